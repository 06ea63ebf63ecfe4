"""`volutectl status`'s answer, built by the gate: what runs, what waits and why; and
the one line the gate gives systemd (sd_notify STATUS=, `systemctl status`).

Live turns are counted as admission counts them (scopes that hold a process), by the
status handler just before `build` (`SystemdAsks.refresh`, which runs
volutectl/gate/liveness.py's `recount`: counting can settle a turn that ended); if
systemd does not answer, the status says what the gate last knew rather than failing.
`build` itself only reads.

No client can make the gate ask systemd more than a few times a second: what status
asks systemd (the turns slice's scopes, the tests slice's runs) is asked at most every
ASK_SYSTEMD_EVERY_SECONDS, and every status within that window shares the answer. Only
a change in the gate's own turns (which admission paces, not clients) asks again at
once, so that a status never shows a turn the gate has settled or misses one it started.

What a client sees of it (`seen_by`): every mind's name and counts, its running
sessions, the test runs (systemd shows their scopes to any user anyway); never a mind's
command, working directory, user or environment file, which preflight's findings and a
refused config's error quote from the config a client may not read. A client owns no
mind: a mind's user is kept out of group `volute` (README, "Minds apart"), so no client
is any mind's, and every mind is another's. An admin (root or `volute-admin`), who may
read the config, sees everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from volutectl import roles
from volutectl.core import admission
from volutectl.core.slotmath import InFlight
from volutectl.errors import VoluteError
from volutectl.launcher import preflight
from volutectl.slots.scopes import list_in_flight
from volutectl.states import AdaptiveMode, QueueState
from volutectl.store.minds import EVERY_MIND
from volutectl.systemd.journal import sd_notify
from volutectl.wire.messages import (
    ConfigStatus,
    MindStatus,
    PausedMind,
    PressureStatus,
    RepositoryStatus,
    Status,
    TestRunStatus,
    TurnStatus,
)

if TYPE_CHECKING:
    from volutectl.gate.state import GateState

# What status asks systemd is asked at most this often; statuses meanwhile share it.
ASK_SYSTEMD_EVERY_SECONDS = 0.25


class SystemdAsks:
    """What status last asked systemd, shared by every status in its window."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.at: float | None = None  # monotonic: when systemd was last asked
        self.turns: frozenset[int] = frozenset()  # the gate's turns once it had answered
        self.runs: list[InFlight] = []  # the tests slice's runs, as listed then
        self.asked = 0  # how many times (for the tests)

    def refresh(self, state: GateState) -> None:
        """Count the live turns and list the test runs, unless that was done less than
        ASK_SYSTEMD_EVERY_SECONDS ago and the gate's turns are the same since."""
        now = self.clock()
        turns = frozenset(turn.id for turn in state.turns.all())
        if self.at is not None and 0 <= now - self.at < ASK_SYSTEMD_EVERY_SECONDS:
            if turns == self.turns:
                return
        state.liveness.recount(known_foreign=state.foreign_live)  # settles what ended
        try:
            self.runs = list_in_flight(state.manager, state.settings.tests.slice)
        except VoluteError:
            self.runs = []
        self.at, self.asked = now, self.asked + 1
        self.turns = frozenset(turn.id for turn in state.turns.all())


