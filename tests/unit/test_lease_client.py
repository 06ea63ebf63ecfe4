"""`volutectl lease` as a user runs it: the console script against a real socket.

The gate's end is a small protocol peer in a thread (tests/unit/fake_lease_gate.py),
each connection played by a script. What these tests check is the client: what it
sends, when CMD runs, what it prints and exits with.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_gate import remove_tree, short_socket_dir
from tests.unit.fake_lease_gate import GRANT, TOKEN, UNIT, LeaseGate, Peer, granted_then, released
from volutectl.states import HoldReason, LeaseState
from volutectl.wire.messages import LeaseStatus, PressureStatus, Status, StatusReply

VOLUTECTL = Path(sys.executable).parent / "volutectl"


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = short_socket_dir()
    yield path
    remove_tree(path)


def start(
    socket_dir: Path,
    *args: str,
    stdin: int | None = subprocess.DEVNULL,
    ignore_sigint: bool = False,
) -> subprocess.Popen[bytes]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith(("VOLUTE_", "COVERAGE_", "COV_CORE_"))
    }
    return subprocess.Popen(
        [str(VOLUTECTL), "lease", "--socket", str(socket_dir / "gate.sock"), *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,  # a signal sent to it is not the test's
        # As a background job of a non-interactive shell: SIGINT ignored from the start.
        preexec_fn=_ignore_sigint if ignore_sigint else None,
    )


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def finish(process: subprocess.Popen[bytes]) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=60)
    return process.returncode, out.decode(), err.decode()


def wait_for(predicate: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- acquire, hold, release ----------------------------------------------------------------


def test_without_a_command_it_prints_the_lease_and_holds_it_until_stdin_closes(
    socket_dir: Path,
) -> None:
    gate = LeaseGate(socket_dir / "gate.sock", [granted_then(released)])
    read, write = os.pipe()
    process = start(socket_dir, "pip", "--session", "chat", stdin=read)
    os.close(read)
    first = process.stdout.readline() if process.stdout else b""
    assert first.decode() == f"7 {UNIT}\n"
    assert process.poll() is None  # holding: stdin is open
    assert [line["op"] for line in gate.all_lines()] == ["acquire"]
    os.close(write)
    code, _, err = finish(process)
    gate.close()
    acquire, release = gate.all_lines()
    assert code == 0
    assert (acquire["mind"], acquire["session"], acquire["pids"]) == ("pip", "chat", 0)
    assert gate.peers[0].pids[0] == []  # no descriptor came with it
    assert release == {"v": 1, "op": "release", "lease": 7, "token": TOKEN}
    assert "lease 7 waits for its place: mind_busy" in err


def test_a_wait_without_a_reason_is_explained_from_status(socket_dir: Path) -> None:
    """A new acquire is answered before admission looks; its reason is in status."""
    looked = threading.Event()

    def holder(peer: Peer) -> None:
        assert peer.line() is not None
        peer.send({"ok": True, "lease": 7, "state": "waiting"})
        assert looked.wait(timeout=30)
        peer.send(GRANT)
        released(peer)

    def status(peer: Peer) -> None:
        line = peer.line()
        assert line == {"v": 1, "op": "status"}, line
        peer.send(StatusReply(status_with_leases()).to_wire())
        looked.set()

    gate = LeaseGate(socket_dir / "gate.sock", [holder, status])
    code, out, err = finish(start(socket_dir, "pip"))
    gate.close()
    assert code == 0
    assert out == f"7 {UNIT}\n"
    assert "lease 7 waits for its place: global_cap" in err


def status_with_leases() -> Status:
    """A gate's status in which lease 7 waits for the global cap (lease 3 held)."""
    return Status(
        active_turns=2,
        global_cap=2,
        turns_per_mind=1,
        turns=(),
        foreign_scopes=0,
        minds={},
        queue_depth=0,
        holds={},
        oldest_held_s=None,
        dead=0,
        slice="volute-turns.slice",
        test_runs=(),
        io_pressure=PressureStatus(enabled=False, high=False, reason=None, trigger=None),
        test_runs_count_as_turns=False,
        leases=(
            LeaseStatus(3, "whorl", "main", 1001, LeaseState.HELD, None, 11, "u", since=1.0),
            LeaseStatus(7, "pip", "main", 1001, LeaseState.WAITING, HoldReason.GLOBAL_CAP),
        ),
    )


