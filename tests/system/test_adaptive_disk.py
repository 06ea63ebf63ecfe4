"""The adaptive limit on a slow disk: under the default config (no cap, the adaptive
limit on), a fan-out of minds whose turns all do synced writes keeps the host's storage
responsive, as cap 2 (what the design recommends for a Pi on an SD card) does.

Its history: CI measured the default at 1.54x cap 2 here (pooled p99s, 276 against 179
ms), where the bound is 1.5x, when three lucky probes in a row let the limit climb to 3
and 4 writers after a distress. Since a limit that met distress waits 12 calm readings
to be tried again (core/adaptive.py), three runs on the 2-core VM gave 0.93x, 1.22x and
0.56x.

The rig is tests/system/test_pressure.py's and bench/replay_incident.py's
(volute_testbed.slowdisk): a throttled ext4 loop device (cgroup-v1 blkio, 60 write IOPS,
2 MB/s, an SD card) whose blkio cgroup this test process joins before the container
boots, so the container's systemd, the gate and every turn inherit it. As on a Pi, the
gate's state directory (/var/lib/volute) is on that disk too, bound there before the gate
starts: its queue's commits and its own probe (what the adaptive limit measures) queue
behind the turns' writes. The host's probe is the issue's: a 4 KiB write and fsync every
200 ms on the same disk, from this process (in the blkio cgroup), standing in for sshd
and journald.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from volute_testbed.fanout import (
    logged_turn,
    max_overlap,
    reset_turn_log,
    synced_writes,
    turn_times,
)
from volute_testbed.faults import assert_exactly_once, fast_restarts, first_status, gate_pid
from volute_testbed.gate import (
    VOLUTECTL,
    all_settled,
    gate_config,
    install_probe,
    queue_rows,
    start_gate,
    status,
    turn_log,
    wait_for,
)
from volute_testbed.machine import Machine, dev_machine
from volute_testbed.slowdisk import SlowDisk, slow_disk
from volute_testbed.turn_probe import TURNS_LOG

pytestmark = [pytest.mark.system, pytest.mark.serial]

STATE_DIR = "/var/lib/volute"  # the gate's StateDirectory=, bound onto the slow disk
MINDS = 12
START = 2  # limits.adaptive.start's default
WRITES = 16  # 64 KiB synced writes per turn: 12 MiB in all, about 6 s of the disk's 2 MB/s


@pytest.fixture
def slow() -> Iterator[tuple[Machine, SlowDisk]]:
    """A machine booted inside the slow disk's blkio cgroup, its state directory on it."""
    with slow_disk(size_mib=256, name="adaptive-test") as disk:
        with dev_machine(name="vt-adaptive-disk", binds=[disk.mount]) as machine:
            state = disk.mount / "gate-state"
            state.mkdir()
            machine.run(["mkdir", "-p", STATE_DIR])
            machine.run(["mount", "--bind", str(state), STATE_DIR])
            yield machine, disk


class Probe:
    """A 4 KiB write + fsync every `every` seconds on average (the issue's 200 ms by
    default; each gap uniform in half to one and a half of it, so that the samples owe
    nothing to the gate's 0.5 s readings: volute_testbed/diskprobe.py says why) on the
    slow disk, in a thread of this process (which the slow disk's blkio cgroup holds):
    (monotonic start, latency in ms)."""

    def __init__(self, path: Path, every: float = 0.2) -> None:
        self.path = path
        self.every = every
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        block = b"p" * 4096
        try:
            gap = random.Random()
            tick = time.monotonic()
            while not self._stop.is_set():
                began = time.monotonic()
                os.pwrite(fd, block, 0)
                os.fsync(fd)
                self.samples.append((began, (time.monotonic() - began) * 1000))
                tick += gap.uniform(0.5, 1.5) * self.every
                now = time.monotonic()
                while tick < now:  # a slow write skips ticks; it does not pile them up
                    tick += gap.uniform(0.5, 1.5) * self.every
                self._stop.wait(tick - now)
        finally:
            os.close(fd)

    def between(self, start: float, end: float) -> list[float]:
        return [ms for began, ms in list(self.samples) if start <= began <= end]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


