"""What a mind's turn did to the root gate through its turn directory (issue 18, findings
1-5), done again here as that turn would, on real files, and what now stops it.

Run as root (as the unit tier runs here), the turn's side runs as `nobody` in a forked
child that dropped to it, holding only the descriptors a turn would have; run as
another user, both sides are that user, and the files' contents still show what root
would have followed.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from volutectl.kernel import dirfds
from volutectl.launcher import fork, turndir

ROOT = os.geteuid() == 0
MIND = pwd.getpwnam("nobody") if ROOT else pwd.getpwuid(os.getuid())


def mind_account() -> fork.Account:
    return fork.Account(MIND.pw_name, MIND.pw_uid, MIND.pw_gid, (), MIND.pw_dir)


def as_mind(attack: Callable[[], None]) -> None:
    """Run `attack` in a child that became the mind's user; an OSError it raises comes
    back as an OSError of the same errno, anything else as an AssertionError."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            if ROOT:
                os.setgroups([])
                os.setgid(MIND.pw_gid)
                os.setuid(MIND.pw_uid)
            attack()
        except OSError as error:
            code = min(error.errno or 1, 200)
        except BaseException:  # noqa: BLE001 - any other failure: told apart by its code
            code = 255
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 255:
        raise AssertionError("the attack failed otherwise than with an OSError")
    if code:
        raise OSError(code, os.strerror(code))


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A runtime directory on tmpfs, as /run is: where removal has its real cost (an
    ext4 rmdir can take milliseconds)."""
    where = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        yield where
    finally:
        # Not shutil.rmtree: a deep tree a failed test left would stop it (RecursionError).
        parent = os.open(where.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            dirfds.remove_tree(parent, where.name, dirfds.Budget(10_000_000, 600.0))
        finally:
            os.close(parent)


@pytest.fixture
def turn(run_dir: Path) -> fork.TurnDir:
    return fork.make_turn_dir(run_dir, 7, mind_account())


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of root's that no mind may change: /etc/passwd, here."""
    path = tmp_path / "etc" / "passwd"
    path.parent.mkdir()
    path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    return path


def unchanged(victim: Path) -> bool:
    found = victim.lstat()
    return (
        stat.S_ISREG(found.st_mode)
        and found.st_uid == os.geteuid()
        and victim.read_text() == "root:x:0:0:root:/root:/bin/bash\n"
    )


# -- finding 1: links planted where the gate writes ------------------------------------------


def test_links_planted_in_the_inbox_are_never_followed(turn: fork.TurnDir, victim: Path) -> None:
    inbox = os.open(turn.inbox, os.O_RDONLY | os.O_DIRECTORY)

    def plant() -> None:
        for delivery_id in range(1, 51):
            os.symlink(victim, f".{delivery_id}.tmp", dir_fd=inbox)
        os.symlink(victim, "2.json", dir_fd=inbox)

    try:
        as_mind(plant)
    finally:
        os.close(inbox)
    for delivery_id in (1, 2, 3):
        fork.offer(turn, delivery_id, b'{"id": %d}\n' % delivery_id, mind_account())
    assert unchanged(victim)
    for delivery_id in (1, 2, 3):
        offered = turn.inbox / f"{delivery_id}.json"
        found = offered.lstat()
        assert stat.S_ISREG(found.st_mode) and found.st_uid == MIND.pw_uid
        assert offered.read_bytes() == b'{"id": %d}\n' % delivery_id
    # The links the mind planted are still its own, and what it reads is just that.
    assert (turn.inbox / ".3.tmp").is_symlink()


def test_an_offer_the_inbox_refuses_is_not_taken(turn: fork.TurnDir) -> None:
    inbox = os.open(turn.inbox, os.O_RDONLY | os.O_DIRECTORY)
    try:
        as_mind(lambda: os.mkdir("4.json", dir_fd=inbox))  # a directory where it goes
    finally:
        os.close(inbox)
    with pytest.raises(IsADirectoryError):
        fork.offer(turn, 4, b"{}\n", mind_account())
    assert turn.not_taken([4]) == {4}  # so it goes to the session's next turn


# -- finding 2: the inbox or the offer record swapped for a link to a directory --------------


