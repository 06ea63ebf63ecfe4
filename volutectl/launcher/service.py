"""The root part of the gate (volute-launcher.service), which `volutectl launcher`
(volutectl/cli/launcher.py) runs.

It takes orders (volutectl/wire/orders.py) on a socket that systemd opens for it
(volute-launcher.socket, root:volute-gate 0660), from root or the gate's user alone
(checked again by SO_PEERCRED), and carries each out with `LocalHands`
(volutectl/launcher/hands.py): the turn's directory, the fork, the scope, the release,
the inbox, SIGINT and stop of a turn's scope, and reading how a turn ran. It reads the minds'
commands, users, working directories and environments from its own copy of the
configuration, read again when the file changes; an order brings ids and names only.

One order at a time, in one thread: an order from a connection is carried out whole
before the next is read, and an order whose sender has already hung up is dropped
unread. So once the gate has a reply on a new connection, whatever a lost connection
asked for is done, or will never be (volutectl/gate/liveness.py relies on this after losing
the launcher mid-start).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import selectors
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from volutectl import events
from volutectl.config.reload import SettingsHolder
from volutectl.config.settings import Settings, load_settings
from volutectl.errors import SystemdNoAnswer, VoluteError
from volutectl.launcher import turndir
from volutectl.launcher.hands import LocalHands
from volutectl.systemd.journal import Journal
from volutectl.systemd.port import SystemdManager
from volutectl.wire import orders

MAX_CONNECTIONS = 8


class ReloadingSettings(SettingsHolder):
    """The launcher's holder of its configuration, read again when its file changes (by
    inode, size or mtime), so that a mind added for the gate is known here too without a
    restart. A file that no longer loads keeps the last good settings, with a warning."""

    def __init__(self, path: str | None, emit: events.Emit) -> None:
        self.path = path
        self.emit = emit
        loaded = load_settings(path)
        super().__init__(loaded.settings)
        self.file = loaded.path
        self.seen = self._stamp()

    def _stamp(self) -> tuple[int, int, int] | None:
        if self.file is None:
            return None
        try:
            st = os.stat(self.file)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    @property
    def current(self) -> Settings:
        stamp = self._stamp()
        if stamp != self.seen:
            self.seen = stamp
            try:
                self.swap(load_settings(self.path).settings)
                self.emit(events.ConfigurationReloaded(file=str(self.file)))
            except VoluteError as error:
                self.emit(events.ConfigurationKept(error=str(error)))
        return self._current


def allowed_uids() -> frozenset[int]:
    """Root, and the gate's user if it exists."""
    uids = {0}
    with contextlib.suppress(KeyError):
        uids.add(pwd.getpwnam(orders.GATE_USER).pw_uid)
    return frozenset(uids)


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return int(uid)


@dataclass
class Connection:
    sock: socket.socket
    uid: int
    # A line may come with a MoveIn's pidfds, at most MAX_LEASE_PIDS of them.
    reader: orders.LineReader = field(
        default_factory=lambda: orders.LineReader(max_fds=orders.MAX_LEASE_PIDS)
    )


