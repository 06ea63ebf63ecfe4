"""Retention on real database files: what a batch deletes and what it keeps, how big a
batch is, the pages it gives back, and when the gate's retention runs one.

The gate's loop around it (its deadline in select(), a batch never in a pass that
starts a turn) is tests/unit/test_gate_retention.py.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.gate_harness import RecordingJournal
from tests.unit.retention_rows import DAY, KEEP_DAYS, add, run_turn, seed, snapshot
from volutectl import events
from volutectl.states import QueueState
from volutectl.store import retention, schema
from volutectl.store.queue import Store
from volutectl.store.retention import Pacing, Retention, delete_batch, next_expiry, reclaim

NOW = 1_800_000_000.0
CUTOFF = NOW - KEEP_DAYS * DAY


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path / "queue.sqlite3")
    yield opened
    opened.close()


def ids(store: Store, table: str) -> set[int]:
    return {row[0] for row in store.db.execute(f"SELECT id FROM {table}")}


def file_bytes(store: Store) -> int:
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return os.path.getsize(store.path)


# -- what goes, what stays --------------------------------------------------------------------


def test_a_batch_deletes_old_done_and_dropped_rows_and_their_turns_and_keeps_the_rest(
    store: Store,
) -> None:
    seeded = seed(store, NOW)
    before = snapshot(store.path)
    batch = delete_batch(store.db, CUTOFF)
    assert (batch.deliveries, batch.turns, batch.more) == (4, len(seeded.gone_turns), False)
    assert ids(store, "deliveries") == seeded.kept
    assert ids(store, "turns") == seeded.kept_turns
    after = snapshot(store.path)
    for table in after:  # what stays is untouched, column by column
        assert after[table] == {key: before[table][key] for key in after[table]}
    # The dead row's turn stays with it, and so does the still-open one from long ago.
    assert len(seeded.kept_turns & {row.turn_id for row in store.list_rows([QueueState.DEAD])}) == 1
    assert len(store.open_turns()) == 1
    assert delete_batch(store.db, CUTOFF) == retention.Batch(0, 0)


def test_a_dead_row_goes_only_after_it_is_dropped_and_then_kept_its_time(store: Store) -> None:
    seeded = seed(store, NOW, running=False)
    [dead] = [row.id for row in store.list_rows([QueueState.DEAD])]
    delete_batch(store.db, CUTOFF)
    assert dead in ids(store, "deliveries")
    dropped_at = NOW - 2 * DAY  # dropped: its retention starts then
    assert store.drop([dead], dropped_at) == [dead]
    assert delete_batch(store.db, CUTOFF).deliveries == 0
    assert delete_batch(store.db, dropped_at + 1).deliveries == 1  # ...and goes when it ends
    assert dead not in ids(store, "deliveries")
    assert seeded.kept_turns - ids(store, "turns")  # its turn went with it


def test_a_turn_stays_while_any_of_its_rows_does(store: Store) -> None:
    first, second = add(store, NOW - 30 * DAY), add(store, NOW - 30 * DAY)
    turn_id = run_turn(store, [first, second], NOW - 30 * DAY)
    batch = delete_batch(store.db, CUTOFF, rows=1)  # takes one of its two rows
    assert (batch.deliveries, batch.turns, batch.more) == (1, 0, True)
    assert turn_id in ids(store, "turns")
    batch = delete_batch(store.db, CUTOFF, rows=1)
    assert (batch.deliveries, batch.turns) == (1, 1)
    assert ids(store, "turns") == set()


def test_a_retried_request_id_is_new_once_its_row_is_gone(store: Store) -> None:
    from volutectl.store.queue import NewDelivery

    item = NewDelivery("m", "s", b"hi", request_id="ab" * 16)
    [first] = store.add_deliveries([item], now=NOW - 30 * DAY)
    assert store.add_deliveries([item], now=NOW) == [first]  # kept: the same delivery
    run_turn(store, [first], NOW - 30 * DAY)  # type: ignore[list-item]
    delete_batch(store.db, CUTOFF)
    [again] = store.add_deliveries([item], now=NOW)
    assert again != first  # a new delivery, and never the old id: ids are not reused
    assert isinstance(again, int) and isinstance(first, int) and again > first


# -- batch sizes ----------------------------------------------------------------------------


def test_batches_stop_at_their_row_limit_and_say_more_is_due(store: Store) -> None:
    seed(store, NOW, old_done=600, running=False)
    sizes = []
    while True:
        batch = delete_batch(store.db, CUTOFF)
        sizes.append((batch.deliveries, batch.more))
        if not batch.more:
            break
    assert sizes == [(256, True), (256, True), (89, False)]  # 600 done + 1 dropped


def test_batches_stop_at_their_message_bytes_but_take_one_large_message_alone(
    store: Store,
) -> None:
    seed(store, NOW, old_done=5, size=400_000, running=False)
    batch = delete_batch(store.db, CUTOFF, message_bytes=1_000_000)
    assert (batch.deliveries, batch.more) == (2, True)  # a third would pass 1,000,000
    batch = delete_batch(store.db, CUTOFF, message_bytes=100)
    assert (batch.deliveries, batch.more) == (1, True)  # alone, over the limit
    remaining = [delete_batch(store.db, CUTOFF).deliveries for _ in range(2)]
    assert remaining == [3, 0]  # 2 done + 1 dropped fit in 1 MiB


# -- pages given back ---------------------------------------------------------------------


def test_deleted_rows_pages_are_given_back_and_the_file_shrinks(store: Store) -> None:
    assert schema.is_incremental(store.db)  # a new database is, from its first table
    seed(store, NOW, old_done=400, size=8000, running=False)
    full = file_bytes(store)
    assert full > 3_000_000
    given = 0
    while True:
        batch = delete_batch(store.db, CUTOFF)
        pages, left = reclaim(store.db)
        given += pages
        if not batch.more and not left:
            break
        assert pages <= retention.VACUUM_PAGES
    assert int(store.db.execute("PRAGMA freelist_count").fetchone()[0]) == 0
    assert given * schema.PAGE_SIZE > 3_000_000
    assert file_bytes(store) < full / 5


def test_a_database_that_is_not_incremental_reports_nothing_to_give_back(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute("PRAGMA auto_vacuum = NONE")
    db.execute("CREATE TABLE t (x)")  # the file's mode is fixed by its first table
    db.close()
    store = Store(path)
    try:
        seed(store, NOW, old_done=50, size=8000, running=False)
        delete_batch(store.db, CUTOFF)
        assert int(store.db.execute("PRAGMA freelist_count").fetchone()[0]) > 50
        assert reclaim(store.db) == (0, 0)  # nothing, and no "more" to spin on
    finally:
        store.close()


# -- when: the deadline -------------------------------------------------------------------


def test_the_next_expiry_is_the_oldest_finished_row_or_unclaimed_turn(store: Store) -> None:
    assert next_expiry(store.db) is None
    seed(store, NOW, running=False)
    assert next_expiry(store.db) == NOW - 30 * DAY + 1  # the old dropped row and turns
    delete_batch(store.db, CUTOFF)
    # Left: the dead row's turn (claimed, so not counted) and the rows done a day ago.
    assert next_expiry(store.db) == NOW - DAY + 1


QUICK = Pacing(start_delay=1.0, busy_gap=2.0, quiet_floor=60.0, defer=0.5, max_wait=5.0)


def clock_retention(store: Store, monkeypatch: pytest.MonkeyPatch, now: float) -> Retention:
    monkeypatch.setattr(time, "time", lambda: now)
    monkeypatch.setattr(time, "monotonic", lambda: 100.0)
    return Retention(store, lambda: KEEP_DAYS, RecordingJournal(), QUICK)


def test_a_due_batch_waits_for_an_idle_pass_never_runs_after_a_start(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(store, NOW, running=False)
    kept = clock_retention(store, monkeypatch, NOW)
    assert kept.deadline() == 101.0
    kept.on_pass(100.5, idle=True, started=False)  # not due yet
    kept.on_pass(101.0, idle=False, started=False)  # due, but a busy pass
    assert kept.deadline() == 101.5 and len(ids(store, "deliveries")) == 7
    kept.on_pass(101.5, idle=True, started=True)  # a pass that started a turn
    assert kept.deadline() == 102.0 and len(ids(store, "deliveries")) == 7
    kept.on_pass(102.0, idle=True, started=False)
    assert len(ids(store, "deliveries")) == 3
    # Caught up: next when the row done a day ago expires, six days on.
    assert kept.deadline() == 102.0 + 6 * DAY + 1


def test_a_gate_that_is_never_idle_still_runs_a_batch_but_never_after_a_start(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(store, NOW, old_done=300, running=False)
    kept = clock_retention(store, monkeypatch, NOW)
    mono = 101.0
    while mono < 105.9:  # busy passes: deferred until due 5 s
        kept.on_pass(mono, idle=False, started=False)
        mono += 0.5
    assert len(ids(store, "deliveries")) == 304
    kept.on_pass(106.0, idle=False, started=True)  # overdue, but this pass started one
    assert len(ids(store, "deliveries")) == 304
    kept.on_pass(106.5, idle=False, started=False)
    assert len(ids(store, "deliveries")) == 304 - 256
    assert kept.deadline() == 106.5 + QUICK.busy_gap  # more is due: the next batch soon


def test_an_empty_queue_sleeps_a_whole_retention(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = clock_retention(store, monkeypatch, NOW)
    assert kept.deadline() == 100.0 + KEEP_DAYS * DAY  # a row done from now expires then
    add(store, NOW)  # pending: it expires only once done
    kept.on_pass(101.0, idle=True, started=False)
    assert kept.deadline() == 100.0 + KEEP_DAYS * DAY


def test_a_disk_that_refuses_a_batch_is_said_once_and_tried_again_later(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(store, NOW, running=False)
    kept = clock_retention(store, monkeypatch, NOW)
    journal = kept.sink
    assert isinstance(journal, RecordingJournal)

    def full(*args: object, **kwargs: object) -> retention.Batch:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(retention, "delete_batch", full)
    kept.on_pass(101.0, idle=True, started=False)
    kept.on_pass(161.0, idle=True, started=False)
    assert kept.deadline() == 161.0 + QUICK.error_gap
    [refused] = journal.of(events.RetentionFailing)  # said once
    assert refused.level == "warning" and "disk is full" in refused.error
    monkeypatch.undo()
    monkeypatch.setattr(time, "time", lambda: NOW)
    kept.on_pass(221.0, idle=True, started=False)
    assert len(ids(store, "deliveries")) == 3
    assert len(journal.of(events.RetentionWorks)) == 1


def test_a_conversion_the_disk_refuses_is_a_warning_and_the_gate_starts_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute("PRAGMA auto_vacuum = NONE")
    db.execute("CREATE TABLE t (x)")
    db.close()
    store = Store(path)
    try:
        seed(store, time.time(), running=False)  # prepare() deletes by the real clock
        journal = RecordingJournal()
        kept = Retention(store, lambda: KEEP_DAYS, journal, QUICK)

        def full(*args: object, **kwargs: object) -> schema.Vacuum:
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(schema, "enable_incremental_vacuum", full)
        kept.prepare(lambda: None)  # raises nothing
        [conversion] = journal.of(events.VacuumConversion)
        assert conversion.level == "warning" and not conversion.done
        assert "disk is full" in conversion.text
        assert not schema.is_incremental(store.db)
        # The expired rows went before the conversion was tried, and a deadline is set.
        assert len(ids(store, "deliveries")) == 3 and kept.deadline() is not None
    finally:
        store.close()
