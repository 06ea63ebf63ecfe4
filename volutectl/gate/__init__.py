"""The gate daemon: the loop that admits deliveries and starts turns.

- `loop`: `Gate`, the event loop and its step.
- `server` (clients on the socket), `handlers` (one per request), `validate` (a request
  against the settings), `status` (the status reply).
- `turns` (starting and settling turns), `liveness` (what systemd says runs),
  `pressure` (the PSI watch).

Imports the layers below (launcher, slots, store, wire, systemd, config, kernel, core).
Nothing imports the gate but the CLI.
"""
