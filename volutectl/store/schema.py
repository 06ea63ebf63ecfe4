"""The queue database's shape: its schema, the migrations between versions, and the one
transaction helper every write goes through.

Schema 1 is what volutectl 0.1.0 wrote, before the database carried a version. Every
database, new or old, is built by running schema 1 and then each migration in turn, so
a new database and an upgraded one cannot drift apart.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from volutectl.errors import UnavailableError
from volutectl.faults import crash_point

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
    # 3 -> 4 (retention): done and dropped rows and ended turns are deleted
    # gate.retention_days after they finished (volutectl/store/retention.py). Partial indexes
    # hold only those rows: finding the oldest reads nothing else, and a row pays one
    # index entry when it finishes, not one per change of state on the handoff path.
    # A finished row without its time (none is known) is dated by its creation.
    # The free pages that deletion leaves are given back by incremental vacuum, which
    # an existing file takes up only through a VACUUM, outside any transaction: that is
    # enable_incremental_vacuum, not a step here.
    3: """
CREATE INDEX deliveries_finished ON deliveries(finished_at) WHERE state IN ('done', 'dropped');
CREATE INDEX turns_ended ON turns(ended_at) WHERE state = 'ended';
UPDATE deliveries SET finished_at = created_at
    WHERE state IN ('done', 'dropped') AND finished_at IS NULL;
UPDATE turns SET ended_at = started_at WHERE state = 'ended' AND ended_at IS NULL;
""",
    # 4 -> 5 (status): each mind's latest ended turn, which `volutectl status` shows, by
    # one index lookup per mind rather than a scan of every turn ever run (60 ms on x86
    # at 100,000 turns, in the gate's loop).
    4: """
CREATE INDEX turns_mind_ended ON turns(mind, ended_at);
""",
    # 5 -> 6 (a deep queue): deliveries_turn holds only rows that a turn carries or
    # carried. A new row has no turn, so its insert no longer writes a page of this
    # index too (bench/bench_admission.py, "writes"); `turn_id = ?` still finds it.
    5: """
DROP INDEX deliveries_turn;
CREATE INDEX deliveries_turn ON deliveries(turn_id) WHERE turn_id IS NOT NULL;
""",
    # 6 -> 7 (fair shares): the uid that delivered each row (SO_PEERCRED), for each uid's
    # quota of deliveries not yet done (volutectl/store/quotas.py). Rows from before have none
    # (NULL), and count against nobody. No index: the gate sums each uid's rows once at
    # start and then keeps the sums in memory.
    6: """
ALTER TABLE deliveries ADD COLUMN uid INTEGER;
""",
    # 7 -> 8 (client-chosen request ids): `deliver --request-id` lets a script name its
    # request ("nightly-2026-12-01"), so an id is unique per sender uid, not across the
    # host: two users' scripts may pick the same name, and one must never be answered
    # with the other's delivery. Random ids were unique anyway, so no row conflicts.
    7: """
DROP INDEX deliveries_request;
CREATE UNIQUE INDEX deliveries_request ON deliveries(uid, request_id)
    WHERE request_id IS NOT NULL;
""",
    # 8 -> 9 (who may interrupt): an --interrupt may cut short a turn that runs only its
    # sender's deliveries, or any turn if its sender was an admin when it delivered.
    # - admin: an interrupt's sender was root or in volute-admin then (0 for any other
    #   delivery: the group lookup is paid for interrupts only);
    # - cut: set in the fold's commit, the interrupt did cut its turn short. The ended
    #   turn's deliveries of that sender are done; the others' are tried again.
    # Rows from before have neither: a turn interrupted then, with no row cut, settles
    # as it did then (core/admission.py's `settle`).
    8: """
ALTER TABLE deliveries ADD COLUMN admin INTEGER NOT NULL DEFAULT 0;
ALTER TABLE deliveries ADD COLUMN cut INTEGER NOT NULL DEFAULT 0;
""",
    # 9 -> 10 (leases, issue 31): a lease's scope is a row of the turns table of kind
    # 'lease' (counted, adopted and stopped as a turn's scope is); each grant is a row of
    # `leases`: who holds it (uid), its token (the state directory is the gate's
    # alone, as the messages are), the request id that makes a
    # repeated acquire safe, whether it created its turn or joined a running one, and how
    # it ended. A waiting acquire has no row: it lives as long as its connection. Turns
    # from before are all of kind 'turn'. AUTOINCREMENT: retention deletes ended leases
    # with their turns, and sqlite_sequence keeps their ids from being given again.
    9: """
