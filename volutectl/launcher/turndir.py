"""A turn's directory: made, offered into, read and removed by root, never through a path
that the turn can change.

Layout, under gate.runtime_dir/turns (root's, 0711):
  <id>/          root's, 0711: the turn may enter it, and change nothing in it; under
                 the launcher a tmpfs of its own (TURN_DIR_BOUNDS), so what the turn
                 writes fills that and not /run
    inbox/       the turn's (its user's, 0700): deliveries folded in while it runs, one
                 <id>.json file each; the turn takes one by deleting (or moving away) its
                 file. Root only ever renames a finished file into it.
    .offered/    root's, 0700: the record of what was offered. <id>.tmp is written (and
                 given to the mind's user) here, then the marker <id> is created, then
                 <id>.tmp is renamed to inbox/<id>.json; so a gate killed half-way through
                 a fold can still tell "never offered" (no marker, or the .tmp still
                 there) from "taken" (marker, and neither file)
    status       root's, 0600: the turn's wrapper writes `started`, and later the
                 command's exit status, through a descriptor it inherited (fd 9); the
                 turn cannot reach the file by its name
  .trash/        root's, 0700: turn directories set aside to be removed, each
                 <id>-<nanoseconds>; what one removal's budget did not cover waits here
                 for the next removal, or the gate's next start

The turn's stdin is not in the directory at all: it is a sealed memfd
(volutectl/launcher/fork.py).

Directories of turns that a gate before this layout started (mind-owned, with files
`started` and `status` the wrapper wrote by name, and `.offered/` inside) are still
read, through the same fds and checks, so that turns adopted across an upgrade settle.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from volutectl.kernel import dirfds

INBOX = "inbox"
OFFERED = ".offered"
STATUS = "status"
TRASH = ".trash"
STARTED_MARK = b"started"
LEGACY_STARTED = "started"  # the file a wrapper before the status descriptor created
STATUS_LIMIT = 64  # bytes: "started\n" and an exit status
# The wrapper's status file, opened for it to inherit: never through a link, never
# waiting (it is a regular file root made; the flags hold even if it were not).
STATUS_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

# What removing one turn directory may cost the gate's loop, and what its start may
# spend on directories set aside before.
REMOVE_ENTRIES, REMOVE_SECONDS = 20_000, 0.25
SWEEP_ENTRIES, SWEEP_SECONDS = 200_000, 2.0


@dataclass(frozen=True)
class Bounds:
    """What one turn's directory may hold: the size and inode count of the tmpfs that
    the launcher mounts as each turn's directory. The turn writes its inbox, on /run:
    without a filesystem of its own, one turn filled /run (bytes or inodes), which
    systemd and every other service share, and no other mind's turn could start."""

    max_bytes: int
    max_inodes: int


# Folded records (at most gate.max_pending_bytes_per_uid per client waits in the queue)
# and what the turn leaves in its inbox. An offer past it is refused (ENOSPC) and its
# delivery goes to the session's next turn.
TURN_DIR_BOUNDS = Bounds(max_bytes=256 * 1024 * 1024, max_inodes=16_384)
_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 8


class Owner(Protocol):
    """Who a turn's inbox and offered files belong to (launcher.Account is one)."""

    @property
    def uid(self) -> int: ...

    @property
    def gid(self) -> int: ...


@dataclass(frozen=True)
class Record:
    """What a turn's wrapper recorded: whether its command started, and how it ended."""

    started: bool
    exit_status: int | None
    ended_at: float | None  # when the exit status was written


