"""The adaptive limit watches every disk the turns use, not only its own (issue 32, item 2).

The rig: tests/system/test_adaptive_disk.py's SD card (volute_testbed.slowdisk: 60 write
IOPS, 2 MB/s, a blkio cgroup this process joins before the container boots), made
`visible` (a direct-IO loop device on it, whose /sys/block counters show the card's
queue, as a real card's do: the throttle alone holds requests back before any device
counts them). The minds' working directories are on it; the gate's state directory is
not: it stays on the container's root (an overlay on the host's disk), a fast disk. So
the gate's own probe sees a healthy disk whatever the turns do, and only the disks the
turns use can tell it otherwise. The host's probe (4 KiB + fsync every 50 ms, from this
process, on the card) stands in for sshd and journald, as in test_adaptive_disk.py.

A device that vanishes (a USB disk pulled: a loop device detached) is the second
test: the gate falls back as for a lost PSI file, says so, and comes back.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.system.test_adaptive_disk import STATE_DIR, Probe, Run, fan_out_run, p99
from volute_testbed.fanout import logged_turn, synced_writes
from volute_testbed.gate import (
    VOLUTECTL,
    gate_config,
    install_probe,
    start_gate,
    status,
    wait_for,
)
from volute_testbed.machine import Machine, dev_machine
from volute_testbed.slowdisk import SlowDisk, slow_disk

pytestmark = [pytest.mark.system, pytest.mark.serial]

CARD = "/srv/card"  # the minds' directories on the card, inside the machine
MINDS = 15  # the fan-out on a slow disk: every third a heavy writer
HEAVY = 48  # 64 KiB synced writes of a heavy turn (3 MiB: 1.5 s of the card alone)
LOOP_CTL_ADD, LOOP_CTL_REMOVE = 0x4C80, 0x4C81  # /dev/loop-control's ioctls


@pytest.fixture
def rig() -> Iterator[tuple[Machine, SlowDisk]]:
    """A machine booted inside the card's blkio cgroup, the card bound in at its path,
    and a working directory on it for each mind (open to the turns' user)."""
    with slow_disk(size_mib=512, name="adaptive-disks", visible=True) as disk:
        with dev_machine(name="vt-adaptive-disks", binds=[disk.mount]) as machine:
            for index in range(MINDS):
                place = disk.mount / "minds" / f"m{index:02d}"
                place.mkdir(parents=True)
                place.chmod(0o777)
            # Where the gate sees it: the card's own path is under /var/tmp, which the
            # gate's PrivateTmp= hides (a mind's directory there would be unseen too).
            machine.run(["mkdir", "-p", CARD])
            machine.run(["mount", "--bind", str(disk.mount / "minds"), CARD])
            yield machine, disk


def mixed(index: int) -> str:
    """bench/bench_adaptive.py's mixed fan-out, in the working directory: every third
    mind writes HEAVY x 64 KiB synced; the others wait on "the model" (4 to 8 s, the same
    per mind in every run) and then write 2 x 64 KiB synced. Each logs its start and end
    (volute_testbed/fanout.py: how many ran at once), and its end (turn-probe 0)."""
    if index % 3 == 0:
        body = synced_writes(Path("."), HEAVY)
    else:
        body = f"sleep {random.Random(index).uniform(4.0, 8.0):.2f}; {synced_writes(Path('.'), 2)}"
    return f"{logged_turn(body)}; turn-probe 0"


def config(disk: SlowDisk, **sections: Any) -> str:
    """gate_config, with each mind's working directory on the card."""
    minds = {f"m{index:02d}": mixed(index) for index in range(MINDS)}
    text = gate_config(minds, **sections)
    for name in minds:
        place = f"{CARD}/{name}"
        text = text.replace(
            f'[minds."{name}"]\n', f'[minds."{name}"]\nworking_directory = "{place}"\n'
        )
    return text


ORDER = ("cap 2", "default", "default", "cap 2", "cap 2", "default")


def test_a_mixed_fan_out_on_the_minds_slow_disk_keeps_the_probe_in_its_bound_with_state_elsewhere(
    rig: tuple[Machine, SlowDisk],
) -> None:
    """Fifteen minds woken at once, a third of them heavy writers, their working
    directories on the card, the gate's state on a fast disk: cap 2 with the adaptive
    limit off, and the default config, three runs of each, interleaved ABBA. The
    default's probe p99 (its runs' samples pooled) must be within test_adaptive_disk's
    bound, max(1.5 x cap 2's, cap 2's + 20 ms), from cap 2's in the same machine.

    What could fail: a gate that watches only its own disk sees it healthy and lets the
    fan-out in as its minds' costs allow (the issue measured 2.6x cap 2's p99 so); a
    disk watch that does not find the minds' disk, or reads it and does not act, the
    same. After the default's last run, `status` names the card's device, and what it
    holds. The runs' numbers are printed (pytest -s)."""
    machine, disk = rig
    install_probe(machine)
    machine.run(["mkdir", "-p", STATE_DIR])  # fan_out_run empties it before each run
    configs = {
        "cap 2": config(disk, adaptive=False, limits={"global_concurrent_turns": 2}),
        "default": config(disk, adaptive=True),
    }
    minds = {f"m{index:02d}": mixed(index) for index in range(MINDS)}
    runs: dict[str, list[Run]] = {name: [] for name in configs}
    probe = Probe(disk.mount / "probe.dat", every=0.05)
    shown: dict[str, Any] = {}
    try:
        time.sleep(1)  # a few samples of the quiet disk before the first run
        for name in ORDER:
            runs[name].append(fan_out_run(machine, probe, name, configs[name], minds))
            if name == "default":
                shown = status(machine)["adaptive"]
    finally:
        probe.stop()
    pooled = {
        name: p99([ms for run in done for ms in run.latencies]) for name, done in runs.items()
    }
    cap2, default = pooled["cap 2"], pooled["default"]
    bound = max(1.5 * cap2, cap2 + 20)
    told = "\n".join(str(run) for name in configs for run in runs[name])
    print(
        f"\n{told}\npooled p99: cap 2 {cap2:.0f} ms, default {default:.0f} ms; "
        f"bound {bound:.0f} ms\nstatus: {shown}"
    )
    assert default <= bound, (
        f"the default's probe p99 (its runs' samples pooled) {default:.0f} ms is over the "
        f"bound {bound:.0f} ms from cap 2's {cap2:.0f} ms:\n{told}"
    )
    device = Path(disk.device).name
    watched = {entry["device"]: entry for entry in shown.get("disks", [])}
    assert device in watched, f"status does not name the card {device}: {shown}"
    assert "mind m00's working directory" in watched[device]["holds"], watched[device]


@pytest.fixture
def usb(tmp_path: Path) -> Iterator[tuple[Machine, str]]:
    """A machine, and a block device of the host's it can see in /sys (a loop device on a
    file: a disk that can be pulled), not mounted anywhere."""
    image = tmp_path / "usb.img"
    with image.open("wb") as handle:
        handle.truncate(64 * 1024 * 1024)
    device = subprocess.run(
        ["losetup", "-f", "--show", str(image)], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        with dev_machine(name="vt-disk-pulled") as machine:
            yield machine, device
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True)


@contextlib.contextmanager
def pulled(device: str) -> Iterator[None]:
    """The device gone from /sys/block for a while, as a pulled USB disk's is (a loop
    device detached stays, unbound: this one is removed through /dev/loop-control),
    then back under the same name, on the same file."""
    name = Path(device).name
    image = Path(f"/sys/block/{name}/loop/backing_file").read_text().strip()
    subprocess.run(["losetup", "-d", device], check=True)
    control = os.open("/dev/loop-control", os.O_RDWR)

    def removed() -> bool:
        try:  # EBUSY until the detach is done
            fcntl.ioctl(control, LOOP_CTL_REMOVE, int(name.removeprefix("loop")))
        except OSError:
            return False
        return True

    try:
        wait_for(removed, timeout=10, interval=0.1)
        assert not Path(f"/sys/block/{name}").exists()
        yield
    finally:
        with contextlib.suppress(OSError):  # taken again meanwhile: it is there anyway
            fcntl.ioctl(control, LOOP_CTL_ADD, int(name.removeprefix("loop")))
        os.close(control)
        subprocess.run(["losetup", device, image], check=True)


def test_a_watched_disk_that_vanishes_puts_the_gate_in_fallback_until_it_is_back(
    usb: tuple[Machine, str],
) -> None:
    """A disk named in limits.adaptive.devices (as /dev names it: the gate's own /dev is
    private, so it finds it in /sys) goes while turns run and wait: its /sys/block entry
    is gone. The gate falls back to `start` and says why, naming the disk, in `status`
    and the journal (adaptive_fallback), as for a lost PSI file; when the disk is back
    it measures again (adaptive_measuring)."""
    machine, device = usb
    name = Path(device).name
    install_probe(machine)
    minds = {f"s{index}": "sleep 60; turn-probe 0" for index in range(4)}
    sections: Any = {"limits.adaptive": {"start": 2, "devices": [device]}}
    start_gate(machine, gate_config(minds, **sections))
    for mind in minds:
        machine.run([VOLUTECTL, "deliver", mind, "--message", "go"])
    # Turns that wait (on "the model"): light, so all run, and the gate reads while they do.
    wait_for(lambda: status(machine)["active_turns"] == len(minds), timeout=30, interval=0.2)
    adaptive = status(machine)["adaptive"]
    assert adaptive["mode"] == "adaptive", adaptive
    assert name in [disk["device"] for disk in adaptive["disks"]], adaptive

    def mode() -> str:
        return str(status(machine)["adaptive"]["mode"])

    with pulled(device):
        wait_for(lambda: mode() == "fallback", timeout=30, interval=0.2)
        adaptive = status(machine)["adaptive"]
        assert name in adaptive["reason"] and adaptive["limit"] == 2, adaptive
        said = journal(machine, "adaptive_fallback")
        assert name in said, said
    wait_for(lambda: mode() == "adaptive", timeout=30, interval=0.2)
    assert "measuring again" in journal(machine, "adaptive_measuring")


def journal(machine: Machine, event: str) -> str:
    return machine.run(["journalctl", "-o", "cat", f"VOLUTE_EVENT={event}", "--no-pager"]).stdout
