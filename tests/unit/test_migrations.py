"""Schema versions and forward migrations, from a database written by volutectl 0.1.0.

tests/unit/data/queue-v1.sql is that release's own database (written by its Store, then
dumped by sqlite3): pending, held, backing-off, running, folded, done, dead and dropped
rows, and two open turns. Upgrading it must lose no row and change none.
"""

from __future__ import annotations

import os
import signal
import sqlite3
from pathlib import Path

import pytest

from tests.unit.retention_child import run_child
from volutectl.core import admission
from volutectl.errors import UnavailableError
from volutectl.states import Outcome, TurnKind
from volutectl.store import schema as queue_schema
from volutectl.store.indexed import IndexedStore
from volutectl.store.leases import LeaseRow
from volutectl.store.queue import AlreadyQueued, NewDelivery, RequestIdReused, Store
from volutectl.store.quotas import Usage
from volutectl.store.schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    enable_incremental_vacuum,
    is_incremental,
    statements,
    vacuum_attempts,
)

V1_DUMP = Path(__file__).parent / "data" / "queue-v1.sql"


def v1_database(path: Path) -> Path:
    db = sqlite3.connect(path)
    db.executescript(V1_DUMP.read_text())
    db.close()
    return path


def rows(path: Path, table: str) -> list[tuple[object, ...]]:
    db = sqlite3.connect(path)
    try:
        return list(db.execute(f"SELECT * FROM {table} ORDER BY id"))
    finally:
        db.close()


def schema(path: Path) -> dict[str, list[tuple[object, ...]]]:
    """Each table's columns (name, type, notnull, default, pk) and each index's columns."""
    db = sqlite3.connect(path)
    try:
        shape: dict[str, list[tuple[object, ...]]] = {}
        for kind, name in db.execute(
            "SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY name"
        ):
            pragma = "table_info" if kind == "table" else "index_info"
            shape[f"{kind} {name}"] = [tuple(r[1:]) for r in db.execute(f"PRAGMA {pragma}({name})")]
        return shape
    finally:
        db.close()


def test_a_v1_database_is_upgraded_with_every_row_kept(tmp_path: Path) -> None:
    path = v1_database(tmp_path / "queue.sqlite3")
    before = {"deliveries": rows(path, "deliveries"), "turns": rows(path, "turns")}
    assert len(before["deliveries"]) == 9 and len(before["turns"]) == 4

    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION
    store.close()

    for table, old in before.items():
        new = rows(path, table)
        # Old columns unchanged, in the same order; migrations only append columns.
        assert [r[: len(old[0])] for r in new] == old
    # The states the gate acts on survive as they were.
    store = Store(path)
    try:
        assert [r.id for r in store.pending()] == [1, 2, 9]
        assert [t.id for t in store.open_turns()] == [3, 4]
        assert store.counts() == {"pending": 3, "running": 3, "done": 1, "dead": 1, "dropped": 1}
    finally:
        store.close()


def test_an_upgraded_database_has_the_schema_of_a_new_one(tmp_path: Path) -> None:
    upgraded = v1_database(tmp_path / "old.sqlite3")
    Store(upgraded).close()
    fresh = tmp_path / "new.sqlite3"
    Store(fresh).close()
    assert schema(upgraded) == schema(fresh)
    assert "index deliveries_request" in schema(fresh)


def test_migrations_run_once(tmp_path: Path) -> None:
    path = v1_database(tmp_path / "queue.sqlite3")
    first = Store(path)
    assert first.migrate() == []  # the open already did it
    first.close()
    again = Store(path)
    assert again.schema_version() == SCHEMA_VERSION
    again.close()


def test_a_new_database_starts_at_the_current_version(tmp_path: Path) -> None:
    store = Store(tmp_path / "queue.sqlite3")
    assert store.schema_version() == SCHEMA_VERSION
    store.close()


def test_a_database_from_a_newer_volutectl_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "queue.sqlite3"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(UnavailableError, match=f"schema {SCHEMA_VERSION + 1}, newer"):
        Store(path)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    db.close()


