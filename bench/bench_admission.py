"""Admission at depth: one pass of the gate's admission, today's full scan against the
incremental index, side by side in the same run, at 1,000 / 10,000 / 100,000 pending.

No systemd is needed: this is the gate's own Store on a real SQLite file (WAL,
synchronous=FULL, on /var/tmp) and its own admission code, driven as the gate drives them.

1. One pass, at each scale (200-byte messages, 2 sessions per mind, global cap 2, two
   turns running, everything else held):
   - "delivery": one delivery has just been committed; the pass decides, then writes
     the hold reasons that changed (one: the new row's);
   - "turn end": a running turn has just ended; the pass starts the next session in
     order and writes what changed.
   The scan is what the gate did before volutectl/store/index.py: `Store.pending()` and
   `admission.admit()` over every row, then the changed holds. The index is
   `IndexedStore.index.admit()`, then the changed holds.
2. Ack at depth: one durable commit of one delivery plus the pass it causes, at an empty
   queue and at 10,000 pending (the gate's work per acknowledgement with one client).
3. Gate start at 100,000 pending: open the store (migrations), build the index, first
   pass; and VmHWM/VmRSS of a fresh process that imports the gate and does that, at 0
   and 100,000 pending.
4. Writes to the disk: bytes written (/proc/PID/io write_bytes), fsync/fdatasync calls
   (strace -c) and WAL growth per delivery, per turn (start, release, settle) and per
   handoff (settle without fsync + the next start), against a plain sqlite3
   synchronous=FULL insert per row in the same run.

Run: .venv/bin/python bench/bench_admission.py [--rounds N] [--scales 1000:100 ...]
One section alone: --sections 4 (or any of 1 2 3 4).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from volutectl.core import admission
from volutectl.core.admission import Limits, LiveTurn
from volutectl.states import Outcome
from volutectl.store.indexed import IndexedStore
from volutectl.store.queue import Store
from volutectl.store.rows import NewDelivery

MESSAGE = b"x" * 200
LIMITS = Limits(global_cap=2)


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else float("nan")


def fill(path: Path, rows: int, minds: int) -> None:
    """`rows` pending deliveries over `minds` minds, two sessions each, one commit."""
    store = Store(path)
    items = [NewDelivery(f"m{i % minds}", f"s{(i // minds) % 2}", MESSAGE) for i in range(rows)]
    store.add_deliveries(items, now=1000.0)
    store.close()


class Scan:
    """The gate's admission before the index: every pending row, every pass."""

    def __init__(self, path: Path) -> None:
        self.store = Store(path)
        self.live: dict[int, LiveTurn] = {}

    def one_pass(self, now: float) -> admission.Admission:
        rows = {row.id: row for row in self.store.pending()}
        decision = admission.admit(
            [row.as_delivery() for row in rows.values()], list(self.live.values()), LIMITS, now=now
        )
        changes = [
            (hold.delivery_id, hold.reason)
            for hold in decision.holds
            if rows[hold.delivery_id].hold_reason != hold.reason
        ]
        self.store.mark_held(changes, now)
        return decision

    def carry_out(self, decision: admission.Admission, now: float) -> None:
        for start in decision.starts:
            turn_id, _ = self.store.start_turn(
                start.mind, start.session, lambda t: f"t{t}", start.delivery_ids, now
            )
            self.live[turn_id] = LiveTurn(turn_id, start.mind, start.session)
        for fold in decision.folds:
            self.store.fold_into(fold.turn_id, fold.delivery_ids, now)


class Indexed(Scan):
    """The gate's admission now: the index, kept in step by IndexedStore."""

    def __init__(self, path: Path, limits: Limits = LIMITS) -> None:
        self.store: IndexedStore = IndexedStore(path)
        self.live = {}
        self.limits = limits

    def one_pass(self, now: float) -> admission.Admission:
        decision, changes = self.store.index.admit(list(self.live.values()), self.limits, now=now)
        self.store.mark_held(changes, now)
        return decision


def end_one(gate: Scan, now: float) -> None:
    """The oldest running turn ends, its rows done (not timed)."""
    turn_id = min(gate.live)
    done = [row.id for row in gate.store.rows_of_turn(turn_id)]
    gate.store.settle_turn(
        turn_id, outcome=Outcome.OK, exit_status=0, detail="", done=done, returned=[],
        failed={}, error="", now=now,
    )  # fmt: skip
    del gate.live[turn_id]


