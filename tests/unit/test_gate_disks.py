"""Every disk the turns use (volutectl/kernel/blockdevs.py, volutectl/gate/disks.py, and
the adaptive limit that reads them), on a /sys of the test's own: a real directory of
files laid out as the kernel's (block/NAME/stat, dev/block/MAJ:MIN links, partitions,
slaves), which the test changes as a disk would, or removes as a pulled USB disk goes.

In the real gate (tests/unit/gate_harness.py, a fake clock): the disk that holds the
limit down is named in `status`, the limit's reason and the journal
(adaptive_disk_holds); a watched disk that vanishes puts the gate in fallback, as a lost
PSI file does, and it measures again when the disk is back.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness
from tests.unit.test_gate_adaptive import MINDS, PSI, limit_of, mode_of, running, writing
from tests.unit.test_gate_pause import deliver, request
from volutectl import events
from volutectl.cli import statusview
from volutectl.gate import disks as gate_disks
from volutectl.gate.adaptive import StorageSensor
from volutectl.host import doctor
from volutectl.kernel import blockdevs
from volutectl.states import AdaptiveMode
from volutectl.wire.messages import AdaptiveStatus, DiskStatus

pytestmark = pytest.mark.serial  # the gate's real probe times this host's disk


def stat_line(ios: int, ticks_ms: int, io_ticks_ms: int = 0, in_flight: int = 0) -> str:
    """A 17-field stat: `ios` writes that took `ticks_ms` in all."""
    return (
        f"0 0 0 0 {ios} 0 {ios * 8} {ticks_ms} {in_flight} {io_ticks_ms} {ticks_ms} 0 0 0 0 0 0\n"
    )


def make_disk(sys_root: Path, name: str, number: str = "", stat: str = "") -> Path:
    """/sys/block/NAME (a link to its devices/ dir, as the kernel's), and its number."""
    real = sys_root / "devices" / "virtual" / "block" / name
    real.mkdir(parents=True)
    (real / "stat").write_text(stat or stat_line(100, 100))
    for place in ("block", "class/block"):
        (sys_root / place).mkdir(parents=True, exist_ok=True)
        (sys_root / place / name).symlink_to(real)
    if number:
        (sys_root / "dev" / "block").mkdir(parents=True, exist_ok=True)
        (sys_root / "dev" / "block" / number).symlink_to(real)
    return real


def number_of(path: Path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


# -- which devices hold a path -------------------------------------------------------------


def test_a_path_names_its_disk_and_a_partition_the_disk_it_is_on(tmp_path: Path) -> None:
    number = number_of(tmp_path)
    if number.startswith("0:"):
        pytest.skip("the test's directory is on no block device (tmpfs, overlayfs)")
    sys_root = tmp_path / "sys"
    disk = make_disk(sys_root, "sdz")
    partition = disk / "sdz1"
    partition.mkdir()
    (partition / "partition").write_text("1\n")
    (sys_root / "dev" / "block").mkdir(parents=True)
    (sys_root / "dev" / "block" / number).symlink_to(partition)
    assert blockdevs.device_of(tmp_path, sys_root) == "sdz"
    # A directory the caller may not stat is taken at its nearest ancestor it may.
    assert blockdevs.device_of(tmp_path / "gone" / "deeper", sys_root) == "sdz"
    assert blockdevs.named(str(tmp_path), sys_root) == "sdz"


def test_a_device_with_no_block_device_has_none(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    sys_root.mkdir()
    assert blockdevs.device_of(tmp_path, sys_root) is None  # no dev/block/MAJ:MIN for it
    assert blockdevs.device_of(Path("/proc"), sys_root) is None  # major 0


def test_the_config_names_a_device_as_dev_or_sys_does(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    disk = make_disk(sys_root, "sdz")
    (disk / "sdz2").mkdir()
    (disk / "sdz2" / "partition").write_text("2\n")
    (sys_root / "class" / "block" / "sdz2").symlink_to(disk / "sdz2")
    assert blockdevs.named("sdz", sys_root) == "sdz"
    assert blockdevs.named("sdz2", sys_root) == "sdz"  # a partition: its disk
    # The gate's /dev is private (no node): /dev/NAME is NAME in /sys.
    assert blockdevs.named("/dev/sdz", sys_root) == "sdz"
    assert blockdevs.named("nvme9n9", sys_root) is None


def test_the_devices_under_one_are_walked(tmp_path: Path) -> None:
    """dm-0 on md0 on two disks' partitions; a loop device's file is not followed when
    the path is not there."""
    sys_root = tmp_path / "sys"
    for name in ("dm-0", "md0", "sdx", "sdy"):
        make_disk(sys_root, name)
    for disk, part in (("sdx", "sdx1"), ("sdy", "sdy1")):
        real = sys_root / "block" / disk / part
        real.mkdir()
        (real / "partition").write_text("1\n")
        (sys_root / "class" / "block" / part).symlink_to(real)
    (sys_root / "block" / "dm-0" / "slaves").mkdir()
    (sys_root / "block" / "dm-0" / "slaves" / "md0").symlink_to(sys_root / "block" / "md0")
    (sys_root / "block" / "md0" / "slaves").mkdir()
    for part in ("sdx1", "sdy1"):
        (sys_root / "block" / "md0" / "slaves" / part).symlink_to(sys_root / "class/block" / part)
    assert blockdevs.below("dm-0", sys_root) == ["md0", "sdx", "sdy"]
    loop = make_disk(sys_root, "loop7")
    (loop / "loop").mkdir()
    (loop / "loop" / "backing_file").write_text(str(tmp_path / "no-such-image"))
    assert blockdevs.below("loop7", sys_root) == []


def test_the_gate_watches_each_minds_directory_the_state_directory_and_named_devices(
    tmp_path: Path,
) -> None:
    harness = Harness(
        tmp_path,
        start=False,
        minds={"a": "true", "b": "true"},
        limits={"adaptive": {"devices": ["sdz"]}},
    )
    found = gate_disks.sources(harness.settings)
    whats = [source.what for source in found]
    assert whats[0] == "the state directory"
    assert found[0].place == str(harness.settings.gate.state_dir)
    assert "limits.adaptive.devices" in whats
    # A mind with no user of its own here (volute-turn is not on this host): skipped,
    # or its home the launcher makes, if the user exists.
    assert all(what.startswith(("the ", "mind ", "limits.")) for what in whats)


def test_a_minds_directory_is_its_working_directory_else_its_home() -> None:
    assert gate_disks.mind_directory("m", Path("/srv/m"), "root") == Path("/srv/m")
    assert gate_disks.mind_directory("m", None, "root") == Path("/root")
    assert gate_disks.mind_directory("m", None, "no-such-user-volute") is None


# -- in the gate ---------------------------------------------------------------------------


def disk_harness(tmp_path: Path, sys_root: Path) -> Harness:
    """A gate whose sensor reads PSI from a file of the test's (never stalled) and the
    disks of `sys_root`, with sdz named in the config."""
    config = {"start": 2, "minimum": 1, "maximum": 4, "interval_seconds": 10.0}
    config["devices"] = ["sdz"]  # type: ignore[assignment]
    harness = Harness(
        tmp_path, start=False, minds=MINDS, limits={"adaptive": config}, clock=FakeClock()
    )
    psi = tmp_path / "io.pressure"
    psi.write_text(PSI.format(0))
    harness.sensor = StorageSensor(harness.settings, True, psi=psi, sys_root=sys_root)
    harness.restart()
    writing(harness)
    return harness


def quiet_baseline(harness: Harness) -> None:
    adaptive = limit_of(harness)
    harness.pump(lambda: adaptive.controller.baseline_ms is not None)


def test_a_slow_disk_of_the_minds_holds_the_limit_down_and_is_named(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    sys_root = tmp_path / "sys"
    disk = make_disk(sys_root, "sdz", stat=stat_line(1000, 1000))  # 1 ms a request so far
    harness = disk_harness(tmp_path, sys_root)
    harnesses.append(harness)
    adaptive = limit_of(harness)
    quiet_baseline(harness)
    for mind in MINDS:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 2)
    # Each interval: 50 more requests, each 400 ms (a card's queue), busy throughout.
    ios, ticks, busy = 1000, 1000, 0
    for _ in range(4):
        ios, ticks, busy = ios + 50, ticks + 50 * 400, busy + 10_000
        (disk / "stat").write_text(stat_line(ios, ticks, busy, in_flight=4))
        harness.pump(lambda: adaptive.probe is None or not adaptive.probe.in_flight)
        harness.advance(10.0)
    assert adaptive.limit() == 1, adaptive.status()
    assert adaptive.held_by == "sdz"
    shown = adaptive.status()
    assert shown.held_by == "sdz" and "held down by the disk sdz" in (shown.reason or "")
    [seen] = shown.disks
    assert (seen.device, seen.await_ms, seen.utilisation_percent) == ("sdz", 400.0, 100.0)
    assert "limits.adaptive.devices" in seen.holds and seen.baseline_ms == 1.0
    [said] = harness.journal.of(events.AdaptiveDiskHolds)
    assert (said.device, said.await_ms, said.limit) == ("sdz", 400.0, 1)
    wire = request(harness, op="status")["status"]["adaptive"]  # on the wire too
    assert wire["held_by"] == "sdz" and wire["disks"][0]["device"] == "sdz", wire


def test_a_reading_with_no_probe_of_its_own_names_no_disk(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    """While turns only run, a reading in QUIET_READINGS has a probe (gate/adaptive.py)
    and only those move the limit: a disk slow in one between is not said to hold the
    limit down, and status keeps the last applied reading's probe."""
    sys_root = tmp_path / "sys"
    disk = make_disk(sys_root, "sdz", stat=stat_line(1000, 1000))
    harness = disk_harness(tmp_path, sys_root)
    harnesses.append(harness)
    adaptive = limit_of(harness)
    quiet_baseline(harness)
    for mind in ["m0", "m1"]:  # the limit of 2: nothing waits
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 2 and adaptive.probe is not None)
    harness.pump(lambda: adaptive.probe is None or not adaptive.probe.in_flight)
    harness.advance(10.0)  # its first reading has a probe; the next has none
    assert adaptive.held_by is None and adaptive.status().probe_ms is not None
    (disk / "stat").write_text(stat_line(1050, 1000 + 50 * 400, 10_000, in_flight=4))
    harness.advance(10.0)
    shown = adaptive.status()
    assert adaptive.held_by is None and shown.held_by is None, shown
    assert shown.probe_ms is not None and adaptive.limit() == 2, shown
    assert not harness.journal.of(events.AdaptiveDiskHolds)


def test_a_watched_disk_that_vanishes_falls_back_until_it_is_back(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    """As a lost PSI file does (test_gate_adaptive's fallback): `start`, said once with
    the disk's name in the journal and status, then measuring again."""
    sys_root = tmp_path / "sys"
    disk = make_disk(sys_root, "sdz", stat=stat_line(1000, 1000))
    harness = disk_harness(tmp_path, sys_root)
    harnesses.append(harness)
    adaptive = limit_of(harness)
    quiet_baseline(harness)
    for mind in MINDS:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 2)
    harness.advance(10.0)
    assert mode_of(adaptive) is AdaptiveMode.ADAPTIVE
    kept = tmp_path / "kept"
    shutil.move(disk, kept)  # pulled: /sys/block/sdz leads nowhere
    harness.advance(10.0)
    assert mode_of(adaptive) is AdaptiveMode.FALLBACK and adaptive.limit() == 2
    [fallback] = harness.journal.of(events.AdaptiveFallback)
    assert "sdz" in fallback.why and "cannot be read" in fallback.why
    assert "sdz" in (adaptive.status().reason or "")
    harness.advance(10.0)  # still gone: still fallback, said once
    assert mode_of(adaptive) is AdaptiveMode.FALLBACK
    assert len(harness.journal.of(events.AdaptiveFallback)) == 1
    shutil.move(kept, disk)  # plugged in again
    harness.advance(10.0)
    assert mode_of(adaptive) is AdaptiveMode.ADAPTIVE
    [measuring] = harness.journal.of(events.AdaptiveMeasuring)
    assert measuring.limit == 2


# -- what status and doctor say ------------------------------------------------------------


def held_status() -> AdaptiveStatus:
    card = DiskStatus(
        device="mmcblk0",
        holds=("mind a's working directory",),
        await_ms=412.0,
        utilisation_percent=100.0,
        baseline_ms=2.5,
    )
    root = DiskStatus(
        device="sda",
        holds=("the journal",),
        await_ms=None,
        utilisation_percent=0.0,
        baseline_ms=1.0,
    )
    return AdaptiveStatus(
        mode=AdaptiveMode.ADAPTIVE,
        limit=1,
        minimum=1,
        maximum=16,
        ceiling=None,
        reason="probe 1 ms: over healthy; held down by the disk mmcblk0",
        disks=(card, root),
        held_by="mmcblk0",
    )


def test_status_text_and_doctor_name_the_disk_that_holds_the_limit_down() -> None:
    [line] = statusview._disks(held_status())
    assert line.startswith("disks watched: mmcblk0 (mind a's working directory): await 412 ms")
    assert "100% busy HOLDS THE LIMIT DOWN; sda (the journal): no requests, 0% busy" in line
    check = doctor.check_adaptive(held_status())
    assert check.status == "ok"
    assert "disks watched: mmcblk0 (mind a's working directory), sda (the journal)" in check.found
    assert check.found.endswith("held down by the disk mmcblk0")


def test_many_minds_directories_on_one_disk_are_counted_not_listed() -> None:
    holds = tuple(f"mind m{index}'s working directory" for index in range(3)) + ("the journal",)
    assert gate_disks.holdings(holds) == "the working directories of 3 minds, the journal"
    assert (
        gate_disks.holdings(holds[:2]) == "mind m0's working directory, mind m1's working directory"
    )
