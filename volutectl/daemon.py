"""The gate daemon: one event loop over file descriptors, no polling.

It waits in one select() on: the listening socket and its clients, the D-Bus connection
(scope-ended signals), a pidfd per turn it forked, and a stop fd. A timeout is used
only for real deadlines: a failed delivery's backoff, and the watchdog.

Each pass: take in requests (deliveries share one durable commit, then are
acknowledged), process turns that ended, then run admission (core.admit) against the
live turn scopes that systemd lists in the turns slice, and carry out its decisions.

`Gate(settings).run(stop_fd)` is the library entry that tests call; `gate_command` is
the thin CLI edge that installs signal handlers and talks sd_notify.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import selectors
import signal
import socket
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from volutectl import core, launcher, names, protocol
from volutectl.config import Settings, load_settings, parse_bandwidth
from volutectl.errors import (
    EX_DATAERR,
    EX_NOUSER,
    EX_USAGE,
    DataError,
    UnavailableError,
    VoluteError,
)
from volutectl.journal import Journal, sd_notify, watchdog_interval
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


@dataclass
class Client:
    sock: socket.socket
    buffer: bytes = b""
    outbox: bytearray = field(default_factory=bytearray)
    events: int = selectors.EVENT_READ
    closed: bool = False
    waiting: set[int] = field(default_factory=set)  # delivery ids for --wait


class Gate:
    def __init__(
        self,
        settings: Settings,
        *,
        manager: Manager | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.settings = settings
        self.journal = journal or Journal("volute-gate")
        self.manager = manager
        self.store: Store | None = None
        self.listener: socket.socket | None = None
        self.selector = selectors.DefaultSelector()
        self.turns: dict[int, Turn] = {}
        self.clients: dict[int, Client] = {}
        self.waiters: dict[int, list[Client]] = {}
        self.dirty = True
        self.stopping = False
        self.watchdog: float | None = None
        self.next_ping: float | None = None
        self.backoff_wake: float | None = None
        self.foreign_live = 0
        self.accounts: dict[str, launcher.Account] = {}
        self.limits = core.Limits(
            global_cap=settings.limits.global_concurrent_turns,
            turns_per_mind=settings.limits.turns_per_mind,
            per_mind={
                name: mind.turns_per_mind
                for name, mind in settings.minds.items()
                if mind.turns_per_mind is not None
            },
        )
        turns = settings.turns
        self.scope_props = ScopeProperties(
            slice=turns.slice,
            cpu_weight=turns.cpu_weight,
            io_weight=turns.io_weight,
            io_read_bandwidth_max=tuple(parse_bandwidth(v) for v in turns.io_read_bandwidth_max),
            io_write_bandwidth_max=tuple(parse_bandwidth(v) for v in turns.io_write_bandwidth_max),
        )

    # -- lifecycle ----------------------------------------------------------------

    def open(self) -> None:
        gate = self.settings.gate
        self.store = Store(gate.state_dir / "queue.sqlite3")
        if self.manager is None:
            self.manager = Manager.connect(user=gate.manager == "user")
        # Subscribe before listing, so no turn can end unseen between the two.
        self.manager.watch_units()
        self.recover()
        self.listener = self._listen(gate.socket, gate.socket_group)
        self.selector.register(self.listener, selectors.EVENT_READ, ("accept", None))
        self.selector.register(self.manager.fileno(), selectors.EVENT_READ, ("bus", None))

    def close(self) -> None:
        for client in list(self.clients.values()):
            self._drop_client(client)
        if self.listener is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.settings.gate.socket)
            self.listener.close()
        for turn in self.turns.values():
            if turn.child is not None:
                with contextlib.suppress(OSError):
                    os.close(turn.child.pidfd)
        if self.store is not None:
            self.store.close()
        if self.manager is not None:
            self.manager.close()
        self.selector.close()

    def run(self, stop_fd: int | None = None, ready: Any = None) -> None:
        """Serve until `stop_fd` becomes readable. Turns keep running after we return."""
        self.open()
        if stop_fd is not None:
            self.selector.register(stop_fd, selectors.EVENT_READ, ("stop", None))
        if ready is not None:
            ready()
        self.journal.log(
            "info",
            f"gate ready on {self.settings.gate.socket}: cap "
            f"{self.limits.global_cap or 'unlimited'}, {self.limits.turns_per_mind} per mind",
            socket=self.settings.gate.socket,
        )
        self.watchdog = watchdog_interval() if self.settings.gate.watchdog else None
        self.next_ping = time.monotonic() + self.watchdog if self.watchdog else None
        try:
            while not self.stopping:
                self.step(self._timeout())
        finally:
            self.close()

    def _timeout(self) -> float | None:
        """How long select() may sleep: only until a real deadline, else forever."""
        assert self.store is not None and self.manager is not None
        if self.manager.has_pending_events():
            return 0.0
        now, mono = time.time(), time.monotonic()
        waits = []
        # Backoffs still to end; a row whose backoff already ended is not a deadline.
        self.backoff_wake = self.store.next_backoff_deadline(after=now)
        if self.backoff_wake is not None:
            waits.append(self.backoff_wake - now)
        waits += [deadline - mono for deadline in self._deadlines()]
        return max(0.0, min(waits)) if waits else None

    def _deadlines(self) -> list[float]:
        """Monotonic deadlines of the loop's timers (watchdog, pressure re-check)."""
        return [self.next_ping] if self.next_ping is not None else []

    def _on_deadlines(self) -> None:
        mono = time.monotonic()
        if self.next_ping is not None and self.watchdog and mono >= self.next_ping:
            sd_notify("WATCHDOG=1")
            self.next_ping = mono + self.watchdog
        if self.backoff_wake is not None and time.time() >= self.backoff_wake:
            self.backoff_wake = None
            self.dirty = True

    def step(self, timeout: float | None) -> None:
        """One pass of the loop: wait, take in what arrived, then admit."""
        assert self.manager is not None
        incoming: list[tuple[Client, dict[str, Any]]] = []
        for key, mask in self.selector.select(timeout):
            kind, data = key.data
            if kind == "accept":
                self._accept()
            elif kind == "client":
                if mask & selectors.EVENT_WRITE:
                    self._flush(data)
                if mask & selectors.EVENT_READ:
                    incoming += self._read_client(data)
            elif kind == "pidfd":
                self._reap(data)
            elif kind == "stop":
                self.stopping = True
        if incoming:
            self._handle_requests(incoming)
        for event in self.manager.process_events():
            self._unit_ended(event.name)
        self._on_deadlines()
        if self.dirty and not self.stopping:
            self.dirty = False
            self.admit()

    # -- the socket -------------------------------------------------------------------

    def _listen(self, path: Path, group: str) -> socket.socket:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()
            else:
                raise UnavailableError(f"another gate is already serving {path}")
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o117)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old_umask)
        try:
            gid = grp.getgrnam(group).gr_gid
            os.chown(path, -1, gid)
        except KeyError:
            self.journal.log(
                "warning",
                f"socket group {group!r} does not exist: only root can use {path}",
                socket=path,
            )
        except PermissionError:
            pass
        os.chmod(path, 0o660)
        listener.listen(128)
        listener.setblocking(False)
        return listener

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            client = Client(sock)
            self.clients[sock.fileno()] = client
            self.selector.register(sock, selectors.EVENT_READ, ("client", client))

    def _read_client(self, client: Client) -> list[tuple[Client, dict[str, Any]]]:
        try:
            chunk = client.sock.recv(1 << 20)
        except BlockingIOError:
            return []
        except OSError:
            chunk = b""
        if not chunk:
            self._drop_client(client)
            return []
        client.buffer += chunk
        requests = []
        while b"\n" in client.buffer:
            line, client.buffer = client.buffer.split(b"\n", 1)
            try:
                requests.append((client, protocol.decode(line)))
            except VoluteError as error:
                self._reply(client, protocol.error_reply(error))
        if len(client.buffer) > protocol.MAX_LINE:
            limit = self.settings.gate.max_message_bytes
            self._reply(
                client,
                protocol.error_reply(
                    DataError(f"request too large: the message limit is {limit} bytes")
                ),
            )
            self._drop_client(client)
        return requests

    def _reply(self, client: Client, message: dict[str, Any]) -> None:
        """Queue a reply and send what the socket takes now; never block the loop."""
        if client.closed:
            return
        client.outbox += protocol.encode(message)
        self._flush(client)

    def _flush(self, client: Client) -> None:
        try:
            while client.outbox:
                sent = client.sock.send(client.outbox)
                del client.outbox[:sent]
        except BlockingIOError:
            if len(client.outbox) > 4 * protocol.MAX_LINE:
                self._drop_client(client)  # a client that never reads
                return
        except OSError:
            self._drop_client(client)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.outbox else 0)
        if events != client.events:
            client.events = events
            self.selector.modify(client.sock, events, ("client", client))

    def _drop_client(self, client: Client) -> None:
        if client.closed:
            return
        client.closed = True
        fd = client.sock.fileno()
        if fd >= 0 and fd in self.clients:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(client.sock)
            del self.clients[fd]
        for delivery_id in client.waiting:
            waiting = self.waiters.get(delivery_id, [])
            if client in waiting:
                waiting.remove(client)
        client.sock.close()

    # -- requests ---------------------------------------------------------------------

    def _handle_requests(self, incoming: list[tuple[Client, dict[str, Any]]]) -> None:
        deliveries: list[tuple[Client, dict[str, Any], tuple[str, str, bytes, bool]]] = []
        for client, request in incoming:
            op = request.get("op")
            try:
                if op == "deliver":
                    deliveries.append((client, request, self._validate_delivery(request)))
                elif op == "status":
                    self._reply(client, {"ok": True, "status": self.status()})
                elif op == "queue":
                    self._reply(client, {"ok": True, "rows": self._queue_rows(request)})
                elif op in ("retry", "drop"):
                    self._reply(client, {"ok": True, "changed": self._retry_drop(op, request)})
                elif op == "ping":
                    self._reply(client, {"ok": True})
                else:
                    raise VoluteError(f"unknown request {op!r}", exit_code=EX_USAGE)
            except VoluteError as error:
                self._reply(client, protocol.error_reply(error))
            except (TypeError, ValueError, KeyError, sqlite3.Error) as error:
                # A malformed request must never take the gate down.
                self._reply(client, protocol.error_reply(DataError(f"bad {op} request: {error}")))
        if not deliveries:
            return
        assert self.store is not None
        # One durable commit for everything that arrived together, then the acks.
        ids = self.store.add_deliveries([item for _, _, item in deliveries])
        for (client, request, item), delivery_id in zip(deliveries, ids, strict=True):
            if request.get("wait"):
                client.waiting.add(delivery_id)
                self.waiters.setdefault(delivery_id, []).append(client)
            self._reply(client, {"ok": True, "id": delivery_id})
            self.journal.log(
                "debug",
                f"queued delivery {delivery_id} for {item[0]}/{item[1]}",
                mind=item[0],
                session=item[1],
                delivery_id=delivery_id,
            )
        self.dirty = True

    def _validate_delivery(self, request: dict[str, Any]) -> tuple[str, str, bytes, bool]:
        mind = request.get("mind")
        session = request.get("session", "main")
        message = request.get("message")
        if not isinstance(mind, str) or not isinstance(session, str):
            raise DataError("mind and session must be strings")
        if not isinstance(message, str):
            raise DataError("the message must be text")
        try:
            names.check_mind(mind)
            names.check_session(session)
        except names.NameError_ as error:
            raise VoluteError(str(error), exit_code=EX_DATAERR) from None
        if mind not in self.settings.minds:
            known = ", ".join(sorted(self.settings.minds)) or "none"
            raise VoluteError(
                f"unknown mind {mind!r}",
                hint=f"configured minds: {known} (add a [minds.{mind}] table)",
                exit_code=EX_NOUSER,
            )
        try:
            data = message.encode()
        except UnicodeEncodeError:
            raise DataError(f"the message for {mind} is not valid UTF-8 text") from None
        limit = self.settings.gate.max_message_bytes
        if len(data) > limit:
            raise VoluteError(
                f"message for {mind} is {len(data)} bytes, over the limit of {limit}",
                hint="raise gate.max_message_bytes, or send a path instead of the content",
                exit_code=EX_DATAERR,
            )
        return mind, session, data, bool(request.get("interrupt"))

    def _queue_rows(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        assert self.store is not None
        states = request.get("states") or ["pending", "running", "dead"]
        known = ("pending", "running", "done", "dead", "dropped")
        if not isinstance(states, list) or any(state not in known for state in states):
            raise DataError(f"states must be a list of {', '.join(known)}")
        return [
            {
                "id": row.id,
                "mind": row.mind,
                "session": row.session,
                "state": row.state,
                "attempts": row.attempts,
                "hold_reason": row.hold_reason,
                "held_ms": row.held_ms,
                "turn_id": row.turn_id,
                "created_at": row.created_at,
                "last_error": row.last_error,
                "bytes": len(row.message),
            }
            for row in self.store.list_rows(list(states))
        ]

    def _retry_drop(self, op: str, request: dict[str, Any]) -> list[int]:
        assert self.store is not None
        raw = request.get("ids")
        if not isinstance(raw, list) or not all(isinstance(i, int) for i in raw):
            raise DataError("ids must be a list of delivery ids (integers)")
        ids = [int(i) for i in raw]
        changed = self.store.retry(ids) if op == "retry" else self.store.drop(ids, time.time())
        for delivery_id in changed:
            self.journal.log("info", f"{op} delivery {delivery_id}", delivery_id=delivery_id)
        if op == "drop":
            for delivery_id in changed:
                self._notify_waiters(delivery_id, {"event": "dropped", "id": delivery_id})
        self.dirty = True
        return changed

    # -- admission and launching ----------------------------------------------------------

    def live_units(self) -> set[str]:
        assert self.manager is not None
        return {u.name for u in self.manager.list_units(self.settings.turns.slice, [TURN_PATTERN])}

    def admit(self) -> None:
        assert self.store is not None
        live_names = self.live_units()
        ours = {turn.unit for turn in self.turns.values()}
        self.foreign_live = len(live_names - ours)
        live = [
            core.LiveTurn(turn.id, turn.mind, turn.session)
            for turn in self.turns.values()
            if turn.unit in live_names
        ]
        rows = {row.id: row for row in self.store.pending()}
        now = time.time()
        decision = core.admit(
            [row.as_delivery() for row in rows.values()],
            live,
            self.limits,
            now=now,
            other_busy=self.foreign_live,
        )
        for fold in decision.folds:
            self._fold(fold, now)
        for start in decision.starts:
            self._start(start, rows, now)
        self._record_holds(decision.holds, rows, now)

    def _record_holds(self, holds: list[core.Hold], rows: dict[int, Row], now: float) -> None:
        assert self.store is not None
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
                self.journal.log(
                    "info",
                    f"holding delivery {row.id} for {row.mind}/{row.session}: {hold.reason}",
                    mind=row.mind,
                    session=row.session,
                    delivery_id=row.id,
                    reason=hold.reason,
                    event="hold",
                )

    def _log_released(self, rows: list[Row], now: float, how: str) -> None:
        for row in rows:
            if row.held_since is not None:
                held_ms = int((now - row.held_since) * 1000)
                self.journal.log(
                    "info",
                    f"delivery {row.id} for {row.mind}/{row.session} was held {held_ms} ms "
                    f"({row.hold_reason}); {how}",
                    mind=row.mind,
                    session=row.session,
                    delivery_id=row.id,
                    reason=row.hold_reason,
                    held_ms=held_ms,
                    event="hold_end",
                )

    def _fold(self, fold: core.Fold, now: float) -> None:
        assert self.store is not None and self.manager is not None
        turn = self.turns[fold.turn_id]
        rows = self.store.fold_into(turn.id, list(fold.delivery_ids), now)
        account = turn.account or self._account_of(turn.mind)
        for row in rows:
            record = launcher.delivery_record(row.id, row.session, row.message, row.interrupt)
            launcher.offer(turn.turn_dir, row.id, record, account)
        self._log_released(rows, now, f"folded into turn {turn.id}")
        if rows:
            self.journal.log(
                "info",
                f"folded deliveries {' '.join(str(r.id) for r in rows)} into turn {turn.id} "
                f"of {turn.mind}/{turn.session}",
                mind=turn.mind,
                session=turn.session,
                turn_id=turn.id,
                delivery_ids=" ".join(str(r.id) for r in rows),
            )
        if fold.interrupt:
            turn.interrupted = True
            with contextlib.suppress(VoluteError):
                self.manager.kill_unit(turn.unit, signal.SIGINT)
            self.journal.log(
                "info",
                f"interrupted turn {turn.id} of {turn.mind}/{turn.session}",
                mind=turn.mind,
                session=turn.session,
                unit=turn.unit,
            )

    def _account_of(self, mind: str) -> launcher.Account:
        """The mind's user, looked up once: NSS lookups would sit on every handoff."""
        account = self.accounts.get(mind)
        if account is None:
            configured = self.settings.minds[mind].user
            account = launcher.resolve_account(configured or self.settings.turns.default_user)
            self.accounts[mind] = account
        return account

    def _start(self, start: core.Start, rows: dict[int, Row], now: float) -> None:
        assert self.store is not None and self.manager is not None
        mind_settings = self.settings.minds.get(start.mind)
        turn_id, taken = self.store.start_turn(
            start.mind,
            start.session,
            lambda tid: names.turn_scope_name(start.mind, tid),
            list(start.delivery_ids),
            now,
        )
        unit = names.turn_scope_name(start.mind, turn_id)
        ids = [row.id for row in taken]
        self._log_released(taken, now, f"starting turn {turn_id}")
        child: launcher.Child | None = None
        try:
            if mind_settings is None:
                raise DataError(f"mind {start.mind!r} is no longer configured")
            account = self._account_of(start.mind)
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
            props = ScopeProperties(
                **{
                    **self.scope_props.__dict__,
                    "description": f"volute turn {turn_id} of {start.mind}/{start.session}",
                }
            )
            self.manager.start_scope(unit, [child.pid], props)
            child.release()
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
            self._fail(taken, error.message)
            self._remove_dir(turn_id)
            self.dirty = True
            return
        self.store.mark_released(turn_id)
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
        self.selector.register(child.pidfd, selectors.EVENT_READ, ("pidfd", turn))
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

    def _fail(self, rows: list[Row], error: str) -> None:
        assert self.store is not None
        self.store.fail_rows(self._failure_updates(rows, error), error, time.time())

    def _failure_updates(
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
                self.journal.log(
                    "warning",
                    f"delivery {row.id} for {row.mind}/{row.session} is dead after "
                    f"{after.attempts} attempts: {error}",
                    mind=row.mind,
                    session=row.session,
                    delivery_id=row.id,
                )
                self._notify_waiters(
                    row.id, {"event": "dead", "id": row.id, "error": error, "exit_code": 1}
                )
        return updates

    # -- turns ending --------------------------------------------------------------------

    def _reap(self, turn: Turn) -> None:
        if turn.child is None:
            return
        with contextlib.suppress(ChildProcessError):
            pid, status = os.waitpid(turn.child.pid, os.WNOHANG)
            if pid == turn.child.pid:
                turn.exit_status = os.waitstatus_to_exitcode(status)
                if turn.exit_status < 0:  # killed by a signal
                    turn.exit_status = 128 - turn.exit_status
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(turn.child.pidfd)
        with contextlib.suppress(OSError):
            os.close(turn.child.pidfd)
        turn.child.pidfd = -1
        turn.child = None

    def _unit_ended(self, unit: str) -> None:
        parsed = names.parse_turn_scope_name(unit)
        if parsed is None:
            return
        turn = self.turns.get(parsed[1])
        if turn is None or turn.unit != unit:
            self.dirty = True  # a foreign scope ended: the budget may have freed
            return
        # systemd also announces a scope's initial "inactive" while it is being
        # created; only the unit's state right now says whether it really ended.
        assert self.manager is not None
        with contextlib.suppress(VoluteError):
            if self.manager.unit_property(unit, "ActiveState") in LIVE_STATES:
                return
        self._reap(turn)
        self._finish(turn)

    def _finish(self, turn: Turn) -> None:
        """The turn's scope is empty: settle its deliveries and free its place."""
        assert self.store is not None
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
        failed = self._failure_updates(carried, error) if outcome.kind == "failed" else []
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
        )
        self.turns.pop(turn.id, None)
        turn.turn_dir.remove()
        level = "warning" if outcome.kind == "failed" else "info"
        self.journal.log(
            level,
            f"turn {turn.id} of {turn.mind}/{turn.session} ended: {outcome.detail}",
            mind=turn.mind,
            session=turn.session,
            unit=turn.unit,
            turn_id=turn.id,
            outcome=outcome.kind,
            exit_status=outcome.exit_status,
        )
        if outcome.kind != "never_ran":
            code = core.wait_exit_code(outcome.exit_status)
            for row in carried:
                self._notify_waiters(
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
        self.dirty = True

    def _notify_waiters(self, delivery_id: int, message: dict[str, Any]) -> None:
        for client in self.waiters.pop(delivery_id, []):
            client.waiting.discard(delivery_id)
            self._reply(client, {"ok": True, **message})

    # -- recovery ----------------------------------------------------------------------

    def recover(self) -> None:
        """Match live turn scopes to the store's open turns; settle the ones that ended."""
        assert self.store is not None
        live_names = self.live_units()
        for row in self.store.open_turns():
            turn_dir = launcher.TurnDir(self.settings.gate.runtime_dir / "turns" / str(row.id))
            account = None
            with contextlib.suppress(VoluteError, KeyError):
                account = self._account_of(row.mind)
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
                self.journal.log(
                    "info",
                    f"adopted running turn {row.id} of {row.mind}/{row.session}",
                    mind=row.mind,
                    session=row.session,
                    unit=row.unit,
                    turn_id=row.id,
                )
            else:
                self._finish(turn)
        self.dirty = True

    # -- status ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        assert self.store is not None
        live_names = self.live_units()
        now = time.time()
        turns: list[dict[str, Any]] = [
            {
                "turn_id": turn.id,
                "mind": turn.mind,
                "session": turn.session,
                "unit": turn.unit,
                "running_s": round(now - turn.started_at, 3),
            }
            for turn in sorted(self.turns.values(), key=lambda t: t.id)
            if turn.unit in live_names
        ]
        pending = self.store.pending()
        minds: dict[str, dict[str, Any]] = {
            name: {"running_sessions": [], "pending": 0} for name in self.settings.minds
        }
        for turn in turns:
            minds.setdefault(turn["mind"], {"running_sessions": [], "pending": 0})
            minds[turn["mind"]]["running_sessions"].append(turn["session"])
        holds: dict[str, int] = {}
        for row in pending:
            minds.setdefault(row.mind, {"running_sessions": [], "pending": 0})
            minds[row.mind]["pending"] += 1
            if row.hold_reason:
                holds[row.hold_reason] = holds.get(row.hold_reason, 0) + 1
        counts = self.store.counts()
        oldest = self.store.oldest_hold()
        return {
            "active_turns": len(live_names),
            "global_cap": self.limits.global_cap,
            "turns_per_mind": self.limits.turns_per_mind,
            "turns": turns,
            "foreign_scopes": len(live_names) - len(turns),
            "minds": minds,
            "queue_depth": len(pending),
            "holds": holds,
            "oldest_held_s": round(now - oldest, 3) if oldest is not None else None,
            "dead": counts.get("dead", 0),
            "slice": self.settings.turns.slice,
        }


# -- the CLI edge ---------------------------------------------------------------------------


@click.command("gate")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Config file.")
def gate_command(config_path: str | None) -> None:
    """Run the turn gate in the foreground (the daemon behind volute-gate.service)."""
    settings = load_settings(config_path).settings
    stop_read, stop_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def on_signal(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            os.write(stop_write, b"x")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    gate = Gate(settings)

    def ready() -> None:
        sd_notify("READY=1\nSTATUS=accepting deliveries")

    gate.run(stop_read, ready=ready)
    sd_notify("STOPPING=1")


def dump_status(status: dict[str, Any]) -> str:
    return json.dumps(status, indent=2, sort_keys=True)