def test_a_gate_on_an_upgraded_database_runs_each_pending_delivery_once(tmp_path: Path) -> None:
    # The real gate, in-process, opens the 0.1.0 database: its open turns had no scope
    # left (the machine rebooted into the new release), so turn 3 (released) counts one
    # failed attempt and turn 4 (never released) returns its delivery unattempted; then
    # every pending delivery runs, each exactly once.
    from tests.unit.gate_harness import Harness

    (tmp_path / "state").mkdir()
    v1_database(tmp_path / "state" / "queue.sqlite3")
    ran = tmp_path / "ran"
    record = f"sed -n 's/.*\"id\": *\\([0-9]*\\).*/\\1/p' >> {ran}"
    harness = Harness(
        tmp_path,
        minds={"mimsy": record, "whorl": record, "pip": record},
        backoff_initial_seconds=0.05,
        backoff_max_seconds=0.05,
    )
    store = harness.gate.state.store
    try:
        harness.pump(lambda: not store.pending() and not store.open_turns(), timeout=20)
        counts = store.counts()
        # The 0.1.0 rows that had finished (done 6, dropped 8) did so in 2023: past
        # gate.retention_days, the gate's start deleted them.
        assert counts == {"done": 6, "dead": 1}, counts
        assert store.row(6) is None and store.row(8) is None
        received = sorted(int(line) for line in ran.read_text().split())
        assert received == [1, 2, 3, 4, 5, 9]  # each once; 6 and 7 were settled before
        assert store.row(3).attempts == 0  # type: ignore[union-attr]  # never released
        assert store.row(4).attempts == 1  # type: ignore[union-attr]  # released, no status
    finally:
        harness.close()


# -- schema 4: retention's indexes, and incremental vacuum ---------------------------------

OLD_DONE = 1500  # done rows of 4 KiB each, finished long ago, beside the v1 rows


def v3_database(path: Path) -> Path:
    """A database as schema 3 left it (not incremental: no schema before 4 asked), with
    the 0.1.0 rows and OLD_DONE more done rows and their ended turns."""
    v1_database(path)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN")
    for version in (1, 2):
        for statement in statements(MIGRATIONS[version]):
            db.execute(statement)
    db.execute("PRAGMA user_version = 3")
    for n in range(OLD_DONE):
        turn = db.execute(
            "INSERT INTO turns (mind, session, unit, state, released, started_at, ended_at, "
            "outcome, exit_status) VALUES ('mimsy', 'bulk', 'u', 'ended', 1, ?, ?, 'ok', 0)",
            (1_700_000_000.0 + n, 1_700_000_001.0 + n),
        ).lastrowid
        db.execute(
            "INSERT INTO deliveries (mind, session, message, state, created_at, turn_id, "
            "finished_at) VALUES ('mimsy', 'bulk', ?, 'done', ?, ?, ?)",
            (bytes([n % 251]) * 4096, 1_700_000_000.0 + n, turn, 1_700_000_001.0 + n),
        )
    db.execute("COMMIT")
    db.execute("PRAGMA journal_mode=WAL")
    assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    db.close()
    return path


def table_rows(path: Path) -> dict[str, list[tuple[object, ...]]]:
    return {table: rows(path, table) for table in ("deliveries", "turns")}


def same_rows(
    after: dict[str, list[tuple[object, ...]]], before: dict[str, list[tuple[object, ...]]]
) -> bool:
    """Every row kept with its values; a later migration may only append columns."""
    return all(
        [row[: len(old[0])] if old else row for row in after[table]] == old
        for table, old in before.items()
    )


