"""Schema versions and forward migrations, from a database written by volutectl 0.1.0.

tests/unit/data/queue-v1.sql is that release's own database (written by its Store, then
dumped by sqlite3): pending, held, backing-off, running, folded, done, dead and dropped
rows, and two open turns. Upgrading it must lose no row and change none.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from volutectl.errors import UnavailableError
from volutectl.schema import SCHEMA_VERSION
from volutectl.store import Store

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
        assert counts == {"done": 7, "dead": 1, "dropped": 1}, counts
        received = sorted(int(line) for line in ran.read_text().split())
        assert received == [1, 2, 3, 4, 5, 9]  # each once; 6 and 7 were settled before
        assert store.row(3).attempts == 0  # type: ignore[union-attr]  # never released
        assert store.row(4).attempts == 1  # type: ignore[union-attr]  # released, no status
    finally:
        harness.close()
