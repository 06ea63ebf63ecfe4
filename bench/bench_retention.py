"""Retention: the queue file's size after many deliveries, and what a batch costs a handoff.

1. Size. The same history is written twice through the Store's own calls (deliver, start
   the turn, settle it done), one delivery per turn, spread evenly over `--days`
   simulated days: once with no retention, once with retention as the gate runs it
   (`gate.retention_days`, batches of volutectl/store/retention.py with their incremental
   vacuum, run until caught up once every simulated hour, as the gate's deadline would).
   These databases live on /dev/shm when there is one: the file's size does not depend
   on the fsyncs, and 300,000 of them would take the SD card's afternoon.
2. Handoff. On a database on disk (`--dir`), holding a week of finished rows and enough
   expired ones for every sample, the store's part of a handoff: the ended turn settled
   (no fsync, as the gate does when a start follows) and the next turn started (one
   durable commit). Alternately alone, and right after one retention batch (delete and
   vacuum), which is what a turn ending at the start of a batch waits for: the gate never
   runs a batch in a pass that starts a turn, so a batch delays a handoff by at most its
   own length. The systemd part of a handoff (bench_gate.py) is the same in both.
3. Conversion. The one VACUUM that makes an existing (schema 3) database incremental, on
   a fifth as many rows: the WAL it writes beside the database, against the live pages
   (volutectl/store/schema.py checks for that much free space before it tries).

    .venv/bin/python bench/bench_retention.py [--deliveries 100000] [--days 30]
        [--message-bytes 1024] [--retention-days 7] [--samples 101] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from volutectl.states import Outcome
from volutectl.store import retention, schema
from volutectl.store.queue import NewDelivery, Store
from volutectl.store.retention import delete_batch, reclaim

DAY = 86400.0
HOUR = 3600.0
MINDS = 30
NOW = 1_800_000_000.0  # the simulated clock ends here


def unit_for(turn_id: int) -> str:
    return f"volute-turn-bench-{turn_id}.scope"


def one_delivery(store: Store, index: int, when: float, message: bytes) -> None:
    """Deliver, start a turn, settle it done: one delivery's whole life in the queue."""
    mind, session = f"mind{index % MINDS}", "chat"
    [delivery_id] = store.add_deliveries([NewDelivery(mind, session, message)], now=when)
    assert isinstance(delivery_id, int)
    turn_id, _ = store.start_turn(mind, session, unit_for, [delivery_id], when)
    store.settle_turn(
        turn_id, outcome=Outcome.OK, exit_status=0, detail="", done=[delivery_id],
        returned=[], failed={}, error="", now=when + 1.0,
    )  # fmt: skip


def catch_up(store: Store, cutoff: float) -> int:
    """Batches until nothing more is due, as the gate runs them; returns batches run."""
    batches = 0
    while True:
        batch = delete_batch(store.db, cutoff)
        _, left = reclaim(store.db)
        batches += 1
        if not batch.more and not left:
            return batches


def file_bytes(store: Store) -> int:
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return os.path.getsize(store.path) + os.path.getsize(f"{store.path}-wal")


def write_history(
    path: Path, deliveries: int, days: float, message: bytes, keep_days: float | None
) -> dict[str, float]:
    """`deliveries` spread over `days` days ending at NOW; retention when keep_days."""
    store = Store(path)
    started, batches, next_hour = time.monotonic(), 0, NOW - days * DAY + HOUR
    step = days * DAY / deliveries
    try:
        for index in range(deliveries):
            when = NOW - days * DAY + index * step
            one_delivery(store, index, when, message)
            if keep_days is not None and when >= next_hour:
                batches += catch_up(store, when - keep_days * DAY)
                next_hour += HOUR
        rows = int(store.db.execute("SELECT COUNT(*) FROM deliveries").fetchone()[0])
        return {
            "bytes": file_bytes(store),
            "rows": rows,
            "batches": batches,
            "seconds": time.monotonic() - started,
        }
    finally:
        store.close()


def handoff(store: Store, turn_id: int, delivery_id: int, when: float) -> tuple[int, int]:
    """Settle `turn_id` and start the next held delivery's turn, as a handoff pass does;
    returns the new turn and the next delivery to hold."""
    store.settle_turn(
        turn_id, outcome=Outcome.OK, exit_status=0, detail="", done=[delivery_id],
        returned=[], failed={}, error="", now=when, durable=False,
    )  # fmt: skip
    [held] = store.add_deliveries([NewDelivery("mind0", "chat", b"m")], now=when)
    assert isinstance(held, int)
    new_turn, _ = store.start_turn("mind0", "chat", unit_for, [held], when)
    return new_turn, held