def build(state: GateState) -> Status:
    """The status from what the gate holds: it reads, and changes nothing. The live
    turns are those of the last count for status (`Liveness.recount`, which the
    handler runs first)."""
    live_ids = state.liveness.census.live_ids
    foreign = state.liveness.census.foreign
    now = state.clock.wall()
    turns = tuple(
        TurnStatus(turn.id, turn.mind, turn.session, turn.unit, round(now - turn.started_at, 3))
        for turn in state.turns.all()
        if turn.id in live_ids
    )
    index = state.store.index  # counts kept in step with every commit: no scan
    holds = {str(reason): count for reason, count in index.counts.items()}
    pauses = state.store.minds.pauses()
    oldest = state.store.oldest_hold()
    return Status(
        active_turns=len(turns) + foreign,
        global_cap=state.limits.global_cap,
        turns_per_mind=state.limits.turns_per_mind,
        turns=turns,
        foreign_scopes=foreign,
        minds=_minds(state, turns, pauses, now),
        queue_depth=len(index),
        holds=holds,
        oldest_held_s=round(now - oldest, 3) if oldest is not None else None,
        dead=state.store.counts().get(QueueState.DEAD, 0),
        slice=state.settings.turns.slice,
        test_runs=_test_runs(state),
        io_pressure=_pressure(state),
        test_runs_count_as_turns=state.settings.limits.test_runs_count_as_turns,
        preflight=preflight.failing_recently(state.settings),  # a fix shows within 2 s
        paused=tuple(PausedMind(mind, since) for mind, since in pauses.items()),
        adaptive=state.adaptive.status() if state.adaptive is not None else None,
        backing_off=len(state.store.index.backing_off(now)),
        config=state.config,
        leases=state.leases.status() if state.leases is not None else (),
    )


# What a client reads in place of a mind's preflight findings and a refused config's
# error: both quote the config (commands, paths, users), which is an admin's to read.
WITHHELD = "withheld: an admin (root or group volute-admin) sees why"


def seen_by(built: Status, role: roles.Role) -> Status:
    """The status as `role` may see it: whole for an admin; for a client, each failing
    mind named with WITHHELD for its findings, and a refused reload with WITHHELD for its
    error (the module's docstring says why)."""
    if role is roles.Role.ADMIN:
        return built
    changes: dict[str, Any] = {"preflight": {mind: (WITHHELD,) for mind in built.preflight}}
    config = built.config
    if config is not None and config.refused is not None:
        changes["config"] = ConfigStatus(
            loaded_at=config.loaded_at,
            refused=WITHHELD,
            refused_at=config.refused_at,
            needs_restart=config.needs_restart,
        )
    fields = {name: getattr(built, name) for name in Status.FIELDS}
    return Status(**{**fields, **changes})


def _minds(
    state: GateState,
    turns: Iterable[TurnStatus],
    pauses: Mapping[str, float],
    now: float,
) -> dict[str, MindStatus]:
    """Every configured mind, and any other that runs, waits, is paused or has dead
    deliveries (one removed from the config since). Pending counts and next retries
    come from the gate's index of pending rows, not a scan of the queue."""
    running: dict[str, list[str]] = {}
    for turn in turns:
        running.setdefault(turn.mind, []).append(turn.session)
    index = state.store.index
    waiting = {name: index.pending_of(name) for name in index.minds}
    retry_at: dict[str, float] = {}
    for row in index.backing_off(now):
        if row.not_before is not None:
            retry_at[row.mind] = min(retry_at.get(row.mind, row.not_before), row.not_before)
    attempts = state.store.minds.attempts_by_mind()
    dead = state.store.minds.dead_counts()
    every = pauses.get(EVERY_MIND)
    named = set(state.settings.minds) | set(running) | set(waiting) | set(dead)
    last = state.store.minds.last_turns(named | set(pauses) - {EVERY_MIND})
    minds = {}
    for name in sorted(named | set(pauses) - {EVERY_MIND}):
        since = [t for t in (pauses.get(name), every) if t is not None]
        ended = last.get(name)
        minds[name] = MindStatus(
            running_sessions=tuple(running.get(name, [])),
            pending=waiting.get(name, 0),
            paused_since=min(since) if since else None,
            attempts=attempts.get(name, 0),
            next_retry_s=round(retry_at[name] - now, 3) if name in retry_at else None,
            last_turn_id=ended.turn_id if ended else None,
            last_turn_s=round(now - ended.ended_at, 3) if ended else None,
            last_outcome=ended.outcome if ended else None,
            dead=dead.get(name, 0),
        )
    return minds


