"""The turns the gate runs: start, fold-in, and settle.

`Turns` carries out admission's decisions (`PendingIndex.admit`, volutectl/store/index.py,
over volutectl/core/admission.py): it commits a turn's row, has its hands
(volutectl/launcher/hands.py: volute-launcher, or this process) start it in its scope,
and, once systemd's word is that nothing of the turn runs any more, settles its
deliveries in one commit. Each turn moves through the states of
volutectl/gate/lifecycle.py; `apply` steps it and is the one place that carries out the
effects, every one of them: it owns the registry of the turns that hold a place, and
when starts are paused. It owns no sockets and no event loop: the gate gives it
callbacks, to watch a pidfd, to ask systemd about a turn (volutectl/gate/liveness.py's
`Evidence`, which answers with the next event), to tell waiting clients how their
delivery ended, and to say that admission should run again.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import assert_never

from volutectl import events, names
from volutectl.clock import SYSTEM, Clock
from volutectl.config.reload import SettingsHolder
from volutectl.config.settings import Settings
from volutectl.core import admission
from volutectl.errors import SystemdNoAnswer, VoluteError
from volutectl.faults import crash_point
from volutectl.gate import lifecycle
from volutectl.gate.outcomes import Settled
from volutectl.launcher import fork
from volutectl.launcher.hands import LauncherLost, LauncherUnavailable, TurnHands
from volutectl.states import HoldReason, LeaseEnd, Outcome, QueueState
from volutectl.store.indexed import IndexedStore
from volutectl.store.queue import NewTurn, Row, TurnRow
from volutectl.systemd.journal import Journal
from volutectl.wire import orders

LEFTOVER_PIDS_SAID = 16  # the journal names at most this many of a scope's leftover PIDs


@dataclass
class Turn:
    """A turn the gate knows is (or may be) running: what the store records of it, and
    its state (volutectl/gate/lifecycle.py), which says what the gate knows of whether it
    still runs. The record stays the same object from its start to its settlement."""

    id: int
    mind: str
    session: str
    unit: str
    started_at: float
    state: lifecycle.State
    released: bool = False  # the store recorded its release into the scope
    pid: int | None = None  # the main process, when known (started by this gate)
    interrupted: bool = False
    deadline: float | None = None  # wall clock; None: no time limit
    timed_out_at: float | None = None  # when the gate stopped it for running past that
    leftovers_told: bool = False  # the journal said what its main process left behind
    taken: tuple[Row, ...] = ()  # while it starts: the deliveries its start carries
    lease: bool = False  # a lease's scope (volutectl/gate/leases.py), not a command's run
    lease_end: LeaseEnd | None = None  # why the gate stopped a lease's scope, if it did

    def main_alive(self) -> bool:
        return isinstance(self.state, lifecycle.Running)

    @property
    def pidfd(self) -> int:
        """The main process's pidfd, while it lives and is watched; else -1."""
        return self.state.pidfd if isinstance(self.state, lifecycle.Running) else -1

    @property
    def recheck_at(self) -> float | None:
        """When a question to systemd about it is owed, if one is."""
        return lifecycle.ask_at(self.state)

    def limit_pending(self) -> bool:
        """It has a time limit it has not yet been stopped for."""
        return self.deadline is not None and self.timed_out_at is None


