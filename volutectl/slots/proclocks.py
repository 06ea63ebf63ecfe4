"""The kernel's own list of held locks, for the gate's slot watch (volutectl.slots.watch
says why it asks the kernel rather than probe a slot): /proc/locks, read whole, and
the mount device that keys its lines.

/proc/locks names each lock's file as MAJ:MIN:INODE, where MAJ:MIN is the device of the
inode's superblock: the mount's, from /proc/self/mountinfo, which on overlayfs and btrfs
differs from the st_dev that stat() gives. volutectl.core.slotmath parses both texts.
"""

from __future__ import annotations

import os
from pathlib import Path

from volutectl.core import slotmath

PROC_LOCKS = Path("/proc/locks")
MOUNTINFO = Path("/proc/self/mountinfo")


def read_locks() -> str:
    """/proc/locks, in as few read() calls as it takes.

    Each read of /proc/locks starts by taking the kernel's file_rwsem for writing
    (fs/locks.c, locks_start), which waits for an RCU grace period when the semaphore
    was idle: about 0.03 ms back to back, 5-20 ms cold on a loaded 2-core VM. Lock
    callers elsewhere are not blocked for that time, only this reader waits. So the
    watch reads it once per batch of events, never on a timer and never per query."""
    fd = os.open(PROC_LOCKS, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def mount_device(path: Path) -> slotmath.Device | None:
    """The device of the mount that `path` is on, as /proc/locks keys it; None if unknown."""
    try:
        text = MOUNTINFO.read_text(errors="replace")
    except OSError:
        return None
    return slotmath.parse_mount_device(text, os.path.realpath(path))
