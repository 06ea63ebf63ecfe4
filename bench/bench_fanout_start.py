"""What a fan-out's first seconds cost the disk the gate guards: the card's completed
writes and the probe's samples while N clients deliver at once (issue 32).

On bench_adaptive.py's rig (a throttled loop device, a throwaway systemd booted in its
blkio cgroup, the gate's state directory on the slow disk, the random-moment probe),
each trial restarts the gate on an empty state directory, waits 2 s, then fans out one
delivery to each of N minds whose command is `sleep 3` (no turn writes), and counts:
- the loop device's completed writes (/sys/block/DEV/stat, field 5) over the first
  `--window` seconds;
- the probe's samples in that window (a 4 KiB synced write every 200 ms on average);
- when the last client was answered.

Fan-outs, interleaved trial by trial:
- `clients`: N `volutectl deliver` at once, as bench_adaptive.py's fan-outs are;
- `paused`: the same with every mind paused, so no turn starts: the deliveries alone;
- `batch`: one `volutectl deliver --batch` of the N deliveries;
and `idle`: no fan-out, the probe's own writes. Gates: `cap16` (a static cap of 16,
adaptive off), `cap2`, and `default` (the package's adaptive gate).

    .venv/bin/python bench/bench_fanout_start.py [--profile sd] [--minds 33] [--trials 5]
        [--fanouts idle,clients,paused,batch] [--gates cap16,default] [--window 1.5]

Baseline in the same run: `idle` (the probe alone) and `batch` (one client, one commit).
Needs root; everything is undone on the way out, as bench_adaptive.py's rig is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import bench_adaptive as rigs

from volute_testbed.gate import VOLUTECTL, gate_config

FANOUTS = ("idle", "clients", "paused", "batch")
GATES = {
    "cap16": {"limits": {"global_concurrent_turns": 16}, "limits.adaptive": {"enabled": False}},
    "cap2": {"limits": {"global_concurrent_turns": 2}, "limits.adaptive": {"enabled": False}},
    "default": {},
}


@dataclass
class Cell:
    writes: list[int] = field(default_factory=list)
    answered: list[float] = field(default_factory=list)  # seconds to the last client's answer
    samples: list[float] = field(default_factory=list)  # ms, every trial's


def completed_writes(device: str) -> int:
    return int(Path(f"/sys/block/{device}/stat").read_text().split()[4])


def trial(rig: rigs.Rig, gate: str, fanout: str, window: float) -> tuple[int, float, list[float]]:
    machine = rig.machine
    names = [f"m{i:02d}" for i in range(rig.minds)]
    config = gate_config(
        {name: "sleep 3" for name in names}, adaptive=gate == "default", **GATES[gate]
    )
    rigs.restart_gate(machine, config)
    if fanout == "paused":
        machine.run([VOLUTECTL, "pause"])
    time.sleep(2.0)  # the gate's start and its quiet probe are done
    device = rig.disk.device.removeprefix("/dev/")
    before, t0 = completed_writes(device), time.time()
    if fanout == "batch":
        lines = "\n".join(json.dumps({"mind": name, "message": "wake"}) for name in names)
        machine.sh(f"{VOLUTECTL} deliver --batch >/dev/null <<'EOF'\n{lines}\nEOF")
    elif fanout != "idle":
        script = "\n".join(
            f"{VOLUTECTL} deliver {name} --message wake >/dev/null &" for name in names
        )
        machine.sh(script + "\nwait")
    answered = time.time() - t0
    time.sleep(max(0.0, window - (time.time() - t0)))
    writes = completed_writes(device) - before
    samples = [ms for _, ms in rig.probe.samples(t0, t0 + window)]
    if fanout == "paused":
        machine.run([VOLUTECTL, "resume"])
    time.sleep(3.5)  # the turns end
    rigs.wait_for_scopes_to_go(machine)
    return writes, answered, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="sd", choices=list(rigs.PROFILES))
    parser.add_argument("--minds", type=int, default=33)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--fanouts", default="idle,clients,paused,batch")
    parser.add_argument("--gates", default="cap16,default")
    parser.add_argument("--window", type=float, default=1.5, help="seconds counted")
    parser.add_argument("--over", type=float, default=20.0, help="a slow sample, ms")
    args = parser.parse_args()
    fanouts = rigs.choose(args.fanouts, list(FANOUTS), "fan-out")
    gates = rigs.choose(args.gates, list(GATES), "gate")
    cells: dict[tuple[str, str], Cell] = {}
    work = Path(tempfile.mkdtemp(prefix="volute-fanout-start.", dir="/var/tmp"))
    with rigs.rig(args.profile, args.minds, 60.0, 1.0, work, "ram") as rig:
        for number in range(args.trials):
            for fanout in fanouts:
                for gate in ["cap16"] if fanout == "idle" else gates:
                    writes, answered, samples = trial(rig, gate, fanout, args.window)
                    cell = cells.setdefault((fanout, gate), Cell())
                    cell.writes.append(writes)
                    cell.answered.append(answered)
                    cell.samples += samples
                    shown = [round(ms) for ms in samples]
                    print(f"  {fanout}/{gate} #{number + 1}: {writes} writes, probe {shown}")
    print(
        f"\n{args.minds} minds, {args.profile}, the first {args.window} s of each fan-out, "
        f"{args.trials} trials (medians)"
    )
    print(
        "| fan-out | gate | the card's writes [trials] | samples over "
        f"{args.over:.0f} ms | last client answered |"
    )
    print("|---|---|---|---|---|")
    for (fanout, gate), cell in cells.items():
        over = sum(ms > args.over for ms in cell.samples)
        answered = "-" if fanout == "idle" else f"{statistics.median(cell.answered):.2f} s"
        print(
            f"| {fanout} | {'-' if fanout == 'idle' else gate} | "
            f"{statistics.median(cell.writes):.0f} {sorted(cell.writes)} | "
            f"{over} of {len(cell.samples)} | {answered} |"
        )


if __name__ == "__main__":
    main()
