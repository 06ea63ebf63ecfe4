"""The SQLite delivery queue, on real database files.

Durability (WAL, synchronous=FULL, one commit per batch, rows that survive a SIGKILL of
the writer) and the row transitions the gate relies on, above all: a held row's attempt
count never changes (DESIGN invariant 4).
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from volutectl.core import admission
from volutectl.core.admission import AfterFailure
from volutectl.errors import UnavailableError
from volutectl.states import HoldReason, Outcome, QueueState
from volutectl.store.indexed import IndexedStore
from volutectl.store.queue import NewDelivery, RequestIdReused, Row, Store

NOW = 1_700_000_000.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[IndexedStore]:
    # The gate's store: the queue and its index of pending rows (IndexedStore is a Store).
    opened = IndexedStore(tmp_path / "state" / "queue.sqlite3")
    yield opened
    opened.close()


def unit_for(turn_id: int) -> str:
    return f"volute-turn-m-{turn_id}.scope"


def add(store: Store, *items: tuple[str, str], interrupt: bool = False) -> list[int]:
    results = store.add_deliveries(
        [NewDelivery(mind, session, f"to {mind}".encode(), interrupt) for mind, session in items],
        now=NOW,
    )
    ids = [i for i in results if isinstance(i, int)]
    assert ids == results  # every one an id
    return ids


def new(
    *items: tuple[str, str, bytes, bool], request_ids: list[str | None] | None = None
) -> list[NewDelivery]:
    rids = request_ids if request_ids is not None else [None] * len(items)
    return [NewDelivery(*item, request_id=rid) for item, rid in zip(items, rids, strict=True)]


def failures(*updates: tuple[int, QueueState, int, float | None]) -> dict[int, AfterFailure]:
    return {
        i: AfterFailure(state, attempts, not_before) for i, state, attempts, not_before in updates
    }


def settle(
    store: Store,
    turn_id: int,
    *,
    done: tuple[int, ...] | list[int] = (),
    returned: tuple[int, ...] | list[int] = (),
    now: float = NOW,
) -> None:
    store.settle_turn(
        turn_id, outcome=Outcome.OK, exit_status=0, detail="", done=done, returned=returned,
        failed={}, error="", now=now,
    )  # fmt: skip


def fail_rows(store: Store, failed: dict[int, AfterFailure], error: str, now: float) -> None:
    """Count an attempt for running rows (their turn settled apart)."""
    store.settle_rows(failed=failed, error=error, now=now)


def one(store: Store, delivery_id: int) -> Row:
    row = store.row(delivery_id)
    assert row is not None
    return row


# -- durability ----------------------------------------------------------------------------


def test_wal_and_synchronous_full(store: Store) -> None:
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    # WAL is a property of the file: another connection sees it too.
    other = sqlite3.connect(str(store.path))
    try:
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        other.close()


def test_store_creates_its_directory(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "queue.sqlite3"
    Store(path).close()
    assert path.is_file()


def test_store_under_a_file_is_unavailable_naming_the_path(tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_text("")
    with pytest.raises(UnavailableError, match="not-a-dir"):
        Store(tmp_path / "not-a-dir" / "queue.sqlite3")


def test_add_deliveries_is_one_commit_with_consecutive_ids(store: Store) -> None:
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    ids = add(store, *[(f"m{i}", "main") for i in range(20)])
    store.db.set_trace_callback(None)
    assert ids == list(range(ids[0], ids[0] + 20))
    assert [s for s in statements if s.split()[0] in ("BEGIN", "COMMIT", "ROLLBACK")] == [
        "BEGIN IMMEDIATE",
        "COMMIT",
    ]
    assert [row.id for row in store.pending()] == ids
    assert one(store, ids[3]).message == b"to m3"


def test_add_deliveries_is_all_or_nothing(store: Store) -> None:
    add(store, ("a", "main"))
    bad = new(("b", "main", b"ok", False), ("c", None, b"no session", False))  # type: ignore[arg-type]
    with pytest.raises(sqlite3.IntegrityError):
        store.add_deliveries(bad, now=NOW)
    assert [row.mind for row in store.pending()] == ["a"]
    # The connection is usable afterwards: the transaction was rolled back, not left open.
    add(store, ("d", "main"))
    assert [row.mind for row in store.pending()] == ["a", "d"]


def test_a_full_database_refuses_a_batch_by_its_cause_and_recovers(store: Store) -> None:
    add(store, ("a", "main"))
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")  # what a full disk does to SQLite
    big = new(("b", "main", b"x" * 200_000, False))
    # SQLite rolled the transaction back itself: the error is the full disk, not a
    # failed second ROLLBACK that would hide it.
    with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
        store.add_deliveries(big, now=NOW)
    assert [row.mind for row in store.pending()] == ["a"]
    store.db.execute(f"PRAGMA max_page_count = {pages * 1000}")  # space is back
    assert store.add_deliveries(big, now=NOW) == [2]


def test_a_commit_that_fails_leaves_no_transaction_open(store: Store) -> None:
    # A deferred constraint fails at COMMIT, as a full disk can, and SQLite then leaves
    # the transaction open: every later BEGIN would fail, and the queue with it.
    store.db.execute("PRAGMA foreign_keys = ON")
    store.db.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
    store.db.execute(
        "CREATE TABLE child (parent INTEGER REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED)"
    )
    with pytest.raises(sqlite3.IntegrityError), store._tx():
        store.db.execute("INSERT INTO child VALUES (7)")
    assert not store.db.in_transaction
    add(store, ("a", "main"))
    assert [row.mind for row in store.pending()] == ["a"]


def test_rows_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "queue.sqlite3"
    first = Store(path)
    ids = add(first, ("a", "main"), ("b", "side"))
    first.close()
    again = Store(path)
    try:
        assert [(r.id, r.mind, r.session, r.state) for r in again.pending()] == [
            (ids[0], "a", "main", "pending"),
            (ids[1], "b", "side", "pending"),
        ]
    finally:
        again.close()


def test_acknowledged_rows_survive_sigkill_of_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "queue.sqlite3"
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from volutectl.store.queue import Store
        store = Store(Path({str(path)!r}))
        from volutectl.store.queue import NewDelivery
        ids = store.add_deliveries([NewDelivery("m", "s", b"x" * 100)] * 50)
        print(" ".join(map(str, ids)), flush=True)
        time.sleep(60)  # never closes: the kill comes first
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        acknowledged = [int(i) for i in child.stdout.readline().split()]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL
    assert len(acknowledged) == 50
    # The WAL is still there (nobody checkpointed): the rows are in it, and recovered.
    assert (tmp_path / "queue.sqlite3-wal").exists()
    reopened = Store(path)
    try:
        assert [row.id for row in reopened.pending()] == acknowledged
    finally:
        reopened.close()


# -- request ids: a retried request gets its original delivery back ----------------------

RID = "0123456789abcdef0123456789abcdef"


def count_rows(store: Store) -> int:
    return int(store.db.execute("SELECT COUNT(*) FROM deliveries").fetchone()[0])


def test_a_retried_request_id_gets_the_original_delivery_id(tmp_path: Path) -> None:
    path = tmp_path / "queue.sqlite3"
    store = Store(path)
    [first] = store.add_deliveries(new(("m", "s", b"hello", False), request_ids=[RID]), now=NOW)
    assert isinstance(first, int)
    # The row has moved on (a turn took it and finished) before the retry arrives.
    turn_id, _ = store.start_turn("m", "s", unit_for, [first], NOW + 1)
    settle(store, turn_id, done=[first], now=NOW + 2)
    store.close()
    # The retry reaches a restarted gate: a new connection to the same file.
    store = Store(path)
    try:
        again = store.add_deliveries(
            new(("m", "s", b"hello", False), request_ids=[RID]), now=NOW + 3
        )
        assert again == [first]
        assert count_rows(store) == 1
        assert one(store, first).state == "done"  # untouched: no second run
    finally:
        store.close()


def test_the_same_request_id_twice_in_one_batch_is_one_delivery(store: Store) -> None:
    other = "f" * 32
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    results = store.add_deliveries(
        new(("m", "s", b"x", False), ("n", "s", b"y", False), ("m", "s", b"x", False),
            request_ids=[RID, other, RID]),
        now=NOW,
    )  # fmt: skip
    store.db.set_trace_callback(None)
    assert results[0] == results[2] and results[0] != results[1]
    ids = [result for result in results if isinstance(result, int)]
    assert ids == results  # every one an id
    assert [row.id for row in store.pending()] == sorted(set(ids))
    assert count_rows(store) == 2
    assert [s for s in statements if s.split()[0] in ("BEGIN", "COMMIT")] == [
        "BEGIN IMMEDIATE",
        "COMMIT",
    ]


@pytest.mark.parametrize(
    "changed",
    [
        ("other", "s", b"hello", False),
        ("m", "other", b"hello", False),
        ("m", "s", b"hello!", False),
        ("m", "s", b"hello", True),
    ],
    ids=["mind", "session", "message", "interrupt"],
)
def test_a_request_id_reused_with_other_content_is_refused_with_65(
    store: Store, changed: tuple[str, str, bytes, bool]
) -> None:
    [original] = store.add_deliveries(new(("m", "s", b"hello", False), request_ids=[RID]), now=NOW)
    results = store.add_deliveries(
        new(("k", "s", b"fine", False), changed, request_ids=[None, RID]), now=NOW + 1
    )
    fine, refused = results
    assert isinstance(refused, RequestIdReused)
    assert refused.exit_code == 65
    assert (refused.request_id, refused.delivery_id) == (RID, original)
    assert RID in refused.message and str(original) in refused.message
    # The batch's other item went in; the original row is as it was.
    assert isinstance(fine, int) and one(store, fine).mind == "k"
    assert count_rows(store) == 2
    row = one(store, int(original))  # type: ignore[arg-type]
    assert (row.mind, row.session, row.message, row.interrupt) == ("m", "s", b"hello", False)


def test_the_second_of_two_conflicting_requests_in_one_batch_is_refused(store: Store) -> None:
    first, second = store.add_deliveries(
        new(("m", "s", b"one", False), ("m", "s", b"two", False), request_ids=[RID, RID]), now=NOW
    )
    assert isinstance(first, int)
    assert isinstance(second, RequestIdReused) and second.delivery_id == first
    assert count_rows(store) == 1


def test_requests_without_an_id_are_never_merged(store: Store) -> None:
    results = store.add_deliveries(new(*[("m", "s", b"same", False)] * 3), now=NOW)
    assert len(set(results)) == 3
    assert add(store, ("m", "s"), ("m", "s"))[0] != add(store, ("m", "s"))[0]
    assert count_rows(store) == 6


# -- holds ------------------------------------------------------------------------------


def test_mark_held_records_the_start_once_and_updates_the_reason(store: Store) -> None:
    [a, b] = add(store, ("a", "main"), ("b", "main"))
    assert store.mark_held([(a, HoldReason.GLOBAL_CAP)], NOW + 1) == [a]
    assert store.mark_held([(a, HoldReason.MIND_BUSY), (b, HoldReason.MIND_BUSY)], NOW + 5) == [b]
    row_a = one(store, a)
    assert row_a.held_since == NOW + 1
    assert row_a.hold_reason == HoldReason.MIND_BUSY
    assert row_a.attempts == 0
    assert one(store, b).held_since == NOW + 5
    assert store.oldest_hold() == NOW + 1


def test_a_held_row_keeps_zero_attempts_through_many_holds(store: Store) -> None:
    [delivery_id] = add(store, ("a", "main"))
    reasons = [
        HoldReason.GLOBAL_CAP,
        HoldReason.MIND_BUSY,
        HoldReason.IO_PRESSURE,
        HoldReason.TEST_RUN,
    ]
    for i in range(200):
        store.mark_held([(delivery_id, reasons[i % len(reasons)])], NOW + i)
    row = one(store, delivery_id)
    assert (row.state, row.attempts, row.not_before) == ("pending", 0, None)
    assert row.held_since == NOW


def test_holding_again_for_the_same_reason_writes_nothing(store: Store) -> None:
    ids = add(store, *[(f"m{i}", "main") for i in range(30)])
    store.mark_held([(i, HoldReason.GLOBAL_CAP) for i in ids], NOW)
    before = store.db.total_changes
    for tick in range(5):  # admission passes while the cap stays full
        assert store.mark_held([(i, HoldReason.GLOBAL_CAP) for i in ids], NOW + tick) == []
    assert store.db.total_changes == before
    store.mark_held([(ids[0], HoldReason.IO_PRESSURE)], NOW + 9)
    assert store.db.total_changes == before + 1
    assert one(store, ids[0]).hold_reason == HoldReason.IO_PRESSURE


def test_mark_held_does_not_touch_rows_that_are_not_pending(store: Store) -> None:
    [a] = add(store, ("a", "main"))
    store.start_turn("a", "main", unit_for, [a], NOW)
    assert store.mark_held([(a, HoldReason.GLOBAL_CAP)], NOW + 1) == []
    row = one(store, a)
    assert (row.state, row.held_since, row.hold_reason) == ("running", None, None)


# -- turns and their rows ---------------------------------------------------------------------


def test_start_turn_moves_rows_to_running_and_accounts_the_hold(store: Store) -> None:
    [a, b, c] = add(store, ("a", "main"), ("a", "main"), ("a", "main"))
    store.mark_held([(a, HoldReason.GLOBAL_CAP)], NOW + 1)
    turn_id, taken = store.start_turn("a", "main", unit_for, [a, b], NOW + 3.5)
    # The rows as they were, with the hold they leave (to log held_ms).
    assert [(r.id, r.state, r.held_since) for r in taken] == [
        (a, "pending", NOW + 1),
        (b, "pending", None),
    ]
    row_a = one(store, a)
    assert (row_a.state, row_a.turn_id, row_a.folded) == ("running", turn_id, False)
    assert (row_a.held_since, row_a.hold_reason, row_a.held_ms) == (None, None, 2500)
    assert one(store, b).held_ms == 0
    assert one(store, c).state == "pending"
    turn = store.turn(turn_id)
    assert turn is not None
    assert (turn.mind, turn.session, turn.unit, turn.state, turn.released) == (
        "a",
        "main",
        unit_for(turn_id),
        "starting",
        False,
    )
    assert [r.id for r in store.rows_of_turn(turn_id)] == [a, b]
    assert [t.id for t in store.open_turns()] == [turn_id]


def test_start_turn_skips_rows_that_left_pending(store: Store) -> None:
    [a, b] = add(store, ("a", "main"), ("a", "main"))
    store.drop([b], NOW)
    turn_id, taken = store.start_turn("a", "main", unit_for, [a, b], NOW)
    assert [r.id for r in taken] == [a]
    assert one(store, b).state == "dropped"
    assert [r.id for r in store.rows_of_turn(turn_id)] == [a]


def test_fold_into_marks_rows_folded(store: Store) -> None:
    [a, b] = add(store, ("a", "main"), ("a", "main"))
    turn_id, _ = store.start_turn("a", "main", unit_for, [a], NOW)
    store.mark_held([(b, HoldReason.MIND_BUSY)], NOW)
    folded = store.fold_into(turn_id, [b], NOW + 0.25)
    assert [r.id for r in folded] == [b]
    row = one(store, b)
    assert (row.state, row.turn_id, row.folded, row.held_ms) == ("running", turn_id, True, 250)
    # Folding a row twice takes it once.
    assert store.fold_into(turn_id, [b], NOW + 1) == []


def test_fold_into_decides_in_its_commit_which_interrupts_cut_the_turn(store: Store) -> None:
    """Who sent what the turn runs decides: Bob's interrupt of Alice's turn folds in as
    a plain delivery; an admin's cuts it; only a cut marks the turn interrupted."""
    alice, bob, admin = 1001, 1002, 0

    def sent(item: NewDelivery) -> int:
        [delivery_id] = store.add_deliveries([item])
        assert isinstance(delivery_id, int)
        return delivery_id

    a = sent(NewDelivery("a", "main", b"hers", uid=alice))
    turn_id, _ = store.start_turn("a", "main", unit_for, [a], NOW)
    b = sent(NewDelivery("a", "main", b"stop", True, uid=bob))
    [folded] = store.fold_into(turn_id, [b], NOW)
    assert folded.id == b and folded.interrupt and not folded.cut
    turn = store.turn(turn_id)
    assert turn is not None and not turn.interrupted
    assert store.senders_of_turn(turn_id) == {alice, bob}
    c = sent(NewDelivery("a", "main", b"stop", True, uid=admin, admin=True))
    [folded] = store.fold_into(turn_id, [c], NOW)
    assert folded.cut and one(store, c).cut and one(store, c).admin
    turn = store.turn(turn_id)
    assert turn is not None and turn.interrupted
    assert not one(store, b).cut  # decided once, at its fold


