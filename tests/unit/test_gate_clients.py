"""Clients that hold on: idle ones, ones that never read, more than gate.max_clients.

The gate runs in-process (tests/unit/gate_harness.py), so the test sees its select()
timeout and counts its steps: the gate must neither poll nor spin while it waits.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness
from volutectl import events
from volutectl.errors import EX_TEMPFAIL
from volutectl.gate import server, status
from volutectl.store import indexed
from volutectl.wire import protocol
from volutectl.wire.messages import StatusReply

IDLE = 0.3


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    opened = Harness(
        tmp_path,
        client_idle_seconds=IDLE,
        max_clients=3,
        clients_reserved_for_root=1,
        minds={"mimsy": "true", "slow": "sleep 1.2"},
        clock=FakeClock(),
    )
    yield opened
    opened.close()


def until_closed(harness: Harness, peer_closed: object) -> float:
    """Move the gate's clock on, 50 ms at a time, until the predicate holds; the seconds
    of the gate's clock it took."""
    started = harness.clock.monotonic()
    while not peer_closed():  # type: ignore[operator]
        took = harness.clock.monotonic() - started
        assert took < 5, "the gate never closed the connection"
        harness.advance(0.05)
    return harness.clock.monotonic() - started


@pytest.mark.serial
def test_a_partial_line_that_never_ends_is_dropped_after_the_idle_time(harness: Harness) -> None:
    # No client: once its first pass is made and its start's commits checkpointed, the
    # gate sleeps until retention's deadline, days away (an empty queue).
    harness.advance(indexed.CHECKPOINT_QUIET_SECONDS + 0.3)
    assert (harness.gate.timeout() or 0) > 6 * 86400
    peer = harness.connect()
    peer.send(b'{"v":1,"op":"pi')
    harness.pump(lambda: bool(harness.gate.server.clients))  # accepted
    harness.step(0.01)  # and the partial line read
    # The idle deadline is what select() sleeps until, not a polling tick.
    # (The fake clock's readings are sums of floats: a deadline IDLE on may read a few
    # ulps past it.)
    timeout = harness.gate.timeout()
    assert timeout is not None and 0 < timeout <= IDLE + 1e-9
    steps = harness.steps
    harness.advance(timeout * 0.9)
    assert not peer.closed_by_gate()
    harness.advance(timeout * 0.1)  # at its idle deadline, not a tick later
    assert peer.closed_by_gate()
    assert harness.steps - steps <= 8  # a few wake-ups, never a busy loop
    reply = peer.reply()
    assert reply["code"] == EX_TEMPFAIL
    assert reply["error"] == f"no complete request in {IDLE:g} s: closing the connection"
    assert harness.gate.server.clients == {} and harness.gate.server.idle == {}
    assert (harness.gate.timeout() or 0) > 6 * 86400
    harness.deliver_ok()


@pytest.mark.serial
def test_a_client_that_connects_and_sends_nothing_is_dropped_too(harness: Harness) -> None:
    peer = harness.connect()
    took = until_closed(harness, peer.closed_by_gate)
    assert took <= IDLE + 0.05
    # It asked nothing, so it is told nothing: the connection just ends (EOF). A line it
    # never asked for would be a reply out of nowhere to a client between requests.
    assert peer.buffer == b""


def test_a_trickle_that_never_completes_a_line_is_still_dropped(harness: Harness) -> None:
    peer = harness.connect()
    started = harness.clock.monotonic()
    for byte in b'{"v":1,"op":"ping","padding":"' + b"x" * 100:
        if peer.closed_by_gate():
            break
        try:
            peer.sock.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
        harness.advance(0.05)  # one byte every 50 ms: always active, never complete
    assert peer.closed_by_gate()
    assert harness.clock.monotonic() - started <= IDLE + 0.1


def test_a_client_that_sends_a_line_now_and_then_stays(harness: Harness) -> None:
    peer = harness.connect()
    for _ in range(4):
        harness.advance(IDLE * 0.6)
        assert peer.request({"op": "ping"}) == {"v": 1, "ok": True}
    assert not peer.closed_by_gate()


def test_a_client_waiting_for_its_turn_is_not_idle(harness: Harness) -> None:
    peer = harness.connect()
    ack = peer.request({"op": "deliver", "mind": "slow", "message": "m", "wait": True})
    assert ack["ok"] is True
    assert harness.gate.server.idle == {}  # no idle deadline while it waits
    harness.advance(IDLE * 3)  # it outlives the idle time, waiting
    assert not peer.closed_by_gate()
    harness.pump(peer.has_line, timeout=15)
    event = peer.reply()
    assert (event["event"], event["id"], event["exit_code"]) == ("turn_ended", ack["id"], 0)
    # Its wait is over: from now on it is a client like any other.
    assert list(harness.gate.server.idle.values())[0].fd in harness.gate.server.clients
    until_closed(harness, peer.closed_by_gate)


