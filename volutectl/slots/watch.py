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
- **Wake-ups: inotify, one watch per repository.** The slot directory is watched for
  IN_CLOSE_* of its files: a directory watch reports its children's events with their
  names. A flock is released when its last descriptor closes, which raises IN_CLOSE.
  Taking a flock raises no event at all, so `volutectl.slots.slotfiles.acquire_slot`
  announces a slot it has just taken by opening and closing the file once more (closing
  a second description never releases a flock). IN_OPEN is not watched: it comes before the
  lock, so a probe on it would race the locker. An event without a name is about the
  directory itself (someone listing it): no slot changed, so it is ignored. The gate
  never lists a slot directory; it looks up `slot-1`.. by name with lstat, which opens
  nothing. Until `volute/test-slots` exists, the deepest existing level is watched for
  IN_CREATE instead.
- **Bounds.** A repository's slots are `slot-1` .. `slot-<max_slot_files>`
  (tests.max_slot_files); a file past that, or with another name, costs nothing: it
  is never looked up, and its events are dropped unread. That it exists is said once,
  in the journal and in `status`. Registrations are bounded in all and per user
  (volutectl.slots.registry).
- **Whose repository.** A repository is opened as volutectl.slots.gitdirs does: through no
  symlink a user controls, `.git` and `commondir` read bounded. Its common dir is then
  checked on the descriptor (owner, filesystem; gitdirs.check_common_dir), and it is
  that descriptor that is watched, through /proc/self/fd/N, so the inode watched is the
  inode checked, whatever is renamed or swapped afterwards. This is done again on each
  (re)attach, so a repository that stops passing the checks stops being watched.
- **A gate that may not look.** Run as an unprivileged user, the gate cannot enter a
  private home directory (Debian makes homes 0700). `volutectl test` therefore sends
  the repository's common dir as a descriptor with its registration (SCM_RIGHTS); the
  gate checks that descriptor as it would the path's (owner, filesystem, shape; the
  same inode as the path's, where the path opens), keeps a dup of it (the repository's
  *anchor*), and reaches the slot directory relative to it, never by the path. An
  anchor is a descriptor held, so the common dir's own removal raises no event; it is
  let go when the repository stops passing the checks (its slot directory going
  raises one), or is found removed (no links left) when next looked at. Anchors are
  kept across gate restarts in systemd's fd store (`FdStore`, named
  volute-repo-UID-DEV-INO), and checked again when they come back. A repository
  registered with no descriptor that the gate may not look into is listed with the
  problem "permission denied" in `status` and said once in the journal, and is
  otherwise ignored.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import sys
import termios
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from inotify_simple import INotify, flags

from volutectl import events
from volutectl.core import slotmath
from volutectl.kernel import pathwalk
from volutectl.slots import gitdirs
from volutectl.slots.proclocks import PROC_LOCKS, mount_device, read_locks
from volutectl.slots.registry import (
    MAX_REPOSITORIES,
    MAX_REPOSITORIES_PER_USER,
    Registered,
    load_registry,
    save_registry,
)

SLOT_PREFIX = "slot-"
DEFAULT_MAX_SLOT_FILES = 256

GONE = flags.DELETE_SELF | flags.MOVE_SELF | flags.IGNORED | flags.UNMOUNT
# Above the slot directory: a missing level appearing, or this one going.
LEVEL_MASK = flags.CREATE | flags.MOVED_TO | flags.DELETE_SELF | flags.MOVE_SELF | flags.ONLYDIR
# The slot directory: its files appearing, going, and closing (a flock released).
SLOT_DIR_MASK = (
    LEVEL_MASK | flags.DELETE | flags.MOVED_FROM | flags.CLOSE_WRITE | flags.CLOSE_NOWRITE
)
SLOT_DEPTH = len(slotmath.SLOT_DIR_PARTS)

Device = slotmath.Device


ANCHOR_PREFIX = "volute-repo-"  # the fd store's name of an anchor: volute-repo-UID-DEV-INO


def anchor_name(uid: int, fd: int) -> str:
    info = os.fstat(fd)
    return f"{ANCHOR_PREFIX}{uid}-{info.st_dev}-{info.st_ino}"


