"""The disk-latency probe of the slow-disk runs: a 4 KiB write+fsync every 200 ms on
average, at random moments (each gap uniform in 100-300 ms).

It stands in for sshd and journald on a Pi whose card is busy: what they feel is how long
one small synced write takes while the turns write. The probe runs on the host as a child
of the calling process, so it inherits the slow disk's blkio cgroup
(volute_testbed.slowdisk) and writes to the same throttled device as the turns.

Why at random moments: sshd and journald do not write in step with the gate. A probe on
a fixed 200 ms grid is: the adaptive gate reads the disk and starts turns every 0.5 s
(limits.adaptive.interval_seconds), so its readings fall on the same two phases of the
probe's grid every second, and a run whose grid starts within a few tens of milliseconds
of them samples every burst of the gate's start commits and probe, and no run in
between. The SD card's network cell at 33 minds showed it (docs/benchmarks.md, "The
probe in step with the gate"): the slow samples of one run 1.00 s apart, each as two turns
started at a reading. Random gaps keep the same rate and sample the disk at moments that
owe nothing to the gate's clock (Poisson arrivals see time averages; uniform gaps are as
good for that and never bunch).

Used by bench/replay_incident.py and bench/bench_adaptive.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

# Gaps drawn uniform in [0.1, 0.3] s: a late write skips the ticks it missed, so a stalled
# disk yields fewer samples, each as slow as it was. One "start_epoch latency_ms" line per
# write.
PROBE_SCRIPT = r"""
import os, random, sys, time
path, out, stop = sys.argv[1:4]
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
block = b"p" * 4096
gap = random.Random()
with open(out, "w", buffering=1) as log:
    tick = time.monotonic()
    while not os.path.exists(stop):
        t0 = time.monotonic()
        wall = time.time()
        os.pwrite(fd, block, 0)
        os.fsync(fd)
        log.write(f"{wall:.6f} {(time.monotonic() - t0) * 1000:.3f}\n")
        tick += gap.uniform(0.1, 0.3)
        now = time.monotonic()
        while tick < now:
            tick += gap.uniform(0.1, 0.3)
        time.sleep(tick - now)
"""

Sample = tuple[float, float]  # (wall-clock start of the write, its latency in ms)


class Probe:
    """The probe, writing `probe.dat` under `mount`; its log and stop file go in `work`."""

    def __init__(self, mount: Path, work: Path) -> None:
        self.out = work / f"probe-{time.monotonic_ns()}.log"
        self.stop_file = work / f"probe-{time.monotonic_ns()}.stop"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                PROBE_SCRIPT,
                str(mount / "probe.dat"),
                str(self.out),
                str(self.stop_file),
            ]
        )

    def samples(self, start: float = 0.0, end: float = float("inf")) -> list[Sample]:
        """The writes so far that started within [start, end] (wall-clock seconds)."""
        if not self.out.exists():
            return []
        found = []
        for line in self.out.read_text().splitlines():
            fields = line.split()
            if len(fields) != 2:
                continue  # the line being written
            wall, ms = float(fields[0]), float(fields[1])
            if start <= wall <= end:
                found.append((wall, ms))
        return found

    def stop(self) -> list[Sample]:
        """Stop the probe; every write it made. Its files are removed."""
        self.stop_file.touch()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stop_file.unlink()
        found = self.samples()
        self.out.unlink()
        return found


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of `values` (NaN if there are none)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[rank(len(ordered), fraction)]


def rank(count: int, fraction: float) -> int:
    """Where `percentile` reads among `count` sorted values (at least 1)."""
    return min(count - 1, round(fraction * (count - 1)))


def above_percentile(count: int, fraction: float) -> int:
    """How many of `count` values rank above their `percentile`: how many slow samples it
    leaves out. A 0.99 of 51 samples or fewer is the highest (0 left out), of 52-150 the
    second-highest (1), and so on."""
    return 0 if count < 1 else count - 1 - rank(count, fraction)