def measure_handoffs(
    directory: Path, source: Path, samples: int, keep_days: float
) -> dict[str, list[float]]:
    """On a copy of `source` on disk: handoffs alone and right after a batch, alternated."""
    path = directory / "handoff.sqlite3"
    shutil.copyfile(source, path)
    store = Store(path)
    times: dict[str, list[float]] = {
        "alone": [], "after a batch": [], "batch": [], "its delete": [], "its vacuum": []
    }  # fmt: skip
    try:
        cutoff = NOW - keep_days * DAY
        [first] = store.add_deliveries([NewDelivery("mind0", "chat", b"m")], now=NOW)
        assert isinstance(first, int)
        turn_id, _ = store.start_turn("mind0", "chat", unit_for, [first], NOW)
        delivery_id = first
        for sample in range(2 * samples):
            with_batch = sample % 2 == 1
            began = time.perf_counter()
            if with_batch:
                batch = delete_batch(store.db, cutoff)
                deleted = time.perf_counter()
                reclaim(store.db)
                assert batch.deliveries == retention.BATCH_ROWS, batch  # a full batch
                times["batch"].append(time.perf_counter() - began)
                times["its delete"].append(deleted - began)
                times["its vacuum"].append(time.perf_counter() - deleted)
            turn_id, delivery_id = handoff(store, turn_id, delivery_id, NOW + sample)
            times["after a batch" if with_batch else "alone"].append(time.perf_counter() - began)
    finally:
        store.close()
    return times


def measure_conversion(path: Path, deliveries: int, message: bytes) -> dict[str, float]:
    """The one VACUUM that makes a schema-3 database (not incremental) incremental: the
    WAL it writes beside the database, against the live pages it copies."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA auto_vacuum = NONE")
    db.execute("CREATE TABLE fixes_the_mode (x)")  # a file's mode is set by its first table
    db.close()
    store = Store(path)
    try:
        for start in range(0, deliveries, 500):
            items = [NewDelivery("mind0", "chat", message)] * min(500, deliveries - start)
            store.add_deliveries(items, now=NOW)
        store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        live = schema.live_bytes(store.db)
        began = time.monotonic()
        schema._vacuum(store.db, lambda: None)
        seconds = time.monotonic() - began
        assert schema.is_incremental(store.db)
        wal = os.path.getsize(f"{path}-wal")
        return {"live": live, "wal": wal, "seconds": seconds}
    finally:
        store.close()


def ms(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deliveries", type=int, default=100_000)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--message-bytes", type=int, default=1024)
    parser.add_argument("--retention-days", type=float, default=7.0)
    parser.add_argument("--samples", type=int, default=101, help="handoffs of each kind")
    parser.add_argument("--dir", type=Path, default=None, help="on-disk directory (handoffs)")
    args = parser.parse_args()
    shm = Path("/dev/shm")
    scratch = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else None))
    disk = Path(tempfile.mkdtemp(dir=args.dir))
    message = b"x" * args.message_bytes
    try:
        print(f"{args.deliveries} deliveries of {args.message_bytes} B over {args.days:g} days, "
              f"one per turn, {MINDS} minds")  # fmt: skip
        sizes: dict[str, dict[str, float]] = {}
        for name, keep in (("no retention", None), ("retention", args.retention_days)):
            label = name if keep is None else f"retention {keep:g} days"
            found = write_history(scratch / f"{name}.sqlite3", args.deliveries, args.days,
                                  message, keep)  # fmt: skip
            sizes[name] = found
            print(f"  {label:<22} file {found['bytes'] / 2**20:7.1f} MiB, "
                  f"{found['rows']:.0f} rows, {found['batches']:.0f} batches "
                  f"(written in {found['seconds']:.0f} s)")  # fmt: skip
        ratio = sizes["no retention"]["bytes"] / sizes["retention"]["bytes"]
        print(f"  ratio {ratio:.1f}x")
        conversion = measure_conversion(scratch / "schema3.sqlite3", args.deliveries // 5, message)
        live, wal = conversion["live"], conversion["wal"]
        print(f"converting a schema-3 database of {args.deliveries // 5} rows to incremental: "
              f"live pages {live / 2**20:.1f} MiB, WAL written {wal / 2**20:.1f} MiB "
              f"({wal / live:.2f}x), {conversion['seconds']:.1f} s")  # fmt: skip
        # The handoff database: the kept week plus 256 expired rows per sample.
        source = scratch / "handoff-source.sqlite3"
        expired = (args.samples + 1) * retention.BATCH_ROWS
        week = int(args.deliveries * args.retention_days / args.days)
        write_history(source, week + expired, (week + expired) / args.deliveries * args.days,
                      message, None)  # fmt: skip
        times = measure_handoffs(disk, source, args.samples, args.retention_days)
        print(f"handoff, store part, on disk ({disk}), {args.samples} of each, alternated:")
        for kind, values in times.items():
            print(f"  {kind:<14} median {ms(values, 0.5):6.2f} ms   p90 {ms(values, 0.9):6.2f} ms")
        extra = statistics.median(times["after a batch"]) - statistics.median(times["alone"])
        print(f"  a batch adds {1000 * extra:.2f} ms to the median handoff")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