class Turns:
    def __init__(
        self,
        held: SettingsHolder,
        store: IndexedStore,
        hands: TurnHands,
        journal: Journal,
        *,
        notify: Callable[[Settled], None],
        watch_fd: Callable[[int, Turn], None],
        unwatch_fd: Callable[[int], None],
        wake: Callable[[], None],
        processes: Callable[[str], list[int] | None],
        ask: Callable[[Turn], lifecycle.Happened],
        durable: Callable[[], None] = lambda: None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.held = held
        self.clock = clock
        self.store = store
        self.hands = hands
        self.journal = journal
        self.notify = notify
        self.watch_fd = watch_fd
        self.unwatch_fd = unwatch_fd
        self.wake = wake  # a turn ended or failed to start: admission should run
        # The store has synced (a start's commit): what waited for it may go (the pass's
        # acknowledgements, volutectl/gate/serving.py), before the hands start the turns.
        self.durable = durable
        # The PIDs in a scope, as systemd lists them (None: not loaded): what a turn's
        # main process left behind, said when its grace is over.
        self.processes = processes
        # systemd's answer about a turn, as its next event (what `Ask` is carried out by).
        self.ask = ask
        # Told what each ended turn wrote, by mind (the adaptive limit's IO costs).
        self.on_written: Callable[[str, int], None] | None = None
        # What a running turn's scope had written at its last sample (a lease's cost).
        self.sampled_written: Callable[[int], int | None] = lambda turn_id: None
        # Told when a turn frees its place, however it ended: the leases on it end
        # (volutectl/gate/leases.py).
        self.on_freed: Callable[[Turn], None] = lambda turn: None
        self._turns: dict[int, Turn] = {}
        # A start found systemd silent (a daemon-reexec): no turn starts before then.
        self._starts_paused_until: float | None = None
        # Scopes of turns we settled that systemd may still list as live for a moment
        # (settled on seeing them empty): not counted, not asked about again.
        self._settled_units: set[str] = set()

    @property
    def settings(self) -> Settings:
        """The settings held now: a reload reaches this part through its holder."""
        return self.held.current

    # -- the registry -----------------------------------------------------------------------

    def all(self) -> list[Turn]:
        """Every turn the gate holds a place for, oldest first."""
        return sorted(self._turns.values(), key=lambda turn: turn.id)

    def get(self, turn_id: int) -> Turn | None:
        return self._turns.get(turn_id)

    def holds(self, turn: Turn) -> bool:
        return self._turns.get(turn.id) is turn

    def starts_paused(self, now: float) -> float | None:
        """Until when no turn may start (systemd gave no answer to a start), if it is
        later than `now`."""
        until = self._starts_paused_until
        return until if until is not None and until > now else None

    # -- scopes settled that systemd may still list -------------------------------------------

    def forgotten(self, unit: str) -> bool:
        """A scope of a turn settled on seeing it empty: not counted, not asked about."""
        return unit in self._settled_units

    def forget_unlisted(self, listed: Container[str]) -> None:
        """systemd no longer lists these scopes: nothing more to forget about them."""
        self._settled_units = {unit for unit in self._settled_units if unit in listed}

    def forgotten_ended(self, unit: str) -> bool:
        """systemd says the scope ended: whether it was one settled already (then it is
        forgotten no more)."""
        if unit not in self._settled_units:
            return False
        self._settled_units.discard(unit)
        return True

    def scope_found_empty(self, unit: str) -> None:
        """A turn scope that is not one of our turns holds no process (a gate that crashed
        left it): say so, stop it, and do not count it while systemd still lists it."""
        self.journal.emit(events.EmptyScopeFound(unit=unit))
        self.stop_quietly(unit)
        self._settled_units.add(unit)

    # -- logging ----------------------------------------------------------------------------

    def log_released(self, rows: Iterable[Row], now: float, how: str) -> None:
        for row in rows:
            if row.held_since is not None:
                held_ms = int((now - row.held_since) * 1000)
                self.journal.emit(
                    events.HoldEnded(
                        **events.delivery_fields(row),
                        reason=row.hold_reason,
                        held_ms=held_ms,
                        how=how,
                    )
                )

    # -- admission's decisions -----------------------------------------------------------------

    def record_holds(self, holds: list[tuple[int, HoldReason | None]], now: float) -> None:
        """Write the hold reasons admission changed (only those), and log new holds."""
        if not holds:
            return
        new = set(self.store.mark_held(holds, now))
        rows = self.store.index.rows
        for delivery_id, reason in holds:
            if delivery_id in new and delivery_id in rows:
                row = rows[delivery_id]
                self.journal.emit(events.DeliveryHeld(**events.delivery_fields(row), reason=reason))

    def fold(self, fold: admission.Fold, now: float) -> None:
        """Hand deliveries to a live turn of their session, through its inbox. An
        interrupt cuts the turn short only if the store's commit decided it may (`cut`);
        one that may not folds in as a plain delivery, and its record says so."""
        turn = self._turns[fold.turn_id]
        rows = self.store.fold_into(turn.id, list(fold.delivery_ids), now)
        self.durable()  # its commit's fsync made the pass's deliveries durable too
        crash_point("fold_committed")
        for row in rows:
            if row.interrupt and not row.cut:
                self.journal.emit(
                    events.InterruptRefused(
                        **events.turn_fields(turn), delivery_id=row.id, uid=row.uid
                    )
                )
        for row in rows:
            record = fork.delivery_record(row.id, row.session, row.message, row.cut)
            offer = orders.Offer(turn_id=turn.id, mind=turn.mind, delivery_id=row.id)
            try:
                self.hands.offer(offer, record)
            except VoluteError as error:
                # Not offered (no marker, or its staged file still there), or unknown (the
                # launcher was lost): when the turn ends, its report says which, and a
                # delivery it did not take goes to the session's next turn.
                self.journal.emit(
                    events.DeliveryNotOffered(
                        **events.delivery_fields(row), turn_id=turn.id, error=error.message
                    )
                )
            crash_point("inbox_written")
        self.log_released(rows, now, f"folded into turn {turn.id}")
        if rows:
            ids = " ".join(str(r.id) for r in rows)
            self.journal.emit(events.TurnFolded(**events.turn_fields(turn), delivery_ids=ids))
        if any(row.cut for row in rows):
            self.apply(turn, lifecycle.CutShort())

    def interrupt_refused(self, row: Row) -> bool:
        """Whether the interrupt of `row`, just acknowledged, will not cut short the turn
        it reaches: what `fold` will decide, told in its ack. Pending, it is judged as its
        fold will judge it (core/admission.py's `interrupts_that_cut`), on the session's
        live turn (the oldest, which admission folds into) and the pending deliveries
        ahead of it, which fold in with it; with no live turn it starts one, and cuts
        nothing short. Folded already (a request id sent again), as it was decided."""
        if not row.interrupt:
            return False
        if row.state is not QueueState.PENDING:
            return row.state is QueueState.RUNNING and row.folded and not row.cut
        live = [t for t in self.all() if (t.mind, t.session) == (row.mind, row.session)]
        if not live:
            return False
        ahead = self.store.senders_of_turn(live[0].id)
        index = self.store.index.minds.get(row.mind)
        queue = index.sessions.get(row.session) if index is not None else None
        before = [i for i in queue.ids if i < row.id] if queue is not None else []
        ahead |= {other.uid for other in self.store.rows(before, with_message=False)}
        return not admission.may_interrupt(row.uid, row.admin, ahead)

    def start(self, starts: Sequence[admission.Start], now: float) -> None:
        """Commit the turns of a pass in ONE durable commit (volutectl/store/queue.py's
        `start_turns`), which makes the pass's deliveries durable too (`durable`: their
        acknowledgements go), then have their hands start each in order (directory, fork,
        scope, release). Once systemd gives one no answer (starts pause), the rest are
        not handed to their hands, and go back with no attempt counted, as that one's
        do."""
        if not starts:
            return
        new = [self._new_turn(start, now) for start in starts]
        committed = self.store.start_turns(new, now)
        self.durable()
        crash_point("start_committed")
        for one, (turn_id, taken) in zip(new, committed, strict=True):
            turn = Turn(
                id=turn_id,
                mind=one.mind,
                session=one.session,
                unit=one.unit_for(turn_id),
                started_at=now,
                state=lifecycle.Starting(),
                deadline=one.deadline,
                taken=tuple(taken),
            )
            if self.starts_paused(now) is not None:
                unanswered = "not started: systemd gave no answer to an earlier start of the pass"
                self._start_unanswered(turn, SystemdNoAnswer(unanswered))
                continue
            self._hand(turn, taken, now)

    def _new_turn(self, start: admission.Start, now: float) -> NewTurn:
        max_runtime = self.settings.max_runtime(start.mind)
        return NewTurn(
            mind=start.mind,
            session=start.session,
            delivery_ids=list(start.delivery_ids),
            unit_for=functools.partial(names.turn_scope_name, start.mind),
            deadline=now + max_runtime if max_runtime else None,
        )

    def _hand(self, turn: Turn, taken: Sequence[Row], now: float) -> None:
        """Have a committed turn's hands start it, and step it by how that went."""
        turn_id = turn.id  # the id the start's commit gave it
        self.log_released(taken, now, f"starting turn {turn_id}")
        stdin = b"".join(
            fork.delivery_record(r.id, r.session, r.message, r.interrupt) for r in taken
        )
        order = orders.StartTurn(
            turn_id=turn_id,
            mind=turn.mind,
            session=turn.session,
            delivery_ids=tuple(row.id for row in taken),
        )
        try:
            launched = self.hands.start(order, stdin)
        except (LauncherLost, LauncherUnavailable) as error:
            self._start_unknown(turn, error)
            return
        except SystemdNoAnswer as error:
            self._start_unanswered(turn, error)
            return
        except (VoluteError, OSError) as error:
            self._start_failed(turn, error)
            return
        self.store.mark_released(turn_id, launched.pid)
        crash_point("release_recorded")
        turn.released, turn.pid = True, launched.pid
        self._start_went(turn, lifecycle.StartReported(pidfd=launched.pidfd))
        ids = " ".join(str(row.id) for row in taken)
        self.journal.emit(events.TurnStarted(**events.turn_fields(turn), delivery_ids=ids))

    def start_lease(self, turn_id: int, mind: str, session: str, now: float) -> Turn:
        """Have its hands start a lease's scope, committed as turn `turn_id` already;
        it then holds its place as a turn does. How the start went is the turn's state
        (a failure frees it at once: `on_freed`)."""
        max_runtime = self.settings.max_runtime(mind)
        turn = Turn(
            id=turn_id,
            mind=mind,
            session=session,
            unit=names.turn_scope_name(mind, turn_id),
            started_at=now,
            state=lifecycle.Starting(),
            deadline=now + max_runtime if max_runtime else None,
            lease=True,
        )
        order = orders.StartLease(turn_id=turn_id, mind=mind, session=session)
        try:
            launched = self.hands.start_lease(order)
        except (LauncherLost, LauncherUnavailable) as error:
            self._start_unknown(turn, error)
            return turn
        except (VoluteError, OSError) as error:
            turn.lease_end = LeaseEnd.START_FAILED
            self._start_failed(turn, error)
            return turn
        crash_point("lease_scope_started")
        self.store.mark_released(turn_id, launched.pid)
        turn.released, turn.pid = True, launched.pid
        self._start_went(turn, lifecycle.StartReported(pidfd=launched.pidfd))
        return turn

    def _start_unknown(self, turn: Turn, error: VoluteError) -> None:
        """The launcher was lost during the start: the turn may run, or may never have.
        It keeps its place, as an adopted turn does, until systemd says which."""
        self.journal.emit(events.TurnStartUnknown(**events.turn_fields(turn), error=error.message))
        self._start_went(turn, lifecycle.LostMidStart(now=self.clock.wall()))

    def _start_unanswered(self, turn: Turn, error: SystemdNoAnswer) -> None:
        """systemd gave no answer about the scope (a daemon-reexec drops every call in
        flight): the child exited unreleased, so the command never ran. Not the
        deliveries' failure: they go back with no attempt counted, as a hold does."""
        self.journal.emit(events.TurnNeverStarted(**events.turn_fields(turn), error=error.message))
        self._start_went(turn, lifecycle.NoAnswer(error=error.message, now=self.clock.wall()))

    def _start_failed(self, turn: Turn, error: Exception) -> None:
        """The command never ran (its hands say so, having removed what they made): the
        turn's deliveries count one failed attempt (a missing user fails every time)."""
        message = error.message if isinstance(error, VoluteError) else str(error)
        self.journal.emit(events.TurnStartFailed(**events.turn_fields(turn), error=message))
        self._start_went(turn, lifecycle.StartFailed(error=message))

    def _start_went(self, turn: Turn, event: lifecycle.Happened) -> None:
        """Step a starting turn by how its start went; then the rows it carried are the
        store's to know (a turn that never ran has settled them)."""
        self.apply(turn, event)
        turn.taken = ()

    def _return_deliveries(self, turn: Turn, error: str) -> None:
        """The command never ran, through no fault of its deliveries: the turn ends and
        they go back with no attempt counted, in one commit."""
        try:
            self.store.settle_turn(
                turn.id,
                outcome=Outcome.NEVER_RAN,
                exit_status=None,
                detail=f"never ran: {error}",
                done=[],
                returned=[row.id for row in turn.taken],
                failed={},
                error=error,
                now=self.clock.wall(),
            )
        except sqlite3.Error as refused:
            self._start_not_settled(turn, refused)
            return
        self.apply(turn, lifecycle.Ended(Outcome.NEVER_RAN))

    def _fail_start(self, turn: Turn, error: str) -> None:
        """The start failed: the turn ends and its deliveries count one attempt, in one
        commit (a gate that dies after it leaves nothing running under a closed turn)."""
        taken = list(turn.taken)
        failed = self.failures(taken)
        try:
            self.store.settle_turn(
                turn.id,
                outcome=Outcome.START_FAILED,
                exit_status=None,
                detail=error,
                done=[],
                returned=[],
                failed=failed,
                error=error,
                now=self.clock.wall(),
            )
        except sqlite3.Error as refused:
            self._start_not_settled(turn, refused)
            return
        crash_point("start_failure_recorded")
        self.apply(turn, lifecycle.Ended(Outcome.START_FAILED))
        self.tell_dead(taken, failed, error)

    def _start_not_settled(self, turn: Turn, refused: sqlite3.Error) -> None:
        """The settlement's one commit failed (a full disk): nothing of it happened, and
        its rows are running under a turn the store holds open. The turn keeps its place
        as one whose start is unknown, until systemd's word settles it (as never run: no
        attempt), as a gate restarted now would."""
        self.journal.emit(events.TurnNotSettled(**events.turn_fields(turn), error=str(refused)))
        self.apply(turn, lifecycle.SettleFailed(now=self.clock.wall()))

    # -- the lifecycle ---------------------------------------------------------------------

    def apply(self, turn: Turn, event: lifecycle.Happened) -> None:
        """Step the turn by `event` (volutectl/gate/lifecycle.py) and carry out the effects
        in order: the one place they are carried out."""
        turn.state, effects = lifecycle.step(turn.state, event)
        for effect in effects:
            self._carry_out(turn, effect)

    def adopt(self, turn: Turn, event: lifecycle.Adopted) -> None:
        """Take back a turn the store holds open (at the gate's start): it takes its
        place and systemd is asked about it; say so if it still runs."""
        self.apply(turn, event)
        if self.holds(turn) and turn.recheck_at is None:
            self.journal.emit(events.TurnAdopted(**events.turn_fields(turn)))

    def _carry_out(self, turn: Turn, effect: lifecycle.Effect) -> None:
        match effect:
            case lifecycle.TakePlace():
                self._turns[turn.id] = turn
            case lifecycle.Free():
                self._turns.pop(turn.id, None)
                self.on_freed(turn)
            case lifecycle.WatchMainFd(pidfd):
                self.watch_fd(pidfd, turn)
            case lifecycle.CloseMainFd(pidfd):
                self._close_fd(pidfd)
            case lifecycle.Wake():
                self.wake()
            case lifecycle.Ask():
                if self.holds(turn):
                    self.apply(turn, self.ask(turn))
            case lifecycle.LogCannotTell(error):
                self._log_cannot_tell(turn, error)
            case lifecycle.StopEmptyScope(active_state):
                self.journal.emit(
                    events.TurnScopeEmpty(**events.turn_fields(turn), state=str(active_state))
                )
                self.stop_quietly(turn.unit)
            case lifecycle.ForgetUnit():
                self._settled_units.add(turn.unit)
            case lifecycle.Settle():
                self._settle(turn)
            case lifecycle.ReturnDeliveries(error):
                self._return_deliveries(turn, error)
            case lifecycle.FailDeliveries(error):
                self._fail_start(turn, error)
            case lifecycle.PauseStarts(until):
                self._starts_paused_until = until
            case lifecycle.RecordTimeout(now):
                self._record_timeout(turn, now)
            case lifecycle.StopOverrun(now):
                self._stop_overrun(turn, now)
            case lifecycle.StopLeftovers():
                self._stop_leftovers(turn)
            case lifecycle.RecordInterrupt():
                self._record_interrupt(turn)
            case _:
                assert_never(effect)

    def _log_cannot_tell(self, turn: Turn, error: str) -> None:
        self.journal.emit(
            events.TurnUnanswered(
                **events.turn_fields(turn),
                error=error,
                recheck_seconds=lifecycle.ASK_AGAIN_SECONDS,
            )
        )

    def _record_interrupt(self, turn: Turn) -> None:
        turn.interrupted = True
        with contextlib.suppress(VoluteError):
            self.hands.interrupt(turn.id, turn.mind)
        self.journal.emit(events.TurnInterrupted(**events.turn_fields(turn)))

    def _settle(self, turn: Turn) -> None:
        try:
            self.finish(turn)
        except (VoluteError, sqlite3.Error, OSError) as error:
            # The settlement's commit failed (a full disk), or its directory could not be
            # read (the launcher is away): nothing of it happened. The turn keeps its
            # place until it can be settled.
            text = error.message if isinstance(error, VoluteError) else str(error)
            self.journal.emit(events.TurnNotSettled(**events.turn_fields(turn), error=text))
            self.apply(turn, lifecycle.SettleFailed(now=self.clock.wall()))

    def _record_timeout(self, turn: Turn, now: float) -> None:
        """The turn ran past its limit: record it (its scope is stopped next)."""
        turn.timed_out_at = now
        self.store.mark_timed_out(turn.id, now)
        crash_point("timeout_recorded")
        limit = turn.deadline - turn.started_at if turn.deadline is not None else 0.0
        grace = self.settings.turns.timeout_grace_seconds
        self.journal.emit(
            events.TurnTimedOut(
                **events.turn_fields(turn), limit_seconds=limit, grace_seconds=grace
            )
        )

    def _stop_overrun(self, turn: Turn, now: float) -> None:
        """Have systemd stop the scope (SIGTERM to every process, SIGKILL after
        turns.timeout_grace_seconds). A lease's processes go back first: the time limit
        ends the lease, not the daemon's processes."""
        if turn.lease:
            self.move_back(turn.id, turn.mind)
        try:
            self.hands.stop(turn.id, turn.mind)
        except VoluteError as error:
            # Stopping it is still owed: systemd's RuntimeMaxSec= backstop will, and
            # so will the next check.
            self.journal.emit(
                events.TurnStopFailed(**events.turn_fields(turn), error=error.message)
            )
            self.apply(turn, lifecycle.StopFailed(now=now))

    def _stop_leftovers(self, turn: Turn) -> None:
        """Its main process exited a grace ago and its scope is still there: say what is
        left in it, and have systemd stop the scope. A scope systemd no longer knows has
        ended: the turn is settled."""
        try:
            left = self.processes(turn.unit)
        except VoluteError:
            left = []  # cannot tell what is left: stop it all the same
            count = None
        else:
            if left is None:
                self.apply(turn, lifecycle.ScopeGone())
                return
            count = len(left)
        told, turn.leftovers_told = turn.leftovers_told, True
        if not told:  # a stop tried again is not said again
            self.journal.emit(
                events.TurnLeftoversStopped(
                    **events.turn_fields(turn),
                    processes=count,
                    pids=" ".join(str(pid) for pid in left[:LEFTOVER_PIDS_SAID]) or None,
                    grace_seconds=self.settings.turns.leftover_grace_seconds,
                    stop_seconds=self.settings.turns.timeout_grace_seconds,
                )
            )
        if turn.lease:  # its placeholder is gone: what it moved in is not leftovers
            self.move_back(turn.id, turn.mind)
        try:
            self.hands.stop(turn.id, turn.mind)
        except VoluteError as error:
            if not told:
                self.journal.emit(
                    events.TurnStopFailed(**events.turn_fields(turn), error=error.message)
                )
            self.apply(turn, lifecycle.LeftoversStopFailed(now=self.clock.wall()))

    def sweep_directories(self, open_ids: set[int]) -> None:
        """Turn directories of turns already settled: a gate killed after settling a turn
        and before removing its directory leaves one behind. A launcher that cannot be
        reached now sweeps them when the gate connects to it."""
        try:
            self.hands.sweep(sorted(open_ids))
        except VoluteError as error:
            self.journal.emit(events.TurnDirectoriesNotSwept(error=error.message))

    def move_back(self, turn_id: int, mind: str) -> None:
        """A lease's processes back where they came from, before its scope is stopped
        (docs/protocol.md, "A lease's processes"); idempotent, and nothing to do for a
        scope into which nothing was moved. A failure is logged; the stop goes on."""
        try:
            self.hands.move_back(turn_id, mind)
        except VoluteError as error:
            unit = names.turn_scope_name(mind, turn_id)
            self.journal.emit(
                events.LeasePidsNotMoved(unit=unit, direction="back", error=error.message)
            )

    def stop_quietly(self, unit: str) -> None:
        """Stop a turn scope, by the name the launcher derives; a failure is only logged.
        Whatever a lease moved into it goes back first."""
        parsed = names.parse_turn_scope_name(unit)
        if parsed is None:
            return  # not a name the launcher would derive: not ours to stop
        self.move_back(parsed[1], parsed[0])
        try:
            self.hands.stop(parsed[1], parsed[0])
        except VoluteError as error:
            self.journal.emit(events.ScopeStopFailed(unit=unit, error=error.message))

    # -- failures ---------------------------------------------------------------------------

    def failures(self, rows: Iterable[Row]) -> dict[int, admission.AfterFailure]:
        """Count an attempt for each row: backoff, or dead after the last."""
        gate = self.settings.gate
        now = self.clock.wall()
        return {
            row.id: admission.after_failure(
                row.attempts,
                now=now,
                max_attempts=gate.max_attempts,
                initial=gate.backoff_initial_seconds,
                ceiling=gate.backoff_max_seconds,
            )
            for row in rows
        }

    def tell_dead(
        self,
        rows: Iterable[Row],
        failed: Mapping[int, admission.AfterFailure],
        error: str,
        *,
        notify: bool = True,
    ) -> None:
        """Once the failure is committed: log the rows that went dead, and tell their
        waiters (unless they are told of the turn that carried them instead): dead, or
        of the failed attempt, for those that asked for progress."""
        for row in rows:
            after = failed.get(row.id)
            if after is not None and after.state is QueueState.PENDING and notify:
                self.notify(
                    Settled(
                        delivery_id=row.id,
                        state=QueueState.PENDING,
                        error=error,
                        outcome=Outcome.START_FAILED,
                        attempts=after.attempts,
                        max_attempts=self.settings.gate.max_attempts,
                        not_before=after.not_before,
                    )
                )
            if after is not None and after.state is QueueState.DEAD:
                self.journal.emit(
                    events.DeliveryDied(
                        **events.delivery_fields(row), attempts=after.attempts, error=error
                    )
                )
                if notify:
                    self.notify(Settled(delivery_id=row.id, state=QueueState.DEAD, error=error))

    # -- settling -------------------------------------------------------------------------

    def close_pidfd(self, turn: Turn) -> None:
        """Stop watching the turn's main process, if it is watched, and close its pidfd."""
        if turn.pidfd >= 0:
            self._close_fd(turn.pidfd)

    def _close_fd(self, pidfd: int) -> None:
        self.unwatch_fd(pidfd)
        with contextlib.suppress(OSError):
            os.close(pidfd)

    def finish(self, turn: Turn) -> None:
        """Nothing of the turn runs any more: settle its deliveries and free its place."""
        if turn.lease:
            self._finish_lease(turn)
            return
        now = self.clock.wall()
        rows = self.store.rows_of_turn(turn.id)
        report = self.hands.inspect(turn.id, [row.id for row in rows if row.folded])
        if report.written_bytes is not None and self.on_written is not None:
            self.on_written(turn.mind, report.written_bytes)
        outcome = admission.turn_outcome(
            exit_status=report.exit_status,
            started_marker=report.started,
            released=turn.released,
            interrupted=turn.interrupted,
            timed_out=admission.timed_out(
                turn.deadline,
                stopped_at=turn.timed_out_at,
                ended_at=report.ended_at,
                now=now,
            ),
        )
        settlement = admission.settle(
            outcome.kind, [row.as_sent() for row in rows], set(report.not_taken)
        )
        carried = [row for row in rows if row.id not in settlement.returned]
        failing = [row for row in carried if row.id in settlement.failed]
        failed = self.failures(failing)
        by_other = ": cut short by another user's interrupt" if settlement.cut_by_other else ""
        error = f"turn {turn.id} {outcome.detail}{by_other}"
        self.store.settle_turn(
            turn.id,
            outcome=outcome.kind,
            exit_status=outcome.exit_status,
            detail=outcome.detail,
            done=settlement.done,
            returned=settlement.returned,
            failed=failed,
            error=error,
            now=now,
            durable=False,  # the gate calls store.sync() before it sleeps
        )
        crash_point("settled")
        self.tell_dead(failing, failed, error, notify=False)  # _tell_settled tells them
        self.apply(turn, lifecycle.Ended(outcome.kind))  # frees its place, closes its pidfd
        try:
            self.hands.remove(turn.id)
        except VoluteError as kept:  # the next sweep removes it
            self.journal.emit(
                events.TurnDirectoryKept(**events.turn_fields(turn), error=kept.message)
            )
        self.journal.emit(
            events.TurnEnded(
                **events.turn_fields(turn),
                outcome=outcome.kind,
                exit_status=outcome.exit_status,
                detail=outcome.detail,
            )
        )
        self._tell_settled(turn, outcome, carried, settlement.done, failed, error)

    def _finish_lease(self, turn: Turn) -> None:
        """A lease's scope ended: no deliveries, no directory; its leases end as it frees
        its place (`on_freed`), and what its scope wrote is its mind's cost."""
        written = self.sampled_written(turn.id)
        if written is not None and self.on_written is not None:
            self.on_written(turn.mind, written)
        self.apply(turn, lifecycle.Ended(Outcome.OK))

    def _tell_settled(
        self,
        turn: Turn,
        outcome: admission.TurnOutcome,
        carried: list[Row],
        done: Container[int],
        failed: Mapping[int, admission.AfterFailure],
        error: str,
    ) -> None:
        """Tell waiting clients of the deliveries this turn settled: done, or dead after
        their last attempt. One that will be tried again stays waited for."""
        for row in carried:
            after = failed.get(row.id)
            if row.id in done:
                state = QueueState.DONE
            elif after is not None:
                state = after.state  # dead, or backing off (told only to who asks progress)
            else:
                continue
            self.notify(
                Settled(
                    delivery_id=row.id,
                    state=state,
                    error=error,
                    turn_id=turn.id,
                    outcome=outcome.kind,
                    exit_status=outcome.exit_status,
                    attempts=after.attempts if after is not None else 0,
                    max_attempts=self.settings.gate.max_attempts,
                    not_before=after.not_before if after is not None else None,
                )
            )

    def settle_stranded(self) -> None:
        """At the gate's start, before the open turns are taken back: settle each row left
        `running` under a turn that is not open (or under none), which no turn will
        settle. Only a gate that died between a turn's end and its rows' settlement, two
        commits before issue 29, leaves one. Each turn's rows settle in one commit, by its
        recorded outcome (admission.stranded_outcome); each row is journalled. A commit
        the disk refuses is said, and left for the next start: the gate starts anyway."""
        by_turn: dict[int | None, list[Row]] = {}
        records: dict[int | None, TurnRow | None] = {}
        for row, record in self.store.stranded():
            by_turn.setdefault(row.turn_id, []).append(row)
            records[row.turn_id] = record
        for turn_id, rows in by_turn.items():
            record = records[turn_id]
            outcome = admission.stranded_outcome(
                record.outcome if record is not None else None,
                exit_status=record.exit_status if record is not None else None,
                detail=record.detail if record is not None else None,
                released=record is not None and record.released,
                interrupted=record is not None and record.interrupted,
                timed_out=record is not None and record.timed_out_at is not None,
            )
            try:
                self._settle_stranded(turn_id, rows, outcome)
            except sqlite3.Error as error:
                what = f"the deliveries left running under turn {turn_id}"
                self.journal.emit(events.HandlingFailed(what=what, error=str(error)))

    def _settle_stranded(
        self, turn_id: int | None, rows: list[Row], outcome: admission.TurnOutcome
    ) -> None:
        ids = [row.id for row in rows]
        error = f"turn {turn_id} {outcome.detail}"
        failed = self.failures(rows) if outcome.kind.failed else {}
        self.store.settle_rows(
            done=ids if outcome.kind.carried else [],
            returned=ids if outcome.kind is Outcome.NEVER_RAN else [],
            failed=failed,
            error=error,
            now=self.clock.wall(),
        )
        for row in rows:
            after = failed.get(row.id)
            if outcome.kind.carried:
                state, attempts = QueueState.DONE, row.attempts
            elif after is not None:
                state, attempts = after.state, after.attempts
            else:
                state, attempts = QueueState.PENDING, row.attempts
            self.journal.emit(
                events.StrandedDeliverySettled(
                    **events.delivery_fields(row),
                    turn_id=turn_id,
                    outcome=outcome.kind,
                    state=state,
                    attempts=attempts,
                )
            )
        self.tell_dead(rows, failed, error, notify=False)  # no client is connected yet