class Launcher:
    """The order loop. `serve(stop_fd)` returns when `stop_fd` becomes readable."""

    def __init__(
        self,
        hands: LocalHands,
        listener: socket.socket,
        journal: Journal,
        allowed: frozenset[int],
    ) -> None:
        self.hands = hands
        # The pidfds that came with the order being carried out (a MoveIn's), closed
        # once it is answered.
        self.passed: tuple[int, ...] = ()
        self.listener = listener
        self.journal = journal
        self.allowed = allowed
        self.selector = selectors.DefaultSelector()
        self.connections: dict[int, Connection] = {}
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ, None)

    def serve(self, stop_fd: int) -> None:
        self.selector.register(stop_fd, selectors.EVENT_READ, "stop")
        try:
            while True:
                for key, _ in self.selector.select():
                    if key.data == "stop":
                        return
                    if key.data is None:
                        self.accept()
                    else:
                        self.on_readable(key.data)
                self.hands.reap()
        finally:
            for connection in list(self.connections.values()):
                self.drop(connection)
            self.selector.close()

    def accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self.journal.emit(events.OrderAcceptFailed(error=str(error)))
            return
        uid = peer_uid(sock)
        if uid not in self.allowed or len(self.connections) >= MAX_CONNECTIONS:
            why = "not root or the gate's user" if uid not in self.allowed else "too many"
            self.journal.emit(events.OrderConnectionRefused(uid=uid, why=why))
            with contextlib.suppress(OSError):
                sock.setblocking(False)
                sock.send(orders.encode(orders.Refused(f"orders are not taken from uid {uid}")))
            sock.close()
            return
        sock.setblocking(False)
        connection = Connection(sock, uid)
        self.connections[sock.fileno()] = connection
        self.selector.register(sock, selectors.EVENT_READ, connection)

    def drop(self, connection: Connection) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(connection.sock)
        self.connections.pop(connection.sock.fileno(), None)
        connection.sock.close()
        connection.reader.close()

    def on_readable(self, connection: Connection) -> None:
        try:
            connection.reader.receive(connection.sock)
            while (line := connection.reader.line()) is not None:
                if orders.peer_gone(connection.sock):
                    break  # its sender hung up: it is told nothing, so it did nothing
                self.carry_out(connection, line)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, orders.OrderError) as error:
            if isinstance(error, orders.OrderError):
                self.journal.emit(events.BadOrder(uid=connection.uid, error=str(error)))
                with contextlib.suppress(OSError):
                    refusal = orders.Refused(error.message[: orders.MAX_TEXT])
                    connection.sock.send(orders.encode(refusal))
            self.drop(connection)
            return
        if connection.reader.eof:
            self.drop(connection)

    def carry_out(self, connection: Connection, line: bytes) -> None:
        order = orders.decode_order(line)
        payload = None
        if order.PAYLOAD:
            fd = connection.reader.take_fd()
            try:
                payload = orders.read_payload(fd, order.PAYLOAD)
            finally:
                os.close(fd)
        if isinstance(order, orders.MoveIn):
            self.passed = connection.reader.take_fds(order.pids)
        if connection.reader.fds:
            # A descriptor no order claimed: kept, one per line, they would fill the
            # launcher's table until it could open nothing (no turn directory, no fork).
            raise orders.OrderError("a descriptor came with an order that takes none")
        try:
            reply = self.execute(order, payload or b"")
        finally:
            for fd in self.passed:
                os.close(fd)
            self.passed = ()
        self.answer(connection, reply)

    def execute(self, order: orders.Order[Any], payload: bytes) -> orders.OrderReply:
        reply: orders.OrderReply
        try:
            reply = EXECUTE[type(order)](self, order, payload)
        except (VoluteError, OSError) as error:
            text = error.message if isinstance(error, VoluteError) else str(error)
            # Within what the gate decodes: a refusal it could not read would look like
            # a lost launcher, and a start would be tried again for ever, uncounted.
            no_answer = isinstance(error, SystemdNoAnswer)
            reply = orders.Refused(text[: orders.MAX_TEXT], no_answer=no_answer)
        return reply

    def answer(self, connection: Connection, reply: orders.OrderReply) -> None:
        fds = reply.descriptors()
        try:
            connection.sock.setblocking(True)
            connection.sock.settimeout(5.0)
            orders.send_line(connection.sock, orders.encode(reply), fds)
            connection.sock.setblocking(False)
        finally:
            for fd in fds:
                os.close(fd)


# -- what each order does: one function per order type, in one table --------------------


def start(launcher: Launcher, order: orders.StartTurn, stdin: bytes) -> orders.Started:
    launched = launcher.hands.start(order, stdin)
    launcher.journal.emit(
        events.TurnLaunched(
            mind=order.mind, session=order.session, turn_id=order.turn_id, pid=launched.pid
        )
    )
    return orders.Started(launched.pid, launched.pidfd)


