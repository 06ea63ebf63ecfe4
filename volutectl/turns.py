"""The turns the gate runs: start, fold-in, settle, and re-adopt after a restart.

`Turns` carries out admission's decisions (core.admit) for one gate: it creates the
turn's row and directory, forks the child, has systemd put it in its scope, releases
it, and when the turn is over, settles its deliveries in one commit. It owns no
sockets and no event loop: the gate hands it the events and gives it callbacks, to
watch a pidfd and to tell --wait clients how their delivery ended.

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
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from volutectl import core, launcher, names
from volutectl.config import Settings, parse_bandwidth
from volutectl.errors import DataError, VoluteError
from volutectl.faults import crash_point
from volutectl.journal import Journal
from volutectl.store import Row, Store, TurnRow
from volutectl.systemd import ENDED_STATES, Manager, ScopeProperties

TURN_PATTERN = "volute-turn-*.scope"
RECHECK_SECONDS = 1.0  # after a failed question to systemd, ask again this much later
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
        store: Store,
        manager: Manager,
        journal: Journal,
        *,
        notify: Callable[[int, dict[str, Any]], None],
        watch_fd: Callable[[int, Turn], None],
        unwatch_fd: Callable[[int], None],
    ) -> None:
        self.settings = settings
        self.store = store
        self.manager = manager
        self.journal = journal
        self.notify = notify
        self.watch_fd = watch_fd
        self.unwatch_fd = unwatch_fd
        self.turns: dict[int, Turn] = {}
        self.accounts: dict[str, launcher.Account] = {}
        self.changed = False  # a turn ended or failed to start: admission should run
        # Scopes of turns we settled that systemd may still list as live for a moment
        # (settled on seeing them empty): not counted, not asked about again.
        self.settled_units: set[str] = set()
        turns = settings.turns
        self.scope_props = ScopeProperties(
            slice=turns.slice,
            cpu_weight=turns.cpu_weight,
            io_weight=turns.io_weight,
            io_read_bandwidth_max=tuple(parse_bandwidth(v) for v in turns.io_read_bandwidth_max),
            io_write_bandwidth_max=tuple(parse_bandwidth(v) for v in turns.io_write_bandwidth_max),
            stop_timeout_seconds=turns.timeout_grace_seconds,
        )

    # -- what runs ---------------------------------------------------------------------

    def count_live(self) -> tuple[list[core.LiveTurn], int]:
        """Our live turns, and how many other scopes in the turns slice hold a process.

        Raises SystemdError if systemd cannot list the slice: admission must then wait,
        not guess. Only scopes that really hold a process count against the cap."""
        ours = {turn.unit: turn for turn in self.turns.values()}
        listed = self.manager.list_units(self.settings.turns.slice, [TURN_PATTERN], known=ours)
        names_listed = {unit.name for unit in listed}
        self.settled_units &= names_listed
        for turn in list(self.turns.values()):
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
            core.LiveTurn(turn.id, turn.mind, turn.session)
            for turn in self.turns.values()
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
        self.journal.log(
            "warning",
            f"{unit} is active but holds no process: stopping it (a turn started around a "
            "process that had died)",
            unit=unit,
            event="empty_scope",
        )
        self._stop_quietly(unit)
        self.settled_units.add(unit)
        return False

    def _stop_quietly(self, unit: str) -> None:
        try:
            self.manager.stop_unit(unit, wait=False)
        except VoluteError as error:
            self.journal.log("warning", f"could not stop {unit}: {error.message}", unit=unit)

    def check(self, turn: Turn) -> None:
        """Ask systemd whether the turn still runs; settle it only if systemd says no.

        Called when its main process exited, when systemd reported its scope inactive,
        at adoption, and when a question failed before. The answers that settle: the
        unit is not loaded, is inactive or failed, or holds no process (then, if it was
        never seen holding one, it is stopped too: it would stay active for ever). Any
        failed question: ask again in RECHECK_SECONDS."""
        if turn.id not in self.turns:
            return
        try:
            state = self.manager.active_state(turn.unit)
            pids = (
                None if state is None or state in ENDED_STATES
                else self.manager.unit_processes(turn.unit)
            )  # fmt: skip
        except VoluteError as error:
            if turn.recheck_at is None:
                self._log_turn(
                    "warning",
                    turn,
                    f"cannot tell whether it still runs ({error.message}): it keeps its "
                    f"place; asking again in {RECHECK_SECONDS:.0f} s",
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
                self._log_turn(
                    "warning",
                    turn,
                    f"{turn.unit} is {state} but holds no process: stopping it",
                    event="empty_scope",
                )
                self._stop_quietly(turn.unit)
            # Otherwise its last process just left, and systemd is about to say so.
            self.settled_units.add(turn.unit)
        try:
            self.finish(turn)
        except (VoluteError, sqlite3.Error, OSError) as error:
            # The settlement's commit failed (a full disk): nothing of it happened. The
            # turn keeps its place until it can be settled.
            text = error.message if isinstance(error, VoluteError) else str(error)
            self._log_turn("error", turn, f"could not be settled: {text}; retrying")
            turn.recheck_at = time.time() + RECHECK_SECONDS

    # -- deadlines -----------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest wall-clock time at which `on_deadline` has work: a turn's time
        limit, or a question to systemd to ask again."""
        times = [t.recheck_at for t in self.turns.values() if t.recheck_at is not None]
        times += [
            t.deadline
            for t in self.turns.values()
            if t.deadline is not None and t.timed_out_at is None
        ]
        return min(times) if times else None

    def on_deadline(self, now: float) -> None:
        for turn in list(self.turns.values()):
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
        self._log_turn(
            "warning",
            turn,
            f"ran past its limit of {limit:.0f} s: stopping it (SIGTERM, then SIGKILL after "
            f"{self.settings.turns.timeout_grace_seconds:g} s)",
            event="timeout",
        )
        try:
            self.manager.stop_unit(turn.unit, wait=False)
        except VoluteError as error:
            # Stopping it is still owed: systemd's RuntimeMaxSec= backstop will, and
            # so will the next check.
            self._log_turn("warning", turn, f"could not stop it: {error.message}")
            turn.recheck_at = now + RECHECK_SECONDS

    def record_holds(self, holds: list[core.Hold], rows: dict[int, Row], now: float) -> None:
        # Only holds that began or changed reason: the rest are already recorded.
        changed = [
            (h.delivery_id, h.reason)
            for h in holds
            if rows[h.delivery_id].held_since is None or rows[h.delivery_id].hold_reason != h.reason
        ]
        if not changed:
            return
        new = set(self.store.mark_held(changed, now))
        for hold in holds:
            if hold.delivery_id in new:
                row = rows[hold.delivery_id]
                self._log_row("info", row, f"held: {hold.reason}", reason=hold.reason, event="hold")

    def _log_row(self, level: str, row: Row, text: str, **fields: Any) -> None:
        """Log about one delivery, with the journal fields that find it again."""
        self.journal.log(
            level,
            f"delivery {row.id} for {row.mind}/{row.session} {text}",
            mind=row.mind,
            session=row.session,
            delivery_id=row.id,
            **fields,
        )

    def _log_turn(self, level: str, turn: Turn, text: str, **fields: Any) -> None:
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

    def log_released(self, rows: list[Row], now: float, how: str) -> None:
        for row in rows:
            if row.held_since is not None:
                held_ms = int((now - row.held_since) * 1000)
                self._log_row(
                    "info",
                    row,
                    f"was held {held_ms} ms ({row.hold_reason}); {how}",
                    reason=row.hold_reason,
                    held_ms=held_ms,
                    event="hold_end",
                )

    def fold(self, fold: core.Fold, now: float) -> None:
        turn = self.turns[fold.turn_id]
        rows = self.store.fold_into(turn.id, list(fold.delivery_ids), now, interrupt=fold.interrupt)
        crash_point("fold_committed")
        account = turn.account or self.account_of(turn.mind)
        for row in rows:
            record = launcher.delivery_record(row.id, row.session, row.message, row.interrupt)
            launcher.offer(turn.turn_dir, row.id, record, account)
            crash_point("inbox_written")
        self.log_released(rows, now, f"folded into turn {turn.id}")
        if rows:
            ids = " ".join(str(r.id) for r in rows)
            self._log_turn("info", turn, f"took deliveries {ids} in its inbox", delivery_ids=ids)
        if fold.interrupt:
            turn.interrupted = True
            with contextlib.suppress(VoluteError):
                self.manager.kill_unit(turn.unit, signal.SIGINT)
            self._log_turn("info", turn, "interrupted (SIGINT to its scope)")

    def account_of(self, mind: str) -> launcher.Account:
        """The mind's user, looked up once: NSS lookups would sit on every handoff."""
        account = self.accounts.get(mind)
        if account is None:
            configured = self.settings.minds[mind].user
            account = launcher.resolve_account(configured or self.settings.turns.default_user)
            self.accounts[mind] = account
        return account

    def start(self, start: core.Start, now: float) -> None:
        mind_settings = self.settings.minds.get(start.mind)
        max_runtime = self.settings.max_runtime(start.mind)
        turn_id, taken = self.store.start_turn(
            start.mind,
            start.session,
            lambda tid: names.turn_scope_name(start.mind, tid),
            list(start.delivery_ids),
            now,
            deadline=now + max_runtime if max_runtime else None,
        )
        crash_point("start_committed")
        unit = names.turn_scope_name(start.mind, turn_id)
        ids = [row.id for row in taken]
        self.log_released(taken, now, f"starting turn {turn_id}")
        child: launcher.Child | None = None
        try:
            if mind_settings is None:
                raise DataError(f"mind {start.mind!r} is no longer configured")
            account = self.account_of(start.mind)
            turn_dir = launcher.make_turn_dir(
                self.settings.gate.runtime_dir,
                turn_id,
                account,
                b"".join(
                    launcher.delivery_record(r.id, r.session, r.message, r.interrupt) for r in taken
                ),
            )
            env = launcher.turn_environment(
                account,
                mind=start.mind,
                session=start.session,
                turn_id=turn_id,
                delivery_ids=ids,
                turn_dir=turn_dir,
                extra=mind_settings.environment,
            )
            cwd = str(mind_settings.working_directory or account.home or "/")
            argv = launcher.command_argv(mind_settings.command)
            child = launcher.fork_turn(argv, env, account, turn_dir, cwd)
            crash_point("forked")
            self.manager.start_scope(unit, [child.pid], self._scope_props(start, turn_id))
            crash_point("scope_started")
            child.release()
            crash_point("released")
        except (VoluteError, OSError) as error:
            self._start_failed(start, turn_id, unit, taken, child, error)
            return
        self.store.mark_released(turn_id, child.pid)
        crash_point("release_recorded")
        turn = Turn(
            turn_id,
            start.mind,
            start.session,
            unit,
            turn_dir,
            account,
            now,
            True,
            child,
            pidfd=child.pidfd,
            deadline=now + max_runtime if max_runtime else None,
            verified=True,
        )
        self.turns[turn_id] = turn
        self.watch_fd(child.pidfd, turn)
        self.journal.log(
            "info",
            f"started turn {turn_id} of {start.mind}/{start.session} with deliveries "
            f"{' '.join(map(str, ids))}",
            mind=start.mind,
            session=start.session,
            unit=unit,
            turn_id=turn_id,
            delivery_ids=" ".join(map(str, ids)),
            event="start",
        )

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
        error: VoluteError | OSError,
    ) -> None:
        """The command never ran: the child (if forked) exits unreleased, and the turn's
        deliveries count one failed attempt (a missing user or mind fails every time)."""
        message = error.message if isinstance(error, VoluteError) else str(error)
        if child is not None:
            child.abandon()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child.pid, 0)
            os.close(child.pidfd)
        self.journal.log(
            "error",
            f"turn {turn_id} of {start.mind}/{start.session} failed to start: {message}",
            mind=start.mind,
            session=start.session,
            unit=unit,
        )
        self.store.end_turn(turn_id, "start_failed", None, message, time.time())
        self.fail(taken, message)
        self._remove_dir(turn_id)
        self.changed = True

    def _remove_dir(self, turn_id: int) -> None:
        launcher.TurnDir(self.settings.gate.runtime_dir / "turns" / str(turn_id)).remove()

    def fail(self, rows: list[Row], error: str) -> None:
        updates = self.failure_updates(rows, error)
        self.store.fail_rows(updates, error, time.time())
        self.tell_dead(rows, updates, error)

    def failure_updates(
        self, rows: list[Row], error: str
    ) -> list[tuple[int, str, int, float | None]]:
        """Count an attempt for each row: (id, backoff or dead, attempts, not_before)."""
        gate = self.settings.gate
        now = time.time()
        updates = []
        for row in rows:
            after = core.after_failure(
                row.attempts,
                now=now,
                max_attempts=gate.max_attempts,
                initial=gate.backoff_initial_seconds,
                ceiling=gate.backoff_max_seconds,
            )
            updates.append((row.id, after.state, after.attempts, after.not_before))
        return updates

    def tell_dead(
        self, rows: list[Row], updates: list[tuple[int, str, int, float | None]], error: str
    ) -> None:
        """Once the failure is committed: log the rows that went dead, tell their waiters."""
        by_id = {row.id: row for row in rows}
        for delivery_id, state, attempts, _ in updates:
            if state == "dead":
                row = by_id[delivery_id]
                self._log_row(
                    "warning", row, f"is dead after {attempts} attempts: {error}", event="dead"
                )
                self.notify(row.id, {"event": "dead", "id": row.id, "error": error, "exit_code": 1})

    # -- turns ending --------------------------------------------------------------------

    def reap(self, turn: Turn) -> None:
        """The turn's main process exited (its pidfd is readable): collect its status if
        it is our child, then find out whether the scope is done."""
        if turn.child is not None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(turn.child.pid, os.WNOHANG)
                if pid == turn.child.pid:
                    turn.exit_status = os.waitstatus_to_exitcode(status)
                    if turn.exit_status < 0:  # killed by a signal
                        turn.exit_status = 128 - turn.exit_status
            turn.child = None
        self._close_pidfd(turn)
        self.check(turn)

    def _close_pidfd(self, turn: Turn) -> None:
        if turn.pidfd >= 0:
            self.unwatch_fd(turn.pidfd)
            with contextlib.suppress(OSError):
                os.close(turn.pidfd)
            turn.pidfd = -1

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
            self.changed = True  # a foreign scope ended: the budget may have freed
            return
        if turn.main_alive():
            # systemd also announces a scope's initial "inactive" while creating it; and
            # a scope cannot have ended while its main process lives. Its pidfd will say.
            return
        self.check(turn)

    def finish(self, turn: Turn) -> None:
        """Nothing of the turn runs any more: settle its deliveries and free its place."""
        now = time.time()
        exit_status = turn.exit_status
        if exit_status is None:
            exit_status = turn.turn_dir.exit_status()
        outcome = core.turn_outcome(
            exit_status=exit_status,
            started_marker=turn.turn_dir.started(),
            released=turn.released,
            interrupted=turn.interrupted,
            timed_out=core.timed_out(
                turn.deadline,
                stopped_at=turn.timed_out_at,
                ended_at=turn.turn_dir.ended_at(),
                now=now,
            ),
        )
        rows = self.store.rows_of_turn(turn.id)
        not_taken = turn.turn_dir.not_taken([row.id for row in rows if row.folded])
        returned = [row.id for row in rows if row.id in not_taken]
        carried = [row for row in rows if row.id not in not_taken]
        carried_ids = [row.id for row in carried]
        error = f"turn {turn.id} {outcome.detail}"
        failing = outcome.kind in ("failed", "timeout")
        failed = self.failure_updates(carried, error) if failing else []
        # One commit settles the turn and all of its rows.
        self.store.settle_turn(
            turn.id,
            outcome=outcome.kind,
            exit_status=outcome.exit_status,
            detail=outcome.detail,
            done=carried_ids if outcome.kind in ("ok", "interrupted") else [],
            returned=returned + (carried_ids if outcome.kind == "never_ran" else []),
            failed=failed,
            error=error,
            now=now,
            durable=False,  # the gate calls store.sync() before it sleeps
        )
        crash_point("settled")
        self.tell_dead(carried, failed, error)
        self.turns.pop(turn.id, None)
        self._close_pidfd(turn)
        turn.turn_dir.remove()
        self._log_turn(
            "warning" if failing else "info",
            turn,
            f"ended: {outcome.detail}",
            outcome=outcome.kind,
            exit_status=outcome.exit_status,
            event="end",
        )
        if outcome.kind != "never_ran":
            code = core.wait_exit_code(outcome.exit_status, outcome.kind)
            for row in carried:
                self.notify(
                    row.id,
                    {
                        "event": "turn_ended",
                        "id": row.id,
                        "turn_id": turn.id,
                        "outcome": outcome.kind,
                        "exit_status": outcome.exit_status,
                        "exit_code": code,
                    },
                )
        self.changed = True

    # -- recovery ----------------------------------------------------------------------

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
            self.turns[row.id] = turn
            if row.pid is not None:
                self._watch_adopted(turn, row.pid)
            self.check(turn)
            if row.id in self.turns and turn.recheck_at is None:
                self._log_turn("info", turn, "is still running: adopted", event="adopt")
        self.changed = True

    def _remove_stale_dirs(self, open_ids: set[int]) -> None:
        """Turn directories of turns already settled: a gate killed after settling a turn
        and before removing its directory leaves one behind."""
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.settings.gate.runtime_dir / "turns"):
                if entry.name.isdigit() and int(entry.name) not in open_ids:
                    launcher.TurnDir(Path(entry.path)).remove()

    def _turn_from_row(self, row: TurnRow) -> Turn:
        account = None
        with contextlib.suppress(VoluteError, KeyError):
            account = self.account_of(row.mind)
        return Turn(
            row.id,
            row.mind,
            row.session,
            row.unit,
            launcher.TurnDir(self.settings.gate.runtime_dir / "turns" / str(row.id)),
            account,
            row.started_at,
            row.released,
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
        self.watch_fd(fd, turn)
