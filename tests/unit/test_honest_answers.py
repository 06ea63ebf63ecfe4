"""What the gate and volutectl tell a user who asks again, or asks why: a request id sent
again, retry and drop per id, the views of a delivery backing off, a lowered
max_attempts, and the test-slot line. Against the real gate in-process
(tests/unit/gate_harness.py), with volutectl's own clients run in a thread.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.unit.gate_harness import Harness
from tests.unit.test_gate_wait import InThread, deliver_to, state_of
from volutectl import events
from volutectl.cli import client as client_commands
from volutectl.cli import deliver, statusview
from volutectl.cli.statusview import format_status
from volutectl.errors import EX_DATAERR, VoluteError
from volutectl.gate.status import gate_line
from volutectl.states import QueueState
from volutectl.wire import messages
from volutectl.wire.messages import ChangedReply, RepositoryStatus, Status

# -- request ids the user chose -----------------------------------------------------------


def test_a_request_id_sent_again_gives_back_its_delivery_and_other_content_is_65(
    tmp_path: Path, harnesses: list[Harness], capsys: pytest.CaptureFixture[str]
) -> None:
    harness = Harness(tmp_path, minds={"mimsy": "true"})
    harnesses.append(harness)
    base = ["mimsy", "--socket", str(harness.socket_path), "--request-id", "nightly-2026.12.01"]

    def send(message: str) -> InThread:
        client = InThread(lambda: deliver.deliver_main([*base, "-m", message]))
        harness.pump(client.done)
        return client

    first = send("backup")
    assert (first.error, first.result) == (None, 0)
    out = capsys.readouterr()
    assert "already" not in out.err
    again = send("backup")
    assert (again.error, again.result) == (None, 0)
    resent = capsys.readouterr()
    assert resent.out == out.out  # the same delivery id, as the first printed
    assert "nightly-2026.12.01 was queued already" in resent.err
    other = send("restore")
    assert isinstance(other.error, VoluteError) and other.error.exit_code == EX_DATAERR
    assert "nightly-2026.12.01" in other.error.message
    assert len(harness.gate.state.store.rows(range(1, 10), with_message=False)) == 1


@pytest.mark.parametrize("bad", ["", "-leading", "a b", "x" * 129, "caf\u00e9", "a/b"])
def test_a_bad_request_id_is_65_before_anything_is_sent(bad: str) -> None:
    with pytest.raises(VoluteError) as refused:
        deliver.deliver_main(
            ["mimsy", "-m", "x", "--socket", "/nonexistent", f"--request-id={bad}"]
        )
    assert refused.value.exit_code == EX_DATAERR
    assert "invalid request id" in refused.value.message


# -- retry and drop say why, per id -------------------------------------------------------


def test_retry_and_drop_name_the_state_of_each_id_they_left_alone(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(tmp_path, minds={"ok": "true", "slow": "sleep 5"})
    harnesses.append(harness)
    done, running = deliver_to(harness, "ok"), deliver_to(harness, "slow")
    harness.pump(lambda: state_of(harness, done) is QueueState.DONE)
    harness.pump(lambda: state_of(harness, running) is QueueState.RUNNING)
    peer = harness.connect()
    reply = peer.request({"op": "retry", "ids": [done, running, 404, done]})
    assert reply == {
        "v": 1, "ok": True, "changed": [],
        "unchanged": [
            {"id": done, "state": "done"}, {"id": running, "state": "running"},
            {"id": 404, "state": None},
        ],
    }  # fmt: skip
    dropped = ChangedReply.from_wire(peer.request({"op": "drop", "ids": [running, 404]}))
    with pytest.raises(VoluteError) as said:
        client_commands.report_changed("dropped", (running, 404), dropped)
    assert said.value.exit_code == EX_DATAERR
    assert said.value.message == (
        f"not dropped: {running} (running now: a turn carries it), "
        "404 (no such delivery: never queued, or removed by retention)"
    )


# -- views agree on backing off; a lowered max_attempts --------------------------------------


def test_status_the_status_line_and_queue_count_a_backing_off_delivery_alike(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(
        tmp_path, minds={"bad": "exit 3"}, max_attempts=5, backoff_initial_seconds=60,
        backoff_max_seconds=60,
    )  # fmt: skip
    harnesses.append(harness)
    delivery_id = deliver_to(harness, "bad")
    store = harness.gate.state.store
    harness.pump(lambda: getattr(store.row(delivery_id), "attempts", 0) == 1)
    status = harness.connect().request({"op": "status"})["status"]
    assert (status["queue_depth"], status["backing_off"]) == (1, 1)
    assert "1 backing off" in gate_line(harness.gate.state, time.time(), 0)
    [row] = harness.connect().request({"op": "queue"})["rows"]
    assert row["id"] == delivery_id and row["not_before"] > time.time() + 30
    shown = format_status(Status.from_wire(status))
    assert "queue: 1 pending (1 backing off)" in shown


def test_a_lowered_max_attempts_applies_to_a_pending_delivery_at_its_next_failure(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    """A delivery with 8 attempts (of an older maximum of 10) under max_attempts = 3: its
    next failure is its last, not 2 more after it."""
    harness = Harness(tmp_path, minds={"bad": "exit 3"}, max_attempts=3)
    harnesses.append(harness)
    assert harness.connect().request({"op": "pause", "minds": ["bad"]})["ok"] is True
    delivery_id = deliver_to(harness, "bad")
    store = harness.gate.state.store
    with store.db:
        store.db.execute("UPDATE deliveries SET attempts = 8 WHERE id = ?", (delivery_id,))
    assert harness.connect().request({"op": "resume", "minds": ["bad"]})["ok"] is True
    harness.pump(lambda: state_of(harness, delivery_id) is QueueState.DEAD, timeout=15)
    [died] = harness.journal.of(events.DeliveryDied)
    assert died.attempts == 9
    assert len(harness.journal.of(events.TurnEnded)) == 1  # one turn: no backoff, no more


def test_the_queue_line_and_the_test_slot_line_say_what_they_count() -> None:
    runs = tuple(
        messages.TestRunStatus(f"run-{n}.scope", "/srv/repo", "make check", 1.0) for n in (1, 2, 3)
    )
    repo = RepositoryStatus(repository="/srv/repo/.git", slots_held=0, slots=1, runs=runs)
    line = statusview._slots_line(repo, count_as_turns=False)
    assert line.startswith("test slots: 0 of 1 held in /srv/repo/.git; 3 runs without a slot")
    assert "no test cap set" in line and "tests.concurrent_runs = 0" in line
    capped = RepositoryStatus("/r/.git", 2, 2, repo.runs[:2])
    assert statusview._slots_line(capped, count_as_turns=True) == (
        "test slots: 2 of 2 held in /r/.git (count as turns)"
    )
