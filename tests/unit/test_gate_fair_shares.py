"""Fair shares for the members of the socket's group, against the real gate in-process.

Connections: each uid other than root holds at most gate.max_clients_per_uid, and the
last gate.clients_reserved_for_root places are root's. Waiters: a client that waits for
an outcome and then goes (closes, or its process dies) is dropped at once. Queue: each
uid other than root has a quota of deliveries not yet done, in number and in bytes; past
it, deliver is refused with 75 and nothing is stored.

The tests run as root (as the test tier does); a group member is this process with its
effective uid set to another for the moment of connect(): SO_PEERCRED records the
effective uid at connect, and the socket (mode 0660, group root) lets it in through the
group it keeps.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness, Peer, connect_as, effective_uid, settled
from volutectl.errors import EX_TEMPFAIL, VoluteError
from volutectl.gate import handlers, loop, server, status
from volutectl.states import QueueState
from volutectl.wire import protocol
from volutectl.wire.messages import PingRequest, Pong

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="connects as other uids: needs root")

MEMBER, OTHER_MEMBER, THIRD_MEMBER = 65534, 65533, 65532


def accepted(harness: Harness, peer: Peer) -> bool:
    return peer.request({"op": "ping"}) == {"v": 1, "ok": True}


def refused(peer: Peer, key: str) -> bool:
    """The gate refused the connection with 75 naming `key`, and closed it."""
    reply = peer.reply()
    peer.harness.pump(peer.closed_by_gate)
    return reply["ok"] is False and reply["code"] == EX_TEMPFAIL and key in reply["error"]


def uids_warned(harness: Harness) -> list[int]:
    return [f["uid"] for level, _, f in harness.journal.entries if "uid" in f]


def open_clients(harness: Harness, uid: int) -> int:
    return sum(1 for client in harness.gate.server.clients.values() if client.uid == uid)


# -- connections ---------------------------------------------------------------------


def test_a_member_gets_its_share_of_connections_and_root_its_reserve(
    harnesses: list[Harness], tmp_path: Path
) -> None:
    harness = Harness(tmp_path, max_clients=6, max_clients_per_uid=2, clients_reserved_for_root=2)
    harnesses.append(harness)
    member = [connect_as(harness, MEMBER) for _ in range(2)]
    assert all(accepted(harness, peer) for peer in member)
    assert refused(connect_as(harness, MEMBER), "gate.max_clients_per_uid")
    assert uids_warned(harness) == [MEMBER]
    # Another member takes its own two: the four places that are not root's are full.
    other = [connect_as(harness, OTHER_MEMBER) for _ in range(2)]
    assert all(accepted(harness, peer) for peer in other)
    assert refused(connect_as(harness, THIRD_MEMBER), "gate.clients_reserved_for_root")
    # Root still gets in, up to gate.max_clients, and is served.
    root = [harness.connect() for _ in range(2)]
    assert all(accepted(harness, peer) for peer in root)
    assert len(harness.gate.server.clients) == 6
    harness.deliver_ok(root[0])
    # A member's connection that ends gives its place back to that member.
    member[0].close()
    harness.pump(lambda: open_clients(harness, MEMBER) == 1)
    assert accepted(harness, connect_as(harness, MEMBER))


def test_volutectls_client_reads_a_refusal_sent_before_its_request(
    harnesses: list[Harness], tmp_path: Path
) -> None:
    """The gate refuses as it accepts, before reading: the request may meet a closed
    socket (EPIPE), and the client must still report the refusal, not a lost gate."""
    harness = Harness(tmp_path, max_clients_per_uid=1)
    harnesses.append(harness)
    assert accepted(harness, connect_as(harness, MEMBER))
    with effective_uid(MEMBER):
        connection = protocol.Connection(str(harness.socket_path), timeout=5)
    harness.pump(lambda: any(MEMBER in f.values() for _, _, f in harness.journal.entries))
    with pytest.raises(VoluteError) as caught:
        connection.request({"v": 1, "op": "ping"}, timeout=5)
    connection.close()
    assert caught.value.exit_code == EX_TEMPFAIL
    assert "gate.max_clients_per_uid" in caught.value.message


# -- waiters that have gone ------------------------------------------------------------


@pytest.fixture
def paused(harnesses: list[Harness], tmp_path: Path) -> Harness:
    harness = Harness(tmp_path, max_clients_per_uid=4, minds={"mimsy": "true", "nap": "true"})
    harnesses.append(harness)
    assert harness.connect().request({"op": "pause", "minds": ["nap"]})["ok"] is True
    return harness


def wait_on(harness: Harness, peer: Peer, delivery_id: int) -> None:
    assert peer.request({"op": "wait", "ids": [delivery_id]}) == {
        "v": 1,
        "ok": True,
        "ids": [delivery_id],
    }


def test_waiters_that_close_are_dropped_at_once_and_their_places_come_back(
    paused: Harness,
) -> None:
    harness = paused
    # The member's own delivery (a client waits for its own only), to a paused mind: its
    # wait never ends by itself.
    first = connect_as(harness, MEMBER)
    held = harness.deliver_ok(first, mind="nap")
    first.close()
    harness.pump(lambda: open_clients(harness, MEMBER) == 0)
    waiters = [connect_as(harness, MEMBER) for _ in range(4)]
    for peer in waiters:
        wait_on(harness, peer, held)
    assert refused(connect_as(harness, MEMBER), "gate.max_clients_per_uid")
    # Gone in each way a client goes: closed with nothing more to say; shut its writing
    # side first (still listening), then closed; reset (unread data on its side).
    waiters[0].close()
    waiters[1].sock.shutdown(socket.SHUT_WR)
    harness.run_for(0.2)
    assert open_clients(harness, MEMBER) == 3  # half-closed, it still waits
    waiters[1].close()
    waiters[2].sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
    waiters[2].close()
    harness.pump(lambda: open_clients(harness, MEMBER) == 1)
    assert len(harness.gate.waiters.by_delivery[held]) == 1
    # No spinning on the ones that went: the gate sleeps until a real deadline.
    steps = harness.steps
    harness.run_for(0.5)
    assert harness.steps - steps <= 6
    again = [connect_as(harness, MEMBER) for _ in range(3)]
    for peer in again:
        wait_on(harness, peer, held)
    # The one that stayed, and the new ones, get the outcome.
    assert harness.connect().request({"op": "resume", "minds": ["nap"]})["ok"] is True
    for peer in [waiters[3], *again]:
        event = peer.reply()
        assert (event["event"], event["id"], event["exit_code"]) == ("turn_ended", held, 0)
    harness.pump(lambda: open_clients(harness, MEMBER) == 4)
    assert held not in harness.gate.waiters.by_delivery


def test_a_deliver_wait_whose_client_died_is_dropped(paused: Harness) -> None:
    harness = paused
    peer = connect_as(harness, MEMBER)
    ack = peer.request({"op": "deliver", "mind": "nap", "message": "m", "wait": True})
    assert ack["ok"] is True
    assert harness.gate.waiters.by_delivery[ack["id"]]
    peer.close()
    harness.pump(lambda: open_clients(harness, MEMBER) == 0)
    assert ack["id"] not in harness.gate.waiters.by_delivery
    assert harness.gate.state.store.row(ack["id"]) is not None  # the delivery stays


# -- the queue quota ----------------------------------------------------------------------


def deliver_as(peer: Peer, message: str = "m", **fields: Any) -> dict[str, Any]:
    return peer.request({"op": "deliver", "mind": "nap", "message": message, **fields})


def rows_of(harness: Harness) -> int:
    store = harness.gate.state.store
    return store.count_rows([QueueState.PENDING, QueueState.RUNNING, QueueState.DEAD])


def test_deliveries_past_a_uids_count_quota_are_refused_and_not_stored(
    harnesses: list[Harness], tmp_path: Path
) -> None:
    harness = Harness(tmp_path, max_pending_per_uid=3, minds={"nap": "true"})
    harnesses.append(harness)
    assert harness.connect().request({"op": "pause", "minds": ["nap"]})["ok"] is True
    member, other = connect_as(harness, MEMBER), connect_as(harness, OTHER_MEMBER)
    request_id = os.urandom(16).hex()
    first = deliver_as(member, request_id=request_id)["id"]
    assert all(deliver_as(member)["ok"] for _ in range(2))
    refusal = deliver_as(member)
    assert (refusal["ok"], refusal["code"]) == (False, EX_TEMPFAIL)
    assert "uid 65534 has 3 deliveries not yet done" in refusal["error"]
    assert "gate.max_pending_per_uid = 3" in refusal["error"]
    assert "nothing was queued" in refusal["hint"]
    assert rows_of(harness) == 3
    # A retry of a stored request is answered with its id, and takes nothing more.
    again = {"v": 1, "ok": True, "id": first, "already_queued": True}
    assert deliver_as(member, request_id=request_id) == again
    # In one batch too: the first two of four fit no more than before.
    member.send(
        b"".join(
            protocol.encode({"v": 1, "op": "deliver", "mind": "nap", "message": "m"})
            for _ in range(2)
        )
    )
    assert [member.reply()["code"] for _ in range(2)] == [EX_TEMPFAIL] * 2
    # Other uids have their own quota; root has none.
    assert all(deliver_as(other)["ok"] for _ in range(3))
    assert all(harness.deliver_ok(mind="nap") for _ in range(5))
    assert rows_of(harness) == 11
    assert uids_warned(harness) == [MEMBER]  # once, not once per refusal
    # Once its deliveries have run, the member may deliver again.
    assert harness.connect().request({"op": "resume", "minds": ["nap"]})["ok"] is True
    harness.pump(lambda: settled(harness))
    assert deliver_as(member)["ok"] is True


def test_the_bytes_quota_counts_messages_and_a_restarted_gate_sums_them_again(
    harnesses: list[Harness], tmp_path: Path
) -> None:
    harness = Harness(tmp_path, max_pending_bytes_per_uid=2500, minds={"nap": "true"})
    harnesses.append(harness)
    assert harness.connect().request({"op": "pause", "minds": ["nap"]})["ok"] is True
    member = connect_as(harness, MEMBER)
    assert deliver_as(member, "x" * 1000)["ok"] and deliver_as(member, "y" * 1000)["ok"]
    refusal = deliver_as(member, "z" * 501)
    assert refusal["code"] == EX_TEMPFAIL and "gate.max_pending_bytes_per_uid" in refusal["error"]
    assert deliver_as(member, "z" * 500)["ok"] is True  # exactly at the quota
    harness.crash()
    harness.restart()
    member = connect_as(harness, MEMBER)
    assert deliver_as(member, "!")["code"] == EX_TEMPFAIL
    assert rows_of(harness) == 3


def test_dead_deliveries_count_until_dropped(harnesses: list[Harness], tmp_path: Path) -> None:
    """Retention never removes a dead row: a uid whose turns fail would fill the disk at
    the pace they die, if dead rows left its quota."""
    harness = Harness(tmp_path, max_pending_per_uid=2, max_attempts=1, minds={"fails": "exit 3"})
    harnesses.append(harness)
    member = connect_as(harness, MEMBER)
    ids = [
        member.request({"op": "deliver", "mind": "fails", "message": "m"})["id"] for _ in range(2)
    ]
    store = harness.gate.state.store
    harness.pump(lambda: all(row.state is QueueState.DEAD for row in store.rows(ids)))
    refusal = member.request({"op": "deliver", "mind": "fails", "message": "m"})
    assert refusal["code"] == EX_TEMPFAIL
    assert harness.connect().request({"op": "drop", "ids": ids})["changed"] == ids
    assert member.request({"op": "deliver", "mind": "fails", "message": "m"})["ok"] is True


# -- time: one pass's budget of requests, and status's questions to systemd -----------

PING = b'{"v":1,"op":"ping"}\n'


def read_all(harness: Harness, clients: int) -> None:
    """Let the server read what the peers sent, without taking any of it."""
    server = harness.gate.server
    for _ in range(200):
        if len(server.backlog) >= clients:
            return
        harness.gate.reactor.wait(0.02)
    raise AssertionError(f"{len(server.backlog)} clients with lines, not {clients}")


def test_a_pass_takes_its_budget_root_first_then_uid_by_uid_and_connection_by_connection(
    harnesses: list[Harness], tmp_path: Path
) -> None:
    harness = Harness(tmp_path)
    harnesses.append(harness)
    flood = [connect_as(harness, MEMBER) for _ in range(3)]
    for peer in flood:
        peer.sock.send(PING * 500)
    other = connect_as(harness, OTHER_MEMBER)
    other.sock.send(PING * 3)
    root = harness.connect()
    root.sock.send(PING)
    harness.pump(lambda: len(harness.gate.server.clients) == 5)
    read_all(harness, 5)
    server = harness.gate.server
    taken = server.take_requests(10)
    assert all(type(request).__name__ == "PingRequest" for _, request in taken)
    uids = [client.uid for client, _ in taken]
    # Root first; then one of each member in turn, until the other member has none left.
    assert uids == [0, MEMBER, OTHER_MEMBER] * 1 + [MEMBER, OTHER_MEMBER] * 2 + [MEMBER] * 3
    flooders = [client.fd for client, _ in taken if client.uid == MEMBER]
    assert len(set(flooders[:3])) == 3  # its three connections in turn
    # The next pass goes on where this one stopped: the member's connections in turn.
    again = [client.fd for client, _ in server.take_requests(3)]
    assert len(set(again)) == 3 and again[0] != flooders[-1]
    # What was taken nowhere near the flood: its lines wait in the clients' buffers.
    assert sum(len(client.buffer) for client in server.clients.values()) >= 1490 * len(PING)


def test_roots_request_is_answered_in_the_pass_it_arrives_despite_a_members_flood(
    harnesses: list[Harness], tmp_path: Path
) -> None:
    harness = Harness(tmp_path, minds={"mimsy": "true"})
    harnesses.append(harness)
    line = b'{"v":1,"op":"status"}\n'
    flood = [connect_as(harness, MEMBER) for _ in range(8)]
    harness.pump(lambda: len(harness.gate.server.clients) == 8)
    for peer in flood:
        peer.sock.send(line * 1024)  # 8 x 1,024 requests, never read
    read_all(harness, 8)
    root = harness.connect()
    root.sock.send(b'{"v":1,"op":"deliver","mind":"mimsy","message":"root\'s"}\n')
    read_all(harness, 9)  # the reactor's wait accepts it, and reads its line
    asks = harness.gate.state.status_asks = status.SystemdAsks(clock=lambda: 1000.0)
    harness.step(0)  # one pass
    assert root.has_line() and "id" in root.reply()
    # That pass answered its share of requests (a budget of them, within a time), not
    # 8 x 1,024; and its statuses shared one question to systemd (the clock stood
    # still: one window).
    answered = sum(peer.sock.recv(1 << 22).count(b"\n") for peer in flood)
    assert 0 < answered <= server.REQUESTS_PER_PASS - 1
    assert asks.asked == 1


def test_statuses_within_the_window_share_one_question_to_systemd(
    harnesses: list[Harness], tmp_path: Path
) -> None:
    harness = Harness(tmp_path, minds={"mimsy": "sleep 5"})
    harnesses.append(harness)
    now = [1000.0]
    asks = status.SystemdAsks(clock=lambda: now[0])
    state = harness.gate.state
    state.status_asks = asks
    peer = harness.connect()
    for _ in range(50):
        assert peer.request({"op": "status"})["ok"] is True
    assert asks.asked == 1
    now[0] += status.ASK_SYSTEMD_EVERY_SECONDS
    assert peer.request({"op": "status"})["ok"] is True
    assert asks.asked == 2
    # A turn the gate starts is shown at once: a change in its own turns asks again.
    delivered = harness.deliver_ok(peer)
    harness.pump(lambda: bool(state.turns.all()))
    shown = peer.request({"op": "status"})["status"]
    assert asks.asked == 3
    assert [turn["mind"] for turn in shown["turns"]] == ["mimsy"], (delivered, shown)
    assert peer.request({"op": "status"})["ok"] is True
    assert asks.asked == 3


def test_a_pass_ends_after_its_time_and_feeds_the_watchdog_between_batches(
    harnesses: list[Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gate's clock is a fake one that each request moves on: a pass's time is the
    # gate's clock's, and a loaded machine's real one would end a pass at a batch's
    # end as readily as within one.
    clock = FakeClock()
    harness = Harness(tmp_path, clock=clock)
    harnesses.append(harness)
    gate = harness.gate

    pinged: list[str] = []
    fed_before: list[int] = []  # for each ping served, the watchdog's pings before it

    def slow_ping(state: object, request: object, caller: object) -> Pong:
        fed_before.append(len(pinged))
        clock.advance(0.005)  # a costly request: 16 of them are a batch of 0.08 s
        return Pong()

    monkeypatch.setitem(handlers.HANDLERS, PingRequest, slow_ping)
    monkeypatch.setattr(loop, "sd_notify", pinged.append)
    flood = [connect_as(harness, MEMBER) for _ in range(4)]
    harness.pump(lambda: len(gate.server.clients) == 4)
    for peer in flood:
        peer.sock.send(PING * 100)
    read_all(harness, 4)
    gate.watchdog, gate.next_ping = 10.0, clock.monotonic()  # a ping is due
    started = clock.monotonic()
    harness.step(0)
    took = clock.monotonic() - started
    answered = sum(peer.sock.recv(1 << 20).count(b"\n") for peer in flood)
    # No request began after PASS_SECONDS: some 40 pings, not the 400 (2 s).
    assert loop.REQUEST_BATCH < answered <= loop.PASS_SECONDS / 0.005 + 1, answered
    assert took <= loop.PASS_SECONDS + 0.005 * 1.5, took
    # The watchdog was fed after the first batch, before the next: within the pass.
    assert pinged[0] == "WATCHDOG=1"
    assert fed_before[0] == 0 and fed_before[-1] >= 1
    # The requests taken but not begun are the next pass's first.
    assert 0 < len(gate.serving.left) < loop.REQUEST_BATCH
    harness.step(0)
    assert sum(peer.sock.recv(1 << 20).count(b"\n") for peer in flood) > len(gate.serving.left)
    harness.pump(lambda: len(fed_before) == 400)


def test_a_uids_lines_still_arriving_hold_at_most_their_share_then_75_and_the_rest_unread(
    harnesses: list[Harness], tmp_path: Path
) -> None:
    harness = Harness(tmp_path)
    harnesses.append(harness)
    start = b'{"v":1,"op":"deliver","mind":"mimsy","message":"'
    chunk = start + b"x" * (7 << 20)  # 7 MiB of one line, its end not sent yet
    peers = [connect_as(harness, MEMBER) for _ in range(5)]
    for peer in peers[:4]:  # 28 MiB: within the share
        peer.send(chunk)
    server_side = harness.gate.server.clients.values
    harness.pump(lambda: sum(client.partial for client in server_side()) == 4 * len(chunk))
    assert not any(peer.has_line() for peer in peers[:4])
    peers[4].send(chunk)  # 35 MiB: past it
    reply = peers[4].reply()
    assert reply["code"] == EX_TEMPFAIL and reply["error"].startswith(f"uid {MEMBER} has ")
    assert str(server.MAX_PARTIAL_BYTES_PER_UID) in reply["error"]
    # What it held is let go, what follows of that line is dropped unread, and the
    # connection goes on with its next line.
    assert sum(client.partial for client in server_side()) == 4 * len(chunk)
    peers[4].send(b"x" * (1 << 20) + b'"}\n{"v":1,"op":"ping"}\n')
    assert peers[4].reply() == {"v": 1, "ok": True}
    # Root is no party to it; and the others' lines, once whole, are answered.
    assert accepted(harness, harness.connect())
    peers[0].send(b'"}\n')
    assert peers[0].reply()["code"] == 65  # over gate.max_message_bytes: it was 7 MiB