@dataclass(frozen=True)
class TurnDir:
    path: Path

    @property
    def inbox(self) -> Path:
        return self.path / INBOX

    @property
    def offered(self) -> Path:
        return self.path / OFFERED

    @contextlib.contextmanager
    def opened(self) -> Iterator[int]:
        """The directory's fd; its parent (turns/) is root's, so its name is trusted."""
        with dirfds.opened_directory(str(self.path)) as fd:
            yield fd

    def record(self) -> Record:
        """The wrapper's record, read once, refusing anything but a small regular file."""
        try:
            with self.opened() as fd:
                found = dirfds.read_small_file(fd, STATUS, STATUS_LIMIT)
                legacy_started = dirfds.is_regular_file(fd, LEGACY_STARTED)
        except OSError:
            return Record(started=False, exit_status=None, ended_at=None)
        words = found.data.split() if found is not None else []
        started = legacy_started or STARTED_MARK in words
        exit_status = None
        if words and words[-1].isdigit() and len(words[-1]) <= 3:
            exit_status = int(words[-1])
        ended_at = found.mtime if found is not None and exit_status is not None else None
        return Record(started=started, exit_status=exit_status, ended_at=ended_at)

    def started(self) -> bool:
        return self.record().started

    def exit_status(self) -> int | None:
        return self.record().exit_status

    def ended_at(self) -> float | None:
        """When the wrapper recorded the exit status (the status file's mtime)."""
        return self.record().ended_at

    def open_status(self) -> int:
        """The status file, opened to append, for the turn's wrapper to inherit: it must
        be a regular file of root's (made by make_turn_dir), or OSError."""
        with self.opened() as fd:
            status_fd = os.open(STATUS, STATUS_FLAGS, dir_fd=fd)
        found = os.fstat(status_fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
            os.close(status_fd)
            raise OSError(f"{self.path / STATUS} is not a file of the gate's own")
        return status_fd

    def not_taken(self, folded: Sequence[int]) -> set[int]:
        """Of the folded delivery ids, those the turn did not take: still in the inbox, or
        never offered there (the gate died between the fold's commit and the rename).

        Only names are looked at (fstatat, no link followed, nothing opened): whatever the
        turn put in its inbox, a name that is there means "not taken"."""
        try:
            with self.opened() as fd:
                return self._not_taken(fd, folded)
        except FileNotFoundError:
            return set()  # as before: no directory, nothing known to be left

    def _not_taken(self, fd: int, folded: Sequence[int]) -> set[int]:
        with _optional_directory(INBOX, fd) as inbox:
            with _optional_directory(OFFERED, fd) as offered:
                left = set()
                for delivery_id in folded:
                    in_inbox = inbox is not None and (
                        _present(inbox, f"{delivery_id}.json")
                        or _present(inbox, f".{delivery_id}.tmp")  # a gate before .offered/<id>.tmp
                    )
                    if offered is None:
                        # A turn directory from volutectl 0.1.0, which kept no offer
                        # record: only what is still in the inbox is known to be untaken.
                        never_offered = False
                    else:
                        never_offered = not _present(offered, str(delivery_id)) or _present(
                            offered, f"{delivery_id}.tmp"
                        )
                    if in_inbox or never_offered:
                        left.add(delivery_id)
                return left

    def remove(self) -> Path | None:
        """Remove the directory, within REMOVE_ENTRIES and REMOVE_SECONDS. It is first set
        aside into turns/.trash (one rename in root's directory), so that what the budget
        does not cover waits there; returns where it waits, or None once it is gone."""
        return remove_turn_dir(self.path.parent, self.path.name)


@contextlib.contextmanager
def _optional_directory(name: str, dir_fd: int) -> Iterator[int | None]:
    try:
        fd = dirfds.open_directory(name, dir_fd)
    except FileNotFoundError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _present(dir_fd: int, name: str) -> bool:
    """Whether the directory has an entry `name`; one that cannot be looked at counts."""
    try:
        return dirfds.entry_stat(dir_fd, name) is not None
    except OSError:
        return True


# -- making, offering ------------------------------------------------------------------------


def open_turns_root(runtime_dir: Path) -> int:
    """runtime_dir/turns, made if missing: root's own and writable by no one else, or a
    PermissionError that names it. `runtime_dir` itself is an admin's path
    (systemd's RuntimeDirectory=), made here if missing, as it always was."""
    runtime_dir.mkdir(parents=True, exist_ok=True)
    with dirfds.opened_directory(str(runtime_dir)) as parent:
        with contextlib.suppress(FileExistsError):
            os.mkdir("turns", 0o711, dir_fd=parent)
        fd = dirfds.open_directory("turns", parent)
    found = os.fstat(fd)
    if found.st_uid != os.geteuid() or found.st_mode & 0o022:
        os.close(fd)
        raise PermissionError(
            f"{runtime_dir / 'turns'} must belong to uid {os.geteuid()} and be writable by "
            f"no one else (it is uid {found.st_uid}, mode {stat.filemode(found.st_mode)})"
        )
    os.fchmod(fd, 0o711)  # others may traverse to their own turn, not list
    return fd


def make_turn_dir(
    runtime_dir: Path, turn_id: int, owner: Owner, bounds: Bounds | None = None
) -> TurnDir:
    """Make turns/<turn_id>: root's, with the owner's inbox, root's offer record and the
    empty status file. A directory already there (a turn id the store reused after its
    state was lost) is set aside first. With `bounds` (the launcher, as root), the
    directory is a tmpfs of its own of that size, detached when it is set aside."""
    name = str(turn_id)
    root = open_turns_root(runtime_dir)
    try:
        if dirfds.entry_stat(root, name) is not None:
            _set_aside(root, name)
        os.mkdir(name, 0o700, dir_fd=root)
        if bounds is not None:
            _mount_tmpfs(root, name, bounds)
        with dirfds.opened_directory(name, root) as turn:
            os.mkdir(OFFERED, 0o700, dir_fd=turn)
            os.mkdir(INBOX, 0o700, dir_fd=turn)
            os.close(dirfds.create_file(turn, STATUS, 0o600))
            if os.geteuid() == 0:
                with dirfds.opened_directory(INBOX, turn) as inbox:
                    os.fchown(inbox, owner.uid, owner.gid)
            os.fchmod(turn, 0o711)  # last: the turn may enter only once all is in place
    finally:
        os.close(root)
    return TurnDir(runtime_dir / "turns" / name)


def offer(turn_dir: TurnDir, delivery_id: int, record: bytes, owner: Owner) -> None:
    """Put a folded delivery into a running turn's inbox, atomically, leaving the record
    that `TurnDir.not_taken` reads: .offered/<id>.tmp first (root's directory: nothing of
    the turn's is followed), then the marker, then the rename into the inbox.

    OSError if the turn directory is not root's (one from before this layout, which the
    turn could change): the delivery then goes back to the queue when the turn ends."""
    with turn_dir.opened() as turn:
        if os.fstat(turn).st_uid != os.geteuid():
            raise PermissionError(f"{turn_dir.path} is not the gate's own: not offering into it")
        with dirfds.opened_directory(OFFERED, turn) as offered:
            with dirfds.opened_directory(INBOX, turn) as inbox:
                if os.geteuid() == 0 and os.fstat(inbox).st_uid != owner.uid:
                    # An offer naming another mind than the turn's: its record would be
                    # given to a user who does not own the inbox it lands in.
                    raise PermissionError(f"{turn_dir.inbox} is not the offering mind's user's")
                staged = f"{delivery_id}.tmp"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(staged, dir_fd=offered)  # a fold of it that a crash cut short
                fd = dirfds.create_file(offered, staged, 0o600)
                try:
                    dirfds.write_all(fd, record)
                    if os.geteuid() == 0:
                        os.fchown(fd, owner.uid, owner.gid)
                finally:
                    os.close(fd)
                flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                os.close(os.open(str(delivery_id), flags, 0o600, dir_fd=offered))
                os.rename(staged, f"{delivery_id}.json", src_dir_fd=offered, dst_dir_fd=inbox)


# -- removing ------------------------------------------------------------------------------


def remove_turn_dir(turns: Path, name: str) -> Path | None:
    """Set turns/<name> aside into turns/.trash and remove it there, within one turn's
    budget. None once it is gone; else the path where what is left waits."""
    try:
        root = dirfds.open_directory(str(turns))
    except FileNotFoundError:
        return None
    try:
        aside = _set_aside(root, name)
        if aside is None:
            return None
        with dirfds.opened_directory(TRASH, root) as trash:
            budget = dirfds.Budget(REMOVE_ENTRIES, REMOVE_SECONDS)
            if dirfds.remove_tree(trash, aside, budget):
                return None
        return turns / TRASH / aside
    finally:
        os.close(root)


def _libc_call(function: str, *args: object) -> None:
    import ctypes  # here: only root's launcher mounts

    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, function)(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _mount_tmpfs(root: int, name: str, bounds: Bounds) -> None:
    """A tmpfs of `bounds` on root/<name>, a directory root just made in its own turns/
    (nothing of a turn's on the way; /proc/self/fd names the directory fd)."""
    options = f"mode=0700,uid=0,gid=0,size={bounds.max_bytes},nr_inodes={bounds.max_inodes}"
    target = f"/proc/self/fd/{root}/{name}".encode()
    _libc_call("mount", b"volute-turn", target, b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode())


def _detach(root: int, name: str) -> None:
    """Detach the tmpfs mounted on root/<name>, if any: what is in it goes with its last
    user (at once, whatever its depth), and the directory below is the empty one root
    made. Not a mount (a directory made without bounds): nothing to do."""
    if os.geteuid() != 0:
        return
    target = f"/proc/self/fd/{root}/{name}".encode()
    try:
        _libc_call("umount2", target, _MNT_DETACH | _UMOUNT_NOFOLLOW)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOENT):
            raise


