"""The queue database's SQL about leases: a lease's scope, its grants, and their ends.

Part of the store (volutectl/store/queue.py opens the connection and owns the transactions).
A granted lease that created its turn is two rows in one commit: a row of `turns` of kind
'lease' (its scope, named as a turn's: counted, adopted after a restart and stopped as a
turn's scope is) and a row of `leases` (schema 10). A joined lease is a `leases` row on
the turn it joined. A waiting acquire has no row. The token is stored as it was given
(the state directory is the gate's alone, as the messages are): a repeated acquire with
the same request id after a lost connection gets it again.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from volutectl.states import LeaseEnd, Outcome, TurnKind, TurnState
from volutectl.store.schema import Transaction


@dataclass(frozen=True)
class LeaseRow:
    """A granted lease as the store keeps it."""

    id: int
    turn_id: int
    mind: str
    session: str
    uid: int
    token: str
    request_id: str | None
    created: bool
    granted_at: float
    ended_at: float | None = None
    reason: LeaseEnd | None = None


_COLUMNS = (
    "id, turn_id, mind, session, uid, token, request_id, created, granted_at, ended_at, reason"
)


def _lease_of(values: tuple[object, ...]) -> LeaseRow:
    (lease_id, turn_id, mind, session, uid, secret, request_id, created, granted_at) = values[:9]
    ended_at, reason = values[9], values[10]
    return LeaseRow(
        id=int(str(lease_id)),
        turn_id=int(str(turn_id)),
        mind=str(mind),
        session=str(session),
        uid=int(str(uid)),
        token=str(secret),
        request_id=None if request_id is None else str(request_id),
        created=bool(created),
        granted_at=float(str(granted_at)),
        ended_at=None if ended_at is None else float(str(ended_at)),
        reason=None if reason is None else LeaseEnd(str(reason)),
    )


class LeaseStore:
    def __init__(self, db: sqlite3.Connection, tx: Callable[[], Transaction]) -> None:
        self.db = db
        self._tx = tx

    def last_id(self) -> int:
        """The highest lease id ever granted (0: none), even if retention deleted it:
        new ids start above it."""
        row = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'leases'").fetchone()
        return int(row[0]) if row is not None else 0

    def next_delivery_id(self) -> int:
        """The id the next delivery will get: a waiting acquire's place in the FIFO."""
        row = self.db.execute(
            "SELECT seq FROM sqlite_sequence WHERE name = 'deliveries'"
        ).fetchone()
        return 1 + (int(row[0]) if row is not None else 0)

    def grant(
        self,
        lease: LeaseRow,
        *,
        unit_for: Callable[[int], str] | None,
        deadline: float | None = None,
    ) -> int:
        """Record a grant in one durable commit; its turn id. With `unit_for`, the lease
        creates its turn: a row of `turns` of kind 'lease' first (its id the lease's
        turn id, `unit_for` names its scope); else it joins turn `lease.turn_id`."""
        with self._tx():
            turn_id = lease.turn_id
            if unit_for is not None:
                cursor = self.db.execute(
                    "INSERT INTO turns (mind, session, started_at, deadline, kind) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (lease.mind, lease.session, lease.granted_at, deadline, TurnKind.LEASE),
                )
                turn_id = int(cursor.lastrowid or 0)
                self.db.execute(
                    "UPDATE turns SET unit = ? WHERE id = ?", (unit_for(turn_id), turn_id)
                )
            self.db.execute(
                f"INSERT INTO leases ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL)",
                (
                    lease.id,
                    turn_id,
                    lease.mind,
                    lease.session,
                    lease.uid,
                    lease.token,
                    lease.request_id,
                    int(lease.created),
                    lease.granted_at,
                ),
            )
        return turn_id

    def end(self, lease_ids: list[int], reason: LeaseEnd, now: float) -> list[int]:
        """Record that these leases ended (those still open), in one commit; which did."""
        ended = []
        with self._tx():
            for lease_id in lease_ids:
                cursor = self.db.execute(
                    "UPDATE leases SET ended_at = ?, reason = ? WHERE id = ? AND ended_at IS NULL",
                    (now, reason, lease_id),
                )
                if cursor.rowcount:
                    ended.append(lease_id)
        return ended

    def end_turn(self, turn_id: int, reason: LeaseEnd, now: float) -> list[int]:
        """A lease's scope is gone: its turn ends, and with it every lease still open on
        it (its creator's and the joined ones), in one commit; the leases that ended."""
        outcome = Outcome.TIMEOUT if reason is LeaseEnd.TIMEOUT else Outcome.OK
        with self._tx():
            open_ids = [
                int(row[0])
                for row in self.db.execute(
                    "SELECT id FROM leases WHERE turn_id = ? AND ended_at IS NULL", (turn_id,)
                )
            ]
            self.db.execute(
                "UPDATE leases SET ended_at = ?, reason = ? WHERE turn_id = ? AND ended_at IS NULL",
                (now, reason, turn_id),
            )
            self.db.execute(
                "UPDATE turns SET state = ?, outcome = ?, detail = ?, ended_at = ? "
                "WHERE id = ? AND kind = ? AND state != ?",
                (
                    TurnState.ENDED,
                    outcome,
                    f"lease ended: {reason}",
                    now,
                    turn_id,
                    TurnKind.LEASE,
                    TurnState.ENDED,
                ),
            )
        return open_ids

    def open(self) -> list[LeaseRow]:
        """Every lease not ended, oldest first."""
        cursor = self.db.execute(
            f"SELECT {_COLUMNS} FROM leases WHERE ended_at IS NULL ORDER BY id"
        )
        return [_lease_of(tuple(values)) for values in cursor]

    def get(self, lease_id: int) -> LeaseRow | None:
        values = self.db.execute(
            f"SELECT {_COLUMNS} FROM leases WHERE id = ?", (lease_id,)
        ).fetchone()
        return _lease_of(tuple(values)) if values else None
