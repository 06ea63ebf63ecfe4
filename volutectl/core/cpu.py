"""The pure part of the CPU signal: how many turns at once the CPUs bear, learnt from
PSI's `cpu` stall, a second signal beside the storage's (core/adaptive.py).

The storage's limit counts IO costs (core/iocost.py): a mind known to write little costs
a sliver of a place, so a warm gate lets a whole fan-out of such minds in at once. When
those turns are CPU-bound (an agent SDK starting up is, for seconds), they queue for the
cores, and so does everything else on the host: the probe, sshd, journald. What they
cost is not what they write. So the CPUs get a limit of their own, on turns at once
whatever they write (`bound`), read from `cpu.pressure`'s `some total=` over each
interval (the share of it in which some task of the turns' slice, or of the system,
waited for a CPU):

- **distress** (at least `STALL_DISTRESS` of the interval stalled) while more turns run
  than the floor, `STRAINED_AFTER` readings in a row: the limit drops to `BACK_OFF` of
  the turns that ran. One reading is not enough: a fan-out's turns start at once, and
  their wrappers' and interpreters' start-up stalls the CPUs for a moment even when the
  turns then wait on the network; CPU-bound turns (an agent SDK starting up) stall
  them for seconds;
- **healthy** (below `STALL_HEALTHY`) `GROW_AFTER` readings in a row, while deliveries
  wait at it and the turns running fill it: before any distress, it grows to what the
  CPUs hold at what each turn used (`room`), or doubles when that use is not known;
  after one, it doubles from under the limit of that distress only up to one below
  it, and by one from there, and never past the room. One healthy reading is enough
  when it says what each turn used (`measured`): the slice's CPU time per second that
  a turn ran (not per interval: a turn that started half-way through it would read as
  half as busy), over turns that filled the limit for at least half the interval. Two
  readings of PSI alone are what a cold fan-out of turns that wait on the network
  paid, 0.5 s of starting nothing (the eMMC and unthrottled network cells at 16 minds,
  1.25x cap 16's makespan; docs/benchmarks.md); the use per turn-second tells such a
  turn from a burner in one;
- what PSI cannot see is use: with exactly as many CPU-bound turns as CPUs nothing
  waits for a CPU, the readings are calm, and a doubling lets in turns that then all
  wait (the SD card's cpu cell: 3 burners on 2 cores, the probe at 50-84 ms). So a
  reading also carries the CPU time the turns' slice used over the interval (its
  `cpu.stat`, in CPUs) and the time the turns ran in it (turn-seconds), and the limit
  grows only to as many turns as the CPUs hold at the CPU each running turn used per
  second it ran (`room`: the USE method's utilisation beside PSI's saturation). Turns
  that wait on the network use almost none: the room is the maximum, and the limit
  goes there at once instead of doubling at every other reading (2, 4, 8, 16 took 3 s
  of an unthrottled disk's mixed fan-out of 33, which cap 16 finished in 13 s);
  turns that keep a CPU busy each hold it at the CPUs. Without the slice's `cpu.stat`
  (no cgroup v2) it doubles as PSI alone says;
- in between, or with nothing waiting: it stays.

It never goes below `floor`: the larger of the storage limit's minimum and the number
of CPUs (capped at the maximum). As many CPU-bound turns as cores is what a static cap
of that size would run, and what the bench's bound is measured against.

A gate that starts knows nothing of the CPUs: it starts at the floor (`initial`), one
turn per CPU, and grows from there as above: two calm readings with deliveries waiting
at it take it to the room the turns leave, one when it measured what they used.

Unlike the storage's limit, it is kept while the gate is idle: the cores a host has do
not change with the mix, and a second fan-out of the same CPU-bound minds (a warm gate)
must not start all at once again. A fan-out of turns that use no CPU grows it back to
the maximum within one reading.

No I/O and no clock here: volutectl/gate/cpu.py reads the file and gives the readings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

STALL_HEALTHY = 0.20  # below: the CPUs keep up
STALL_DISTRESS = 0.50  # at or over: tasks of the turns wait for a CPU half the time
BACK_OFF = 0.7  # on distress, the limit becomes this share of the turns that ran
GROW_AFTER = 2  # healthy readings in a row before the limit grows
STRAINED_AFTER = 2  # distressed readings in a row before it drops


@dataclass(frozen=True)
class CpuReading:
    """What one interval measured of the CPUs."""

    stalled: float | None  # PSI cpu `some`: the share of the interval stalled, 0..1
    running: int  # the most turns that ran during the interval
    waiting: int  # deliveries waiting (held by a limit)
    used: float | None = None  # CPUs the turns' slice used over the interval (None: unknown)
    cpus: int = 1  # the CPUs there are
    seconds: float = 0.0  # the interval's length
    turn_seconds: float = 0.0  # the time the turns ran in it, summed over them

    def busy(self) -> float | None:
        """The CPU each turn used per second it ran (None: not known, or no turn ran)."""
        if self.used is None or self.turn_seconds <= 0:
            return None
        return self.used * self.seconds / self.turn_seconds


@dataclass(frozen=True)
class CpuLimit:
    """The most turns at once the CPUs bear, and what the rule has learnt."""

    limit: int
    healthy: int = 0  # healthy readings in a row
    strained: int = 0  # distressed readings in a row
    distressed_at: int | None = None  # turns running at the last distress


def floor_of(minimum: int, maximum: int, cpus: int) -> int:
    """The lowest the CPU limit goes: one turn per CPU, within [minimum, maximum]."""
    return max(minimum, min(maximum, cpus))


def initial(floor: int, maximum: int) -> CpuLimit:
    """A gate that starts: nothing learnt of the CPUs yet, so the floor (one turn per
    CPU), which calm readings grow from as any growth. A cold gate at the maximum let
    a CPU-bound fan-out in as fast as the storage's limit did: turns that write nothing
    cost a sixteenth of a place once sampled, so 7 to 10 CPU-bound turns ran at once on
    2 cores before two stalled readings brought the bound down, and the probe waited for
    the cores. Two per CPU was tried and did not bring the probe's p99 down; one per CPU
    did (issue 32: the cpu cells at 33 minds, docs/benchmarks.md). Turns that use no CPU
    find it at the maximum within one reading while deliveries wait at it."""
    return CpuLimit(limit=min(maximum, floor))


def grown(state: CpuLimit, reading: CpuReading, maximum: int) -> int:
    """The limit a growth gives: before any distress, as far as the CPUs hold at what
    each turn used (`room`) when that is known, else double; after one, double up to
    one below the distress and by one from there, never past the room."""
    if state.distressed_at is None:
        known = reading.busy() is not None
        return room(reading, maximum) if known else min(maximum, state.limit * 2)
    below = max(1, state.distressed_at - 1)
    new = min(state.limit * 2, below) if state.limit < below else state.limit + 1
    return min(new, room(reading, maximum))


def room(reading: CpuReading, maximum: int) -> int:
    """The most turns the CPUs hold at the CPU each running turn used per second it ran
    (`maximum` when that is not known, or next to none)."""
    busy = reading.busy()
    if busy is None or busy <= 0:
        return maximum
    return min(maximum, int(reading.cpus / busy))


def measured(state: CpuLimit, reading: CpuReading) -> bool:
    """Whether the reading says what each turn uses: the slice's CPU time was read, and
    the turns filling the limit ran for at least half the interval (a few turn-seconds,
    such as turns that started just before it ended, say next to nothing)."""
    return reading.busy() is not None and reading.turn_seconds >= state.limit * reading.seconds / 2


def step(
    state: CpuLimit, reading: CpuReading, floor: int, maximum: int
) -> tuple[CpuLimit, str | None]:
    """One interval: the new CPU limit, and why it moved (None: it did not)."""
    if reading.stalled is None:
        return state, None
    share = f"cpu {reading.stalled * 100:.0f}% stalled with {reading.running} running"
    if reading.used is not None:
        share += f" using {reading.used:.1f} of {reading.cpus} CPUs"
    busy = reading.busy()
    if busy is not None:
        share += f", {busy:.2f} per turn"
    if reading.stalled >= STALL_DISTRESS and reading.running > floor:
        state = replace(state, healthy=0, strained=state.strained + 1)
        if state.strained < STRAINED_AFTER:
            return state, None
        new = max(floor, min(state.limit, int(reading.running * BACK_OFF)))
        moved = replace(state, limit=new, distressed_at=reading.running)
        return moved, f"{share}: over {STALL_DISTRESS * 100:.0f}%" if new != state.limit else None
    if reading.stalled >= STALL_HEALTHY:
        return replace(state, healthy=0, strained=0), None
    state = replace(state, healthy=state.healthy + 1, strained=0)
    filled = reading.running >= state.limit
    if state.limit >= maximum or not reading.waiting or not filled:
        return state, None
    if state.healthy < GROW_AFTER and not measured(state, reading):
        return state, None
    new = max(floor, grown(state, reading, maximum))
    if new <= state.limit:
        return state, None
    return replace(state, limit=new, healthy=0), f"{share}: healthy, {reading.waiting} waiting"


def clamp(state: CpuLimit, floor: int, maximum: int) -> CpuLimit:
    """The limit within new bounds (a reload moved them)."""
    return replace(state, limit=max(floor, min(maximum, state.limit)))
