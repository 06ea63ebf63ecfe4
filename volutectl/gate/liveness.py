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

Also here: counting what holds a place under the cap, re-adopting turns at start, and
each turn's time limit.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable

from volutectl import events, names
from volutectl.config.settings import Settings
from volutectl.core import admission
from volutectl.errors import VoluteError
from volutectl.gate.turns import Turn, Turns
from volutectl.store.queue import Store, TurnRow
from volutectl.systemd.port import ENDED_STATES, SystemdManager

TURN_PATTERN = "volute-turn-*.scope"
RECHECK_SECONDS = 1.0  # after a failed question to systemd, ask again this much later


class Liveness:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        manager: SystemdManager,
        turns: Turns,
        *,
        wake: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.store = store
        self.manager = manager
        self.turns = turns
        self.wake = wake
        # Scopes of turns we settled that systemd may still list as live for a moment
        # (settled on seeing them empty): not counted, not asked about again.
        self.settled_units: set[str] = set()

    # -- what holds a place -------------------------------------------------------------

    def count_live(self) -> tuple[list[admission.LiveTurn], int]:
        """Our live turns, and how many other scopes in the turns slice hold a process.

        Raises SystemdError if systemd cannot list the slice: admission must then wait,
        not guess. Only scopes that really hold a process count against the cap."""
        ours = {turn.unit: turn for turn in self.turns.all()}
        listed = self.manager.list_units(self.settings.turns.slice, [TURN_PATTERN], known=ours)
        names_listed = {unit.name for unit in listed}
        self.settled_units &= names_listed
        for turn in ours.values():
            if turn.unit not in names_listed and not turn.main_alive():
                self.check(turn)  # systemd lists it as not live: confirm, then settle
        foreign = 0
        for name in sorted(names_listed):
            own = ours.get(name)
            if own is not None:
                if not (own.main_alive() or own.verified or own.recheck_at is not None):
                    self.check(own)
            elif name not in self.settled_units and self._foreign_holds_process(name):
                foreign += 1
        live = [
            admission.LiveTurn(turn.id, turn.mind, turn.session)
            for turn in self.turns.all()
            if turn.unit in names_listed or turn.main_alive() or turn.recheck_at is not None
        ]
        return live, foreign

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
        self.turns.journal.emit(events.EmptyScopeFound(unit=unit))
        self._stop_quietly(unit)
        self.settled_units.add(unit)
        return False

    def _stop_quietly(self, unit: str) -> None:
        parsed = names.parse_turn_scope_name(unit)
        if parsed is None:
            return  # not a name the launcher would derive: not ours to stop
        try:
            self.turns.hands.stop(parsed[1], parsed[0])
        except VoluteError as error:
            self.turns.journal.emit(events.ScopeStopFailed(unit=unit, error=error.message))

    # -- the evidence ------------------------------------------------------------------------

    def check(self, turn: Turn) -> None:
        """Ask systemd whether the turn still runs; settle it only if systemd says no.

        Called when its main process exited, when systemd reported its scope inactive,
        at adoption, and when a question failed before. The answers that settle: the
        unit is not loaded, is inactive or failed, or holds no process (then, if it was
        never seen holding one, it is stopped too: it would stay active for ever). Any
        failed question: ask again in RECHECK_SECONDS."""
        if not self.turns.holds(turn):
            return
        if turn.unknown:
            # The launcher was lost mid-start. Its next connection is served only once
            # that order is done (or died with it): until then systemd's answer could
            # come before the scope does.
            try:
                self.turns.hands.ensure()
            except VoluteError:
                turn.recheck_at = time.time() + RECHECK_SECONDS
                return
            turn.unknown = False
        try:
            state = self.manager.active_state(turn.unit)
            pids = (
                None if state is None or state in ENDED_STATES
                else self.manager.unit_processes(turn.unit)
            )  # fmt: skip
        except VoluteError as error:
            if turn.recheck_at is None:
                self.turns.journal.emit(
                    events.TurnUnanswered(
                        **events.turn_fields(turn),
                        error=error.message,
                        recheck_seconds=RECHECK_SECONDS,
                    )
                )
            turn.recheck_at = time.time() + RECHECK_SECONDS
            return
        turn.recheck_at = None
        if pids:
            turn.verified = True
            return
        if pids is not None:  # live, but empty
            if not turn.verified:
                # Never seen holding a process: started around one that had died. It
                # will never end by itself.
                self.turns.journal.emit(
                    events.TurnScopeEmpty(**events.turn_fields(turn), state=str(state))
                )
                self._stop_quietly(turn.unit)
            # Otherwise its last process just left, and systemd is about to say so.
            self.settled_units.add(turn.unit)
        self._settle(turn)

    def _settle(self, turn: Turn) -> None:
        try:
            self.turns.finish(turn)
        except (VoluteError, sqlite3.Error, OSError) as error:
            # The settlement's commit failed (a full disk), or its directory could not be
            # read (the launcher is away): nothing of it happened. The turn keeps its
            # place until it can be settled.
            text = error.message if isinstance(error, VoluteError) else str(error)
            self.turns.journal.emit(events.TurnNotSettled(**events.turn_fields(turn), error=text))
            turn.recheck_at = time.time() + RECHECK_SECONDS

    def reap(self, turn: Turn) -> None:
        """The turn's main process exited (its pidfd is readable): find out whether the
        scope is done (its hands collect the exit status)."""
        self.turns.close_pidfd(turn)
        self.check(turn)

    def unit_ended(self, unit: str) -> None:
        """systemd says a turn scope left the live states (or was removed)."""
        if unit in self.settled_units:
            self.settled_units.discard(unit)
            return
        parsed = names.parse_turn_scope_name(unit)
        if parsed is None:
            return
        turn = self.turns.get(parsed[1])
        if turn is None or turn.unit != unit:
            self.wake()  # a foreign scope ended: the budget may have freed
            return
        if turn.main_alive():
            # systemd also announces a scope's initial "inactive" while creating it; and
            # a scope cannot have ended while its main process lives. Its pidfd will say.
            return
        self.check(turn)

    # -- time limits and questions to ask again -------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest wall-clock time at which `on_deadline` has work: a turn's time
        limit, or a question to systemd to ask again."""
        times: list[float] = []
        for turn in self.turns.all():
            if turn.recheck_at is not None:
                times.append(turn.recheck_at)
            if turn.deadline is not None and turn.timed_out_at is None:
                times.append(turn.deadline)
        return min(times, default=None)

    def on_deadline(self, now: float) -> None:
        for turn in self.turns.all():
            if turn.deadline is not None and turn.timed_out_at is None and now >= turn.deadline:
                self.time_out(turn, now)
            if turn.recheck_at is not None and now >= turn.recheck_at:
                self.check(turn)

    def time_out(self, turn: Turn, now: float) -> None:
        """The turn ran past its limit: record it, then have systemd stop the scope
        (SIGTERM to every process, SIGKILL after turns.timeout_grace_seconds)."""
        turn.timed_out_at = now
        self.store.mark_timed_out(turn.id, now)
        limit = turn.deadline - turn.started_at if turn.deadline is not None else 0.0
        grace = self.settings.turns.timeout_grace_seconds
        self.turns.journal.emit(
            events.TurnTimedOut(
                **events.turn_fields(turn), limit_seconds=limit, grace_seconds=grace
            )
        )
        try:
            self.turns.hands.stop(turn.id, turn.mind)
        except VoluteError as error:
            # Stopping it is still owed: systemd's RuntimeMaxSec= backstop will, and
            # so will the next check.
            self.turns.journal.emit(
                events.TurnStopFailed(**events.turn_fields(turn), error=error.message)
            )
            turn.recheck_at = now + RECHECK_SECONDS

    # -- recovery ----------------------------------------------------------------------------

    def recover(self) -> None:
        """Take back the store's open turns, each on systemd's word.

        Each open turn first takes its place (so admission counts it), then is checked:
        settled if its scope is gone, inactive or empty; adopted if its scope holds a
        process; kept, and asked about again, if systemd cannot say. Its main process is
        watched again by the PID recorded at release, if that PID is still in the scope.
        """
        open_turns = self.store.open_turns()
        self._remove_stale_dirs({row.id for row in open_turns})
        for row in open_turns:
            turn = self._turn_from_row(row)
            self.turns.add(turn)
            if row.pid is not None:
                self._watch_adopted(turn, row.pid)
            self.check(turn)
            if self.turns.holds(turn) and turn.recheck_at is None:
                self.turns.journal.emit(events.TurnAdopted(**events.turn_fields(turn)))
        self.wake()

    def _remove_stale_dirs(self, open_ids: set[int]) -> None:
        """Turn directories of turns already settled: a gate killed after settling a turn
        and before removing its directory leaves one behind. A launcher that cannot be
        reached now sweeps them when the gate connects to it."""
        try:
            self.turns.hands.sweep(sorted(open_ids))
        except VoluteError as error:
            self.turns.journal.emit(events.TurnDirectoriesNotSwept(error=error.message))

    def _turn_from_row(self, row: TurnRow) -> Turn:
        return Turn(
            id=row.id,
            mind=row.mind,
            session=row.session,
            unit=row.unit,
            started_at=row.started_at,
            released=row.released,
            pid=row.pid,
            interrupted=row.interrupted,
            deadline=row.deadline,
            timed_out_at=row.timed_out_at,
        )

    def _watch_adopted(self, turn: Turn, pid: int) -> None:
        """Watch an adopted turn's main process, if that PID still belongs to its scope."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return  # exited (or the PID is gone): nothing to watch
        try:
            in_scope = pid in (self.manager.unit_processes(turn.unit) or [])
        except VoluteError:
            in_scope = False
        if not in_scope:
            os.close(fd)  # reused by an unrelated process, or the question failed
            return
        turn.pidfd = fd
        self.turns.watch_fd(fd, turn)