@dataclass
class Run:
    name: str
    probe_p99: float
    samples: int
    makespan: float
    most_at_once: int  # turns running at once at the most, from the turns' own log
    latencies: list[float] = field(default_factory=list)  # the probe's, in ms

    def __str__(self) -> str:
        made = f"{self.samples} samples, p99 {self.probe_p99:.0f} ms, {self.makespan:.1f} s"
        return f"{self.name}: {made}, at most {self.most_at_once} at once"


def writers(mount: Path) -> dict[str, str]:
    """Turns that each write WRITES x 64 KiB with O_DSYNC to the slow disk, each logging
    its start and end (volute_testbed/fanout.py: how many ran at once, from the turns
    themselves), then log their end (turn-probe 0: the turn log that shows each ran
    once)."""
    write = logged_turn(synced_writes(mount, WRITES)) + "; turn-probe 0"
    return {f"w{i:02d}": write for i in range(MINDS)}


def fan_out_run(
    machine: Machine, probe: Probe, name: str, config: str, minds: Mapping[str, str]
) -> Run:
    """A fresh gate on an empty state directory with `config`; one delivery to each mind
    at once; the probe's p99 from the first delivery until the queue drains."""
    machine.run(["systemctl", "stop", "volute-gate.service"], check=False, timeout=60)
    machine.run(["find", STATE_DIR, "-mindepth", "1", "-delete"])
    machine.run(["sh", "-c", f": > {TURNS_LOG}"])
    reset_turn_log(machine)
    start_gate(machine, config)
    began = time.monotonic()
    script = " ".join(
        f"{VOLUTECTL} deliver {mind} --message go > /var/tmp/id.{mind} &" for mind in minds
    )
    machine.sh(f"{script} wait")
    acked = [int(machine.host_path(f"/var/tmp/id.{mind}").read_text()) for mind in minds]
    wait_for(lambda: all_settled(machine), timeout=90, interval=0.5)
    ended = time.monotonic()
    assert_exactly_once(turn_log(machine), acked)
    assert sorted(int(r["id"]) for r in queue_rows(machine, "done")) == sorted(acked)
    samples = probe.between(began, ended)
    assert len(samples) >= 10, f"{name}: too few probe samples ({len(samples)}) to judge"
    most = max_overlap(*turn_times(machine))
    return Run(name, p99(samples), len(samples), ended - began, most, samples)


# Seven runs of each, interleaved ABBA so that neither always runs on the fresher disk.
ORDER = ("cap 2", "default", "default", "cap 2") * 3 + ("cap 2", "default")


