"""The gate's view of the test slots: which `slot-N` files are held, in which repositories.

The gate never takes a slot, and never opens one. It learns that a slot is held from
/proc/locks, and that something may have changed from inotify:

- **Probe: /proc/locks, not F_OFD_GETLK.** Slots are flock() locks. On Linux, flock
  locks and POSIX/OFD record locks live on separate lists, and F_GETLK / F_OFD_GETLK
  consult only the record locks: on a slot held with flock they answer F_UNLCK (the unit
  tests check this). A flock probe (LOCK_SH|LOCK_NB, then unlock) would take the lock
  for an instant, so a waiter could find a free slot held by the gate, and the unlock
  raises no inotify event to wake it again: that changes the lock semantics. Opening a
  slot to probe it is also ruled out: the close raises IN_CLOSE_NOWRITE on the slot,
  which wakes every waiting `volutectl test` and the gate itself, in a loop. Reading
  /proc/locks takes no lock and touches no slot. It lists every flock held as
  `FLOCK ... MAJ:MIN:INODE`, keyed by the inode's superblock device. That device is
  the mount's device (from /proc/self/mountinfo), which on overlayfs and btrfs differs
  from a file's st_dev, so each slot matches on its inode and on any of its candidate
  devices. Lines marked `->` are blocked waiters, not holders. Its one cost: a cold
  read waits for an RCU grace period (the kernel takes file_rwsem for writing), so it
  is read once per batch of slot events and `held()` answers from that reading.
- **Limit of /proc/locks.** A reader in a PID namespace other than the initial one sees
  only locks whose taking process is visible there and alive. `volutectl test` takes
  the lock and lives until the run ends, so its lock shows, unless someone kills that
  process alone while its command runs on. The packaged gate runs in the initial
  namespace, where every flock shows.
- **Wake-ups: inotify.** Each slot file is watched for IN_CLOSE_*. A flock is released
  when its last descriptor closes, which raises IN_CLOSE. Taking a flock raises no
  event at all, so `volutectl.slots.acquire_slot` announces a slot it has just taken by
  opening and closing the file once more (closing a second description never releases
  a flock). IN_OPEN is not watched: it comes before the lock, so a probe on it would
  race the locker. Directories are watched for IN_CREATE only (a slot file, or a missing
  `volute/test-slots` level appearing), never for IN_OPEN/IN_CLOSE: the gate lists a
  slot directory itself, and those events would echo back.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import termios
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from inotify_simple import INotify, flags

from volutectl import slotcore
from volutectl.gitdirs import resolve_common_dir
from volutectl.proclocks import PROC_LOCKS, mount_device, read_locks
from volutectl.slotregistry import MAX_REPOSITORIES, load_registry, save_registry

Log = Callable[[str, str], None]

SLOT_PREFIX = "slot-"

DIR_MASK = flags.CREATE | flags.MOVED_TO | flags.DELETE_SELF | flags.MOVE_SELF | flags.ONLYDIR
FILE_MASK = flags.CLOSE_WRITE | flags.CLOSE_NOWRITE | flags.DELETE_SELF | flags.MOVE_SELF
GONE = flags.DELETE_SELF | flags.MOVE_SELF | flags.IGNORED | flags.UNMOUNT

Device = slotcore.Device


@dataclass(frozen=True)
class HeldSlot:
    repository: Path  # the git common dir
    slot: Path  # .../volute/test-slots/slot-K


@dataclass(frozen=True)
class RepositorySlots:
    """A repository's slots for `status`: files present and how many are held."""

    repository: Path
    slots: int
    held: int
    watching: bool  # False while the repository is missing or unreadable


# -- the watch ----------------------------------------------------------------------------


@dataclass
class _SlotFile:
    path: Path
    wd: int
    inode: int
    devices: frozenset[Device]


