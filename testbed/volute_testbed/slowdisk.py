"""A slow disk for IO-pressure runs: a throttled ext4 loop device, on cgroup-v1 blkio.

A file-backed loop device with ext4 stands in for a Raspberry Pi's SD card, throttled by
a cgroup-v1 blkio limit (60 write IOPS, 2 MB/s by default, on the loop device's
major:minor only; a limit of 0 is left off, so iops=0, bps=0 is the rig unthrottled).
The calling process moves itself into that blkio cgroup, so everything it starts
inherits the limit: a machine booted then (systemd-nspawn), its systemd, the gate and
every turn scope (the container's systemd does not manage the v1 blkio hierarchy). Bind
the mount into a machine at the same path.

The throttle holds each request back before the loop device counts it: the device's
/sys/block counters (what iostat and the gate's disk watch read) show a quick, idle
disk however long the writers wait, where a real SD card's own queue shows in its
counters. `visible=True` puts a second loop device (direct IO) on a file on the
throttled one, with the ext4 on it: its requests are counted while the throttle below
holds them, so its await and utilisation are the card's (the mount and device given
are then that device's; the throttle, on the one below, stays where it was).

Used by bench/replay_incident.py, bench/bench_adaptive.py, tests/system/test_pressure.py
and tests/system/test_adaptive_disks.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLKIO = Path("/sys/fs/cgroup/blkio")
WRITE_IOPS = 60
WRITE_BPS = 2 * 1024 * 1024


@dataclass
class SlowDisk:
    device: str  # /dev/loopN
    majmin: str  # "7:N"
    mount: Path  # the ext4 mount (bind it into containers at the same path)
    cgroup: Path | None  # the blkio cgroup this process (and its children) is in


def _run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)


@contextlib.contextmanager
def slow_disk(
    size_mib: int = 1024,
    iops: int = WRITE_IOPS,
    bps: int = WRITE_BPS,
    name: str = "replay",
    in_ram: bool = False,
    visible: bool = False,
) -> Iterator[SlowDisk]:
    """A throttled ext4 loop device; this process is in its blkio cgroup while inside.

    Its backing file is on the host's disk (/var/tmp), whose own stalls (other writers,
    writeback) come through the loop device too; `in_ram` puts it on a tmpfs of its own
    instead, which leaves the throttle as the disk's only slowness, the same in every run.

    Everything is undone on the way out, whatever happens: the process leaves the
    cgroup, the cgroup is removed, the mount unmounted, the loop device detached and
    its backing file deleted.
    """
    if os.geteuid() != 0:
        raise SystemExit("the slow disk needs root (losetup, mount, blkio cgroups)")
    with contextlib.ExitStack() as undo:  # each part undone, the last made first
        work = undo.enter_context(
            _directory(Path(tempfile.mkdtemp(prefix=f"volute-{name}.", dir="/var/tmp")))
        )
        work.chmod(0o755)  # turns run as unprivileged users
        home = undo.enter_context(_tmpfs(work / "ram", size_mib + 16)) if in_ram else work
        image = undo.enter_context(_image(home / "disk.img", size_mib))
        device = undo.enter_context(_loop_device(image))
        mount = undo.enter_context(_ext4(device, work / "mnt"))
        st = os.stat(device)
        majmin = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        cgroup = undo.enter_context(
            _blkio_cgroup(f"volute-{name}-{os.getpid()}", majmin, iops, bps)
        )
        if visible:
            image = undo.enter_context(_image(mount / "visible.img", size_mib * 3 // 4))
            device = undo.enter_context(_loop_device(image, direct_io=True))
            mount = undo.enter_context(_ext4(device, work / "visible"))
            st = os.stat(device)
            majmin = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        yield SlowDisk(device, majmin, mount, cgroup)


@contextlib.contextmanager
def _directory(path: Path) -> Iterator[Path]:
    """A directory of the rig's, removed on the way out (once empty)."""
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.rmdir()


@contextlib.contextmanager
def _tmpfs(path: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of the rig's own at `path`, for the loop device's file."""
    path.mkdir()
    with _directory(path):
        _run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(path)])
        try:
            yield path
        finally:
            subprocess.run(["umount", str(path)], capture_output=True)


@contextlib.contextmanager
def _image(path: Path, size_mib: int) -> Iterator[Path]:
    """The loop device's (sparse) file, deleted on the way out."""
    try:
        with path.open("wb") as handle:
            handle.truncate(size_mib * 1024 * 1024)
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def _loop_device(image: Path, direct_io: bool = False) -> Iterator[str]:
    direct = ["--direct-io=on"] if direct_io else []
    device = _run(["losetup", "-f", "--show", *direct, str(image)]).stdout.strip()
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True)


@contextlib.contextmanager
def _ext4(device: str, mount: Path) -> Iterator[Path]:
    """A fresh ext4 on `device`, mounted at `mount` (open to all, sticky)."""
    _run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", device])
    mount.mkdir()
    with _directory(mount):
        _run(["mount", "-o", "noatime", device, str(mount)])
        try:
            mount.chmod(0o1777)
            yield mount
        finally:
            for _ in range(50):
                if subprocess.run(["umount", str(mount)], capture_output=True).returncode == 0:
                    break
                time.sleep(0.2)
            else:
                subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@contextlib.contextmanager
def _blkio_cgroup(name: str, majmin: str, iops: int, bps: int) -> Iterator[Path]:
    """A blkio cgroup throttling `majmin`, with this process in it while inside."""
    if not (BLKIO / "blkio.throttle.write_iops_device").exists():
        raise SystemExit(f"no cgroup-v1 blkio throttle at {BLKIO}: cannot slow the disk")
    cgroup = BLKIO / name
    cgroup.mkdir()
    try:
        _throttle(cgroup, majmin, iops, bps)
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield cgroup
        finally:
            with contextlib.suppress(OSError):
                (BLKIO / "cgroup.procs").write_text(str(os.getpid()))
    finally:
        _remove_cgroup(cgroup)


def _throttle(cgroup: Path, majmin: str, iops: int, bps: int) -> None:
    """The write limits on the device `majmin`; a limit of 0 is left off."""
    if iops:
        (cgroup / "blkio.throttle.write_iops_device").write_text(f"{majmin} {iops}\n")
    if bps:
        (cgroup / "blkio.throttle.write_bps_device").write_text(f"{majmin} {bps}\n")


def _remove_cgroup(cgroup: Path) -> None:
    """Move stragglers to the root blkio cgroup, then remove ours."""
    for _ in range(50):
        with contextlib.suppress(OSError):
            for pid in (cgroup / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (BLKIO / "cgroup.procs").write_text(pid)
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
