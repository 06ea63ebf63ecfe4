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
import struct
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from volutectl import activation, core, launcher, options, protocol, validate
from volutectl.config import Settings, load_settings
from volutectl.errors import (
    EX_SOFTWARE,
    DataError,
    TemporaryError,
    UnavailableError,
    VoluteError,
)
from volutectl.faults import crash_point
from volutectl.journal import Journal, sd_notify, watchdog_interval
from volutectl.pressure import PressureWatch, slice_cgroup
from volutectl.slotwatch import SlotWatch
from volutectl.store import Store
from volutectl.systemd import Manager
from volutectl.testscopes import list_in_flight
from volutectl.turns import Turn, Turns

ADMIT_RETRY_SECONDS = 1.0
# Replies queued for a client that does not read them: beyond this it is dropped. The
# largest reply (a queue listing of 200 rows, without messages) is some 50 KiB.
MAX_OUTBOX = 1 << 20
# After accept() failed for want of descriptors or memory, the listener rests until a
# client leaves or this long has passed (the descriptors may be held by turns instead).
ACCEPT_RETRY_SECONDS = 1.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass
class Client:
    sock: socket.socket
    fd: int  # the key in Gate.clients and Gate.idle; sock.fileno() is -1 once closed
    buffer: bytearray = field(default_factory=bytearray)  # a request line still partial
    outbox: bytearray = field(default_factory=bytearray)
    events: int = selectors.EVENT_READ
    closed: bool = False
    waiting: set[int] = field(default_factory=set)  # delivery ids for --wait
    # Monotonic time of the last complete line, of the accept, or of a wait's end: the
    # client is dropped gate.client_idle_seconds later, unless it is waiting.
    idle_since: float = 0.0