def test_turn_lifecycle_released_then_ended(store: Store) -> None:
    [a] = add(store, ("a", "main"))
    turn_id, _ = store.start_turn("a", "main", unit_for, [a], NOW)
    store.mark_released(turn_id)
    turn = store.turn(turn_id)
    assert turn is not None and (turn.state, turn.released) == ("running", True)
    store.settle_turn(
        turn_id, outcome=Outcome.FAILED, exit_status=3, detail="exited 3", done=[],
        returned=[], failed=failures((a, QueueState.PENDING, 1, NOW + 20)),
        error="turn 1 exited 3", now=NOW + 9,
    )  # fmt: skip
    turn = store.turn(turn_id)
    assert turn is not None
    assert (turn.state, turn.outcome, turn.exit_status, turn.detail, turn.ended_at) == (
        "ended",
        "failed",
        3,
        "exited 3",
        NOW + 9,
    )
    assert store.open_turns() == []
    assert store.turn(turn_id + 100) is None


def test_a_failed_start_ends_its_turn_and_counts_the_attempt_in_one_commit(
    store: IndexedStore,
) -> None:
    """Issue 29: the turn's end and its rows' attempt were two commits; a gate that died
    between them left the rows running under a closed turn. One commit now: it is seen
    whole (the commit hook fires once) or not at all."""
    [a] = add(store, ("a", "main"))
    turn_id, _ = store.start_turn("a", "main", unit_for, [a], NOW)
    commits = []
    store.db.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    store.settle_turn(
        turn_id, outcome=Outcome.START_FAILED, exit_status=None, detail="no such user",
        done=[], returned=[], failed=failures((a, QueueState.PENDING, 1, NOW + 5)),
        error="no such user", now=NOW + 1,
    )  # fmt: skip
    store.db.set_trace_callback(None)
    assert commits == ["COMMIT"]
    turn = store.turn(turn_id)
    assert turn is not None and (turn.state, turn.outcome) == ("ended", "start_failed")
    row = one(store, a)
    assert (row.state, row.attempts, row.last_error) == ("pending", 1, "no such user")
    assert store.stranded() == []
    assert a in store.index.rows