def test_a_schema_3_database_is_upgraded_with_every_row_kept_and_then_made_incremental(
    tmp_path: Path,
) -> None:
    path = v3_database(tmp_path / "queue.sqlite3")
    before = table_rows(path)
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION == 11
        assert not is_incremental(store.db)  # the migration itself never VACUUMs
        assert same_rows(table_rows(path), before)
        outcome = enable_incremental_vacuum(store.db, path)
        assert (outcome.done, outcome.level) == (True, "info"), outcome
        assert "now gives back free pages, in 1024-byte pages" in outcome.message
        assert is_incremental(store.db)
        assert queue_schema.page_size(store.db) == queue_schema.PAGE_SIZE == 1024
        assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert vacuum_attempts(store.db) == 0  # the count is cleared once it worked
        assert os.path.getsize(f"{path}-wal") == 0  # the VACUUM's WAL is truncated
    finally:
        store.close()
    assert same_rows(table_rows(path), before)
    assert check(path) == "ok"


def test_a_vacuum_that_would_not_fit_is_left_for_later_and_counts_no_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = v3_database(tmp_path / "queue.sqlite3")
    store = Store(path)
    try:
        live = queue_schema.live_bytes(store.db)
        assert live > OLD_DONE * 4096
        monkeypatch.setattr(queue_schema, "VACUUM_SLACK_BYTES", 1 << 60)  # no disk is that free
        outcome = enable_incremental_vacuum(store.db, path)
        assert (outcome.done, outcome.level) == (False, "warning")
        assert "left for a later start, as it needs" in outcome.message
        assert str(queue_schema.sqlite_temp_dir()) in outcome.message
        assert not is_incremental(store.db) and vacuum_attempts(store.db) == 0
    finally:
        store.close()


def test_the_space_a_vacuum_needs_is_its_live_pages_in_both_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLite's temporary copy and the WAL: each the live pages (measured: 0.93x and
    # 1.0x), on one file system twice over.
    path = v3_database(tmp_path / "queue.sqlite3")
    store = Store(path)
    try:
        need = queue_schema.live_bytes(store.db) + queue_schema.VACUUM_SLACK_BYTES
        free = {"same": 2 * need - 4096}

        def statvfs(place: object) -> os.statvfs_result:
            return os.statvfs_result((4096, 1, 0, 0, free["same"], 0, 0, 0, 0, 255))

        monkeypatch.setattr(os, "statvfs", statvfs)
        assert "it needs" in (queue_schema.vacuum_space_missing(store.db, path) or "")
        free["same"] = 2 * need
        assert queue_schema.vacuum_space_missing(store.db, path) is None
    finally:
        store.close()


def test_after_vacuum_attempts_that_never_finished_the_gate_stops_trying(
    tmp_path: Path,
) -> None:
    path = v3_database(tmp_path / "queue.sqlite3")
    store = Store(path)
    try:
        store.db.execute(
            "INSERT INTO meta (key, value) VALUES ('vacuum_attempts', ?)",
            (queue_schema.VACUUM_ATTEMPTS,),
        )
        outcome = enable_incremental_vacuum(store.db, path)
        assert (outcome.done, outcome.level) == (False, "warning")
        assert "tried 3 times, never to the end; by hand: stop volute-gate" in outcome.message
        assert "PRAGMA auto_vacuum = INCREMENTAL; VACUUM" in outcome.message
        assert not is_incremental(store.db)
    finally:
        store.close()


def test_a_sigkill_during_the_vacuum_leaves_every_row_and_the_next_start_finishes_it(
    tmp_path: Path,
) -> None:
    path = v3_database(tmp_path / "queue.sqlite3")
    Store(path).close()  # schema 4, not yet incremental
    before = table_rows(path)
    killed = run_child(["vacuum", str(path)], crash_at="vacuuming")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    # Killed mid-VACUUM, which goes through a rollback journal to change the page size
    # (the WAL is gone with the switch): none of it committed, and the next open rolls
    # back whatever the journal holds.
    assert not os.path.exists(f"{path}-wal")
    assert os.path.getsize(f"{path}-journal") > 1 << 20  # a hot journal: half copied back
    assert check(path) == "ok"
    assert same_rows(table_rows(path), before)
    store = Store(path)
    try:
        assert not is_incremental(store.db)
        assert vacuum_attempts(store.db) == 1  # counted before it began
        assert enable_incremental_vacuum(store.db, path).done
        assert is_incremental(store.db) and vacuum_attempts(store.db) == 0
    finally:
        store.close()
    assert same_rows(table_rows(path), before)