def test_the_command_is_held_until_the_grant_and_runs_in_the_process_that_was_passed(
    socket_dir: Path,
) -> None:
    marker = socket_dir / "ran"
    seen: dict[str, Any] = {}

    def script(peer: Peer) -> None:
        acquire = peer.line()
        assert acquire is not None
        seen["acquire"], seen["pids"] = acquire, peer.pids[0]
        peer.send({"ok": True, "lease": 7, "state": "waiting", "reason": "global_cap"})
        time.sleep(0.5)
        seen["ran_before_grant"] = marker.exists()
        peer.send(GRANT)
        released(peer)

    gate = LeaseGate(socket_dir / "gate.sock", [script])
    process = start(
        socket_dir,
        "pip",
        "--",
        "sh",
        "-c",
        f'echo "$$ $VOLUTE_LEASE $VOLUTE_LEASE_UNIT" > {marker}; exit 3',
    )
    code, _, err = finish(process)
    gate.close()
    assert code == 3
    assert seen["acquire"]["pids"] == 1 and len(seen["pids"]) == 1
    assert seen["ran_before_grant"] is False
    pid, lease, unit = marker.read_text().split()
    assert (int(pid), lease, unit) == (seen["pids"][0], "7", UNIT)  # exec'd in that process
    assert [line["op"] for line in gate.all_lines()] == ["acquire", "release"]


def test_with_pid_the_named_processes_go_with_the_acquire_and_the_command_runs_after(
    socket_dir: Path,
) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        gate = LeaseGate(socket_dir / "gate.sock", [granted_then(released)])
        code, _, _ = finish(start(socket_dir, "pip", "--pid", str(sleeper.pid), "--", "true"))
        gate.close()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert code == 0
    assert gate.all_lines()[0]["pids"] == 1
    assert gate.peers[0].pids[0] == [sleeper.pid]


def test_a_pid_that_does_not_exist_is_65_and_nothing_is_sent(socket_dir: Path) -> None:
    gate = LeaseGate(socket_dir / "gate.sock", [])
    code, _, err = finish(start(socket_dir, "pip", "--pid", "4194304", "--", "true"))
    gate.close()
    assert code == 65 and "--pid 4194304: no such process" in err
    assert gate.peers == []


def test_a_command_killed_by_a_signal_exits_128_plus_its_number(socket_dir: Path) -> None:
    gate = LeaseGate(socket_dir / "gate.sock", [granted_then(released)])
    code, _, _ = finish(start(socket_dir, "pip", "--", "sh", "-c", "kill -USR1 $$"))
    gate.close()
    assert code == 128 + signal.SIGUSR1


def test_a_command_not_found_is_127_and_the_lease_is_released(socket_dir: Path) -> None:
    gate = LeaseGate(socket_dir / "gate.sock", [granted_then(released)])
    code, _, err = finish(start(socket_dir, "pip", "--", "no-such-command-here"))
    gate.close()
    assert code == 127 and "no-such-command-here: command not found" in err
    assert [line["op"] for line in gate.all_lines()] == ["acquire", "release"]


# -- refusals ------------------------------------------------------------------------------


def test_a_refused_move_is_77_said_plainly_and_the_command_never_runs(socket_dir: Path) -> None:
    marker = socket_dir / "ran"

    def refuse(peer: Peer) -> None:
        assert peer.line() is not None
        peer.send(
            {
                "ok": False,
                "code": 77,
                "error": "pids: only the mind's user or an admin may move processes",
            }
        )

    gate = LeaseGate(socket_dir / "gate.sock", [refuse])
    code, _, err = finish(start(socket_dir, "pip", "--", "touch", str(marker)))
    gate.close()
    assert code == 77
    assert "will not move the command into pip's lease scope, so it did not run" in err
    assert "only the mind's user or an admin may move processes" in err
    time.sleep(0.2)
    assert not marker.exists()


def test_a_held_command_whose_volutectl_is_killed_exits_without_running(
    socket_dir: Path,
) -> None:
    marker = socket_dir / "ran"
    held: list[int] = []
    killed = threading.Event()

    def never_grants(peer: Peer) -> None:
        assert peer.line() is not None
        held.extend(peer.pids[0])
        peer.send({"ok": True, "lease": 7, "state": "waiting", "reason": "global_cap"})
        assert killed.wait(timeout=30)
        try:  # the connection closed with volutectl: EOF, or a reset if it read not all
            assert peer.line() is None
        except ConnectionResetError:
            pass

    gate = LeaseGate(socket_dir / "gate.sock", [never_grants])
    process = start(socket_dir, "pip", "--", "touch", str(marker))
    wait_for(lambda: bool(held))
    process.kill()
    process.wait(timeout=30)
    killed.set()
    gate.close()
    wait_for(lambda: not _alive(held[0]))
    assert not marker.exists()


