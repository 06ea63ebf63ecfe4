"""File operations for root in a directory that someone else can write.

A mind owns its turn's inbox, and its processes can change what is in it at any moment:
put a symbolic link where root is about to create a file, a FIFO where root reads, a
tree deeper than any recursion. So root reaches such files only through directory fds,
one path component at a time (DESIGN.md invariant 13):
- a directory is opened with O_NOFOLLOW|O_DIRECTORY, relative to a directory fd;
- a file is created with O_CREAT|O_EXCL|O_NOFOLLOW, and chowned by its fd;
- a file is read only if it is a regular file (checked before the open and again on
  the fd), opened with O_NONBLOCK, and only up to a few bytes;
- a tree is removed without recursion and without following links, within a budget of
  entries and time, holding two directory fds whatever its depth.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

# Names read from a directory at a time: a directory of millions of entries is read a
# chunk at a time, so that the budget, not the directory, bounds the memory used.
_CHUNK = 256


def open_directory(name: str, dir_fd: int | None = None) -> int:
    """Open a directory, never through a symbolic link in its last component (ELOOP or
    ENOTDIR then). Without `dir_fd`, `name` is a path that root alone controls."""
    return os.open(name, DIRECTORY_FLAGS, dir_fd=dir_fd)


@contextlib.contextmanager
def opened_directory(name: str, dir_fd: int | None = None) -> Iterator[int]:
    fd = open_directory(name, dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def entry_stat(dir_fd: int, name: str) -> os.stat_result | None:
    """What `name` in the directory is, without following a link; None if absent."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def is_regular_file(dir_fd: int, name: str) -> bool:
    found = entry_stat(dir_fd, name)
    return found is not None and stat.S_ISREG(found.st_mode)


@dataclass(frozen=True)
class SmallFile:
    data: bytes
    mtime: float


def read_small_file(dir_fd: int, name: str, limit: int) -> SmallFile | None:
    """The content of a regular file of at most `limit` bytes; None for anything else
    (absent, a link, a FIFO, a device, a directory, larger). Never blocks: a FIFO is
    refused before the open, and one swapped in after that check opens without waiting
    (O_NONBLOCK) and is refused on its fd."""
    if not is_regular_file(dir_fd, name):
        return None
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_size > limit:
            return None
        data = os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > limit:
        return None
    return SmallFile(data, found.st_mtime)


def create_file(dir_fd: int, name: str, mode: int = 0o600) -> int:
    """A new regular file, opened for writing; FileExistsError if the name is taken by
    anything at all, a dangling link included."""
    return os.open(name, CREATE_FLAGS, mode, dir_fd=dir_fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Budget:
    """How much one removal may do: a count of entries, and a monotonic deadline."""

    def __init__(self, entries: int, seconds: float) -> None:
        self.entries = entries
        self.deadline = time.monotonic() + seconds

    def spend(self) -> bool:
        """One more entry; False once the budget is gone."""
        self.entries -= 1
        return self.entries >= 0 and time.monotonic() < self.deadline

    def spent(self) -> bool:
        """Whether the budget ran out (a `spend` was refused, or its time is up)."""
        return self.entries < 0 or time.monotonic() >= self.deadline


def remove_tree(dir_fd: int, name: str, budget: Budget) -> bool:
    """Remove `name` in the directory, and everything under it, within `budget`.

    True if it is gone; False if the budget ran out or something could not be removed
    (it is then left, maybe in part). Links are removed, never followed. No recursion:
    each directory found below the top one is first moved up into the top one, then
    emptied of its files and removed, so any depth takes two fds and no stack."""
    if _unlink(dir_fd, name):
        return True
    try:
        top = open_directory(name, dir_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return _unlink(dir_fd, name)  # swapped for a link or a file meanwhile
    try:
        emptied = _empty_top(top, budget)
    finally:
        os.close(top)
    if not emptied:
        return False
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _unlink(dir_fd: int, name: str) -> bool:
    """Remove a non-directory; False if `name` is a directory (or cannot go)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _names(dir_fd: int) -> list[str]:
    """Up to _CHUNK names in the directory, from its start."""
    os.lseek(dir_fd, 0, os.SEEK_SET)
    found: list[str] = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            found.append(entry.name)
            if len(found) >= _CHUNK:
                break
    return found


def _empty_top(top: int, budget: Budget) -> bool:
    moved = 0
    while True:
        names = _names(top)
        if not names:
            return True
        for name in names:
            if not budget.spend():
                return False
            if _unlink(top, name):
                continue
            moved = _flatten(top, name, budget, moved)
            if moved < 0:
                return False


def _flatten(top: int, name: str, budget: Budget, moved: int) -> int:
    """Empty the directory `name` in `top`: remove its files, move its directories up
    into `top`, then remove it. Returns the count of directories moved so far, or -1
    when the budget ran out or something cannot be removed."""
    try:
        directory = open_directory(name, top)
    except FileNotFoundError:
        return moved
    except OSError:
        return moved if _unlink(top, name) else -1
    try:
        while names := _names(directory):
            for entry in names:
                if not budget.spend():
                    return -1
                if _unlink(directory, entry):
                    continue
                moved += 1
                if not _move_up(directory, entry, top, moved):
                    return -1
    finally:
        os.close(directory)
    try:
        os.rmdir(name, dir_fd=top)
    except FileNotFoundError:
        pass
    except OSError as error:
        if error.errno != errno.ENOTEMPTY:  # refilled meanwhile: the next pass sees it
            return -1
    return moved


def _move_up(directory: int, name: str, top: int, moved: int) -> bool:
    for attempt in range(3):
        target = f".volute-removing-{os.getpid()}-{moved}-{attempt}-{time.monotonic_ns()}"
        try:
            os.rename(name, target, src_dir_fd=directory, dst_dir_fd=top)
        except FileNotFoundError:
            return True  # gone meanwhile
        except OSError as error:
            if error.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                continue
            return False
        return True
    return False