ALTER TABLE turns ADD COLUMN kind TEXT NOT NULL DEFAULT 'turn';
CREATE TABLE leases (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    turn_id INTEGER NOT NULL,
    mind TEXT NOT NULL,
    session TEXT NOT NULL,
    uid INTEGER NOT NULL,
    token TEXT NOT NULL,
    request_id TEXT,
    created INTEGER NOT NULL,
    granted_at REAL NOT NULL,
    ended_at REAL,
    reason TEXT
);
CREATE INDEX leases_open ON leases(turn_id) WHERE ended_at IS NULL;
""",
    # 10 -> 11 (the gate's own writes, issue 32): every commit writes each page it
    # changes to the WAL again, so each index a turn moves costs a page per commit.
    # - turns_open (state) served no query: open turns are found by a scan of `turns`
    #   (`state != ?` cannot seek), and its only reader was that scan's covering copy;
    #   a turn wrote it three times (start, release, settlement);
    # - turns_mind_ended holds only ended turns, all its reader (status's each mind's
    #   last turn) asks for: a turn's start no longer writes a NULL entry to it.
    10: """
DROP INDEX turns_open;
DROP INDEX turns_mind_ended;
CREATE INDEX turns_mind_ended ON turns(mind, ended_at) WHERE ended_at IS NOT NULL;
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
    (synchronous=NORMAL in WAL mode: safe against a crash of the gate, not a power cut).
    A durable commit tells `on_durable_commit` how many seconds its COMMIT took (its
    fsync, mostly)."""

    def __init__(
        self,
        db: sqlite3.Connection,
        *,
        durable: bool = True,
        on_durable_commit: Callable[[float], None] | None = None,
        on_commit: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.durable = durable
        self.on_durable_commit = on_durable_commit
        self.on_commit = on_commit
        self.clock = clock

    def __enter__(self) -> None:
        if not self.durable:
            self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None:
                began = self.clock()
                try:
                    self.db.execute("COMMIT")
                except sqlite3.Error:
                    # A failed COMMIT can leave the transaction open, and then every
                    # later BEGIN fails: the queue would refuse everything for good.
                    # The COMMIT's error is the one to raise, not the ROLLBACK's.
                    with contextlib.suppress(sqlite3.Error):
                        self._rollback()
                    raise
                if self.on_commit is not None:
                    self.on_commit()
                if self.durable and self.on_durable_commit is not None:
                    self.on_durable_commit(self.clock() - began)
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


# -- incremental vacuum (schema 4) -------------------------------------------------------
#
# Retention deletes rows; `PRAGMA incremental_vacuum` then gives their pages back to the
# file system. A new database is incremental from its first table (Store's open sets
# it first); an existing one takes it up only through a VACUUM, which rewrites the file
# and cannot run inside a transaction. What one VACUUM needs, measured on 100,000
# deliveries (docs/benchmarks.md, "Retention"): a copy of the live pages in SQLite's
# temporary directory and as much again in the WAL beside the database, at once (in its
# rollback journal when it changes the page size too, since schema 10: the same). So:
# - it runs at the gate's start, after the expired rows are deleted, so that it copies
#   only what is kept; and only if both directories have that space free;
# - it is atomic: a gate killed during it leaves the database as it was, and the next
#   start tries again. Each try is counted first; after VACUUM_ATTEMPTS that never
#   finished (a start timeout, the OOM killer), the gate stops trying and says how to
#   do it by hand. Meanwhile the gate works the same; only the file does not shrink.

INCREMENTAL = 2  # PRAGMA auto_vacuum's value for it
# The page size (issue 32: the gate's own writes). Each commit writes every page it
# changes to the WAL in full: a delivery changes ~4 pages (the table, deliveries_open,
# sqlite_sequence, and the pass's hold), a turn ~12. At 1 KiB a page that is 5 KiB and
# 15 KiB of WAL, against 17 and 50 at SQLite's 4 KiB (bench/bench_admission.py,
# section 4; docs/benchmarks.md). A new database takes it at its first table; one made
# before takes it in the same one VACUUM as incremental vacuum (`converted`).
PAGE_SIZE = 1024
VACUUM_ATTEMPTS = 3
VACUUM_SLACK_BYTES = 16 << 20  # free space kept beyond the measured need
MiB = 1 << 20


@dataclass(frozen=True)
class Vacuum:
    """What enable_incremental_vacuum did, as a line for the journal."""

    done: bool
    level: str
    message: str


def is_incremental(db: sqlite3.Connection) -> bool:
    return int(db.execute("PRAGMA auto_vacuum").fetchone()[0]) == INCREMENTAL


def page_size(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA page_size").fetchone()[0])


def converted(db: sqlite3.Connection) -> bool:
    """Whether the file has its final layout: incremental vacuum, PAGE_SIZE pages."""
    return is_incremental(db) and page_size(db) == PAGE_SIZE


def vacuum_attempts(db: sqlite3.Connection) -> int:
    found = db.execute("SELECT value FROM meta WHERE key = 'vacuum_attempts'").fetchone()
    return int(found[0]) if found else 0


def live_bytes(db: sqlite3.Connection) -> int:
    """The pages in use: what a VACUUM copies."""
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    free = db.execute("PRAGMA freelist_count").fetchone()[0]
    return int(pages - free) * int(db.execute("PRAGMA page_size").fetchone()[0])


def sqlite_temp_dir() -> Path:
    """Where SQLite's unix VFS puts temporary files: the first directory we may write."""
    candidates = (
        os.environ.get("SQLITE_TMPDIR"),
        os.environ.get("TMPDIR"),
        "/var/tmp",
        "/usr/tmp",
        "/tmp",
        ".",
    )
    for candidate in candidates:
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return Path(candidate)
    return Path(".")


