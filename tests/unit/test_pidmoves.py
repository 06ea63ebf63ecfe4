"""A lease's processes moved by the launcher (issue 31, item 2), in parts: the pure
checks (volutectl/core/pidmoves.py), the reading of a process by its pidfd
(volutectl/kernel/pidfds.py), the bound on descriptors beside a line
(volutectl/wire/orders.py), and the mover's record and its undo
(volutectl/launcher/moves.py) with systemd and the cgroup writes stood in for.
tests/system/test_lease_moves.py moves real processes under a real systemd."""

from __future__ import annotations

import array
import os
import socket
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tests.unit.gate_harness import RecordingJournal
from volutectl.core import pidmoves
from volutectl.core.pidmoves import Origin, Rules, Seen
from volutectl.errors import VoluteError
from volutectl.gate.leasepids import LeasePids
from volutectl.kernel import cgroupmove, pidfds
from volutectl.launcher import moves
from volutectl.launcher.hands import LocalHands, TurnHands
from volutectl.wire import orders

RULES = Rules(mind="m", turn_id=7, mind_uid=1001, forbidden_pids=frozenset({1, 50, 60}))
SCOPE = "volute-turn-m-7.scope"


def seen(**change: Any) -> Seen:
    base: dict[str, Any] = {
        "pid": 4242,
        "real_uid": 1001,
        "effective_uid": 1001,
        "cgroup": "/system.slice/runner.service",
        "start_time": 99,
    }
    return Seen(**{**base, **change})


# -- the pure checks ----------------------------------------------------------------------


def test_the_minds_own_process_in_a_unit_of_its_own_may_move() -> None:
    assert pidmoves.refusal(seen(), RULES) is None
    assert pidmoves.refusal(seen(cgroup=f"/volute.slice/volute-turns.slice/{SCOPE}"), RULES) is None


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"real_uid": 0}, "runs as uid 0/1001"),
        ({"effective_uid": 0}, "runs as uid 1001/0"),
        ({"pid": 1}, "pid 1"),
        ({"pid": 50}, "the gate or the launcher"),
        ({"cgroup": "/system.slice/volute-gate.service"}, "volute-gate.service"),
        ({"cgroup": "/system.slice/volute-launcher.service"}, "volute-launcher.service"),
        ({"cgroup": "/init.scope"}, "init.scope"),
        ({"cgroup": "/volute.slice/volute-turns.slice/volute-turn-o-3.scope"}, "another turn's"),
        ({"cgroup": "/volute.slice/volute-turns.slice/volute-turn-m-8.scope"}, "another turn's"),
        ({"cgroup": "/"}, "no systemd unit"),
        ({"cgroup": "/user.slice"}, "no systemd unit"),
    ],
)
def test_a_process_that_is_not_the_minds_own_is_refused(change: dict[str, Any], words: str) -> None:
    why = pidmoves.refusal(seen(**change), RULES)
    assert why is not None and words in why


def test_a_mind_that_runs_as_root_moves_nothing() -> None:
    rules = Rules("m", 7, 0, frozenset({1}))
    why = pidmoves.refusal(seen(real_uid=0, effective_uid=0), rules)
    assert why is not None and "runs as root" in why


def test_the_origin_of_a_cgroup_is_the_system_managers_unit() -> None:
    assert pidmoves.origin_of("/system.slice/runner.service") == Origin(
        "runner.service", "", "system.slice"
    )
    nested = "/user.slice/user-1000.slice/user@1000.service/app.slice/x.service"
    assert pidmoves.origin_of(nested) == Origin(
        "user@1000.service", "app.slice/x.service", "user-1000.slice"
    )
    assert pidmoves.origin_of("/init.scope") == Origin("init.scope", "", "-.slice")
    assert pidmoves.origin_of("/") is None
    assert pidmoves.origin_of("/system.slice/../x.service") is None


def test_proc_files_are_parsed_as_the_kernel_writes_them() -> None:
    status = "Name:\tsleep\nUid:\t1001\t1002\t1001\t1001\nGid:\t5\t5\t5\t5\n"
    assert pidmoves.parse_status_uids(status) == (1001, 1002)
    assert pidmoves.parse_status_uids("Name:\tx\n") is None
    hybrid = "1:cpu:/\n9:name=systemd:/system.slice/a.service\n0::/system.slice/a.service\n"
    assert pidmoves.parse_systemd_cgroup(hybrid) == "/system.slice/a.service"
    assert pidmoves.parse_systemd_cgroup("0::/user.slice/x.scope\n") == "/user.slice/x.scope"
    # A command with spaces and parentheses: fields count from the last ')'.
    rest = " ".join(["S"] + [str(n) for n in range(4, 22)] + ["777", "0"])
    assert pidmoves.parse_start_time(f"12 (a b) c)) {rest}") == 777
    assert pidmoves.parse_start_time("12 (x) S 1") is None


