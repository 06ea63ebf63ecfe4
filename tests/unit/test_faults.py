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
import time
from pathlib import Path

import pytest

from tests.unit.fake_gate import remove_tree, short_socket_dir
from tests.unit.gate_harness import ME, Harness
from volute_testbed.gate import gate_config
from volutectl import events, faults, names
from volutectl.config.settings import MindSettings
from volutectl.states import Outcome, QueueState
from volutectl.store.indexed import IndexedStore
from volutectl.store.queue import NewDelivery, Store
from volutectl.wire import protocol

REPO = Path(__file__).resolve().parents[2]


UNARMED = """
import sys
from volutectl import faults
faults.kill_own_cgroup = lambda: sys.exit(9)  # what a point that fires would do
for point in faults.EVERY_POINT:
    faults.crash_point(point)
print("passed", len(faults.EVERY_POINT))
"""


def test_unarmed_points_do_nothing(tmp_path: Path) -> None:
    """As in production (no VOLUTE_CRASH_AT), every point is passed: none kills, raises
    or marks its crash-once file, even with VOLUTE_CRASH_ONCE set."""
    once = tmp_path / "crashed-once"
    env = {name: value for name, value in os.environ.items() if name != "VOLUTE_CRASH_AT"}
    result = subprocess.run(
        [sys.executable, "-c", UNARMED],
        env={**env, "VOLUTE_CRASH_ONCE": str(once)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    points = faults.EVERY_POINT
    assert (result.returncode, result.stdout) == (0, f"passed {len(points)}\n"), result.stderr
    assert not once.exists()
    faults.arm("forked")
    faults.arm(None)  # disarmed in-process: the point it armed is passed too
    faults.crash_point("forked")


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

    def __init__(self, tmp_path: Path, crash_at: str, minds: str, **gate: object) -> None:
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


def stored(database: Path, delivery_id: int) -> tuple[dict[str, object], list[dict[str, object]]]:
    """A delivery's row, and every turn's, read from the database as it is on disk."""
    db = sqlite3.connect(database)
    db.row_factory = sqlite3.Row
    try:
        row = db.execute("SELECT * FROM deliveries WHERE id = ?", (delivery_id,)).fetchone()
        turns = db.execute("SELECT * FROM turns ORDER BY id").fetchall()
        return dict(row), [dict(turn) for turn in turns]
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
        row, [turn] = stored(run.database, delivery)
        assert (turn["state"], turn["outcome"]) == ("ended", "start_failed")
        assert (row["state"], row["attempts"]) == ("pending", 1), row
        assert row["last_error"] == f"working directory {gone} does not exist"
        assert second.poll() is None
    finally:
        run.close()


def strand(
    store: Store, message: bytes, outcome: Outcome | None, exit_status: int | None
) -> tuple[int, int]:
    """A delivery left running under a turn that is closed (ended with `outcome`), or
    under no turn at all (None: its turn's row is gone), as the old window left it."""
    session = message.decode()  # a session each: a backoff holds back its session's next
    [delivery] = store.add_deliveries([NewDelivery("m", session, message, uid=4242)])
    assert isinstance(delivery, int)
    turn, _ = store.start_turn(
        "m", session, lambda t: names.turn_scope_name("m", t), [delivery], time.time()
    )
    # What the old window's first commit did (Store.end_turn, gone since), or worse.
    with store._tx():
        if outcome is None:
            store.db.execute("DELETE FROM turns WHERE id = ?", (turn,))
        else:
            store.db.execute(
                "UPDATE turns SET state = 'ended', outcome = ?, exit_status = ?, detail = ?, "
                "ended_at = ? WHERE id = ?",
                (outcome, exit_status, f"{outcome} detail", time.time(), turn),
            )
    return delivery, turn


def test_a_gate_starting_settles_each_row_left_running_under_a_closed_turn(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    """A database a gate of before left with rows `running` under turns that are not
    open: the next gate settles each one at its start by its turn's recorded outcome, as
    that turn's settlement would have (a failed start or a failed turn: one attempt;
    carried: done), or, with no turn to say, as a turn that never ran (no attempt)."""
    hour = 3600.0
    harness = Harness(tmp_path, start=False, minds={"m": "true"}, max_attempts=3,
                      backoff_initial_seconds=hour, backoff_max_seconds=hour)  # fmt: skip
    harnesses.append(harness)
    store = Store(harness.settings.gate.state_dir / "queue.sqlite3")
    failed_start, failed_start_turn = strand(store, b"a", Outcome.START_FAILED, None)
    failed, failed_turn = strand(store, b"b", Outcome.FAILED, 3)
    carried, _ = strand(store, b"c", Outcome.OK, 0)
    orphan, _ = strand(store, b"d", None, None)
    store.close()
    harness.restart()
    gate_store = harness.gate.state.store
    rows = {row.id: row for row in gate_store.rows([failed_start, failed, carried, orphan])}
    states = {key: (row.state, row.attempts) for key, row in rows.items()}
    assert states == {
        failed_start: (QueueState.PENDING, 1),
        failed: (QueueState.PENDING, 1),
        carried: (QueueState.DONE, 0),
        orphan: (QueueState.PENDING, 0),
    }
    assert rows[failed_start].last_error == f"turn {failed_start_turn} start_failed detail"
    assert rows[failed].last_error == f"turn {failed_turn} failed detail"
    # The index and the quota sums moved with the commit: admission sees the three
    # pending rows, and the done one no longer counts against its sender.
    assert set(gate_store.index.rows) == {failed_start, failed, orphan}
    assert gate_store.usages.of(4242).deliveries == 3
    settled = harness.journal.of(events.StrandedDeliverySettled)
    assert {(e.delivery_id, e.outcome, e.state) for e in settled} == {
        (failed_start, Outcome.START_FAILED, QueueState.PENDING),
        (failed, Outcome.FAILED, QueueState.PENDING),
        (carried, Outcome.OK, QueueState.DONE),
        (orphan, Outcome.NEVER_RAN, QueueState.PENDING),
    }

    # The one with no attempt runs; the others wait out their backoff.
    def ran() -> bool:
        row = gate_store.row(orphan)
        return row is not None and row.state is QueueState.DONE

    harness.pump(ran)
    assert [r.state for r in gate_store.rows([failed_start, failed])] == [QueueState.PENDING] * 2


def test_a_gate_whose_disk_refuses_to_settle_stranded_rows_starts_all_the_same(
    tmp_path: Path, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = Harness(tmp_path, start=False, minds={"m": "true"})
    harnesses.append(harness)
    store = Store(harness.settings.gate.state_dir / "queue.sqlite3")
    stranded, turn = strand(store, b"a", Outcome.START_FAILED, None)
    store.close()

    def full_disk(self: IndexedStore, **kwargs: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(IndexedStore, "settle_rows", full_disk)
    harness.restart()  # does not raise: a gate that cannot settle them still serves
    row = harness.gate.state.store.row(stranded)
    assert row is not None and row.state is QueueState.RUNNING  # left for the next start
    [said] = harness.journal.of(events.HandlingFailed)
    assert f"turn {turn}" in said.what and "disk is full" in said.error
    assert harness.connect().request({"op": "ping"}) == {"v": 1, "ok": True}


def test_a_failed_start_whose_commit_the_disk_refuses_leaves_nothing_running(
    tmp_path: Path, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed start's one commit refused (a full disk): nothing of it happened, so the
    turn keeps its place as one whose start is unknown, until systemd's word settles it
    (never ran: no attempt). It used to be dropped by the gate with its delivery
    `running` under a turn that was still open in the store, until the next restart."""
    hour = 3600.0
    harness = Harness(tmp_path, start=False, backoff_initial_seconds=hour, backoff_max_seconds=hour)
    lost = MindSettings(command="true", user=ME, working_directory=tmp_path / "gone")
    harness.settings = harness.settings.model_copy(update={"minds": {"lost": lost}})
    harness.restart()
    harnesses.append(harness)
    store = harness.gate.state.store
    real = store.settle_turn
    refused: list[int] = []

    def full_disk(turn_id: int, **kwargs: object) -> None:
        if not refused:
            refused.append(turn_id)
            raise sqlite3.OperationalError("database or disk is full")
        real(turn_id, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "settle_turn", full_disk)
    delivery = harness.deliver_ok(mind="lost")
    harness.pump(lambda: bool(refused))
    assert [turn.id for turn in harness.gate.state.turns.all()] == refused  # it holds its place

    def failed_once() -> bool:
        row = store.row(delivery)
        return row is not None and row.attempts == 1

    harness.pump(failed_once)  # settled as never run, started again, failed and settled
    row = store.row(delivery)
    assert row is not None and row.state is QueueState.PENDING
    first, second = (store.turn(refused[0]), store.turn(refused[0] + 1))
    assert first is not None and (first.state, first.outcome) == ("ended", "never_ran")
    assert second is not None and (second.state, second.outcome) == ("ended", "start_failed")
    assert harness.gate.state.turns.all() == []
    assert [e.turn_id for e in harness.journal.of(events.TurnNotSettled)] == refused
