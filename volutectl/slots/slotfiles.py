"""Test-run slots: flock'ed files under the git common dir, and waiting on them with inotify.

A run holds an exclusive flock on one of `<git common dir>/volute/test-slots/slot-1..N`
for as long as the open file description lives. The CLI passes that descriptor on to the
command it runs, so the slot stays held while any process of the run lives and is freed
by the kernel when the last one dies, however it dies. There is no daemon and no state
beyond held-ness; slot files are created on demand and never deleted (an unlink would
split the lock domain: a re-created name is a new inode).

Waiting: probe every slot with a non-blocking flock on a descriptor opened once and kept
open, then sleep on inotify for IN_CLOSE_* on the slot files (a flock is released exactly
when its file description's last reference closes, which is what raises IN_CLOSE), and
re-probe on each event. A probe descriptor is never closed while waiting: that close
would itself raise IN_CLOSE_NOWRITE on the watched file and turn the wait into a busy
spin. A fallback re-probe every `fallback_seconds` covers a missed event (an overflowed
queue, a file on a filesystem without inotify).

In-process callers (a test server, an editor integration) use `hold_slot`; flock excludes
between separate open file descriptions even within one process, so they contend
correctly with CLI runs and with each other.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from inotify_simple import INotify, flags

from volutectl.core import slotmath
from volutectl.errors import TemporaryError
from volutectl.kernel import pathwalk, processes
from volutectl.slots import gitdirs

Notice = Callable[[str], None]
SLOT_FILE_MODE = 0o660  # owner and group may lock; others may not even open
DIRECTORY_MODE = 0o755  # others may look (the gate, unprivileged), not create or remove
SHARED_DIRECTORY_MODE = 0o775  # in a repository whose git dir is group-writable
CLOSE_EVENTS = flags.CLOSE_WRITE | flags.CLOSE_NOWRITE
DEFAULT_FALLBACK_SECONDS = 1.5


def stderr_notice(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass
class Slot:
    """A held slot. The flock lives as long as `fd` (and any inherited copy) stays open."""

    index: int  # 1-based, as in the file name
    path: Path
    fd: int
    # The inotify instance we waited on, if any. Closing one that had watches waits for
    # an SRCU grace period (5-15 ms here), so it is closed on release, after the lock
    # is gone, instead of on the handoff path.
    watcher: INotify | None = None

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None


def slot_directory(common_dir: str | os.PathLike[str]) -> Path:
    return Path(common_dir).joinpath(*slotmath.SLOT_DIR_PARTS)


def _open_slot_files(common_dir: str | os.PathLike[str], cap: int) -> list[tuple[Path, int]]:
    """Open (creating as needed) slot-1..cap; OSError if any cannot be used.

    Who may lock a slot: the repository's owner and group, nobody else (a stranger's
    flock on a slot would hold up the runs and, through the gate, the turns). So the
    slot files are 0660 and belong to the git dir's group; their directories are 0755
    (0775 in a shared repository, whose git dir is group-writable), so that others, the
    gate included, may look but not create, remove or open. Slot files made before
    this (0644) are tightened by their owner's next run. Nothing here follows a
    symlink or opens anything but a directory or a regular file, so root running the
    tests in someone else's checkout is not steered by it."""
    directory = slot_directory(common_dir)
    common = open_common_dir(common_dir)
    try:
        repository = os.fstat(common)
        shared = bool(repository.st_mode & stat.S_IWGRP)
        dir_mode = SHARED_DIRECTORY_MODE if shared else DIRECTORY_MODE
        slot_dir = _open_level(common, Path(common_dir), 0, dir_mode, repository.st_gid)
    finally:
        os.close(common)
    opened: list[tuple[Path, int]] = []
    try:
        for name in slotmath.slot_names(cap):
            path = directory / name
            opened.append((path, _open_slot_file(slot_dir, path, repository.st_gid)))
    except OSError:
        for _, fd in opened:
            os.close(fd)
        raise
    finally:
        os.close(slot_dir)
    return opened


