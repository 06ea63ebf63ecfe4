"""Waiting later (`wait`, `volutectl wait`), and `deliver --wait`, against the real gate
in-process: the op's events, its refusals, and a client that outlives a crash of the
gate by reconnecting and sending `wait` again for what has not settled.

The clients under test are volutectl's own (volutectl/cli/waiting.py, volutectl/cli/deliver.py),
run in a thread while this one drives the gate (tests/unit/gate_harness.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.unit.gate_harness import Harness
from volutectl.cli import deliver, waiting
from volutectl.errors import EX_DATAERR, EX_TEMPFAIL, EX_UNAVAILABLE, VoluteError
from volutectl.states import Outcome, QueueState
from volutectl.wire.messages import (
    MAX_WAIT_IDS,
    AttemptFailed,
    DeliveryDead,
    DeliveryDropped,
    Event,
    TurnEnded,
)


def deliver_to(harness: Harness, mind: str) -> int:
    reply = harness.connect().request({"op": "deliver", "mind": mind, "message": "m"})
    assert reply["ok"] is True, reply
    return int(reply["id"])


def state_of(harness: Harness, delivery_id: int) -> QueueState | None:
    row = harness.gate.state.store.row(delivery_id)
    return row.state if row is not None else None


class InThread:
    """Run a client call in a thread, while the test steps the gate."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.result = call()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            self.error = error

    def done(self) -> bool:
        return not self.thread.is_alive()