def vacuum_space_missing(db: sqlite3.Connection, path: Path) -> str | None:
    """Why a VACUUM of `db` would not fit now (which directory, how much), or None."""
    need = live_bytes(db) + VACUUM_SLACK_BYTES
    temp, home = sqlite_temp_dir(), path.parent
    if os.stat(temp).st_dev == os.stat(home).st_dev:
        checks = [(home, 2 * need, f"{home} (and {temp}, on the same file system)")]
    else:
        checks = [(temp, need, f"{temp} (SQLite's temporary files)"), (home, need, str(home))]
    for place, needed, where in checks:
        stat = os.statvfs(place)
        free = stat.f_bavail * stat.f_frsize
        if free < needed:
            return f"it needs {needed / MiB:.0f} MiB free in {where}, which has {free / MiB:.0f}"
    return None


def enable_incremental_vacuum(
    db: sqlite3.Connection, path: Path, progress: Callable[[], None] = lambda: None
) -> Vacuum:
    """VACUUM the database into auto_vacuum=INCREMENTAL and PAGE_SIZE pages, if that is
    safe to try now.

    `progress` is called about once a second during the VACUUM."""
    if converted(db):
        return Vacuum(done=True, level="debug", message=f"{path}: gives back free pages already")
    manual = (
        f"stop volute-gate.service, run sqlite3 {path} 'PRAGMA journal_mode = DELETE; "
        f"PRAGMA page_size = {PAGE_SIZE}; PRAGMA auto_vacuum = INCREMENTAL; VACUUM; "
        "PRAGMA journal_mode = WAL', start it again"
    )
    attempts = vacuum_attempts(db)
    if attempts >= VACUUM_ATTEMPTS:
        return Vacuum(
            done=False,
            level="warning",
            message=f"{path} does not shrink: converting it was tried {attempts} times, "
            f"never to the end; by hand: {manual}",
        )
    missing = vacuum_space_missing(db, path)
    if missing is not None:
        return Vacuum(
            done=False,
            level="warning",
            message=f"{path} does not shrink yet: converting it to incremental vacuum is "
            f"left for a later start, as {missing}",
        )
    with Transaction(db):
        db.execute(
            "INSERT INTO meta (key, value) VALUES ('vacuum_attempts', 1) "
            "ON CONFLICT(key) DO UPDATE SET value = value + 1"
        )
    before, started = _file_bytes(path), time.monotonic()
    try:
        _vacuum(db, progress)
    except sqlite3.Error as error:
        return Vacuum(
            done=False,
            level="error",
            message=f"{path}: converting it to incremental vacuum failed (tried again at "
            f"the next start): {error}",
        )
    with Transaction(db):
        db.execute("DELETE FROM meta WHERE key = 'vacuum_attempts'")
    # The VACUUM went through the WAL, which keeps its size until truncated.
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return Vacuum(
        done=True,
        level="info",
        message=f"{path} now gives back free pages, in {PAGE_SIZE}-byte pages: converted "
        f"from {before / MiB:.1f} MiB to {_file_bytes(path) / MiB:.1f} MiB in "
        f"{time.monotonic() - started:.1f} s",
    )


def _vacuum(db: sqlite3.Connection, progress: Callable[[], None]) -> None:
    last = time.monotonic()

    def on_progress() -> int:
        nonlocal last
        crash_point("vacuuming")
        if time.monotonic() - last >= 1.0:
            progress()
            last = time.monotonic()
        return 0

    db.execute(f"PRAGMA auto_vacuum = {INCREMENTAL}")
    # A WAL database keeps its page size through a VACUUM: this one goes through a
    # rollback journal (as atomic: a kill leaves the journal, and the next open rolls
    # it back), and the file is WAL again after it, or at the next open if it was
    # killed (Store's open sets WAL).
    resize = page_size(db) != PAGE_SIZE
    if resize:
        db.execute("PRAGMA journal_mode=DELETE").fetchall()
        db.execute(f"PRAGMA page_size = {PAGE_SIZE}")
    db.set_progress_handler(on_progress, 10_000)
    try:
        db.execute("VACUUM")
    finally:
        db.set_progress_handler(None, 0)
        if resize:
            db.execute("PRAGMA journal_mode=WAL").fetchall()


def _file_bytes(path: Path) -> int:
    total = 0
    for suffix in ("", "-wal"):
        with contextlib.suppress(OSError):
            total += os.stat(f"{path}{suffix}").st_size
    return total
