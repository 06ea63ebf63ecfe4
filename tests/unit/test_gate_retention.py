"""Retention in the real gate, in-process and against fake_systemd: its deadline is one
of the loop's (a real one: no polling), a batch never runs in a pass that starts a turn,
and a gate SIGKILLed in the middle of a batch loses nothing it should keep.
"""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.fake_gate import remove_tree, short_socket_dir
from tests.unit.gate_harness import ME, Harness
from tests.unit.retention_child import run_child
from tests.unit.retention_rows import DAY, KEEP_DAYS, Seeded, seed, snapshot
from volute_testbed.gate import gate_config
from volutectl.states import QueueState
from volutectl.store import retention
from volutectl.store.queue import Store
from volutectl.store.retention import Pacing

SECOND = 1 / 86400  # gate.retention_days of one second


def deliver(harness: Harness, mind: str = "mimsy") -> int:
    reply = harness.connect().request({"op": "deliver", "mind": mind, "message": "m"})
    assert reply.get("ok") is True, reply
    return int(reply["id"])


def seeded_state(tmp_path: Path, **options: Any) -> tuple[Path, Seeded]:
    """A state directory whose queue holds retention's mix (tests/unit/retention_rows.py)."""
    path = tmp_path / "state" / "queue.sqlite3"
    store = Store(path)
    try:
        return path, seed(store, time.time(), running=False, **options)
    finally:
        store.close()


def unheld(tables: dict[str, dict[int, tuple[object, ...]]]) -> dict[int, tuple[object, ...]]:
    """Each delivery's columns, less its hold (held_since, hold_reason, held_ms): the
    gate records holds as it admits, which changes nothing that was asked."""
    return {key: row[:9] + row[12:] for key, row in tables["deliveries"].items()}


