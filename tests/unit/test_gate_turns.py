"""The real gate in-process, when systemd or the disk fails to answer about its turns.

A turn is settled only on an answer: a failed question keeps it in its place and is
asked again; a failed listing stops admission rather than starting a turn on a guess; a
settlement the disk refuses is tried again. Turns are real processes; systemd is the
fake of tests/unit/fake_systemd.py, told to fail on demand. The gate's clock is
tests/unit/fake_clock.py's: a retry comes when the test moves the clock to it, not
before.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness
from volutectl import events
from volutectl.gate.lifecycle import ASK_AGAIN_SECONDS
from volutectl.gate.loop import ADMIT_RETRY_SECONDS


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    opened = Harness(tmp_path, minds={"m": "sleep 0.3", "n": "true"}, clock=FakeClock())
    yield opened
    opened.close()


def state_of(harness: Harness, delivery_id: int) -> str:
    row = harness.gate.state.store.row(delivery_id)
    assert row is not None
    return row.state


def test_a_listing_that_fails_starts_nothing_says_so_once_and_retries(
    harness: Harness,
) -> None:
    harness.manager.failing.add("list_units")
    delivery = harness.deliver_ok(mind="n")
    harness.advance(0)
    listed = harness.manager.calls["list_units"]
    assert listed >= 1
    # The gate's own deadline wakes it to retry, once a second, and not before.
    assert harness.gate.timeout() == pytest.approx(ADMIT_RETRY_SECONDS, abs=1e-5)
    for second in range(1, 4):
        harness.advance(ADMIT_RETRY_SECONDS * 0.9)
        assert harness.manager.calls["list_units"] == listed + second - 1
        harness.advance(ADMIT_RETRY_SECONDS * 0.1)
        assert harness.manager.calls["list_units"] == listed + second
        assert harness.manager.scopes == {}  # no turn started on a guess
        assert state_of(harness, delivery) == "pending"
    failures = harness.journal.of(events.AdmissionFailing)  # said once
    assert len(failures) == 1 and failures[0].level == "error", harness.journal.events
    harness.manager.failing.clear()
    harness.advance(ADMIT_RETRY_SECONDS)
    harness.pump(lambda: state_of(harness, delivery) == "done")
    assert len(harness.journal.of(events.AdmissionWorks)) == 1


def test_a_question_that_fails_never_settles_a_turn(harness: Harness) -> None:
    delivery = harness.deliver_ok(mind="m")
    harness.pump(lambda: state_of(harness, delivery) == "running")
    [turn] = harness.gate.state.turns.all()
    harness.manager.failing.update({"active_state", "unit_processes"})
    # Its process exits; every question about its scope fails.
    harness.pump(lambda: turn.recheck_at is not None, timeout=5)
    for _ in range(3):  # asked again within each ASK_AGAIN_SECONDS, never given up on
        asked = harness.manager.calls["active_state"]
        harness.advance(ASK_AGAIN_SECONDS)
        assert harness.manager.calls["active_state"] > asked
        assert harness.gate.state.turns.holds(turn)
        assert turn.recheck_at is not None
        assert state_of(harness, delivery) == "running"
    warnings = harness.journal.of(events.TurnUnanswered)
    assert [(w.turn_id, w.level) for w in warnings] == [(turn.id, "warning")]
    # The answers come back: it is settled, once, as the exit status says.
    harness.manager.failing.clear()
    harness.advance(ASK_AGAIN_SECONDS)
    assert state_of(harness, delivery) == "done"
    assert not harness.gate.state.turns.holds(turn)


def test_a_turn_whose_settlement_the_disk_refuses_keeps_its_place_until_it_can(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = harness.gate.state.store
    real = store.settle_turn
    refused: list[int] = []
    disk_full = True

    def full_disk(turn_id: int, **kwargs: object) -> None:
        if disk_full:
            refused.append(turn_id)
            raise sqlite3.OperationalError("database or disk is full")
        real(turn_id, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "settle_turn", full_disk)
    first = harness.deliver_ok(mind="m")
    harness.pump(lambda: state_of(harness, first) == "running")
    reply = harness.connect().request(
        {"op": "deliver", "mind": "m", "session": "other", "message": "after"}
    )
    held = int(reply["id"])  # same mind, another session: waits for m's one place
    harness.pump(lambda: len(refused) >= 1, timeout=10)
    tried = len(refused)
    for _ in range(5):  # passes, but the clock stands still: not tried again yet
        harness.step(0.01)
    assert len(refused) == tried
    assert state_of(harness, held) == "pending"  # the unsettled turn still holds m's place
    harness.advance(ASK_AGAIN_SECONDS)  # tried again once the clock says so
    assert len(refused) > tried
    assert state_of(harness, held) == "pending" and state_of(harness, first) == "running"
    disk_full = False
    harness.advance(ASK_AGAIN_SECONDS)
    harness.pump(lambda: state_of(harness, held) == "done", timeout=10)
    assert state_of(harness, first) == "done"
    assert refused == [refused[0]] * len(refused)  # the same turn, tried again
    unsettled = harness.journal.of(events.TurnNotSettled)
    assert [(u.turn_id, u.level) for u in unsettled] == [(refused[0], "error")] * len(refused)
