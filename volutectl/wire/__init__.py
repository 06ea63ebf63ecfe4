"""What crosses a socket: the gate's protocol and the launcher's orders.

- `messages`: every request, reply and event, typed; `records` and `fields` decode them.
- `protocol`: the framing (one JSON line each way) and the client's connect and retry.
- `orders`: the typed orders the gate sends its root launcher, and their replies.

Light on purpose: `volutectl deliver` imports messages and protocol. Nothing here
imports the gate, the store or systemd.
"""