def test_wait_answers_with_the_ids_then_one_event_each_at_once_for_those_settled(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(
        tmp_path, minds={"ok": "true", "bad": "exit 3", "slow": "sleep 0.5", "held": "true"},
        max_attempts=1,
    )  # fmt: skip
    harnesses.append(harness)
    done, dead = deliver_to(harness, "ok"), deliver_to(harness, "bad")
    harness.pump(lambda: state_of(harness, done) is QueueState.DONE)
    harness.pump(lambda: state_of(harness, dead) is QueueState.DEAD)
    assert harness.connect().request({"op": "pause", "minds": ["held"]})["ok"] is True
    dropped = deliver_to(harness, "held")
    assert harness.connect().request({"op": "drop", "ids": [dropped]})["changed"] == [dropped]
    slow = deliver_to(harness, "slow")
    peer = harness.connect()
    reply = peer.request({"op": "wait", "ids": [slow, done, dead, done, dropped]})
    assert reply == {"v": 1, "ok": True, "ids": [slow, done, dead, dropped]}  # each once
    at_once = [peer.reply() for _ in range(3)]
    assert [(e["event"], e["id"]) for e in at_once] == [
        ("turn_ended", done), ("dead", dead), ("dropped", dropped)
    ]  # fmt: skip
    assert (at_once[0]["exit_code"], at_once[1]["exit_code"]) == (0, 3)
    assert not peer.has_line()  # slow has not settled yet
    later = peer.reply(timeout=10)
    assert (later["event"], later["id"], later["outcome"]) == ("turn_ended", slow, "ok")
    # Nothing more is owed: the connection goes back to being an ordinary one.
    assert peer.request({"op": "wait", "ids": []}) == {"v": 1, "ok": True, "ids": []}
    assert peer.request({"op": "ping"}) == {"v": 1, "ok": True}


def test_wait_refuses_unknown_ids_naming_them_and_too_many_ids(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(tmp_path)
    harnesses.append(harness)
    known = deliver_to(harness, "mimsy")
    peer = harness.connect()
    reply = peer.request({"op": "wait", "ids": [known, 404, 9_000_000_000]})
    assert (reply["ok"], reply["code"]) == (False, EX_DATAERR)
    assert reply["error"] == "ids: no delivery 404, 9000000000"
    assert "retention" in reply["hint"]
    many = list(range(1, MAX_WAIT_IDS + 2))
    reply = peer.request({"op": "wait", "ids": many})
    too_many = f"ids: at most {MAX_WAIT_IDS} deliveries in one wait, not {len(many)}"
    assert (reply["code"], reply["error"]) == (EX_DATAERR, too_many)
    for bad in ([0], ["1"], [1.5], "1", None):
        assert peer.request({"op": "wait", "ids": bad})["code"] == EX_DATAERR, bad
    assert harness.gate.waiters.by_delivery == {}  # a refused wait keeps no waiter
    assert peer.request({"op": "ping"})["ok"] is True


def test_volutectl_wait_reconnects_after_the_gate_dies_and_exits_with_the_turns_code(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(tmp_path, minds={"m": "sleep 0.8; exit 7", "quick": "true"}, max_attempts=1)
    harnesses.append(harness)
    quick, slow = deliver_to(harness, "quick"), deliver_to(harness, "m")
    path = str(harness.socket_path)
    client = InThread(lambda: waiting.settle(path, (slow, quick), timeout=10))
    harness.pump(lambda: slow in harness.gate.waiters.by_delivery)
    harness.crash()  # the waiting connection ends with EOF; the turn goes on
    threading.Event().wait(0.3)  # the client finds nothing listening, and keeps trying
    assert not client.done()
    harness.restart()
    harness.pump(client.done, timeout=15)
    assert client.error is None, client.error
    events = client.result
    assert isinstance(events[quick], TurnEnded) and isinstance(events[slow], DeliveryDead)
    assert (events[slow].exit_code, events[slow].outcome) == (7, Outcome.FAILED)
    assert waiting.exit_code((quick, slow), events) == 7
    assert waiting.exit_code((slow, quick), events) == 7


def test_deliver_wait_outlives_a_gate_crash_after_its_ack(
    tmp_path: Path, harnesses: list[Harness], capsys: pytest.CaptureFixture[str]
) -> None:
    harness = Harness(tmp_path, minds={"m": "sleep 0.6; exit 5"}, max_attempts=1)
    harnesses.append(harness)
    argv = ["m", "--message", "x", "--wait", "--socket", str(harness.socket_path)]
    client = InThread(lambda: deliver.deliver_main(argv))
    harness.pump(lambda: bool(harness.gate.waiters.by_delivery))
    [delivery_id] = harness.gate.waiters.by_delivery
    harness.crash()
    harness.restart()
    harness.pump(client.done, timeout=15)
    assert (client.error, client.result) == (None, 5)
    assert capsys.readouterr().out == f"{delivery_id}\n"
    assert state_of(harness, delivery_id) is QueueState.DEAD


def test_a_gate_that_does_not_come_back_is_75_and_one_never_there_is_69(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(tmp_path, minds={"m": "sleep 2"})
    harnesses.append(harness)
    delivery_id = deliver_to(harness, "m")
    path = str(harness.socket_path)
    client = InThread(lambda: waiting.settle(path, (delivery_id,), timeout=0.5))
    harness.pump(lambda: delivery_id in harness.gate.waiters.by_delivery)
    harness.crash()
    client.thread.join(timeout=10)
    assert isinstance(client.error, VoluteError) and client.error.exit_code == EX_TEMPFAIL
    assert f"volutectl wait {delivery_id}" in str(client.error.hint)
    with pytest.raises(VoluteError) as absent:
        waiting.settle(str(tmp_path / "nothing.sock"), (1,), timeout=5)
    assert absent.value.exit_code == EX_UNAVAILABLE
    harness.restart()  # so that the fixture closes a gate


def test_the_exit_code_of_several_is_the_first_failure_in_the_order_given() -> None:
    ok = TurnEnded(1, 1, Outcome.OK, 0, 0)
    timeout = DeliveryDead(2, "turn 2 ran past its time limit", 124, 2, Outcome.TIMEOUT)
    failed = DeliveryDead(3, "turn 3 exited 9", 9, 3, Outcome.FAILED)
    events: dict[int, Event] = {1: ok, 2: timeout, 3: failed, 4: DeliveryDropped(4)}
    assert waiting.exit_code((1,), events) == 0
    assert waiting.exit_code((1, 3, 2), events) == 9
    assert waiting.exit_code((2, 3), events) == 124
    assert waiting.exit_code((4, 3), events) == 1


# -- progress while waiting: each failed attempt, to whoever asked ------------------------


def test_each_failed_attempt_is_told_to_the_waiters_that_asked_and_only_to_them(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(
        tmp_path, minds={"bad": "exit 3"}, max_attempts=3, backoff_initial_seconds=0.05,
        backoff_max_seconds=0.05,
    )  # fmt: skip
    harnesses.append(harness)
    asked, plain = harness.connect(), harness.connect()
    ack = asked.request(
        {"op": "deliver", "mind": "bad", "message": "m", "wait": True, "progress": True}
    )
    assert ack == {"v": 1, "ok": True, "id": ack["id"]}
    delivery_id = ack["id"]
    assert plain.request({"op": "wait", "ids": [delivery_id]})["ok"] is True
    told = [asked.reply(timeout=15) for _ in range(3)]
    assert [event["event"] for event in told] == ["attempt_failed", "attempt_failed", "dead"]
    for number, event in enumerate(told[:2], start=1):
        assert (event["id"], event["attempt"], event["max_attempts"]) == (delivery_id, number, 3)
        assert (event["outcome"], event["exit_status"]) == ("failed", 3)
        assert event["error"] == f"turn {event['turn_id']} exited 3"
        assert event["next_try_at"] > 0
    assert told[0]["turn_id"] != told[1]["turn_id"]
    # The waiter that did not ask (an older client) hears only what settles it.
    assert plain.reply(timeout=15)["event"] == "dead"
    assert not plain.has_line()


def test_deliver_wait_says_each_attempt_on_stderr_then_exits_with_the_last_turns_code(
    tmp_path: Path, harnesses: list[Harness], capsys: pytest.CaptureFixture[str]
) -> None:
    harness = Harness(
        tmp_path, minds={"bad": "exit 4"}, max_attempts=3, backoff_initial_seconds=0.05,
        backoff_max_seconds=0.05,
    )  # fmt: skip
    harnesses.append(harness)
    argv = ["bad", "--message", "x", "--wait", "--socket", str(harness.socket_path)]
    client = InThread(lambda: deliver.deliver_main(argv))
    harness.pump(client.done, timeout=15)
    assert (client.error, client.result) == (None, 4)
    err = capsys.readouterr().err
    assert "attempt 1 of 3 failed: turn" in err and "attempt 2 of 3 failed" in err
    assert "exit status 4" in err and "next try at" in err
    assert "is dead" in err


def test_max_wait_gives_up_with_the_wait_line_and_leaves_the_delivery_alone(
    tmp_path: Path, harnesses: list[Harness], capsys: pytest.CaptureFixture[str]
) -> None:
    harness = Harness(tmp_path, minds={"slow": "sleep 1"})
    harnesses.append(harness)
    argv = ["slow", "-m", "x", "--wait", "--max-wait", "0.3", "--socket", str(harness.socket_path)]
    client = InThread(lambda: deliver.deliver_main(argv))
    harness.pump(client.done, timeout=10)
    assert isinstance(client.error, VoluteError) and client.error.exit_code == EX_TEMPFAIL
    delivery_id = int(capsys.readouterr().out)
    assert "--max-wait" in client.error.message
    assert f"volutectl wait {delivery_id}" in str(client.error.hint)
    assert state_of(harness, delivery_id) is QueueState.RUNNING  # untouched: it goes on
    harness.pump(lambda: state_of(harness, delivery_id) is QueueState.DONE)
    path = str(harness.socket_path)
    later = InThread(lambda: waiting.settle(path, (delivery_id,), 5, max_wait=5))
    harness.pump(later.done)
    assert later.error is None and isinstance(later.result[delivery_id], TurnEnded)


def test_a_describe_attempt_names_the_turn_its_exit_the_count_and_the_next_try() -> None:
    attempt = AttemptFailed(
        id=3, error="turn 7 exited 137", attempt=2, max_attempts=10, next_try_at=1000.0,
        turn_id=7, outcome=Outcome.FAILED, exit_status=137,
    )  # fmt: skip
    text = waiting.describe_attempt(attempt, now=990.0)
    assert text.startswith("delivery 3: attempt 2 of 10 failed: turn 7 exited 137")
    assert "killed by SIGKILL" in text and text.endswith(", in 10.0s")