def _alive(pid: int) -> bool:
    """A process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_refused_release_is_said_and_the_commands_status_kept(socket_dir: Path) -> None:
    def refuse_release(peer: Peer) -> None:
        line = peer.line()
        assert line is not None and line["op"] == "release"
        peer.send({"ok": False, "code": 75, "error": "the queue could not store"})

    gate = LeaseGate(socket_dir / "gate.sock", [granted_then(refuse_release)])
    code, _, err = finish(start(socket_dir, "pip", "--", "sh", "-c", "exit 4"))
    gate.close()
    assert code == 4
    assert "volutectl: the queue could not store" in err


def test_a_command_in_no_unit_is_65_said_plainly_and_never_runs(socket_dir: Path) -> None:
    marker = socket_dir / "ran"

    def refuse(peer: Peer) -> None:
        assert peer.line() is not None
        peer.send({"ok": False, "code": 65, "error": "pids[0]: pid 172 is in no systemd unit"})

    gate = LeaseGate(socket_dir / "gate.sock", [refuse])
    code, _, err = finish(start(socket_dir, "pip", "--", "touch", str(marker)))
    gate.close()
    assert code == 65
    assert "so it did not run: pids[0]: pid 172 is in no systemd unit" in err
    assert "hint: run it from a login session or a service" in err
    time.sleep(0.2)
    assert not marker.exists()


def test_an_older_gate_is_too_old_for_leases_64(socket_dir: Path) -> None:
    def old(peer: Peer) -> None:
        assert peer.line() is not None
        peer.send({"ok": False, "code": 64, "error": "op: unknown request 'acquire'"})

    gate = LeaseGate(socket_dir / "gate.sock", [old])
    code, _, err = finish(start(socket_dir, "pip"))
    gate.close()
    assert code == 64
    assert "the gate is too old for leases (upgrade volutectl on the host)" in err


def test_end_is_the_admin_op_and_a_members_refusal_shows_the_hint(socket_dir: Path) -> None:
    def refuse(peer: Peer) -> None:
        assert peer.line() is not None
        peer.send(
            {
                "ok": False,
                "code": 77,
                "error": "ending another's lease is an admin's",
                "hint": "needs root or membership of group volute-admin",
            }
        )

    def end(peer: Peer) -> None:
        assert peer.line() is not None
        peer.send({"ok": True, "lease": 9, "ended": True})

    gate = LeaseGate(socket_dir / "gate.sock", [refuse, end])
    refused = finish(start(socket_dir, "--end", "9"))
    ended = finish(start(socket_dir, "--end", "9"))
    gate.close()
    assert refused[0] == 77 and "hint: needs root or membership of group volute-admin" in refused[2]
    assert ended[:2] == (0, "ended lease 9\n")
    assert gate.all_lines() == [{"v": 1, "op": "end_lease", "lease": 9}] * 2


# -- the lease ends, the gate restarts, signals --------------------------------------------


def test_a_lease_ended_under_the_command_stops_it_and_exits_75(socket_dir: Path) -> None:
    marker = socket_dir / "pid"

    def end(peer: Peer) -> None:
        wait_for(marker.exists)
        peer.send({"ok": True, "event": "lease_ended", "lease": 7, "reason": "timeout"})
        peer.line(timeout=30)  # the release that follows (refused: it ended), or EOF

    gate = LeaseGate(socket_dir / "gate.sock", [granted_then(end)])
    started = time.monotonic()
    code, _, err = finish(
        start(socket_dir, "pip", "--", "sh", "-c", f"echo $$ > {marker}; exec sleep 60")
    )
    gate.close()
    assert code == 75
    assert "lease 7 ended (timeout: it reached the mind's max_runtime_seconds)" in err
    assert time.monotonic() - started < 30  # the sleep was stopped, not waited for
    assert not Path(f"/proc/{marker.read_text().strip()}").exists()


def test_the_gates_words_are_shown_not_obeyed(socket_dir: Path) -> None:
    def end(peer: Peer) -> None:
        peer.send({"ok": True, "event": "lease_ended", "lease": 7, "reason": "\x1b[2Jx"})

    gate = LeaseGate(
        socket_dir / "gate.sock",
        [granted_then(end, first={"ok": True, "lease": 7, "state": "waiting", "reason": "\x07"})],
    )
    read, write = os.pipe()  # stdin stays open: the lease is held until the gate ends it
    process = start(socket_dir, "pip", stdin=read)
    os.close(read)
    code, _, err = finish(process)
    os.close(write)
    gate.close()
    assert code == 75
    assert "\x1b" not in err and "\x07" not in err
    assert "lease 7 ended (\\x1b[2Jx)" in err and "waits for its place: \\a" in err


def test_after_a_gate_restart_the_lease_is_claimed_with_its_token(socket_dir: Path) -> None:
    go = socket_dir / "go"

    def restart(peer: Peer) -> None:
        return  # the gate goes away with the lease granted

    def claim(peer: Peer) -> None:
        line = peer.line()
        assert line == {"v": 1, "op": "claim", "lease": 7, "token": TOKEN}, line
        peer.send({"ok": True, "lease": 7, "unit": UNIT, "turn_id": 12})
        go.touch()
        released(peer)

    gate = LeaseGate(socket_dir / "gate.sock", [granted_then(restart), claim])
    command = f"while [ ! -e {go} ]; do sleep 0.05; done; exit 4"
    code, _, err = finish(start(socket_dir, "pip", "--", "sh", "-c", command))
    gate.close()
    assert code == 4  # the command went on through the restart
    assert "claiming lease 7 again" in err and "claimed lease 7 again" in err
    assert [line["op"] for line in gate.all_lines()] == ["acquire", "claim", "release"]


def test_a_claim_too_late_ends_the_lease_stops_the_command_and_exits_75(socket_dir: Path) -> None:
    def gone(peer: Peer) -> None:
        assert peer.line() is not None
        peer.send({"ok": False, "code": 65, "error": "lease: 7 has ended"})

    gate = LeaseGate(socket_dir / "gate.sock", [granted_then(lambda peer: None), gone])
    code, _, err = finish(start(socket_dir, "pip", "--", "sleep", "60"))
    gate.close()
    assert code == 75 and "lease 7 ended (reclaim_expired" in err


def test_a_restart_while_waiting_asks_again_with_the_same_request_id(socket_dir: Path) -> None:
    def waits_then_dies(peer: Peer) -> None:
        assert peer.line() is not None
        peer.send({"ok": True, "lease": 7, "state": "waiting", "reason": "paused"})

    gate = LeaseGate(socket_dir / "gate.sock", [waits_then_dies, granted_then(released)])
    code, out, _ = finish(start(socket_dir, "pip", "--", "true"))
    gate.close()
    first, again, _ = gate.all_lines()
    assert code == 0
    assert first["op"] == again["op"] == "acquire"
    assert first["request_id"] == again["request_id"]
    assert len(gate.peers[1].pids[0]) == 1  # the held command's pidfd went again


def test_sigterm_is_passed_to_the_command_and_the_lease_released(socket_dir: Path) -> None:
    marker = socket_dir / "pid"
    gate = LeaseGate(socket_dir / "gate.sock", [granted_then(released)])
    process = start(socket_dir, "pip", "--", "sh", "-c", f"echo $$ > {marker}; exec sleep 60")
    wait_for(marker.exists)
    process.send_signal(signal.SIGTERM)
    code, _, _ = finish(process)
    gate.close()
    assert code == 128 + signal.SIGTERM  # the command's status: it died of it
    assert [line["op"] for line in gate.all_lines()] == ["acquire", "release"]


def test_a_sigint_right_after_the_grant_releases_even_if_it_was_inherited_ignored(
    socket_dir: Path,
) -> None:
    """A background job of a non-interactive shell starts with SIGINT ignored. The
    signals are caught before the grant's line is printed, so one sent the moment the
    line is read is not lost (before, about one run in four held the lease on)."""
    for attempt in range(16):
        sock_dir = socket_dir / str(attempt)
        sock_dir.mkdir()
        read, write = os.pipe()
        gate = LeaseGate(sock_dir / "gate.sock", [granted_then(released)])
        process = start(sock_dir, "pip", stdin=read, ignore_sigint=True)
        os.close(read)
        assert process.stdout is not None and process.stdout.readline()
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=20)
        finally:
            process.kill()
            finish(process)
            os.close(write)
            gate.close()
        assert code == 130, (attempt, code)
        assert [line["op"] for line in gate.all_lines()] == ["acquire", "release"]


def test_without_a_command_sigint_releases(socket_dir: Path) -> None:
    read, write = os.pipe()
    gate = LeaseGate(socket_dir / "gate.sock", [granted_then(released)])
    process = start(socket_dir, "pip", stdin=read)
    os.close(read)
    assert process.stdout is not None and process.stdout.readline()
    process.send_signal(signal.SIGINT)
    code, _, _ = finish(process)
    os.close(write)
    gate.close()
    assert code == 130
    assert [line["op"] for line in gate.all_lines()] == ["acquire", "release"]
