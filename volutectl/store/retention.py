"""Retention: finished deliveries leave the queue database, and their pages leave the file.

What goes: done and dropped deliveries, message bodies included, whose finished_at is
more than `gate.retention_days` old; then ended turns as old that no delivery still
points at. What stays: pending and running deliveries, and dead ones until someone
retries or drops them (their turn with them). Ids are never reused (AUTOINCREMENT), so
an id that is gone stays unknown rather than naming another delivery.

How: in small batches, each one commit of at most BATCH_ROWS rows or BATCH_BYTES of
messages, then `PRAGMA incremental_vacuum` of at most VACUUM_PAGES pages (schema 4).
Neither is synced: a batch lost to a power cut only comes back to be deleted again.

When: on a deadline of its own in the gate's loop (`Retention.deadline`), which is a
real deadline, never a poll: the next batch while more is due, else the moment the
oldest finished row expires. A due batch waits for a pass in which nothing happened
(the loop woke for this deadline alone); a gate that is never idle runs it anyway
once it has waited `Pacing.max_wait`, but never in a pass that starts a turn. A batch
costs a few milliseconds (docs/benchmarks.md, "Retention"): that is what a turn ending
during one waits.

At the gate's start, a database that is not yet incremental (one from schema 3 or
before) has its expired rows deleted first and is then converted, once
(schema.enable_incremental_vacuum).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from volutectl import events
from volutectl.events import Sink
from volutectl.faults import crash_point
from volutectl.store import schema
from volutectl.store.queue import Store
from volutectl.store.schema import Transaction

DAY = 86400.0
BATCH_ROWS = 256  # deliveries (and, apart, turns) per batch
BATCH_BYTES = 1 << 20  # message bytes per batch; a larger message goes alone
VACUUM_PAGES = 1024  # pages given back per batch (1 MiB of schema.PAGE_SIZE pages)

# Literal states, not parameters: SQLite uses a partial index only when the query's
# WHERE names the index's own terms, and INDEXED BY makes that an error, not a scan.
FINISHED_ROWS = "FROM deliveries INDEXED BY deliveries_finished WHERE state IN ('done', 'dropped')"
ENDED_TURNS = (
    "FROM turns INDEXED BY turns_ended WHERE state = 'ended' "
    "AND NOT EXISTS (SELECT 1 FROM deliveries WHERE deliveries.turn_id = turns.id)"
)


@dataclass(frozen=True)
class Pacing:
    """When batches run (seconds). Tests shorten them."""

    start_delay: float = 10.0  # leave a new gate's first passes (recovery, a drain) alone
    busy_gap: float = 1.0  # between batches while more is due
    quiet_floor: float = 600.0  # caught up: the next batch no sooner than this
    defer: float = 0.25  # a due batch that met a busy pass looks again this much later
    max_wait: float = 5.0  # ...and once due this long it runs in any pass starting no turn
    error_gap: float = 60.0  # after the disk refused a batch


PACING = Pacing()


@dataclass(frozen=True)
class Batch:
    deliveries: int  # deleted
    turns: int  # deleted
    pages: int = 0  # free pages given back
    more: bool = False  # a limit was reached: more is due now


def _marks(values: Sequence[object]) -> str:
    return ",".join("?" * len(values))


def delete_batch(
    db: sqlite3.Connection,
    cutoff: float,
    *,
    rows: int = BATCH_ROWS,
    message_bytes: int = BATCH_BYTES,
) -> Batch:
    """Delete one batch of what finished before `cutoff` (seconds since the epoch), in
    one commit: the oldest done and dropped deliveries, then ended turns that no
    delivery points at any more."""
    with Transaction(db, durable=False):
        found = db.execute(
            f"SELECT id, length(message) {FINISHED_ROWS} AND finished_at < ? "
            "ORDER BY finished_at LIMIT ?",
            (cutoff, rows),
        ).fetchall()
        ids: list[int] = []
        total = 0
        for delivery_id, size in found:
            if ids and total + size > message_bytes:
                break
            ids.append(delivery_id)
            total += size
        if ids:
            db.execute(
                f"DELETE FROM deliveries WHERE id IN ({_marks(ids)}) "
                "AND state IN ('done', 'dropped')",
                ids,
            )
        turns = [
            turn_id
            for (turn_id,) in db.execute(
                f"SELECT id {ENDED_TURNS} AND ended_at < ? ORDER BY ended_at LIMIT ?",
                (cutoff, rows),
            )
        ]
        if turns:
            db.execute(f"DELETE FROM turns WHERE id IN ({_marks(turns)})", turns)
            # The leases granted on them, ended with them (schema 10; ids not reused).
            db.execute(
                f"DELETE FROM leases WHERE turn_id IN ({_marks(turns)}) AND ended_at IS NOT NULL",
                turns,
            )
        crash_point("retention_deleted")
    # A limit reached means more may be due now.
    more = len(found) == rows or len(ids) < len(found) or len(turns) == rows
    return Batch(len(ids), len(turns), more=more)


def reclaim(db: sqlite3.Connection, pages: int = VACUUM_PAGES) -> tuple[int, int]:
    """Give back up to `pages` free pages (truncating the file at the next checkpoint);
    returns (given back, still free). Nothing on a database that is not incremental."""
    free = int(db.execute("PRAGMA freelist_count").fetchone()[0])
    if not free or not schema.is_incremental(db):
        return 0, 0
    step = min(free, pages)
    # The pragma frees one page per step of its statement, and Python's execute() steps
    # a statement without result columns once: executescript() steps it to the end. It
    # commits any open transaction first, so it runs in one of its own.
    db.execute("PRAGMA synchronous=NORMAL")
    try:
        db.executescript(f"BEGIN IMMEDIATE; PRAGMA incremental_vacuum({step}); COMMIT;")
    except sqlite3.Error:
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
        raise
    finally:
        db.execute("PRAGMA synchronous=FULL")
    left = int(db.execute("PRAGMA freelist_count").fetchone()[0])
    return free - left, left


def next_expiry(db: sqlite3.Connection) -> float | None:
    """When the oldest finished delivery, or ended turn that nothing points at, finished
    (seconds since the epoch); None if there is none."""
    times = [
        db.execute(f"SELECT MIN(finished_at) {FINISHED_ROWS}").fetchone()[0],
        db.execute(f"SELECT ended_at {ENDED_TURNS} ORDER BY ended_at LIMIT 1").fetchone(),
    ]
    found = [
        float(value[0] if isinstance(value, tuple) else value)
        for value in times
        if value is not None
    ]
    return min(found) if found else None


class Retention:
    """The gate's retention: its deadline, and a batch when the loop can spare one."""

    def __init__(
        self,
        store: Store,
        retention_days: Callable[[], float],
        sink: Sink,
        pacing: Pacing | None = None,
    ) -> None:
        self.store = store
        self.clock = store.clock  # the gate's, which its store was given
        self.retention_days = retention_days  # gate.retention_days, as a reload left it
        self.sink = sink
        self.pacing = pacing or PACING
        self.due_since: float | None = None  # when the due batch first met a busy pass
        self.latch = events.Latch(sink.emit, self.pacing.error_gap)  # the queue refused one
        self.due: float | None = self._first_due()

    @property
    def keep_seconds(self) -> float:
        return self.retention_days() * DAY

    def _first_due(self) -> float:
        """A new gate's first batch: after `start_delay` if anything has expired, else
        when the oldest finished row will (an idle gate sleeps until then)."""
        mono, now = self.clock.monotonic(), self.clock.wall()
        oldest = next_expiry(self.store.db)
        expires = (oldest if oldest is not None else now) + self.keep_seconds
        return mono + max(self.pacing.start_delay, expires - now)

    def deadline(self) -> float | None:
        """Monotonic time of the next batch."""
        return self.due

    def on_pass(self, mono: float, idle: bool, started: bool) -> None:
        """At the end of a pass: run the due batch if this pass may take it.

        `idle`: the pass woke for deadlines alone (no client, turn or systemd news);
        `started`: it started a turn. A batch never follows a start; it waits for an
        idle pass, or, due for `max_wait` already, takes any other."""
        if self.due is None or mono < self.due:
            return
        if self.due_since is None:
            self.due_since = mono
        waited = mono - self.due_since
        if started or (not idle and waited < self.pacing.max_wait):
            self.due = mono + self.pacing.defer
            return
        self.due_since = None
        self.run_batch(mono)

    def run_batch(self, mono: float) -> Batch | None:
        """One batch and its vacuum; then the deadline of the next."""
        now = self.clock.wall()
        try:
            batch = delete_batch(self.store.db, now - self.keep_seconds)
            pages, left = reclaim(self.store.db)
        except (sqlite3.Error, OSError) as error:
            refused = events.RetentionFailing(error=str(error), retry_seconds=self.pacing.error_gap)
            self.due = self.latch.failed(refused, mono)
            return None
        self.latch.works(events.RetentionWorks())
        batch = Batch(batch.deliveries, batch.turns, pages, batch.more or left > 0)
        if batch.deliveries or batch.turns:
            self.sink.emit(
                events.RetentionDeleted(
                    deliveries=batch.deliveries,
                    turns=batch.turns,
                    days=self.keep_seconds / DAY,
                    pages=pages,
                )
            )
        self.due = mono + self._wait_after(batch, now)
        return batch

    def _wait_after(self, batch: Batch, now: float) -> float:
        if batch.more:
            return self.pacing.busy_gap
        # Caught up. A row finishing from now on expires no sooner than keep_seconds
        # from now, so this is the real next deadline, not a poll.
        oldest = next_expiry(self.store.db)
        expires = (oldest if oldest is not None else now) + self.keep_seconds
        return max(self.pacing.quiet_floor, expires - now)

    def prepare(self, progress: Callable[[], None]) -> None:
        """At the gate's start: make a database that is not yet incremental so, once.

        The expired rows go first, batch after batch, so that the VACUUM copies only
        what is kept. `progress` is called about once a second meanwhile (the daemon
        extends its start timeout with it). A failure here is logged, never fatal: the
        gate works the same with a file that does not shrink."""
        db = self.store.db
        try:
            if schema.converted(db):
                return
            if schema.vacuum_attempts(db) < schema.VACUUM_ATTEMPTS:
                self._delete_expired(progress)
        except (sqlite3.Error, OSError) as error:
            self.sink.emit(events.RetentionDeleteFailed(error=str(error)))
        try:
            outcome = schema.enable_incremental_vacuum(db, self.store.path, progress)
        except (sqlite3.Error, OSError) as error:  # a full disk: the gate starts all the same
            outcome = schema.Vacuum(False, "warning", f"retention: not converted: {error}")
        self.sink.emit(
            events.VacuumConversion(
                done=outcome.done, outcome_level=outcome.level, text=outcome.message
            )
        )
        self.due = self._first_due()

    def _delete_expired(self, progress: Callable[[], None]) -> None:
        # Progress is for systemd's start timeout: on the host's clock, not the gate's.
        cutoff, deleted, last = self.clock.wall() - self.keep_seconds, 0, time.monotonic()
        while True:
            batch = delete_batch(self.store.db, cutoff)
            deleted += batch.deliveries
            if time.monotonic() - last >= 1.0:
                progress()
                last = time.monotonic()
            if not batch.more:
                break
        if deleted:
            self.sink.emit(
                events.RetentionDeletedAtStart(deliveries=deleted, days=self.keep_seconds / DAY)
            )