def test_stranded_rows_are_those_running_under_no_open_turn(store: IndexedStore) -> None:
    [a, b, c, d] = add(store, ("a", "w"), ("a", "x"), ("a", "y"), ("a", "z"))
    open_turn, _ = store.start_turn("a", "w", unit_for, [a], NOW)
    ended, _ = store.start_turn("a", "x", unit_for, [b], NOW)
    gone, _ = store.start_turn("a", "y", unit_for, [c], NOW)
    with store._tx():  # what a gate killed in the old window, or worse, left
        store.db.execute("UPDATE turns SET state = 'ended', outcome = 'ok' WHERE id = ?", (ended,))
        store.db.execute("DELETE FROM turns WHERE id = ?", (gone,))
    found = [(row.id, turn.id if turn is not None else None) for row, turn in store.stranded()]
    assert found == [(b, ended), (c, None)]  # not a (its turn is open), not d (pending)
    store.settle_rows(done=[b], returned=[c], failed={}, error="", now=NOW + 1)
    assert store.stranded() == []
    assert (one(store, b).state, one(store, c).state, one(store, d).state) == (
        "done", "pending", "pending",
    )  # fmt: skip
    assert set(store.index.rows) == {c, d}
    assert one(store, a).turn_id == open_turn


def test_settling_as_done_only_finishes_running_rows(store: Store) -> None:
    [a, b] = add(store, ("a", "main"), ("a", "main"))
    turn_id, _ = store.start_turn("a", "main", unit_for, [a], NOW)
    settle(store, turn_id, done=[a, b], now=NOW + 2)
    assert one(store, a).state == "done"
    assert one(store, b).state == "pending"
    assert store.counts() == {"done": 1, "pending": 1}