def open_common_dir(common_dir: str | os.PathLike[str]) -> int:
    """An O_PATH descriptor of the common dir. Root, who may be running the tests in
    someone else's checkout, follows no symlink of theirs; a user follows any."""
    try:
        return pathwalk.open_directory(common_dir, any_symlink=os.geteuid() != 0)
    except pathwalk.UntrustedPath as error:
        raise OSError(errno.ELOOP, str(error), str(common_dir)) from None


def _open_level(parent: int, where: Path, depth: int, mode: int, group: int) -> int:
    """An O_PATH descriptor of volute/ (depth 0), then of volute/test-slots/ below it,
    each made with `mode` if missing, and put right if it is ours and is not."""
    name = slotmath.SLOT_DIR_PARTS[depth]
    path = where / name
    try:
        os.mkdir(name, mode, dir_fd=parent)
    except FileExistsError:
        pass
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from None
    try:
        fd = os.open(name, pathwalk.DIRECTORY_FLAGS, dir_fd=parent)
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from None
    try:
        _tighten(fd, os.fstat(fd), mode, group)
        if depth + 1 == len(slotmath.SLOT_DIR_PARTS):
            return fd
        return _open_level(fd, path, depth + 1, mode, group)
    finally:
        if depth + 1 < len(slotmath.SLOT_DIR_PARTS):
            os.close(fd)


def _open_slot_file(directory: int, path: Path, group: int) -> int:
    # Read-only is enough for flock, and works on a slot another user created.
    flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path.name, flags, SLOT_FILE_MODE, dir_fd=directory)
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    _tighten(fd, info, SLOT_FILE_MODE, group)
    return fd


def _tighten(fd: int, info: os.stat_result, mode: int, group: int) -> None:
    """Give a slot directory or file of ours its mode and the repository's group.

    Only our own, and only one with no other name (a hard link to a file elsewhere
    would carry the change there); another user's is theirs to fix on their next run.
    Through /proc/self/fd, so that the inode changed is the one opened (an O_PATH
    descriptor cannot be fchmod'ed)."""
    if info.st_uid != os.geteuid() or (stat.S_ISREG(info.st_mode) and info.st_nlink != 1):
        return
    with contextlib.suppress(OSError):
        if info.st_gid != group:
            os.chown(pathwalk.watch_path(fd), -1, group)  # fails unless we are in it
    if stat.S_IMODE(info.st_mode) & ~stat.S_ISGID != mode:
        keep = info.st_mode & stat.S_ISGID if stat.S_ISDIR(info.st_mode) else 0
        with contextlib.suppress(OSError):
            os.chmod(pathwalk.watch_path(fd), mode | keep)


def _probe(opened: list[tuple[Path, int]]) -> int | None:
    """Take the first free slot; its position in `opened`, or None if all are held."""
    free = []
    for _, fd in opened:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            free.append(False)
            continue
        free.append(True)
        break  # holding one; do not grab more
    return slotmath.choose_slot(free)


def acquire_slot(
    common_dir: str | os.PathLike[str],
    cap: int,
    *,
    on_wait: Callable[[], None] | None = None,
    timeout: float | None = None,
    fallback_seconds: float = DEFAULT_FALLBACK_SECONDS,
    notice: Notice = stderr_notice,
) -> Slot | None:
    """Wait for and hold one of the repository's `cap` slots.

    Returns None when the slot files cannot be used: the cap fails open, after a one-line
    notice, because it protects throughput and must never fail a run that would pass.
    `on_wait` is called once, when the first probe finds every slot held. Raises
    TemporaryError when `timeout` seconds pass without a free slot.
    """
    if cap <= 0:
        return None
    try:
        opened = _open_slot_files(common_dir, cap)
    except OSError as error:
        where = error.filename or slot_directory(common_dir)
        notice(
            f"volutectl test: cannot use the test slots ({where}: {error.strerror}); "
            "running without the test-run cap"
        )
        return None
    watcher: INotify | None = None
    chosen: int | None = None
    try:
        chosen = _probe(opened)
        if chosen is None:
            watcher = INotify()
            for path, _ in opened:
                watcher.add_watch(path, CLOSE_EVENTS)
            # Probe again now that the watch is in place: a slot freed between the first
            # probe and add_watch raised its event before anyone was listening.
            chosen = _probe(opened)
        if chosen is None:
            if on_wait is not None:
                on_wait()
            assert watcher is not None
            chosen = _wait(watcher, opened, timeout, fallback_seconds)
        path, fd = opened[chosen]
        slot = Slot(index=chosen + 1, path=path, fd=fd, watcher=watcher)
        watcher = None
    finally:
        for position, (_, fd) in enumerate(opened):
            if position != chosen:
                os.close(fd)
        if watcher is not None:  # only when giving up: timeout or interrupt
            watcher.close()
    announce_held(slot.path, slot.fd)
    return slot