def measure_passes(work: Path, rows: int, minds: int, rounds: int) -> dict[str, Any]:
    result: dict[str, Any] = {"rows": rows, "minds": minds}
    gates: dict[str, Scan] = {}
    for name, kind in (("scan", Scan), ("index", Indexed)):
        path = work / f"{name}-{rows}.sqlite3"
        fill(path, rows, minds)
        started = time.perf_counter()
        gate = kind(path)
        result[f"{name}_open_ms"] = (time.perf_counter() - started) * 1000
        gate.carry_out(gate.one_pass(1000.0), 1000.0)  # the steady state: 2 running
        gates[name] = gate
    times: dict[str, list[float]] = {f"{n}_{e}": [] for n in gates for e in ("deliver", "end")}
    # One kind after the other, not paired: the scan's garbage (a Row per pending row
    # per pass) would set off the collector inside the index's passes. The gate freezes
    # what it loads at start (gc.freeze), so the index's rows are not scanned; so here.
    for name, gate in gates.items():
        gc.collect()
        gc.freeze()
        now = 1001.0
        for _ in range(rounds):
            gate.store.add_deliveries([NewDelivery("m0", "s0", MESSAGE)], now=now)
            started = time.perf_counter()
            decision = gate.one_pass(now)
            times[f"{name}_deliver"].append((time.perf_counter() - started) * 1000)
            gate.carry_out(decision, now)
            end_one(gate, now)
            started = time.perf_counter()
            decision = gate.one_pass(now)
            times[f"{name}_end"].append((time.perf_counter() - started) * 1000)
            assert len(decision.starts) == 1, decision.starts  # the next session started
            gate.carry_out(decision, now)
            now += 1.0
        gc.unfreeze()
    for gate in gates.values():
        gate.store.close()
    result.update(times)
    return result


def measure_acks(work: Path, depth: int, rounds: int) -> dict[str, list[float]]:
    """One delivery's durable commit plus the pass it causes, per kind."""
    out: dict[str, list[float]] = {}
    gates: dict[str, Scan] = {}
    for name, kind in (("scan", Scan), ("index", Indexed)):
        path = work / f"ack-{name}-{depth}.sqlite3"
        # Two turns fill the cap (at depth 0, the only two rows); mind q is held by it.
        fill(path, max(depth, 2), 1000 if depth else 2)
        gates[name] = kind(path)
        gates[name].carry_out(gates[name].one_pass(1000.0), 1000.0)
        out[name] = []
    for name, gate in gates.items():  # one kind after the other, as in measure_passes
        gc.collect()
        gc.freeze()
        for _ in range(rounds):
            started = time.perf_counter()
            gate.store.add_deliveries([NewDelivery("q", "main", MESSAGE)])
            gate.carry_out(gate.one_pass(time.time()), time.time())
            out[name].append((time.perf_counter() - started) * 1000)
        gc.unfreeze()
    for gate in gates.values():
        gate.store.close()
    return out


def inner_start(path: str, kind: str) -> None:
    """In a fresh process: import the gate, open the store, first pass; print figures."""
    import volutectl.gate.loop  # noqa: F401  (the gate's imports count in its RSS)

    started = time.perf_counter()
    gate = Indexed(Path(path)) if kind == "index" else Scan(Path(path))
    gate.one_pass(time.time())
    elapsed = (time.perf_counter() - started) * 1000
    status = Path("/proc/self/status").read_text()
    kib = {k: int(v) for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.M)}
    print(json.dumps({"start_ms": elapsed, **kib}))


