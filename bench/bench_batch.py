"""A fan-out of 33 deliveries: one `volutectl deliver --batch` against 33 `volutectl
deliver` processes (issue 31, item 6), against the real gate in a throwaway systemd.

On a Pi, a message to 33 minds today starts 33 Python processes at the worst moment.
This measures, in the container, with the gate running and every mind paused (so the
deliveries are queued and held, and no turn runs to muddy the figures):

- `processes at once`: 33 `volutectl deliver MIND -m TEXT` started together and
  waited for, as a fan-out starts them (the baseline);
- `processes in turn`: the same, one after another, as a shell loop would;
- `one --batch`: one `volutectl deliver --batch` given the 33 lines on stdin.

For each: wall time (first start to last exit), the CPU time of the client processes
(user + sys, from os.wait4's rusage of each child) and the gate's CPU time over the same
window (/proc/PID/stat utime + stime, in clock ticks: 10 ms each). The three are run in a
shuffled order in each of --runs rounds; medians, p90 and ratios to the baseline.

    .venv/bin/python bench/bench_batch.py            # --runs 15 --minds 33

The gate's state directory lives on the host's disk (bound into the container), so its
`synchronous=FULL` commits are real.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from volute_testbed.diskprobe import percentile
from volute_testbed.gate import VOLUTECTL, start_gate
from volute_testbed.machine import dev_machine

MESSAGE = "m" * 200
MODES = ("processes at once", "processes in turn", "one --batch")


# -- the inside part, run in the container ---------------------------------------------------


def gate_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)


def spawn(argv: list[str], stdin: bytes | None = None) -> int:
    read = None
    if stdin is not None:
        read, write = os.pipe()
        os.write(write, stdin)  # 33 lines of ~250 bytes: well within a pipe's buffer
        os.close(write)
    devnull = os.open(os.devnull, os.O_WRONLY)
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(read if read is not None else os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(devnull, 1)
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    os.close(devnull)
    if read is not None:
        os.close(read)
    return pid


def reap(pid: int) -> float:
    """Wait for `pid`; its CPU time (user + sys) in ms. A failure stops the bench."""
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"bench_batch: a delivery failed (status {status})")
    return (usage.ru_utime + usage.ru_stime) * 1000


def one_round(mode: str, minds: list[str]) -> tuple[float, float]:
    """Wall ms and client CPU ms of one fan-out in `mode`."""
    start = time.perf_counter_ns()
    cpu = 0.0
    single = [[VOLUTECTL, "deliver", mind, "-m", MESSAGE] for mind in minds]
    if mode == MODES[0]:
        pids = [spawn(argv, b"") for argv in single]
        cpu = sum(reap(pid) for pid in pids)
    elif mode == MODES[1]:
        for argv in single:
            cpu += reap(spawn(argv, b""))
    else:
        lines = "".join(json.dumps({"mind": m, "message": MESSAGE}) + "\n" for m in minds)
        cpu = reap(spawn([VOLUTECTL, "deliver", "--batch"], lines.encode()))
    return (time.perf_counter_ns() - start) / 1e6, cpu


def inner(runs: int, minds: int, seed: int, gate_pid: int) -> None:
    names = [f"m{n:02}" for n in range(1, minds + 1)]
    rng = random.Random(seed)
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    results: dict[str, dict[str, list[float]]] = {
        mode: {"wall": [], "cpu": [], "gate": []} for mode in MODES
    }
    for mode in MODES:  # warm the page cache and the gate
        one_round(mode, names)
    for _ in range(runs):
        order = list(MODES)
        rng.shuffle(order)
        for mode in order:
            before = gate_ticks(gate_pid)
            wall, cpu = one_round(mode, names)
            results[mode]["wall"].append(wall)
            results[mode]["cpu"].append(cpu)
            results[mode]["gate"].append((gate_ticks(gate_pid) - before) * tick_ms)
    print(json.dumps(results))


# -- orchestration ---------------------------------------------------------------------------


def gate_config(work: Path, minds: int) -> str:
    named = "".join(f'[minds.m{n:02}]\ncommand = ["true"]\n\n' for n in range(1, minds + 1))
    return (
        f'[gate]\nsocket = "{work / "gate.sock"}"\nstate_dir = "{work / "state"}"\n\n'
        "[limits.adaptive]\nenabled = false\n\n"
        f"{named}"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="volute-bench-batch.", dir="/var/tmp"))
    try:
        os.chmod(work, 0o755)
        print("bench_batch: booting a throwaway systemd (systemd-nspawn) ...", flush=True)
        with dev_machine(name=f"volute-bench-batch-{os.getpid()}", binds=[work]) as machine:
            start_gate(machine, gate_config(work, args.minds))
            machine.run([VOLUTECTL, "pause"])  # every mind: deliveries are held, none runs
            pid = int(
                machine.run(["systemctl", "show", "-P", "MainPID", "volute-gate.service"]).stdout
            )
            print(f"  {args.runs} rounds of {len(MODES)} fan-outs of {args.minds} ...", flush=True)
            out = machine.run(
                [sys.executable, str(Path(__file__).resolve()), "--inner",
                 "--runs", str(args.runs), "--minds", str(args.minds),
                 "--seed", str(args.seed), "--gate-pid", str(pid)],
                timeout=3600,
            )  # fmt: skip
            results: dict[str, Any] = json.loads(out.stdout)
            held = json.loads(machine.run([VOLUTECTL, "status", "--json"]).stdout)
            results["queued"] = held["queue_depth"]
            return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    base = results[MODES[0]]
    print(f"\n{args.minds} deliveries, {args.runs} rounds; medians (p90), ratio to {MODES[0]!r}")
    print(f"  {'':<22} {'wall ms':>16} {'clients CPU ms':>20} {'gate CPU ms':>16}")
    for mode in MODES:
        cells = []
        for key in ("wall", "cpu", "gate"):
            values = results[mode][key]
            median = statistics.median(values)
            ratio = median / statistics.median(base[key]) if statistics.median(base[key]) else 0
            cells.append(f"{median:7.1f} ({percentile(values, 0.9):6.1f}) {ratio:4.2f}x")
        print(f"  {mode:<22} " + "  ".join(cells))
    print(f"  (the queue held {results['queued']} deliveries at the end, every mind paused)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="rounds of the three fan-outs")
    parser.add_argument("--minds", type=int, default=33, help="deliveries in a fan-out")
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gate-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args.runs, args.minds, args.seed, args.gate_pid)
        return
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps(results))
    report(results, args)


if __name__ == "__main__":
    main()