def start_lease(launcher: Launcher, order: orders.StartLease, _: bytes) -> orders.Started:
    launched = launcher.hands.start_lease(order)
    launcher.journal.emit(
        events.TurnLaunched(
            mind=order.mind, session=order.session, turn_id=order.turn_id, pid=launched.pid
        )
    )
    return orders.Started(launched.pid, launched.pidfd)


def offer(launcher: Launcher, order: orders.Offer, record: bytes) -> orders.Done:
    launcher.hands.offer(order, record)
    return orders.Done()


def interrupt(launcher: Launcher, order: orders.Interrupt, _: bytes) -> orders.Done:
    launcher.hands.interrupt(order.turn_id, order.mind)
    return orders.Done()


def stop(launcher: Launcher, order: orders.Stop, _: bytes) -> orders.Done:
    launcher.hands.stop(order.turn_id, order.mind)
    return orders.Done()


def inspect(launcher: Launcher, order: orders.Inspect, _: bytes) -> orders.Report:
    return launcher.hands.inspect(order.turn_id, order.folded)


def sample(launcher: Launcher, order: orders.Sample, _: bytes) -> orders.Written:
    written = launcher.hands.sample(order.turn_ids)
    blocked = tuple(turn_id for turn_id, seen in written.items() if seen.blocked)
    counts = tuple(seen.bytes for seen in written.values())
    return orders.Written(tuple(written), counts, blocked)


def move_in(launcher: Launcher, order: orders.MoveIn, _: bytes) -> orders.Moved:
    return launcher.hands.move_in(order, launcher.passed)


def move_back(launcher: Launcher, order: orders.MoveBack, _: bytes) -> orders.Done:
    launcher.hands.move_back(order.turn_id, order.mind)
    return orders.Done()


def remove(launcher: Launcher, order: orders.Remove, _: bytes) -> orders.Done:
    launcher.hands.remove(order.turn_id)
    return orders.Done()


def sweep(launcher: Launcher, order: orders.Sweep, _: bytes) -> orders.Done:
    launcher.hands.sweep(order.open_ids)
    return orders.Done()


# Each order type's executor, given the launcher, the order and its payload (b"" for an
# order that takes none). `answered_by` proves (to mypy) that each returns its order's
# reply type; tests/unit/test_launcher_channel.py that every order has one.
Executor = Callable[[Launcher, Any, bytes], orders.OrderReply]
EXECUTE: dict[type[orders.Order[Any]], Executor] = dict(
    [
        orders.StartTurn.answered_by(start),
        orders.StartLease.answered_by(start_lease),
        orders.Offer.answered_by(offer),
        orders.Interrupt.answered_by(interrupt),
        orders.Stop.answered_by(stop),
        orders.Inspect.answered_by(inspect),
        orders.Sample.answered_by(sample),
        orders.Remove.answered_by(remove),
        orders.Sweep.answered_by(sweep),
        orders.MoveIn.answered_by(move_in),
        orders.MoveBack.answered_by(move_back),
    ]
)


def bind_listener(path: Path) -> socket.socket:
    """A socket of our own, when run by hand: root and the gate's user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    with contextlib.suppress(KeyError):
        os.chown(path, 0, pwd.getpwnam(orders.GATE_USER).pw_gid)
        os.chmod(path, 0o660)
    sock.listen(16)
    return sock


def run(
    settings: ReloadingSettings,
    manager: SystemdManager,
    listener: socket.socket,
    journal: Journal,
    stop_fd: int,
    ready: Callable[[], None] | None = None,
) -> None:
    hands = LocalHands(settings, manager, journal)
    hands.turn_dir_bounds = turndir.TURN_DIR_BOUNDS  # root: each turn's directory its tmpfs
    launcher = Launcher(hands, listener, journal, allowed_uids())
    if ready is not None:
        ready()
    launcher.serve(stop_fd)