@dataclass
class _Repository:
    key: Path  # the common dir; the given path while it does not resolve
    given: Path  # as configured or registered
    common_dir: Path | None = None
    wd: int | None = None  # the watch on the deepest existing of dir, volute, test-slots
    watched_dir: Path | None = None
    files: dict[str, _SlotFile] = field(default_factory=dict)
    registered: bool = False  # persisted in the registry (not from the config)


class SlotWatch:
    """Watches the slot directories of a set of repositories; see the module docstring."""

    def __init__(self, repositories: Iterable[Path], registry: Path, log: Log) -> None:
        self._inotify = INotify()
        self._registry = registry
        self._log = log
        self._problems: dict[Path, str] = {}
        self._repos: dict[Path, _Repository] = {}
        self._by_wd: dict[int, tuple[_Repository, str | None]] = {}  # None: the dir watch
        self._held: frozenset[HeldSlot] = frozenset()
        for path in repositories:
            self._add(Path(path), registered=False)
        forgotten = False
        for path in load_registry(self._registry, self._problem):
            if resolve_common_dir(path) is None:
                # Gone for good, most likely (a deleted clone): forget it, so the
                # registry does not grow with every repository ever tested. Its next
                # `volutectl test` registers it again.
                self._log("info", f"forgetting registered repository {path}: it is gone")
                forgotten = True
                continue
            self._add(path, registered=True)
        if forgotten:
            self._save_registry()
        self._held = self._probe()

    # -- the interface the gate uses ------------------------------------------------------

    def fileno(self) -> int:
        fd: int = self._inotify.fileno()
        return fd

    def on_ready(self) -> bool:
        """Take in the pending events, re-probe; True if the held slots changed."""
        try:
            events = self._inotify.read(timeout=0)
        except OSError as error:
            self._problem(Path("inotify"), f"cannot read slot events: {error}")
            events = []
        reattach: set[Path] = set()
        relevant = False
        for event in events:
            if event.mask & flags.Q_OVERFLOW:
                reattach.update(self._repos)
                relevant = True
                continue
            owner = self._by_wd.get(event.wd)
            if owner is None:
                continue  # a watch we already dropped
            relevant = True
            repo, name = owner
            if name is not None:  # a slot file
                if event.mask & GONE:
                    self._drop_file(repo, name)
            elif event.mask & GONE:
                reattach.add(repo.key)
            elif event.mask & (flags.CREATE | flags.MOVED_TO):
                self._created(repo, event.name, reattach)
        for key in reattach:
            if key in self._repos:
                self._attach(self._repos[key])
        return self._refresh() if relevant else False

    def held(self) -> list[HeldSlot]:
        """The slots held now: as of the last probe, after taking in any pending event.

        Not a fresh probe: every reading of /proc/locks costs an RCU grace period (see
        volutectl.proclocks.read_locks), and the gate asks on every admission. Every
        change of a slot raises an event, so the cache plus the pending events is
        current."""
        if self._pending_events():
            self.on_ready()
        return sorted(self._held, key=lambda h: (str(h.repository), str(h.slot)))

    def _pending_events(self) -> bool:
        try:
            return _pending(self.fileno()) > 0
        except OSError:
            return False

    def register(self, repository: Path) -> bool:
        """Watch one more repository (a checkout, worktree or git dir) and persist it.

        True if it is new, or known but was not being watched (it had gone, and is back):
        the held set may then have grown, so re-run admission."""
        path = Path(repository)
        if not path.is_absolute():
            self._problem(path, f"{repository}: not an absolute path; not watched")
            return False
        common = resolve_common_dir(path)
        if common is None:
            self._problem(path, f"{repository}: not a git repository; not watched")
            return False
        known = self._repos.get(common) or next(
            (repo for repo in self._repos.values() if repo.given == common), None
        )
        if known is not None:
            if known.wd is not None:
                return False
            self._attach(known)
            self._refresh()
            return known.wd is not None
        if sum(repo.registered for repo in self._repos.values()) >= MAX_REPOSITORIES:
            self._problem(
                Path("registry-full"),
                f"{MAX_REPOSITORIES} repositories registered: not adding {common}",
            )
            return False
        self._add(common, registered=True)
        self._save_registry()  # the gate logs the registration itself
        self._refresh()
        return True

    def repositories(self) -> list[Path]:
        return sorted(self._repos)

    def summary(self) -> list[RepositorySlots]:
        """Per repository: slot files present, slots held, whether it is watched now."""
        held = self.held()
        return [
            RepositorySlots(
                repository=key,
                slots=len(repo.files),
                held=sum(1 for h in held if h.repository == key),
                watching=repo.wd is not None,
            )
            for key, repo in sorted(self._repos.items())
        ]

    def status(self, runs: Iterable[slotcore.InFlight]) -> list[dict[str, object]]:
        """`status --json`'s "test_runs": per repository, slots held of N and its runs.

        `runs` are the live scopes of the tests slice; each goes to the repository its
        worktree belongs to. Runs in repositories the gate does not watch are listed
        too, with null slot counts."""
        entries: dict[Path, dict[str, object]] = {}
        for state in self.summary():
            entries[state.repository] = {
                "repository": str(state.repository),
                "slots_held": state.held,
                "slots": state.slots,
                "runs": [],
            }
        for run in runs:
            common = resolve_common_dir(Path(run.worktree)) if run.worktree != "?" else None
            key = common or Path(run.worktree)
            entry = entries.setdefault(
                key, {"repository": str(key), "slots_held": None, "slots": None, "runs": []}
            )
            running = None if run.running_seconds is None else round(run.running_seconds, 3)
            runs_list = entry["runs"]
            assert isinstance(runs_list, list)
            runs_list.append(
                {
                    "unit": run.unit,
                    "worktree": run.worktree,
                    "command": run.command,
                    "running_s": running,
                }
            )
        return [entries[key] for key in sorted(entries)]

    def close(self) -> None:
        self._inotify.close()

    # -- watches ----------------------------------------------------------------------------

    def _add(self, path: Path, *, registered: bool) -> None:
        common = resolve_common_dir(path)
        key = common or Path(os.path.abspath(path))
        existing = self._repos.get(key)
        if existing is not None:
            existing.registered = existing.registered or registered
            return
        repo = _Repository(key=key, given=path, common_dir=common, registered=registered)
        self._repos[key] = repo
        self._attach(repo)

    def _detach(self, repo: _Repository) -> None:
        wds = [slot.wd for slot in repo.files.values()]
        if repo.wd is not None:
            wds.append(repo.wd)
        for wd in wds:
            self._by_wd.pop(wd, None)
            with contextlib.suppress(OSError):
                self._inotify.rm_watch(wd)
        repo.files.clear()
        repo.wd = repo.watched_dir = None

    def _attach(self, repo: _Repository) -> None:
        """(Re)build a repository's watches from what exists now, race-free: each watch
        is added before the level below it is looked at, so anything created after the
        look raises an event."""
        self._detach(repo)
        if repo.common_dir is None:
            repo.common_dir = resolve_common_dir(repo.given)
            if repo.common_dir is None:
                self._problem(
                    repo.key, f"repository {repo.given} is missing or not a git repository; ignored"
                )
                return
        levels = [
            repo.common_dir,
            *(repo.common_dir.joinpath(*slotcore.SLOT_DIR_PARTS[:i]) for i in (1, 2)),
        ]
        depth = 0
        while depth < 2 and levels[depth + 1].is_dir():
            depth += 1
        while True:
            directory = levels[depth]
            try:
                repo.wd = self._inotify.add_watch(directory, DIR_MASK)
            except OSError as error:
                repo.wd = repo.watched_dir = None
                gone = depth == 0 and error.errno == errno.ENOENT
                reason = "is gone" if gone else f"cannot be watched ({error.strerror})"
                self._problem(
                    repo.key, f"repository {repo.common_dir}: {directory} {reason}; ignored"
                )
                return
            repo.watched_dir = directory
            self._by_wd[repo.wd] = (repo, None)
            if depth == 2 or not levels[depth + 1].is_dir():
                break
            # The next level appeared between the look and the watch: move down.
            self._by_wd.pop(repo.wd, None)
            with contextlib.suppress(OSError):
                self._inotify.rm_watch(repo.wd)
            depth += 1
        if repo.watched_dir == levels[2]:
            try:
                names = sorted(entry.name for entry in os.scandir(levels[2]))
            except OSError as error:
                self._problem(
                    repo.key,
                    f"repository {repo.common_dir}: cannot read {levels[2]} "
                    f"({error.strerror}); ignored",
                )
                self._detach(repo)
                return
            for name in names:
                if name.startswith(SLOT_PREFIX):
                    self._watch_file(repo, name)
        self._recovered(repo.key)

    def _created(self, repo: _Repository, name: str, reattach: set[Path]) -> None:
        assert repo.common_dir is not None and repo.watched_dir is not None
        slot_dir = repo.common_dir.joinpath(*slotcore.SLOT_DIR_PARTS)
        if repo.watched_dir == slot_dir:
            if name.startswith(SLOT_PREFIX):
                self._watch_file(repo, name)
        elif name in slotcore.SLOT_DIR_PARTS:
            reattach.add(repo.key)  # a missing level appeared: move the watch down

    def _watch_file(self, repo: _Repository, name: str) -> None:
        assert repo.watched_dir is not None
        path = repo.watched_dir / name
        try:
            wd = self._inotify.add_watch(path, FILE_MASK)
            info = path.stat()
        except OSError:
            return  # gone already, or not a file we can watch: nothing to hold
        devices = {(os.major(info.st_dev), os.minor(info.st_dev))}
        with contextlib.suppress(OSError):
            parent = repo.watched_dir.stat()
            devices.add((os.major(parent.st_dev), os.minor(parent.st_dev)))
        mount = mount_device(path)
        if mount is not None:
            devices.add(mount)
        old = repo.files.get(name)
        if old is not None and old.wd != wd:
            self._by_wd.pop(old.wd, None)
        repo.files[name] = _SlotFile(path, wd, info.st_ino, frozenset(devices))
        self._by_wd[wd] = (repo, name)

    def _drop_file(self, repo: _Repository, name: str) -> None:
        slot = repo.files.pop(name, None)
        if slot is not None:
            self._by_wd.pop(slot.wd, None)
            with contextlib.suppress(OSError):
                self._inotify.rm_watch(slot.wd)

    # -- probing ------------------------------------------------------------------------------

    def _probe(self) -> frozenset[HeldSlot]:
        if not any(repo.files for repo in self._repos.values()):
            return frozenset()
        try:
            locks = slotcore.parse_proc_locks(read_locks())
        except OSError as error:
            self._problem(
                PROC_LOCKS, f"cannot read {PROC_LOCKS} ({error.strerror}); slots look free"
            )
            return frozenset()
        held = set()
        for key, repo in self._repos.items():
            for slot in repo.files.values():
                if any((*device, slot.inode) in locks for device in slot.devices):
                    held.add(HeldSlot(key, slot.path))
        return frozenset(held)

    def _refresh(self) -> bool:
        before = self._held
        self._held = self._probe()
        return self._held != before

    # -- the log, once per problem ------------------------------------------------------------

    def _problem(self, key: Path, message: str) -> None:
        if self._problems.get(key) == message:
            return
        self._problems[key] = message
        self._log("warning", message)

    def _recovered(self, key: Path) -> None:
        if self._problems.pop(key, None) is not None:
            self._log("info", f"watching the test slots of {key} again")

    def _save_registry(self) -> None:
        registered = [key for key, repo in self._repos.items() if repo.registered]
        save_registry(self._registry, registered, self._problem)


def _pending(fd: int) -> int:
    buffer = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buffer)
    return int.from_bytes(buffer, sys.byteorder)