def _set_aside(root: int, name: str) -> str | None:
    """Move root/<name> into root/.trash under a fresh name, its tmpfs detached first;
    None if there was none."""
    _detach(root, name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(TRASH, 0o700, dir_fd=root)
    aside = f"{name}-{time.time_ns()}"
    with dirfds.opened_directory(TRASH, root) as trash:
        try:
            os.rename(name, aside, src_dir_fd=root, dst_dir_fd=trash)
        except FileNotFoundError:
            return None
    return aside


@dataclass(frozen=True)
class Sweep:
    left: list[str]  # names under turns/.trash still waiting, once the budget ran out
    errors: list[str]  # one line each: what could not be opened or moved


def sweep_turn_dirs(runtime_dir: Path, keep: set[int]) -> Sweep:
    """At the gate's start: set aside every turn directory but those of `keep` (turns
    still open), then empty turns/.trash, within SWEEP_ENTRIES and SWEEP_SECONDS. Never
    raises: what it cannot do is reported, and waits for the next sweep."""
    errors: list[str] = []
    turns = runtime_dir / "turns"
    try:
        root = dirfds.open_directory(str(turns))
    except FileNotFoundError:
        return Sweep(left=[], errors=[])
    except OSError as error:
        return Sweep(left=[], errors=[f"cannot open {turns}: {error.strerror or error}"])
    try:
        for name in _listed(root):
            if name.isdigit() and int(name) not in keep:
                try:
                    _set_aside(root, name)
                except OSError as error:
                    errors.append(f"cannot set {turns / name} aside: {error.strerror or error}")
    except OSError as error:
        errors.append(f"cannot list {turns}: {error.strerror or error}")
    finally:
        os.close(root)
    swept = empty_trash(runtime_dir, dirfds.Budget(SWEEP_ENTRIES, SWEEP_SECONDS))
    return Sweep(left=swept.left, errors=errors + swept.errors)


def empty_trash(runtime_dir: Path, budget: dirfds.Budget) -> Sweep:
    """Remove what waits in turns/.trash, within `budget`. Never raises."""
    trash_path = runtime_dir / "turns" / TRASH
    left: list[str] = []
    try:
        trash = dirfds.open_directory(str(trash_path))
    except FileNotFoundError:
        return Sweep(left=[], errors=[])
    except OSError as error:
        return Sweep(left=[], errors=[f"cannot open {trash_path}: {error.strerror or error}"])
    try:
        for aside in _listed(trash):
            if not dirfds.remove_tree(trash, aside, budget):
                left.append(aside)
    except OSError as error:
        return Sweep(left=left, errors=[f"cannot empty {trash_path}: {error.strerror or error}"])
    finally:
        os.close(trash)
    return Sweep(left=left, errors=[])


def _listed(dir_fd: int) -> list[str]:
    """Every name in a directory of root's own (turns/, turns/.trash): bounded by what
    root made there, one per turn."""
    os.lseek(dir_fd, 0, os.SEEK_SET)
    with os.scandir(dir_fd) as entries:
        return sorted(entry.name for entry in entries)