def test_a_fan_out_of_synced_writers_under_the_default_config_keeps_the_probe_within_its_bound(
    slow: tuple[Machine, SlowDisk],
) -> None:
    """Twelve minds woken at once, each turn 16 x 64 KiB synced writes, on the SD-card
    disk: cap 2 with the adaptive limit off (the safe setting the design recommends for
    a Pi), and the default config (no cap, the adaptive limit on), seven runs of each,
    interleaved. The default's probe p99 must be within the issue's bound, max(1.5 x cap
    2's, cap 2's + 20 ms), cap 2's measured the same way in the same machine on the same
    disk, so no number from another machine is baked in.

    How the p99s are taken, and why: each config's probe samples of its seven runs
    pooled, the probe every 50 ms on average (about 80 samples a run, as a write waits
    its turn on the disk; 570 a config), so that a p99 is the 6th-worst sample, not one
    run's worst. Taken per run (35 samples at the issue's 200 ms, where a p99 is the
    maximum) and as the median of runs, one stray stall of the host's own disk decided
    it: in CI, cap 2's per-run p99 ranged from 53 to 880 ms, and the test failed once at
    200 ms against 180 ms (issue 21's history, commit fcfb058). A stall is a sample or
    two; a limit that lets too many writers in is a stretch of them, which a pooled p99
    still sees. Pooled over five runs each (430 samples), one run's slow stretch still
    decided it once: CI measured the default at 171 ms against a 170 ms bound, one run
    at 189 ms and four at 112-116 ms beside cap 2's 97-113 ms. Run here with the most
    turns at once printed for each run, no default run had more than cap 2's 2.

    What could fail: with no cap and no adaptive limit (the default before issue 21)
    all twelve write at once and the probe queues behind them (607 ms at p99 against
    cap 2's 112 ms, measured per run); an adaptive limit that grew on the wrong signal,
    did not shrink, or charged these unknown writers less than a whole place, the same.
    The runs' numbers are printed (pytest -s)."""
    machine, disk = slow
    install_probe(machine)
    minds = writers(disk.mount)
    configs = {
        "cap 2": gate_config(minds, adaptive=False, limits={"global_concurrent_turns": 2}),
        "default": gate_config(minds, adaptive=True),
    }
    runs: dict[str, list[Run]] = {name: [] for name in configs}
    probe = Probe(disk.mount / "probe.dat", every=0.05)
    try:
        time.sleep(1)  # a few samples of the quiet disk before the first run
        for name in ORDER:
            runs[name].append(fan_out_run(machine, probe, name, configs[name], minds))
    finally:
        probe.stop()
    pooled = {
        name: p99([ms for run in done for ms in run.latencies]) for name, done in runs.items()
    }
    cap2, default = pooled["cap 2"], pooled["default"]
    bound = max(1.5 * cap2, cap2 + 20)
    shown = "\n".join(str(run) for name in configs for run in runs[name])
    print(
        f"\n{shown}\npooled p99: cap 2 {cap2:.0f} ms, default {default:.0f} ms; "
        f"bound {bound:.0f} ms"
    )
    assert default <= bound, (
        f"the default's probe p99 (its runs' samples pooled) {default:.0f} ms is over the "
        f"bound {bound:.0f} ms from cap 2's {cap2:.0f} ms:\n{shown}"
    )


def test_a_sigkill_while_the_limit_is_lowered_starts_again_at_start_and_loses_nothing(
    slow: tuple[Machine, SlowDisk],
) -> None:
    """The synced writers drive the default gate's limit below `start` (its probe of the
    state disk far over its baseline); then a SIGKILL of the gate's whole cgroup. The gate
    that comes back answers `start` (the limit is not kept, whichever way it had moved),
    adopts the running turns, and every delivery settles exactly once."""
    machine, disk = slow
    install_probe(machine)
    fast_restarts(machine)
    reset_turn_log(machine)
    minds = writers(disk.mount)
    start_gate(machine, gate_config(minds, adaptive=True))
    script = " ".join(
        f"{VOLUTECTL} deliver {mind} --message go > /var/tmp/id.{mind} &" for mind in minds
    )

    def lowered() -> bool:
        return bool(status(machine)["adaptive"]["limit"] < START)

    acked: list[int] = []
    # One probe of the state disk every half second is quick or slow by luck: a gate
    # may see its writers' whole fan-out (6 s) without a distress (once in CI, and once
    # in a dozen runs here). Fan out again, up to three times, until it lowers.
    for _ in range(3):
        machine.sh(f"{script} wait")
        acked += [int(machine.host_path(f"/var/tmp/id.{mind}").read_text()) for mind in minds]
        wait_for(lambda: lowered() or all_settled(machine), timeout=60, interval=0.2)
        if lowered():
            break
    assert lowered(), "three fan-outs of synced writers never lowered the limit"
    first = gate_pid(machine)
    machine.run(["systemctl", "kill", "--signal=SIGKILL", "volute-gate.service"])
    wait_for(lambda: gate_pid(machine) not in (0, first), timeout=30, interval=0.05)
    again = first_status(machine)["adaptive"]
    assert (again["mode"], again["limit"]) == ("adaptive", START), again
    wait_for(lambda: all_settled(machine), timeout=120, interval=0.5)
    assert_exactly_once(turn_log(machine), acked)
    rows = queue_rows(machine, "done")
    assert sorted(int(r["id"]) for r in rows) == sorted(acked)
    assert all(r["attempts"] == 0 for r in rows), rows  # a crash is never a turn's failure
