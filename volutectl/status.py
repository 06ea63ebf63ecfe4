"""`volutectl status`'s answer, built by the gate: what runs, what waits and why.

Live turns are counted as admission counts them (scopes that hold a process); if
systemd does not answer, the status says what the gate last knew rather than failing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from volutectl import preflight
from volutectl.errors import VoluteError
from volutectl.messages import (
    MindStatus,
    PressureStatus,
    RepositoryStatus,
    Status,
    TestRunStatus,
    TurnStatus,
)
from volutectl.states import QueueState
from volutectl.testscopes import list_in_flight

if TYPE_CHECKING:
    from volutectl.handlers import GateState


def build(state: GateState) -> Status:
    try:
        live, foreign = state.liveness.count_live()
    except VoluteError:
        live, foreign = [], state.foreign_live  # systemd did not answer: what we know
    live_ids = {turn.turn_id for turn in live}
    now = time.time()
    turns = tuple(
        TurnStatus(turn.id, turn.mind, turn.session, turn.unit, round(now - turn.started_at, 3))
        for turn in state.turns.all()
        if turn.id in live_ids
    )
    index = state.store.index  # counts kept in step with every commit: no scan
    running: dict[str, list[str]] = {name: [] for name in state.settings.minds}
    waiting = {name: index.pending_of(name) for name in {*state.settings.minds, *index.minds}}
    for turn in turns:
        running.setdefault(turn.mind, []).append(turn.session)
    holds = {str(reason): count for reason, count in index.counts.items()}
    minds = {
        name: MindStatus(tuple(running.get(name, [])), waiting.get(name, 0))
        for name in sorted(set(running) | set(waiting))
    }
    oldest = state.store.oldest_hold()
    return Status(
        active_turns=len(turns) + foreign,
        global_cap=state.limits.global_cap,
        turns_per_mind=state.limits.turns_per_mind,
        turns=turns,
        foreign_scopes=foreign,
        minds=minds,
        queue_depth=len(index),
        holds=holds,
        oldest_held_s=round(now - oldest, 3) if oldest is not None else None,
        dead=state.store.counts().get(QueueState.DEAD, 0),
        slice=state.settings.turns.slice,
        test_runs=_test_runs(state),
        io_pressure=_pressure(state),
        test_runs_count_as_turns=state.settings.limits.test_runs_count_as_turns,
        preflight=preflight.failing_recently(state.settings),  # a fix shows within 2 s
    )


def _test_runs(state: GateState) -> tuple[RepositoryStatus, ...]:
    """Per repository: slots held of N, and its runs from the tests slice's scopes."""
    try:
        runs = list_in_flight(state.manager, state.settings.tests.slice)  # type: ignore[arg-type]
    except VoluteError:
        runs = []
    return tuple(
        RepositoryStatus(
            str(entry["repository"]),
            entry["slots_held"],  # type: ignore[arg-type]
            entry["slots"],  # type: ignore[arg-type]
            tuple(
                TestRunStatus(str(r["unit"]), str(r["worktree"]), str(r["command"]), r["running_s"])
                for r in entry["runs"]  # type: ignore[attr-defined]
            ),
        )
        for entry in state.slots.status(runs)
    )


def _pressure(state: GateState) -> PressureStatus:
    watch = state.pressure
    if watch is None:
        return PressureStatus(enabled=False, high=False, reason=None, trigger=None)
    return PressureStatus(
        enabled=True, high=watch.high, reason=watch.reason, trigger=watch.describe()
    )