def measure_start(work: Path, rows: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for count in (0, rows):
        path = work / f"start-{count}.sqlite3"
        fill(path, count, 1000 if count else 1)
        settled = Indexed(path)  # a gate ran before: the holds are recorded
        settled.one_pass(time.time())
        settled.store.close()
        for kind in ("scan", "index"):
            runs = []
            for _ in range(3):
                copy = work / f"start-copy-{kind}.sqlite3"
                shutil.copy(path, copy)
                for suffix in ("-wal", "-shm"):
                    Path(f"{copy}{suffix}").unlink(missing_ok=True)
                done = subprocess.run(
                    [sys.executable, __file__, "--inner-start", str(copy), kind],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                runs.append(json.loads(done.stdout))
            out[f"{kind}_{count}"] = {
                "start_ms": med([r["start_ms"] for r in runs]),
                "rss_mib": med([r["VmRSS"] / 1024 for r in runs]),
                "hwm_mib": med([r["VmHWM"] / 1024 for r in runs]),
            }
    return out


def inner_writes(path: str, what: str, count: int) -> None:
    """In a fresh process (under strace): `count` of one operation; print write_bytes.
    Writes to /dev/null mark the measured loop's start and end in the trace."""
    marker = os.open("/dev/null", os.O_WRONLY)
    before = _write_bytes()
    if what == "plain":
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, body BLOB)")
        before = _write_bytes()
        os.write(marker, b"start")
        for _ in range(count):
            db.execute("INSERT INTO t (body) VALUES (?)", (MESSAGE,))
        os.write(marker, b"end")
        written = _write_bytes() - before
        wal_size = Path(f"{path}-wal").stat().st_size
        before = _write_bytes()
        db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        checkpoint = _write_bytes() - before
        db.close()
    else:
        # Cap 1: one turn at a time. Turns take deliveries made before the loop, one
        # session each, so that the loop's figures are the turns' alone.
        gate = Indexed(Path(path), Limits(global_cap=1))
        now = time.time()
        if what.startswith("delivery"):  # a turn of another mind fills the cap: held
            gate.store.add_deliveries([NewDelivery("block", "main", MESSAGE)], now=now)
        else:
            items = [NewDelivery("m1", f"s{i}", MESSAGE) for i in range(count + 1)]
            gate.store.add_deliveries(items, now=now)
        gate.carry_out(gate.one_pass(now), now)  # one turn runs, the rest held
        before = _write_bytes()
        os.write(marker, b"start")
        for _ in range(count):
            if what.startswith("delivery"):  # as `deliver` sends it: a request id, a uid
                item = NewDelivery("m1", "s1", MESSAGE, request_id=os.urandom(16).hex(), uid=1000)
                gate.store.add_deliveries([item], now=now)
                gate.one_pass(now)  # held (cap): its hold is written, unsynced
            else:  # a turn: started, released, settled
                _turn(gate, now, handoff=what == "handoff")
            if what.endswith("-ckpt"):  # each alone: the gate's checkpoint after a quiet second
                gate.store.checkpoint()
        os.write(marker, b"end")
        written = _write_bytes() - before
        wal_size = Path(f"{path}-wal").stat().st_size
        before = _write_bytes()
        gate.store.checkpoint()  # as the gate does after a quiet second
        checkpoint = _write_bytes() - before
        gate.store.close()
    print(json.dumps({"write_bytes": written, "wal_size": wal_size, "checkpoint": checkpoint}))


def _turn(gate: Indexed, now: float, *, handoff: bool) -> None:
    """The running turn is released and ends; the next held one starts. On a handoff
    the settlement skips its fsync (the next start's commit covers it, as in the gate);
    otherwise it is durable on its own."""
    for turn_id in list(gate.live):
        gate.store.mark_released(turn_id, os.getpid())
        done = [row.id for row in gate.store.rows_of_turn(turn_id)]
        gate.store.settle_turn(
            turn_id, outcome=Outcome.OK, exit_status=0, detail="", done=done,
            returned=[], failed={}, error="", now=now, durable=not handoff,
        )  # fmt: skip
        del gate.live[turn_id]
    gate.carry_out(gate.one_pass(now), now)
    gate.store.sync()  # a no-op when the start's commit synced the settlement


def _write_bytes() -> int:
    text = Path("/proc/self/io").read_text()
    return int(re.search(r"^write_bytes: (\d+)", text, re.M).group(1))  # type: ignore[union-attr]


def measure_writes(work: Path, count: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for what in ("plain", "delivery", "turn", "handoff", "delivery-ckpt", "turn-ckpt"):
        path = work / f"writes-{what}.sqlite3"
        if what != "plain":
            Store(path).close()
        trace = work / f"strace-{what}.txt"
        done = subprocess.run(
            ["strace", "-f", "-y", "-e", "trace=pwrite64,write,fsync,fdatasync", "-o", str(trace),
             sys.executable, __file__, "--inner-writes", str(path), what, str(count)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        inner = json.loads(done.stdout)
        wal_bytes = db_bytes = syncs = 0
        # Only the measured loop: the inner process marks its start and end with a write
        # of its own to /dev/null.
        text = trace.read_text().split("</dev/null>")
        for line in (text[1] if len(text) > 2 else "").splitlines():
            call = re.search(r"(pwrite64|write|fsync|fdatasync)\(\d+<([^>]*)>.*= (-?\d+)", line)
            if call is None:
                continue
            name, file, value = call.group(1), call.group(2), int(call.group(3))
            if name in ("fsync", "fdatasync"):
                syncs += 1
            elif file.endswith("-wal"):
                wal_bytes += value
            elif file.endswith(".sqlite3"):
                db_bytes += value
        out[what] = {
            "bytes": inner["write_bytes"] / count,
            "syncs": syncs / count,
            "wal_bytes": wal_bytes / count,
            "db_bytes": db_bytes / count,
            "wal_size_kib": inner["wal_size"] / 1024,
            "checkpoint": inner["checkpoint"] / count,
        }
    return out


def report(results: dict[str, Any]) -> None:
    if results["passes"]:
        report_passes(results)
    if "acks" in results:
        report_acks(results)
    if "start" in results:
        report_start(results)
    if "writes" in results:
        report_writes(results)


def report_passes(results: dict[str, Any]) -> None:
    print("\n1. One admission pass (ms, median / p90), today's scan vs the index, same run")
    print(f"{'pending':>9} {'minds':>6} {'event':>9} {'scan':>18} {'index':>18} {'ratio':>8}")
    for scale in results["passes"]:
        for event in ("deliver", "end"):
            scan, index = scale[f"scan_{event}"], scale[f"index_{event}"]
            print(
                f"{scale['rows']:>9,} {scale['minds']:>6,} {event:>9} "
                f"{med(scan):>8.2f} / {p90(scan):>7.2f} {med(index):>8.3f} / {p90(index):>7.3f} "
                f"{med(scan) / med(index):>7.0f}x"
            )


def report_acks(results: dict[str, Any]) -> None:
    print("\n2. One acknowledgement's work: durable commit + the pass it causes (ms, median)")
    acks = results["acks"]
    for kind in ("scan", "index"):
        empty, deep = med(acks["0"][kind]), med(acks[str(results["ack_depth"])][kind])
        print(
            f"  {kind:<6} empty {empty:6.2f} ms ({1000 / empty:5.0f}/s)   depth "
            f"{results['ack_depth']:,} {deep:7.2f} ms ({1000 / deep:5.0f}/s)   "
            f"depth/empty rate {empty / deep:.2f}x"
        )


def report_start(results: dict[str, Any]) -> None:
    print(f"\n3. Gate start with {results['start_rows']:,} pending (fresh process, median of 3)")
    start = results["start"]
    for kind in ("scan", "index"):
        deep, empty = start[f"{kind}_{results['start_rows']}"], start[f"{kind}_0"]
        print(
            f"  {kind:<6} open + first pass {deep['start_ms']:7.0f} ms   VmRSS "
            f"{deep['rss_mib']:5.1f} MiB (peak {deep['hwm_mib']:5.1f})   empty queue: "
            f"{empty['start_ms']:5.0f} ms, VmRSS {empty['rss_mib']:5.1f} MiB"
        )


def report_writes(results: dict[str, Any]) -> None:
    print(f"\n4. Writes per operation ({results['write_count']} each, fresh process, strace -c)")
    print(
        f"  {'operation':<46} {'write_bytes':>11} {'fsyncs':>7} {'to WAL':>8} {'to db':>7}"
        f" {'then ckpt':>9}   (per operation; to db = checkpoints in the loop; then ckpt:"
        " one checkpoint after it)"
    )
    labels = {
        "plain": "baseline: sqlite3 insert, synchronous=FULL",
        "delivery": "delivery (durable commit + pass)",
        "turn": "turn (release, durable settle, next start)",
        "handoff": "handoff (release, settle unsynced, next start)",
        "delivery-ckpt": "delivery, each then checkpointed",
        "turn-ckpt": "turn, each then checkpointed",
    }
    for what, label in labels.items():
        w = results["writes"][what]
        print(
            f"  {label:<46} {w['bytes']:>11.0f} {w['syncs']:>7.2f} {w['wal_bytes']:>8.0f} "
            f"{w['db_bytes']:>7.0f} {w.get('checkpoint', 0):>9.0f}   "
            f"WAL file {w['wal_size_kib']:.0f} KiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--scales", nargs="+", default=["1000:100", "10000:1000", "100000:1000"])
    parser.add_argument("--ack-depth", type=int, default=10_000)
    parser.add_argument("--start-rows", type=int, default=100_000)
    parser.add_argument("--write-count", type=int, default=200)
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["1", "2", "3", "4"],
        choices=["1", "2", "3", "4"],
        help="run only these sections",
    )
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--inner-start", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--inner-writes", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner_start:
        inner_start(*args.inner_start)
        return
    if args.inner_writes:
        inner_writes(args.inner_writes[0], args.inner_writes[1], int(args.inner_writes[2]))
        return
    began, load_before = time.time(), os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="volute-bench-admission.", dir="/var/tmp"))
    try:
        results: dict[str, Any] = {"passes": [], "ack_depth": args.ack_depth}
        if "1" in args.sections:
            for scale in args.scales:
                rows, minds = (int(part) for part in scale.split(":"))
                print(f"  passes at {rows:,} pending over {minds:,} minds ...", flush=True)
                results["passes"].append(measure_passes(work, rows, minds, args.rounds))
        if "2" in args.sections:
            print("  acknowledgements ...", flush=True)
            results["acks"] = {
                str(depth): measure_acks(work, depth, args.rounds) for depth in (0, args.ack_depth)
            }
        if "3" in args.sections:
            print("  gate start ...", flush=True)
            results["start_rows"] = args.start_rows
            results["start"] = measure_start(work, args.start_rows)
        if "4" in args.sections:
            print("  writes ...", flush=True)
            results["write_count"] = args.write_count
            results["writes"] = measure_writes(work, args.write_count)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results)
    print(
        f"\n(bench took {time.time() - began:.0f} s; {os.cpu_count()} CPUs; load average "
        f"before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
