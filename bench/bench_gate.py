"""The turn gate, end to end, in a throwaway systemd: handoff, deliver, enqueue, idle.

Boots a container (volute_testbed.machine: systemd-nspawn over an overlay of this root, the
checkout and venv bound at the same paths), installs units/ with this checkout's
volutectl, and starts volute-gate.service. The gate's state directory and socket live in
a work directory on the host's disk (/var/tmp, ext4), bound into the container, so its
synchronous=FULL commits reach a real disk, not the overlay's tmpfs. Every figure has a
baseline measured in the same run:

1. Handoff: the last process of a turn exits -> the next held turn's command runs in its
   scope. global_concurrent_turns = 1; three minds whose command is bench/stamp.c (static,
   built here): its first action stamps CLOCK_MONOTONIC ("S"), then it sleeps the hold
   time its delivery carries (random, 0.2-1.2 s), and its last action stamps "E". Each
   delivery goes to its own session, so each is one turn. Handoff = S(next) - E(prev).
   The span also holds the turn wrapper's tail (/bin/sh writing the exit status, then
   exiting), which is part of every turn. Beside it, on the same event times, the
   reference designs' wake-up schedules are simulated: (a) a 15 s sweep with a random
   phase; (b) 150 ms x1.6 backoff capped at 2 s, +-25 % jitter, by a waiter that began
   waiting when the previous turn started. The simulations count only the delay to
   notice the end, not their own launch cost.
2. `volutectl deliver` wall time inside the container (gate running, deliveries held
   behind a running turn) against `python3 -c pass`, `python3 -I -c pass` and the venv
   interpreter's `-I -c pass`, interleaved in a shuffled order.
3. Sustained enqueue rate, one durable commit before each ack: N clients (one connection
   each, closed loop, one selector loop in this process) each sending M deliveries of
   200 bytes to a mind held by the global cap. Then the same at a deep queue, and an
   strace pass counting fsync/fdatasync (acks per fsync = group commit). Baseline: a
   plain sqlite3 loop, WAL, synchronous=FULL, one commit per 200-byte row, on the same
   filesystem.
4. Idle: the gate's VmRSS and context switches (all its threads, voluntary +
   nonvoluntary) over a quiet window, with no turn, and again while holding deliveries
   behind a running turn. Each wakeup from select() is at least one switch; the unit's
   WatchdogSec=30s means one WATCHDOG=1 ping every 15 s.

    .venv/bin/python bench/bench_gate.py [--handoffs 40] [--runs 30] [--messages 100]
    .venv/bin/python bench/bench_gate.py --handoff-only [--handoffs 40]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import selectors
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from volute_testbed.diskprobe import percentile
from volute_testbed.gate import VOLUTECTL, start_gate
from volute_testbed.machine import dev_machine
from volute_testbed.paths import PYTHON

REPO = Path(__file__).resolve().parents[1]
HANDOFF_MINDS = ("h1", "h2", "h3")
TARGET_HANDOFF_MS = 25.0
WATCHDOG_SEC = 30.0
MESSAGE = "m" * 200


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def row(label: str, values: list[float], unit: str = "ms", base: float | None = None) -> str:
    m = med(values)
    ratio = f"{m / base:8.2f}x" if base else " " * 9
    return (
        f"  {label:<44} {m:10.2f} {percentile(values, 0.9):10.2f} {unit:<4} {ratio}"
        f"  (n={len(values)})"
    )


def header(title: str, unit_note: str = "median        p90") -> None:
    print(f"\n{title}")
    print(f"  {'':<44} {unit_note:>21}       ratio")


# -- the inside part: deliver wall time, run in the container ----------------------------


def inner_deliver(runs: int, seed: int) -> None:
    commands = {
        "volutectl deliver": [VOLUTECTL, "deliver", "q", "--message", "x"],
        "python3 -c pass": ["/usr/bin/python3", "-c", "pass"],
        "python3 -I -c pass": ["/usr/bin/python3", "-I", "-c", "pass"],
        "venv python -I -c pass": [PYTHON, "-I", "-c", "pass"],
    }
    rng = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for argv in commands.values():  # warm the page cache
        subprocess.run(argv, stdout=subprocess.DEVNULL, check=True)
    for _ in range(runs):
        order = list(commands)
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter_ns()
            subprocess.run(commands[name], stdout=subprocess.DEVNULL, check=True)
            times[name].append((time.perf_counter_ns() - start) / 1e6)
    print(json.dumps(times))


def inner_floor(turns: int, stamp: str, log: str, seed: int) -> None:
    """The handoff floor: the same adapter and turn wrapper, nothing else.

    One process forks each turn (blocked on a pipe), has systemd put it in a scope
    (Manager.start_scope), releases it into the gate's /bin/sh wrapper running the stamp
    helper, and starts the next one as soon as the scope is reported ended (checked
    against ActiveState, as the gate does). No queue, no SQLite, no account lookup.
    """
    import select

    from volutectl.launcher.fork import WRAPPER
    from volutectl.systemd.adapter import LIVE_STATES, Manager, ScopeProperties

    rng = random.Random(seed)
    holds = [1000] + [rng.randint(200, 1200) for _ in range(turns - 1)]
    props = ScopeProperties(slice="volute-turns.slice", description="bench floor")
    turn_dir = tempfile.mkdtemp(dir="/var/tmp")
    with Manager.connect() as manager:
        manager.watch_units()
        for i, hold in enumerate(holds):
            unit = f"volute-floor-{i}.scope"
            env = {"VOLUTE_TURN_ID": f"f{i}", "VOLUTE_MIND": "floor", "VOLUTE_TURN_DIR": turn_dir}
            argv = ["/bin/sh", WRAPPER, stamp, log, str(hold)]
            read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(write_fd)
                    if os.read(read_fd, 1) == b"1":
                        os.execve("/bin/sh", argv, env)
                finally:
                    os._exit(127)
            os.close(read_fd)
            manager.start_scope(unit, [pid], props)
            os.write(write_fd, b"1")
            os.close(write_fd)
            ended = False
            while not ended:
                select.select([manager.fileno()], [], [], 30)
                for event in manager.process_events():
                    if event.name == unit and (
                        manager.unit_property(unit, "ActiveState") not in LIVE_STATES
                    ):
                        ended = True
            os.waitpid(pid, 0)
    shutil.rmtree(turn_dir, ignore_errors=True)


# -- the host side --------------------------------------------------------------------------


class Gate:
    """The gate service in a booted container, seen from the host."""

    def __init__(self, machine: Any, work: Path) -> None:
        self.machine = machine
        self.work = work
        self.socket = str(work / "gate.sock")

    def inner_pid(self) -> int:
        out = self.machine.run(
            ["systemctl", "show", "-p", "MainPID", "--value", "volute-gate.service"]
        ).stdout
        return int(out.strip())

    def host_pid(self) -> int:
        """The gate's PID in the host's namespace (read /proc without entering)."""
        inner = self.inner_pid()
        ns = os.readlink(f"/proc/{self.machine.leader}/ns/pid")
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry.name}/ns/pid") != ns:
                    continue
                for line in Path(f"/proc/{entry.name}/status").read_text().splitlines():
                    if line.startswith("NSpid:") and int(line.split()[-1]) == inner:
                        return int(entry.name)
            except (OSError, ValueError):
                continue
        raise RuntimeError(f"gate PID {inner} not found from the host")

    def request(self, conn: socket.socket, message: dict[str, Any]) -> dict[str, Any]:
        conn.sendall(json.dumps({"v": 1, **message}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                raise RuntimeError("the gate closed the connection")
            data += chunk
        reply: dict[str, Any] = json.loads(data)
        if not reply.get("ok"):
            raise RuntimeError(f"gate refused {message.get('op')}: {reply}")
        return reply

    def connect(self) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket)
        return conn

    def deliver(self, mind: str, session: str, message: str) -> int:
        with self.connect() as conn:
            reply = self.request(
                conn, {"op": "deliver", "mind": mind, "session": session, "message": message}
            )
        return int(reply["id"])

    def status(self) -> dict[str, Any]:
        with self.connect() as conn:
            result: dict[str, Any] = self.request(conn, {"op": "status"})["status"]
            return result

    def drop(self, ids: list[int]) -> None:
        with self.connect() as conn:
            for start in range(0, len(ids), 500):
                self.request(conn, {"op": "drop", "ids": ids[start : start + 500]})


def proc_sample(pid: int) -> tuple[int, int]:
    """(VmRSS in KiB, context switches summed over all the process's threads)."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    switches = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{task}/status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                switches += int(line.split()[1])
    return rss, switches


def measure_idle(pid: int, seconds: float) -> dict[str, float]:
    _, sw0 = proc_sample(pid)
    time.sleep(seconds)
    rss1, sw1 = proc_sample(pid)
    return {
        "rss_kib": rss1,
        "switches": sw1 - sw0,
        "per_s": (sw1 - sw0) / seconds,
        "seconds": seconds,
        "threads": len(os.listdir(f"/proc/{pid}/task")),
    }


# 1. handoff ---------------------------------------------------------------------------------


def run_handoffs(gate: Gate, log: Path, handoffs: int, rng: random.Random) -> dict[str, Any]:
    turns = handoffs + 1
    holds = [1000] + [rng.randint(200, 1200) for _ in range(turns - 1)]
    for i, hold in enumerate(holds):
        gate.deliver(HANDOFF_MINDS[i % len(HANDOFF_MINDS)], f"s{i}", str(hold))
    wait_turns(log, turns, sum(holds) / 1000 + 60)
    events, measured, overlaps = handoffs_of(log, turns)
    return {
        "events": events,
        "handoff_ms": measured,
        "overlaps": overlaps,
        "sweep_ms": simulate_sweep(events, rng),
        "backoff_ms": simulate_backoff(events, rng),
        "backoff_60s_ms": simulate_backoff([(start, start + 60.0) for start, _ in events], rng),
    }


def wait_turns(log: Path, turns: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if sum(1 for line in text.splitlines() if line.startswith("E ")) >= turns:
            return
        time.sleep(0.2)


def handoffs_of(log: Path, turns: int) -> tuple[list[tuple[float, float]], list[float], int]:
    """(start, end) of each turn in seconds, the handoffs in ms, and overlapping pairs."""
    starts: dict[str, int] = {}
    ends: dict[str, int] = {}
    for line in log.read_text().splitlines():
        kind, turn, _mind, ns = line.split()
        (starts if kind == "S" else ends)[turn] = int(ns)
    order = sorted(starts, key=lambda t: starts[t])
    if len(order) < turns or any(t not in ends for t in order):
        raise RuntimeError(f"only {len(ends)} of {turns} turns finished: {log.read_text()}")
    events = [(starts[t] / 1e9, ends[t] / 1e9) for t in order]
    overlaps = sum(1 for a, b in zip(events, events[1:], strict=False) if b[0] < a[1])
    measured = [(b[0] - a[1]) * 1000 for a, b in zip(events, events[1:], strict=False)]
    return events, measured, overlaps


def traced_handoffs(gate: Gate, log: Path, handoffs: int, rng: random.Random) -> dict[str, int]:
    """A few more handoffs with strace counting the gate's fsync/fdatasync calls.

    strace attaches after the deliveries are acknowledged, so the count covers only
    turns ending and starting."""
    turns = handoffs + 1
    log.unlink(missing_ok=True)
    holds = [1500] + [rng.randint(200, 600) for _ in range(turns - 1)]
    for i, hold in enumerate(holds):
        gate.deliver(HANDOFF_MINDS[i % len(HANDOFF_MINDS)], f"t{i}", str(hold))
    out = gate.work / "strace-handoff.txt"
    tracer = subprocess.Popen(
        ["strace", "-c", "-e", "trace=fsync,fdatasync", "-o", str(out),
         "-p", str(gate.host_pid())],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_turns(log, turns, sum(holds) / 1000 + 60)
    time.sleep(0.3)
    tracer.send_signal(signal.SIGINT)
    tracer.wait(timeout=10)
    return {"turns": turns, "syncs": count_syncs(out)}


def count_syncs(out: Path) -> int:
    syncs = 0
    for line in out.read_text().splitlines():
        parts = line.split()
        if parts and parts[-1] in ("fsync", "fdatasync"):
            syncs += int(parts[3])
    return syncs


def simulate_sweep(events: list[tuple[float, float]], rng: random.Random) -> list[float]:
    """A 15 s redrive sweep with a random phase: the end is noticed at the next tick."""
    delays = []
    for (_, end), _next in zip(events, events[1:], strict=False):
        phase = rng.uniform(0.0, 15.0)
        delays.append(((phase - end) % 15.0) * 1000)
    return delays


def simulate_backoff(events: list[tuple[float, float]], rng: random.Random) -> list[float]:
    """Probes from the previous turn's start: 150 ms x1.6, cap 2 s, +-25 % jitter."""
    delays = []
    for (start, end), _next in zip(events, events[1:], strict=False):
        t, step = start, 0.150
        while True:
            t += step * rng.uniform(0.75, 1.25)
            if t >= end:
                delays.append((t - end) * 1000)
                break
            step = min(step * 1.6, 2.0)
    return delays


# 3. enqueue -----------------------------------------------------------------------------------


def load(gate: Gate, clients: int, messages: int, mind: str = "q") -> dict[str, Any]:
    """`clients` connections, each sending `messages` deliveries back to back."""
    selector = selectors.DefaultSelector()
    conns = []
    for _ in range(clients):
        conn = gate.connect()
        conn.setblocking(False)
        conns.append(conn)
    request = (
        json.dumps(
            {"v": 1, "op": "deliver", "mind": mind, "session": "main", "message": MESSAGE}
        ).encode()
        + b"\n"
    )
    state = {conn.fileno(): {"left": messages, "buf": b"", "sent": 0.0} for conn in conns}
    latencies: list[float] = []
    ids: list[int] = []
    start = time.perf_counter()
    for conn in conns:
        state[conn.fileno()]["sent"] = time.perf_counter()
        conn.sendall(request)
        selector.register(conn, selectors.EVENT_READ)
    active = clients
    while active:
        for key, _ in selector.select():
            conn = key.fileobj
            assert isinstance(conn, socket.socket)
            st = state[conn.fileno()]
            chunk = conn.recv(65536)
            if not chunk:
                raise RuntimeError("the gate closed a client connection")
            st["buf"] += chunk
            while b"\n" in st["buf"]:
                line, st["buf"] = st["buf"].split(b"\n", 1)
                reply = json.loads(line)
                if not reply.get("ok"):
                    raise RuntimeError(f"delivery refused: {reply}")
                now = time.perf_counter()
                latencies.append((now - st["sent"]) * 1000)
                ids.append(int(reply["id"]))
                st["left"] -= 1
                if st["left"]:
                    st["sent"] = now
                    conn.setblocking(True)
                    conn.sendall(request)
                    conn.setblocking(False)
                else:
                    selector.unregister(conn)
                    active -= 1
    elapsed = time.perf_counter() - start
    for conn in conns:
        conn.close()
    selector.close()
    return {
        "clients": clients,
        "messages": clients * messages,
        "rate": clients * messages / elapsed,
        "latency_ms": latencies,
        "ids": ids,
    }


def strace_load(gate: Gate, clients: int, messages: int) -> dict[str, Any]:
    """The same load with strace counting the gate's fsync/fdatasync calls."""
    out = gate.work / f"strace-{clients}.txt"
    pid = gate.host_pid()
    tracer = subprocess.Popen(
        ["strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", str(out), "-p", str(pid)],
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)  # let it attach
    result = load(gate, clients, messages)
    time.sleep(0.2)
    tracer.send_signal(signal.SIGINT)
    tracer.wait(timeout=10)
    result["syncs"] = count_syncs(out)
    return result


def sqlite_baseline(directory: Path, rows: int) -> float:
    path = directory / "baseline.sqlite3"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    db = sqlite3.connect(str(path), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY AUTOINCREMENT, message BLOB NOT NULL)")
    data = MESSAGE.encode()
    start = time.perf_counter()
    for _ in range(rows):
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO t (message) VALUES (?)", (data,))
        db.execute("COMMIT")
    elapsed = time.perf_counter() - start
    db.close()
    return rows / elapsed


# -- orchestration ------------------------------------------------------------------------------


def gate_config(work: Path, stamp: Path, log: Path) -> str:
    minds = "".join(
        f'[minds.{mind}]\ncommand = ["{stamp}", "{log}", "-"]\n\n' for mind in HANDOFF_MINDS
    )
    return (
        f'[gate]\nsocket = "{work / "gate.sock"}"\nstate_dir = "{work / "state"}"\n\n'
        "[limits]\nglobal_concurrent_turns = 1\n\n"
        "[limits.adaptive]\nenabled = false\n\n"  # the static cap alone, as measured before
        f"{minds}"
        '[minds.block]\ncommand = ["sleep", "infinity"]\n\n'
        '[minds.q]\ncommand = ["true"]\n'
    )


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="volute-bench-gate.", dir="/var/tmp"))
    try:
        os.chmod(work, 0o755)
        turns_dir = work / "turns"
        turns_dir.mkdir(mode=0o777)
        os.chmod(turns_dir, 0o777)
        stamp = work / "stamp"
        subprocess.run(
            ["gcc", "-O2", "-static", "-o", str(stamp), str(REPO / "bench/stamp.c")], check=True
        )
        log = turns_dir / "stamps.log"
        print("bench_gate: booting a throwaway systemd (systemd-nspawn) ...", flush=True)
        # A name of its own: machines of one name would share one cgroup tree, and
        # another checkout's benchmark may be running beside this one.
        name = f"volute-bench-gate-{os.getpid()}"
        with dev_machine(name=name, binds=[work]) as machine:
            start_gate(machine, gate_config(work, stamp, log))
            gate = Gate(machine, work)
            wait_for(lambda: os.path.exists(gate.socket), 30, "the gate socket")
            pid = gate.host_pid()
            results["watchdog_usec"] = (
                machine.run(["sh", "-c", f"tr '\\0' '\\n' < /proc/{gate.inner_pid()}/environ"])
                .stdout.split("WATCHDOG_USEC=")[-1]
                .split("\n")[0]
            )
            time.sleep(1.0)
            print(f"  idle, no turns ({args.idle:.0f} s) ...", flush=True)
            results["idle_empty"] = measure_idle(pid, args.idle)

            print(f"  handoff ({args.handoffs} handoffs) ...", flush=True)
            results["handoff"] = run_handoffs(gate, log, args.handoffs, rng)

            print(f"  handoff floor, adapter only ({args.handoffs} handoffs) ...", flush=True)
            floor_log = turns_dir / "floor.log"
            machine.run(
                [sys.executable, str(Path(__file__).resolve()), "--inner-floor",
                 "--handoffs", str(args.handoffs), "--seed", str(args.seed),
                 "--stamp", str(stamp), "--log", str(floor_log)],
                timeout=600,
            )  # fmt: skip
            results["floor_ms"] = handoffs_of(floor_log, args.handoffs + 1)[1]
            if shutil.which("strace"):
                print("  handoffs under strace (fsync count) ...", flush=True)
                results["handoff_syncs"] = traced_handoffs(gate, log, 6, rng)
            if args.handoff_only:
                return results

            # A turn that never ends fills the cap: everything after this is held.
            gate.deliver("block", "main", "hold the cap")
            wait_for(
                lambda: any(t["mind"] == "block" for t in gate.status()["turns"]),
                30,
                "the blocking turn",
            )
            print(f"  deliver wall time ({args.runs} runs each) ...", flush=True)
            inner = machine.run(
                [sys.executable, str(Path(__file__).resolve()), "--inner-deliver",
                 "--runs", str(args.runs), "--seed", str(args.seed)],
                timeout=600,
            )  # fmt: skip
            results["deliver"] = json.loads(inner.stdout)
            time.sleep(1.0)
            status = gate.status()
            results["held_during_idle"] = status["queue_depth"]
            print(f"  idle, holding {status['queue_depth']} ({args.idle:.0f} s) ...", flush=True)
            results["idle_holding"] = measure_idle(pid, args.idle)

            print("  enqueue ...", flush=True)
            # The baseline runs on the host, on the same filesystem, right beside each
            # load (the host is shared; its disk and CPUs drift over a run).
            baselines = []
            enqueue = []
            for clients in args.clients:
                baselines.append(sqlite_baseline(work, args.baseline_rows))
                result = load(gate, clients, args.messages)
                gate.drop(result["ids"])
                enqueue.append(result)
            results["enqueue"] = enqueue
            baselines.append(sqlite_baseline(work, args.baseline_rows))
            results["sqlite_full_rows_s"] = med(baselines)
            results["sqlite_runs"] = baselines
            # The same loads at a deep queue (rows held the whole time).
            fill = load(gate, 16, args.deep // 16)
            depth = gate.status()["queue_depth"]
            # Let the gate checkpoint the fill's WAL (after a quiet second), as the empty
            # runs above began from a checkpointed WAL: otherwise the first deep run pays
            # for the fill's checkpoint, up to 2,000 commits of it, in its first ack.
            time.sleep(2.0)
            deep = [load(gate, clients, args.messages) for clients in (1, 16)]
            for result in deep:
                gate.drop(result["ids"])
            gate.drop(fill["ids"])
            results["deep"] = {"depth": depth, "runs": deep}
            if shutil.which("strace"):
                print("  enqueue under strace (fsync count) ...", flush=True)
                traced = []
                for clients in args.clients:
                    result = strace_load(gate, clients, args.messages)
                    gate.drop(result["ids"])
                    traced.append(result)
                results["traced"] = traced
            results["rss_end_kib"] = proc_sample(pid)[0]
            status = gate.status()
            results["gate_active"] = machine.run(
                ["systemctl", "is-active", "volute-gate.service"], check=False
            ).stdout.strip()
            results["final_status"] = {k: status[k] for k in ("active_turns", "queue_depth")}
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, str, str]]:
    summary: list[tuple[str, str, str]] = []
    h = results["handoff"]
    header(
        f"1. Handoff: last process of a turn exits -> next held turn's command runs "
        f"(cap 1, {len(h['handoff_ms'])} handoffs, holds 0.2-1.2 s)"
    )
    measured = h["handoff_ms"]
    print(row("volutectl gate (measured, CLOCK_MONOTONIC)", measured))
    m = med(measured)
    floor = results["floor_ms"]
    print(row("floor: same adapter + wrapper, no queue", floor, base=m))
    print(row("(a) 15 s sweep, random phase (simulated)", h["sweep_ms"], base=m))
    print(row("(b) 150 ms x1.6 cap 2 s +-25 % (simulated)", h["backoff_ms"], base=m))
    print(row("(b) same, had each turn lasted 60 s", h["backoff_60s_ms"], base=m))
    print(
        f"  target: median <= {TARGET_HANDOFF_MS:.0f} ms -> "
        f"{'MET' if m <= TARGET_HANDOFF_MS else 'MISSED'}; turns overlapping: {h['overlaps']}"
        f"; min {min(measured):.2f} ms, max {max(measured):.2f} ms"
    )
    if "handoff_syncs" in results:
        hs = results["handoff_syncs"]
        commit = ""
        if "sqlite_full_rows_s" in results:
            commit_ms = 1000 / results["sqlite_full_rows_s"]
            commit = f"; one commit costs {commit_ms:.1f} ms on this disk (baseline loop)"
        print(
            f"  durable commits on the handoff path: {hs['syncs']} fsync/fdatasync for "
            f"{hs['turns']} turns = {hs['syncs'] / hs['turns']:.1f} per turn (end + start)"
            f"{commit}"
        )
    note = (
        f"target <= 25 ms; floor {med(floor):.1f} ms; sweep {med(h['sweep_ms']):.0f} ms; "
        f"backoff {med(h['backoff_ms']):.0f} ms"
    )
    summary.append(("handoff median (p90)", f"{m:.1f} ms ({percentile(measured, 0.9):.1f})", note))
    if args.handoff_only:
        return summary

    d = results["deliver"]
    base = med(d["python3 -c pass"])
    header("2. `volutectl deliver` wall time in the container (gate running), vs python3 -c pass")
    for name, values in d.items():
        print(row(name, values, base=base))
    dm = med(d["volutectl deliver"])
    summary.append(("deliver wall time median", f"{dm:.1f} ms",
                    f"{dm / base:.2f}x python3 -c pass ({base:.1f} ms), "
                    f"{dm / med(d['python3 -I -c pass']):.2f}x python3 -I"))  # fmt: skip

    baseline = results["sqlite_full_rows_s"]
    print(
        "\n3. Sustained enqueue: one durable (synchronous=FULL) commit before each ack; "
        f"{MESSAGE.__len__()}-byte messages"
    )
    print(f"  {'':<44} {'deliveries/s':>12} {'ack p50':>9} {'ack p90':>9}    ratio")
    runs = ", ".join(f"{r:.0f}" for r in results["sqlite_runs"])
    print(f"  {'baseline: sqlite3 loop, 1 commit per row':<44} {baseline:12.0f}   (runs: {runs})")
    for result in results["enqueue"]:
        label = f"gate, {result['clients']} client(s) x {args.messages}"
        lat = result["latency_ms"]
        print(
            f"  {label:<44} {result['rate']:12.0f} {med(lat):9.2f} {percentile(lat, 0.9):9.2f}"
            f"  {result['rate'] / baseline:6.2f}x"
        )
        summary.append((f"enqueue, {result['clients']} client(s)",
                        f"{result['rate']:.0f} /s", f"{result['rate'] / baseline:.2f}x "
                        f"sqlite FULL loop ({baseline:.0f} rows/s)"))  # fmt: skip
    deep = results["deep"]
    for result in deep["runs"]:
        label = f"gate at depth {deep['depth']}, {result['clients']} client(s)"
        lat = result["latency_ms"]
        print(
            f"  {label:<44} {result['rate']:12.0f} {med(lat):9.2f} {percentile(lat, 0.9):9.2f}"
            f"  {result['rate'] / baseline:6.2f}x"
        )
        name = f"enqueue at depth {deep['depth']}, {result['clients']} client(s)"
        ratio = f"{result['rate'] / baseline:.2f}x baseline"
        summary.append((name, f"{result['rate']:.0f} /s", ratio))
    if "traced" in results:
        print("  group commit (separate pass under strace; its rates are not comparable):")
        for result in results["traced"]:
            syncs = result["syncs"]
            per = result["messages"] / syncs if syncs else float("inf")
            print(
                f"    {result['clients']:>2} client(s): {result['messages']} acks, "
                f"{syncs} fsync/fdatasync -> {per:.2f} acks per fsync"
            )
            summary.append((f"acks per fsync, {result['clients']} client(s)", f"{per:.2f}",
                            f"{syncs} syncs for {result['messages']} acks"))  # fmt: skip

    print("\n4. Idle gate (all threads' voluntary + nonvoluntary context switches)")
    ping_rate = 1 / (WATCHDOG_SEC / 2)
    holding = f"1 turn running, {results['held_during_idle']} held"
    for key, label in (("idle_empty", "no turns, empty queue"), ("idle_holding", holding)):
        idle = results[key]
        print(
            f"  {label:<44} VmRSS {idle['rss_kib'] / 1024:6.1f} MiB, {idle['switches']} switches "
            f"in {idle['seconds']:.0f} s = {idle['per_s']:.2f}/s ({idle['threads']} thread(s))"
        )
        summary.append((f"idle ({label})", f"{idle['per_s']:.2f} wakeups/s",
                        f"VmRSS {idle['rss_kib'] / 1024:.1f} MiB"))  # fmt: skip
    print(
        f"  expected from the watchdog alone: WatchdogSec={WATCHDOG_SEC:.0f}s "
        f"(WATCHDOG_USEC={results['watchdog_usec']}) -> a ping every {WATCHDOG_SEC / 2:.0f} s "
        f"= {ping_rate:.3f}/s; VmRSS after the load phases "
        f"{results['rss_end_kib'] / 1024:.1f} MiB"
    )
    print(f"  gate still {results['gate_active']} at the end; {results['final_status']}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=40)
    parser.add_argument("--runs", type=int, default=30, help="deliver wall-time runs")
    parser.add_argument("--messages", type=int, default=100, help="deliveries per client")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--deep", type=int, default=2000, help="queue depth for the deep run")
    parser.add_argument("--idle", type=float, default=10.0, help="idle window, seconds")
    parser.add_argument("--baseline-rows", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--handoff-only", action="store_true", help="measure the handoff (section 1) and stop"
    )
    parser.add_argument("--inner-deliver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--inner-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stamp", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    if args.inner_deliver:
        inner_deliver(args.runs, args.seed)
        return
    if args.inner_floor:
        inner_floor(args.handoffs + 1, args.stamp, args.log, args.seed)
        return
    started = time.time()
    load_before = os.getloadavg()
    results = run(args)
    summary = report(results, args)
    print("\nSummary")
    for name, value, note in summary:
        print(f"  {name:<40} {value:>22}   {note}")
    print(
        f"\n(bench took {time.time() - started:.0f} s; {os.cpu_count()} CPUs; seed {args.seed}; "
        f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
