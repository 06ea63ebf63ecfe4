"""What a turn's main process left behind, stopped at the end of its grace
(volutectl/gate/turns.py carrying out volutectl/gate/lifecycle.py's StopLeftovers): said
once in the journal with what systemd lists in the scope, stopped through the turn's
hands, and a stop that failed tried again a second later, not said again. The real
thing, in a real systemd: tests/system/test_leftovers.py."""

from __future__ import annotations

import time
from typing import Any, cast

from tests.unit.gate_harness import RecordingJournal
from volutectl import events
from volutectl.config.reload import SettingsHolder
from volutectl.config.settings import Settings
from volutectl.gate import lifecycle
from volutectl.gate.turns import Turn, Turns
from volutectl.launcher.hands import LauncherUnavailable

EXITED_AT = 100.0
GRACE = 5.0


class Hands:
    """The turn's hands, as far as a stop goes: each stop recorded, the first `fail` refused."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.stops: list[tuple[int, str]] = []

    def stop(self, turn_id: int, mind: str) -> None:
        self.stops.append((turn_id, mind))
        if len(self.stops) <= self.fail:
            raise LauncherUnavailable("the launcher does not answer")


def lingering_turn(hands: Hands, listed: list[int] | None) -> tuple[Turns, Turn, RecordingJournal]:
    journal = RecordingJournal()
    turns = Turns(
        SettingsHolder(Settings.model_validate({"turns": {"leftover_grace_seconds": GRACE}})),
        cast(Any, None),  # the store: a stop of leftovers writes nothing
        cast(Any, hands),
        journal,
        notify=lambda settled: None,
        watch_fd=lambda fd, turn: None,
        unwatch_fd=lambda fd: None,
        wake=lambda: None,
        processes=lambda unit: listed,
        ask=lambda turn: lifecycle.ScopeHolds(),  # systemd: its scope still holds a process
    )
    turn = Turn(7, "m", "main", "volute-turn-m-7.scope", 90.0, lifecycle.Starting())
    turns.apply(turn, lifecycle.StartReported(pidfd=-1))
    turns.apply(turn, lifecycle.MainExited(now=EXITED_AT, grace=GRACE))
    return turns, turn, journal


def test_leftovers_are_stopped_once_at_the_end_of_the_grace_and_said() -> None:
    hands = Hands()
    turns, turn, journal = lingering_turn(hands, [4242, 4243])
    assert lifecycle.stop_at(turn.state) == EXITED_AT + GRACE
    turns.apply(turn, lifecycle.Due(now=EXITED_AT + GRACE - 0.1))
    assert hands.stops == []  # not before its grace is over
    turns.apply(turn, lifecycle.Due(now=EXITED_AT + GRACE))
    assert hands.stops == [(7, "m")]
    [said] = journal.of(events.TurnLeftoversStopped)
    assert (said.unit, said.processes, said.pids) == ("volute-turn-m-7.scope", 2, "4242 4243")
    assert said.message_id() == "2d205a995f8641a19a2a39c0bfb48530"
    turns.apply(turn, lifecycle.Due(now=EXITED_AT + 60))
    assert hands.stops == [(7, "m")]  # once
    assert turns.holds(turn)  # its place is freed when systemd says the scope ended


def test_a_stop_that_fails_is_tried_again_a_second_later_and_said_once() -> None:
    hands = Hands(fail=2)
    turns, turn, journal = lingering_turn(hands, [4242])
    turns.apply(turn, lifecycle.Due(now=EXITED_AT + GRACE))
    for attempt in (2, 3):
        failed_at = time.time()
        again = lifecycle.stop_at(turn.state)
        assert again is not None and failed_at - 0.5 < again - 1.0 <= failed_at  # a second on
        turns.apply(turn, lifecycle.Due(now=again - 0.01))
        assert len(hands.stops) == attempt - 1
        turns.apply(turn, lifecycle.Due(now=again))
        assert len(hands.stops) == attempt
    assert lifecycle.stop_at(turn.state) is None  # the third worked: nothing more owed
    assert len(journal.of(events.TurnLeftoversStopped)) == 1
    assert len(journal.of(events.TurnStopFailed)) == 1