def anchor_uid(name: str) -> int | None:
    """Whose an anchor is, from its name in the fd store; None for no anchor's name."""
    if not name.startswith(ANCHOR_PREFIX):
        return None
    uid = name[len(ANCHOR_PREFIX) :].split("-")[0]
    return int(uid) if uid.isdigit() else None


@dataclass(frozen=True)
class FdStore:
    """Where anchors are kept across restarts (systemd's fd store: `keep` and `forget` of
    volutectl.systemd.activation); by default nowhere, and a repository's next
    `volutectl test` registers it again."""

    keep: Callable[[str, int], object] = lambda name, fd: None
    forget: Callable[[str], object] = lambda name: None


class RepositoryLimit(Exception):
    """A registration past a bound (all repositories, or one user's); says which."""


class RunEntry(TypedDict):
    """A test run in `status --json`'s "test_runs"."""

    unit: str
    worktree: str
    command: str
    running_s: float | None


class RepositoryEntry(TypedDict):
    """One repository in `status --json`'s "test_runs" (wire.messages.RepositoryStatus)."""

    repository: str
    slots_held: int | None
    slots: int | None
    problem: str | None
    runs: list[RunEntry]


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
    watching: bool  # False while the repository is missing, unreadable or refused
    problem: str | None = None  # why it is not watched, or what of it is not


# -- the watch ----------------------------------------------------------------------------


@dataclass
class _SlotFile:
    path: Path
    inode: int
    devices: frozenset[Device]


@dataclass
class _Repository:
    key: Path  # the common dir as first opened; the given path until it opens
    given: Path  # as configured or registered
    uid: int  # the common dir must belong to this user or root; 0 (the config): anyone
    registered: bool = False  # persisted in the registry (not from the config)
    configured: bool = False  # from tests.repositories: counts against no bound
    depth: int = 0  # of the watched level: 0 the common dir .. SLOT_DEPTH the slot dir
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the watched level
    wd: int | None = None
    devices: frozenset[Device] = frozenset()  # the slot directory's and its mount's
    files: dict[str, _SlotFile] = field(default_factory=dict)
    problem: str | None = None  # why it is not watched now
    over_cap: bool = False  # has slot files past max_slot_files
    # The common dir, as a descriptor a client passed: the gate may not open the path.
    anchor: int | None = None
    anchor_name: str | None = None  # its name in the fd store


