"""Whether each turn still runs, on systemd's word alone, and what runs in the turns slice.

A turn is settled only on positive evidence that nothing of it runs any more:
- systemd answers that its scope is not loaded, or is inactive or failed; or
- systemd lists the scope's processes and there are none. A scope started around a
  PID that died before systemd moved it (the gate's whole cgroup SIGKILLed between
  the fork and the scope) stays `active` with an empty cgroup for ever, and no "empty"
  event ever comes; such a scope is stopped, and its turn settled.
A question to systemd that fails (EINTR while the gate is being stopped, a timeout)
proves nothing: the turn keeps its place, and the question is asked again later.

Evidence that a turn still runs costs nothing on the handoff path: the gate holds a
pidfd on each turn's main process (the wrapper), its own child or, after a restart,
the PID recorded at release. While that process lives, the scope is not empty.

Liveness turns systemd's evidence (and the clock's) into the events of
volutectl/gate/lifecycle.py, which volutectl/gate/turns.py applies, carrying out every
effect (`Ask` with `Evidence.about`, here). Also here: counting what holds a place under
the cap, re-adopting turns at start, and each turn's time limit. Liveness changes nothing
of a turn or of `Turns` itself: it tells `Turns` what it learnt.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from volutectl import names
from volutectl.clock import SYSTEM, Clock
from volutectl.config.reload import SettingsHolder
from volutectl.config.settings import Settings
from volutectl.core import admission
from volutectl.errors import VoluteError
from volutectl.gate import lifecycle
from volutectl.gate.turns import Turn, Turns
from volutectl.launcher.hands import TurnHands
from volutectl.states import TurnKind
from volutectl.store.queue import Store, TurnRow
from volutectl.systemd.port import ENDED_STATES, SystemdManager

TURN_PATTERN = "volute-turn-*.scope"


@dataclass(frozen=True)
class Census:
    """What holds a place in the turns slice, as last counted: our live turns' ids, and
    how many other scopes hold a process."""

    live_ids: frozenset[int] = frozenset()
    foreign: int = 0


class Evidence:
    """What systemd (and, for a turn whose start is unconfirmed, the launcher) says of a
    turn, as the next event of its lifecycle: what `Turns` carries out `Ask` with."""

    def __init__(self, manager: SystemdManager, hands: TurnHands, clock: Clock = SYSTEM) -> None:
        self.manager = manager
        self.hands = hands
        self.clock = clock

    def about(self, turn: Turn) -> lifecycle.Happened:
        """Whether the turn still runs, on systemd's word. The answers that settle: the
        unit is not loaded, is inactive or failed, or holds no process. A question that
        failed proves nothing: it is asked again in lifecycle.ASK_AGAIN_SECONDS.

        Of a turn whose launcher was lost mid-start, first whether the launcher is back:
        its next connection is served only once that order is done (or died with it),
        and until then systemd's answer could come before the scope does."""
        if isinstance(turn.state, lifecycle.Unconfirmed):
            try:
                self.hands.ensure()
            except VoluteError:
                return lifecycle.LauncherAway(now=self.clock.wall())
            return lifecycle.LauncherBack()
        return self._ask(turn.unit)

    def _ask(self, unit: str) -> lifecycle.Happened:
        """systemd's answer about a turn's scope, as an event."""
        try:
            state = self.manager.active_state(unit)
            if state is None or state in ENDED_STATES:
                return lifecycle.ScopeGone()
            pids = self.manager.unit_processes(unit)
        except VoluteError as error:
            return lifecycle.QuestionFailed(error=error.message, now=self.clock.wall())
        if pids is None:
            return lifecycle.ScopeGone()
        return lifecycle.ScopeHolds() if pids else lifecycle.ScopeEmpty(active_state=state)