def announce_held(path: Path, fd: int | None = None) -> None:
    """Raise one IN_CLOSE_NOWRITE on a slot we have just locked, for the gate.

    Taking a flock raises no inotify event, so without this the gate (which counts held
    slots against the turn budget) would not learn of a run that took a slot without
    opening it, as a waiter does. Opening and closing a second description is safe:
    a flock belongs to its own open file description, and only closing that one (or
    every copy of it) releases it; it is fcntl record locks that any close drops.
    Waiters wake once on it, probe, find the slot held and sleep again.

    Given the held descriptor `fd`, the file is opened again through /proc/self/fd: a
    new description of the very inode locked, whatever was renamed since."""
    where = str(path) if fd is None else pathwalk.watch_path(fd)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
    with contextlib.suppress(OSError):
        os.close(os.open(where, flags if fd is not None else flags | os.O_NOFOLLOW))


def _wait(
    watcher: INotify,
    opened: list[tuple[Path, int]],
    timeout: float | None,
    fallback_seconds: float,
) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    poller = select.poll()
    poller.register(watcher.fileno(), select.POLLIN)
    while True:
        wait = fallback_seconds
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TemporaryError(
                    f"no test slot came free within {timeout:g}s",
                    hint="try again later, or raise the cap",
                )
            wait = min(wait, left)
        if poller.poll(wait * 1000):
            list(watcher.read(timeout=0))  # drain; which slot closed does not matter
        chosen = _probe(opened)
        if chosen is not None:
            return chosen


@contextlib.contextmanager
def hold_slot(
    common_dir: str | os.PathLike[str],
    cap: int,
    *,
    on_wait: Callable[[], None] | None = None,
    timeout: float | None = None,
    environ: Mapping[str, str] | None = None,
    notice: Notice = stderr_notice,
) -> Iterator[Slot | None]:
    """Hold a test slot for the body of a `with` block; the in-process API.

        with hold_slot(common_dir, 2) as slot:
            run_the_suite()

    Yields None (and waits for nothing) when cap is 0, when a slot is already held
    above us (the nesting marker is set), or when the slot files fail open.
    """
    environ = os.environ if environ is None else environ
    if cap <= 0 or environ.get(slotmath.NESTING_MARKER):
        yield None
        return
    slot = acquire_slot(common_dir, cap, on_wait=on_wait, timeout=timeout, notice=notice)
    try:
        yield slot
    finally:
        if slot is not None:
            slot.release()


# -- where a repository keeps its slots ---------------------------------------------------


@dataclass(frozen=True)
class Repository:
    common_dir: Path  # shared by every worktree: the fleet scope of the cap
    worktree: Path  # the top level of this checkout
    cap_setting: str | None  # git config volute.testSlots, from the common config


def find_repository(path: str | os.PathLike[str]) -> Repository | None:
    """The git repository `path` is in, or None when it is in none."""
    checkout = gitdirs.find_checkout(path)
    if checkout is None:
        return None
    return Repository(checkout.common_dir, checkout.worktree, read_cap_setting(checkout.common_dir))


def read_cap_setting(common_dir: Path) -> str | None:
    """volute.testSlots from the repository's own config file, which every worktree shares
    (not from a worktree's config.worktree, nor the user's or system's config).

    git parses it (the format has quoting, subsections and case rules of its own)."""
    config = common_dir / "config"
    argv = ["git", "config", "--file", str(config), "--get", slotmath.GIT_CONFIG_KEY]
    try:
        result = processes.run(argv, redirect={2: os.devnull}, capture=True, search_path=True)
    except OSError:
        return None
    if result.exit_code != 0:
        return None
    return result.output.strip() or None
