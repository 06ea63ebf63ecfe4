"""Deliveries that keep coming share commits (volutectl/gate/serving.py's Commit, the
loop's `gather_until`): after a commit of deliveries, requests of other clients wait a
while (GATHER_SHARE times as long as such a commit takes, at most GATHER_MAX) before the
next commit,
so a burst of `deliver` on a slow disk costs it fewer fsyncs; the client whose delivery
was just committed, alone, is served at once.

The real gate on a real SQLite file, on a FakeClock that the store's commit moves: a
commit takes the time the test gives the disk.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness, Peer, settled
from volutectl import events
from volutectl.errors import VoluteError
from volutectl.gate.serving import GATHER_MAX, GATHER_SHARE, Commit
from volutectl.states import QueueState
from volutectl.store.rows import NewDelivery

MINDS = {"a": "true", "b": "true", "c": "true"}


class SlowDisk:
    """The store's durable commits (those with an fsync: SQLite's synchronous=FULL),
    each taking `seconds` of the gate's clock; how many rows each commit of deliveries
    held. The deliveries' own commit has no fsync: the pass's durable commit (its
    starts', or the sync before the gate sleeps) makes them durable, and only then are
    they acknowledged."""

    def __init__(self, harness: Harness, clock: FakeClock, seconds: float) -> None:
        self.seconds = seconds
        self.commits: list[int] = []
        self.syncs = 0  # durable commits that went through
        self.failing = False  # a durable commit fails, as a disk's EIO on fsync
        store = harness.gate.state.store
        add = store.add_deliveries
        store.db = _SlowConnection(store.db, clock, self)  # type: ignore[assignment]

        def counted(
            items: Iterable[NewDelivery],
            now: float | None = None,
            *,
            refuse: Callable[[NewDelivery], VoluteError | None] | None = None,
            durable: bool = True,
        ) -> list[int | VoluteError]:
            rows = list(items)
            self.commits.append(len(rows))
            return add(rows, now, refuse=refuse, durable=durable)

        store.add_deliveries = counted  # type: ignore[method-assign]


class _SlowConnection:
    """A sqlite3 connection whose COMMIT under synchronous=FULL (an fsync) moves the
    clock by the disk's `seconds`; the rest passes through."""

    def __init__(self, db: sqlite3.Connection, clock: FakeClock, disk: SlowDisk) -> None:
        self.db, self.clock, self.disk = db, clock, disk
        self.synchronous = "FULL"

    def execute(self, sql: str, parameters: Sequence[object] = ()) -> sqlite3.Cursor:
        if sql.startswith("PRAGMA synchronous="):
            self.synchronous = sql.split("=", 1)[1]
        elif sql == "COMMIT" and self.synchronous == "FULL":
            self.clock.advance(self.disk.seconds)
            if self.disk.failing:  # the fsync failed: SQLite rolls the commit back
                raise sqlite3.OperationalError("disk I/O error")
            self.disk.syncs += 1
        return self.db.execute(sql, parameters)

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[tuple[Harness, FakeClock]]:
    clock = FakeClock()
    harness = Harness(tmp_path, minds=MINDS, clock=clock)
    try:
        yield harness, clock
    finally:
        harness.close()


def send(peer: Peer, mind: str, request_id: str | None = None) -> None:
    request = {"v": 1, "op": "deliver", "mind": mind, "message": "m"}
    if request_id is not None:
        request["request_id"] = request_id
    peer.send(json.dumps(request).encode() + b"\n")


def acked(peer: Peer) -> bool:
    return peer.has_line()


def resend(harness: Harness, mind: str) -> int:
    """A client that got no ack sends its delivery to `mind` again, on a new connection
    with the same request id (`r-MIND`), as `volutectl deliver` does; the id it gets."""
    again = harness.connect()
    send(again, mind, f"r-{mind}")
    harness.advance(1.0)
    harness.pump(partial(acked, again))
    reply = again.reply()
    assert reply["ok"] is True, reply
    return int(reply["id"])


def held(harness: Harness, *peers: Peer) -> bool:
    """Whether the gate has read a request of as many clients as `peers` and holds
    them unanswered (clients with complete lines not yet served)."""
    return len(harness.gate.server.backlog) == len(peers)


def test_the_wait_is_a_share_of_the_commit_at_most_gather_max_and_none_for_its_own() -> None:
    commit = Commit(ended=100.0, seconds=0.03, clients=frozenset({7, 8}))
    assert commit.gather_until({9}) == pytest.approx(100.0 + GATHER_SHARE * 0.03)
    assert commit.gather_until({7, 9}) == commit.gather_until({9})  # one other is enough
    assert commit.gather_until({7}) is None  # its own client, alone: nothing to share
    assert commit.gather_until({7, 8}) is None
    assert commit.gather_until(set()) is None
    stalled = Commit(ended=100.0, seconds=5.0, clients=frozenset({7}))
    assert stalled.gather_until({9}) == pytest.approx(100.0 + GATHER_MAX)  # a stalled disk
    quick = Commit(ended=100.0, seconds=0.0005, clients=frozenset({7}))
    fast = quick.gather_until({9})  # a fast disk: next to none
    assert fast is not None and fast - 100.0 < 0.002


def test_deliveries_that_come_while_a_slow_commit_runs_share_the_next_one(
    gate: tuple[Harness, FakeClock],
) -> None:
    harness, clock = gate
    disk = SlowDisk(harness, clock, 0.05)
    first, second, third = harness.connect(), harness.connect(), harness.connect()
    send(first, "a")
    harness.pump(lambda: acked(first))
    assert disk.commits == [1]
    send(second, "b")
    send(third, "c")
    # Other clients wait: the commit took 0.05 s, so they gather for a while after it.
    for _ in range(5):  # passes on the gate's clock, which stands still
        harness.step(0)
    assert held(harness, second, third)
    assert not acked(second) and not acked(third) and disk.commits == [1]
    wait = harness.gate.timeout()
    assert wait is not None and 0 < wait <= GATHER_SHARE * 0.05 + 1e-9
    harness.advance(GATHER_SHARE * 0.05)
    harness.pump(lambda: acked(second) and acked(third))
    assert disk.commits == [1, 2]  # both in one commit
    for peer in (first, second, third):
        reply = peer.reply()
        assert reply["ok"] is True, reply
    rows = harness.gate.state.store.rows([1, 2, 3])
    assert [row.mind for row in rows] == ["a", "b", "c"]


def test_a_client_alone_delivering_one_after_another_never_waits(
    gate: tuple[Harness, FakeClock],
) -> None:
    """Its own delivery was the last commit's, and nobody else's waits: it has nothing
    to share a commit with, and each of its deliveries is committed at once."""
    harness, clock = gate
    disk = SlowDisk(harness, clock, 0.05)
    peer = harness.connect()
    for n in range(1, 5):
        before = clock.monotonic()
        send(peer, "a")
        harness.pump(lambda: acked(peer))
        assert peer.reply()["ok"] is True
        assert clock.monotonic() == pytest.approx(before + 0.05)  # the commit's time only
        assert disk.commits == [1] * n


def test_the_wait_follows_the_slowest_of_the_last_few_commits(
    gate: tuple[Harness, FakeClock],
) -> None:
    """A throttled card's commits take 30 ms and 1 ms by turns (a slot of the card's
    free, or not): the gather after a quick one is still the slow one's."""
    harness, clock = gate
    disk = SlowDisk(harness, clock, 0.03)
    first, second = harness.connect(), harness.connect()
    send(first, "a")
    harness.pump(lambda: acked(first))
    first.reply()
    disk.seconds = 0.001
    send(first, "a")  # its own client alone: at once, and quick
    harness.pump(lambda: acked(first))
    assert disk.commits == [1, 1]
    send(second, "b")
    harness.step(0)
    assert held(harness, second)
    wait = harness.gate.timeout()
    # The slow one's share (less what a quick commit since, a turn's end, took).
    assert wait is not None and wait == pytest.approx(GATHER_SHARE * 0.03, abs=disk.seconds * 1.01)
    assert not acked(second)


def test_a_fast_disk_gathers_next_to_nothing(gate: tuple[Harness, FakeClock]) -> None:
    """A commit that takes no time on the gate's clock (a fast disk) leaves nothing to
    wait for: other clients are served in the next pass."""
    harness, clock = gate
    disk = SlowDisk(harness, clock, 0.0)
    first, second = harness.connect(), harness.connect()
    send(first, "a")
    harness.pump(lambda: acked(first))
    send(second, "b")
    harness.pump(lambda: acked(second), timeout=1.0)
    assert disk.commits == [1, 1]


def test_a_status_waits_out_the_gather_too_and_is_answered_after_it(
    gate: tuple[Harness, FakeClock],
) -> None:
    """The gather holds every request of the clients that wait, in their order: a
    `status` after a delivery is answered after it, within the gather's time."""
    harness, clock = gate
    SlowDisk(harness, clock, 0.05)
    first, second = harness.connect(), harness.connect()
    send(first, "a")
    harness.pump(lambda: acked(first))
    send(second, "b")
    second.send(b'{"v": 1, "op": "status"}\n')
    harness.step(0)
    assert held(harness, second) and not acked(second)
    harness.advance(GATHER_SHARE * 0.05)
    harness.pump(lambda: acked(second))
    delivered = second.reply()
    assert delivered["ok"] is True and "id" in delivered, delivered  # the delivery first
    shown = second.reply()
    assert shown["ok"] is True and "status" in shown, shown  # then the status


def test_a_gate_that_dies_while_deliveries_gather_acknowledged_none_and_loses_none(
    gate: tuple[Harness, FakeClock],
) -> None:
    """The gather is before the commit: a gate killed then has stored none of the
    deliveries that gathered, and told their clients nothing (their connections end),
    so each client sends again (the same request id) and each is stored once; the
    delivery committed before it stays, once."""
    harness, clock = gate
    SlowDisk(harness, clock, 0.05)
    first, second, third = harness.connect(), harness.connect(), harness.connect()
    send(first, "a", "r-a")
    harness.pump(lambda: acked(first))
    committed = first.reply()
    assert committed["ok"] is True
    for peer, mind in ((second, "b"), (third, "c")):
        send(peer, mind, f"r-{mind}")
    harness.step(0)
    assert held(harness, second, third)
    assert not acked(second) and not acked(third)  # gathering
    harness.crash()
    assert second.closed_by_gate() and third.closed_by_gate()
    assert not second.buffer and not third.buffer  # no ack was sent
    harness.restart()
    store = harness.gate.state.store
    assert [row.mind for row in store.rows([1, 2, 3]) if row is not None] == ["a"]
    ids = [resend(harness, mind) for mind in ("a", "b", "c")]  # the first one's too
    assert ids[0] == committed["id"]  # the committed one, not queued twice
    rows = store.rows(ids)
    assert [row.mind for row in rows] == ["a", "b", "c"] and len(set(ids)) == 3


# -- one fsync for a pass's deliveries and its starts ---------------------------------------


def test_a_pass_acknowledges_its_deliveries_after_one_fsync_shared_with_its_starts(
    gate: tuple[Harness, FakeClock],
) -> None:
    """Issue 32: each pass paid two fsyncs, its deliveries' commit and its starts', a
    pair that on the SD card was most of a fan-out's first writes. The deliveries'
    commit has none of its own now: the starts' commit (the WAL is sequential) makes
    them durable, and the acknowledgements go after it, none before."""
    harness, clock = gate
    disk = SlowDisk(harness, clock, 0.05)
    peers = [harness.connect() for _ in MINDS]
    syncs = disk.syncs
    for peer, mind in zip(peers, MINDS, strict=True):
        send(peer, mind)
    harness.pump(lambda: all(acked(peer) for peer in peers))
    assert disk.commits == [3]  # one pass: the three deliveries, and the turns they start
    assert disk.syncs - syncs == 1  # the starts' commit, and no other
    store = harness.gate.state.store
    assert not store.sync_pending()
    assert harness.gate.state.turns.all()  # it started turns (as many as the cap lets)
    assert [peer.reply()["ok"] for peer in peers] == [True] * len(peers)


def test_a_pass_that_starts_nothing_acknowledges_after_its_sync(
    gate: tuple[Harness, FakeClock],
) -> None:
    """A delivery that starts no turn (its mind is paused): the sync before the gate
    sleeps is its fsync, and its ack comes after it, in the same pass."""
    harness, clock = gate
    disk = SlowDisk(harness, clock, 0.05)
    gate_state = harness.gate.state
    admin, second = harness.connect(), harness.connect()
    paused = admin.request({"v": 1, "op": "pause", "minds": ["b"]})
    assert paused["ok"] is True, paused
    harness.pump(lambda: not gate_state.store.sync_pending())
    syncs = disk.syncs
    send(second, "b")
    harness.advance(GATHER_MAX)
    harness.pump(lambda: acked(second))
    assert second.reply()["ok"] is True
    assert disk.syncs - syncs == 1 and not gate_state.store.sync_pending()


def test_a_sync_that_fails_acknowledges_none_and_a_retry_gets_the_same_delivery(
    gate: tuple[Harness, FakeClock],
) -> None:
    """The deliveries are in the WAL but the fsync failed (EIO): none may be
    acknowledged, so their clients are dropped unanswered, as by a gate that died after
    the commit, and the journal says why. Each sends again with its request id; once
    the disk syncs, each gets its one delivery back, stored once and run once."""
    harness, clock = gate
    disk = SlowDisk(harness, clock, 0.01)
    peers = {mind: harness.connect() for mind in ("a", "b")}
    disk.failing = True
    for mind, peer in peers.items():
        send(peer, mind, f"r-{mind}")
    harness.pump(lambda: all(peer.closed_by_gate() for peer in peers.values()))
    assert not any(peer.buffer for peer in peers.values())  # no ack was sent
    [said] = harness.journal.of(events.DeliveriesNotSynced)
    assert (said.count, said.clients) == (2, 2) and said.level == "error"
    store = harness.gate.state.store
    assert store.sync_pending()  # still in the WAL, not known to be on the disk
    disk.failing = False
    ids = {mind: resend(harness, mind) for mind in peers}
    assert not store.sync_pending()
    assert sum(store.counts().values()) == 2  # not stored twice
    harness.pump(lambda: settled(harness) and not harness.gate.state.turns.all())
    rows = store.rows(sorted(ids.values()))
    assert [(row.mind, row.state, row.attempts) for row in rows] == [
        ("a", QueueState.DONE, 0),
        ("b", QueueState.DONE, 0),
    ]
