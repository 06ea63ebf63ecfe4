"""Opening paths that users can change, from a process that another user's files must not
steer: the gate, when it looks at a repository someone registered.

- **Directories, one component at a time.** `open_directory` opens each component with
  O_PATH|O_DIRECTORY|O_NOFOLLOW relative to the one before, so every step is checked on
  what was opened, not on a path string looked up again later. A symlink on the way is
  followed only when nobody but root could have put it there or can change it: owned by
  root, in a directory owned by root that no one else may write (or that is sticky, as
  /tmp is). Its target is followed as text, and no symlink on /proc, /sys or /dev is
  followed at all (`KernelPath`): a magic link there (/proc/PID/cwd) leads elsewhere
  than its text says. A user's own symlink is refused (`untrusted`), unless the caller
  acts for that user only (`any_symlink`, for `volutectl test`, which runs as the user).
- **Small files, bounded.** `read_small_file` reads a file a user controls (a `.git` file,
  `commondir`) only if it is a regular file of at most `limit` bytes: checked with
  lstat before the open, opened O_NOFOLLOW|O_NONBLOCK (a FIFO never blocks), and
  checked again on the descriptor.
- **What a descriptor is.** `kernel_filesystem` names /proc, /sys or /dev when the
  descriptor is on one of them, from fstatfs's filesystem type and the device, never
  from a path string; `descriptor_path` is the path the kernel gives it now.

Descriptors are O_PATH: they need only search permission on the way, read nothing, and
are enough for fstat, fstatfs, openat and an inotify watch on /proc/self/fd/N.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections import deque
from pathlib import Path
from typing import Any

DIRECTORY_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_SYMLINKS = 40  # as the kernel's own limit on a lookup

# linux/magic.h: filesystems that are the kernel's, not anybody's files.
KERNEL_FILESYSTEM_TYPES = {
    0x9FA0: "/proc",  # proc
    0x6E736673: "/proc",  # nsfs
    0x62656572: "/sys",  # sysfs
    0x27E0EB: "/sys",  # cgroup
    0x63677270: "/sys",  # cgroup2
    0x64626720: "/sys",  # debugfs
    0x74726163: "/sys",  # tracefs
    0x73636673: "/sys",  # securityfs
    0xCAFE4A11: "/sys",  # bpf
    0x6165676C: "/sys",  # pstore
    0xDE5E81E4: "/sys",  # efivarfs
    0x62656570: "/sys",  # configfs
    0x65735543: "/sys",  # fusectl
    0x42494E4D: "/proc",  # binfmt_misc
    0xF97CFF8C: "/sys",  # selinuxfs
    0x43415D53: "/sys",  # smackfs
    0x1CD1: "/dev",  # devpts
    0x19800202: "/dev",  # mqueue
}
KERNEL_DIRECTORIES = ("/proc", "/sys", "/dev")
_STATFS_BUFFER = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first


class UntrustedPath(Exception):
    """A path that goes through something its user controls; the message names it."""


class KernelPath(UntrustedPath):
    """A path through a symlink on /proc, /sys or /dev: never followed, because there a
    symlink's text is not where it leads (/proc/PID/cwd, /proc/PID/root)."""

    def __init__(self, root: str) -> None:
        super().__init__(f"is under {root}")
        self.root = root