def test_the_turn_can_change_nothing_in_its_directory_but_its_inbox(
    turn: fork.TurnDir, tmp_path: Path
) -> None:
    directory = os.open(turn.path, os.O_RDONLY | os.O_DIRECTORY)
    etc = tmp_path / "etc"
    etc.mkdir()

    def swap(name: str) -> Callable[[], None]:
        def attack() -> None:
            os.rename(name, f"{name}.away", src_dir_fd=directory, dst_dir_fd=directory)

        return attack

    found = os.fstat(directory)
    assert found.st_uid == os.geteuid() and stat.S_IMODE(found.st_mode) == 0o711
    try:
        # Only a turn of another user than the gate's can be kept out (as root: nobody).
        if ROOT:
            for name in ("inbox", ".offered", "status"):
                with pytest.raises(PermissionError):
                    as_mind(swap(name))
            with pytest.raises(PermissionError):
                as_mind(lambda: os.symlink(etc, "new", dir_fd=directory))
    finally:
        os.close(directory)
    fork.offer(turn, 5, b"{}\n", mind_account())
    assert list(etc.iterdir()) == []


def test_an_inbox_that_is_a_link_is_refused(turn: fork.TurnDir, tmp_path: Path) -> None:
    # What a turn did when its directory was its own; root alone can do it now.
    etc = tmp_path / "etc"
    etc.mkdir()
    turn.inbox.rename(turn.path / "inbox.away")
    turn.inbox.symlink_to(etc)
    with pytest.raises(OSError) as raised:
        fork.offer(turn, 5, b"{}\n", mind_account())
    assert raised.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert list(etc.iterdir()) == []


# -- finding 3: the turn's stdin ---------------------------------------------------------------


def test_stdin_is_the_batch_whatever_the_turn_put_in_its_directory(
    turn: fork.TurnDir, victim: Path
) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as where:
        out = Path(where)
        os.chmod(out, 0o777)  # the mind's user writes what its command saw here
        run_turn_that_reports(turn, victim, out)


def run_turn_that_reports(turn: fork.TurnDir, victim: Path, out: Path) -> None:
    # No stdin.jsonl to swap: a link of that name (root's doing; the turn cannot) is not read.
    (turn.path / "stdin.jsonl").symlink_to(victim)
    account = mind_account()
    script = f"cat > {out}/stdin; {{ echo x >&9; }} 2>/dev/null || echo closed > {out}/nine; exit 3"
    child = fork.fork_turn(["/bin/sh", "-c", script], {}, account, turn, "/", stdin=b'{"id": 1}\n')
    try:
        child.release()
        _, status = os.waitpid(child.pid, 0)
    finally:
        child.abandon()
        os.close(child.pidfd)
    assert os.waitstatus_to_exitcode(status) == 3
    assert (out / "stdin").read_bytes() == b'{"id": 1}\n'
    assert (out / "stdin").stat().st_uid == MIND.pw_uid
    assert (out / "nine").read_text() == "closed\n"  # the command never gets the status fd
    record = turn.record()
    assert record.started and record.exit_status == 3 and record.ended_at is not None


def test_the_stdin_memfd_cannot_be_changed() -> None:
    fd = fork.sealed_stdin(b"batch\n")
    try:
        with pytest.raises(PermissionError):
            os.write(fd, b"other")
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        assert os.read(fd, 100) == b"batch\n"
    finally:
        os.close(fd)


# -- finding 4: a FIFO (or a link, or a huge file) where the gate reads ------------------------


def returns_within(seconds: float, call: Callable[[], object]) -> object:
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert result, f"{call} still blocked after {seconds} s"
    return result[0]


@pytest.mark.parametrize("name", ["status", "started"])
def test_a_fifo_where_the_wrapper_writes_never_blocks_the_gate(
    turn: fork.TurnDir, name: str
) -> None:
    # Where a turn directory is the turn's (before this layout), the turn could do this.
    (turn.path / name).unlink(missing_ok=True)
    os.mkfifo(turn.path / name)
    record = returns_within(5, turn.record)
    assert record == turndir.Record(started=False, exit_status=None, ended_at=None)
    assert returns_within(5, turn.exit_status) is None
    assert returns_within(5, turn.ended_at) is None
    assert returns_within(5, turn.started) is False