class Gate:
    def __init__(
        self,
        settings: Settings,
        *,
        manager: Manager | None = None,
        journal: Journal | None = None,
        listener: socket.socket | None = None,
    ) -> None:
        self.settings = settings
        self.journal = journal or Journal("volute-gate")
        self.manager = manager
        self.store: Store | None = None
        self.listener: socket.socket | None = None
        # A listening socket from systemd (volute-gate.socket), served instead of binding.
        self.inherited_listener = listener
        self.bound_socket: Path | None = None  # a socket file we bound, to unlink on close
        self.selector = selectors.DefaultSelector()
        self.turns: Turns | None = None
        self.slots: SlotWatch | None = None
        self.pressure: PressureWatch | None = None
        self.clients: dict[int, Client] = {}
        # The clients that can go idle (not waiting), oldest idle_since first: insertion
        # order is that order, so the next idle deadline is the first entry's, in O(1).
        self.idle: dict[int, Client] = {}
        self.waiters: dict[int, list[Client]] = {}
        self.accepting = True  # the listener is in the selector (see _pause_accepting)
        self.accept_retry: float | None = None  # monotonic, after accept() lacked fds
        self.accept_problem: str | None = None  # why accepting paused, as last logged
        self.dirty = True
        self.stopping = False
        self.watchdog: float | None = None
        self.next_ping: float | None = None
        self.backoff_wake: float | None = None
        self.admit_retry: float | None = None  # monotonic: admission failed, try again then
        self.admit_failing = False
        self.foreign_live = 0
        self.limits = core.Limits(
            global_cap=settings.limits.global_concurrent_turns,
            turns_per_mind=settings.limits.turns_per_mind,
            per_mind={
                name: mind.turns_per_mind
                for name, mind in settings.minds.items()
                if mind.turns_per_mind is not None
            },
        )

    # -- lifecycle ----------------------------------------------------------------

    def open(self) -> None:
        gate = self.settings.gate
        self.store = Store(gate.state_dir / "queue.sqlite3")
        if self.manager is None:
            self.manager = Manager.connect(user=gate.manager == "user")
        # Subscribe before listing, so no turn can end unseen between the two.
        self.manager.watch_units()
        self.turns = Turns(
            self.settings,
            self.store,
            self.manager,
            self.journal,
            notify=self._notify_waiters,
            watch_fd=self._watch_pidfd,
            unwatch_fd=self._unwatch,
        )
        self.turns.recover()
        self.store.sync()
        self.slots = SlotWatch(
            self.settings.tests.repositories, gate.state_dir / "repositories.json", self._log
        )
        self.listener = self._listen(gate.socket, gate.socket_group)
        self.selector.register(self.listener, selectors.EVENT_READ, ("accept", None))
        self.selector.register(self.manager.fileno(), selectors.EVENT_READ, ("bus", None))
        self.selector.register(self.slots.fileno(), selectors.EVENT_READ, ("slots", None))
        self._open_pressure()

    def close(self) -> None:
        for client in list(self.clients.values()):
            self._drop_client(client)
        if self.listener is not None:
            # A socket from systemd stays: its backlog holds the connections that arrive
            # until the next gate starts. Only a socket the gate bound itself goes.
            if self.bound_socket is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.bound_socket)
            self.listener.close()
        for turn in self.turns.turns.values() if self.turns else []:
            if turn.child is not None:
                with contextlib.suppress(OSError):
                    os.close(turn.child.pidfd)
        if self.slots is not None:
            self.slots.close()
        if self.pressure is not None:
            self.pressure.close()
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
        """Monotonic deadlines of the loop's timers (watchdog, pressure re-check, turn time
        limits and questions to systemd to ask again, a failed admission's retry, the
        oldest idle client, a rested listener)."""
        deadlines = [self.next_ping] if self.next_ping is not None else []
        if self.pressure is not None and self.pressure.deadline() is not None:
            deadlines.append(self.pressure.deadline() or 0.0)
        if self.admit_retry is not None:
            deadlines.append(self.admit_retry)
        turn_deadline = self.turns.next_deadline() if self.turns is not None else None
        if turn_deadline is not None:
            deadlines.append(time.monotonic() + turn_deadline - time.time())
        oldest = next(iter(self.idle.values()), None)
        if oldest is not None:
            deadlines.append(oldest.idle_since + self.settings.gate.client_idle_seconds)
        if self.accept_retry is not None:
            deadlines.append(self.accept_retry)
        return deadlines

    def _on_deadlines(self) -> None:
        mono = time.monotonic()
        if self.next_ping is not None and self.watchdog and mono >= self.next_ping:
            sd_notify("WATCHDOG=1")
            self.next_ping = mono + self.watchdog
        if self.pressure is not None and self.pressure.on_deadline(mono):
            self.dirty = True  # pressure fell below the resume threshold
        if self.backoff_wake is not None and time.time() >= self.backoff_wake:
            self.backoff_wake = None
            self.dirty = True
        if self.admit_retry is not None and mono >= self.admit_retry:
            self.admit_retry = None
            self.dirty = True
        if self.turns is not None:
            due = self.turns.next_deadline()
            if due is not None and time.time() >= due:
                self._guarded("a turn's deadline", self.turns.on_deadline, time.time())
        self._drop_idle_clients(mono)
        if self.accept_retry is not None and mono >= self.accept_retry:
            self._resume_accepting()

    def step(self, timeout: float | None) -> None:
        """One pass of the loop: wait, take in what arrived, then admit."""
        assert self.manager is not None
        incoming: list[tuple[Client, dict[str, Any]]] = []
        for key, mask in self.selector.select(timeout):
            kind, data = key.data
            if kind == "accept":
                self._accept()
            elif kind == "client":
                incoming += self._client_event(data, mask)
            elif kind == "pidfd":
                assert self.turns is not None
                self._guarded(f"the end of turn {data.id}", self.turns.reap, data)
            elif kind == "slots":
                assert self.slots is not None
                if self.slots.on_ready():
                    self.dirty = True  # a test run started or ended: the budget moved
            elif kind == "pressure":
                assert self.pressure is not None
                if self.pressure.on_ready(time.monotonic()):
                    self.dirty = True
            elif kind == "stop":
                self.stopping = True
        if incoming:
            self._handle_requests(incoming)
        assert self.turns is not None
        for event in self.manager.process_events():
            self._guarded(f"systemd's news of {event.name}", self.turns.unit_ended, event.name)
        if self.turns.changed:
            self.turns.changed = False
            self.dirty = True
        self._on_deadlines()
        if self.dirty and not self.stopping:
            self.dirty = False
            self.admit()
        assert self.store is not None
        # A turn's settlement is durable before the gate sleeps; if the disk refuses,
        # the next pass tries again (what was not synced is still in the WAL).
        self._guarded("syncing the queue", self.store.sync)

    # -- the socket -------------------------------------------------------------------

    def _listen(self, path: Path, group: str) -> socket.socket:
        """The listening socket: systemd's when socket-activated, else one bound at `path`.

        When volute-gate.socket listens somewhere other than gate.socket, the inherited
        socket wins: it is where systemd queues connections while the gate restarts, and
        a gate that bound a second socket would leave those unserved. The mismatch is
        logged with both paths, and `volutectl doctor` reports it.
        """
        if self.inherited_listener is not None:
            served = activation.served_path(self.inherited_listener)
            if served != str(path):
                self.journal.log(
                    "warning",
                    f"serving {served}, the socket systemd passed (volute-gate.socket), not "
                    f"gate.socket = {path}: clients that read the config connect to {path}",
                    socket=served,
                    configured_socket=path,
                )
            self.inherited_listener.setblocking(False)
            return self.inherited_listener
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
        self.bound_socket = path
        return listener

    def _accept(self) -> None:
        assert self.listener is not None
        while len(self.clients) < self.settings.gate.max_clients:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                self.accept_problem = None  # nobody is left waiting: a new episode may log
                return
            except ConnectionAbortedError:
                continue
            except OSError as error:
                # EMFILE, ENFILE, ENOBUFS, ENOMEM: accepting again at once would spin.
                self._pause_accepting(
                    f"cannot accept connections: {error.strerror or error}", retry=True
                )
                return
            try:
                self._add_client(sock)
            except Exception as error:  # noqa: BLE001 - one connection, not the gate
                sock.close()
                self._log_failure("taking a new connection", error)
                self._pause_accepting(f"cannot take connections: {error}", retry=True)
                return
        self._pause_accepting(
            f"{self.settings.gate.max_clients} connections are open (gate.max_clients); "
            "new ones wait until one closes"
        )

    def _add_client(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        client = Client(sock, sock.fileno())
        self.selector.register(sock, selectors.EVENT_READ, ("client", client))
        self.clients[client.fd] = client
        self._mark_active(client)

    def _pause_accepting(self, reason: str, *, retry: bool = False) -> None:
        """Take the listener out of the selector: connections wait in its backlog, and
        the loop does not wake for them. A client leaving (or, after a lack of
        descriptors, ACCEPT_RETRY_SECONDS) puts it back."""
        if self.accepting and self.listener is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.listener)
            self.accepting = False
        if retry:
            self.accept_retry = time.monotonic() + ACCEPT_RETRY_SECONDS
        if reason != self.accept_problem:  # once per episode, not once per retry
            self.accept_problem = reason
            self.journal.log(
                "warning", f"not accepting for now: {reason}", clients=len(self.clients)
            )

    def _resume_accepting(self) -> None:
        self.accept_retry = None
        if self.accepting or self.listener is None or self.stopping:
            return
        if len(self.clients) >= self.settings.gate.max_clients:
            return
        self.selector.register(self.listener, selectors.EVENT_READ, ("accept", None))
        self.accepting = True

    def _mark_active(self, client: Client) -> None:
        """Restart the client's idle clock; a client that waits on a turn has none."""
        self.idle.pop(client.fd, None)
        if not client.closed and not client.waiting:
            client.idle_since = time.monotonic()
            self.idle[client.fd] = client

    def _drop_idle_clients(self, now: float) -> None:
        limit = self.settings.gate.client_idle_seconds
        while self.idle:
            client = next(iter(self.idle.values()))
            if now < client.idle_since + limit:
                return
            self._reply(
                client,
                protocol.error_reply(
                    TemporaryError(f"no complete request in {limit:g} s: closing the connection")
                ),
            )
            self._drop_client(client)  # which takes it out of self.idle

    def _peer_uid(self, client: Client) -> int:
        """The uid of the process that connected (SO_PEERCRED: fixed at connect())."""
        raw = client.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        _pid, uid, _gid = _PEERCRED.unpack(raw)
        return int(uid)

    def _client_event(self, client: Client, mask: int) -> list[tuple[Client, dict[str, Any]]]:
        """Serve one client's readiness; whatever fails ends that client, not the loop."""
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(client)
            if mask & selectors.EVENT_READ and not client.closed:
                return self._read_client(client)
        except Exception as error:  # noqa: BLE001 - see _client_failed
            self._client_failed(client, "reading a request", error)
        return []

    def _client_failed(self, client: Client, what: str, error: Exception) -> None:
        """A bug met while serving one client: log it once, tell the client (70) if it
        still listens, and close it. The gate carries on with everyone else."""
        self._log_failure(what, error)
        with contextlib.suppress(Exception):
            self._reply(
                client,
                protocol.error_reply(
                    VoluteError(
                        f"internal error in the gate while {what}",
                        hint="see: journalctl -u volute-gate",
                        exit_code=EX_SOFTWARE,
                    )
                ),
            )
        self._drop_client(client)

    def _log_failure(self, what: str, error: BaseException) -> None:
        frames = traceback.extract_tb(error.__traceback__)
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else None
        self.journal.log(
            "error",
            f"internal error while {what}: {type(error).__name__}: {error}",
            exception=type(error).__name__,
            where=where,
        )

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
        if b"\n" not in chunk:
            client.buffer += chunk  # a bytearray: a line that trickles in is not recopied
            if len(client.buffer) > protocol.MAX_LINE:
                self._refuse_oversized(client)
            return []
        lines = chunk.split(b"\n")  # once: a chunk of a million lines is not quadratic
        lines[0] = bytes(client.buffer) + lines[0]
        client.buffer = bytearray(lines.pop())
        self._mark_active(client)  # a complete line: the idle clock starts again
        requests = []
        for line in lines:
            if len(line) > protocol.MAX_LINE:
                self._refuse_oversized(client)
            elif not client.closed:
                try:
                    requests.append((client, protocol.decode(line)))
                except VoluteError as error:
                    self._reply(client, protocol.error_reply(error))
            if client.closed:
                return []
        if len(client.buffer) > protocol.MAX_LINE:
            self._refuse_oversized(client)
        return requests

    def _refuse_oversized(self, client: Client) -> None:
        limit = self.settings.gate.max_message_bytes
        self._reply(
            client,
            protocol.error_reply(
                DataError(f"request too large: the message limit is {limit} bytes")
            ),
        )
        self._drop_client(client)

    def _reply(self, client: Client, message: dict[str, Any]) -> None:
        """Queue a reply and send what the socket takes now; never block the loop."""
        if client.closed:
            return
        client.outbox += protocol.encode(message)
        if client.waiting:
            self.idle.pop(client.fd, None)  # it waits on a turn: not idle
        elif client.fd not in self.idle:
            self._mark_active(client)  # its wait just ended
        self._flush(client)

    def _flush(self, client: Client) -> None:
        try:
            while client.outbox:
                sent = client.sock.send(client.outbox)
                del client.outbox[:sent]
        except BlockingIOError:
            if len(client.outbox) > MAX_OUTBOX:
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
        self.idle.pop(client.fd, None)
        if self.clients.get(client.fd) is client:
            del self.clients[client.fd]
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(client.fd)
        for delivery_id in client.waiting:
            waiting = self.waiters.get(delivery_id, [])
            if client in waiting:
                waiting.remove(client)
        with contextlib.suppress(OSError):
            client.sock.close()
        self._resume_accepting()  # one place free, or one descriptor

    # -- requests ---------------------------------------------------------------------

    def _handle_requests(self, incoming: list[tuple[Client, dict[str, Any]]]) -> None:
        deliveries: list[
            tuple[Client, dict[str, Any], tuple[str, str, bytes, bool], str | None]
        ] = []
        for client, request in incoming:
            if client.closed:
                continue  # dropped since: e.g. it stopped reading its earlier replies
            op = "unnamed"
            try:
                op = validate.op(request)
                if op == "deliver":
                    item = validate.delivery(self.settings, request)
                    deliveries.append((client, request, item, validate.request_id(request)))
                elif op == "status":
                    self._reply(client, {"ok": True, "status": self.status()})
                elif op == "queue":
                    self._reply(client, {"ok": True, "rows": self._queue_rows(request)})
                elif op in ("retry", "drop"):
                    self._reply(client, {"ok": True, "changed": self._retry_drop(op, request)})
                elif op == "register_repo":
                    self._reply(client, {"ok": True, "new": self._register_repo(client, request)})
                elif op == "ping":
                    self._reply(client, {"ok": True})
            except VoluteError as error:
                self._reply(client, protocol.error_reply(error))
            except sqlite3.OperationalError as error:
                # The disk is full, or the database locked or unwritable: try again later.
                self.journal.log("warning", f"the queue failed a {op} request: {error}")
                self._reply(
                    client, protocol.error_reply(TemporaryError(f"{op}: the queue failed: {error}"))
                )
            except Exception as error:  # noqa: BLE001 - see _client_failed
                self._client_failed(client, f"handling a {op} request", error)
        deliveries = [item for item in deliveries if not item[0].closed]
        if not deliveries:
            return
        assert self.store is not None
        # One durable commit for everything that arrived together, then the acks. A request
        # id the store already holds is a client retrying after a gate died before its ack:
        # it gets the original delivery id back, and nothing is queued twice.
        try:
            results = self.store.add_deliveries(
                [item for _, _, item, _ in deliveries],
                request_ids=[request_id for _, _, _, request_id in deliveries],
            )
        except Exception as error:  # noqa: BLE001 - nothing was stored: refuse them all
            self._refuse_deliveries([client for client, _, _, _ in deliveries], error)
            return
        crash_point("request_committed")
        for (client, request, item, request_id), result in zip(deliveries, results, strict=True):
            if isinstance(result, VoluteError):
                self._reply(client, protocol.error_reply(result))
                continue
            delivery_id = result
            if request.get("wait") is True:  # a boolean: validate.delivery checked it
                client.waiting.add(delivery_id)
                self.waiters.setdefault(delivery_id, []).append(client)
            self._reply(client, {"ok": True, "id": delivery_id})
            if request.get("wait") is True and request_id is not None:
                # A retried request's delivery may have run already: tell the waiter now.
                finished = self._finished_event(delivery_id)
                if finished is not None:
                    self._notify_waiters(delivery_id, finished)
            self.journal.log(
                "debug",
                f"queued delivery {delivery_id} for {item[0]}/{item[1]}",
                mind=item[0],
                session=item[1],
                delivery_id=delivery_id,
            )
        self.dirty = True

    def _finished_event(self, delivery_id: int) -> dict[str, Any] | None:
        """The event a --wait client would have had, for a delivery that already ended."""
        assert self.store is not None
        row = self.store.row(delivery_id)
        if row is None or row.state in ("pending", "running"):
            return None
        if row.state == "dead":
            return {"event": "dead", "id": row.id, "error": row.last_error, "exit_code": 1}
        if row.state == "dropped":
            return {"event": "dropped", "id": row.id}
        turn = self.store.turn(row.turn_id) if row.turn_id is not None else None
        exit_status = turn.exit_status if turn is not None else None
        return {
            "event": "turn_ended",
            "id": row.id,
            "turn_id": row.turn_id,
            "outcome": turn.outcome if turn is not None else "ok",
            "exit_status": exit_status,
            "exit_code": core.wait_exit_code(exit_status),
        }

    def _refuse_deliveries(self, clients: list[Client], error: Exception) -> None:
        """The commit failed, so no delivery of the batch is stored: none is acknowledged.
        A full disk or any SQLite error is temporary (75); anything else is our bug (70)."""
        if not isinstance(error, sqlite3.Error | OSError):
            for client in clients:
                self._client_failed(client, "storing deliveries", error)
            return
        state_dir = self.settings.gate.state_dir
        self.journal.log(
            "error",
            f"could not store {len(clients)} deliveries, refused them (nothing acknowledged): "
            f"{type(error).__name__}: {error}",
            exception=type(error).__name__,
            state_dir=state_dir,
        )
        refusal = protocol.error_reply(
            TemporaryError(
                f"the queue could not store the delivery: {error}",
                hint=f"nothing was queued; free space in {state_dir} and deliver again",
            )
        )
        for client in clients:
            self._reply(client, refusal)

    def _open_pressure(self) -> None:
        settings = self.settings.limits.io_pressure
        if not settings.enabled:
            return
        assert self.manager is not None
        # The slice's cgroup (and its io.pressure) exists only while the slice is active.
        with contextlib.suppress(VoluteError):
            self.manager.start_unit(self.settings.turns.slice)
        self.pressure = PressureWatch.open(
            settings, slice_cgroup=slice_cgroup(self.settings.turns.slice), journal_log=self._log
        )
        if self.pressure is not None:
            self.selector.register(self.pressure.fileno(), selectors.EVENT_READ, ("pressure", None))

    def _register_repo(self, client: Client, request: dict[str, Any]) -> bool:
        assert self.slots is not None
        path = validate.repository_path(request)
        common = validate.git_common_dir(path, self._peer_uid(client))
        new = self.slots.register(common)
        if new:
            self.journal.log("info", f"watching test slots of {common}", repository=common)
            self.dirty = True
        return new

    def _log(self, level: str, message: str) -> None:
        self.journal.log(level, message)

    def _queue_rows(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        assert self.store is not None
        states = validate.queue_states(request)
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
            for row in self.store.list_rows(states)
        ]

    def _retry_drop(self, op: str, request: dict[str, Any]) -> list[int]:
        assert self.store is not None
        ids = validate.delivery_ids(request)
        changed = self.store.retry(ids) if op == "retry" else self.store.drop(ids, time.time())
        for delivery_id in changed:
            self.journal.log("info", f"{op} delivery {delivery_id}", delivery_id=delivery_id)
        if op == "drop":
            for delivery_id in changed:
                self._notify_waiters(delivery_id, {"event": "dropped", "id": delivery_id})
        self.dirty = True
        return changed

    # -- admission and launching ----------------------------------------------------------

    def _guarded(self, what: str, handler: Callable[..., None], *args: Any) -> None:
        """Run one event's handler; a failure there must not take the loop down.

        Its state stays as it was: a turn keeps its place, a row its state. systemd or
        the disk failing is logged; anything else is a bug, logged with its type."""
        try:
            handler(*args)
        except (VoluteError, sqlite3.Error, OSError) as error:
            text = error.message if isinstance(error, VoluteError) else str(error)
            self.journal.log("error", f"handling {what} failed: {text}")
            self.dirty = True
        except Exception as error:  # noqa: BLE001 - the loop must outlive a bug
            self.journal.log("error", f"handling {what} failed: {type(error).__name__}: {error}")
            self.dirty = True

    def admit(self) -> None:
        """Run admission; if systemd or the store fails, say so once and retry in a second.

        Nothing is started on a guess: without systemd's listing, no turn starts."""
        try:
            self._admit()
        except (VoluteError, sqlite3.Error, OSError) as error:
            text = error.message if isinstance(error, VoluteError) else str(error)
            if not self.admit_failing:
                self.journal.log(
                    "error",
                    f"admission failed, no turn starts until it works: {text}; retrying "
                    f"every {ADMIT_RETRY_SECONDS:.0f} s",
                )
            self.admit_failing = True
            self.admit_retry = time.monotonic() + ADMIT_RETRY_SECONDS
            return
        if self.admit_failing:
            self.journal.log("info", "admission works again")
            self.admit_failing = False

    def _admit(self) -> None:
        assert self.store is not None and self.turns is not None
        live, self.foreign_live = self.turns.count_live()
        # With limits.test_runs_count_as_turns, each held test slot takes one unit of the
        # global budget; test runs are never held here, only turns.
        test_runs = 0
        if self.settings.limits.test_runs_count_as_turns and self.slots is not None:
            test_runs = len(self.slots.held())
        rows = {row.id: row for row in self.store.pending()}
        now = time.time()
        decision = core.admit(
            [row.as_delivery() for row in rows.values()],
            live,
            self.limits,
            now=now,
            other_busy=self.foreign_live + test_runs,
            other_busy_reason=core.HOLD_TEST_RUN if test_runs else core.HOLD_GLOBAL_CAP,
            pressure=self.pressure is not None and self.pressure.high,
        )
        if self.pressure is not None:
            # PSI is reactive: start at most one turn per pass, and let it settle.
            decision = self.pressure.pace(decision, time.monotonic())
        for fold in decision.folds:
            self.turns.fold(fold, now)
        for start in decision.starts:
            self.turns.start(start, now)
        self.turns.record_holds(decision.holds, rows, now)
        if self.turns.changed:  # a start failed: its rows are back, maybe startable
            self.turns.changed = False
            self.dirty = True

    def _test_runs(self) -> list[dict[str, object]]:
        """Per repository: slots held of N, and its runs from the tests slice's scopes."""
        assert self.manager is not None and self.slots is not None
        try:
            runs = list_in_flight(self.manager, self.settings.tests.slice)
        except VoluteError:
            runs = []
        return self.slots.status(runs)

    def _watch_pidfd(self, fd: int, turn: Turn) -> None:
        self.selector.register(fd, selectors.EVENT_READ, ("pidfd", turn))

    def _unwatch(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fd)

    def _notify_waiters(self, delivery_id: int, message: dict[str, Any]) -> None:
        for client in self.waiters.pop(delivery_id, []):
            client.waiting.discard(delivery_id)
            self._reply(client, {"ok": True, **message})

    # -- status ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        assert self.store is not None and self.turns is not None
        try:
            live_turns, foreign = self.turns.count_live()
        except VoluteError:
            live_turns, foreign = [], self.foreign_live  # systemd did not answer: what we know
        live_ids = {turn.turn_id for turn in live_turns}
        now = time.time()
        turns: list[dict[str, Any]] = [
            {
                "turn_id": turn.id,
                "mind": turn.mind,
                "session": turn.session,
                "unit": turn.unit,
                "running_s": round(now - turn.started_at, 3),
            }
            for turn in sorted(self.turns.turns.values(), key=lambda t: t.id)
            if turn.id in live_ids
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
            "active_turns": len(turns) + foreign,
            "global_cap": self.limits.global_cap,
            "turns_per_mind": self.limits.turns_per_mind,
            "turns": turns,
            "foreign_scopes": foreign,
            "minds": minds,
            "queue_depth": len(pending),
            "holds": holds,
            "oldest_held_s": round(now - oldest, 3) if oldest is not None else None,
            "dead": counts.get("dead", 0),
            "slice": self.settings.turns.slice,
            "test_runs": self._test_runs(),
            "io_pressure": {
                "enabled": self.pressure is not None,
                "high": self.pressure is not None and self.pressure.high,
                "reason": self.pressure.reason if self.pressure is not None else None,
                "trigger": self.pressure.describe() if self.pressure is not None else None,
            },
            "test_runs_count_as_turns": self.settings.limits.test_runs_count_as_turns,
        }


# -- the CLI edge ---------------------------------------------------------------------------


@click.command("gate")
@options.config_option
def gate_command(config_path: str | None) -> None:
    """Run the turn gate in the foreground (the daemon behind volute-gate.service)."""
    # First of all, before the gate can fork a turn: take the socket systemd may have
    # passed (made close-on-exec, its variables unset). Run by hand, there is none.
    listener = activation.inherited_listener()
    settings = load_settings(config_path).settings
    stop_read, stop_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def on_signal(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            os.write(stop_write, b"x")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    launcher.raise_nofile_limit()  # a descriptor per client; turns get the old limit back
    gate = Gate(settings, listener=listener)

    def ready() -> None:
        sd_notify("READY=1\nSTATUS=accepting deliveries")

    gate.run(stop_read, ready=ready)
    sd_notify("STOPPING=1")


def dump_status(status: dict[str, Any]) -> str:
    return json.dumps(status, indent=2, sort_keys=True)