class Liveness:
    def __init__(
        self,
        held: SettingsHolder,
        store: Store,
        manager: SystemdManager,
        turns: Turns,
        *,
        wake: Callable[[], None],
        clock: Clock = SYSTEM,
    ) -> None:
        self.held = held
        self.clock = clock
        self.store = store
        self.manager = manager
        self.turns = turns
        self.wake = wake
        self.census = Census()  # for status: what the last count for it found

    @property
    def settings(self) -> Settings:
        """The settings held now: a reload reaches this part through its holder."""
        return self.held.current

    # -- what holds a place -------------------------------------------------------------

    def count_live(self) -> tuple[list[admission.LiveTurn], int]:
        """Our live turns, and how many other scopes in the turns slice hold a process.

        Raises SystemdError if systemd cannot list the slice: admission must then wait,
        not guess. Only scopes that really hold a process count against the cap."""
        ours = {turn.unit: turn for turn in self.turns.all()}
        listed = self.manager.list_units(self.settings.turns.slice, [TURN_PATTERN], known=ours)
        names_listed = {unit.name for unit in listed}
        self.turns.forget_unlisted(names_listed)
        for turn in ours.values():
            if turn.unit not in names_listed:
                self._learn(turn, lifecycle.Listed(listed=False))
        foreign = 0
        for name in sorted(names_listed):
            own = ours.get(name)
            if own is not None:
                self._learn(own, lifecycle.Listed(listed=True))
            elif not self.turns.forgotten(name) and self._foreign_holds_process(name):
                foreign += 1
        live = [
            admission.LiveTurn(turn.id, turn.mind, turn.session, lease=turn.lease)
            for turn in self.turns.all()
            if lifecycle.holds_place(turn.state, turn.unit in names_listed)
        ]
        return live, foreign

    def recount(self, known_foreign: int) -> Census:
        """Count for `volutectl status` (settling what systemd says ended), and keep the
        count for status to read. If systemd does not answer: no turn of ours, and the
        `known_foreign` other scopes last counted."""
        try:
            live, foreign = self.count_live()
        except VoluteError:
            live, foreign = [], known_foreign  # systemd did not answer: what we know
        self.census = Census(frozenset(turn.turn_id for turn in live), foreign)
        return self.census

    def _foreign_holds_process(self, unit: str) -> bool:
        """A scope in our slice that is not one of our turns: count it unless it is empty.

        An empty turn scope (named as ours: a gate that crashed left it) is stopped."""
        try:
            pids = self.manager.unit_processes(unit)
        except VoluteError:
            return True  # cannot tell: count it, the cap is what must hold
        if pids is None:
            return False
        if pids:
            return True
        self.turns.scope_found_empty(unit)
        return False

    # -- the evidence ------------------------------------------------------------------------

    def _learn(self, turn: Turn, event: lifecycle.Happened) -> None:
        """Tell `Turns` what was learnt of a turn the gate holds. Asked (when its main
        process exited, when systemd reported its scope inactive, at adoption, when a
        question failed before), `Turns` takes systemd's word from `Evidence`."""
        if self.turns.holds(turn):
            self.turns.apply(turn, event)

    def reap(self, turn: Turn) -> None:
        """The turn's main process exited (its pidfd is readable): find out whether the
        scope is done (its hands collect the exit status)."""
        if not self.turns.holds(turn):
            self.turns.close_pidfd(turn)
            return
        grace = self.settings.turns.leftover_grace_seconds
        self._learn(turn, lifecycle.MainExited(now=self.clock.wall(), grace=grace))

    def unit_ended(self, unit: str) -> None:
        """systemd says a turn scope left the live states (or was removed)."""
        if self.turns.forgotten_ended(unit):
            return
        parsed = names.parse_turn_scope_name(unit)
        if parsed is None:
            return
        turn = self.turns.get(parsed[1])
        if turn is None or turn.unit != unit:
            self.wake()  # a foreign scope ended: the budget may have freed
            return
        self._learn(turn, lifecycle.ScopeEnded())

    # -- time limits and questions to ask again -------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest wall-clock time at which `on_deadline` has work: a turn's time
        limit, a question to systemd to ask again, or the end of the grace of what a
        turn's main process left behind."""
        times: list[float] = []
        for turn in self.turns.all():
            if turn.recheck_at is not None:
                times.append(turn.recheck_at)
            stop_at = lifecycle.stop_at(turn.state)
            if stop_at is not None:
                times.append(stop_at)
            if turn.deadline is not None and turn.limit_pending():
                times.append(turn.deadline)
        return min(times, default=None)

    def on_deadline(self, now: float) -> None:
        for turn in self.turns.all():
            if turn.deadline is not None and turn.limit_pending() and now >= turn.deadline:
                self.turns.apply(turn, lifecycle.TimeLimit(now=now))
            self._learn(turn, lifecycle.Due(now=now))

    # -- recovery ----------------------------------------------------------------------------

    def recover(self) -> None:
        """Take back the store's open turns, each on systemd's word.

        Each open turn first takes its place (so admission counts it), then is checked:
        settled if its scope is gone, inactive or empty; adopted if its scope holds a
        process; kept, and asked about again, if systemd cannot say. Its main process is
        watched again by the PID recorded at release, if that PID is still in the scope;
        if that process is gone, what it left behind gets its grace again from now.
        Before them, rows left running under a turn that is not open, which no open turn
        would settle, are settled by that turn's outcome (Turns.settle_stranded).
        """
        self.turns.settle_stranded()
        open_turns = self.store.open_turns()
        self.turns.sweep_directories({row.id for row in open_turns})
        grace = self.settings.turns.leftover_grace_seconds
        for row in open_turns:
            pidfd, main_gone = self._adopted_main(row)
            stop_at = self.clock.wall() + grace if main_gone else None
            turn = self._turn_from_row(row, lifecycle.Recorded())
            self.turns.adopt(turn, lifecycle.Adopted(pidfd=pidfd, stop_at=stop_at))
        self.wake()

    def _turn_from_row(self, row: TurnRow, state: lifecycle.State) -> Turn:
        return Turn(
            id=row.id,
            mind=row.mind,
            session=row.session,
            unit=row.unit,
            started_at=row.started_at,
            state=state,
            released=row.released,
            pid=row.pid,
            interrupted=row.interrupted,
            deadline=row.deadline,
            timed_out_at=row.timed_out_at,
            lease=row.kind is TurnKind.LEASE,
        )

    def _adopted_main(self, row: TurnRow) -> tuple[int | None, bool]:
        """A pidfd on an adopted turn's main process, if the PID recorded at its release
        still belongs to its scope; and whether that process is known to be gone (its
        PID ended, or its scope no longer holds it). A turn never recorded as released,
        or whose scope systemd could not list, is neither."""
        if row.pid is None:
            return None, False
        try:
            fd = os.pidfd_open(row.pid)
        except OSError:
            return None, True  # exited (the PID is gone): nothing to watch
        try:
            in_scope = row.pid in (self.manager.unit_processes(row.unit) or [])
        except VoluteError:
            os.close(fd)  # the question failed: it may still run
            return None, False
        if not in_scope:
            os.close(fd)  # reused by an unrelated process
            return None, True
        return fd, False
