"""The durable delivery queue: the only module that writes SQL.

SQLite in WAL mode with synchronous=FULL: a delivery is acknowledged only after the
commit that holds it has reached the disk, because the incident this tool exists for
ended in a power cycle. Deliveries that arrive together share one commit (group
commit), which keeps durability affordable on a 60-IOPS SD card.

The store is the truth for what was asked; systemd is the truth for what runs.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from volutectl.core import Delivery
from volutectl.errors import DataError, PermissionDeniedError, UnavailableError

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
}
SCHEMA_VERSION = 1 + len(MIGRATIONS)


class RequestIdReused(DataError):
    """A request id the store holds, sent again with another mind, session, message or
    interrupt flag: never a retry, so it is refused (65) rather than merged."""

    def __init__(self, request_id: str, delivery_id: int) -> None:
        super().__init__(
            f"request id {request_id} was already used for delivery {delivery_id}, "
            "with other content",
            hint="a client makes a new random request id for each new message",
        )
        self.request_id = request_id
        self.delivery_id = delivery_id


@dataclass(frozen=True)
class Row:
    id: int
    mind: str
    session: str
    message: bytes
    interrupt: bool
    state: str
    attempts: int
    not_before: float | None
    created_at: float
    held_since: float | None
    hold_reason: str | None
    held_ms: int
    turn_id: int | None
    folded: bool
    last_error: str | None

    def as_delivery(self) -> Delivery:
        return Delivery(self.id, self.mind, self.session, self.interrupt, self.not_before)


@dataclass(frozen=True)
class TurnRow:
    id: int
    mind: str
    session: str
    unit: str
    state: str
    released: bool
    started_at: float
    ended_at: float | None
    outcome: str | None
    exit_status: int | None
    detail: str | None
    pid: int | None = None  # the turn's main process (its wrapper), once released
    interrupted: bool = False  # the gate sent it SIGINT for an --interrupt delivery
    deadline: float | None = None  # when its max runtime runs out (None: no limit)
    timed_out_at: float | None = None  # when the gate stopped it for running past that


_ROW_COLUMNS = (
    "id, mind, session, message, interrupt, state, attempts, not_before, created_at, "
    "held_since, hold_reason, held_ms, turn_id, folded, last_error"
)
_TURN_COLUMNS = (
    "id, mind, session, unit, state, released, started_at, ended_at, outcome, exit_status, "
    "detail, pid, interrupted, deadline, timed_out_at"
)


def _statements(script: str) -> list[str]:
    """Split a schema script into statements (executescript would commit on its own)."""
    statements, buffer = [], ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            statements.append(buffer.strip())
            buffer = ""
    return [statement for statement in statements if statement]


def _row(v: Sequence[Any]) -> Row:
    return Row(
        int(v[0]), str(v[1]), str(v[2]), bytes(v[3]), bool(v[4]), str(v[5]), int(v[6]), v[7],
        float(v[8]), v[9], v[10], int(v[11]), v[12], bool(v[13]), v[14],
    )  # fmt: skip


def _turn(v: Sequence[Any]) -> TurnRow:
    return TurnRow(
        int(v[0]), str(v[1]), str(v[2]), str(v[3]), str(v[4]), bool(v[5]), float(v[6]),
        v[7], v[8], v[9], v[10], v[11], bool(v[12]), v[13], v[14],
    )  # fmt: skip


class Store:
    """One connection to the queue database. Every method commits before it returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._unsynced = False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(path), isolation_level=None, timeout=10)
        except PermissionError:
            raise PermissionDeniedError(f"{path}: cannot create the queue database") from None
        except (sqlite3.Error, OSError) as error:
            raise UnavailableError(f"{path}: cannot open the queue database: {error}") from None
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.migrate()
        except sqlite3.OperationalError as error:
            raise UnavailableError(f"{path}: cannot use the queue database: {error}") from None

    def schema_version(self) -> int:
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    def migrate(self) -> list[int]:
        """Bring the database to SCHEMA_VERSION; returns the versions it passed through.

        Version 0 is either a new, empty file or a 0.1.0 database (schema 1, which set no
        version): SCHEMA_V1's CREATE ... IF NOT EXISTS serves both. A database from a newer
        volutectl is refused rather than guessed at.
        """
        passed: list[int] = []
        while True:
            # Each step reads the version inside its own write transaction, so two
            # processes opening the same old database cannot both run one migration.
            with self._tx():
                version = self.schema_version()
                if version > SCHEMA_VERSION:
                    raise UnavailableError(
                        f"{self.path}: the queue database has schema {version}, newer than "
                        f"this volutectl's {SCHEMA_VERSION}",
                        hint="a newer volutectl wrote it: upgrade volutectl again, not down",
                    )
                if version == SCHEMA_VERSION:
                    return passed
                script = SCHEMA_V1 if version == 0 else MIGRATIONS[version]
                for statement in _statements(script):
                    self.db.execute(statement)
                self.db.execute(f"PRAGMA user_version = {version + 1}")
            if version > 0:
                passed.append(version + 1)

    def close(self) -> None:
        self.db.close()

    def _tx(self, *, durable: bool = True) -> _Transaction:
        return _Transaction(self.db, durable=durable, on_durable_commit=self._synced)

    def _synced(self) -> None:
        self._unsynced = False  # a synced commit's fsync covers every earlier WAL frame

    def settle_turn(
        self,
        turn_id: int,
        *,
        outcome: str,
        exit_status: int | None,
        detail: str,
        done: Sequence[int],
        returned: Sequence[int],
        failed: Iterable[tuple[int, str, int, float | None]],
        error: str,
        now: float,
        durable: bool = True,
    ) -> None:
        """Record how a turn ended and settle all its rows, in ONE commit.

        With durable=False the commit skips its fsync and `sync_pending()` turns true: the
        caller promises `sync()` before it sleeps. On the handoff path the next turn's
        start_turn commit comes first and, the WAL being sequential, its one fsync makes
        both durable; a pass that starts nothing pays the fsync in sync() instead.
        """
        with self._tx(durable=durable):
            self._return_to_pending(returned)
            self._finish_rows(done, now)
            self._fail_rows(failed, error, now)
            self._end_turn(turn_id, outcome, exit_status, detail, now)
        if not durable:
            self._unsynced = True

    def sync_pending(self) -> bool:
        return self._unsynced

    def sync(self) -> None:
        """Make every earlier commit durable, if one was made without an fsync to keep."""
        if self._unsynced:
            with self._tx():
                self.db.execute(
                    "INSERT INTO meta (key, value) VALUES ('syncs', 1) "
                    "ON CONFLICT(key) DO UPDATE SET value = value + 1"
                )

    # -- deliveries -------------------------------------------------------------

    def add_deliveries(
        self,
        items: Iterable[tuple[str, str, bytes, bool]],
        now: float | None = None,
        *,
        request_ids: Sequence[str | None] | None = None,
    ) -> list[int | RequestIdReused]:
        """Insert (mind, session, message, interrupt) rows in ONE durable commit.

        `request_ids` (one per item, None for a request that carries none) makes a retry
        harmless: a request id the store already holds, with the same mind, session,
        message and interrupt flag, inserts nothing and gives back the ORIGINAL delivery
        id, whatever state that delivery is in by now. The same id twice in one batch is
        the same request twice. The same id with other content is refused: that item's
        result is a RequestIdReused error (65), and the batch's other items still go in.
        """
        now = time.time() if now is None else now
        items = list(items)
        ids_of_requests = list(request_ids) if request_ids is not None else [None] * len(items)
        results: list[int | RequestIdReused] = []
        with self._tx():
            for (mind, session, message, interrupt), request_id in zip(
                items, ids_of_requests, strict=True
            ):
                if request_id is not None:
                    found = self.db.execute(
                        "SELECT id, mind, session, message, interrupt FROM deliveries "
                        "WHERE request_id = ?",
                        (request_id,),
                    ).fetchone()
                    if found is not None:
                        same = (found[1], found[2], bytes(found[3]), bool(found[4])) == (
                            mind,
                            session,
                            message,
                            bool(interrupt),
                        )
                        results.append(
                            int(found[0]) if same else RequestIdReused(request_id, int(found[0]))
                        )
                        continue
                cursor = self.db.execute(
                    "INSERT INTO deliveries "
                    "(mind, session, message, interrupt, created_at, request_id) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (mind, session, message, int(interrupt), now, request_id),
                )
                results.append(int(cursor.lastrowid or 0))
        return results

    def pending(self, *, with_message: bool = False) -> list[Row]:
        """Pending rows in id order. Without `with_message`, Row.message is empty: admission
        runs on every pass and must not read a deep queue's message bodies each time."""
        columns = _ROW_COLUMNS if with_message else _ROW_COLUMNS.replace("message", "x''", 1)
        cursor = self.db.execute(
            f"SELECT {columns} FROM deliveries WHERE state = 'pending' ORDER BY id"
        )
        return [_row(values) for values in cursor]

    def rows(self, ids: Iterable[int]) -> list[Row]:
        id_list = list(ids)
        if not id_list:
            return []
        marks = ",".join("?" * len(id_list))
        cursor = self.db.execute(
            f"SELECT {_ROW_COLUMNS} FROM deliveries WHERE id IN ({marks}) ORDER BY id", id_list
        )
        return [_row(values) for values in cursor]

    def row(self, delivery_id: int) -> Row | None:
        found = self.rows([delivery_id])
        return found[0] if found else None

    def list_rows(self, states: Sequence[str], limit: int = 200) -> list[Row]:
        marks = ",".join("?" * len(states))
        cursor = self.db.execute(
            f"SELECT {_ROW_COLUMNS} FROM deliveries WHERE state IN ({marks}) ORDER BY id LIMIT ?",
            (*states, limit),
        )
        return [_row(values) for values in cursor]

    def rows_of_turn(self, turn_id: int) -> list[Row]:
        cursor = self.db.execute(
            f"SELECT {_ROW_COLUMNS} FROM deliveries WHERE turn_id = ? AND state = 'running' "
            "ORDER BY id",
            (turn_id,),
        )
        return [_row(values) for values in cursor]

    def mark_held(self, holds: Iterable[tuple[int, str]], now: float) -> list[int]:
        """Record holds that just began; returns the ids whose hold is new (to log once).

        Not synced: a hold is bookkeeping for logs and `status`, and losing its start time
        to a power cut loses nothing that was asked for.
        """
        holds = list(holds)
        if not holds:
            return []
        new = []
        with self._tx(durable=False):
            for delivery_id, reason in holds:
                cursor = self.db.execute(
                    "UPDATE deliveries SET held_since = ?, hold_reason = ? "
                    "WHERE id = ? AND state = 'pending' AND held_since IS NULL",
                    (now, reason, delivery_id),
                )
                if cursor.rowcount:
                    new.append(delivery_id)
                else:
                    # Only when the reason changed: admission re-holds every waiting row
                    # on each pass, and rewriting unchanged rows costs a synced write.
                    self.db.execute(
                        "UPDATE deliveries SET hold_reason = ? "
                        "WHERE id = ? AND state = 'pending' AND hold_reason IS NOT ?",
                        (reason, delivery_id, reason),
                    )
        return new

    def start_turn(
        self,
        mind: str,
        session: str,
        unit_for: Callable[[int], str],
        delivery_ids: Sequence[int],
        now: float,
        deadline: float | None = None,
    ) -> tuple[int, list[Row]]:
        """Create a turn and move its rows to running, in one commit.

        Returns the turn id and the rows as they were (with the hold they leave).
        `unit_for` turns the new turn id into its unit name; `deadline` is when the turn's
        max runtime runs out.
        """
        with self._tx():
            cursor = self.db.execute(
                "INSERT INTO turns (mind, session, started_at, deadline) VALUES (?, ?, ?, ?)",
                (mind, session, now, deadline),
            )
            turn_id = int(cursor.lastrowid or 0)
            unit = unit_for(turn_id)
            self.db.execute("UPDATE turns SET unit = ? WHERE id = ?", (unit, turn_id))
            rows = self._take(turn_id, delivery_ids, now, folded=False)
        return turn_id, rows

    def fold_into(
        self, turn_id: int, delivery_ids: Sequence[int], now: float, *, interrupt: bool = False
    ) -> list[Row]:
        """Hand rows to a running turn; with `interrupt`, record in the same commit that the
        turn is being interrupted, so a gate that restarts still knows."""
        with self._tx():
            if interrupt:
                self.db.execute("UPDATE turns SET interrupted = 1 WHERE id = ?", (turn_id,))
            return self._take(turn_id, delivery_ids, now, folded=True)

    def _take(self, turn_id: int, ids: Sequence[int], now: float, *, folded: bool) -> list[Row]:
        rows = [row for row in self.rows(ids) if row.state == "pending"]
        for row in rows:
            held = int((now - row.held_since) * 1000) if row.held_since is not None else 0
            self.db.execute(
                "UPDATE deliveries SET state = 'running', turn_id = ?, folded = ?, "
                "held_since = NULL, hold_reason = NULL, held_ms = held_ms + ?, not_before = NULL "
                "WHERE id = ?",
                (turn_id, int(folded), held, row.id),
            )
        return rows

    def return_to_pending(self, delivery_ids: Sequence[int]) -> None:
        """Undo a hand-off that never reached the command: no attempt is counted."""
        with self._tx():
            self._return_to_pending(delivery_ids)

    def _return_to_pending(self, delivery_ids: Sequence[int]) -> None:
        for delivery_id in delivery_ids:
            self.db.execute(
                "UPDATE deliveries SET state = 'pending', turn_id = NULL, folded = 0 "
                "WHERE id = ? AND state = 'running'",
                (delivery_id,),
            )

    def finish_rows(self, delivery_ids: Sequence[int], now: float) -> None:
        with self._tx():
            self._finish_rows(delivery_ids, now)

    def _finish_rows(self, delivery_ids: Sequence[int], now: float) -> None:
        for delivery_id in delivery_ids:
            self.db.execute(
                "UPDATE deliveries SET state = 'done', finished_at = ? "
                "WHERE id = ? AND state = 'running'",
                (now, delivery_id),
            )

    def fail_rows(
        self, updates: Iterable[tuple[int, str, int, float | None]], error: str, now: float
    ) -> None:
        """(id, new state, attempts, not_before) after a real failure."""
        with self._tx():
            self._fail_rows(updates, error, now)

    def _fail_rows(
        self, updates: Iterable[tuple[int, str, int, float | None]], error: str, now: float
    ) -> None:
        for delivery_id, state, attempts, not_before in updates:
            self.db.execute(
                "UPDATE deliveries SET state = ?, attempts = ?, not_before = ?, "
                "last_error = ?, turn_id = CASE WHEN ? = 'dead' THEN turn_id ELSE NULL END, "
                "folded = 0, finished_at = CASE WHEN ? = 'dead' THEN ? ELSE NULL END "
                "WHERE id = ? AND state = 'running'",
                (state, attempts, not_before, error, state, state, now, delivery_id),
            )

    def retry(self, delivery_ids: Sequence[int]) -> list[int]:
        changed = []
        with self._tx():
            for delivery_id in delivery_ids:
                cursor = self.db.execute(
                    "UPDATE deliveries SET state = 'pending', attempts = 0, not_before = NULL, "
                    "turn_id = NULL, finished_at = NULL WHERE id = ? AND state = 'dead'",
                    (delivery_id,),
                )
                if cursor.rowcount:
                    changed.append(delivery_id)
        return changed

    def drop(self, delivery_ids: Sequence[int], now: float) -> list[int]:
        changed = []
        with self._tx():
            for delivery_id in delivery_ids:
                cursor = self.db.execute(
                    "UPDATE deliveries SET state = 'dropped', finished_at = ?, held_since = NULL "
                    "WHERE id = ? AND state IN ('pending', 'dead')",
                    (now, delivery_id),
                )
                if cursor.rowcount:
                    changed.append(delivery_id)
        return changed

    def next_backoff_deadline(self, after: float | None = None) -> float | None:
        """The earliest backoff end of a pending row (only those later than `after`).

        A row whose backoff has ended keeps its not_before until a turn takes it, so a
        caller that sleeps until the next deadline passes `after=now`: otherwise a row
        held past its backoff would be a deadline in the past, forever.
        """
        value = self.db.execute(
            "SELECT MIN(not_before) FROM deliveries WHERE state = 'pending' "
            "AND not_before IS NOT NULL AND not_before > ?",
            (float("-inf") if after is None else after,),
        ).fetchone()[0]
        return float(value) if value is not None else None

    def counts(self) -> dict[str, int]:
        cursor = self.db.execute("SELECT state, COUNT(*) FROM deliveries GROUP BY state")
        return {str(state): int(count) for state, count in cursor}

    def oldest_hold(self) -> float | None:
        value = self.db.execute(
            "SELECT MIN(held_since) FROM deliveries WHERE state = 'pending'"
        ).fetchone()[0]
        return float(value) if value is not None else None

    # -- turns --------------------------------------------------------------------

    def mark_released(self, turn_id: int, pid: int | None = None) -> None:
        """Note that the command was let go, and its main process. Not synced: it sits on
        the handoff path, and the wrapper's `started` file says the same thing to a gate
        that restarts."""
        with self._tx(durable=False):
            self.db.execute(
                "UPDATE turns SET state = 'running', released = 1, pid = ? WHERE id = ?",
                (pid, turn_id),
            )

    def mark_timed_out(self, turn_id: int, now: float) -> None:
        """Note that the gate is stopping the turn for running past its deadline. Not
        synced: a crash of the gate keeps it (WAL), and a power cut ends the turn anyway."""
        with self._tx(durable=False):
            self.db.execute(
                "UPDATE turns SET timed_out_at = ? WHERE id = ? AND timed_out_at IS NULL",
                (now, turn_id),
            )
        self._unsynced = True

    def end_turn(
        self, turn_id: int, outcome: str, exit_status: int | None, detail: str, now: float
    ) -> None:
        with self._tx():
            self._end_turn(turn_id, outcome, exit_status, detail, now)

    def _end_turn(
        self, turn_id: int, outcome: str, exit_status: int | None, detail: str, now: float
    ) -> None:
        self.db.execute(
            "UPDATE turns SET state = 'ended', outcome = ?, exit_status = ?, detail = ?, "
            "ended_at = ? WHERE id = ?",
            (outcome, exit_status, detail, now, turn_id),
        )

    def open_turns(self) -> list[TurnRow]:
        cursor = self.db.execute(
            f"SELECT {_TURN_COLUMNS} FROM turns WHERE state != 'ended' ORDER BY id"
        )
        return [_turn(values) for values in cursor]

    def turn(self, turn_id: int) -> TurnRow | None:
        values = self.db.execute(
            f"SELECT {_TURN_COLUMNS} FROM turns WHERE id = ?", (turn_id,)
        ).fetchone()
        return _turn(values) if values else None


class _Transaction:
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