@pytest.fixture
def patient_harness(tmp_path: Path) -> Iterator[Harness]:
    """The harness, with clients idle for 10 s before they are dropped: a flood's drop
    takes passes enough (REQUESTS_PER_PASS each) that IDLE's reader would go first."""
    opened = Harness(tmp_path, client_idle_seconds=10.0, minds={"mimsy": "true"})
    yield opened
    opened.close()


@pytest.mark.serial
def test_a_client_that_never_reads_is_dropped_without_blocking_the_gate(
    patient_harness: Harness,
) -> None:
    harness = patient_harness
    reader = harness.connect()
    assert reader.request({"op": "ping"}) == {"v": 1, "ok": True}
    flood = harness.connect()
    # Accepted before it floods: else the pump below may return at once (only the reader
    # accepted yet), and the flood, read from the last pump on, is never dropped.
    harness.pump(lambda: len(harness.gate.server.clients) == 2)
    request = b'{"v":1,"op":"status"}\n'
    reply = StatusReply(status.build(harness.gate.state))
    reply_size = len(protocol.encode(reply.to_wire()))
    # Eight times what the gate will queue: the kernel takes a large write whole, and the
    # gate answers server.REQUESTS_PER_PASS requests a pass, so the queue grows slowly.
    count = 8 * server.MAX_OUTBOX // reply_size + 1000
    started = time.monotonic()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        flood.send(request * count)  # and it never reads a single reply
    harness.pump(lambda: len(harness.gate.server.clients) == 1)  # only the reader is left
    assert reader.request({"op": "ping"}) == {"v": 1, "ok": True}
    assert time.monotonic() - started < 10
    harness.deliver_ok(reader)
    # What the flood finds when it finally reads: some replies, then the end. The gate
    # is stepped meanwhile, though the pump above saw it dropped: a loop that only sleeps
    # would wait for ever on a gate that is not stepped.
    harness.pump(flood.closed_by_gate)
    assert 0 < flood.buffer.count(b"\n") < count


def test_clients_beyond_max_clients_wait_unaccepted_and_are_served_when_one_leaves(
    harness: Harness,
) -> None:
    first = [harness.connect() for _ in range(3)]
    for peer in first:
        assert peer.request({"op": "ping"}) == {"v": 1, "ok": True}
    late = harness.connect()  # connect() succeeds: it waits in the listen backlog
    late.send(b'{"v":1,"op":"ping"}\n')
    harness.advance(0.2)
    assert not late.has_line()
    assert len(harness.gate.server.clients) == 3 and not harness.gate.server.accepting
    # At the cap the listener is out of the selector: its waiting client makes nothing
    # ready, and nothing spins. (Only the listener's readiness is asked about: the
    # adaptive limit's probe, whose thread says it is done through a pipe, may be ready
    # at any moment, and the next step reads it.)
    listener = harness.gate.server.listener.fileno()
    assert listener not in harness.gate.reactor.selector.get_map()
    ready = harness.gate.reactor.selector.select(0)
    assert [key for key, _ in ready if key.fd == listener] == []
    at_cap = harness.journal.of(events.NotAccepting)
    assert any(e.clients == 3 and "gate.max_clients" in e.reason for e in at_cap)
    first[0].close()
    late_reply = late.reply(timeout=5)
    assert late_reply == {"v": 1, "ok": True}
    assert harness.gate.server.accepting is False  # three again: the late one took the place
    first[1].close()
    harness.deliver_ok()


def test_pipelined_requests_are_answered_in_their_order(harness: Harness) -> None:
    peer = harness.connect()
    lines = [
        b'{"v":1,"op":"deliver","mind":"mimsy","message":"one"}',
        b'{"v":1,"op":"ping"}',
        b"not json",
        b'{"v":1,"op":"deliver","mind":"ghost","message":"two"}',
        b'{"v":1,"op":"queue","states":["pending","running","done"]}',
    ]
    peer.send(b"\n".join(lines) + b"\n")  # one write: the gate reads them in one pass
    replies = [peer.reply() for _ in lines]
    assert "id" in replies[0]
    assert replies[1] == {"v": 1, "ok": True}
    assert replies[2]["code"] == 76 and replies[3]["code"] == 67
    assert [row["id"] for row in replies[4]["rows"]] == [replies[0]["id"]]


def test_a_waiting_client_that_shuts_its_side_still_gets_its_outcome(harness: Harness) -> None:
    peer = harness.connect()
    peer.send(b'{"v":1,"op":"deliver","mind":"mimsy","message":"m","wait":true}\n')
    peer.sock.shutdown(socket.SHUT_WR)  # asks nothing more, but waits
    ack = peer.reply()
    ended = peer.reply(timeout=10)
    assert (ended["event"], ended["id"]) == ("turn_ended", ack["id"])
    harness.pump(peer.closed_by_gate)  # and then the gate closes it
    assert harness.gate.server.clients == {}