def test_a_process_goes_back_to_its_unit_while_active_else_to_its_own_scope() -> None:
    origin = Origin("runner.service", "", "system.slice")
    assert pidmoves.return_target(origin, True, "m", 7) == "runner.service"
    assert pidmoves.return_target(origin, False, "m", 7) == "volute-returned-m-7.scope"
    assert pidmoves.returned_scope("a-b", 3) == "volute-returned-a\\x2db-3.scope"


# -- reading a process by its pidfd -----------------------------------------------------


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(["sleep", "60"])
    yield child
    child.kill()
    child.wait()


def test_a_pidfd_is_read_as_its_own_process(sleeper: subprocess.Popen[bytes]) -> None:
    pidfd = os.pidfd_open(sleeper.pid)
    try:
        found = pidfds.read_process(pidfd)
        assert found.pid == sleeper.pid
        assert (found.real_uid, found.effective_uid) == (os.getuid(), os.geteuid())
        assert found.start_time > 0
        again = pidfds.open_recorded(found.pid, found.start_time)
        assert again is not None
        os.close(again)
        assert pidfds.open_recorded(found.pid, found.start_time + 1) is None  # another
    finally:
        os.close(pidfd)


def test_an_exited_process_or_a_descriptor_that_is_no_pidfd_is_refused(
    sleeper: subprocess.Popen[bytes],
) -> None:
    pidfd = os.pidfd_open(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    try:
        with pytest.raises(pidfds.NotAProcess, match="exited"):
            pidfds.read_process(pidfd)
        assert pidfds.current_cgroup(pidfd) is None
    finally:
        os.close(pidfd)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(pidfds.NotAProcess, match="not a pidfd"):
            pidfds.read_process(null)
    finally:
        os.close(null)


# -- descriptors beside a line ---------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_more_pidfds_than_a_lease_may_have_are_refused_and_all_closed() -> None:
    left, right = socket.socketpair()
    reader = orders.LineReader(max_fds=orders.MAX_LEASE_PIDS)
    null = os.open(os.devnull, os.O_RDONLY)
    before = open_fds()
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [null] * 65))]
    left.sendmsg([b'{"v":1}\n'], rights)
    with pytest.raises(orders.OrderError, match="at most 64"):
        reader.receive(right)
    assert open_fds() == before and not reader.fds  # none kept
    # 64 are taken, and only as many as the line announces.
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [null] * 64))]
    left.sendmsg([b'{"v":1}\n'], rights)
    reader.receive(right)
    with pytest.raises(orders.OrderError, match="3 descriptors were announced, 64 came"):
        reader.take_fds(3)
    taken = reader.take_fds(64)
    assert len(taken) == 64
    for fd in taken:
        os.close(fd)
    assert open_fds() == before
    for end in (left, right):
        end.close()
    os.close(null)


# -- the mover's record and undo, systemd and the cgroup writes stood in for ---------------


class StandIn:
    """What the mover asks of systemd, answered from a dict; moves recorded."""

    def __init__(self) -> None:
        self.states = {SCOPE: "active", "runner.service": "active"}
        self.attached: list[tuple[str, int]] = []
        self.started: list[tuple[str, list[int]]] = []

    def active_state(self, name: str) -> str | None:
        return self.states.get(name)

    def unit_property(self, name: str, prop: str) -> object:
        return {"MainPID": 0, "ControlGroup": f"/x/{name}", "Delegate": False}[prop]

    def attach_processes(self, name: str, pids: Sequence[int], subcgroup: str = "") -> None:
        raise AssertionError("no unit here is delegated")

    def start_scope(self, name: str, pids: Sequence[int], props: object) -> None:
        self.started.append((name, list(pids)))