def _test_runs(state: GateState) -> tuple[RepositoryStatus, ...]:
    """Per repository: slots held of N, and its runs from the tests slice's scopes (as
    last listed: `SystemdAsks.refresh`)."""
    runs = state.status_asks.runs
    return tuple(
        RepositoryStatus(
            repository=str(entry["repository"]),
            slots_held=entry["slots_held"],
            slots=entry["slots"],
            runs=tuple(
                TestRunStatus(r["unit"], r["worktree"], r["command"], r["running_s"])
                for r in entry["runs"]
            ),
            problem=entry["problem"],
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


def gate_line(state: GateState, now: float, tests: int) -> str:
    """The status line after an admission pass, from the index's counts (no scan)."""
    index = state.store.index
    adaptive = state.adaptive
    limit = adaptive.limit() if adaptive is not None else None
    return status_line(
        turns=len(state.turns.all()) + state.foreign_live,
        cap=replace(state.limits, adaptive=limit).cap,
        adaptive=adaptive.mode if adaptive is not None and limit is not None else None,
        global_cap=state.limits.global_cap,
        test_runs=tests,
        holds={str(reason): count for reason, count in index.counts.items()},
        backing_off=len(index.backing_off(now)),
        dead=sum(state.store.minds.dead_counts().values()),
        paused=state.paused,
    ) + config_note(state.config)


def config_note(config: ConfigStatus | None) -> str:
    """What STATUS= adds about the config: a refused reload, keys needing a restart."""
    if config is None:
        return ""
    note = ""
    if config.refused is not None:
        note += f"; config reload refused, old config in force: {config.refused}"
    if config.needs_restart:
        note += f"; needs a restart to apply: {', '.join(config.needs_restart)}"
    return note


def status_line(
    *,
    turns: int,
    cap: int | None,
    adaptive: str | None = None,
    global_cap: int | None = None,
    test_runs: int,
    holds: Mapping[str, int],
    backing_off: int,
    dead: int,
    paused: frozenset[str] | admission.EveryMind,
) -> str:
    """The gate's state in one line for systemd's STATUS=, e.g.
    `2/2 turns, 5 held (global_cap), 0 backing off, 0 dead, 1 paused`, or with the
    adaptive limit (`adaptive`: its mode) as the cap,
    `4/4 turns (adaptive limit, ceiling 8), 5 held (adaptive_limit), ...`."""
    line = f"{turns}/{cap} turns" if cap is not None else f"{turns} turn{_s(turns)} (no cap)"
    if adaptive is not None:
        kind = "adaptive limit" if adaptive == AdaptiveMode.ADAPTIVE else f"adaptive {adaptive}"
        line += f" ({kind}, ceiling {global_cap})" if global_cap is not None else f" ({kind})"
    if test_runs:
        line += f" + {test_runs} test run{_s(test_runs)}"
    reasons = {reason: n for reason, n in holds.items() if n}
    held = sum(reasons.values())
    if len(reasons) == 1:  # 5 held (global_cap)
        line += f", {held} held ({next(iter(reasons))})"
    elif reasons:  # 5 held (3 global_cap, 2 paused)
        shown = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
        line += f", {held} held ({shown})"
    else:
        line += ", 0 held"
    line += f", {backing_off} backing off, {dead} dead"
    if isinstance(paused, admission.EveryMind):
        return f"{line}, all paused"
    return f"{line}, {len(paused)} paused"


def _s(count: int) -> str:
    return "" if count == 1 else "s"


class StatusNotifier:
    """Sends the gate's status line to systemd when it changes, not on every pass."""

    def __init__(self, send: Callable[[str], object] = sd_notify) -> None:
        self.send = send
        self.last: str | None = None

    def update(self, line: str) -> None:
        if line != self.last:
            self.last = line
            self.send(f"STATUS={line}")
