"""The gate checkpoints its WAL when it has been quiet, not inside a handoff's commit: a
quiet second once the WAL holds CHECKPOINT_MIN_COMMITS, else a quiet
CHECKPOINT_IDLE_SECONDS (a checkpoint per turn wrote twice a turn's own commits)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness
from volutectl.store import indexed


def test_the_gate_checkpoints_after_a_quiet_while_not_on_each_commit(tmp_path: Path) -> None:
    clock = FakeClock()
    harness = Harness(tmp_path, minds={"mimsy": "sleep 30"}, clock=clock)
    store = harness.gate.state.store
    database = store.path
    try:
        harness.advance(indexed.CHECKPOINT_IDLE_SECONDS)  # start's commits
        assert store.checkpoint_deadline() is None
        peer = harness.connect()
        size = database.stat().st_size
        for _ in range(40):  # the first starts a turn; the rest are held by it
            reply = peer.request({"op": "deliver", "mind": "mimsy", "message": "x" * 2000})
            assert reply.get("ok") is True, reply
        assert database.stat().st_size == size  # every page still in the WAL
        deadline = store.checkpoint_deadline()
        # Fewer commits than CHECKPOINT_MIN_COMMITS: not after a quiet second, but a while.
        assert deadline == pytest.approx(clock.monotonic() + indexed.CHECKPOINT_IDLE_SECONDS)
        harness.advance(indexed.CHECKPOINT_IDLE_SECONDS * 0.9)  # not quiet long enough yet
        assert store.checkpoint_deadline() == deadline
        assert database.stat().st_size == size
        harness.advance(indexed.CHECKPOINT_IDLE_SECONDS * 0.1)
        assert store.checkpoint_deadline() is None
        assert database.stat().st_size > size + 40 * 2000  # the rows reached the database
    finally:
        harness.close()
