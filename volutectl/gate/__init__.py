"""The gate daemon: the loop that admits deliveries and starts turns.

- `loop`: `Gate`, built whole from the settings; one pass (`step`) takes in requests,
  learns which turns ended, runs admission and carries out its decisions.
- `reactor`: the one event loop's parts: file descriptors and deadlines, registered
  with their callbacks, on one monotonic clock.
- `server` (clients on the socket), `serving` (a pass's requests, deliveries' group
  commit), `handlers` (one per request type), `validate` (a request against the
  settings and the disk), `status` (the status reply, a pure read), `state`
  (`GateState`, what handlers see), `outcomes` (who waits for which delivery, and the
  one event a settled delivery tells).
- `lifecycle` (a turn's states and transitions, pure), `turns` (starting, folding into
  and settling turns: carrying out the lifecycle's effects), `liveness` (systemd's
  evidence, turned into lifecycle events), `pressure` (the PSI watch).

Imports the layers below (launcher, slots, store, wire, systemd, config, kernel, core,
the leaves). Nothing imports the gate but the CLI.
"""