def open_directory(
    path: str | os.PathLike[str],
    *,
    relative_to: int | None = None,
    any_symlink: bool = False,
) -> int:
    """An O_PATH descriptor of the directory at `path` (absolute, or relative to the
    directory descriptor `relative_to`, else to the working directory); see the module
    docstring for which symlinks are followed. Raises OSError (ENOENT, EACCES,
    ENOTDIR, ELOOP) or UntrustedPath."""
    text = os.fspath(path)
    parts = deque(text.split("/"))
    if text.startswith("/"):
        current = os.open("/", DIRECTORY_FLAGS)
    elif relative_to is None:
        current = os.open(".", DIRECTORY_FLAGS)
    else:
        current = os.dup(relative_to)
    links = 0
    walked = "" if text.startswith("/") else "."
    try:
        while parts:
            name = parts.popleft()
            if name in ("", "."):
                continue
            try:
                following = os.open(name, DIRECTORY_FLAGS, dir_fd=current)
            except NotADirectoryError:
                info = os.stat(name, dir_fd=current, follow_symlinks=False)
                if not stat.S_ISLNK(info.st_mode):
                    raise NotADirectoryError(
                        errno.ENOTDIR, os.strerror(errno.ENOTDIR), text
                    ) from None
                kernel = kernel_filesystem(current)
                if kernel is not None:
                    raise KernelPath(kernel) from None
                if not any_symlink and not _trusted_link(info, os.fstat(current)):
                    raise UntrustedPath(
                        f"{walked}/{name} is a symlink that a user other than root controls"
                    ) from None
                links += 1
                if links > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), text) from None
                target = os.readlink(name, dir_fd=current)
                parts.extendleft(reversed(target.split("/")))
                if target.startswith("/"):
                    os.close(current)
                    current = os.open("/", DIRECTORY_FLAGS)
                    walked = ""
                continue
            os.close(current)
            current = following
            walked = f"{walked}/{name}"
        return current
    except BaseException:
        os.close(current)
        raise


def _trusted_link(link: os.stat_result, parent: os.stat_result) -> bool:
    """Only root made it, and only root can swap it: root's, in root's unshared dir."""
    if link.st_uid != 0 or parent.st_uid != 0:
        return False
    return not parent.st_mode & 0o022 or bool(parent.st_mode & stat.S_ISVTX)


def read_small_file(directory: int, name: str, limit: int) -> bytes:
    """The content of regular file `name` in `directory`, at most `limit` bytes.

    Raises UntrustedPath for anything else (a symlink, FIFO, device, directory, or a
    larger file, sparse or not), OSError when it cannot be opened."""
    info = os.stat(name, dir_fd=directory, follow_symlinks=False)
    _check_small(name, info, limit)
    fd = os.open(
        name,
        os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
        dir_fd=directory,
    )
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise UntrustedPath(f"{name} changed while it was opened")
        _check_small(name, opened, limit)
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UntrustedPath(f"{name} is larger than {limit} bytes")
    return data


def _check_small(name: str, info: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise UntrustedPath(f"{name} is not a regular file")
    if info.st_size > limit:
        raise UntrustedPath(f"{name} is larger than {limit} bytes ({info.st_size})")


def kernel_filesystem(fd: int) -> str | None:
    """/proc, /sys or /dev when `fd` is on one of the kernel's filesystems, else None.

    By fstatfs's type (proc, sysfs and the like), by device (/dev's devtmpfs is a tmpfs
    to fstatfs), and by the kernel's own name for it (so /dev/shm counts as /dev)."""
    import ctypes  # here: `volutectl test` imports this module, and seldom needs it

    buffer = ctypes.create_string_buffer(_STATFS_BUFFER)
    if _libc().fstatfs(fd, buffer) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    kind = ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF
    if kind in KERNEL_FILESYSTEM_TYPES:
        return KERNEL_FILESYSTEM_TYPES[kind]
    device = os.fstat(fd).st_dev
    try:
        top = os.stat("/").st_dev
    except OSError:
        top = None
    for root in KERNEL_DIRECTORIES:
        try:
            root_device = os.stat(root).st_dev
        except OSError:
            continue
        if root_device == device and root_device != top:  # its own mount, not /'s
            return root
    where = descriptor_path(fd)
    for root in KERNEL_DIRECTORIES:
        if where == Path(root) or Path(root) in where.parents:
            return root
    return None


@functools.cache
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def descriptor_path(fd: int) -> Path:
    """The path the kernel has for what `fd` refers to, as of now."""
    return Path(os.readlink(f"/proc/self/fd/{fd}"))


def watch_path(fd: int) -> str:
    """A path that names `fd`'s own inode to inotify_add_watch, whatever is renamed."""
    return f"/proc/self/fd/{fd}"
