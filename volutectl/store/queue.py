"""The durable delivery queue: the SQL that reads and writes deliveries and turns.

The records it takes and gives are volutectl/store/rows.py's, decoded here from its
SELECTs by column name; a mind's pauses are volutectl/store/minds.py's SQL, and removing
what is done is volutectl/store/retention.py's.

SQLite in WAL mode with synchronous=FULL: a delivery is acknowledged only after its
commit has reached the disk (the incident this tool exists for ended in a power cycle);
deliveries that arrive together share one commit, affordable on a 60-IOPS SD card. The
store is the truth for what was asked, systemd for what runs; the schema, migrations
and transaction helper are volutectl/store/schema.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sqlite3
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from pathlib import Path

from volutectl.clock import SYSTEM, Clock
from volutectl.core.admission import AfterFailure, interrupts_that_cut
from volutectl.errors import PermissionDeniedError, UnavailableError, VoluteError
from volutectl.states import HoldReason, Outcome, QueueState, TurnKind, TurnState
from volutectl.store.leases import LeaseStore
from volutectl.store.minds import MindStore
from volutectl.store.rows import (
    AlreadyQueued,
    NewDelivery,
    NewTurn,
    RequestIdReused,
    Row,
    TurnRow,
)
from volutectl.store.schema import PAGE_SIZE, Transaction, migrate, schema_version

# The records are volutectl/store/rows.py's; they are re-exported for the store's callers.
__all__ = [
    "AlreadyQueued",
    "NewDelivery",
    "NewTurn",
    "RequestIdReused",
    "Row",
    "Store",
    "TurnRow",
]

PENDING = QueueState.PENDING
RUNNING = QueueState.RUNNING
DONE = QueueState.DONE
DEAD = QueueState.DEAD
DROPPED = QueueState.DROPPED


_CHUNK = 500  # ids per statement


def _marks(values: Sequence[object]) -> str:
    return ",".join("?" * len(values))


# The columns of a SELECT that reads whole rows; the decoders below read them by name.
ROW_COLUMNS = (
    "id, mind, session, message, interrupt, state, attempts, not_before, created_at, "
    "held_since, hold_reason, held_ms, turn_id, folded, last_error, uid, admin, cut"
)
# The same, with an empty message: admission must not read a deep queue's message bodies.
ROW_COLUMNS_NO_MESSAGE = ROW_COLUMNS.replace("message", "x'' AS message", 1)
TURN_COLUMNS = (
    "id, mind, session, unit, state, released, started_at, ended_at, outcome, exit_status, "
    "detail, pid, interrupted, deadline, timed_out_at, kind"
)


def _row_of(values: sqlite3.Row) -> Row:
    hold_reason = values["hold_reason"]
    return Row(
        id=int(values["id"]),
        mind=str(values["mind"]),
        session=str(values["session"]),
        message=bytes(values["message"]),
        interrupt=bool(values["interrupt"]),
        state=QueueState(values["state"]),
        attempts=int(values["attempts"]),
        not_before=values["not_before"],
        created_at=float(values["created_at"]),
        held_since=values["held_since"],
        hold_reason=HoldReason(hold_reason) if hold_reason else None,
        held_ms=int(values["held_ms"]),
        turn_id=values["turn_id"],
        folded=bool(values["folded"]),
        last_error=values["last_error"],
        uid=values["uid"],
        admin=bool(values["admin"]),
        cut=bool(values["cut"]),
    )


def _in_states(states: Sequence[QueueState], uid: int | None) -> tuple[str, tuple[object, ...]]:
    """A WHERE clause for rows in `states` (and delivered by `uid`, if given)."""
    where = f"state IN ({_marks(states)})"
    if uid is None:
        return where, tuple(states)
    return f"{where} AND uid = ?", (*states, uid)


def _turn_of(values: sqlite3.Row) -> TurnRow:
    outcome = values["outcome"]
    return TurnRow(
        id=int(values["id"]),
        mind=str(values["mind"]),
        session=str(values["session"]),
        unit=str(values["unit"]),
        state=TurnState(values["state"]),
        released=bool(values["released"]),
        started_at=float(values["started_at"]),
        ended_at=values["ended_at"],
        outcome=Outcome(outcome) if outcome else None,
        exit_status=values["exit_status"],
        detail=values["detail"],
        pid=values["pid"],
        interrupted=bool(values["interrupted"]),
        deadline=values["deadline"],
        timed_out_at=values["timed_out_at"],
        kind=TurnKind(values["kind"]),
    )


class Store:
    """One connection to the queue database. Every method commits before it returns."""

    def __init__(self, path: Path, clock: Clock = SYSTEM) -> None:
        self.path = path
        self.clock = clock  # what stamps rows when no time is given
        self._unsynced = False
        self.sync_seconds = 0.0  # how long the last durable commit's COMMIT took
        try:
            # The messages are private. Under systemd the unit's StateDirectory= (and the
            # package's tmpfiles) make the directory 0700; a gate run by hand makes its
            # own directory 0700 and the database 0600 (SQLite gives -wal and -shm the
            # database's mode). What exists already is left as it is.
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            self.db = sqlite3.connect(str(path), isolation_level=None, timeout=10)
        except PermissionError:
            raise PermissionDeniedError(f"{path}: cannot create the queue database") from None
        except (sqlite3.Error, OSError) as error:
            raise UnavailableError(f"{path}: cannot open the queue database: {error}") from None
        try:
            # Before anything else: a new database takes this at its first table (an
            # existing one only through a VACUUM: schema.enable_incremental_vacuum).
            # So does a page size (WAL keeps an existing file's: the same VACUUM changes it).
            self.db.execute(f"PRAGMA page_size={PAGE_SIZE}")
            self.db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.migrate()
        except sqlite3.OperationalError as error:
            raise UnavailableError(f"{path}: cannot use the queue database: {error}") from None
        self.minds = MindStore(self.db, self._tx)  # pauses, and each mind's last turn
        self.leases = LeaseStore(self.db, self._tx)  # leases: their grants and ends

    def schema_version(self) -> int:
        return schema_version(self.db)

    def migrate(self) -> list[int]:
        return migrate(self.db, self.path)

    def close(self) -> None:
        self.db.close()

    def _select(self, sql: str, parameters: Sequence[object] = ()) -> sqlite3.Cursor:
        """A cursor whose rows are read by column name (sqlite3.Row)."""
        cursor = self.db.cursor()
        cursor.row_factory = sqlite3.Row
        return cursor.execute(sql, parameters)

    def _tx(self, *, durable: bool = True) -> Transaction:
        return Transaction(
            self.db, durable=durable, on_durable_commit=self._synced, clock=self.clock.monotonic
        )

    def _synced(self, seconds: float) -> None:
        self._unsynced = False  # a synced commit's fsync covers every earlier WAL frame
        self.sync_seconds = seconds

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
        items: Iterable[NewDelivery],
        now: float | None = None,
        *,
        refuse: Callable[[NewDelivery], VoluteError | None] | None = None,
        durable: bool = True,
    ) -> list[int | VoluteError]:
        """Insert deliveries in ONE durable commit; one result per item, in order.

        With durable=False the commit skips its fsync and `sync_pending()` turns true: the
        caller promises to acknowledge none of them before a later durable commit (the
        gate's pass shares one fsync between its deliveries and the turns it starts).

        A request id the store already holds from the same uid, with the same mind,
        session, message and interrupt flag, inserts nothing and gives back the ORIGINAL
        delivery id (as AlreadyQueued), whatever state that delivery is in by now. The
        same id twice in one batch is the same request twice. The same id with other
        content is refused: that item's result is a RequestIdReused error (65), and the
        batch's other items still go in. `refuse` (a quota: volutectl/store/quotas.py) is
        asked about each item that would be inserted, in order; an error it gives is that
        item's result, and nothing of it is stored.
        """
        now = self.clock.wall() if now is None else now
        results: list[int | VoluteError] = []
        inserted: list[tuple[int, NewDelivery]] = []
        with self._tx(durable=durable):
            for item in items:
                found = self._by_request_id(item) if item.request_id is not None else None
                if found is not None:
                    results.append(found)
                    continue
                refusal = refuse(item) if refuse is not None else None
                if refusal is not None:
                    results.append(refusal)
                    continue
                cursor = self.db.execute(
                    "INSERT INTO deliveries "
                    "(mind, session, message, interrupt, created_at, request_id, uid, admin) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        item.mind,
                        item.session,
                        item.message,
                        int(item.interrupt),
                        now,
                        item.request_id,
                        item.uid,
                        int(item.interrupt and item.admin),
                    ),
                )
                delivery_id = int(cursor.lastrowid or 0)
                results.append(delivery_id)
                inserted.append((delivery_id, item))
        if inserted and not durable:
            self._unsynced = True
        self._inserted(inserted)
        return results

    # Hooks for the gate's index (volutectl/store/indexed.py), after a commit (none if it
    # fails): new rows; rows maybe pending again (returned, backing off, retried); rows
    # that left; rows now done or dropped (no longer counted against their uid's quota).
    def _inserted(self, rows: list[tuple[int, NewDelivery]]) -> None: ...
    def _pended(self, ids: Iterable[int]) -> None: ...
    def _unpended(self, ids: Iterable[int]) -> None: ...
    def _finished(self, ids: list[int]) -> None: ...

    def _by_request_id(self, item: NewDelivery) -> AlreadyQueued | RequestIdReused | None:
        found = self._select(
            "SELECT id, mind, session, message, interrupt FROM deliveries "
            "WHERE uid IS ? AND request_id = ?",
            (item.uid, item.request_id),
        ).fetchone()
        if found is None:
            return None
        same = (
            found["mind"] == item.mind
            and found["session"] == item.session
            and bytes(found["message"]) == item.message
            and bool(found["interrupt"]) == bool(item.interrupt)
        )
        delivery_id = int(found["id"])
        if not same:
            return RequestIdReused(str(item.request_id), delivery_id)
        return AlreadyQueued(delivery_id)

    def pending(self, *, with_message: bool = False) -> list[Row]:
        """Pending rows in id order. Without `with_message`, Row.message is empty: admission
        runs on every pass and must not read a deep queue's message bodies each time."""
        columns = ROW_COLUMNS if with_message else ROW_COLUMNS_NO_MESSAGE
        cursor = self._select(
            f"SELECT {columns} FROM deliveries WHERE state = ? ORDER BY id", (PENDING,)
        )
        return [_row_of(values) for values in cursor]

    def rows(self, ids: Iterable[int], *, with_message: bool = True) -> list[Row]:
        """The rows of `ids` that exist, in id order (Row.message empty without
        `with_message`). Asked in chunks: a batch after a long pause can hold more ids
        than one statement may have parameters (999 before SQLite 3.32, 32766 after)."""
        id_list = sorted(set(ids))
        columns = ROW_COLUMNS if with_message else ROW_COLUMNS_NO_MESSAGE
        found = []
        for start in range(0, len(id_list), _CHUNK):
            chunk = id_list[start : start + _CHUNK]
            cursor = self._select(
                f"SELECT {columns} FROM deliveries WHERE id IN ({_marks(chunk)}) ORDER BY id",
                chunk,
            )
            found += [_row_of(values) for values in cursor]
        return found

    def row(self, delivery_id: int) -> Row | None:
        found = self.rows([delivery_id])
        return found[0] if found else None

    def list_rows(
        self, states: Sequence[QueueState], limit: int = 200, *, uid: int | None = None
    ) -> list[Row]:
        """The newest `limit` rows in `states`, newest first; only `uid`'s, if given."""
        where, parameters = _in_states(states, uid)
        cursor = self._select(
            f"SELECT {ROW_COLUMNS} FROM deliveries WHERE {where} ORDER BY id DESC LIMIT ?",
            (*parameters, limit),
        )
        return [_row_of(values) for values in cursor]

    def count_rows(self, states: Sequence[QueueState], *, uid: int | None = None) -> int:
        where, parameters = _in_states(states, uid)
        return int(
            self.db.execute(
                f"SELECT COUNT(*) FROM deliveries WHERE {where}", parameters
            ).fetchone()[0]
        )

    def rows_of_turn(self, turn_id: int) -> list[Row]:
        cursor = self._select(
            f"SELECT {ROW_COLUMNS} FROM deliveries WHERE turn_id = ? AND state = ? ORDER BY id",
            (turn_id, RUNNING),
        )
        return [_row_of(values) for values in cursor]

    def mark_held(self, holds: Iterable[tuple[int, HoldReason | None]], now: float) -> list[int]:
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
                if reason is None:  # no longer held (it is backing off itself)
                    self.db.execute(
                        "UPDATE deliveries SET held_since = NULL, hold_reason = NULL "
                        "WHERE id = ? AND state = ?",
                        (delivery_id, PENDING),
                    )
                    continue
                cursor = self.db.execute(
                    "UPDATE deliveries SET held_since = ?, hold_reason = ? "
                    "WHERE id = ? AND state = ? AND held_since IS NULL",
                    (now, reason, delivery_id, PENDING),
                )
                if cursor.rowcount:
                    new.append(delivery_id)
                else:
                    # Only when the reason changed: admission re-holds every waiting row
                    # on each pass, and rewriting unchanged rows costs a synced write.
                    self.db.execute(
                        "UPDATE deliveries SET hold_reason = ? "
                        "WHERE id = ? AND state = ? AND hold_reason IS NOT ?",
                        (reason, delivery_id, PENDING, reason),
                    )
        return new

    def retry(self, delivery_ids: Sequence[int]) -> list[int]:
        changed = self._change(
            delivery_ids,
            "state = ?, attempts = 0, not_before = NULL, turn_id = NULL, finished_at = NULL",
            (PENDING,),
            (DEAD,),
        )
        self._pended(changed)
        return changed

    def drop(self, delivery_ids: Sequence[int], now: float) -> list[int]:
        changed = self._change(
            delivery_ids,
            "state = ?, finished_at = ?, held_since = NULL",
            (DROPPED, now),
            (PENDING, DEAD),
        )
        self._unpended(changed)
        self._finished(changed)
        return changed

    def _change(
        self,
        delivery_ids: Sequence[int],
        assignments: str,
        values: tuple[object, ...],
        from_states: tuple[QueueState, ...],
    ) -> list[int]:
        changed = []
        with self._tx():
            for delivery_id in delivery_ids:
                cursor = self.db.execute(
                    f"UPDATE deliveries SET {assignments} "
                    f"WHERE id = ? AND state IN ({_marks(from_states)})",
                    (*values, delivery_id, *from_states),
                )
                if cursor.rowcount:
                    changed.append(delivery_id)
        return changed

    def counts(self) -> dict[QueueState, int]:
        cursor = self.db.execute("SELECT state, COUNT(*) FROM deliveries GROUP BY state")
        return {QueueState(state): int(count) for state, count in cursor}

    def oldest_hold(self) -> float | None:
        value = self.db.execute(
            "SELECT MIN(held_since) FROM deliveries WHERE state = ?", (PENDING,)
        ).fetchone()[0]
        return float(value) if value is not None else None

    # -- turns --------------------------------------------------------------------

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
        one = NewTurn(
            mind=mind,
            session=session,
            delivery_ids=delivery_ids,
            unit_for=unit_for,
            deadline=deadline,
        )
        [started] = self.start_turns([one], now)
        return started

    def start_turns(self, turns: Sequence[NewTurn], now: float) -> list[tuple[int, list[Row]]]:
        """Create turns and move their rows to running, all in ONE durable commit: each
        turn's id and its rows as they were (with the hold they leave), in order.

        A pass that starts several turns pays one fsync, not one each: on a 60-IOPS SD
        card a commit is a few of its writes, and a fan-out's starts at one reading of
        the adaptive limit were a burst a small write of the host's waited behind (issue
        32). Each turn is as a lone start leaves it: committed, not yet released, so a
        gate that dies before its hands start one finds it so and returns its rows."""
        started: list[tuple[int, list[Row]]] = []
        with self._tx():
            for turn in turns:
                cursor = self.db.execute(
                    "INSERT INTO turns (mind, session, started_at, deadline) VALUES (?, ?, ?, ?)",
                    (turn.mind, turn.session, now, turn.deadline),
                )
                turn_id = int(cursor.lastrowid or 0)
                self.db.execute(
                    "UPDATE turns SET unit = ? WHERE id = ?", (turn.unit_for(turn_id), turn_id)
                )
                rows = self._take(turn_id, turn.delivery_ids, now, folded=False)
                started.append((turn_id, rows))
        for _, rows in started:
            self._unpended(row.id for row in rows)
        return started

    def fold_into(self, turn_id: int, delivery_ids: Sequence[int], now: float) -> list[Row]:
        """Hand rows to a running turn, and decide in the same commit which of their
        interrupts cut it short (core/admission.py's `interrupts_that_cut`, from the
        senders of what it runs): those come back with `cut` set, and the turn is
        recorded as interrupted. The others fold in as plain deliveries."""
        with self._tx():
            rows = self._take(turn_id, delivery_ids, now, folded=True)
            cut: set[int] = set()
            if any(row.interrupt for row in rows):  # only then: a fold is on the handoff path
                taken = {row.id for row in rows}
                running = self.senders_of_turn(turn_id, besides=taken)
                cut = set(interrupts_that_cut(running, [row.as_sent() for row in rows]))
            if cut:
                self.db.execute("UPDATE turns SET interrupted = 1 WHERE id = ?", (turn_id,))
                self.db.executemany(
                    "UPDATE deliveries SET cut = 1 WHERE id = ?", [(i,) for i in sorted(cut)]
                )
        self._unpended(row.id for row in rows)
        return [dataclasses.replace(row, cut=True) if row.id in cut else row for row in rows]

    def senders_of_turn(self, turn_id: int, besides: Container[int] = ()) -> set[int | None]:
        """Who sent the deliveries a turn runs (its rows still running), `besides` those."""
        cursor = self.db.execute(
            "SELECT id, uid FROM deliveries WHERE turn_id = ? AND state = ?", (turn_id, RUNNING)
        )
        return {uid for delivery_id, uid in cursor if delivery_id not in besides}

    def _take(self, turn_id: int, ids: Sequence[int], now: float, *, folded: bool) -> list[Row]:
        rows = [row for row in self.rows(ids) if row.state is PENDING]
        for row in rows:
            held = int((now - row.held_since) * 1000) if row.held_since is not None else 0
            self.db.execute(
                "UPDATE deliveries SET state = ?, turn_id = ?, folded = ?, held_since = NULL, "
                "hold_reason = NULL, held_ms = held_ms + ?, not_before = NULL WHERE id = ?",
                (RUNNING, turn_id, int(folded), held, row.id),
            )
        return rows

    def mark_released(self, turn_id: int, pid: int | None = None) -> None:
        """Note that the command was let go, and its main process. Not synced: it sits on
        the handoff path, and the wrapper's `started` file says the same thing to a gate
        that restarts."""
        with self._tx(durable=False):
            self.db.execute(
                "UPDATE turns SET state = ?, released = 1, pid = ? WHERE id = ?",
                (TurnState.RUNNING, pid, turn_id),
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

    def settle_turn(
        self,
        turn_id: int,
        *,
        outcome: Outcome,
        exit_status: int | None,
        detail: str,
        done: Sequence[int],
        returned: Sequence[int],
        failed: Mapping[int, AfterFailure],
        error: str,
        now: float,
        durable: bool = True,
    ) -> None:
        """Record how a turn ended and settle all its rows, in ONE commit: every outcome
        of a turn, a start that failed included. (A turn ended in one commit and its rows
        settled in another left them `running` under a closed turn if the gate died
        between the two: issue 29.)

        done: carried (done); returned: back to pending with no attempt (never offered,
        untaken, or never run); failed: one attempt counted (backoff or dead).

        With durable=False the commit skips its fsync and `sync_pending()` turns true: the
        caller promises `sync()` before it sleeps. On the handoff path the next turn's
        start_turn commit comes first and, the WAL being sequential, its one fsync makes
        both durable; a pass that starts nothing pays the fsync in sync() instead.
        """
        with self._tx(durable=durable):
            finished = self._settle_rows(done, returned, failed, error, now)
            self._end_turn(turn_id, outcome, exit_status, detail, now)
        if not durable:
            self._unsynced = True
        self._pended([*returned, *failed])
        self._finished(finished)

    def settle_rows(
        self,
        *,
        done: Sequence[int] = (),
        returned: Sequence[int] = (),
        failed: Mapping[int, AfterFailure],
        error: str,
        now: float,
    ) -> None:
        """Settle running rows whose turn is settled already (or unknown), as settle_turn
        would, in one durable commit; their turn's record is left as it is."""
        with self._tx():
            finished = self._settle_rows(done, returned, failed, error, now)
        self._pended([*returned, *failed])
        self._finished(finished)

    def _settle_rows(
        self,
        done: Sequence[int],
        returned: Sequence[int],
        failed: Mapping[int, AfterFailure],
        error: str,
        now: float,
    ) -> list[int]:
        """Inside a transaction: settle what is still running of these rows; the ids
        that became done."""
        finished = []
        for delivery_id in returned:
            self.db.execute(
                "UPDATE deliveries SET state = ?, turn_id = NULL, folded = 0 "
                "WHERE id = ? AND state = ?",
                (PENDING, delivery_id, RUNNING),
            )
        for delivery_id in done:
            cursor = self.db.execute(
                "UPDATE deliveries SET state = ?, finished_at = ? WHERE id = ? AND state = ?",
                (DONE, now, delivery_id, RUNNING),
            )
            if cursor.rowcount:
                finished.append(delivery_id)
        for delivery_id, after in failed.items():
            dead = after.state is DEAD
            self.db.execute(
                "UPDATE deliveries SET state = ?, attempts = ?, not_before = ?, last_error = ?, "
                "turn_id = CASE WHEN ? THEN turn_id ELSE NULL END, folded = 0, "
                "finished_at = ? WHERE id = ? AND state = ?",
                (
                    after.state,
                    after.attempts,
                    after.not_before,
                    error,
                    dead,
                    now if dead else None,
                    delivery_id,
                    RUNNING,
                ),
            )
        return finished

    def _end_turn(
        self, turn_id: int, outcome: Outcome, exit_status: int | None, detail: str, now: float
    ) -> None:
        self.db.execute(
            "UPDATE turns SET state = ?, outcome = ?, exit_status = ?, detail = ?, ended_at = ? "
            "WHERE id = ?",
            (TurnState.ENDED, outcome, exit_status, detail, now, turn_id),
        )

    def stranded(self) -> list[tuple[Row, TurnRow | None]]:
        """Rows `running` under a turn that is not open (or under none): each with its
        turn's record, if there is one. Only a gate that died between a turn's end and
        its rows' settlement (before issue 29) leaves such rows; the next one settles
        them at its start."""
        cursor = self._select(
            f"SELECT {ROW_COLUMNS} FROM deliveries WHERE state = ? AND (turn_id IS NULL OR "
            "turn_id NOT IN (SELECT id FROM turns WHERE state != ?)) ORDER BY id",
            (RUNNING, TurnState.ENDED),
        )
        rows = [_row_of(values) for values in cursor]
        turn_ids = {row.turn_id for row in rows if row.turn_id is not None}
        turns = {turn_id: self.turn(turn_id) for turn_id in turn_ids}
        return [(row, turns.get(row.turn_id) if row.turn_id is not None else None) for row in rows]

    def open_turns(self) -> list[TurnRow]:
        cursor = self._select(
            f"SELECT {TURN_COLUMNS} FROM turns WHERE state != ? ORDER BY id", (TurnState.ENDED,)
        )
        return [_turn_of(values) for values in cursor]

    def turn(self, turn_id: int) -> TurnRow | None:
        values = self._select(
            f"SELECT {TURN_COLUMNS} FROM turns WHERE id = ?", (turn_id,)
        ).fetchone()
        return _turn_of(values) if values else None
