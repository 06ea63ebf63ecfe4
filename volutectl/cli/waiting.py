"""Waiting for deliveries to settle, through gate restarts: `volutectl wait`, and
`volutectl deliver --wait` after its ack.

The gate tells a waiting connection once each delivery settles (docs/protocol.md's
events). A gate restart ends every connection with EOF; the socket is systemd's, so a
new connection waits in its backlog for the next gate. So on a lost connection this
connects again and sends `wait` for the deliveries not yet settled; one that settled
meanwhile is told at once. Light, like volutectl/cli/deliver.py: deliver imports it.
"""

from __future__ import annotations

import sys

from volutectl.errors import EX_TEMPFAIL, VoluteError
from volutectl.states import Outcome
from volutectl.wire import messages, protocol
from volutectl.wire.messages import DeliveryDead, Event, TurnEnded, WaitReply, WaitRequest

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: deliver's hot path loads this module
if TYPE_CHECKING:
    from collections.abc import Callable


def settle(
    path: str,
    ids: tuple[int, ...],
    timeout: float,
    connection: protocol.Connection | None = None,
    on_event: Callable[[Event], object] | None = None,
) -> dict[int, Event]:
    """Wait until every delivery of `ids` has settled; its event by id.

    `connection`, if given, is one on which the gate already waits for them (deliver's,
    after a `wait: true` ack); else this sends `wait`. Each time the connection is lost,
    the gate has `timeout` seconds to answer a new one. A first connection that finds no
    gate fails at once (69), as deliver's does; running out of time is 75; an id the gate
    does not know is its refusal (65). `on_event` hears each event as it comes. Closes
    every connection it uses.
    """
    left = list(dict.fromkeys(ids))
    events: dict[int, Event] = {}
    lost: protocol.ConnectionLost | None = None
    while left:
        if connection is None:
            connection = _connect(path, tuple(left), timeout, lost)
        try:
            while left:
                event = messages.decode_event(connection.receive(timeout=None))
                if event.id in left:
                    left.remove(event.id)
                    events[event.id] = event
                    if on_event is not None:
                        on_event(event)
        except protocol.ConnectionLost as error:
            lost = error
        finally:
            connection.close()
            connection = None
    return events


def _connect(
    path: str, ids: tuple[int, ...], timeout: float, lost: protocol.ConnectionLost | None
) -> protocol.Connection:
    """A connection on which the gate has taken `wait` for `ids`, retrying for `timeout`
    seconds after a lost one (the gate is restarting)."""
    connection, _ = protocol.request_through_restarts(
        path,
        WaitRequest(ids).to_wire(),
        lambda reply: messages.expect(WaitReply, reply),
        timeout,
        lambda last: _out_of_time(ids, last),
        lost,
    )
    return connection


def _out_of_time(ids: tuple[int, ...], lost: protocol.ConnectionLost | None) -> VoluteError:
    why = f" (last: {lost.message})" if lost is not None else ""
    shown = " ".join(map(str, ids))
    return VoluteError(
        f"lost the gate while waiting for {shown}, and it did not answer again in time{why}",
        hint=f"the deliveries go on regardless; wait again with: volutectl wait {shown}",
        exit_code=EX_TEMPFAIL,
    )


def exit_code(ids: tuple[int, ...], events: dict[int, Event]) -> int:
    """0 if every delivery was done by a turn that exited 0; else the exit code of the
    first one, in the order given, that was not (its turn's, 124 for a time limit, 1 if
    it was dropped or its turn could not start)."""
    for delivery_id in ids:
        code = _code(events[delivery_id])
        if code != 0:
            return code
    return 0


def _code(event: Event) -> int:
    if isinstance(event, TurnEnded | DeliveryDead):
        return event.exit_code
    return 1  # dropped


def report(event: Event) -> None:
    """Say on stderr how a delivery ended, unless it went well."""
    if isinstance(event, TurnEnded):
        if event.outcome is not Outcome.OK:
            print(
                f"volutectl: delivery {event.id}: turn {event.turn_id} {event.outcome}: "
                f"exit status {event.exit_status}",
                file=sys.stderr,
            )
    elif isinstance(event, DeliveryDead):
        how = f" after turn {event.turn_id} {event.outcome}" if event.turn_id else ""
        print(f"volutectl: delivery {event.id} is dead{how}: {event.error}", file=sys.stderr)
    else:
        print(f"volutectl: delivery {event.id} was dropped", file=sys.stderr)
