"""Starting turns: everything done as root, and the checks that a turn can start.

- `hands`: `TurnHands`, the port the gate gives its orders through: `LocalHands` does
  them here, `RemoteHands` sends them to volute-launcher.service.
- `service`: the launcher's server (volute-launcher.service), which runs `LocalHands`.
- `fork` (a turn's process, released into its scope), `turndir` (its directory, by
  descriptor), `envfile` (a mind's secrets), `home` (a mind's own working directory),
  `preflight` (will a mind's turns start?).
- `moves`: a lease's processes moved into its scope and back, after the launcher's own
  checks.
- `turn-wrapper.sh`: the scope's main process.
"""