@pytest.mark.serial
def test_retention_wakes_the_gate_on_its_own_deadline_and_never_polls(
    tmp_path: Path, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    quick = Pacing(start_delay=0.0, busy_gap=0.05, quiet_floor=0.3, defer=0.05, max_wait=1.0)
    monkeypatch.setattr(retention, "PACING", quick)
    harness = Harness(tmp_path, retention_days=SECOND, clock=FakeClock())
    harnesses.append(harness)
    store = harness.gate.state.store
    ran: list[float] = []
    run_batch = harness.gate.retention.run_batch

    def recorded(mono: float) -> retention.Batch | None:
        ran.append(mono)
        return run_batch(mono)

    monkeypatch.setattr(harness.gate.retention, "run_batch", recorded)
    ids = [deliver(harness) for _ in range(3)]
    harness.pump(lambda: all(r.state == QueueState.DONE for r in store.rows(ids)))
    harness.advance(0.1)  # the first batch: nothing has expired yet
    # Asleep until the oldest row expires (one second after it finished): a real
    # deadline, not a poll, and the loop wakes about once for it.
    timeout = harness.gate.timeout()
    assert timeout is not None and 0.3 <= timeout <= 1.0, timeout
    steps, batches = harness.steps, len(ran)
    harness.advance(1.5)
    assert store.rows(ids) == []
    assert harness.steps - steps <= 6, harness.steps - steps
    assert len(ran) - batches <= 2
    # Nothing left: the next batch is a whole retention after the last (a row done from
    # now on expires no sooner), or the quiet floor, whichever is later.
    assert harness.gate.retention.deadline() == pytest.approx(ran[-1] + 1.0, abs=0.01)


def test_a_new_gate_sleeps_until_the_oldest_row_expires_or_briefly_if_one_has(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    clock = FakeClock()
    harness = Harness(tmp_path, clock=clock)  # the defaults: seven days, a start delay of 10 s
    harnesses.append(harness)
    harness.advance(0.2)
    # Retention's own deadline (the gate's timeout may be nearer: a checkpoint's).
    due = harness.gate.retention.deadline()
    timeout = None if due is None else due - clock.monotonic()
    assert timeout is not None and 7 * DAY - 60 < timeout <= 7 * DAY  # an empty queue
    harness.crash()
    store = Store(tmp_path / "state" / "queue.sqlite3")
    gone = seed(store, clock.wall() - 3 * DAY, running=False)  # done and dropped 33 days ago,
    store.close()  # ...and the last row done 4 days ago
    harness.restart()
    assert harness.gate.timeout() == 0.0  # the new gate's first pass is owed
    harness.advance(0.2)  # its first passes (a row of a mind no longer configured fails)
    due = harness.gate.retention.deadline()
    timeout = None if due is None else due - clock.monotonic()
    assert timeout is not None and 9.0 < timeout <= retention.PACING.start_delay
    harness.gate.retention.due = clock.monotonic()
    harness.advance(0.6)  # the first passes were busy: it waits for an idle one
    assert not harness.gate.state.store.rows(gone.gone)
    due = harness.gate.retention.deadline()
    assert due is not None and 3 * DAY - 60 < due - clock.monotonic() <= 3 * DAY + 1


def test_a_batch_never_runs_in_a_pass_that_starts_a_turn(
    tmp_path: Path, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Retention eager as it can be (always due, never waiting for an idle pass beyond
    # 10 ms) while turns hand off one to the next: batches run between them, never in
    # the pass that starts one.
    eager = Pacing(start_delay=0.0, busy_gap=0.0, quiet_floor=0.0, defer=0.001, max_wait=0.01)
    monkeypatch.setattr(retention, "PACING", eager)
    path, seeded = seeded_state(tmp_path, old_done=1500)
    harness = Harness(
        tmp_path, minds={"a": "sleep 0.02", "b": "sleep 0.02"},
        limits={"global_concurrent_turns": 1}, retention_days=KEEP_DAYS,
    )  # fmt: skip
    harnesses.append(harness)
    gate = harness.gate
    batches: list[tuple[bool, int]] = []
    run_batch = gate.retention.run_batch

    def recorded(mono: float) -> retention.Batch | None:
        batches.append((gate.started, len(gate.state.turns.all())))
        return run_batch(mono)

    monkeypatch.setattr(gate.retention, "run_batch", recorded)
    ids = [deliver(harness, mind) for _ in range(6) for mind in ("a", "b")]
    store = gate.state.store
    harness.pump(lambda: all(r.state == QueueState.DONE for r in store.rows(ids)), timeout=30)
    harness.pump(lambda: not store.rows(seeded.gone), timeout=30)
    assert len(batches) >= 6  # 1,500 rows: six batches at least
    assert not any(started for started, _ in batches)
    assert any(running for _, running in batches)  # some ran while a turn was running
    assert len(store.rows(seeded.kept)) == len(seeded.kept)


def test_a_gate_sigkilled_mid_batch_loses_nothing_it_keeps_and_the_next_one_finishes(
    tmp_path: Path, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, seeded = seeded_state(tmp_path, old_done=600)
    before = snapshot(path)
    config = tmp_path / "volutectl.toml"
    socket_dir = short_socket_dir()
    gate = {
        "socket": str(socket_dir / "gate.sock"), "socket_group": ME,
        "state_dir": str(tmp_path / "state"), "runtime_dir": str(tmp_path / "run"),
        "watchdog": False,
    }  # fmt: skip
    config.write_text(gate_config({"m": "true"}, gate=gate, turns={"default_user": ME}))
    killed = run_child(["gate", str(config)], crash_at="retention_deleted")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    # The batch's 256 deletions died uncommitted: every row is there, and unchanged
    # but for the hold the gate recorded on the pending row (not a change of state).
    after = snapshot(path)
    assert after["turns"] == before["turns"]
    assert set(after["deliveries"]) == set(before["deliveries"])
    assert unheld(after) == unheld(before)
    monkeypatch.setattr(retention, "PACING", Pacing(start_delay=0.0, busy_gap=0.0))
    harness = Harness(tmp_path, minds={"m": "true"}, retention_days=KEEP_DAYS)
    harnesses.append(harness)
    store = harness.gate.state.store
    harness.pump(lambda: not store.rows(seeded.gone), timeout=20)
    left = snapshot(path)
    assert set(left["deliveries"]) == seeded.kept
    assert set(left["turns"]) == seeded.kept_turns
    kept = unheld(before)
    assert unheld(left) == {delivery_id: kept[delivery_id] for delivery_id in seeded.kept}
    for turn_id in seeded.kept_turns:
        assert left["turns"][turn_id] == before["turns"][turn_id]
    remove_tree(socket_dir)