def test_returning_to_pending_counts_no_attempt(store: Store) -> None:
    [a] = add(store, ("a", "main"))
    turn_id, _ = store.start_turn("a", "main", unit_for, [a], NOW)
    settle(store, turn_id, returned=[a])
    row = one(store, a)
    assert (row.state, row.turn_id, row.folded, row.attempts) == ("pending", None, False, 0)
    assert store.rows_of_turn(turn_id) == []
    # Only running rows go back: a second undo changes nothing.
    settle(store, turn_id, returned=[a])
    assert one(store, a) == row


def test_fail_rows_backs_off_or_kills(store: IndexedStore) -> None:
    [a, b, c] = add(store, ("a", "main"), ("a", "main"), ("a", "main"))
    turn_id, _ = store.start_turn("a", "main", unit_for, [a, b], NOW)
    fail_rows(
        store,
        failures(
            (a, QueueState.PENDING, 1, NOW + 5),
            (b, QueueState.DEAD, 10, None),
            (c, QueueState.DEAD, 10, None),
        ),
        "turn 1 exited 3",
        NOW + 1,
    )
    row_a = one(store, a)
    assert (row_a.state, row_a.attempts, row_a.not_before, row_a.turn_id) == (
        "pending",
        1,
        NOW + 5,
        None,
    )
    assert row_a.last_error == "turn 1 exited 3"
    row_b = one(store, b)
    # A dead row remembers the turn that last carried it.
    assert (row_b.state, row_b.attempts, row_b.turn_id) == ("dead", 10, turn_id)
    # Only running rows fail: c was never taken.
    assert (one(store, c).state, one(store, c).attempts) == ("pending", 0)
    assert store.next_backoff_deadline() == NOW + 5
    assert store.counts() == {"pending": 2, "dead": 1}