class SlotWatch:
    """Watches the slot directories of a set of repositories; see the module docstring."""

    def __init__(
        self,
        repositories: Iterable[Path],
        registry: Path,
        emit: events.Emit,
        *,
        max_slot_files: int = DEFAULT_MAX_SLOT_FILES,
        anchors: Iterable[tuple[str, int]] = (),
        fd_store: FdStore | None = None,
    ) -> None:
        self._inotify = INotify()
        self._fd_store = fd_store or FdStore()
        self._registry = registry
        self._emit = emit
        self._max_slot_files = max_slot_files
        self._problems: dict[str, events.BaseEvent] = {}
        self._repos: dict[Path, _Repository] = {}
        self._by_wd: dict[int, _Repository] = {}
        self._held: frozenset[HeldSlot] = frozenset()
        for path in repositories:
            self._add(Path(path), uid=0, registered=False, configured=True)
        for name, fd in anchors:
            self._restore(name, fd)
        forgotten = False
        for entry in load_registry(self._registry, self._problem):
            uid, reason = self._usable(entry)
            if uid is None:
                # Gone for good, most likely (a deleted clone): forget it, so the
                # registry does not grow with every repository ever tested. Its next
                # `volutectl test` registers it again, if it may.
                self._emit(events.RepositoryForgotten(repository=str(entry.path), reason=reason))
                forgotten = True
                continue
            self._add(entry.path, uid=uid, registered=True)
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
            self._problem("inotify", events.SlotEventsUnreadable(error=str(error)))
            events = []
        reattach: set[Path] = set()
        lookups: dict[Path, set[str]] = {}  # slot names to look up, per repository
        relevant = False
        for event in events:
            if event.mask & flags.Q_OVERFLOW:
                reattach.update(self._repos)
                relevant = True
                continue
            repo = self._by_wd.get(event.wd)
            if repo is None:
                continue  # a watch we already dropped
            if event.mask & GONE:
                reattach.add(repo.key)
                relevant = True
            elif event.name:  # nameless: the directory itself was listed; no slot changed
                relevant |= self._on_entry(repo, event.mask, event.name, reattach, lookups)
        for key, names in lookups.items():
            if key not in reattach and not self._look_up(self._repos[key], names):
                reattach.add(key)
        for key in reattach:
            if key in self._repos:
                self._attach(self._repos[key])
        return self._refresh() if relevant else False

    def _on_entry(
        self,
        repo: _Repository,
        mask: int,
        name: str,
        reattach: set[Path],
        lookups: dict[Path, set[str]],
    ) -> bool:
        """An event about `name` in the watched level; True if a slot may have changed."""
        if repo.depth < SLOT_DEPTH:
            if (
                mask & (flags.CREATE | flags.MOVED_TO)
                and name == slotmath.SLOT_DIR_PARTS[repo.depth]
            ):
                reattach.add(repo.key)  # a missing level appeared: move the watch down
                return True
            return False
        index = slotmath.slot_index(name)
        if index is None:
            return False
        if index > self._max_slot_files:
            self._over_cap(repo)
            return False
        if mask & (flags.DELETE | flags.MOVED_FROM):
            lookups.get(repo.key, set()).discard(name)
            return repo.files.pop(name, None) is not None
        if name not in repo.files or mask & (flags.CREATE | flags.MOVED_TO):
            lookups.setdefault(repo.key, set()).add(name)  # new, or replaced
        return True

    def _look_up(self, repo: _Repository, names: set[str]) -> bool:
        """Track `names` in the watched slot directory; False if the directory at its
        path is no longer the one watched (then it is attached afresh, and checked)."""
        directory = self._reopen(repo)
        if directory is None:
            return False
        try:
            for name in sorted(names):
                self._track(repo, directory, name)
        finally:
            os.close(directory)
        return True

    def _reopen(self, repo: _Repository) -> int | None:
        """The watched level, opened again by its path, if it is still the same inode.

        The watch holds no descriptor of the level: an open one would keep a removed
        directory's inode alive, and its IN_DELETE_SELF would never come. A repository
        the gate may not open by path is reopened below its anchor (the common dir)."""
        below = slotmath.SLOT_DIR_PARTS[: repo.depth]
        try:
            if repo.anchor is not None:
                directory = pathwalk.open_directory("/".join(below) or ".", relative_to=repo.anchor)
            else:
                directory = pathwalk.open_directory(repo.key.joinpath(*below))
        except (OSError, pathwalk.UntrustedPath):
            return None
        info = os.fstat(directory)
        if (info.st_dev, info.st_ino) != repo.identity:
            os.close(directory)
            return None
        return directory

    def held(self) -> list[HeldSlot]:
        """The slots held now: as of the last probe, after taking in any pending event.

        Not a fresh probe: every reading of /proc/locks costs an RCU grace period (see
        volutectl.slots.proclocks.read_locks), and the gate asks on every admission. Every
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

    def register(self, repository: Path, uid: int = 0, descriptor: int | None = None) -> bool:
        """Watch one more repository (a checkout, worktree or git dir) for the user `uid`
        (0: root, who may have any repository watched), and persist it.

        True if it is new, or known but was not being watched (it had gone, and is back):
        the held set may then have grown, so re-run admission. False, with the reason
        logged once, when it is no repository this user may have watched. One the gate
        may not look into (permission denied) is watched through `descriptor`, its
        common dir as the client passed it (a dup is kept; the caller closes it), when
        there is one; else it is kept, unwatched and unpersisted, so that `status` says
        so. Raises RepositoryLimit past the bounds on registrations."""
        path = Path(repository)
        if not path.is_absolute():
            self._refused(path, "not an absolute path")
            return False
        try:
            fd = gitdirs.open_common_dir(path)
        except PermissionError:
            if descriptor is not None:
                return self._register_passed(path, uid, descriptor)
            return self._register_unreadable(path, uid)
        except (OSError, gitdirs.RepositoryRefused):
            self._refused(path, "not a git repository")
            return False
        try:
            gitdirs.check_common_dir(fd, uid)
            if descriptor is not None and _identity(fd) != _identity(descriptor):
                raise gitdirs.RepositoryRefused("is not the directory its descriptor is")
            common = pathwalk.descriptor_path(fd)
        except (OSError, gitdirs.RepositoryRefused) as refusal:
            self._refused(path, str(refusal))
            return False
        finally:
            os.close(fd)
        unreadable = self._repos.get(path)
        if unreadable is not None and path != common and unreadable.wd is None:
            del self._repos[path]  # listed while the gate could not look: it can now
            self._problems.pop(str(path), None)
        known = self._repos.get(common) or next(
            (repo for repo in self._repos.values() if repo.given == common), None
        )
        if known is not None:
            if known.wd is not None:
                return False
            self._attach(known)
            self._refresh()
            return known.wd is not None
        self._check_bounds(common, uid)
        self._add(common, uid=uid, registered=True)
        self._save_registry()  # the gate logs the registration itself
        self._refresh()
        return True

    def _register_passed(self, path: Path, uid: int, descriptor: int) -> bool:
        """Register the common dir open at `descriptor` (the gate may not open `path`),
        checked as its user's, and watch it through a dup of that descriptor."""
        try:
            _check_anchor(descriptor, uid)
            common = pathwalk.descriptor_path(descriptor)
        except (OSError, gitdirs.RepositoryRefused) as refusal:
            self._refused(path, _reason(refusal))
            return False
        listed = self._repos.get(path)
        if listed is not None and path != common and listed.wd is None and listed.anchor is None:
            del self._repos[path]  # listed as unreadable: it is watched now
            self._problems.pop(str(path), None)
        known = self._repos.get(common)
        if known is not None and known.wd is not None:
            return False
        if known is None or known.uid != uid:
            self._check_bounds(common, uid)
        if known is None:
            known = self._repos[common] = _Repository(key=common, given=common, uid=uid)
        # Listed unwatched, perhaps by another user that named this path: it is the
        # user's whose descriptor passed the checks.
        known.uid = uid
        if not known.registered and not known.configured:
            known.registered = True
            self._save_registry()
        self._anchor(known, descriptor)
        self._attach(known)
        self._refresh()
        return known.wd is not None

    def _anchor(self, repo: _Repository, descriptor: int) -> None:
        """Keep a dup of `descriptor` as the repository's anchor, and in the fd store."""
        self._release_anchor(repo)
        repo.anchor = os.dup(descriptor)  # not inheritable: no turn or child gets it
        repo.anchor_name = anchor_name(repo.uid, repo.anchor)
        self._fd_store.keep(repo.anchor_name, repo.anchor)

    def _release_anchor(self, repo: _Repository) -> None:
        if repo.anchor is not None:
            os.close(repo.anchor)
        if repo.anchor_name is not None:
            self._fd_store.forget(repo.anchor_name)
        repo.anchor = repo.anchor_name = None

    def _restore(self, name: str, fd: int) -> None:
        """An anchor from the fd store, kept before a restart: watched again if it still
        passes the checks; else closed and taken out of the store."""
        uid = anchor_uid(name)
        try:
            if uid is None:
                raise gitdirs.RepositoryRefused(f"is no anchor ({name!r})")
            _check_anchor(fd, uid)
            key = pathwalk.descriptor_path(fd)
        except (OSError, gitdirs.RepositoryRefused) as refusal:
            where = pathwalk.descriptor_path(fd) if uid is not None else name
            os.close(fd)
            self._fd_store.forget(name)
            self._emit(events.RepositoryForgotten(repository=str(where), reason=_reason(refusal)))
            return
        if uid is None or key in self._repos:  # a second copy: the store keeps the first
            os.close(fd)
            return
        repo = _Repository(key=key, given=key, uid=uid, registered=True)
        repo.anchor, repo.anchor_name = fd, name
        self._repos[key] = repo
        self._attach(repo)

    def _register_unreadable(self, path: Path, uid: int) -> bool:
        if path not in self._repos:
            self._check_bounds(path, uid)
            self._repos[path] = _Repository(key=path, given=path, uid=uid)
        self._attach(self._repos[path])  # says why, once
        return False

    def _check_bounds(self, path: Path, uid: int) -> None:
        ours = [repo for repo in self._repos.values() if not repo.configured]
        if len(ours) >= MAX_REPOSITORIES:
            full = events.RegistrationsFull(
                repository=str(path), uid=None, registered=MAX_REPOSITORIES
            )
            self._problem("registry-full", full)
            raise RepositoryLimit(full.message())
        mine = sum(1 for repo in ours if repo.uid == uid)
        if uid != 0 and mine >= MAX_REPOSITORIES_PER_USER:
            full = events.RegistrationsFull(repository=str(path), uid=uid, registered=mine)
            self._problem(f"registry-full-{uid}", full)
            raise RepositoryLimit(full.message())

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
                problem=repo.problem
                or (
                    f"slot files past slot-{self._max_slot_files} are not counted"
                    if repo.over_cap
                    else None
                ),
            )
            for key, repo in sorted(self._repos.items())
        ]

    def status(self, runs: Iterable[slotmath.InFlight]) -> list[RepositoryEntry]:
        """`status --json`'s "test_runs": per repository, slots held of N and its runs.

        `runs` are the live scopes of the tests slice; each goes to the repository its
        worktree belongs to. Runs in repositories the gate does not watch are listed
        too, with null slot counts."""
        entries: dict[Path, RepositoryEntry] = {}
        for state in self.summary():
            entries[state.repository] = {
                "repository": str(state.repository),
                "slots_held": state.held if state.watching else None,
                "slots": state.slots if state.watching else None,
                "problem": state.problem,
                "runs": [],
            }
        for run in runs:
            common = resolve_run(run.worktree) or self._anchored(run.worktree)
            key = common or Path(run.worktree)
            entry = entries.setdefault(
                key,
                {
                    "repository": str(key),
                    "slots_held": None,
                    "slots": None,
                    "problem": None,
                    "runs": [],
                },
            )
            running = None if run.running_seconds is None else round(run.running_seconds, 3)
            entry["runs"].append(
                {
                    "unit": run.unit,
                    "worktree": run.worktree,
                    "command": run.command,
                    "running_s": running,
                }
            )
        return [entries[key] for key in sorted(entries)]

    def _anchored(self, worktree: str) -> Path | None:
        """The repository of a run in a main checkout the gate may not open, watched
        through its anchor: the one whose common dir is that checkout's `.git`."""
        key = Path(worktree) / ".git"
        repo = self._repos.get(key)
        return key if repo is not None and repo.anchor is not None else None

    def close(self) -> None:
        """Stop watching. Anchors are closed here, and stay in the fd store."""
        for repo in self._repos.values():
            self._detach(repo)
            if repo.anchor is not None:
                os.close(repo.anchor)
                repo.anchor = None
        self._inotify.close()

    # -- watches ----------------------------------------------------------------------------

    def _usable(self, entry: Registered) -> tuple[int | None, str]:
        """Whose a registry entry is; (None, why) when it is to be forgotten: gone, or
        no longer its user's (or root's)."""
        uid = entry.uid
        try:
            if uid is None:  # version 1: the owner of the path given, as it checked
                uid = os.stat(entry.path, follow_symlinks=False).st_uid
            fd = gitdirs.open_common_dir(entry.path)
        except FileNotFoundError:
            return None, "it is gone"
        except PermissionError:
            # Perhaps there still, and said when it is attached; but whose a version 1
            # entry is cannot be told without looking.
            return uid, "" if uid is not None else "cannot tell whose it is"
        except (OSError, gitdirs.RepositoryRefused) as error:
            return None, _reason(error)
        try:
            gitdirs.check_common_dir(fd, uid)
        except (OSError, gitdirs.RepositoryRefused) as refusal:
            return None, _reason(refusal)
        finally:
            os.close(fd)
        return uid, ""

    def _add(self, path: Path, *, uid: int, registered: bool, configured: bool = False) -> None:
        common = gitdirs.resolve_common_dir(path)
        key = common or Path(os.path.abspath(path))
        existing = self._repos.get(key)
        if existing is not None:
            existing.registered = existing.registered or registered
            return
        repo = _Repository(
            key=key, given=path, uid=uid, registered=registered, configured=configured
        )
        self._repos[key] = repo
        self._attach(repo)

    def _detach(self, repo: _Repository) -> None:
        if repo.wd is not None:
            self._by_wd.pop(repo.wd, None)
            with contextlib.suppress(OSError):
                self._inotify.rm_watch(repo.wd)
        repo.files.clear()
        repo.wd = repo.identity = None
        repo.depth = 0

    def _attach(self, repo: _Repository) -> None:
        """(Re)build a repository's watch from what exists now, race-free: each level's
        watch is added before the level below it is looked for, so anything created
        after the look raises an event. Opened and checked again each time."""
        self._detach(repo)
        directory = self._open_common_dir(repo)
        if directory is None:
            return
        watched = self._watch_deepest_level(repo, directory)
        if watched is None:
            return
        directory, depth, wd = watched
        try:
            info = os.fstat(directory)
            repo.depth, repo.wd, repo.identity = depth, wd, (info.st_dev, info.st_ino)
            self._by_wd[wd] = repo
            repo.problem = None
            if depth == SLOT_DEPTH:
                self._scan(repo, directory)
        finally:
            os.close(directory)
        self._recovered(repo)

    def _open_common_dir(self, repo: _Repository) -> int | None:
        """The repository's common git directory, opened and checked as its owner's; None
        (and the problem said) when it cannot be watched."""
        if repo.anchor is not None:
            return self._open_anchor(repo)
        try:
            directory = gitdirs.open_common_dir(repo.given)
        except PermissionError:
            self._cannot_watch(repo, "permission denied")
            return None
        except (FileNotFoundError, gitdirs.NotARepository):
            if repo.key == repo.given:
                self._cannot_watch(repo, "missing or not a git repository")
            else:
                self._cannot_watch(repo, "gone")
            return None
        except (OSError, gitdirs.RepositoryRefused) as error:
            self._cannot_watch(repo, _reason(error))
            return None
        try:
            gitdirs.check_common_dir(directory, repo.uid)
        except (OSError, gitdirs.RepositoryRefused) as error:
            os.close(directory)
            self._cannot_watch(repo, _reason(error))
            return None
        return directory

    def _open_anchor(self, repo: _Repository) -> int | None:
        """A dup of the repository's anchor, checked again; None (the anchor let go, and
        the problem said) once it no longer passes: removed, or no longer its user's."""
        assert repo.anchor is not None
        try:
            _check_anchor(repo.anchor, repo.uid)
            return os.dup(repo.anchor)
        except (OSError, gitdirs.RepositoryRefused) as error:
            self._release_anchor(repo)
            self._cannot_watch(repo, _reason(error))
            return None

    def _watch_deepest_level(
        self, repo: _Repository, directory: int
    ) -> tuple[int, int, int] | None:
        """Watch the deepest level there is below `directory` (which this takes over):
        (that level's fd, its depth, the watch), or None (and the problem said)."""
        depth = 0
        while depth < SLOT_DEPTH:  # down to the deepest level there is
            below = _open_level(directory, depth)
            if below is None:
                break
            os.close(directory)
            directory = below
            depth += 1
        while True:
            try:
                wd = self._inotify.add_watch(
                    pathwalk.watch_path(directory),
                    SLOT_DIR_MASK if depth == SLOT_DEPTH else LEVEL_MASK,
                )
            except OSError as error:
                os.close(directory)
                self._cannot_watch(repo, _reason(error))
                return None
            if depth == SLOT_DEPTH:
                return directory, depth, wd
            below = _open_level(directory, depth)
            if below is None:
                # Not there (or no plain directory): its creation raises an event.
                return directory, depth, wd
            # It appeared between the look and the watch: move the watch down.
            with contextlib.suppress(OSError):
                self._inotify.rm_watch(wd)
            os.close(directory)
            directory = below
            depth += 1

    def _scan(self, repo: _Repository, directory: int) -> None:
        """Look up slot-1 .. slot-<max> by name: bounded, whatever else the directory
        holds, and opening nothing (a listing would raise events of its own)."""
        devices = {_device(os.fstat(directory).st_dev)}
        mount = mount_device(pathwalk.descriptor_path(directory))
        if mount is not None:
            devices.add(mount)
        repo.devices = frozenset(devices)
        for name in slotmath.slot_names(self._max_slot_files):
            self._track(repo, directory, name)
        beyond = f"{SLOT_PREFIX}{self._max_slot_files + 1}"
        with contextlib.suppress(OSError):
            os.stat(beyond, dir_fd=directory, follow_symlinks=False)
            self._over_cap(repo)

    def _track(self, repo: _Repository, directory: int, name: str) -> None:
        try:
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except OSError:
            repo.files.pop(name, None)
            return  # gone already: nothing to hold
        if not stat.S_ISREG(info.st_mode):
            repo.files.pop(name, None)
            return  # flock works on any file, but slots are regular files
        path = repo.key.joinpath(*slotmath.SLOT_DIR_PARTS, name)
        devices = repo.devices | {_device(info.st_dev)}
        repo.files[name] = _SlotFile(path, info.st_ino, devices)

    def _over_cap(self, repo: _Repository) -> None:
        if not repo.over_cap:
            repo.over_cap = True
            self._emit(
                events.SlotsPastCap(repository=str(repo.key), max_slot_files=self._max_slot_files)
            )

    def _cannot_watch(self, repo: _Repository, reason: str) -> None:
        repo.problem = reason
        user = _user_name() if reason == "permission denied" else None
        unwatchable = events.RepositoryUnwatchable(
            repository=str(repo.key), problem=reason, user=user
        )
        self._problem(str(repo.key), unwatchable)

    def _refused(self, path: Path, reason: str) -> None:
        self._problem(str(path), events.RepositoryRefused(repository=str(path), reason=reason))

    # -- probing ------------------------------------------------------------------------------

    def _probe(self) -> frozenset[HeldSlot]:
        if not any(repo.files for repo in self._repos.values()):
            return frozenset()
        try:
            locks = slotmath.parse_proc_locks(read_locks())
        except OSError as error:
            unreadable = events.SlotLocksUnreadable(path=str(PROC_LOCKS), error=str(error.strerror))
            self._problem(str(PROC_LOCKS), unreadable)
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

    def _problem(self, key: str, event: events.BaseEvent) -> None:
        if self._problems.get(key) == event:
            return
        self._problems[key] = event
        self._emit(event)

    def _recovered(self, repo: _Repository) -> None:
        if self._problems.pop(str(repo.key), None) is not None:
            self._emit(events.RepositoryWatchedAgain(repository=str(repo.key)))

    def _save_registry(self) -> None:
        registered = [
            Registered(key, repo.uid) for key, repo in self._repos.items() if repo.registered
        ]
        save_registry(self._registry, registered, self._problem)


