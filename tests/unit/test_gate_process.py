"""The gate as its own process: out of file descriptors, and what its turns inherit.

`volutectl gate` runs in a subprocess (tests/unit/gate_process.py: the real click
command, with fake_systemd for systemd), so the test can set its RLIMIT_NOFILE the way
LimitNOFILE= would, watch its CPU time, and read /proc about it and its turns. A turn's
child is also checked right after the fork, before it is released.
"""

from __future__ import annotations

import contextlib
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.fake_gate import remove_tree, short_socket_dir
from tests.unit.gate_harness import ME
from volute_testbed.gate import gate_config
from volutectl.launcher import fork
from volutectl.wire import messages, protocol

REPO = Path(__file__).resolve().parents[2]
SIGPIPE_BIT = 1 << (signal.SIGPIPE - 1)
SIGXFSZ_BIT = 1 << (signal.SIGXFSZ - 1)
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)
# Signals a program can handle. glibc keeps 32 and 33 for itself (handled in any process
# that ever had a second thread), and exec resets them as it resets every handler.
OURS = sum(1 << (signum - 1) for signum in signal.valid_signals())


def signal_masks(pid: int | str) -> dict[str, int]:
    """SigBlk, SigIgn and SigCgt of a process, from /proc."""
    masks = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("SigBlk", "SigIgn", "SigCgt"):
            masks[key] = int(value.strip(), 16)
    return masks


def soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no 'Max open files' in /proc/{pid}/limits")


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


class GateProcess:
    def __init__(self, tmp_path: Path, minds: dict[str, str], nofile: str) -> None:
        self.dir = short_socket_dir()
        self.socket = self.dir / "gate.sock"
        config = tmp_path / "volutectl.toml"
        gate = {
            "socket": str(self.socket),
            "socket_group": ME,
            "state_dir": str(tmp_path / "state"),
            "runtime_dir": str(tmp_path / "run"),
            "watchdog": False,
        }
        config.write_text(gate_config(minds, gate=gate, turns={"default_user": ME}))
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(self.dir / "notify"))
        notify.settimeout(60)
        self.stderr_path = tmp_path / "gate.stderr"
        with self.stderr_path.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.unit.gate_process", str(config), nofile],
                env={**os.environ, "PYTHONPATH": str(REPO), "NOTIFY_SOCKET": notify.getsockname()},
                stdin=subprocess.DEVNULL,
                stderr=stderr,
            )  # fmt: skip
        try:
            while b"READY=1" not in notify.recv(4096):
                pass
        except TimeoutError:
            self.stop()
            raise AssertionError(f"the gate never got ready: {self.stderr()}") from None
        finally:
            notify.close()
        self.pid = self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(self.socket))
        return sock

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        finally:
            remove_tree(self.dir)


@pytest.fixture
def tracked() -> Iterator[list[GateProcess]]:
    gates: list[GateProcess] = []
    yield gates
    for gate in gates:
        if gate.proc.poll() is None:
            gate.proc.kill()
            gate.proc.wait()
        remove_tree(gate.dir)