def test_a_row_that_backed_off_starts_clean(store: IndexedStore) -> None:
    [a] = add(store, ("a", "main"))
    store.start_turn("a", "main", unit_for, [a], NOW)
    fail_rows(store, failures((a, QueueState.PENDING, 1, NOW + 5)), "exited 1", NOW)
    assert one(store, a).as_delivery() == admission.Delivery(a, "a", "main", False, NOW + 5)
    store.start_turn("a", "main", unit_for, [a], NOW + 6)
    row = one(store, a)
    assert (row.state, row.attempts, row.not_before) == ("running", 1, None)
    assert store.next_backoff_deadline() is None


def test_next_backoff_deadline_is_the_earliest_pending_one(store: IndexedStore) -> None:
    assert store.next_backoff_deadline() is None
    ids = add(store, ("a", "x"), ("a", "y"), ("a", "z"))
    for delivery_id in ids:
        store.start_turn("a", "x", unit_for, [delivery_id], NOW)
    fail_rows(
        store,
        failures(
            (ids[0], QueueState.PENDING, 1, NOW + 30), (ids[1], QueueState.PENDING, 2, NOW + 10)
        ),
        "e",
        NOW,
    )
    fail_rows(store, failures((ids[2], QueueState.DEAD, 3, None)), "e", NOW)
    assert store.next_backoff_deadline() == NOW + 10
    store.drop([ids[1]], NOW)
    assert store.next_backoff_deadline() == NOW + 30