@pytest.fixture
def mover(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> moves.Mover:
    journal = RecordingJournal()
    standin = StandIn()
    hands = SimpleNamespace(
        units={7: SCOPE},
        manager=standin,
        journal=journal,
        held=SimpleNamespace(current=None),
        account_of=lambda _settings, _mind: SimpleNamespace(uid=1001),
    )
    records = moves.Records(tmp_path / "moved")
    made = moves.Mover(cast(LocalHands, hands), records)
    where: dict[int, str] = {}  # pid -> its cgroup, as the stood-in kernel has it
    gone: set[int] = set()
    monkeypatch.setattr(pidfds, "read_process", lambda fd: seen(pid=fd, start_time=fd))
    opened: dict[int, int] = {}  # a stood-in pidfd (of /dev/null) -> its pid

    def open_recorded(pid: int, start: int) -> int | None:
        if pid in gone:
            return None
        fd = os.open(os.devnull, os.O_RDONLY)
        opened[fd] = pid
        return fd

    def current_cgroup(fd: int) -> str:
        return where.get(opened[fd], "/system.slice/runner.service")

    monkeypatch.setattr(pidfds, "open_recorded", open_recorded)
    monkeypatch.setattr(pidfds, "current_cgroup", current_cgroup)

    def attach(cgroup: str, pid: int) -> None:
        if pid in gone:
            raise cgroupmove.ProcessGone(f"pid {pid} exited")
        if pid == 666:
            raise OSError(13, "refused")
        where[pid] = cgroup.replace("/x/", "/system.slice/")
        standin.attached.append((cgroup, pid))

    monkeypatch.setattr(cgroupmove, "attach", attach)
    made.where, made.gone = where, gone  # type: ignore[attr-defined]
    return made


def test_a_process_that_exits_mid_move_is_left_out_and_nothing_is_stranded(
    mover: moves.Mover,
) -> None:
    gone: set[int] = mover.gone  # type: ignore[attr-defined]
    gone.add(12)  # exits between the check and its move
    reply = mover.move_in(orders.MoveIn(7, "m", 2), (11, 12))
    assert reply == orders.Moved((11,), ("runner.service",))
    record = mover.records.load(7)
    assert record is not None and [p.pid for p in record.processes] == [11, 12]
    mover.move_back(7, "m")  # 12 names no process: skipped; 11 goes home
    assert mover.records.load(7) is None
    mover.move_back(7, "m")  # and again: nothing to do


def test_a_move_that_fails_moves_back_what_moved_and_forgets_it(mover: moves.Mover) -> None:
    with pytest.raises(VoluteError, match="none moved"):
        mover.move_in(orders.MoveIn(7, "m", 2), (11, 666))
    where: dict[int, str] = mover.where  # type: ignore[attr-defined]
    assert where[11] == "/system.slice/runner.service"  # back where it was
    assert mover.records.load(7) is None


def test_a_scope_the_launcher_did_not_start_is_no_target(mover: moves.Mover) -> None:
    with pytest.raises(VoluteError, match="turn_id: .* not a scope this launcher started"):
        mover.move_in(orders.MoveIn(8, "m", 1), (11,))
    with pytest.raises(VoluteError, match="turn_id: "):
        mover.move_in(orders.MoveIn(7, "o", 1), (11,))


def test_the_records_directory_must_be_the_launchers_own(tmp_path: Path) -> None:
    path = tmp_path / "moved"
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    with pytest.raises(VoluteError, match="not trusted"):
        moves.Records(path).load(1)
    (tmp_path / "link").symlink_to(path)
    path.chmod(0o700)
    with pytest.raises(OSError):
        moves.Records(tmp_path / "link").load(1)  # never through a link


def test_a_sweep_returns_the_processes_of_leases_the_gate_no_longer_holds(
    mover: moves.Mover,
) -> None:
    mover.move_in(orders.MoveIn(7, "m", 1), (11,))
    where: dict[int, str] = mover.where  # type: ignore[attr-defined]
    assert where[11] == f"/system.slice/{SCOPE}"
    mover.sweep([7])  # still open: left alone
    assert where[11] == f"/system.slice/{SCOPE}" and mover.records.turn_ids() == [7]
    mover.sweep([])  # its lease ended while the gate was away: back home
    assert where[11] == "/system.slice/runner.service"
    assert mover.records.turn_ids() == []


# -- the gate's copies of a lease's pidfds ------------------------------------------------


def test_the_gate_moves_only_the_living_and_ends_a_lease_when_all_have_exited() -> None:
    first, second = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    asked: list[orders.MoveIn] = []
    watched: dict[int, Callable[[int], None]] = {}
    ended: list[int] = []

    class Hands:
        def move_in(self, order: orders.MoveIn, pidfds: Sequence[int]) -> orders.Moved:
            asked.append(order)
            return orders.Moved(tuple(range(len(pidfds))), ("a.service",) * len(pidfds))

    def unwatch(fd: int) -> None:
        watched.pop(fd)

    pids = LeasePids(RecordingJournal(), watched.__setitem__, unwatch, ended.append)
    passed = [os.pidfd_open(first.pid), os.pidfd_open(second.pid)]
    before = open_fds()
    pids.keep(5, passed)
    for fd in passed:
        os.close(fd)  # the request's own: the gate keeps copies
    first.kill()
    first.wait()
    assert pids.move_in(cast(TurnHands, Hands()), 5, 9, "m") == 1
    assert asked == [orders.MoveIn(turn_id=9, mind="m", pids=1)]
    for on_ready in list(watched.values()):
        on_ready(1)
    assert ended == []  # one still lives
    second.kill()
    second.wait()
    for on_ready in list(watched.values()):
        on_ready(1)
    assert ended == [5] and not watched and not pids.held
    assert open_fds() == before - 2  # its copies closed


def test_a_record_is_kept_whole_and_read_back(tmp_path: Path) -> None:
    records = moves.Records(tmp_path / "run" / "moved")  # its parent made too
    assert records.load(3) is None and records.turn_ids() == []
    moved = moves.MovedProcess(41, 99, "/system.slice/a.service", "a.service", "system.slice")
    record = moves.Record("m", 3, "volute-turn-m-3.scope", (moved,))
    records.save(record)
    assert records.load(3) == record and records.turn_ids() == [3]
    assert oct((tmp_path / "run" / "moved").stat().st_mode & 0o777) == "0o700"
    records.drop(3)
    records.drop(3)  # again: nothing to drop
    assert records.load(3) is None
