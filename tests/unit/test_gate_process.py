"""The gate as its own process, and what its turns inherit from it.

`volutectl gate` runs in a subprocess (tests/unit/gate_process.py: the real click
command, with fake_systemd for systemd), so the test can set its RLIMIT_NOFILE the way
LimitNOFILE= would, and read /proc about it and its turns. A turn's child is also
checked right after the fork, before it is released.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.system.gate_fixture import gate_config
from tests.unit.fake_gate import remove_tree, short_socket_dir
from tests.unit.gate_harness import ME
from volutectl import launcher, protocol

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
        ended = protocol.raise_for_reply(connection.receive(timeout=30))
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
    monkeypatch.setattr(launcher, "_inherited_nofile", None)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: handled.append(signum))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        # As the gate does at start: raise the limit, remember the original.
        assert launcher.raise_nofile_limit() == (256, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        account = launcher.resolve_account(ME)
        turn_dir = launcher.make_turn_dir(tmp_path, 1, account, b"")
        child = launcher.fork_turn(["true"], {}, account, turn_dir, str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        signal.signal(signal.SIGTERM, previous)
    try:
        # Forked and not released: it blocks on its pipe with nothing of the gate's.
        deadline = time.monotonic() + 5
        while signal_masks(child.pid)["SigCgt"] & OURS:
            assert time.monotonic() < deadline, signal_masks(child.pid)
            time.sleep(0.005)
        masks = signal_masks(child.pid)
        assert (masks["SigBlk"], masks["SigIgn"], masks["SigCgt"] & OURS) == (0, 0, 0), masks
        assert soft_nofile(child.pid) == 256
        # So a SIGTERM (a restart of the gate's unit) ends it, and runs no handler of ours.
        os.kill(child.pid, signal.SIGTERM)
        _, status = os.waitpid(child.pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert handled == []
        assert not turn_dir.started()
    finally:
        child.abandon()
        os.close(child.pidfd)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