# -- schema 5: status's index on each mind's ended turns ---------------------------------


def test_a_schema_4_database_gets_the_last_turn_index_and_status_uses_it(
    tmp_path: Path,
) -> None:
    """Retention's schema (4) and then status's index (5), in that order: a database the
    retention release left is upgraded in place, its rows kept, and each mind's last
    turn is then one lookup in turns(mind, ended_at), not retention's turns_ended or a
    scan of every turn."""
    path = v3_database(tmp_path / "queue.sqlite3")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN")
    for statement in statements(MIGRATIONS[3]):
        db.execute(statement)
    db.execute("PRAGMA user_version = 4")
    db.execute("COMMIT")
    db.close()
    assert "index turns_mind_ended" not in schema(path)
    before = table_rows(path)
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION == 11
        assert "index turns_mind_ended" in schema(path)
        assert "index turns_ended" in schema(path)  # retention's, kept
        plan = " ".join(
            str(row[-1])
            for row in store.db.execute(
                "EXPLAIN QUERY PLAN SELECT id, outcome, ended_at FROM turns WHERE mind = ? "
                "AND ended_at IS NOT NULL ORDER BY ended_at DESC LIMIT 1",
                ("mimsy",),
            )
        )
        assert "USING INDEX turns_mind_ended" in plan, plan
        last = store.minds.last_turns(["mimsy"])["mimsy"]
        assert last.ended_at == 1_700_000_001.0 + OLD_DONE - 1
    finally:
        store.close()
    assert same_rows(table_rows(path), before)


def index_sql(path: Path, name: str) -> str:
    db = sqlite3.connect(path)
    try:
        row = db.execute("SELECT sql FROM sqlite_master WHERE name = ?", (name,)).fetchone()
        return str(row[0])
    finally:
        db.close()


def test_a_schema_5_database_keeps_its_rows_and_indexes_only_rows_with_a_turn(
    tmp_path: Path,
) -> None:
    """The deep-queue step (6): deliveries_turn becomes partial. A new row (no turn yet)
    then writes no page of it, and both of its queries still search it."""
    path = v3_database(tmp_path / "queue.sqlite3")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN")
    for version in (3, 4):
        for statement in statements(MIGRATIONS[version]):
            db.execute(statement)
    db.execute("PRAGMA user_version = 5")
    db.execute("COMMIT")
    db.close()
    assert "WHERE turn_id IS NOT NULL" not in index_sql(path, "deliveries_turn")
    before = table_rows(path)
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION == 11
        assert "WHERE turn_id IS NOT NULL" in index_sql(path, "deliveries_turn")
        for query in (
            "SELECT id FROM deliveries WHERE turn_id = ? AND state = 'running'",
            "SELECT 1 FROM turns WHERE NOT EXISTS "
            "(SELECT 1 FROM deliveries WHERE deliveries.turn_id = turns.id)",
        ):
            params = (1,) if "?" in query else ()
            plan = " ".join(
                str(r[-1]) for r in store.db.execute("EXPLAIN QUERY PLAN " + query, params)
            )
            assert "INDEX deliveries_turn" in plan, plan
        carried = store.db.execute(
            "SELECT COUNT(*) FROM deliveries INDEXED BY deliveries_turn WHERE turn_id IS NOT NULL"
        ).fetchone()[0]
        assert (
            carried
            == store.db.execute(
                "SELECT COUNT(*) FROM deliveries WHERE turn_id IS NOT NULL"
            ).fetchone()[0]
        )
    finally:
        store.close()
    assert same_rows(table_rows(path), before)