def test_next_backoff_deadline_after_skips_backoffs_that_ended(store: IndexedStore) -> None:
    ids = add(store, ("a", "x"), ("a", "y"))
    for delivery_id in ids:
        store.start_turn("a", "x", unit_for, [delivery_id], NOW)
    fail_rows(
        store,
        failures(
            (ids[0], QueueState.PENDING, 1, NOW + 5), (ids[1], QueueState.PENDING, 1, NOW + 50)
        ),
        "e",
        NOW,
    )
    # ids[0]'s backoff is over but no pass has seen it: it is due now, once (a wake
    # that came early must not lose it); then a loop sleeping until "the next
    # deadline" must not see it again.
    assert store.next_backoff_deadline() == NOW + 5
    assert store.next_backoff_deadline(after=NOW + 6) == NOW + 6
    assert store.next_backoff_deadline(after=NOW + 6) == NOW + 50
    assert store.next_backoff_deadline(after=NOW + 50) == NOW + 50
    assert store.next_backoff_deadline(after=NOW + 50) is None


def test_retry_revives_only_dead_rows_with_attempts_reset(store: Store) -> None:
    [a, b] = add(store, ("a", "main"), ("a", "main"))
    store.start_turn("a", "main", unit_for, [a], NOW)
    fail_rows(store, failures((a, QueueState.DEAD, 10, None)), "e", NOW)
    assert store.retry([a, b, 999]) == [a]
    row = one(store, a)
    assert (row.state, row.attempts, row.not_before, row.turn_id) == ("pending", 0, None, None)
    assert store.retry([a]) == []


