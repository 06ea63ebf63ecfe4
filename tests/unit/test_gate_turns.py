"""The real gate in-process, when systemd or the disk fails to answer about its turns.

A turn is settled only on an answer: a failed question keeps it in its place and is
asked again; a failed listing stops admission rather than starting a turn on a guess; a
settlement the disk refuses is tried again. Turns are real processes; systemd is the
fake of tests/unit/fake_systemd.py, told to fail on demand.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.gate_harness import Harness
from volutectl import events


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    opened = Harness(tmp_path, minds={"m": "sleep 0.3", "n": "true"})
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
    harness.run_for(2.5)  # the real loop's own timeouts: it must wake to retry
    assert harness.manager.scopes == {}  # no turn started on a guess
    assert state_of(harness, delivery) == "pending"
    failures = harness.journal.of(events.AdmissionFailing)  # said once
    assert len(failures) == 1 and failures[0].level == "error", harness.journal.events
    assert harness.manager.calls["list_units"] >= 3  # retried about once a second
    harness.manager.failing.clear()
    harness.pump(lambda: state_of(harness, delivery) == "done")
    assert len(harness.journal.of(events.AdmissionWorks)) == 1


def test_a_question_that_fails_never_settles_a_turn(harness: Harness) -> None:
    delivery = harness.deliver_ok(mind="m")
    harness.pump(lambda: state_of(harness, delivery) == "running")
    [turn] = harness.gate.state.turns.all()
    harness.manager.failing.update({"active_state", "unit_processes"})
    # Its process exits; every question about its scope fails.
    harness.pump(lambda: not turn.main_alive(), timeout=5)
    harness.run_for(1.5)
    assert harness.gate.state.turns.holds(turn)
    assert turn.recheck_at is not None
    assert state_of(harness, delivery) == "running"
    assert harness.manager.calls["active_state"] >= 2  # asked again, not given up on
    warnings = harness.journal.of(events.TurnUnanswered)
    assert [(w.turn_id, w.level) for w in warnings] == [(turn.id, "warning")]
    # The answers come back: it is settled, once, as the exit status says.
    harness.manager.failing.clear()
    harness.pump(lambda: state_of(harness, delivery) == "done")
    assert not harness.gate.state.turns.holds(turn)


def test_a_turn_whose_settlement_the_disk_refuses_keeps_its_place_until_it_can(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = harness.gate.state.store
    real = store.settle_turn
    refused: list[int] = []

    def full_disk(turn_id: int, **kwargs: object) -> None:
        if len(refused) < 2:
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
    harness.pump(lambda: len(refused) == 2, timeout=10)
    assert state_of(harness, held) == "pending"  # the unsettled turn still holds m's place
    harness.pump(lambda: state_of(harness, held) == "done", timeout=10)
    assert state_of(harness, first) == "done"
    assert refused == [refused[0]] * 2  # the same turn, tried again
    unsettled = harness.journal.of(events.TurnNotSettled)
    assert [(u.turn_id, u.level) for u in unsettled] == [(refused[0], "error")] * 2
