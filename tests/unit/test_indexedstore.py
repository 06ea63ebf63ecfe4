"""The in-memory index of pending rows stays in step with the database, commit by commit.

Random histories of the store's operations on a real SQLite file; after each one, the
index the store keeps equals one built afresh from the database: the same pending rows
(mind, session, interrupt, backoff) and the same recorded hold reasons.
"""

from __future__ import annotations

import random
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from volutectl.core.admission import AfterFailure
from volutectl.states import HoldReason, Outcome, QueueState
from volutectl.store.index import PendingIndex
from volutectl.store.indexed import IndexedStore
from volutectl.store.queue import NewDelivery

NOW = 1_700_000_000.0


def snapshot(index: PendingIndex) -> tuple[dict[int, object], dict[int, object]]:
    return dict(index.rows), {i: r for i, r in index.recorded.items() if r is not None}


def assert_in_step(store: IndexedStore) -> None:
    assert snapshot(store.index) == snapshot(store.load_index())
    assert dict(store.index.counts) == dict(store.load_index().counts)
    # Each uid's deliveries not yet done (its quota's sums), as summed afresh.
    assert store.usages.by_uid == store.load_usages().by_uid


def unit(turn_id: int) -> str:
    return f"volute-turn-m-{turn_id}.scope"


OPS = ["add", "add", "start", "fold", "settle", "fail", "retry", "drop", "hold", "retried"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1000)), max_size=40))
def test_the_index_follows_every_commit(tmp_path: Path, history: list[tuple[str, int]]) -> None:
    store = IndexedStore(Path(tempfile.mkdtemp(dir=tmp_path)) / "queue.sqlite3")
    turns: dict[int, list[int]] = {}
    try:
        for op, seed in history:
            rng = random.Random(seed)
            pending = sorted(store.index.rows)
            if op == "add":
                item = NewDelivery(
                    rng.choice("ab"),
                    rng.choice("xy"),
                    b"m" * rng.randrange(1, 50),
                    rng.random() < 0.3,
                    uid=rng.choice([None, 0, 1000, 1001]),
                )
                store.add_deliveries([item], now=NOW)
            elif op == "retried":  # the same request id twice: one row, indexed once
                rid = f"{rng.randrange(4):032x}"
                item = NewDelivery("a", "x", b"same", request_id=rid, uid=1000)
                store.add_deliveries([item], now=NOW)
            elif op == "start" and pending:
                turn_id, taken = store.start_turn("a", "x", unit, pending[:2], NOW)
                turns[turn_id] = [row.id for row in taken]
            elif op == "fold" and pending and turns:
                turn_id = rng.choice(sorted(turns))
                turns[turn_id] += [row.id for row in store.fold_into(turn_id, pending[:1], NOW)]
            elif op in ("settle", "fail") and turns:
                turn_id = rng.choice(sorted(turns))
                ids = turns.pop(turn_id)
                done = ids[1:2] if rng.random() < 0.5 else []
                after = {i: AfterFailure(rng.choice([QueueState.PENDING, QueueState.DEAD]), 1,
                                         NOW + 5) for i in ids[1 + len(done):]}  # fmt: skip
                if op == "settle":
                    store.settle_turn(
                        turn_id, outcome=Outcome.FAILED, exit_status=1, detail="", done=done,
                        returned=ids[:1], failed=after, error="e", now=NOW,
                    )  # fmt: skip
                else:  # rows whose turn is settled already (a stranded row, at start)
                    store.settle_rows(done=done, returned=ids[:1], failed=after, error="e", now=NOW)
            elif op == "retry":
                dead = [r.id for r in store.list_rows([QueueState.DEAD])]
                store.retry(dead[:2])
            elif op == "drop" and pending:
                dead = [r.id for r in store.list_rows([QueueState.DEAD])]
                store.drop([rng.choice(pending + dead)], NOW)
            elif op == "hold" and pending:
                # As the gate does: the index decides a hold (and records it), the store
                # writes it.
                delivery_id, reason = rng.choice(pending), rng.choice(list(HoldReason))
                store.index._record(delivery_id, reason)
                store.mark_held([(delivery_id, reason)], NOW)
            assert_in_step(store)
    finally:
        store.close()


def test_a_failed_hold_write_rebuilds_the_index_from_the_database(tmp_path: Path) -> None:
    store = IndexedStore(tmp_path / "queue.sqlite3")
    [row] = store.add_deliveries([NewDelivery("a", "x", b"m")], now=NOW)
    assert isinstance(row, int), row
    store.index._record(row, HoldReason.GLOBAL_CAP)  # what admit does
    store.db.execute("PRAGMA query_only = 1")  # the next write fails
    with pytest.raises(sqlite3.OperationalError):
        store.mark_held([(row, HoldReason.GLOBAL_CAP)], NOW)
    store.db.execute("PRAGMA query_only = 0")
    assert store.index.recorded[row] is None  # the database never got it
    store.close()


def test_sqlite_checkpoints_only_when_the_gate_asks(tmp_path: Path) -> None:
    # SQLite's own checkpoint (every 1,000 WAL pages) would run inside whichever commit
    # crosses the line, a handoff's too. The gate's store leaves the pages in the WAL
    # until checkpoint(), which the gate calls after a quiet second.
    path = tmp_path / "queue.sqlite3"
    store = IndexedStore(path)
    assert store.checkpoint_deadline() is None
    size = path.stat().st_size
    for i in range(1200):  # each commit writes >1 page: past SQLite's 1,000
        store.add_deliveries([NewDelivery("m", f"s{i}", b"x" * 200)], now=NOW)
    assert path.stat().st_size == size  # nothing was copied into the database yet
    deadline = store.checkpoint_deadline()
    assert deadline is not None
    store.checkpoint()
    assert path.stat().st_size > size + 1200 * 200
    assert store.checkpoint_deadline() is None
    other = sqlite3.connect(path)
    assert other.execute("SELECT COUNT(*) FROM deliveries").fetchone() == (1200,)
    other.close()
    store.close()
