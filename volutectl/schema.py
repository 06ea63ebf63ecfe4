"""The queue database's shape: its schema, the migrations between versions, and the one
transaction helper every write goes through.

Schema 1 is what volutectl 0.1.0 wrote, before the database carried a version. Every
database, new or old, is built by running schema 1 and then each migration in turn, so
a new database and an upgraded one cannot drift apart.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable
from pathlib import Path

from volutectl.errors import UnavailableError

# Schema 1: volutectl 0.1.0, written before the database carried a version. Every
# database, new or old, is built by running this and then each migration in turn, so a
# fresh database and an upgraded one cannot drift apart.
SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS deliveries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    mind TEXT NOT NULL,
    session TEXT NOT NULL,
    message BLOB NOT NULL,
    interrupt INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'pending',   -- pending, running, done, dead, dropped
    attempts INTEGER NOT NULL DEFAULT 0,
    not_before REAL,                         -- backoff after a failure
    created_at REAL NOT NULL,
    held_since REAL,                         -- set while the gate holds the row
    hold_reason TEXT,
    held_ms INTEGER NOT NULL DEFAULT 0,      -- total time held, over all holds
    turn_id INTEGER,                         -- the turn carrying it (running) or that ran it
    folded INTEGER NOT NULL DEFAULT 0,       -- handed to a live turn's inbox
    last_error TEXT,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS deliveries_open ON deliveries(state, id);
CREATE INDEX IF NOT EXISTS deliveries_turn ON deliveries(turn_id);
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    mind TEXT NOT NULL,
    session TEXT NOT NULL,
    unit TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL DEFAULT 'starting',  -- starting, running, ended
    released INTEGER NOT NULL DEFAULT 0,     -- the command was allowed to exec
    started_at REAL NOT NULL,
    ended_at REAL,
    outcome TEXT,                            -- ok, failed, never_ran, start_failed
    exit_status INTEGER,
    detail TEXT
);
CREATE INDEX IF NOT EXISTS turns_open ON turns(state);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""

# Forward migrations: MIGRATIONS[n] takes a database from schema n to n + 1. They run at
# gate start (any Store open), each in one transaction with its new user_version.
MIGRATIONS: dict[int, str] = {
    # 1 -> 2 (the wedge-proof gate):
    # - request_id: made by the client, so a request retried after the gate died before
    #   acknowledging it gets its original delivery id back instead of a second row;
    # - turns.pid: the turn's main process (the wrapper), to watch an adopted turn;
    # - turns.interrupted: the gate sent SIGINT for an --interrupt delivery; a restarted
    #   gate must still count a non-zero exit as interrupted, not failed;
    # - turns.deadline: when turns.max_runtime_seconds runs out (NULL: no limit);
    # - turns.timed_out_at: when the gate stopped the turn for running past it.
    1: """
ALTER TABLE deliveries ADD COLUMN request_id TEXT;
CREATE UNIQUE INDEX deliveries_request ON deliveries(request_id) WHERE request_id IS NOT NULL;
ALTER TABLE turns ADD COLUMN pid INTEGER;
ALTER TABLE turns ADD COLUMN interrupted INTEGER NOT NULL DEFAULT 0;
ALTER TABLE turns ADD COLUMN deadline REAL;
ALTER TABLE turns ADD COLUMN timed_out_at REAL;
""",
    # 2 -> 3 (operating): paused minds, durable across restarts; mind '*' is every mind,
    # minds added to the config later included.
    2: """
CREATE TABLE paused (mind TEXT PRIMARY KEY, since REAL NOT NULL);
""",
    # 3 -> 4 (status): each mind's latest ended turn, which `volutectl status` shows, by
    # one index lookup per mind rather than a scan of every turn ever run (60 ms on x86
    # at 100,000 turns, in the gate's loop).
    3: """
CREATE INDEX turns_mind_ended ON turns(mind, ended_at);
""",
}
SCHEMA_VERSION = 1 + len(MIGRATIONS)


def statements(script: str) -> list[str]:
    """Split a schema script into statements (executescript would commit on its own)."""
    statements, buffer = [], ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            statements.append(buffer.strip())
            buffer = ""
    return [statement for statement in statements if statement]


def migrate(db: sqlite3.Connection, path: Path) -> list[int]:
    """Bring the database to SCHEMA_VERSION; returns the versions it passed through.

    Version 0 is either a new, empty file or a 0.1.0 database (schema 1, which set no
    version): SCHEMA_V1's CREATE ... IF NOT EXISTS serves both. A database from a newer
    volutectl is refused rather than guessed at.
    """
    passed: list[int] = []
    while True:
        # Each step reads the version inside its own write transaction, so two processes
        # opening the same old database cannot both run one migration.
        with Transaction(db):
            version = schema_version(db)
            if version > SCHEMA_VERSION:
                raise UnavailableError(
                    f"{path}: the queue database has schema {version}, newer than this "
                    f"volutectl's {SCHEMA_VERSION}",
                    hint="a newer volutectl wrote it: upgrade volutectl again, not down",
                )
            if version == SCHEMA_VERSION:
                return passed
            script = SCHEMA_V1 if version == 0 else MIGRATIONS[version]
            for statement in statements(script):
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {version + 1}")
        if version > 0:
            passed.append(version + 1)


def schema_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


class Transaction:
    """BEGIN IMMEDIATE ... COMMIT; with durable=False, that one commit skips the fsync
    (synchronous=NORMAL in WAL mode: safe against a crash of the gate, not a power cut)."""

    def __init__(
        self,
        db: sqlite3.Connection,
        *,
        durable: bool = True,
        on_durable_commit: Callable[[], None] | None = None,
    ) -> None:
        self.db = db
        self.durable = durable
        self.on_durable_commit = on_durable_commit

    def __enter__(self) -> None:
        if not self.durable:
            self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None:
                try:
                    self.db.execute("COMMIT")
                except sqlite3.Error:
                    # A failed COMMIT can leave the transaction open, and then every
                    # later BEGIN fails: the queue would refuse everything for good.
                    # The COMMIT's error is the one to raise, not the ROLLBACK's.
                    with contextlib.suppress(sqlite3.Error):
                        self._rollback()
                    raise
                if self.durable and self.on_durable_commit is not None:
                    self.on_durable_commit()
            else:
                self._rollback()
        finally:
            if not self.durable:
                self.db.execute("PRAGMA synchronous=FULL")

    def _rollback(self) -> None:
        # SQLite rolls back by itself on some errors (SQLITE_FULL, SQLITE_IOERR): a
        # second ROLLBACK would fail, and its error would hide the one that matters.
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
