"""The turns the gate runs: start, fold-in, and settle.

`Turns` carries out admission's decisions (core.admit): it creates a turn's row and
directory, forks the child, has systemd put it in its scope, releases it, and, once
volutectl/liveness.py has systemd's word that nothing of the turn runs any more,
settles its deliveries in one commit. It owns no sockets and no event loop: the gate
gives it callbacks, to watch a pidfd, to tell waiting clients how their delivery ended,
and to say that admission should run again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from volutectl import core, dirfds, launcher, names, preflight, processes, turndir
from volutectl.config import Settings, parse_bandwidth
from volutectl.errors import DataError, VoluteError
from volutectl.faults import crash_point
from volutectl.indexedstore import IndexedStore
from volutectl.journal import Event, Journal
from volutectl.messages import DeliveryDead, Reply, TurnEnded
from volutectl.states import HoldReason, Outcome, QueueState
from volutectl.store import Row
from volutectl.units import ScopeProperties, SystemdManager

# systemd's RuntimeMaxSec= backstop fires this long after the gate's own deadline (plus
# the kill grace; less for limits shorter than this), so that with the gate up its own
# timer decides.
BACKSTOP_MARGIN_SECONDS = 30.0


@dataclass
class Turn:
    """A turn the gate knows is (or may be) running."""

    id: int
    mind: str
    session: str
    unit: str
    turn_dir: launcher.TurnDir
    account: launcher.Account | None
    started_at: float
    released: bool
    child: launcher.Child | None = None  # forked by this gate; None when adopted
    pidfd: int = -1  # watched: the main process's pidfd, while it lives
    exit_status: int | None = None
    interrupted: bool = False
    deadline: float | None = None  # wall clock; None: no time limit
    timed_out_at: float | None = None
    # systemd showed the scope holding a process (or its main process is ours and
    # alive): from then on, systemd reports when it empties.
    verified: bool = False
    recheck_at: float | None = None  # a question to systemd failed; ask again then

    def main_alive(self) -> bool:
        return self.pidfd >= 0


class Turns:
    def __init__(
        self,
        settings: Settings,
        store: IndexedStore,
        manager: SystemdManager,
        journal: Journal,
        *,
        notify: Callable[[int, Reply], None],
        watch_fd: Callable[[int, Turn], None],
        unwatch_fd: Callable[[int], None],
        wake: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.store = store
        self.manager = manager
        self.journal = journal
        self.notify = notify
        self.watch_fd = watch_fd
        self.unwatch_fd = unwatch_fd
        self.wake = wake  # a turn ended or failed to start: admission should run
        self._turns: dict[int, Turn] = {}
        self.accounts: dict[str, launcher.Account] = {}
        self.trash_waiting = False  # something was set aside in turns/.trash
        turns = settings.turns
        self.scope_props = ScopeProperties(
            slice=turns.slice,
            cpu_weight=turns.cpu_weight,
            io_weight=turns.io_weight,
            io_read_bandwidth_max=tuple(parse_bandwidth(v) for v in turns.io_read_bandwidth_max),
            io_write_bandwidth_max=tuple(parse_bandwidth(v) for v in turns.io_write_bandwidth_max),
            stop_timeout_seconds=turns.timeout_grace_seconds,
        )

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

    def log_row(self, level: str, row: Row | core.Delivery, text: str, **fields: Any) -> None:
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

    def fold(self, fold: core.Fold, now: float) -> None:
        """Hand deliveries to a live turn of their session, through its inbox."""
        turn = self._turns[fold.turn_id]
        rows = self.store.fold_into(turn.id, list(fold.delivery_ids), now, interrupt=fold.interrupt)
        crash_point("fold_committed")
        account = turn.account or self.account_of(turn.mind)
        for row in rows:
            record = launcher.delivery_record(row.id, row.session, row.message, row.interrupt)
            try:
                launcher.offer(turn.turn_dir, row.id, record, account)
            except OSError as error:
                # Not offered (no marker, or its staged file still there): not_taken says
                # so when the turn ends, and the delivery goes to the next turn.
                self.log_row(
                    "warning",
                    row,
                    f"could not be offered into turn {turn.id}'s inbox "
                    f"({error.strerror or error}): it goes to the session's next turn",
                )
            crash_point("inbox_written")
        self.log_released(rows, now, f"folded into turn {turn.id}")
        if rows:
            ids = " ".join(str(r.id) for r in rows)
            self.log_turn("info", turn, f"took deliveries {ids} in its inbox", delivery_ids=ids)
        if fold.interrupt:
            turn.interrupted = True
            with contextlib.suppress(VoluteError):
                self.manager.kill_unit(turn.unit, signal.SIGINT)
            self.log_turn("info", turn, "interrupted (SIGINT to its scope)")

    def account_of(self, mind: str) -> launcher.Account:
        """The mind's user, looked up once: NSS lookups would sit on every handoff."""
        account = self.accounts.get(mind)
        if account is None:
            configured = self.settings.minds[mind].user
            account = launcher.resolve_account(configured or self.settings.turns.default_user)
            self.accounts[mind] = account
        return account

    def start(self, start: core.Start, now: float) -> None:
        """Commit the turn, fork its child, have systemd put it in its scope, release it."""
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
        turn_dir, child = None, None
        try:
            account = self.account_of(start.mind)
            turn_dir, argv, env, cwd = self._prepare(start, turn_id, account)
            stdin = b"".join(
                launcher.delivery_record(r.id, r.session, r.message, r.interrupt) for r in taken
            )
            stream = self.journal.turn_stream(start.mind, unit)
            child = launcher.fork_turn(argv, env, account, turn_dir, cwd, stream, stdin=stdin)
            crash_point("forked")
            self.manager.start_scope(unit, [child.pid], self._scope_props(start, turn_id))
            crash_point("scope_started")
            child.release()
            crash_point("released")
        except (VoluteError, OSError, KeyError) as error:
            self._start_failed(start, turn_id, unit, taken, child, error)
            return
        except BaseException:
            # The gate is going down mid-start: the child must not wait for it. Its pipe
            # closes, and it exits having run nothing, as it would if the gate died.
            if child is not None:
                child.abandon()
                with contextlib.suppress(ChildProcessError):
                    processes.wait(child.pid)
            raise
        self.store.mark_released(turn_id, child.pid)
        crash_point("release_recorded")
        turn = Turn(turn_id, start.mind, start.session, unit, turn_dir, account, now, True,
                    child, pidfd=child.pidfd, deadline=deadline, verified=True)  # fmt: skip
        self._turns[turn_id] = turn
        self.watch_fd(child.pidfd, turn)
        ids = " ".join(str(row.id) for row in taken)
        self.log_turn("info", turn, f"started with deliveries {ids}", delivery_ids=ids,
                      event=Event.START)  # fmt: skip

    def _prepare(
        self, start: core.Start, turn_id: int, account: launcher.Account
    ) -> tuple[launcher.TurnDir, list[str], dict[str, str], str]:
        """The turn's directory, command, environment and cwd."""
        mind = self.settings.minds.get(start.mind)
        if mind is None:
            raise DataError(f"mind {start.mind!r} is no longer configured")
        cwd = preflight.turn_directory(start.mind, mind, account)  # before anything is made
        extra = launcher.mind_environment(mind.environment, mind.environment_file)
        turn_dir = launcher.make_turn_dir(self.settings.gate.runtime_dir, turn_id, account)
        env = launcher.turn_environment(
            account,
            mind=start.mind,
            session=start.session,
            turn_id=turn_id,
            delivery_ids=list(start.delivery_ids),
            turn_dir=turn_dir,
            extra=extra,
        )
        return turn_dir, launcher.command_argv(mind.command), env, cwd

    def _scope_props(self, start: core.Start, turn_id: int) -> ScopeProperties:
        max_runtime = self.settings.max_runtime(start.mind)
        backstop = None
        if max_runtime:
            grace = self.settings.turns.timeout_grace_seconds
            backstop = max_runtime + grace + min(BACKSTOP_MARGIN_SECONDS, max_runtime)
        return ScopeProperties(
            **{
                **self.scope_props.__dict__,
                "description": f"volute turn {turn_id} of {start.mind}/{start.session}",
                "runtime_max_seconds": backstop,
            }
        )

    def _start_failed(
        self,
        start: core.Start,
        turn_id: int,
        unit: str,
        taken: list[Row],
        child: launcher.Child | None,
        error: Exception,
    ) -> None:
        """The command never ran: the child (if forked) exits unreleased, and the turn's
        deliveries count one failed attempt (a missing user or mind fails every time)."""
        message = error.message if isinstance(error, VoluteError) else str(error)
        if child is not None:
            child.abandon()
            with contextlib.suppress(ChildProcessError):
                processes.wait(child.pid)
            os.close(child.pidfd)
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
        turns = self.settings.gate.runtime_dir / "turns"
        self.remove_turn_dir(launcher.TurnDir(turns / str(turn_id)))
        self.wake()

    # -- failures ---------------------------------------------------------------------------

    def fail(self, rows: list[Row], error: str) -> None:
        failed = self.failures(rows)
        self.store.fail_rows(failed, error, time.time())
        self.tell_dead(rows, failed, error)

    def failures(self, rows: Iterable[Row]) -> dict[int, core.AfterFailure]:
        """Count an attempt for each row: backoff, or dead after the last."""
        gate = self.settings.gate
        now = time.time()
        return {
            row.id: core.after_failure(
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
        failed: Mapping[int, core.AfterFailure],
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
                    self.notify(row.id, DeliveryDead(row.id, error))

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
        record = turn.turn_dir.record()
        exit_status = turn.exit_status
        if exit_status is None:
            exit_status = record.exit_status
        outcome = core.turn_outcome(
            exit_status=exit_status,
            started_marker=record.started,
            released=turn.released,
            interrupted=turn.interrupted,
            timed_out=core.timed_out(
                turn.deadline,
                stopped_at=turn.timed_out_at,
                ended_at=record.ended_at,
                now=now,
            ),
        )
        rows = self.store.rows_of_turn(turn.id)
        not_taken = turn.turn_dir.not_taken([row.id for row in rows if row.folded])
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
        self.remove_turn_dir(turn.turn_dir)
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

    def remove_turn_dir(self, turn_dir: launcher.TurnDir) -> None:
        """Remove a turn's directory within its budget. What is left waits in
        turns/.trash, and is tried again, within the same budget, after each later
        removal, and at the gate's next start. Never fails a settlement."""
        try:
            left = turn_dir.remove()
        except OSError as error:
            self.journal.log(
                "warning", f"could not remove {turn_dir.path}: {error.strerror or error}"
            )
            return
        if left is not None:
            self.journal.log(
                "warning",
                f"{turn_dir.path} was too large to remove at once: set aside as {left}, to "
                "be removed a part at a time",
            )
            self.trash_waiting = True
        elif self.trash_waiting:
            budget = dirfds.Budget(turndir.REMOVE_ENTRIES, turndir.REMOVE_SECONDS)
            swept = turndir.empty_trash(self.settings.gate.runtime_dir, budget)
            self.trash_waiting = bool(swept.left or swept.errors)

    def _tell_settled(
        self,
        turn: Turn,
        outcome: core.TurnOutcome,
        carried: list[Row],
        failed: Mapping[int, core.AfterFailure],
        error: str,
    ) -> None:
        """Tell waiting clients of the deliveries this turn settled: done, or dead after
        their last attempt. One that will be tried again stays waited for."""
        code = core.wait_exit_code(outcome.exit_status, outcome.kind)
        for row in carried:
            if outcome.kind.carried:
                event: Reply = TurnEnded(row.id, turn.id, outcome.kind, outcome.exit_status, code)
            elif failed.get(row.id) is not None and failed[row.id].state is QueueState.DEAD:
                event = DeliveryDead(row.id, error, code, turn.id, outcome.kind)
            else:
                continue
            self.notify(row.id, event)
