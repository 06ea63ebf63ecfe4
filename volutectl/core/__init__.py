"""Pure cores: the decisions, with no I/O, no clock and no imports beyond the leaves.

- `admission`: which deliveries start now (`admit`), from the queue, the live turns and
  the limits.
- `slotmath`: a test run's cap and its wait line, from slot states and history.
- `adaptive`: the adaptive limit's rules: how many turns may run, from the probe and PSI.
- `iocost`: what one turn of each mind costs against that limit, from what it wrote.
- `psi`: PSI trigger lines, the stalled share of an interval, and the hysteresis.
- `shares`: whose requests one pass of the gate takes: in turns between uids, then connections.
- `pidmoves`: whether the launcher may move a process into a lease's scope, and where it
  goes back to.

Each module is the package's surface: import it by name. Nothing is re-exported here.
"""