def check(path: Path) -> str:
    db = sqlite3.connect(path)
    try:
        return str(db.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        db.close()


def test_a_schema_6_database_gets_a_uid_column_and_its_rows_count_against_nobody(
    tmp_path: Path,
) -> None:
    """The fair-shares step (7): each delivery's sender, for its uid's quota. Rows from
    before have none; the gate's sums count them against nobody, and new rows count."""
    path = v3_database(tmp_path / "queue.sqlite3")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN")
    for version in (3, 4, 5):
        for statement in statements(MIGRATIONS[version]):
            db.execute(statement)
    db.execute("PRAGMA user_version = 6")
    db.execute("COMMIT")
    db.close()
    before = table_rows(path)
    assert ("uid", "INTEGER", 0, None, 0) not in schema(path)["table deliveries"]
    store = IndexedStore(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION == 11
        assert ("uid", "INTEGER", 0, None, 0) in schema(path)["table deliveries"]
        counted = "SELECT COUNT(*) FROM deliveries WHERE uid IS NOT NULL"
        assert store.db.execute(counted).fetchone() == (0,)
        assert store.usages.by_uid == {}
        [new] = store.add_deliveries([NewDelivery("mimsy", "main", b"four", uid=1000)])
        assert store.db.execute("SELECT uid FROM deliveries WHERE id = ?", (new,)).fetchone() == (
            1000,
        )
        assert store.usages.of(1000) == Usage(1, 4) == store.load_usages().of(1000)
    finally:
        store.close()
    after = table_rows(path)
    after["deliveries"] = [row for row in after["deliveries"] if row[0] != new]
    assert same_rows(after, before)
    uid_column = len(before["deliveries"][0])  # the first column appended after these
    assert all(row[uid_column] is None for row in after["deliveries"])


def test_a_schema_7_database_keeps_request_ids_unique_per_sender_uid(tmp_path: Path) -> None:
    """The client-chosen request ids step (8): an id is its sender's, so two users' scripts
    may pick one name; the same uid's id sent again still gives its delivery back."""
    path = v3_database(tmp_path / "queue.sqlite3")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN")
    for version in (3, 4, 5, 6):
        for statement in statements(MIGRATIONS[version]):
            db.execute(statement)
    db.execute("PRAGMA user_version = 7")
    db.execute("COMMIT")
    db.close()
    before = table_rows(path)
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION == 11
        nightly = [
            NewDelivery("mimsy", "main", b"backup", request_id="nightly-1", uid=uid)
            for uid in (1000, 1001, 1000)
        ]
        first, other, again = store.add_deliveries(nightly)
        assert first != other  # another uid's id of the same name is its own
        assert again == first and isinstance(again, AlreadyQueued)
        assert not isinstance(first, AlreadyQueued)
        [reused] = store.add_deliveries(
            [NewDelivery("mimsy", "main", b"restore", request_id="nightly-1", uid=1001)]
        )
        assert isinstance(reused, RequestIdReused) and reused.delivery_id == other
    finally:
        store.close()
    after = table_rows(path)
    after["deliveries"] = [row for row in after["deliveries"] if row[0] not in (first, other)]
    assert same_rows(after, before)


def test_a_schema_8_database_gets_who_may_interrupt_and_an_interrupted_turn_settles_as_then(
    tmp_path: Path,
) -> None:
    """The who-may-interrupt step (9): each interrupt's sender's admin-ness, and whether
    it cut its turn short. Rows from before have neither; a turn an older gate
    interrupted (no row says who cut it) is done whole, as it was then."""
    path = v3_database(tmp_path / "queue.sqlite3")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN")
    for version in (3, 4, 5, 6, 7):
        for statement in statements(MIGRATIONS[version]):
            db.execute(statement)
    db.execute("PRAGMA user_version = 8")
    db.execute("COMMIT")
    db.close()
    before = table_rows(path)
    columns = schema(path)["table deliveries"]
    assert not any(column[0] in ("admin", "cut") for column in columns)
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION == 11
        columns = schema(path)["table deliveries"]
        assert ("admin", "INTEGER", 1, "0", 0) in columns
        assert ("cut", "INTEGER", 1, "0", 0) in columns
        [turn] = store.open_turns()[:1]
        running = store.rows_of_turn(turn.id)
        assert running and not any(row.cut or row.admin for row in running)
        sent = [row.as_sent() for row in running]
        settled = admission.settle(Outcome.INTERRUPTED, sent)
        assert settled.done == tuple(row.id for row in running) and not settled.failed
        [new] = store.add_deliveries(
            [NewDelivery("mimsy", "main", b"stop", interrupt=True, uid=0, admin=True)]
        )
        assert isinstance(new, int)
        row = store.row(new)
        assert row is not None and row.admin and not row.cut
    finally:
        store.close()
    after = table_rows(path)
    after["deliveries"] = [row for row in after["deliveries"] if row[0] != new]
    assert same_rows(after, before)


def test_a_schema_9_database_gets_lease_turns_and_a_leases_table_and_keeps_its_turns(
    tmp_path: Path,
) -> None:
    """The leases step (10, issue 31): each turn row gets a kind, 'turn' for every turn
    from before; a `leases` table holds grants. An open turn of before is still a command
    turn after it, and a lease granted on the upgraded database is a turn of kind 'lease'."""
    path = v3_database(tmp_path / "queue.sqlite3")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN")
    for version in (3, 4, 5, 6, 7, 8):
        for statement in statements(MIGRATIONS[version]):
            db.execute(statement)
    db.execute("PRAGMA user_version = 9")
    db.execute("COMMIT")
    db.close()
    before = table_rows(path)
    assert not any(column[0] == "kind" for column in schema(path)["table turns"])
    assert "table leases" not in schema(path)
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION == 11
        assert ("kind", "TEXT", 1, "'turn'", 0) in schema(path)["table turns"]
        assert "table leases" in schema(path)
        assert store.open_turns() and all(t.kind is TurnKind.TURN for t in store.open_turns())
        assert store.leases.open() == [] and store.leases.last_id() == 0
        lease = LeaseRow(1, 0, "mimsy", "main", 1001, "ab" * 16, None, True, 5.0)
        turn_id = store.leases.grant(lease, unit_for=lambda tid: f"volute-turn-mimsy-{tid}.scope")
        turn = store.turn(turn_id)
        assert turn is not None and turn.kind is TurnKind.LEASE
        assert [row.turn_id for row in store.leases.open()] == [turn_id]
    finally:
        store.close()
    after = table_rows(path)
    after["turns"] = [row for row in after["turns"] if row[0] != turn_id]
    after.pop("leases", None)
    assert same_rows(after, before)


def test_an_incremental_database_of_4k_pages_is_converted_to_small_pages_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database the previous version made (incremental already, SQLite's 4 KiB pages)
    takes schema.PAGE_SIZE in the same one VACUUM, every row kept, WAL again after."""
    path = tmp_path / "queue.sqlite3"
    monkeypatch.setattr(queue_schema, "PAGE_SIZE", 4096)
    monkeypatch.setattr("volutectl.store.queue.PAGE_SIZE", 4096)
    old = Store(path)
    old.add_deliveries([NewDelivery("m", f"s{n}", b"x" * 300) for n in range(500)], now=1.0)
    assert queue_schema.page_size(old.db) == 4096 and is_incremental(old.db)
    old.close()
    monkeypatch.undo()
    before = table_rows(path)
    store = Store(path)
    try:
        assert queue_schema.page_size(store.db) == 4096  # an open keeps the file's
        assert not queue_schema.converted(store.db)
        outcome = enable_incremental_vacuum(store.db, path)
        assert outcome.done, outcome
        assert queue_schema.page_size(store.db) == 1024 and queue_schema.converted(store.db)
        assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert enable_incremental_vacuum(store.db, path).level == "debug"  # once
    finally:
        store.close()
    assert same_rows(table_rows(path), before)
    assert check(path) == "ok"
