"""The turns the gate runs: start, fold-in, and settle.

`Turns` carries out admission's decisions (admission.admit): it commits a turn's row, has
its hands (volutectl/launcher/hands.py: volute-launcher, or this process) start it in its scope,
and, once volutectl/gate/liveness.py has systemd's word that nothing of the turn runs any
more, settles its deliveries in one commit. It owns no sockets and no event loop: the gate
gives it callbacks, to watch a pidfd, to tell waiting clients how their delivery ended,
and to say that admission should run again.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from volutectl import names
from volutectl.config.settings import Settings
from volutectl.core import admission
from volutectl.errors import SystemdNoAnswer, VoluteError
from volutectl.faults import crash_point
from volutectl.gate.outcomes import Settled
from volutectl.launcher import fork
from volutectl.launcher.hands import LauncherLost, LauncherUnavailable, TurnHands
from volutectl.states import HoldReason, Outcome, QueueState
from volutectl.store.indexed import IndexedStore
from volutectl.store.queue import Row
from volutectl.systemd.journal import Event, Journal
from volutectl.wire import orders


@dataclass
class Turn:
    """A turn the gate knows is (or may be) running."""

    id: int
    mind: str
    session: str
    unit: str
    started_at: float
    released: bool
    pid: int | None = None  # the main process, when known (started by this gate)
    pidfd: int = -1  # watched: the main process's pidfd, while it lives
    interrupted: bool = False
    deadline: float | None = None  # wall clock; None: no time limit
    timed_out_at: float | None = None
    # systemd showed the scope holding a process (or its main process is ours and
    # alive): from then on, systemd reports when it empties.
    verified: bool = False
    recheck_at: float | None = None  # a question to systemd failed; ask again then
    # The launcher was lost while it started this turn: whether it runs, only systemd
    # can say, once the launcher has finished (or abandoned) that order.
    unknown: bool = False

    def main_alive(self) -> bool:
        return self.pidfd >= 0


class Turns:
    def __init__(
        self,
        settings: Settings,
        store: IndexedStore,
        hands: TurnHands,
        journal: Journal,
        *,
        notify: Callable[[Settled], None],
        watch_fd: Callable[[int, Turn], None],
        unwatch_fd: Callable[[int], None],
        wake: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.store = store
        self.hands = hands
        self.journal = journal
        self.notify = notify
        self.watch_fd = watch_fd
        self.unwatch_fd = unwatch_fd
        self.wake = wake  # a turn ended or failed to start: admission should run
        self._turns: dict[int, Turn] = {}
        # A start found systemd silent (a daemon-reexec): the gate's admission stops
        # starting turns in this pass and tries again a second later.
        self.systemd_silent = False

    # -- the registry -----------------------------------------------------------------------

    def all(self) -> list[Turn]:
        """Every turn the gate holds a place for, oldest first."""
        return sorted(self._turns.values(), key=lambda turn: turn.id)

    def get(self, turn_id: int) -> Turn | None:
        return self._turns.get(turn_id)

    def add(self, turn: Turn) -> None:
        self._turns[turn.id] = turn

    def holds(self, turn: Turn) -> bool:
        return self._turns.get(turn.id) is turn

    # -- logging ----------------------------------------------------------------------------

    def log_row(self, level: str, row: Row | admission.Delivery, text: str, **fields: Any) -> None:
        """Log about one delivery, with the journal fields that find it again."""
        self.journal.log(
            level,
            f"delivery {row.id} for {row.mind}/{row.session} {text}",
            mind=row.mind,
            session=row.session,
            delivery_id=row.id,
            **fields,
        )

    def log_turn(self, level: str, turn: Turn, text: str, **fields: Any) -> None:
        """Log about one turn, with the journal fields that find it again."""
        self.journal.log(
            level,
            f"turn {turn.id} of {turn.mind}/{turn.session} {text}",
            mind=turn.mind,
            session=turn.session,
            unit=turn.unit,
            turn_id=turn.id,
            **fields,
        )

    def log_released(self, rows: Iterable[Row], now: float, how: str) -> None:
        for row in rows:
            if row.held_since is not None:
                held_ms = int((now - row.held_since) * 1000)
                self.log_row(
                    "info",
                    row,
                    f"was held {held_ms} ms ({row.hold_reason}); {how}",
                    reason=row.hold_reason,
                    held_ms=held_ms,
                    event=Event.HOLD_END,
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
                self.log_row("info", row, f"held: {reason}", reason=reason, event=Event.HOLD)

    def fold(self, fold: admission.Fold, now: float) -> None:
        """Hand deliveries to a live turn of their session, through its inbox."""
        turn = self._turns[fold.turn_id]
        rows = self.store.fold_into(turn.id, list(fold.delivery_ids), now, interrupt=fold.interrupt)
        crash_point("fold_committed")
        for row in rows:
            record = fork.delivery_record(row.id, row.session, row.message, row.interrupt)
            offer = orders.Offer(turn_id=turn.id, mind=turn.mind, delivery_id=row.id)
            try:
                self.hands.offer(offer, record)
            except VoluteError as error:
                # Not offered (no marker, or its staged file still there), or unknown (the
                # launcher was lost): when the turn ends, its report says which, and a
                # delivery it did not take goes to the session's next turn.
                self.log_row(
                    "warning",
                    row,
                    f"could not be offered into turn {turn.id}'s inbox ({error.message}): "
                    "it goes to the session's next turn",
                )
            crash_point("inbox_written")
        self.log_released(rows, now, f"folded into turn {turn.id}")
        if rows:
            ids = " ".join(str(r.id) for r in rows)
            self.log_turn("info", turn, f"took deliveries {ids} in its inbox", delivery_ids=ids)
        if fold.interrupt:
            turn.interrupted = True
            with contextlib.suppress(VoluteError):
                self.hands.interrupt(turn.id, turn.mind)
            self.log_turn("info", turn, "interrupted (SIGINT to its scope)")

    def start(self, start: admission.Start, now: float) -> None:
        """Commit the turn, then have its hands start it (directory, fork, scope, release)."""
        max_runtime = self.settings.max_runtime(start.mind)
        deadline = now + max_runtime if max_runtime else None
        turn_id, taken = self.store.start_turn(
            start.mind,
            start.session,
            lambda tid: names.turn_scope_name(start.mind, tid),
            list(start.delivery_ids),
            now,
            deadline=deadline,
        )
        crash_point("start_committed")
        unit = names.turn_scope_name(start.mind, turn_id)
        self.log_released(taken, now, f"starting turn {turn_id}")
        stdin = b"".join(
            fork.delivery_record(r.id, r.session, r.message, r.interrupt) for r in taken
        )
        order = orders.StartTurn(
            turn_id=turn_id,
            mind=start.mind,
            session=start.session,
            delivery_ids=tuple(row.id for row in taken),
        )
        try:
            launched = self.hands.start(order, stdin)
        except (LauncherLost, LauncherUnavailable) as error:
            self._start_unknown(start, turn_id, unit, now, deadline, error)
            return
        except SystemdNoAnswer as error:
            self._start_unanswered(start, turn_id, unit, taken, error)
            self.systemd_silent = True  # the gate starts nothing more for a second
            return
        except (VoluteError, OSError) as error:
            self._start_failed(start, turn_id, unit, taken, error)
            return
        self.store.mark_released(turn_id, launched.pid)
        crash_point("release_recorded")
        turn = Turn(
            id=turn_id,
            mind=start.mind,
            session=start.session,
            unit=unit,
            started_at=now,
            released=True,
            pid=launched.pid,
            pidfd=launched.pidfd,
            deadline=deadline,
            verified=True,
        )
        self._turns[turn_id] = turn
        self.watch_fd(launched.pidfd, turn)
        ids = " ".join(str(row.id) for row in taken)
        self.log_turn("info", turn, f"started with deliveries {ids}", delivery_ids=ids,
                      event=Event.START)  # fmt: skip

    def _start_unknown(
        self,
        start: admission.Start,
        turn_id: int,
        unit: str,
        now: float,
        deadline: float | None,
        error: VoluteError,
    ) -> None:
        """The launcher was lost during the start: the turn may run, or may never have.
        It keeps its place, as an adopted turn does, until systemd says which."""
        turn = Turn(
            id=turn_id,
            mind=start.mind,
            session=start.session,
            unit=unit,
            started_at=now,
            released=False,
            deadline=deadline,
            recheck_at=time.time(),
            unknown=True,
        )
        self._turns[turn_id] = turn
        self.log_turn(
            "warning", turn, f"may or may not have started ({error.message}): asking systemd"
        )
        self.wake()

    def _start_unanswered(
        self,
        start: admission.Start,
        turn_id: int,
        unit: str,
        taken: list[Row],
        error: SystemdNoAnswer,
    ) -> None:
        """systemd gave no answer about the scope (a daemon-reexec drops every call in
        flight): the child exited unreleased, so the command never ran. Not the
        deliveries' failure: they go back with no attempt counted, as a hold does."""
        self.journal.log(
            "warning",
            f"turn {turn_id} of {start.mind}/{start.session} did not start, systemd gave "
            f"no answer ({error.message}); its deliveries wait for the next pass",
            mind=start.mind,
            session=start.session,
            unit=unit,
            turn_id=turn_id,
            outcome=Outcome.NEVER_RAN,
            event=Event.END,
        )
        ids = [row.id for row in taken]
        self.store.settle_turn(
            turn_id,
            outcome=Outcome.NEVER_RAN,
            exit_status=None,
            detail=f"never ran: {error.message}",
            done=[],
            returned=ids,
            failed={},
            error=error.message,
            now=time.time(),
        )

    def _start_failed(
        self,
        start: admission.Start,
        turn_id: int,
        unit: str,
        taken: list[Row],
        error: Exception,
    ) -> None:
        """The command never ran (its hands say so, having removed what they made): the
        turn's deliveries count one failed attempt (a missing user fails every time)."""
        message = error.message if isinstance(error, VoluteError) else str(error)
        self.journal.log(
            "error",
            f"turn {turn_id} of {start.mind}/{start.session} failed to start: {message}",
            mind=start.mind,
            session=start.session,
            unit=unit,
            turn_id=turn_id,
            outcome=Outcome.START_FAILED,
            event=Event.END,
        )
        self.store.end_turn(turn_id, Outcome.START_FAILED, None, message, time.time())
        self.fail(taken, message)
        self.wake()

    # -- failures ---------------------------------------------------------------------------

    def fail(self, rows: list[Row], error: str) -> None:
        failed = self.failures(rows)
        self.store.fail_rows(failed, error, time.time())
        self.tell_dead(rows, failed, error)

    def failures(self, rows: Iterable[Row]) -> dict[int, admission.AfterFailure]:
        """Count an attempt for each row: backoff, or dead after the last."""
        gate = self.settings.gate
        now = time.time()
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
        waiters (unless they are told of the turn that carried them instead)."""
        for row in rows:
            after = failed.get(row.id)
            if after is not None and after.state is QueueState.DEAD:
                self.log_row(
                    "warning", row, f"is dead after {after.attempts} attempts: {error}",
                    event=Event.DEAD,
                )  # fmt: skip
                if notify:
                    self.notify(Settled(delivery_id=row.id, state=QueueState.DEAD, error=error))

    # -- settling -------------------------------------------------------------------------

    def close_pidfd(self, turn: Turn) -> None:
        if turn.pidfd >= 0:
            self.unwatch_fd(turn.pidfd)
            with contextlib.suppress(OSError):
                os.close(turn.pidfd)
            turn.pidfd = -1

    def finish(self, turn: Turn) -> None:
        """Nothing of the turn runs any more: settle its deliveries and free its place."""
        now = time.time()
        rows = self.store.rows_of_turn(turn.id)
        report = self.hands.inspect(turn.id, [row.id for row in rows if row.folded])
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
        not_taken = set(report.not_taken)
        returned = [row.id for row in rows if row.id in not_taken]
        carried = [row for row in rows if row.id not in not_taken]
        carried_ids = [row.id for row in carried]
        error = f"turn {turn.id} {outcome.detail}"
        failed = self.failures(carried) if outcome.kind.failed else {}
        self.store.settle_turn(
            turn.id,
            outcome=outcome.kind,
            exit_status=outcome.exit_status,
            detail=outcome.detail,
            done=carried_ids if outcome.kind.carried else [],
            returned=returned + (carried_ids if outcome.kind is Outcome.NEVER_RAN else []),
            failed=failed,
            error=error,
            now=now,
            durable=False,  # the gate calls store.sync() before it sleeps
        )
        crash_point("settled")
        self.tell_dead(carried, failed, error, notify=False)  # _tell_settled tells them
        self._turns.pop(turn.id, None)
        self.close_pidfd(turn)
        try:
            self.hands.remove(turn.id)
        except VoluteError as kept:  # the next sweep removes it
            self.log_turn("warning", turn, f"its directory stays for now: {kept.message}")
        self.log_turn(
            "warning" if outcome.kind.failed else "info",
            turn,
            f"ended: {outcome.detail}",
            outcome=outcome.kind,
            exit_status=outcome.exit_status,
            event=Event.END,
        )
        self._tell_settled(turn, outcome, carried, failed, error)
        self.wake()

    def _tell_settled(
        self,
        turn: Turn,
        outcome: admission.TurnOutcome,
        carried: list[Row],
        failed: Mapping[int, admission.AfterFailure],
        error: str,
    ) -> None:
        """Tell waiting clients of the deliveries this turn settled: done, or dead after
        their last attempt. One that will be tried again stays waited for."""
        for row in carried:
            after = failed.get(row.id)
            if outcome.kind.carried:
                state = QueueState.DONE
            elif after is not None:
                state = after.state  # dead, or backing off (then its waiters hear nothing)
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
                )
            )