def test_a_status_that_is_a_link_or_too_large_is_not_read(
    turn: fork.TurnDir, tmp_path: Path
) -> None:
    zero = tmp_path / "zero"
    zero.write_text("0\n")
    (turn.path / "status").unlink()
    (turn.path / "status").symlink_to(zero)
    (turn.path / "started").symlink_to(zero)
    assert turn.record() == turndir.Record(started=False, exit_status=None, ended_at=None)
    (turn.path / "status").unlink()
    (turn.path / "status").write_bytes(b"started\n" + b" " * 100 + b"0\n")
    assert turn.exit_status() is None


# -- finding 5: a tree too deep, or too large, to remove at once --------------------------------


def deep_tree(top: Path, depth: int) -> None:
    """A chain of `depth` directories, made relative to a descriptor: its path is
    longer than PATH_MAX."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    os.close(fd)


def test_a_deep_tree_in_the_inbox_is_removed(
    turn: fork.TurnDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Depth, not time, is what this is about (a loaded test machine is slow).
    monkeypatch.setattr(turndir, "REMOVE_SECONDS", 60.0)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    inbox = os.open(turn.inbox, os.O_RDONLY | os.O_DIRECTORY)

    def plant() -> None:
        os.symlink(outside, "link", dir_fd=inbox)
        os.mkdir("top", dir_fd=inbox)

    try:
        as_mind(plant)
    finally:
        os.close(inbox)
    deep_tree(turn.inbox / "top", 3000)
    assert turn.remove() is None
    assert not turn.path.exists()
    assert (outside / "keep").read_text() == "keep"  # the link was removed, not followed
    assert list((turn.path.parent / ".trash").iterdir()) == []


def test_a_tree_past_the_budget_is_set_aside_and_removed_at_the_next_start(
    turn: fork.TurnDir, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for index in range(300):
        (turn.inbox / str(index)).touch()
    deep_tree(turn.inbox, 200)
    monkeypatch.setattr(turndir, "REMOVE_ENTRIES", 100)
    left = turn.remove()
    assert left is not None and left.parent == turn.path.parent / ".trash"
    assert left.is_dir() and not turn.path.exists()
    # The next start: another turn's directory stays, the rest goes.
    kept = fork.make_turn_dir(run_dir, 8, mind_account())
    stale = fork.make_turn_dir(run_dir, 9, mind_account())
    sweep = turndir.sweep_turn_dirs(run_dir, keep={8})
    assert sweep == turndir.Sweep(left=[], errors=[])
    assert kept.path.is_dir() and not stale.path.exists()
    assert not left.exists()


def test_a_sweep_out_of_budget_reports_what_is_left_and_never_raises(
    turn: fork.TurnDir, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep_tree(turn.inbox, 500)
    monkeypatch.setattr(turndir, "SWEEP_ENTRIES", 50)
    sweep = turndir.sweep_turn_dirs(run_dir, keep=set())
    assert len(sweep.left) == 1 and sweep.left[0].startswith("7-") and sweep.errors == []
    monkeypatch.setattr(turndir, "SWEEP_ENTRIES", 10_000)
    assert turndir.sweep_turn_dirs(run_dir, keep=set()) == turndir.Sweep(left=[], errors=[])


def test_remove_tree_holds_two_descriptors_whatever_the_depth(run_dir: Path) -> None:
    top = run_dir / "top"
    top.mkdir()
    deep_tree(top, 2000)
    before = len(os.listdir("/proc/self/fd"))
    parent = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert dirfds.remove_tree(parent, "top", dirfds.Budget(10_000, 10.0))
    finally:
        os.close(parent)
    assert not top.exists()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_removal_stops_at_its_time_budget(
    turn: fork.TurnDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep_tree(turn.inbox, 3000)
    monkeypatch.setattr(turndir, "REMOVE_SECONDS", 0.01)
    started = time.monotonic()
    left = turn.remove()
    assert time.monotonic() - started < 1.0
    assert left is not None and left.is_dir()