def answered(
    peers: list[socket.socket], timeout: float, expect: int | None = None
) -> set[socket.socket]:
    """The peers whose ping got its reply within `timeout` s (or once `expect` have)."""
    done: set[socket.socket] = set()
    with selectors.DefaultSelector() as selector:
        for each in peers:
            selector.register(each, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and len(done) < (expect or len(peers)):
            for key, _ in selector.select(left):
                peer = key.fileobj
                assert isinstance(peer, socket.socket)
                assert peer.recv(4096) == b'{"v":1,"ok":true}\n'
                selector.unregister(peer)
                done.add(peer)
    return done


def test_out_of_descriptors_the_gate_stops_accepting_without_dying_or_spinning(
    tmp_path: Path, tracked: list[GateProcess]
) -> None:
    gate = GateProcess(tmp_path, {"mimsy": "true"}, nofile="48:48")
    tracked.append(gate)
    assert soft_nofile(gate.pid) == 48
    free = 48 - len(os.listdir(f"/proc/{gate.pid}/fd"))
    peers = [gate.connect() for _ in range(free + 20)]  # 20 more than it has descriptors for
    for peer in peers:
        peer.sendall(b'{"v":1,"op":"ping"}\n')
    served = answered(peers, timeout=3)
    waiting = [peer for peer in peers if peer not in served]
    # (The count of free descriptors may be off by one: sd_notify's socket, just closing.)
    assert 0 < len(served) <= free + 1 and len(waiting) >= 19
    assert len(os.listdir(f"/proc/{gate.pid}/fd")) == 48  # it really is out of them
    # Out of descriptors, with 20 connections knocking: it sleeps, it does not spin.
    before = cpu_ticks(gate.pid)
    time.sleep(2)
    assert cpu_ticks(gate.pid) - before <= 20  # 0.2 s of CPU in 2 s, at most
    # Every client that leaves lets one more in, until all have been served.
    while waiting:
        for peer in list(served)[:5]:
            peer.close()
            served.discard(peer)
        newly = answered(waiting, timeout=5, expect=min(5, len(waiting)))
        assert newly, f"{len(waiting)} clients still wait: {gate.stderr()}"
        served |= newly
        waiting = [peer for peer in waiting if peer not in newly]
    for peer in served:
        peer.close()
    assert gate.proc.poll() is None
    assert gate.stop() == 0
    log = gate.stderr()
    assert "Traceback" not in log
    problem = "not accepting for now: cannot accept connections: Too many open files"
    assert 1 <= log.count(problem) <= 5, log  # when it begins, not once per retry


def test_a_turn_gets_default_signal_dispositions_and_the_original_fd_limit(
    tmp_path: Path, tracked: list[GateProcess]
) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert hard > 256, "the test needs a hard limit above the soft one it sets"
    out = tmp_path / "out"
    out.mkdir()
    command = f"ulimit -n > {out}/nofile; grep -E '^Sig(Blk|Ign)' /proc/self/status > {out}/status"
    gate = GateProcess(tmp_path, {"probe": command}, nofile=f"256:{hard}")
    tracked.append(gate)
    # The gate itself raised its limit, and has what Python and its own handlers set.
    assert soft_nofile(gate.pid) == hard
    masks = signal_masks(gate.pid)
    assert masks["SigIgn"] & SIGPIPE_BIT and masks["SigIgn"] & SIGXFSZ_BIT
    assert masks["SigCgt"] & SIGTERM_BIT
    connection = protocol.Connection(str(gate.socket), timeout=30)
    try:
        reply = connection.request({"op": "deliver", "mind": "probe", "message": "m", "wait": True})
        ended = messages.decode_event(connection.receive(timeout=30)).to_wire()
    finally:
        connection.close()
    assert (ended["event"], ended["id"], ended["exit_code"]) == ("turn_ended", reply["id"], 0)
    # What the turn's command found: none of it.
    assert (out / "nofile").read_text().strip() == "256"
    turn = dict(line.split(":") for line in (out / "status").read_text().splitlines())
    assert int(turn["SigIgn"], 16) == 0 and int(turn["SigBlk"], 16) == 0, turn
    assert gate.stop() == 0


def test_a_forked_child_resets_signals_and_limits_before_it_waits_for_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard > 256
    handled: list[int] = []
    monkeypatch.setattr(fork, "_inherited_nofile", None)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: handled.append(signum))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        # As the gate does at start: raise the limit, remember the original.
        assert fork.raise_nofile_limit() == (256, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        account = fork.resolve_account(ME)
        turn_dir = fork.make_turn_dir(tmp_path, 1, account)
        child = fork.fork_turn(["true"], {}, account, turn_dir, str(tmp_path), stdin=b"")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        signal.signal(signal.SIGTERM, previous)
    try:
        # Forked and not released: it blocks on its pipe with nothing of the gate's, and
        # ignores only the signals that stop the gate's unit.
        stops = sum(1 << (s - 1) for s in fork.STOP_SIGNALS)
        deadline = time.monotonic() + 5
        # It blocks every signal across the fork, then resets (its mask last): wait
        # until it has.
        while signal_masks(child.pid)["SigCgt"] & OURS or signal_masks(child.pid)["SigBlk"]:
            assert time.monotonic() < deadline, signal_masks(child.pid)
            time.sleep(0.005)
        masks = signal_masks(child.pid)
        assert (masks["SigBlk"], masks["SigIgn"], masks["SigCgt"] & OURS) == (0, stops, 0), masks
        assert soft_nofile(child.pid) == 256
        # So a SIGTERM to the gate's whole cgroup (a restart of its unit) neither kills it
        # (the gate will release it into its scope, or close its pipe) nor runs a handler.
        os.kill(child.pid, signal.SIGTERM)
        time.sleep(0.1)
        assert os.waitpid(child.pid, os.WNOHANG) == (0, 0)
        assert handled == []
        child.abandon()  # the gate gone: the pipe closes and it exits, having run nothing
        _, status = os.waitpid(child.pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert not turn_dir.started()
    finally:
        child.abandon()
        os.close(child.pidfd)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
