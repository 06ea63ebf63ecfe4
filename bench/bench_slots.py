"""Slot handoff latency: the holder releases a test slot -> the waiter's command starts.

Compares, in one run and on the same hold times:
  inotify  this implementation (volutectl.slots.slotfiles.acquire_slot: flock probe +
           IN_CLOSE wait),
           in two variants of starting the command (see below);
  polling  the reference design's waiter: non-blocking probes, sleeping 150 ms x1.6 per
           probe, capped at 2 s, with +-25 % jitter;
  flock(1) `flock SLOT CMD`, blocking in the kernel on a single slot.

Each handoff: the bench takes slot-1, starts a waiter, holds the slot for a random
0.1-0.9 s (the same sequence for every method), records the time and closes the slot.
The waiter's command is `date +%s%N`, so "command starts" is the command's own clock.
The Python waiters start it with posix_spawn (flock(1), a small C program, forks). The
"inotify+gate" row starts it the way `volutectl test` does: /bin/sh spawned held at a
gate pipe, the gate opened at once (no scope here), then exec. The Python waiters also
report when they got the lock ("lock median").

This measures the slot mechanism only. It runs on the host; no systemd is involved (in
`volutectl test` the scope launch adds its own few ms after the slot is taken).

    .venv/bin/python bench/bench_slots.py [--handoffs 50] [--seed 1]
"""

from __future__ import annotations

import argparse
import fcntl
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("inotify", "inotify+gate", "polling", "flock(1)")
COMMAND = ["date", "+%s%N"]


# -- the waiters (run as child processes of the bench) -----------------------------------


def waiter_inotify(common_dir: str, gated: bool = False) -> None:
    from volutectl.slots import slotfiles

    if gated:
        import volutectl.slots.testrun  # noqa: F401 - loaded before the wait, as in the CLI

    def on_wait() -> None:
        print("waiting", file=sys.stderr, flush=True)

    slot = slotfiles.acquire_slot(common_dir, 1, on_wait=on_wait)
    print(f"locked {time.time_ns()}", file=sys.stderr, flush=True)
    assert slot is not None
    if gated:
        run_gated(slot.fd)
    run_command(slot.fd)


def run_command(slot_fd: int) -> None:
    """Start the command with the slot fd inherited (posix_spawn), and wait for it."""
    os.set_inheritable(slot_fd, True)
    pid = os.posix_spawnp(COMMAND[0], COMMAND, os.environ)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))


def run_gated(slot_fd: int) -> None:
    """What `volutectl test` does after taking the slot, minus systemd: spawn /bin/sh held
    at a gate pipe (where the scope launch would go), open the gate, let it exec."""
    from volutectl.slots.testrun import spawn_held

    pid, gate = spawn_held(COMMAND, os.environ, slot_fd, as_json=False)
    os.write(gate, b"go\n")
    os.close(gate)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))


def waiter_polling(common_dir: str) -> None:
    path = Path(common_dir, "volute", "test-slots", "slot-1")
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    delay = 0.150
    announced = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        if not announced:
            print("waiting", file=sys.stderr, flush=True)
            announced = True
        time.sleep(delay * random.uniform(0.75, 1.25))
        delay = min(delay * 1.6, 2.0)
    print(f"locked {time.time_ns()}", file=sys.stderr, flush=True)
    run_command(fd)


# -- the bench ------------------------------------------------------------------------------


def start_waiter(method: str, common_dir: Path) -> subprocess.Popen[str]:
    if method == "flock(1)":
        slot = common_dir / "volute" / "test-slots" / "slot-1"
        argv = ["flock", str(slot), *COMMAND]
    else:
        argv = [sys.executable, __file__, "--waiter", method, str(common_dir)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def handoff(method: str, common_dir: Path, hold: float) -> tuple[float, float | None]:
    """One handoff; (release -> command start ms, release -> lock taken ms or None)."""
    slot = common_dir / "volute" / "test-slots" / "slot-1"
    fd = os.open(slot, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    spawned = time.monotonic()
    waiter = start_waiter(method, common_dir)
    assert waiter.stderr is not None and waiter.stdout is not None
    if method != "flock(1)":
        line = waiter.stderr.readline()
        if line.strip() != "waiting":
            raise SystemExit(f"{method} waiter did not wait: {line!r}")
    time.sleep(max(0.0, spawned + hold - time.monotonic()))
    released = time.time_ns()
    os.close(fd)
    out, err = waiter.communicate(timeout=30)
    if waiter.returncode != 0:
        raise SystemExit(f"{method} waiter failed: {err}")
    started = int(out.strip())
    locked = [int(line.split()[1]) for line in err.splitlines() if line.startswith("locked ")]
    lock_ms = (locked[0] - released) / 1e6 if locked else None
    return (started - released) / 1e6, lock_ms


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--waiter", nargs=2, metavar=("METHOD", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.waiter:
        method, directory = args.waiter
        if method == "polling":
            waiter_polling(directory)
        else:
            waiter_inotify(directory, gated=method == "inotify+gate")
        return

    rng = random.Random(args.seed)
    holds = [rng.uniform(0.1, 0.9) for _ in range(args.handoffs)]
    print(
        f"slot handoff latency, {args.handoffs} handoffs per method, holds 0.1-0.9 s; "
        "on the host, no systemd (measures the slot mechanism only)"
    )
    command_ms: dict[str, list[float]] = {method: [] for method in METHODS}
    lock_ms: dict[str, list[float]] = {method: [] for method in METHODS}
    with tempfile.TemporaryDirectory(prefix="bench-slots.", dir="/var/tmp") as tmp:
        common_dir = Path(tmp)
        (common_dir / "volute" / "test-slots").mkdir(parents=True)
        for number, hold in enumerate(holds, 1):
            for method in METHODS:  # interleaved, so all see the same conditions
                started, locked = handoff(method, common_dir, hold)
                command_ms[method].append(started)
                if locked is not None:
                    lock_ms[method].append(locked)
            if number % 10 == 0:
                print(f"  {number}/{args.handoffs} handoffs", file=sys.stderr)

    print()
    print("release -> waiter's command starts (ms)")
    header = f"  {'method':<14}{'median':>9}{'p90':>9}{'mean':>9}{'max':>9}{'lock median':>13}"
    print(header)
    for method in METHODS:
        values = command_ms[method]
        lock = f"{statistics.median(lock_ms[method]):.2f}" if lock_ms[method] else "-"
        print(
            f"  {method:<14}{statistics.median(values):>9.2f}{percentile(values, 0.9):>9.2f}"
            f"{statistics.mean(values):>9.2f}{max(values):>9.2f}{lock:>13}"
        )
    ours = statistics.median(command_ms["inotify"])
    ours_p90 = percentile(command_ms["inotify"], 0.9)
    print()
    for method in ("inotify+gate", "polling", "flock(1)"):
        median = statistics.median(command_ms[method])
        p90 = percentile(command_ms[method], 0.9)
        print(f"  {method} / inotify: median x{median / ours:.2f}, p90 x{p90 / ours_p90:.2f}")
    verdict = "met" if ours < 5.0 else "MISSED"
    print(f"\ntarget: inotify median < 5 ms: {verdict} ({ours:.2f} ms)")


if __name__ == "__main__":
    main()
