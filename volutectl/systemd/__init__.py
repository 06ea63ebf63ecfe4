"""systemd, behind one port.

- `port`: `SystemdManager`, the Protocol the gate and the launcher program against, and
  its value types. It knows nothing of pystemd.
- `adapter`: `Manager`, the one implementation, over pystemd (the only module that
  imports it).
- `journal`: structured entries and turn streams; `activation`: sockets systemd passes.
"""
