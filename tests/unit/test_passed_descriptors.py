"""Issue 29, item 6: a repository registered by descriptor (SCM_RIGHTS), for the gate that
may not open its path (a private home), and every other descriptor a client sends closed.

The unit tests run as root, who may open any path: the gate's lack of permission is
made by refusing `gitdirs.open_common_dir` and the first path walk (as the unprivileged
gate is refused); the system tier (tests/system/test_private_homes.py) does it for real.
"""

from __future__ import annotations

import array
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.gate_harness import Harness
from tests.unit.test_slotwatch import Log, git, hold_in_child, make_watch, pump, seen
from volutectl import events
from volutectl.core import slotmath
from volutectl.gate import server
from volutectl.kernel import pathwalk
from volutectl.slots import gitdirs
from volutectl.slots import watch as slotwatch
from volutectl.slots.registry import MAX_REPOSITORIES_PER_USER
from volutectl.slots.watch import FdStore, SlotWatch


def open_fds() -> int:
    return len(fd_links())


def fd_links() -> dict[int, str]:
    """This process's descriptors but the gate's disk probe's (opened now and then)."""
    links = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            links[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # listdir's own
    return {fd: link for fd, link in links.items() if not link.endswith("adaptive-probe")}


def o_path(path: Path) -> int:
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    checkout = tmp_path / "repo"
    checkout.mkdir()
    git("init", "-q", cwd=checkout)
    git("commit", "-q", "--allow-empty", "-m", "i", cwd=checkout)
    return checkout


class Store:
    """A recording stand-in for systemd's fd store: what was kept and forgotten."""

    def __init__(self) -> None:
        self.kept: list[str] = []
        self.forgotten: list[str] = []

    def fd_store(self) -> FdStore:
        return FdStore(keep=lambda name, fd: self.kept.append(name), forget=self.forgotten.append)


def refuse_paths_under(monkeypatch: pytest.MonkeyPatch, top: Path) -> None:
    """As the unprivileged gate: no path under `top` opens (a 0700 home); a descriptor
    the gate holds still leads below it."""
    walk, common = pathwalk.open_directory, gitdirs.open_common_dir

    def refused(path: Any) -> bool:
        return str(path).startswith(str(top))

    def open_directory(path: Any, **kwargs: Any) -> int:
        if kwargs.get("relative_to") is None and refused(path):
            raise PermissionError(13, "Permission denied", str(path))
        return walk(path, **kwargs)

    def open_common_dir(path: Any, **kwargs: Any) -> int:
        if refused(path):
            raise PermissionError(13, "Permission denied", str(path))
        return common(path, **kwargs)

    monkeypatch.setattr(pathwalk, "open_directory", open_directory)
    monkeypatch.setattr(gitdirs, "open_common_dir", open_common_dir)


# -- the watch ----------------------------------------------------------------------------


def test_a_repository_the_gate_may_not_open_is_watched_through_its_descriptor(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = repo / ".git"
    store, log = Store(), Log()
    refuse_paths_under(monkeypatch, repo)
    watch = SlotWatch([], tmp_path / "state" / "repositories.json", log, fd_store=store.fd_store())
    holder = None
    try:
        assert watch.register(common, 0) is False  # no descriptor: unwatched, as before
        assert watch.summary()[0].problem == "permission denied"
        before = open_fds()
        passed = o_path(common)
        assert watch.register(common, os.getuid(), passed) is True
        name = slotwatch.anchor_name(os.getuid(), passed)
        os.close(passed)
        assert open_fds() == before + 1  # the anchor, and nothing else
        [state] = watch.summary()
        assert (state.repository, state.watching, state.problem) == (common, True, None)
        assert store.kept == [name]
        # Registered again (every run does): nothing more is kept.
        for _ in range(3):
            again = o_path(common)
            assert watch.register(common, os.getuid(), again) is False
            os.close(again)
        assert open_fds() == before + 1 and len(store.kept) == 1
        # The slot directory is made after the registration, and a slot taken is seen.
        holder = hold_in_child(common, 1)
        assert holder.stdout is not None
        holder.stdout.readline()
        pump(watch, lambda: seen(watch) == ["slot-1"])
        # A run in that checkout is listed under it, though its path does not open.
        run = slotmath.InFlight("volute-test-1.scope", str(repo), "sleep 60", 1.0)
        [entry] = watch.status([run])
        assert (entry["repository"], entry["slots_held"]) == (str(common), 1)
        assert [listed["unit"] for listed in entry["runs"]] == ["volute-test-1.scope"]
        assert json.loads((tmp_path / "state" / "repositories.json").read_text())[
            "repositories"
        ] == [{"path": str(common), "uid": os.getuid()}]
    finally:
        if holder is not None:
            holder.communicate("")
        watch.close()
    assert store.forgotten == []  # closing the gate keeps its anchors in the store


def test_an_anchor_comes_back_from_the_fd_store_and_goes_with_its_repository(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = repo / ".git"
    refuse_paths_under(monkeypatch, repo)
    store, log = Store(), Log()
    holder = hold_in_child(common, 1)
    try:
        assert holder.stdout is not None
        holder.stdout.readline()
        stored = [("", o_path(common)), ("volute-repo-x", o_path(common))]
        name = slotwatch.anchor_name(os.getuid(), stored[0][1])
        stored[0] = (name, stored[0][1])
        watch = SlotWatch(
            [],
            tmp_path / "state" / "repositories.json",
            log,
            anchors=stored,
            fd_store=store.fd_store(),
        )
        assert seen(watch) == ["slot-1"]  # held at once, with no registration
        assert store.forgotten == ["volute-repo-x"]  # no anchor's name: closed, dropped
    finally:
        holder.communicate("")
    pump(watch, lambda: seen(watch) == [])
    before = open_fds()
    shutil.rmtree(repo)
    pump(watch, lambda: name in store.forgotten)
    assert open_fds() == before - 1  # the anchor was let go with its repository
    watch.close()


def test_another_users_directory_or_a_file_or_another_inode_is_refused(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = repo / ".git"
    other = tmp_path / "other"
    other.mkdir()
    git("init", "-q", cwd=other)
    store, log = Store(), Log()
    watch = make_watch([], tmp_path, log)
    try:
        # The path opens: the descriptor must be its common dir.
        passed = o_path(other / ".git")
        assert watch.register(common, 0, passed) is False
        os.close(passed)
        assert "is not the directory its descriptor is" in str(log.events[-1])
        refuse_paths_under(monkeypatch, tmp_path)
        for path in (repo, common):
            os.chown(path, 4321, 4321)
        before = open_fds()
        for fd in (o_path(common), os.open(common / "HEAD", os.O_RDONLY)):
            assert watch.register(common, 1000, fd) is False
            os.close(fd)
        assert open_fds() == before
        reasons = [str(event) for event in log.of(events.RepositoryRefused)]
        assert any("belongs to uid 4321" in reason for reason in reasons), reasons
        assert any("is not a directory" in reason for reason in reasons), reasons
        assert store.kept == [] and all(state.watching is False for state in watch.summary())
    finally:
        watch.close()


# -- the server ---------------------------------------------------------------------------


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def send_with_fds(sock: socket.socket, line: bytes, fds: list[int]) -> None:
    sock.sendmsg([line], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def test_descriptors_with_any_other_request_are_closed(harness: Harness, repo: Path) -> None:
    fd = o_path(repo)
    peer = harness.connect()
    assert peer.request({"op": "ping"})["ok"] is True
    links = fd_links()
    before = len(links)
    for line in (b'{"v":1,"op":"ping"}\n', b'{"v":1,"op":"status"}\n', b"not json\n"):
        send_with_fds(peer.sock, line, [fd] * 200)  # far past what one read takes
        assert "ok" in peer.reply()
        now = fd_links()
        assert open_fds() == before, {k: v for k, v in now.items() if links.get(k) != v}
    # With no complete line, or the end of the stream: closed at once too.
    send_with_fds(peer.sock, b'{"v":1,', [fd])
    clients = harness.gate.server.clients.values()
    harness.pump(lambda: any(c.buffer.endswith(b'{"v":1,') for c in clients))  # read
    assert open_fds() == before
    peer.send(b'"op":"ping"}\n')
    assert peer.reply()["ok"] is True
    # A register_repo whose path the gate may open keeps nothing either.
    line = json.dumps({"v": 1, "op": "register_repo", "path": str(repo / ".git")}).encode()
    send_with_fds(peer.sock, line + b"\n", [fd, fd])  # the checkout's, not its .git's
    reply = peer.reply()
    assert (reply["ok"], reply["code"]) == (False, 65), reply
    assert "is not the directory whose descriptor came with it" in reply["error"]
    common = o_path(repo / ".git")
    send_with_fds(peer.sock, line + b"\n", [common])
    assert peer.reply()["ok"] is True
    os.close(common)
    assert open_fds() == before
    # Closed with a descriptor still unread: dropped with the client.
    send_with_fds(peer.sock, b'{"v":1,"op":"ping"}\n', [fd])
    peer.close()
    harness.pump(lambda: not harness.gate.server.clients)  # dropped
    assert open_fds() == before - 2  # its socket, and the gate's end of it
    os.close(fd)
    assert server.MAX_PASSED_FDS == 65  # a lease's 64 pidfds, and one to find a count wrong


def test_a_register_line_keeps_its_descriptor_where_the_path_cannot_open(
    harness: Harness, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_paths_under(monkeypatch, repo)
    common = repo / ".git"
    peer = harness.connect()
    line = json.dumps({"v": 1, "op": "register_repo", "path": str(common)}).encode() + b"\n"
    peer.send(line)
    reply = peer.reply()
    assert (reply["ok"], reply["code"]) == (False, 77), reply
    links = fd_links()
    before = len(links)
    fd = o_path(common)
    # Two lines in one read, the descriptor with the second: the first keeps nothing.
    ping = b'{"v":1,"op":"ping"}\n'
    send_with_fds(peer.sock, ping + line, [fd])
    os.close(fd)
    assert peer.reply()["ok"] is True
    assert peer.reply() == {"v": 1, "ok": True, "new": True}
    now = fd_links()
    assert len(now) == before + 1, {k: v for k, v in now.items() if links.get(k) != v}
    [state] = harness.gate.state.slots.summary()
    assert (state.repository, state.watching) == (common, True)


# -- systemd's side -----------------------------------------------------------------------


CHILD = """
import json, os, socket
from volutectl.slots import watch
from volutectl.systemd import activation
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind("\\0volute-test-%d" % os.getpid())
listener.listen(1)
anchor = os.open("/", os.O_PATH | os.O_DIRECTORY)
for fd, target in ((listener.detach(), 3), (anchor, 4)):
    if fd != target:
        os.dup2(fd, target)
        os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="2",
                  LISTEN_FDNAMES="volute-gate.socket:volute-repo-1000-1-2")
sock, stored = activation.inherited(watch.ANCHOR_PREFIX)
print(json.dumps([sock.fileno(), stored, os.readlink("/proc/self/fd/4"),
                  [name in os.environ for name in activation.VARIABLES]]))
"""


def test_the_fd_store_comes_back_named_apart_from_the_socket() -> None:
    """LISTEN_FDNAMES tells the socket from the anchors; the order is systemd's."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == [3, [["volute-repo-1000-1-2", 4]], "/", [False, False, False]]
    assert slotwatch.anchor_uid("volute-repo-1000-1-2") == 1000
    assert slotwatch.anchor_uid("volute-gate.socket") is None
    assert slotwatch.anchor_uid("volute-repo-x-1-2") is None


def test_registrations_by_descriptor_keep_the_bound_per_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 33rd repository of a member is refused (75 from the handler), and keeps no
    descriptor: a member holds at most 32 of the gate's."""
    homes = tmp_path / "home"
    commons = []
    for number in range(MAX_REPOSITORIES_PER_USER + 1):
        common = homes / f"r{number}" / ".git"
        for part in ("objects", "refs"):
            (common / part).mkdir(parents=True)
        (common / "HEAD").write_text("ref: refs/heads/main\n")
        os.chown(common, 1000, 1000)
        commons.append(common)
    refuse_paths_under(monkeypatch, homes)
    store = Store()
    watch = SlotWatch(
        [], tmp_path / "state" / "repositories.json", Log(), fd_store=store.fd_store()
    )
    try:
        before = open_fds()
        for common in commons[:-1]:
            fd = o_path(common)
            assert watch.register(common, 1000, fd) is True
            os.close(fd)
        fd = o_path(commons[-1])
        with pytest.raises(slotwatch.RepositoryLimit):
            watch.register(commons[-1], 1000, fd)
        os.close(fd)
        assert open_fds() == before + MAX_REPOSITORIES_PER_USER
        assert len(store.kept) == MAX_REPOSITORIES_PER_USER
    finally:
        watch.close()


def test_an_acquires_pidfds_are_bounded_and_every_one_is_closed(harness: Harness) -> None:
    """An acquire's pidfds (issue 31): at most 64 per lease; a read brings at most 65,
    so that more than a lease may have is a wrong count, refused naming `pids`, never
    cut to fit; whatever is refused or left over is closed."""
    child = subprocess.Popen(["sleep", "60"])
    pidfd = os.pidfd_open(child.pid)
    try:
        peer = harness.connect()
        assert peer.request({"op": "ping"})["ok"] is True
        before = open_fds()
        for sent, announced in ((65, 64), (100, 64), (3, 2), (1, 0)):
            line = json.dumps({"v": 1, "op": "acquire", "mind": "mimsy", "pids": announced})
            send_with_fds(peer.sock, line.encode() + b"\n", [pidfd] * sent)
            reply = peer.reply()
            assert (reply["ok"], reply["code"]) == (False, 65), (sent, reply)
            assert reply["error"].startswith("pids: "), (sent, reply)
            assert f"{announced} announced, " in reply["error"], (sent, reply)
            assert open_fds() == before, sent
        # 10,000 is not a count a lease may have at all.
        reply = peer.request({"op": "acquire", "mind": "mimsy", "pids": 10_000})
        assert (reply["ok"], reply["code"]) == (False, 65) and "pids" in reply["error"]
    finally:
        os.close(pidfd)
        child.kill()
        child.wait()
