"""The gate's reactor (volutectl/gate/reactor.py) and the events told to waiting clients
(volutectl/gate/outcomes.py)."""

from __future__ import annotations

import os

import pytest

from tests.unit.fake_clock import FakeClock
from volutectl.gate.outcomes import Settled
from volutectl.gate.reactor import Reactor
from volutectl.states import Outcome, QueueState
from volutectl.wire.messages import DeliveryDead, DeliveryDropped, TurnEnded


def test_a_ready_descriptor_is_called_back_and_an_unwatched_one_is_not() -> None:
    reactor = Reactor()
    read_end, write_end = os.pipe()
    called: list[int] = []
    try:
        reactor.watch(read_end, called.append)
        assert reactor.wait(0) is False and called == []
        os.write(write_end, b"x")
        assert reactor.wait(0) is True and len(called) == 1
        reactor.unwatch(read_end)
        reactor.unwatch(read_end)  # twice: no error
        assert reactor.wait(0) is False and len(called) == 1
    finally:
        reactor.close()
        os.close(read_end)
        os.close(write_end)


def test_the_timeout_is_the_nearest_deadline_and_only_due_ones_are_called() -> None:
    clock = FakeClock()
    reactor = Reactor(clock)
    assert reactor.timeout() is None  # nothing to wait for: sleep for ever
    now = clock.monotonic()
    due: list[tuple[str, float]] = []
    reactor.at(lambda: now - 1, lambda at: due.append(("past", at)))
    reactor.at(lambda: now + 60, lambda at: due.append(("future", at)))
    reactor.at(lambda: None, lambda at: due.append(("none", at)))
    reactor.at(lambda: now + 30)  # only wakes the loop
    assert reactor.timeout() == 0.0
    reactor.run_due()
    assert due == [("past", now)]
    clock.advance(29)
    reactor.run_due()
    assert reactor.timeout() == 0.0  # the past one stays due until its deadline moves
    due.clear()
    clock.advance(31)  # the future one comes, exactly at its time, with that time
    reactor.run_due()
    assert due == [("past", now + 60), ("future", now + 60)]
    reactor.close()


def test_the_timeout_counts_down_on_the_clock_it_was_given() -> None:
    clock = FakeClock()
    reactor = Reactor(clock)
    start = clock.monotonic()
    reactor.at(lambda: start + 30)
    assert reactor.timeout() == 30
    clock.advance(12.5)
    assert reactor.timeout() == 17.5
    clock.advance(100)
    assert reactor.timeout() == 0.0
    reactor.close()


def test_a_wall_clock_time_becomes_the_same_moment_on_the_monotonic_clock() -> None:
    clock = FakeClock()
    reactor = Reactor(clock)
    assert reactor.from_wall_clock(None) is None
    moment = reactor.from_wall_clock(clock.wall() + 100)
    assert moment == pytest.approx(clock.monotonic() + 100)
    reactor.close()


EVENTS = [
    (Settled(delivery_id=1, state=QueueState.PENDING), None),
    (Settled(delivery_id=1, state=QueueState.RUNNING), None),
    (Settled(delivery_id=1, state=QueueState.DROPPED), DeliveryDropped(1)),
    (
        Settled(
            delivery_id=1,
            state=QueueState.DONE,
            turn_id=7,
            outcome=Outcome.INTERRUPTED,
            exit_status=130,
        ),
        TurnEnded(id=1, turn_id=7, outcome=Outcome.INTERRUPTED, exit_status=130, exit_code=130),
    ),
    (  # dead after its last turn ran
        Settled(
            delivery_id=1,
            state=QueueState.DEAD,
            error="turn 7 exited 3",
            turn_id=7,
            outcome=Outcome.FAILED,
            exit_status=3,
        ),
        DeliveryDead(id=1, error="turn 7 exited 3", exit_code=3, turn_id=7, outcome=Outcome.FAILED),
    ),
    (  # dead after a turn that ran past its time limit
        Settled(
            delivery_id=1, state=QueueState.DEAD, error="e", turn_id=7, outcome=Outcome.TIMEOUT
        ),
        DeliveryDead(id=1, error="e", exit_code=124, turn_id=7, outcome=Outcome.TIMEOUT),
    ),
    (  # dead after a start that failed: no turn ran (live: no turn; replay: its row)
        Settled(delivery_id=1, state=QueueState.DEAD, error="no user"),
        DeliveryDead(id=1, error="no user"),
    ),
    (
        Settled(
            delivery_id=1,
            state=QueueState.DEAD,
            error="no user",
            turn_id=7,
            outcome=Outcome.START_FAILED,
        ),
        DeliveryDead(id=1, error="no user"),
    ),
]


@pytest.mark.parametrize(("settled", "event"), EVENTS)
def test_what_a_waiting_client_is_told(
    settled: Settled, event: TurnEnded | DeliveryDead | DeliveryDropped | None
) -> None:
    assert settled.event() == event
