"""The store, with its pending rows indexed in memory and the index kept in step.

volutectl/store/index.py decides admission from an index of the pending deliveries; this
keeps that index true. It is built once from the database when the store opens, then
every method that moves a row into or out of `pending` updates it after its commit (a
commit that fails changes nothing, in the database or here). The gate uses this store;
the index also answers what would otherwise be a scan of the queue on every pass: the
next backoff to wake for, pending counts per mind, held counts per reason.

It also keeps each uid's sums of deliveries not yet done (`usages`, volutectl/store/quotas.py),
summed once when the store opens and moved by the same commits, so that the quota check
of a delivery reads no row.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path

from volutectl.clock import SYSTEM, Clock
from volutectl.core.admission import Delivery
from volutectl.states import HoldReason, QueueState
from volutectl.store.index import PendingIndex
from volutectl.store.queue import Store
from volutectl.store.quotas import COUNTED, BatchCheck, Quota, Usages
from volutectl.store.rows import NewDelivery
from volutectl.store.schema import Transaction

HOLD_REASONS = frozenset(HoldReason)


# A checkpoint copies each page changed since the last into the database file, and syncs
# it: per page, not per commit, so one checkpoint after many commits writes the hot pages
# (the newest rows' leaves, their indexes, sqlite_sequence) once, where one after each
# turn writes them each time, a 4 KiB block of the disk per 1 KiB page (issue 32: a
# turn's commits and its own checkpoint wrote 57 KB, its commits alone 23 KB;
# bench/bench_admission.py, section 4). So:
CHECKPOINT_QUIET_SECONDS = 1.0  # checkpoint once the gate has committed nothing this long,
CHECKPOINT_MIN_COMMITS = 200  # ... if the WAL holds this many commits (~1 MiB of it);
CHECKPOINT_IDLE_SECONDS = 30.0  # fewer: once the gate has committed nothing this long;
CHECKPOINT_MAX_COMMITS = 2000  # ... or after this many commits (a WAL of ~25 MiB at most)


class IndexedStore(Store):
    """The gate's store. Also: SQLite's own checkpoints (every 1,000 WAL pages, inside
    whichever commit crosses the line, a handoff's included) are turned off; the gate
    checkpoints when it has been quiet for a second with CHECKPOINT_MIN_COMMITS in the
    WAL, or quiet for CHECKPOINT_IDLE_SECONDS with fewer (checkpoint_deadline)."""

    def __init__(self, path: Path, clock: Clock = SYSTEM) -> None:
        super().__init__(path, clock)
        self.index = self.load_index()
        self.usages = self.load_usages()
        self.usages_stale = False  # a commit's sums could not be read: sum again
        self.db.execute("PRAGMA wal_autocheckpoint=0")
        self._commits = 0
        self._last_commit = 0.0

    def _tx(self, *, durable: bool = True) -> Transaction:
        return Transaction(
            self.db,
            durable=durable,
            on_durable_commit=self._synced,
            on_commit=self._committed,
            clock=self.clock.monotonic,
        )

    def _committed(self) -> None:
        self._commits += 1
        self._last_commit = self.clock.monotonic()
        if self._commits >= CHECKPOINT_MAX_COMMITS:
            self.checkpoint()  # never quiet: bound the WAL anyway

    def checkpoint_deadline(self) -> float | None:
        """When (monotonic) to checkpoint: a quiet second after the last commit when the
        WAL holds CHECKPOINT_MIN_COMMITS, else CHECKPOINT_IDLE_SECONDS after it."""
        if not self._commits:
            return None
        if self._commits >= CHECKPOINT_MIN_COMMITS:
            return self._last_commit + CHECKPOINT_QUIET_SECONDS
        return self._last_commit + CHECKPOINT_IDLE_SECONDS

    def checkpoint(self) -> None:
        """Copy the WAL's pages into the database (PASSIVE: it waits for no reader)."""
        self._commits = 0
        self.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def load_index(self) -> PendingIndex:
        """The index of what the database holds as pending, with each row's recorded hold.

        Streamed from a query of only the columns admission needs, names shared between
        rows (a deep queue has few minds and sessions): at 100,000 pending this keeps the
        gate's start and its RSS small (bench/bench_admission.py)."""
        index = PendingIndex()
        names: dict[str, str] = {}
        cursor = self.db.execute(
            "SELECT id, mind, session, interrupt, not_before, hold_reason FROM deliveries "
            "WHERE state = ? ORDER BY id",
            (QueueState.PENDING,),
        )
        index.load(
            (
                Delivery(
                    delivery_id,
                    names.setdefault(mind, mind),
                    names.setdefault(session, session),
                    bool(interrupt),
                    not_before,
                ),
                HoldReason(reason) if reason in HOLD_REASONS else None,
            )
            for delivery_id, mind, session, interrupt, not_before, reason in cursor
        )
        return index

    def load_usages(self) -> Usages:
        """Each uid's deliveries not yet done, summed from the database."""
        usages = Usages()
        cursor = self.db.execute(
            "SELECT uid, COUNT(*), SUM(length(message)) FROM deliveries "
            f"WHERE state IN ({','.join('?' * len(COUNTED))}) AND uid IS NOT NULL GROUP BY uid",
            COUNTED,
        )
        for uid, count, message_bytes in cursor:
            usages.add(int(uid), int(count), int(message_bytes or 0))
        return usages

    def quota_check(self, quota: Quota) -> BatchCheck:
        """The check for one batch of deliveries (add_deliveries' `refuse`)."""
        if self.usages_stale:
            self.usages = self.load_usages()
            self.usages_stale = False
        return BatchCheck(self.usages, quota)

    # -- keeping the index in step: the store's hooks, each after its commit ----------

    def _inserted(self, rows: list[tuple[int, NewDelivery]]) -> None:
        for delivery_id, item in rows:
            self.index.add(Delivery(delivery_id, item.mind, item.session, item.interrupt))
            if item.uid is not None:
                self.usages.add(item.uid, 1, len(item.message))

    def _finished(self, ids: list[int]) -> None:
        """Rows just done or dropped leave their uid's sums. Their uid and size are read
        back (by primary key, a few rows) rather than kept in memory for every row; if
        that read fails, the sums are summed again before the next check."""
        try:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                cursor = self.db.execute(
                    "SELECT uid, length(message) FROM deliveries "
                    f"WHERE id IN ({','.join('?' * len(chunk))}) AND uid IS NOT NULL",
                    chunk,
                )
                for uid, message_bytes in cursor:
                    self.usages.add(int(uid), -1, -int(message_bytes))
        except sqlite3.Error:
            self.usages_stale = True

    def _pended(self, ids: Iterable[int]) -> None:
        """Into the index as they now are, those the commit left pending."""
        for row in self.rows(ids, with_message=False):
            if row.state is QueueState.PENDING:
                self.index.add(row.as_delivery(), row.hold_reason)

    def _unpended(self, ids: Iterable[int]) -> None:
        self.index.remove(ids)

    def mark_held(self, holds: Iterable[tuple[int, HoldReason | None]], now: float) -> list[int]:
        """Record the holds the index decided (it counts them already). If the commit
        fails, the index is rebuilt from the database, so that it never believes a hold
        the store does not hold."""
        try:
            return super().mark_held(holds, now)
        except Exception:
            self.index = self.load_index()
            raise

    def next_backoff_deadline(self, after: float | None = None) -> float | None:
        return self.index.next_backoff(float("-inf") if after is None else after)
