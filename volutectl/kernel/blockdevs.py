"""Which block devices hold a path, and their counters: plain reads of /sys, no writes,
no privilege (volutectl/gate/disks.py watches them; volutectl/core/disks.py judges).

- `device_of(path)`: the path's st_dev, through /sys/dev/block/MAJ:MIN, to its device's
  name; a partition names the whole disk it is on (its queue is the disk's). A path
  the caller may not stat (a private home) is taken at its nearest ancestor it may:
  the same device unless a mount point lies under a closed directory (then the config
  names the device, limits.adaptive.devices). A filesystem with no block device
  (tmpfs, overlayfs, a network filesystem: major 0) has none.
- `below(name)`: the devices a device's requests go on to: a device-mapper or md
  device's `slaves`, and a loop device's backing file's device, each walked the same
  way, so a disk under LVM, RAID or a loop file is watched too.
- `named(text)`: a device as the config names it: "/dev/sda", "sda", or a path on it.
- `read_stat(name)`: its counters (core/disks.py's parse_stat), an OSError if the device
  is gone (a USB disk pulled), or a ValueError if the file is not a stat.

`sys_root` is /sys; a test gives a directory of its own with the same files.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from volutectl.core.disks import DiskStat, parse_stat
from volutectl.kernel.probes import block_device_dir

SYS = Path("/sys")
MOST_BELOW = 16  # devices walked below one: a loop of links is not followed forever


def device_of(path: Path, sys_root: Path = SYS) -> str | None:
    """The whole-disk device that holds `path` (or its nearest ancestor that may be
    stat'ed), or None: no block device, or nothing on the way may be stat'ed."""
    for place in (path, *path.parents):
        try:
            st = os.stat(place)
        except OSError:
            continue
        return _by_number(os.major(st.st_dev), os.minor(st.st_dev), sys_root)
    return None


def _by_number(major: int, minor: int, sys_root: Path) -> str | None:
    if major == 0:
        return None  # tmpfs, overlayfs, NFS...: no block device of its own
    device = block_device_dir(major, minor, sys_root)  # a partition's: its disk's
    return device.name if device is not None else None


def named(text: str, sys_root: Path = SYS) -> str | None:
    """A device as the config names it: /dev/NAME (its node's number, or NAME in /sys
    when the node is not there), NAME (as /sys/class/block names it: a partition
    names its disk), or any other path (the device that holds it); None if none."""
    if "/" not in text:
        return _whole(text, sys_root)
    place = Path(text)
    try:
        st = os.stat(place)
    except OSError:
        # The gate's /dev is its own (PrivateDevices=): /dev/NAME is NAME in /sys.
        return _whole(place.name, sys_root) if place.parent == Path("/dev") else None
    if stat.S_ISBLK(st.st_mode):
        return _by_number(os.major(st.st_rdev), os.minor(st.st_rdev), sys_root)
    return device_of(place, sys_root)


def below(name: str, sys_root: Path = SYS) -> list[str]:
    """The devices under `name` (not itself), nearest first: slaves, a loop's backing."""
    found: list[str] = []
    todo = [name]
    while todo and len(found) < MOST_BELOW:
        for under in _directly_below(todo.pop(0), sys_root):
            if under != name and under not in found:
                found.append(under)
                todo.append(under)
    return found


def _directly_below(name: str, sys_root: Path) -> list[str]:
    device = sys_root / "block" / name
    try:
        slaves = sorted(os.listdir(device / "slaves"))
    except OSError:
        slaves = []
    disks = [_whole(slave, sys_root) for slave in slaves]
    try:
        backing = (device / "loop" / "backing_file").read_text().strip()
    except OSError:
        backing = ""
    if backing:  # a path in the namespace that set it up: taken as is, or not at all
        try:
            st = os.stat(backing)
        except OSError:
            st = None
        if st is not None:
            disks.append(_by_number(os.major(st.st_dev), os.minor(st.st_dev), sys_root))
    return [disk for disk in disks if disk]


def _whole(name: str, sys_root: Path) -> str | None:
    """A slave as /sys/class/block names it (it may be a partition): its whole disk."""
    try:
        real = Path(os.path.realpath(sys_root / "class" / "block" / name, strict=True))
    except OSError:
        return name if (sys_root / "block" / name).exists() else None
    return real.parent.name if (real / "partition").exists() else real.name


def read_stat(name: str, sys_root: Path = SYS) -> DiskStat:
    """A device's counters now; OSError if it is gone, ValueError if not a stat."""
    return parse_stat((sys_root / "block" / name / "stat").read_text())
