"""The gate checkpoints its WAL when it has been quiet, not inside a handoff's commit."""

from __future__ import annotations

import time
from pathlib import Path

from tests.unit.gate_harness import Harness
from volutectl.store import indexed


def test_the_gate_checkpoints_after_a_quiet_second_not_on_each_commit(tmp_path: Path) -> None:
    harness = Harness(tmp_path, minds={"mimsy": "sleep 30"})
    store = harness.gate.state.store
    database = store.path
    try:
        harness.run_for(indexed.CHECKPOINT_QUIET_SECONDS + 0.5)  # start's commits
        assert store.checkpoint_deadline() is None
        peer = harness.connect()
        size = database.stat().st_size
        for _ in range(40):  # the first starts a turn; the rest are held by it
            reply = peer.request({"op": "deliver", "mind": "mimsy", "message": "x" * 2000})
            assert reply.get("ok") is True, reply
        assert database.stat().st_size == size  # every page still in the WAL
        deadline = store.checkpoint_deadline()
        assert deadline is not None and deadline > time.monotonic()
        harness.run_for(indexed.CHECKPOINT_QUIET_SECONDS + 0.5)
        assert store.checkpoint_deadline() is None
        assert database.stat().st_size > size + 40 * 2000  # the rows reached the database
    finally:
        harness.close()
