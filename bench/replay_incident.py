"""Replay the storage-starvation incident on a slow disk, with and without the gate.

The incident: 33 minds wake at once, each writes with fsync, the SD card stalls, and
sshd/journald starve. Here a 1 GiB file-backed loop device with ext4 stands in for the
card, throttled by a cgroup-v1 blkio limit (60 write IOPS, 2 MB/s, on the loop device's
major:minor only) set from outside the container. This process moves itself into that
blkio cgroup before anything starts, so everything of the replay inherits it: the
throwaway systemd (nspawn), the gate, every turn scope (the container's systemd does
not manage the v1 blkio hierarchy, so scopes stay in the blkio cgroup of PID 1) and
the probe. The mount is bound into the container at the same path.

Load: 33 minds whose turn command is `dd bs=64k count=W oflag=dsync` (64 KiB
write+fsync-equivalent loops, W writes per turn: a fixed amount of work, so a turn that
overlaps others takes longer), delivered all at once with `volutectl deliver`, one
delivery per mind. A probe stands in for sshd/journald: a 4 KiB write+fsync every
200 ms on the same disk, recording its latency.

Runs, each in a fresh throwaway systemd with the real gate (volute-gate.service):
- baseline: the probe alone, then with 1 and 2 plain writers (no gate);
- ungated: the 33 turn commands started together, no gate;
- per-mind only: the gate with its defaults (turns_per_mind = 1, no global cap). With
  one delivery per mind this admits all 33 at once, like ungated: per-mind
  serialization bounds a mind's own sessions, not a fan-out across minds;
- cap 1, 2, 4: limits.global_concurrent_turns;
- pressure: limits.io_pressure.enabled, no static cap.

For each: probe p50/p99/max over the fan-out (from the first delivery to the last turn's
end) and the makespan. The target for the gated runs is 1.5x the 2-writer baseline's
p99, measured in the same run.

    .venv/bin/python bench/replay_incident.py [--minds 33] [--writes 48] [--only cap2,pressure]

Needs root. Cleans up in finally blocks: the loop device (losetup -d), the mount and
the blkio cgroup (and this process leaves it first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from volute_testbed.diskprobe import Probe, percentile
from volute_testbed.fanout import (
    logged_turn,
    max_overlap,
    reset_turn_log,
    synced_writes,
    turn_times,
)
from volute_testbed.gate import VOLUTECTL, gate_config, start_gate
from volute_testbed.machine import dev_machine
from volute_testbed.slowdisk import WRITE_BPS, WRITE_IOPS, SlowDisk, slow_disk


@dataclass
class Result:
    label: str
    samples: list[float]
    makespan: float | None
    concurrency: int | None = None  # most turns seen running at once
    note: str = ""

    @property
    def p50(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    @property
    def p99(self) -> float:
        return percentile(self.samples, 0.99)

    @property
    def max(self) -> float:
        return max(self.samples) if self.samples else float("nan")


def plain_writers(disk: SlowDisk, count: int, seconds: float, probe_work: Path) -> Result:
    """Baseline: `count` plain 64 KiB write+fsync loops for `seconds`, no gate, with the probe."""
    probe = Probe(disk.mount, probe_work)
    time.sleep(1.0)
    start = time.time()
    procs = [
        subprocess.Popen(
            [
                "sh",
                "-c",
                f"while :; do dd if=/dev/zero of={disk.mount}/plain.{i} bs=64k "
                f"count=16 oflag=dsync status=none; done",
            ]
        )
        for i in range(count)
    ]
    time.sleep(seconds)
    end = time.time()
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait()
    samples = [ms for wall, ms in probe.stop() if start + 1.0 <= wall <= end]
    for i in range(count):
        with contextlib.suppress(OSError):
            (disk.mount / f"plain.{i}").unlink()
    return Result(f"{count} plain writer{'s' if count != 1 else ''}", samples, None, count)


def fan_out(
    disk: SlowDisk,
    work: Path,
    label: str,
    *,
    minds: int,
    writes: int,
    gated: bool,
    limits: dict[str, Any],
    timeout: float,
) -> Result:
    names = [f"m{i:02d}" for i in range(minds)]
    command = logged_turn(synced_writes(disk.mount, writes))
    name = f"replay-{label.replace(' ', '-')}"[:30]
    with dev_machine(name=name, binds=[disk.mount]) as machine:
        reset_turn_log(machine)
        if gated:
            sections: dict[str, dict[str, object]] = {}
            plain_limits = {k: v for k, v in limits.items() if not isinstance(v, dict)}
            nested = {k: v for k, v in limits.items() if isinstance(v, dict)}
            if plain_limits:
                sections["limits"] = plain_limits
            for key, table in nested.items():
                sections[f"limits.{key}"] = table
            try:
                # Each row's own limits only: no adaptive limit unless it sets limits.adaptive.
                config = gate_config(dict.fromkeys(names, command), adaptive=False, **sections)
                start_gate(machine, config)
            except Exception:
                print(
                    machine.run(
                        ["journalctl", "--no-pager", "-n", "40", "-u", "volute-gate.service"],
                        check=False,
                    ).stdout,
                    file=sys.stderr,
                )
                raise
            script = "\n".join(
                f"{VOLUTECTL} deliver {name} --message wake >/dev/null &" for name in names
            )
        else:
            env = "VOLUTE_MIND={name}"
            script = "\n".join(
                f"{env.format(name=name)} setpriv --reuid nobody --regid nogroup --clear-groups "
                f"sh -c {shlex.quote(command)} &"
                for name in names
            )
        probe = Probe(disk.mount, work)
        time.sleep(2.0)  # a quiet stretch before the fan-out
        t0 = time.time()
        machine.sh(script + "\nwait", timeout=timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            starts, ends = turn_times(machine)
            if len(ends) >= minds:
                break
            time.sleep(0.25)
        t_end = time.time()
        samples = [ms for wall, ms in probe.stop() if t0 <= wall <= t_end]
        starts, ends = turn_times(machine)
        note = ""
        if len(ends) < minds:
            note = f"only {len(ends)} of {minds} turns ended within {timeout:.0f} s"
        makespan = (max(ends.values()) - t0) if ends else None
        if gated:
            gate_log = machine.run(
                ["journalctl", "--no-pager", "-o", "cat", "-u", "volute-gate.service"],
                check=False,
            ).stdout
            pressure_lines = [line for line in gate_log.splitlines() if "pressure" in line]
            if "pressure" in label:
                note = (note + "; " if note else "") + (
                    pressure_lines[0] if pressure_lines else "no pressure line in the gate log"
                )
        return Result(label, samples, makespan, max_overlap(starts, ends), note)


RUNS: dict[str, tuple[bool, dict[str, Any]]] = {
    "ungated": (False, {}),
    "per-mind only": (True, {}),
    "cap 1": (True, {"global_concurrent_turns": 1}),
    "cap 2": (True, {"global_concurrent_turns": 2}),
    "cap 4": (True, {"global_concurrent_turns": 4}),
    "pressure": (True, {"io_pressure": {"enabled": True}}),
}
SHORT = {
    "ungated": "ungated",
    "per-mind": "per-mind only",
    "cap1": "cap 1",
    "cap2": "cap 2",
    "cap4": "cap 4",
    "pressure": "pressure",
}


def table(results: list[Result], target: float) -> str:
    lines = [
        "| run | turns at once (max) | probe p50 | probe p99 | probe max | makespan | samples |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        makespan = f"{r.makespan:.1f} s" if r.makespan is not None else "-"
        lines.append(
            f"| {r.label} | {r.concurrency if r.concurrency is not None else '-'} | "
            f"{r.p50:.0f} ms | {r.p99:.0f} ms | {r.max:.0f} ms | {makespan} | {len(r.samples)} |"
        )
    lines.append("")
    lines.append(
        f"Target for the gated runs: probe p99 <= 1.5 x the 2-writer p99 = {target:.0f} ms."
    )
    for r in results:
        if r.note:
            lines.append(f"- {r.label}: {r.note}")
    return "\n".join(lines)


def checks(results: list[Result], target: float) -> list[str]:
    by = {r.label: r for r in results}
    out = []
    if "ungated" in by and "2 plain writers" in by:
        ok = by["ungated"].p99 > by["2 plain writers"].p99
        out.append(
            f"{'PASS' if ok else 'FAIL'} ungated p99 grows with the fan-out "
            f"({by['ungated'].p99:.0f} ms vs {by['2 plain writers'].p99:.0f} ms)"
        )
    if "cap 2" in by:
        ok = by["cap 2"].p99 <= target
        out.append(
            f"{'PASS' if ok else 'FAIL'} cap 2 p99 {by['cap 2'].p99:.0f} ms <= {target:.0f} ms"
        )
    if "pressure" in by:
        p = by["pressure"]
        ok = p.p99 <= target
        out.append(f"{'PASS' if ok else 'FAIL'} pressure p99 {p.p99:.0f} ms <= {target:.0f} ms")
        if "cap 1" in by and p.makespan is not None and by["cap 1"].makespan is not None:
            ok = p.makespan <= by["cap 1"].makespan * 1.05
            out.append(
                f"{'PASS' if ok else 'FAIL'} pressure makespan {p.makespan:.1f} s "
                f"<= cap 1's {by['cap 1'].makespan:.1f} s (+5 % noise)"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minds", type=int, default=33)
    parser.add_argument("--writes", type=int, default=48, help="64 KiB synced writes per turn")
    parser.add_argument("--baseline-seconds", type=float, default=25.0)
    parser.add_argument("--timeout", type=float, default=240.0, help="per fan-out")
    parser.add_argument(
        "--only", default="", help=f"comma-separated runs: {','.join(SHORT)} (default: all)"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    chosen = [SHORT[k] for k in args.only.split(",") if k] or list(RUNS)
    started = time.monotonic()
    results: list[Result] = []
    work = Path(tempfile.mkdtemp(prefix="volute-replay-work.", dir="/var/tmp"))
    try:
        with slow_disk() as disk:
            print(
                f"slow disk: {disk.device} ({disk.majmin}) at {disk.mount}, blkio "
                f"{WRITE_IOPS} write IOPS, {WRITE_BPS} B/s, cgroup {disk.cgroup}",
                flush=True,
            )
            for writers in (0, 1, 2):
                results.append(plain_writers(disk, writers, args.baseline_seconds, work))
                r = results[-1]
                print(f"  {r.label}: p50 {r.p50:.0f} ms p99 {r.p99:.0f} ms", flush=True)
            for label in chosen:
                gated, limits = RUNS[label]
                r = fan_out(
                    disk,
                    work,
                    label,
                    minds=args.minds,
                    writes=args.writes,
                    gated=gated,
                    limits=limits,
                    timeout=args.timeout,
                )
                results.append(r)
                print(
                    f"  {label}: p50 {r.p50:.0f} ms p99 {r.p99:.0f} ms max {r.max:.0f} ms "
                    f"makespan {r.makespan} at once {r.concurrency} {r.note}",
                    flush=True,
                )
    finally:
        with contextlib.suppress(OSError):
            for leftover in work.iterdir():
                leftover.unlink()
            work.rmdir()
    two = next((r for r in results if r.label == "2 plain writers"), None)
    target = 1.5 * two.p99 if two is not None else float("nan")
    print()
    print(
        f"{args.minds} minds, {args.writes} x 64 KiB synced writes per turn; "
        f"{time.monotonic() - started:.0f} s in all"
    )
    print(table(results, target))
    print()
    for line in checks(results, target):
        print(line)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "label": r.label,
                        "p50": r.p50,
                        "p99": r.p99,
                        "max": r.max,
                        "makespan": r.makespan,
                        "concurrency": r.concurrency,
                        "n": len(r.samples),
                        "note": r.note,
                    }
                    for r in results
                ],
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
