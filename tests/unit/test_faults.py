"""Crash points: unarmed they do nothing; armed in-process they raise once; armed in a
gate of its own process, it dies there by a real SIGKILL, and the next gate settles what
that one left."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.fake_gate import remove_tree, short_socket_dir
from tests.unit.gate_harness import ME
from volute_testbed.gate import gate_config
from volutectl import faults
from volutectl.wire import protocol

REPO = Path(__file__).resolve().parents[2]


def test_unarmed_points_do_nothing() -> None:
    faults.arm(None)
    for point in faults.POINTS + faults.FAILED_START_POINTS + faults.STORAGE_POINTS:
        faults.crash_point(point)


def test_an_armed_point_raises_once_and_only_there() -> None:
    faults.arm("forked")
    try:
        faults.crash_point("start_committed")  # another point: nothing
        with pytest.raises(faults.SimulatedCrash, match="forked"):
            faults.crash_point("forked")
        faults.crash_point("forked")  # disarmed by the crash
    finally:
        faults.arm(None)


def test_a_simulated_crash_is_not_an_exception_the_gate_could_swallow() -> None:
    assert not issubclass(faults.SimulatedCrash, Exception)


def test_an_unknown_point_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown crash point"):
        faults.arm("nowhere")


def test_the_own_cgroup_is_read_from_proc() -> None:
    # What kill_own_cgroup would kill: the processes of our cgroup, which include us.
    assert os.getpid() in faults._cgroup_pids()


# -- a gate killed at a crash point, in a process of its own -----------------------------


class GateRun:
    """`volutectl gate` in a process of its own (tests/unit/gate_process.py: fake_systemd
    for systemd, the real IndexedStore and SQLite file), with a crash point armed by the
    environment: it SIGKILLs itself there, once (VOLUTE_CRASH_ONCE), as the service's
    cgroup would die. `minds` is the config's [minds] tables, as TOML."""

    def __init__(
        self, tmp_path: Path, crash_at: str, minds: str, **gate: object
    ) -> None:
        self.dir = short_socket_dir()
        self.socket = self.dir / "gate.sock"
        self.database = tmp_path / "state" / "queue.sqlite3"
        self.config = tmp_path / "volutectl.toml"
        gate = {
            "socket": str(self.socket), "socket_group": ME, "state_dir": str(tmp_path / "state"),
            "runtime_dir": str(tmp_path / "run"), "watchdog": False, **gate,
        }  # fmt: skip
        self.config.write_text(gate_config({}, gate=gate, turns={"default_user": ME}) + minds)
        self.env = {
            **os.environ, "PYTHONPATH": str(REPO), "VOLUTE_CRASH_AT": crash_at,
            "VOLUTE_CRASH_ONCE": str(tmp_path / "crashed"),
        }  # fmt: skip
        self.stderr_path = tmp_path / "gate.stderr"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        """Start it, and wait for READY=1: by then it has taken back what its store holds."""
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(self.dir / "notify"))
        notify.settimeout(60)
        try:
            with self.stderr_path.open("ab") as stderr:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.unit.gate_process", str(self.config)],
                    env={**self.env, "NOTIFY_SOCKET": notify.getsockname()},
                    stdin=subprocess.DEVNULL, stderr=stderr,
                )  # fmt: skip
            while b"READY=1" not in notify.recv(4096):
                pass
        except TimeoutError:
            raise AssertionError(f"the gate never got ready: {self.stderr()}") from None
        finally:
            notify.close()
            (self.dir / "notify").unlink(missing_ok=True)
        return self.proc

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def deliver(self, mind: str) -> int:
        connection = protocol.Connection(str(self.socket), timeout=30)
        try:
            reply = connection.request({"op": "deliver", "mind": mind, "message": "m"})
        finally:
            connection.close()
        assert reply.get("ok") is True, reply
        return int(reply["id"])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        remove_tree(self.dir)


def stored(database: Path, delivery_id: int) -> tuple[dict[str, object], dict[str, object]]:
    """A delivery's row and its turn's, read from the database as it is on disk."""
    db = sqlite3.connect(database)
    db.row_factory = sqlite3.Row
    try:
        row = db.execute("SELECT * FROM deliveries WHERE id = ?", (delivery_id,)).fetchone()
        turn = db.execute("SELECT * FROM turns WHERE id = ?", (row["turn_id"],)).fetchone()
        return dict(row), dict(turn) if turn is not None else {}
    finally:
        db.close()


def test_a_gate_killed_as_a_failed_start_settles_leaves_no_delivery_running(
    tmp_path: Path,
) -> None:
    """Issue 29, finding 6: a start that fails ended its turn in one commit and counted
    its deliveries' attempt in another. A gate SIGKILLed between the two left the row
    `running` under a turn that is closed, which no later gate took back: running for
    ever, against its sender's quota, and neither droppable nor retryable."""
    gone = tmp_path / "gone"
    minds = f'[minds."lost"]\ncommand = "true"\nworking_directory = "{gone}"\n'
    hour = 3600.0  # the retry waits: what the test reads is the first attempt's
    run = GateRun(tmp_path, "start_failure_recorded", minds, max_attempts=3,
                  backoff_initial_seconds=hour, backoff_max_seconds=hour)  # fmt: skip
    try:
        first = run.start()
        delivery = run.deliver("lost")
        assert first.wait(timeout=30) == -signal.SIGKILL, run.stderr()
        assert (tmp_path / "crashed").exists()  # it died at the point, not elsewhere
        second = run.start()  # it has crashed there once: this one runs on
        row, turn = stored(run.database, delivery)
        assert (turn["state"], turn["outcome"]) == ("ended", "start_failed")
        assert (row["state"], row["attempts"]) == ("pending", 1), row
        assert row["last_error"] == f"working directory {gone} does not exist"
        assert second.poll() is None
    finally:
        run.close()
