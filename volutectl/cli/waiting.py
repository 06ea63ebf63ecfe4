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
import time

from volutectl.durations import format_duration
from volutectl.errors import EX_TEMPFAIL, VoluteError
from volutectl.states import Outcome
from volutectl.visible import visible
from volutectl.wire import messages, protocol
from volutectl.wire.messages import (
    AttemptFailed,
    DeliveryDead,
    Event,
    TurnEnded,
    WaitReply,
    WaitRequest,
)

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: deliver's hot path loads this module
if TYPE_CHECKING:
    from collections.abc import Callable


def settle(
    path: str,
    ids: tuple[int, ...],
    timeout: float,
    connection: protocol.Connection | None = None,
    on_event: Callable[[Event], object] | None = None,
    *,
    max_wait: float | None = None,
    on_attempt: Callable[[AttemptFailed], object] | None = None,
) -> dict[int, Event]:
    """Wait until every delivery of `ids` has settled; its event by id.

    `connection`, if given, is one on which the gate already waits for them (deliver's,
    after a `wait: true` ack); else this sends `wait`. Each time the connection is lost,
    the gate has `timeout` seconds to answer a new one. A first connection that finds no
    gate fails at once (69), as deliver's does; running out of time is 75; an id the gate
    does not know is its refusal (65). `on_event` hears each event as it comes, and
    `on_attempt` each failed attempt that will be tried again (asked of the gate as
    `progress`; deliver asks it in its own request). After `max_wait` seconds in all
    this gives up (75), naming the ids still unsettled; the deliveries go on. Closes
    every connection it uses.
    """
    left = list(dict.fromkeys(ids))
    events: dict[int, Event] = {}
    lost: protocol.ConnectionLost | None = None
    deadline = None if max_wait is None else time.monotonic() + max_wait
    progress = on_attempt is not None
    while left:
        try:
            if connection is None:
                connection = _connect(path, tuple(left), timeout, lost, deadline, progress)
            while left:
                event = messages.decode_event(connection.receive(timeout=_remaining(deadline)))
                if isinstance(event, AttemptFailed):
                    if on_attempt is not None and event.id in left:
                        on_attempt(event)
                elif event.id in left:
                    left.remove(event.id)
                    events[event.id] = event
                    if on_event is not None:
                        on_event(event)
        except protocol.ConnectionLost as error:
            lost = error
        except VoluteError:
            if deadline is not None and time.monotonic() >= deadline:
                raise _gave_up(tuple(left), max_wait or 0.0) from None
            raise
        finally:
            if connection is not None:
                connection.close()
            connection = None
    return events


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(0.001, deadline - time.monotonic())


def _gave_up(ids: tuple[int, ...], max_wait: float) -> VoluteError:
    shown = " ".join(map(str, ids))
    return VoluteError(
        f"stopped waiting for {shown} after {format_duration(max_wait)} (--max-wait); "
        "not settled yet",
        hint=f"nothing was changed and the deliveries go on; wait again with: "
        f"volutectl wait {shown}",
        exit_code=EX_TEMPFAIL,
    )


def _connect(
    path: str,
    ids: tuple[int, ...],
    timeout: float,
    lost: protocol.ConnectionLost | None,
    deadline: float | None = None,
    progress: bool = False,
) -> protocol.Connection:
    """A connection on which the gate has taken `wait` for `ids`, retrying for `timeout`
    seconds (no longer than until `deadline`) after a lost one (the gate is restarting)."""
    if deadline is not None:
        timeout = max(0.001, min(timeout, deadline - time.monotonic()))
    connection, _ = protocol.request_through_restarts(
        path,
        WaitRequest(ids, progress).to_wire(),
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
        error = visible(event.error)  # a turn's or the launcher's words: shown, not obeyed
        print(f"volutectl: delivery {event.id} is dead{how}: {error}", file=sys.stderr)
    else:
        print(f"volutectl: delivery {event.id} was dropped", file=sys.stderr)


def report_attempt(attempt: AttemptFailed, now: float | None = None) -> None:
    """Say on stderr that an attempt failed and when the next one comes."""
    print(f"volutectl: {visible(describe_attempt(attempt, now))}", file=sys.stderr, flush=True)


def describe_attempt(attempt: AttemptFailed, now: float | None = None) -> str:
    """`delivery 3: attempt 2 of 10 failed: turn 7 exited 3 (exit status 3); next try at
    20:41:07, in 10.0s`: the turn, how it ended, the count, and when it goes again."""
    now = time.time() if now is None else now
    how = attempt.error
    if attempt.exit_status is not None:
        how += f" ({_exit_words(attempt.exit_status)})"
    at = time.strftime("%H:%M:%S", time.localtime(attempt.next_try_at))
    return (
        f"delivery {attempt.id}: attempt {attempt.attempt} of {attempt.max_attempts} "
        f"failed: {how}; next try at {at}, in {format_duration(attempt.next_try_at - now)}"
    )


def _exit_words(status: int) -> str:
    if status > 128:
        import signal  # only on this rare path: deliver's hot path does not pay for it

        try:
            name = signal.Signals(status - 128).name
        except ValueError:
            return f"exit status {status}"
        return f"exit status {status}: killed by {name}, or exited {status}"
    return f"exit status {status}"