def test_drop_takes_pending_and_dead_rows_never_running_ones(store: Store) -> None:
    [a, b, c] = add(store, ("a", "x"), ("a", "y"), ("a", "z"))
    store.mark_held([(a, HoldReason.GLOBAL_CAP)], NOW)
    store.start_turn("a", "y", unit_for, [b], NOW)
    store.start_turn("a", "z", unit_for, [c], NOW)
    fail_rows(store, failures((c, QueueState.DEAD, 10, None)), "e", NOW)
    assert store.drop([a, b, c, 999], NOW + 1) == [a, c]
    assert one(store, a).state == "dropped"
    assert one(store, a).held_since is None
    assert one(store, b).state == "running"
    assert store.oldest_hold() is None
    assert store.pending() == []
    # Newest first, and the limit keeps the newest.
    assert [r.id for r in store.list_rows([QueueState.DROPPED])] == [c, a]
    assert [r.id for r in store.list_rows([QueueState.RUNNING, QueueState.DROPPED], limit=2)] == [
        c,
        b,
    ]
    assert store.count_rows([QueueState.RUNNING, QueueState.DROPPED]) == 3


# -- invariant 4, over generated histories --------------------------------------------------


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.sampled_from(["hold", "start_and_return", "fold_and_return", "hold_again"]),
        max_size=25,
    )
)
def test_holds_and_undone_handoffs_never_count_an_attempt(tmp_path: Path, steps: list[str]) -> None:
    store = Store(Path(tempfile.mkdtemp(dir=tmp_path)) / "queue.sqlite3")
    try:
        [held, other] = add(store, ("a", "main"), ("b", "main"))
        other_turn, _ = store.start_turn("b", "main", unit_for, [other], NOW)
        for i, step in enumerate(steps):
            now = NOW + i
            if step in ("hold", "hold_again"):
                store.mark_held([(held, HoldReason.GLOBAL_CAP)], now)
            elif step == "start_and_return":
                turn_id, _ = store.start_turn("a", "main", unit_for, [held], now)
                settle(store, turn_id, returned=[held], now=now)
            else:
                store.fold_into(other_turn, [held], now)
                settle(store, other_turn, returned=[held], now=now)
            row = one(store, held)
            assert (row.state, row.attempts, row.not_before) == ("pending", 0, None)
    finally:
        store.close()


def test_settle_turn_in_one_commit_and_unsynced_until_the_next_synced_commit(
    store: Store,
) -> None:
    ids = add(store, ("mimsy", "a"), ("mimsy", "a"), ("mimsy", "a"))
    turn_id, _ = store.start_turn("mimsy", "a", unit_for, ids, now=1.0)
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    store.settle_turn(
        turn_id,
        outcome=Outcome.OK,
        exit_status=0,
        detail="exited 0",
        done=[ids[0]],
        returned=[ids[1]],
        failed=failures((ids[2], QueueState.PENDING, 1, 9.0)),
        error="boom",
        now=2.0,
        durable=False,
    )
    store.db.set_trace_callback(None)
    assert statements.count("BEGIN IMMEDIATE") == 1 and statements.count("COMMIT") == 1
    assert "PRAGMA synchronous=NORMAL" in statements  # this commit skipped its fsync
    assert [one(store, i).state for i in ids] == ["done", "pending", "pending"]
    assert one(store, ids[2]).attempts == 1 and one(store, ids[1]).attempts == 0
    turn = store.turn(turn_id)
    assert turn is not None and turn.state == "ended" and turn.outcome == "ok"
    assert store.sync_pending()
    # The next synced commit (here a delivery) covers it: no extra fsync is owed.
    add(store, ("pip", "b"))
    assert not store.sync_pending()
    statements.clear()
    store.db.set_trace_callback(statements.append)
    store.sync()  # nothing owed: no statement at all
    assert statements == []


def test_sync_makes_an_unsynced_settlement_durable_with_one_synced_commit(store: Store) -> None:
    ids = add(store, ("mimsy", "a"))
    turn_id, _ = store.start_turn("mimsy", "a", unit_for, ids, now=1.0)
    store.settle_turn(
        turn_id, outcome=Outcome.OK, exit_status=0, detail="", done=ids, returned=[], failed={},
        error="", now=2.0, durable=False,
    )  # fmt: skip
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    store.sync()
    store.db.set_trace_callback(None)
    assert statements.count("COMMIT") == 1
    assert "PRAGMA synchronous=NORMAL" not in statements
    assert not store.sync_pending()
