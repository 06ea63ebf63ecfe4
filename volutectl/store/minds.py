"""The queue database's SQL about minds rather than deliveries: pauses, and what
`volutectl status` shows of each mind's past.

Part of the store (volutectl/store/queue.py opens the connection and owns the transactions);
a module of its own so that the store keeps to the queue itself.

A pause is a row of the `paused` table (schema 3): the mind, and since when. The mind
EVERY_MIND ('*') is a pause of every mind, minds added to the config later included; no
mind can be named '*' (names.MIND_PATTERN).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from volutectl.states import Outcome, QueueState
from volutectl.store.schema import Transaction

EVERY_MIND = "*"


@dataclass(frozen=True)
class LastTurn:
    """A mind's latest turn that ended."""

    turn_id: int
    outcome: Outcome | None
    ended_at: float


class MindStore:
    def __init__(self, db: sqlite3.Connection, tx: Callable[[], Transaction]) -> None:
        self.db = db
        self._tx = tx

    def pauses(self) -> dict[str, float]:
        """Every pause: mind (or EVERY_MIND) -> since, seconds since the epoch."""
        cursor = self.db.execute("SELECT mind, since FROM paused ORDER BY since, mind")
        return {str(mind): float(since) for mind, since in cursor}

    def pause(self, minds: Iterable[str], now: float) -> list[str]:
        """Pause each of `minds` (EVERY_MIND for all) not paused yet, in one durable
        commit; the ones this paused."""
        changed = []
        with self._tx():
            for mind in minds:
                cursor = self.db.execute(
                    "INSERT OR IGNORE INTO paused (mind, since) VALUES (?, ?)", (mind, now)
                )
                if cursor.rowcount:
                    changed.append(mind)
        return changed

    def resume(self, minds: Iterable[str] | None) -> list[str]:
        """Lift the pauses of `minds` (None: every pause, EVERY_MIND's included), in one
        durable commit; the ones that were paused."""
        with self._tx():
            if minds is None:
                return [str(m) for (m,) in self.db.execute("DELETE FROM paused RETURNING mind")]
            changed = []
            for mind in minds:
                if self.db.execute("DELETE FROM paused WHERE mind = ?", (mind,)).rowcount:
                    changed.append(mind)
            return changed

    def last_turns(self, minds: Iterable[str]) -> dict[str, LastTurn]:
        """The latest ended turn of each of `minds` that has one: one lookup each in the
        index turns(mind, ended_at) (schema 5), however many turns the store holds."""
        found = {}
        for mind in minds:
            latest = self.db.execute(
                "SELECT id, outcome, ended_at FROM turns WHERE mind = ? AND ended_at IS NOT NULL "
                "ORDER BY ended_at DESC LIMIT 1",
                (mind,),
            ).fetchone()
            if latest is not None:
                turn_id, outcome, ended = latest
                found[mind] = LastTurn(
                    int(turn_id), Outcome(outcome) if outcome else None, float(ended)
                )
        return found

    def dead_counts(self) -> dict[str, int]:
        cursor = self.db.execute(
            "SELECT mind, COUNT(*) FROM deliveries WHERE state = ? GROUP BY mind",
            (QueueState.DEAD,),
        )
        return {str(mind): int(count) for mind, count in cursor}

    def attempts_by_mind(self) -> dict[str, int]:
        """Per mind, the most attempts any of its pending rows has made (rows that
        never failed are left out)."""
        cursor = self.db.execute(
            "SELECT mind, MAX(attempts) FROM deliveries WHERE state = ? AND attempts > 0 "
            "GROUP BY mind",
            (QueueState.PENDING,),
        )
        return {str(mind): int(attempts) for mind, attempts in cursor}
