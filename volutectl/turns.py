"""The turns the gate runs: start, fold-in, settle, and re-adopt after a restart.

`Turns` carries out admission's decisions (core.admit) for one gate: it creates the
turn's row and directory, forks the child, has systemd put it in its scope, releases
it, and when systemd reports the scope empty, settles the turn's deliveries in one
durable commit. It owns no sockets and no event loop: the gate hands it the events
and gives it two callbacks, one to watch a turn's pidfd and one to tell --wait
clients how their delivery ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from volutectl import core, launcher, names
from volutectl.config import Settings, parse_bandwidth
from volutectl.errors import DataError, VoluteError
from volutectl.faults import crash_point
from volutectl.journal import Journal
from volutectl.store import Row, Store
from volutectl.systemd import LIVE_STATES, Manager, ScopeProperties

TURN_PATTERN = "volute-turn-*.scope"


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
    child: launcher.Child | None = None  # None for a turn adopted after a restart
    exit_status: int | None = None
    interrupted: bool = False


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
        turns = settings.turns
        self.scope_props = ScopeProperties(
            slice=turns.slice,
            cpu_weight=turns.cpu_weight,
            io_weight=turns.io_weight,
            io_read_bandwidth_max=tuple(parse_bandwidth(v) for v in turns.io_read_bandwidth_max),
            io_write_bandwidth_max=tuple(parse_bandwidth(v) for v in turns.io_write_bandwidth_max),
        )

    def live_units(self) -> set[str]:
        """Turn scopes systemd lists as live in the turns slice (ours and any others)."""
        ours = {turn.unit for turn in self.turns.values()}
        units = self.manager.list_units(self.settings.turns.slice, [TURN_PATTERN], known=ours)
        return {unit.name for unit in units}

    def live(self, live_names: set[str]) -> list[core.LiveTurn]:
        """Our turns whose scopes systemd lists as live."""
        return [
            core.LiveTurn(turn.id, turn.mind, turn.session)
            for turn in self.turns.values()
            if turn.unit in live_names
        ]

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
        rows = self.store.fold_into(turn.id, list(fold.delivery_ids), now)
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
        turn_id, taken = self.store.start_turn(
            start.mind,
            start.session,
            lambda tid: names.turn_scope_name(start.mind, tid),
            list(start.delivery_ids),
            now,
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
            stdin = b"".join(
                launcher.delivery_record(r.id, r.session, r.message, r.interrupt) for r in taken
            )
            turn_dir = launcher.make_turn_dir(
                self.settings.gate.runtime_dir, turn_id, account, stdin
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
            props = ScopeProperties(
                **{
                    **self.scope_props.__dict__,
                    "description": f"volute turn {turn_id} of {start.mind}/{start.session}",
                }
            )
            self.manager.start_scope(unit, [child.pid], props)
            crash_point("scope_started")
            child.release()
            crash_point("released")
        except VoluteError as error:
            if child is not None:
                child.abandon()
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child.pid, 0)
                os.close(child.pidfd)
            self.journal.log(
                "error",
                f"turn {turn_id} of {start.mind}/{start.session} failed to start: {error.message}",
                mind=start.mind,
                session=start.session,
                unit=unit,
            )
            self.store.end_turn(turn_id, "start_failed", None, error.message, time.time())
            self.fail(taken, error.message)
            self._remove_dir(turn_id)
            self.changed = True
            return
        self.store.mark_released(turn_id)
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
        )

    def _remove_dir(self, turn_id: int) -> None:
        launcher.TurnDir(self.settings.gate.runtime_dir / "turns" / str(turn_id)).remove()

    def fail(self, rows: list[Row], error: str) -> None:
        self.store.fail_rows(self.failure_updates(rows, error), error, time.time())

    def failure_updates(
        self, rows: list[Row], error: str
    ) -> list[tuple[int, str, int, float | None]]:
        """Count an attempt for each row (backoff or dead), and tell --wait clients of the dead."""
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
            if after.state == "dead":
                self._log_row("warning", row, f"is dead after {after.attempts} attempts: {error}")
                self.notify(row.id, {"event": "dead", "id": row.id, "error": error, "exit_code": 1})
        return updates

    # -- turns ending --------------------------------------------------------------------

    def reap(self, turn: Turn) -> None:
        if turn.child is None:
            return
        with contextlib.suppress(ChildProcessError):
            pid, status = os.waitpid(turn.child.pid, os.WNOHANG)
            if pid == turn.child.pid:
                turn.exit_status = os.waitstatus_to_exitcode(status)
                if turn.exit_status < 0:  # killed by a signal
                    turn.exit_status = 128 - turn.exit_status
        self.unwatch_fd(turn.child.pidfd)
        with contextlib.suppress(OSError):
            os.close(turn.child.pidfd)
        turn.child.pidfd = -1
        turn.child = None

    def unit_ended(self, unit: str) -> None:
        parsed = names.parse_turn_scope_name(unit)
        if parsed is None:
            return
        turn = self.turns.get(parsed[1])
        if turn is None or turn.unit != unit:
            self.changed = True  # a foreign scope ended: the budget may have freed
            return
        # systemd also announces a scope's initial "inactive" while it is being
        # created; only the unit's state right now says whether it really ended.
        with contextlib.suppress(VoluteError):
            if self.manager.unit_property(unit, "ActiveState") in LIVE_STATES:
                return
        self.reap(turn)
        self.finish(turn)

    def finish(self, turn: Turn) -> None:
        """The turn's scope is empty: settle its deliveries and free its place."""
        now = time.time()
        exit_status = turn.exit_status
        if exit_status is None:
            exit_status = turn.turn_dir.exit_status()
        outcome = core.turn_outcome(
            exit_status=exit_status,
            started_marker=turn.turn_dir.started(),
            released=turn.released,
            interrupted=turn.interrupted,
        )
        rows = self.store.rows_of_turn(turn.id)
        untaken = turn.turn_dir.untaken()
        returned = [row.id for row in rows if row.folded and row.id in untaken]
        carried = [row for row in rows if row.id not in set(returned)]
        if returned:
            launcher.withdraw(turn.turn_dir, returned)
        carried_ids = [row.id for row in carried]
        error = f"turn {turn.id} {outcome.detail}"
        failed = self.failure_updates(carried, error) if outcome.kind == "failed" else []
        # One durable commit settles the turn and all of its rows.
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
        self.turns.pop(turn.id, None)
        turn.turn_dir.remove()
        level = "warning" if outcome.kind == "failed" else "info"
        self._log_turn(
            level,
            turn,
            f"ended: {outcome.detail}",
            outcome=outcome.kind,
            exit_status=outcome.exit_status,
        )
        if outcome.kind != "never_ran":
            code = core.wait_exit_code(outcome.exit_status)
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
        """Match live turn scopes to the store's open turns; settle the ones that ended."""
        live_names = self.live_units()
        for row in self.store.open_turns():
            turn_dir = launcher.TurnDir(self.settings.gate.runtime_dir / "turns" / str(row.id))
            account = None
            with contextlib.suppress(VoluteError, KeyError):
                account = self.account_of(row.mind)
            turn = Turn(
                row.id,
                row.mind,
                row.session,
                row.unit,
                turn_dir,
                account,
                row.started_at,
                row.released,
            )
            if row.unit in live_names:
                self.turns[row.id] = turn
                self._log_turn("info", turn, "is still running: adopted")
            else:
                self.finish(turn)
        self.changed = True