def resolve_run(worktree: str) -> Path | None:
    """The common dir of a test run's worktree (from its scope, which its user set)."""
    if worktree == "?" or not os.path.isabs(worktree):
        return None
    return gitdirs.resolve_common_dir(worktree)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _check_anchor(fd: int, uid: int) -> None:
    """That a passed descriptor is a common dir `uid` may have watched, still linked in
    its filesystem (removed, it would be watched for ever and raise nothing)."""
    info = os.fstat(fd)
    if not stat.S_ISDIR(info.st_mode):
        raise gitdirs.RepositoryRefused("is not a directory")
    if info.st_nlink == 0:
        raise gitdirs.RepositoryRefused("gone")
    gitdirs.check_common_dir(fd, uid)


def _open_level(directory: int, depth: int) -> int | None:
    """The level below `directory` (volute/, then test-slots/), if it is a directory."""
    try:
        return os.open(slotmath.SLOT_DIR_PARTS[depth], pathwalk.DIRECTORY_FLAGS, dir_fd=directory)
    except OSError:
        return None


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError):
        if error.errno == errno.EACCES:
            return "permission denied"
        return (error.strerror or str(error)).lower()
    return str(error)


def _device(st_dev: int) -> Device:
    return (os.major(st_dev), os.minor(st_dev))


def _user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def _pending(fd: int) -> int:
    buffer = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buffer)
    return int.from_bytes(buffer, sys.byteorder)
