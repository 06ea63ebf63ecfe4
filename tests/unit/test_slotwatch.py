"""The gate's slot watch on real files, real flock locks, real inotify and real git.

No systemd here: held-ness comes from /proc/locks, wake-ups from inotify, so a process of
our own (or a child) holding a slot is all a test needs.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from inotify_simple import INotify, flags

from volutectl import events
from volutectl.core import slotmath
from volutectl.slots import gitdirs, proclocks, slotfiles
from volutectl.slots import watch as slotwatch
from volutectl.slots.testrun import register_with_gate
from volutectl.slots.watch import HeldSlot, SlotWatch

F_OFD_GETLK = 36  # linux/fcntl.h; Python's fcntl module does not name it before 3.13
FLOCK_STRUCT = "hhqqi4x"  # struct flock on 64-bit Linux: type, whence, start, len, pid


E = TypeVar("E", bound=events.BaseEvent)


class Log:
    """The events a watch emits, in order."""

    def __init__(self) -> None:
        self.events: list[events.BaseEvent] = []

    def __call__(self, event: events.BaseEvent) -> None:
        self.events.append(event)

    def of(self, kind: type[E]) -> list[E]:
        return [event for event in self.events if isinstance(event, kind)]

    def about(self, repository: Path) -> list[events.BaseEvent]:
        """The events whose VOLUTE_REPOSITORY is `repository`."""
        return [e for e in self.events if e.journal_fields().get("repository") == str(repository)]


def git(*args: str, cwd: Path) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@example.org", "-c", "user.name=t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
    )


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A checkout with one commit; its git common dir is repo/.git."""
    checkout = tmp_path / "repo"
    checkout.mkdir()
    git("init", "-q", cwd=checkout)
    git("commit", "-q", "--allow-empty", "-m", "i", cwd=checkout)
    return checkout


def make_watch(repositories: list[Path], tmp_path: Path, log: Log) -> SlotWatch:
    return SlotWatch(repositories, tmp_path / "state" / "repositories.json", log)


def pump(watch: SlotWatch, until: Callable[[], bool], timeout: float = 5.0) -> int:
    """Serve the watch like the gate's loop does until `until()`; how many changes."""
    changes = 0
    deadline = time.monotonic() + timeout
    while not until():
        left = deadline - time.monotonic()
        assert left > 0, "timed out"
        ready, _, _ = select.select([watch.fileno()], [], [], left)
        if ready and watch.on_ready():
            changes += 1
    return changes


def seen(watch: SlotWatch) -> list[str]:
    """The held slots as of the watch's last probe (held() would probe afresh, and so
    could not tell whether an event woke the watch)."""
    return sorted(held.slot.name for held in watch._held)


def readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def hold_in_child(common_dir: Path, cap: int) -> subprocess.Popen[str]:
    """A separate process that takes a slot (through the real acquire_slot) and holds it
    until its stdin closes; it prints the slot path once held."""
    code = (
        "import sys; from volutectl.slots import slotfiles\n"
        f"slot = slotfiles.acquire_slot({str(common_dir)!r}, {cap})\n"
        "print(slot.path, flush=True); sys.stdin.read(); slot.release()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )


# -- the choice of probe ------------------------------------------------------------------


def test_ofd_getlk_does_not_see_a_flock_but_proc_locks_does(tmp_path: Path) -> None:
    """Why the gate reads /proc/locks: record-lock queries are blind to flock locks."""
    path = tmp_path / "slot-1"
    holder = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    prober = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        query = struct.pack(FLOCK_STRUCT, fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)
        answer = struct.unpack(FLOCK_STRUCT, fcntl.fcntl(prober, F_OFD_GETLK, query))
        assert answer[0] == fcntl.F_UNLCK  # "no conflicting lock": wrong for us
        info = os.stat(path)
        locks = slotmath.parse_proc_locks(Path("/proc/locks").read_text())
        assert (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino) in locks
        # and the flock really is exclusive against a second description:
        with pytest.raises(BlockingIOError):
            fcntl.flock(prober, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(holder)
        os.close(prober)


def test_parse_proc_locks_keeps_granted_flocks_only() -> None:
    text = (
        "1: POSIX  ADVISORY  WRITE 700 08:02:99 0 EOF\n"
        "2: FLOCK  ADVISORY  WRITE 4242 fe:00:5309070 0 EOF\n"
        "2: -> FLOCK  ADVISORY  WRITE 4243 fe:00:5309070 0 EOF\n"
        "3: FLOCK  ADVISORY  READ 17 00:6d:51 0 EOF\n"
        "4: OFDLCK ADVISORY  READ -1 00:6d:52 0 EOF\n"
        "5: -> FLOCK  ADVISORY  WRITE 18 00:6d:77 0 EOF\n"
        "garbage\n"
        "6: FLOCK  ADVISORY  WRITE 1 zz:00:1 0 EOF\n"
    )
    assert slotmath.parse_proc_locks(text) == {(0xFE, 0, 5309070), (0, 0x6D, 51)}


def test_parse_mount_device_takes_the_longest_then_the_topmost_mount() -> None:
    mountinfo = (
        "22 1 0:109 / / rw - overlay overlay rw\n"
        "30 22 254:0 /work /work rw - ext4 /dev/vda rw\n"
        "31 22 254:1 / /srv rw - ext4 /dev/vdb rw\n"
        "32 31 254:2 / /srv rw - ext4 /dev/vdc rw\n"
        "33 22 254:3 / /mnt/with\\040space rw - ext4 /dev/vdd rw\n"
    )
    assert slotmath.parse_mount_device(mountinfo, "/work/main/.git") == (254, 0)
    assert slotmath.parse_mount_device(mountinfo, "/workshop") == (0, 109)
    assert slotmath.parse_mount_device(mountinfo, "/srv/repo") == (254, 2)  # on top
    assert slotmath.parse_mount_device(mountinfo, "/mnt/with space/r") == (254, 3)
    assert slotmath.parse_mount_device("", "/x") is None


# -- the watch -----------------------------------------------------------------------------


def test_no_repository_at_all(tmp_path: Path) -> None:
    log = Log()
    watch = make_watch([], tmp_path, log)
    try:
        assert watch.held() == [] and watch.repositories() == []
        assert not readable(watch.fileno(), 0.05)
        assert watch.on_ready() is False
        assert watch.status([]) == []
        assert log.events == []
    finally:
        watch.close()


def test_sees_a_slot_taken_and_freed_without_holding_it(repo: Path, tmp_path: Path) -> None:
    common = (repo / ".git").resolve()
    watch = make_watch([repo], tmp_path, Log())
    try:
        assert watch.repositories() == [common]
        slot = slotfiles.acquire_slot(common, 2)
        assert slot is not None
        # The directories appeared after the watch began: it follows them down.
        assert pump(watch, lambda: seen(watch) == ["slot-1"]) >= 1
        expected = [HeldSlot(common, common / "volute" / "test-slots" / "slot-1")]
        assert watch.held() == expected
        state = watch.summary()[0]
        assert (state.slots, state.held, state.watching) == (2, 1, True)
        # Another process can still take the other slot: the gate took nothing.
        other = hold_in_child(common, 2)
        assert other.stdout is not None
        assert other.stdout.readline().strip().endswith("slot-2")
        assert pump(watch, lambda: seen(watch) == ["slot-1", "slot-2"]) >= 1
        slot.release()
        assert pump(watch, lambda: seen(watch) == ["slot-2"]) >= 1
        other.communicate("")
        assert pump(watch, lambda: seen(watch) == []) >= 1
    finally:
        watch.close()


def test_a_waiter_taking_a_freed_slot_is_seen(repo: Path, tmp_path: Path) -> None:
    """Taking a flock raises no event; acquire_slot's announce makes the handoff visible."""
    common = (repo / ".git").resolve()
    first = slotfiles.acquire_slot(common, 1)
    assert first is not None
    watch = make_watch([common], tmp_path, Log())
    try:
        assert len(watch.held()) == 1
        waiter = hold_in_child(common, 1)
        time.sleep(0.3)  # let it open the slot and start waiting
        while readable(watch.fileno(), 0):
            watch.on_ready()
        first.release()
        assert waiter.stdout is not None
        assert waiter.stdout.readline().strip().endswith("slot-1")
        # The release and the retake may fold into one batch of events, but the watch
        # must end up seeing the slot held by the waiter, from events alone.
        time.sleep(0.05)
        changed_any = False
        while readable(watch.fileno(), 0.2):
            changed_any |= watch.on_ready()
        assert seen(watch) == ["slot-1"], changed_any
        waiter.communicate("")
        assert pump(watch, lambda: seen(watch) == []) >= 1
    finally:
        watch.close()


def test_the_watch_never_touches_a_slot_file(repo: Path, tmp_path: Path) -> None:
    """No open, no close, no event: waiters are never woken by the gate's probing."""
    common = (repo / ".git").resolve()
    slot = slotfiles.acquire_slot(common, 3)
    assert slot is not None
    spy = INotify()
    slot_dir = slotfiles.slot_directory(common)
    for path in slot_dir.iterdir():
        spy.add_watch(path, flags.OPEN | flags.CLOSE_WRITE | flags.CLOSE_NOWRITE | flags.ACCESS)
    watch = make_watch([repo], tmp_path, Log())
    try:
        for _ in range(20):
            watch.held()
            watch.on_ready()
            watch.summary()
        assert spy.read(timeout=100) == []
        # And nothing the watch does wakes the watch itself.
        assert not readable(watch.fileno(), 0.2)
    finally:
        watch.close()
        spy.close()
        slot.release()


def test_missing_repository_is_logged_once(tmp_path: Path) -> None:
    log = Log()
    ghost = tmp_path / "ghost"
    watch = make_watch([ghost], tmp_path, log)
    try:
        for _ in range(3):
            watch.on_ready()
            watch.held()
        assert len(log.about(ghost)) == 1
        assert log.events[0].level == "warning"
        assert watch.held() == []
    finally:
        watch.close()


def test_a_repository_that_disappears_is_logged_once_and_ignored(
    repo: Path, tmp_path: Path
) -> None:
    common = (repo / ".git").resolve()
    holder = hold_in_child(common, 1)
    assert holder.stdout is not None
    holder.stdout.readline()
    log = Log()
    watch = make_watch([repo], tmp_path, log)
    try:
        assert len(watch.held()) == 1
        holder.communicate("")
        shutil.rmtree(repo)
        pump(watch, lambda: any(e.problem == "gone" for e in log.of(events.RepositoryUnwatchable)))
        for _ in range(3):
            while readable(watch.fileno(), 0.05):
                watch.on_ready()
        assert watch.held() == []
        assert len(log.about(common)) == 1, log.events
        assert watch.summary()[0].watching is False
        # It comes back (re-cloned); its next run registers it, and it is watched again.
        repo.mkdir()
        git("init", "-q", cwd=repo)
        assert watch.register(repo) is True
        assert watch.summary()[0].watching is True
        assert [e.repository for e in log.of(events.RepositoryWatchedAgain)] == [str(common)]
        assert watch.register(Path("relative/repo")) is False
    finally:
        watch.close()


def test_register_persists_and_a_new_watch_finds_runs_in_flight(repo: Path, tmp_path: Path) -> None:
    common = (repo / ".git").resolve()
    log = Log()
    watch = make_watch([], tmp_path, log)
    try:
        assert watch.register(repo) is True
        assert watch.register(common) is False  # the same repository
        assert watch.register(tmp_path / "nowhere") is False
        assert watch.repositories() == [common]
    finally:
        watch.close()
    registry = json.loads((tmp_path / "state" / "repositories.json").read_text())
    assert registry == {"version": 2, "repositories": [{"path": str(common), "uid": 0}]}
    holder = hold_in_child(common, 1)  # a run already in flight when the gate starts
    assert holder.stdout is not None
    holder.stdout.readline()
    restarted = make_watch([], tmp_path, Log())
    try:
        assert restarted.repositories() == [common]
        assert [h.slot.name for h in restarted.held()] == ["slot-1"]
    finally:
        restarted.close()
        holder.communicate("")


def test_a_registered_repository_that_is_gone_is_forgotten(repo: Path, tmp_path: Path) -> None:
    registry = tmp_path / "state" / "repositories.json"
    registry.parent.mkdir()
    registry.write_text(json.dumps({"version": 1, "repositories": [str(tmp_path / "gone")]}))
    log = Log()
    watch = make_watch([], tmp_path, log)
    watch.close()
    assert [e.repository for e in log.of(events.RepositoryForgotten)] == [str(tmp_path / "gone")]
    assert json.loads(registry.read_text())["repositories"] == []
    registry.write_text("{not json")
    log = Log()
    make_watch([repo], tmp_path, log).close()
    assert [e.path for e in log.of(events.RegistryUnreadable)] == [str(registry)]


def test_status_groups_runs_by_repository(repo: Path, tmp_path: Path) -> None:
    common = (repo / ".git").resolve()
    git("worktree", "add", "-q", str(tmp_path / "wt1"), cwd=repo)
    other = tmp_path / "other"
    other.mkdir()
    git("init", "-q", cwd=other)
    slot = slotfiles.acquire_slot(common, 2)
    assert slot is not None
    watch = make_watch([repo], tmp_path, Log())
    try:
        runs = [
            slotmath.InFlight("volute-test-wt1-10.scope", str(tmp_path / "wt1"), "pytest", 3.25),
            slotmath.InFlight("volute-test-other-11.scope", str(other), "make", None),
        ]
        expected: list[dict[str, object]] = [
            {
                "repository": str(common),
                "slots_held": 1,
                "slots": 2,
                "problem": None,
                "runs": [
                    {
                        "unit": "volute-test-wt1-10.scope",
                        "worktree": str(tmp_path / "wt1"),
                        "command": "pytest",
                        "running_s": 3.25,
                    }
                ],
            },
            {
                "repository": str((other / ".git").resolve()),
                "slots_held": None,
                "slots": None,
                "problem": None,
                "runs": [
                    {
                        "unit": "volute-test-other-11.scope",
                        "worktree": str(other),
                        "command": "make",
                        "running_s": None,
                    }
                ],
            },
        ]
        assert watch.status(runs) == sorted(expected, key=lambda entry: str(entry["repository"]))
    finally:
        watch.close()
        slot.release()


# -- registration from `volutectl test` ----------------------------------------------------


def test_register_with_gate_sends_one_request_and_never_waits(tmp_path: Path) -> None:
    path = str(tmp_path / "gate.sock")
    started = time.monotonic()
    register_with_gate(path, tmp_path)  # no gate: silently nothing
    assert time.monotonic() - started < 0.1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    received: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            received.append(conn.makefile("rb").readline())

    thread = threading.Thread(target=serve)
    thread.start()
    started = time.monotonic()
    register_with_gate(path, tmp_path / "repo" / ".git")  # the gate never answers
    assert time.monotonic() - started < 0.1
    thread.join(5)
    listener.close()
    request = json.loads(received[0])
    assert request == {"v": 1, "op": "register_repo", "path": str(tmp_path / "repo" / ".git")}


def test_taking_a_flock_raises_no_event_so_the_taker_announces_it(
    repo: Path, tmp_path: Path
) -> None:
    common = (repo / ".git").resolve()
    slotfiles.acquire_slot(common, 1).release()  # type: ignore[union-attr]  # make slot-1
    path = slotfiles.slot_directory(common) / "slot-1"
    fd = os.open(path, os.O_RDONLY)  # a waiter's descriptor, opened before the watch
    watch = make_watch([repo], tmp_path, Log())
    try:
        assert seen(watch) == []
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a waiter does on wake-up
        assert not readable(watch.fileno(), 0.2)  # the kernel says nothing
        slotfiles.announce_held(path)
        assert readable(watch.fileno(), 1.0)
        assert watch.on_ready() is True
        assert seen(watch) == ["slot-1"]
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # still ours: raises if it is not
    finally:
        os.close(fd)
        watch.close()


# -- bounds and whose repository (issue 18) -----------------------------------------------


def inotify_watches(fd: int) -> int:
    """How many watches an inotify descriptor of ours holds, as the kernel counts them."""
    text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    return sum(1 for line in text.splitlines() if line.startswith("inotify wd:"))


def test_one_watch_per_repository_and_slot_files_past_the_cap_cost_nothing(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 8c: 145,000 slot files took one watch each. Now one watch per directory,
    and only slot-1 .. slot-<max> are looked at."""
    common = (repo / ".git").resolve()
    slot = slotfiles.acquire_slot(common, 2)
    assert slot is not None
    directory = slotfiles.slot_directory(common)
    for index in range(3, 3001):
        (directory / f"slot-{index}").touch()
    log = Log()
    started = time.monotonic()
    watch = SlotWatch([repo], tmp_path / "state" / "repositories.json", log, max_slot_files=64)
    try:
        assert time.monotonic() - started < 1.0
        assert inotify_watches(watch.fileno()) == 1
        state = watch.summary()[0]
        assert (state.slots, state.held, state.watching) == (64, 1, True)
        assert state.problem == "slot files past slot-64 are not counted"
        assert [e.max_slot_files for e in log.of(events.SlotsPastCap)] == [64]
        readings: list[int] = []

        def counted_read() -> str:
            readings.append(1)
            return proclocks.read_locks()

        monkeypatch.setattr(slotwatch, "read_locks", counted_read)
        # Files past the cap, and other names, wake the gate but cost no probe.
        for name in ("slot-65", "slot-2999", "notes", "slot-007"):
            os.close(os.open(directory / name, os.O_RDONLY | os.O_CREAT, 0o600))
        os.listdir(directory)  # an event with no name: someone listing the directory
        assert readable(watch.fileno(), 1.0)
        assert watch.on_ready() is False
        assert readings == []
        assert [e.max_slot_files for e in log.of(events.SlotsPastCap)] == [64]  # said once
        # A slot within the cap is seen as before.
        other = hold_in_child(common, 2)
        assert other.stdout is not None
        assert other.stdout.readline().strip().endswith("slot-2")
        assert pump(watch, lambda: seen(watch) == ["slot-1", "slot-2"]) >= 1
        assert readings
        other.communicate("")
        assert pump(watch, lambda: seen(watch) == ["slot-1"]) >= 1
        assert inotify_watches(watch.fileno()) == 1
    finally:
        watch.close()
        slot.release()


def fake_git_dir(path: Path, owner: int) -> Path:
    for name in ("objects", "refs"):
        (path / name).mkdir(parents=True)
    (path / "HEAD").write_text("ref: refs/heads/main\n")
    for part in (path, path / "objects", path / "refs", path / "HEAD"):
        os.chown(part, owner, owner)
    return path


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to other users")


@needs_root
def test_a_commondir_to_another_users_repository_is_neither_watched_nor_kept(
    repo: Path, tmp_path: Path
) -> None:
    """Finding 7: the owner was checked on the path given, then commondir followed."""
    victim = (repo / ".git").resolve()
    os.chown(victim, 65533, 65533)
    fake = fake_git_dir(tmp_path / "fake.git", 65534)
    (fake / "commondir").write_text(f"{victim}\n")
    log = Log()
    watch = make_watch([], tmp_path, log)
    try:
        assert watch.register(fake, 65534) is False
        assert watch.repositories() == []
        assert [e.repository for e in log.of(events.RepositoryRefused)] == [str(fake)]
        assert watch.register(fake, 65533) is True  # its owner may
        assert watch.repositories() == [victim]
    finally:
        watch.close()
    registry = json.loads((tmp_path / "state" / "repositories.json").read_text())
    assert registry["repositories"] == [{"path": str(victim), "uid": 65533}]
    # The repository changes hands: a restarted gate forgets it.
    os.chown(victim, 65532, 65532)
    log = Log()
    restarted = make_watch([], tmp_path, log)
    try:
        assert restarted.repositories() == []
        assert [e.repository for e in log.of(events.RepositoryForgotten)] == [str(victim)]
    finally:
        restarted.close()


@needs_root
def test_the_watched_inode_is_the_checked_one(repo: Path, tmp_path: Path) -> None:
    """A repository swapped for another user's after the check is not watched: the watch
    is on the descriptor checked, and a re-attach checks again."""
    common = (repo / ".git").resolve()
    os.chown(common, 65534, 65534)
    slotfiles.acquire_slot(common, 1).release()  # type: ignore[union-attr]
    log = Log()
    watch = make_watch([], tmp_path, log)
    try:
        assert watch.register(common, 65534) is True
        assert watch.summary()[0].watching is True
        moved = tmp_path / "moved.git"
        common.rename(moved)
        fake = fake_git_dir(common, 65533)  # somebody else's, in its place
        holder = hold_in_child(fake, 1)
        assert holder.stdout is not None
        holder.stdout.readline()
        time.sleep(0.2)
        assert watch.held() == []  # the other user's slot is not the one watched
        # The watched directory changes; looking it up by its path finds another inode:
        # it is attached afresh, and checked again.
        (slotfiles.slot_directory(moved) / "slot-2").touch()
        pump(watch, lambda: not watch.summary()[0].watching)
        assert "belongs to uid 65533" in str(watch.summary()[0].problem)
        assert watch.held() == []
        holder.communicate("")
    finally:
        watch.close()


def test_registrations_are_bounded_per_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slotwatch, "MAX_REPOSITORIES_PER_USER", 2)
    repositories = []
    for index in range(4):
        checkout = tmp_path / f"r{index}"
        checkout.mkdir()
        git("init", "-q", cwd=checkout)
        repositories.append(checkout)
    uid = os.getuid() or 65534
    if os.getuid() == 0:
        for checkout in repositories:
            os.chown(checkout / ".git", uid, uid)
    log = Log()
    watch = make_watch([], tmp_path, log)
    try:
        assert watch.register(repositories[0], uid) is True
        assert watch.register(repositories[1], uid) is True
        with pytest.raises(slotwatch.RepositoryLimit, match=f"uid {uid} has 2 repositories"):
            watch.register(repositories[2], uid)
        assert watch.register(repositories[1], uid) is False  # known: no new place taken
        assert watch.register(repositories[3], 0) is True  # root has no bound of its own
        assert len(watch.repositories()) == 3
    finally:
        watch.close()


def test_a_version_1_registry_is_read_with_its_owner(repo: Path, tmp_path: Path) -> None:
    common = (repo / ".git").resolve()
    registry = tmp_path / "state" / "repositories.json"
    registry.parent.mkdir()
    registry.write_text(json.dumps({"version": 1, "repositories": [str(common)]}))
    watch = make_watch([], tmp_path, Log())
    try:
        assert watch.repositories() == [common]
        assert watch.summary()[0].watching is True
    finally:
        watch.close()


def test_a_repository_the_gate_may_not_enter_is_listed_with_why(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run unprivileged (after the split), the gate cannot enter a private home. The
    registration is not dropped in silence, nor is it a crash: status and the log say
    "permission denied" (the system tier does this for real, as an unprivileged user)."""

    def refuse(path: object, **kwargs: object) -> int:
        raise PermissionError(13, "Permission denied", str(path))

    log = Log()
    watch = make_watch([], tmp_path, log)
    try:
        monkeypatch.setattr(gitdirs, "open_common_dir", refuse)
        assert watch.register(repo, 1000) is False
        assert watch.register(repo, 1000) is False  # said once
        [entry] = watch.status([])
        assert entry == {
            "repository": str(repo),
            "slots_held": None,
            "slots": None,
            "problem": "permission denied",
            "runs": [],
        }
        assert log.events == [
            events.RepositoryUnwatchable(
                repository=str(repo), problem="permission denied", user=slotwatch._user_name()
            )
        ]
        monkeypatch.undo()
        assert watch.register(repo, 0) is True  # it may look now: watched
        [entry] = watch.status([])
        assert (entry["repository"], entry["slots_held"], entry["problem"]) == (
            str((repo / ".git").resolve()),
            0,
            None,
        )
    finally:
        watch.close()
    assert "uid" in (tmp_path / "state" / "repositories.json").read_text()
