"""The gate's socket: its listener, its clients, and the lines between them.

`Server` owns the listening socket (systemd's when socket-activated, else one it binds)
and every client connection. It reads lines, decodes each into a typed request (or
answers the refusal at once), queues replies without ever blocking the loop, and keeps
the clients that wait for a delivery's outcome. It registers its sockets, and its
deadlines (idle clients, a rested listener's retry), in the gate's reactor
(volutectl/gate/reactor.py), which calls it back; the gate takes the requests that
arrived (`take_requests`) once the reactor's wait is over.

Limits, so that no client can hurt the gate: gate.max_clients connections at once (then
new ones wait unaccepted in the backlog), a listener that rests when accept() lacks
descriptors instead of spinning, clients idle mid-request for gate.client_idle_seconds
dropped, clients that never read their replies dropped, and a failure while serving
one client ends that client only.

Fair shares, as every member of the socket's group may connect: a uid other than root
holds at most gate.max_clients_per_uid connections, and the last
gate.clients_reserved_for_root places are root's; a connection past either is refused
with 75 as soon as it is accepted (its uid is known only then). A client that waits for
an outcome after its end of requests is watched for hang-up (`hangups`, an epoll set
that reports nothing else): once its peer has closed, nobody can read the outcome, and
it is dropped at once instead of holding its place until the delivery settles.

Fair shares of time and memory: one pass of the loop takes at most REQUESTS_PER_PASS
requests for all clients together (`take_requests`, batch by batch within the pass's
time: volutectl/gate/loop.py): root's first, then the others in turns between uids,
and within a uid between its connections (volutectl/core/shares.py), the uid served
longest ago first. A client's lines wait in its buffer until their turn, and a client
with a complete line waiting is not read further, so what one holds is at most one
read past its partial line. A line is checked for what it would cost before it is
parsed, and while it still arrives (protocol.check_cost); a uid's partial lines
together hold at most MAX_PARTIAL_BYTES_PER_UID (root: no limit). A line refused as it
arrives is answered at once, and its rest is dropped unread.

Descriptors (SCM_RIGHTS): a `register_repo` line may carry one, its repository's git
common directory, which the gate cannot open by path in a private home; an `acquire`
line up to MAX_LEASE_PIDS, the pidfds of the processes its lease moves. They must come
in the same sendmsg as the line's end. Each read takes at most MAX_PASSED_FDS (the
kernel discards what does not fit the ancillary buffer): one more than a lease's most,
so that an acquire that sent too many finds its count wrong (65) rather than cut to
fit. Those of a read are kept for the last line it completes, if that is a
register_repo (its first only) or an acquire (all), for that request (`take_passed`);
every other, with any other request, with no complete line, or while the client has
some waiting already, is closed at once.
"""

from __future__ import annotations

import array
import contextlib
import grp
import os
import select
import selectors
import socket
import struct
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeAlias

from volutectl import events
from volutectl.config.reload import SettingsHolder
from volutectl.config.settings import Settings
from volutectl.core import shares
from volutectl.errors import EX_SOFTWARE, DataError, TemporaryError, UnavailableError, VoluteError
from volutectl.gate.reactor import Reactor
from volutectl.systemd import activation
from volutectl.systemd.journal import Journal
from volutectl.wire import fields, messages, protocol
from volutectl.wire.messages import ErrorReply, Reply, Request

# Replies queued for a client that does not read them: beyond this it is dropped. The
# largest reply (a queue listing of 200 rows, without messages) is some 50 KiB.
MAX_OUTBOX = 1 << 20
# After accept() failed for want of descriptors or memory, the listener rests until a
# client leaves or this long has passed (the descriptors may be held by turns instead).
ACCEPT_RETRY_SECONDS = 1.0
# Requests served in one pass of the loop, of every client together (root's first, then
# the others' in turns), in batches and within volutectl/gate/loop.py's PASS_SECONDS:
# the rest wait for the next pass, in the clients' buffers. A `status` takes some 0.5 ms
# here (2 cores of a VM), 2 ms on a Raspberry Pi 3; so a pass is over in a fraction of a
# second, and root's request, read in the next, never waits long.
REQUESTS_PER_PASS = 256
# The partial lines of one uid's connections, together (a `deliver` of 1 MiB is at most
# some 6 MiB on the wire): beyond, the connection that grew them is refused (75).
MAX_PARTIAL_BYTES_PER_UID = 32 << 20
# A client's partial line past this is counted with its uid's others.
_PARTIAL_CHECKED = 64 << 10
# Descriptors one read may bring in (SCM_RIGHTS); the kernel closes any past them.
MAX_PASSED_FDS = fields.MAX_LEASE_PIDS + 1
_ANCILLARY = socket.CMSG_SPACE(MAX_PASSED_FDS * 4)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# The peer has closed its socket (or shut both ways), or reset it: nothing sent reaches it.
_GONE = select.POLLHUP | select.POLLERR


@dataclass(eq=False)
class Client:
    sock: socket.socket
    fd: int  # the key in Server.clients and Server.idle; sock.fileno() is -1 once closed
    uid: int  # SO_PEERCRED of the connection: fixed at connect()
    buffer: bytearray = field(default_factory=bytearray)  # lines read, not yet all taken
    taken: int = 0  # the offset in `buffer` of the first byte not yet taken as a line
    partial: int = 0  # the bytes at the end of `buffer` after its last complete line
    skipping: bool = False  # a line was refused as it arrived: drop the rest of it
    outbox: bytearray = field(default_factory=bytearray)
    events: int = selectors.EVENT_READ  # what the reactor watches it for; 0: not at all
    closed: bool = False
    eof: bool = False  # it shut its writing side: no more requests, but it may wait
    waiting: set[int] = field(default_factory=set)  # delivery ids it waits for
    progress: bool = False  # it asked to hear of each failed attempt of those (AttemptFailed)
    # Monotonic time of the last complete line, of the accept, or of a wait's end: the
    # client is dropped gate.client_idle_seconds later, unless it is waiting.
    idle_since: float = 0.0
    # A descriptor that came with one of its lines (SCM_RIGHTS), the gate's until its
    # request is handled or the client dropped: (fd, lines still to go until that one).
    incoming_fds: tuple[tuple[int, ...], int] | None = None
    passed: tuple[Request[Reply], tuple[int, ...]] | None = None  # that request, its fds
    # Leases it holds or awaits (volutectl/gate/leases.py): while it has one it is never
    # idle, and closing it ends them.
    leases: set[int] = field(default_factory=set)

    def kept(self) -> bool:
        """It waits for an outcome or holds a lease: no idle clock runs for it."""
        return bool(self.waiting or self.leases)

    def peer_uid(self) -> int:
        """The uid of the process that connected."""
        return self.uid


# A request as it arrived: decoded, or already refused.
Incoming: TypeAlias = tuple[Client, Request[Reply] | ErrorReply]


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _passed_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors in a read's ancillary data (SCM_RIGHTS), all of them."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def peer_uid(sock: socket.socket) -> int:
    """The (effective) uid of the process that connected: SO_PEERCRED, fixed at connect()."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return int(_PEERCRED.unpack(raw)[1])


class Server:
    def __init__(
        self,
        held: SettingsHolder,
        reactor: Reactor,
        journal: Journal,
        *,
        inherited: socket.socket | None = None,
    ) -> None:
        self.held = held
        self.reactor = reactor
        self.journal = journal
        self.bound_socket: Path | None = None  # a socket file we bound, to unlink on close
        self.clients: dict[int, Client] = {}
        self.per_uid: Counter[int] = Counter()  # connections open, by uid
        self.refusing: set[int] = set()  # uids refused (as logged) since last accepted
        # Clients that wait for an outcome after their end of requests, by fd: polled for
        # nothing but hang-up (EPOLLHUP and EPOLLERR are always reported), and itself
        # in the reactor, so a hang-up wakes the loop.
        self.hangups = select.epoll()
        # The clients that can go idle (not waiting), oldest idle_since first: insertion
        # order is that order, so the next idle deadline is the first entry's, in O(1).
        self.idle: dict[int, Client] = {}
        # Called with each client dropped: the waiters forget it (gate/outcomes.py).
        self.on_drop: Callable[[Client], None] = lambda client: None
        # Clients with complete lines not yet taken, by fd: those served longest ago first.
        self.backlog: dict[int, Client] = {}
        self.served: list[int] = []  # uids with lines taken before, the most recent last
        self.accept_retry: float | None = None  # monotonic, after accept() lacked fds
        self.accept_problem: str | None = None  # why accepting paused, as last logged
        self.stopping = False
        self.listener = self._listen(inherited)
        reactor.watch(self.listener, self._on_listener)
        reactor.watch(self.hangups.fileno(), self._on_hangups)
        self.accepting = True  # the listener is in the reactor (see _pause_accepting)
        reactor.at(self._idle_deadline, self._drop_idle_clients)
        reactor.at(lambda: self.accept_retry, self._retry_accepting)

    @property
    def settings(self) -> Settings:
        """The settings held now: a reload reaches this part through its holder."""
        return self.held.current

    # -- the listener -----------------------------------------------------------------

    def _listen(self, inherited: socket.socket | None) -> socket.socket:
        """The listening socket: systemd's when socket-activated, else one bound here.

        When volute-gate.socket listens somewhere other than gate.socket, the inherited
        socket wins: it is where systemd queues connections while the gate restarts, and
        a gate that bound a second socket would leave those unserved. The mismatch is
        logged with both paths, and `volutectl doctor` reports it.
        """
        path, group = self.settings.gate.socket, self.settings.gate.socket_group
        if inherited is not None:
            served = activation.served_path(inherited)
            if served != str(path):
                self.journal.emit(events.SocketMismatch(socket=served, configured_socket=str(path)))
            inherited.setblocking(False)
            return inherited
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(str(path))
                except OSError:
                    path.unlink()
                else:
                    raise UnavailableError(f"another gate is already serving {path}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o117)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old_umask)
        self._give_to_group(path, group)
        listener.listen(128)
        listener.setblocking(False)
        self.bound_socket = path
        return listener

    def _give_to_group(self, path: Path, group: str) -> None:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except KeyError:
            self.journal.emit(events.SocketGroupMissing(group=group, path=str(path)))
        except PermissionError:
            pass
        os.chmod(path, 0o660)

    def _on_listener(self, mask: int) -> None:
        self.accept()

    def accept(self) -> None:
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
                uid = peer_uid(sock)
                refusal = self._refusal(uid)
                if refusal is not None:
                    self._refuse(sock, uid, refusal)
                    continue
                self._add_client(sock, uid)
            except Exception as error:  # noqa: BLE001 - one connection, not the gate
                sock.close()
                self.log_failure("taking a new connection", error)
                self._pause_accepting(f"cannot take connections: {error}", retry=True)
                return
        self._pause_accepting(
            f"{self.settings.gate.max_clients} connections are open (gate.max_clients); "
            "new ones wait until one closes"
        )

    def _add_client(self, sock: socket.socket, uid: int) -> None:
        sock.setblocking(False)
        client = Client(sock, sock.fileno(), uid)
        self.reactor.watch(sock, partial(self.on_client, client))
        self.clients[client.fd] = client
        self.per_uid[uid] += 1
        self.refusing.discard(uid)
        self._mark_active(client)

    def _refusal(self, uid: int) -> TemporaryError | None:
        """Why a new connection of `uid` may not have a place, if it may not: root may
        take every place; any other uid its share, out of what root's reserve leaves."""
        if uid == 0:
            return None
        gate = self.settings.gate
        mine = self.per_uid[uid]
        if mine >= gate.max_clients_per_uid:
            return TemporaryError(
                f"uid {uid} has {mine} connections open to the gate, its most "
                f"(gate.max_clients_per_uid = {gate.max_clients_per_uid})",
                hint="each `volutectl wait` and `deliver --wait` holds one until its "
                "deliveries settle: end some, or wait for them, and try again",
            )
        others = len(self.clients) - self.per_uid[0]
        if others >= gate.max_clients - gate.clients_reserved_for_root:
            return TemporaryError(
                f"{others} connections are open to the gate; the other "
                f"{gate.clients_reserved_for_root} places are root's "
                "(gate.clients_reserved_for_root)",
                hint="try again once fewer are open",
            )
        return None

    def _refuse(self, sock: socket.socket, uid: int, refusal: TemporaryError) -> None:
        """Say why (one line, which a new socket's buffer always takes), and close. The
        request it may have sent is never read: the client takes this as its answer."""
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(protocol.encode(ErrorReply.of(refusal).to_wire()))
        sock.close()
        if uid not in self.refusing:  # once, until one of its connections is taken again
            self.refusing.add(uid)
            self.journal.emit(
                events.ConnectionsRefused(
                    refusal=refusal.message, uid=uid, clients=len(self.clients)
                )
            )

    def _pause_accepting(self, reason: str, *, retry: bool = False) -> None:
        """Take the listener out of the reactor: connections wait in its backlog, and
        the loop does not wake for them. A client leaving (or, after a lack of
        descriptors, ACCEPT_RETRY_SECONDS) puts it back."""
        if self.accepting:
            self.reactor.unwatch(self.listener)
            self.accepting = False
        if retry:
            self.accept_retry = self.reactor.clock.monotonic() + ACCEPT_RETRY_SECONDS
        if reason != self.accept_problem:  # once per episode, not once per retry
            self.accept_problem = reason
            self.journal.emit(events.NotAccepting(reason=reason, clients=len(self.clients)))

    def _resume_accepting(self) -> None:
        self.accept_retry = None
        if self.accepting or self.stopping:
            return
        if len(self.clients) >= self.settings.gate.max_clients:
            return
        self.reactor.watch(self.listener, self._on_listener)
        self.accepting = True

    # -- deadlines ----------------------------------------------------------------------

    def _idle_deadline(self) -> float | None:
        """Monotonic: when the client idle longest is to be dropped."""
        oldest = next(iter(self.idle.values()), None)
        if oldest is None:
            return None
        return oldest.idle_since + self.settings.gate.client_idle_seconds

    def _retry_accepting(self, now: float) -> None:
        self._resume_accepting()

    def _mark_active(self, client: Client) -> None:
        """Restart the client's idle clock; a client that waits on a turn has none."""
        self.idle.pop(client.fd, None)
        if not client.closed and not client.kept():
            client.idle_since = self.reactor.clock.monotonic()
            self.idle[client.fd] = client

    def _drop_idle_clients(self, now: float) -> None:
        limit = self.settings.gate.client_idle_seconds
        while self.idle:
            client = next(iter(self.idle.values()))
            if now < client.idle_since + limit:
                return
            if client.partial:  # a request that never ended: say why it is cut off
                refusal = TemporaryError(
                    f"no complete request in {limit:g} s: closing the connection"
                )
                self.reply(client, ErrorReply.of(refusal))
            self.drop(client)  # which takes it out of self.idle

    # -- reading --------------------------------------------------------------------------

    def on_client(self, client: Client, mask: int) -> None:
        """Serve one client's readiness: what it sent waits in its buffer, and a client
        with a complete line is in `backlog` until the gate takes its lines in turn
        (`take_requests`). Whatever fails ends that client, not the loop."""
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(client)
            # A client with lines still waiting in its backlog is not read further
            # until they are taken: its buffer stays within one read.
            if mask & selectors.EVENT_READ and not client.closed and client.fd not in self.backlog:
                self._read(client)
        except Exception as error:  # noqa: BLE001 - see client_failed
            self.client_failed(client, "reading a request", error)

    def take_requests(self, budget: int = REQUESTS_PER_PASS) -> list[Incoming]:
        """At most `budget` requests of the clients' complete lines, each decoded or
        already refused, each client's in the order it sent them: root's first, then
        one of each other uid's in turn, the uid served longest ago first, and within
        a uid one of each connection in turn. The rest wait for the next pass."""
        requests: list[Incoming] = []
        by_uid: dict[int, list[Client]] = {}
        for client in self.backlog.values():  # served longest ago first
            by_uid.setdefault(client.uid, []).append(client)
        roots = by_uid.pop(0, [])
        take = partial(self._take_line, requests)
        turns = shares.take_turns([roots], budget, take)
        others = shares.least_recent_first(by_uid, self.served)
        turns += shares.take_turns([by_uid[uid] for uid in others], budget - len(turns), take)
        for client in shares.served_order((), turns):
            if self.backlog.pop(client.fd, None) is not None:
                self.backlog[client.fd] = client  # served now: last in line
        self.served = shares.served_order(self.served, [c.uid for c in turns if c.uid])
        return requests

    def _take_line(self, requests: list[Incoming], client: Client) -> bool:
        """Take the client's next complete line into `requests`, decoded or refused;
        False if it had none (it leaves the backlog) or was closed for it."""
        end = client.buffer.find(b"\n", client.taken) if not client.closed else -1
        if end < 0:
            self.backlog.pop(client.fd, None)
            return False
        line = bytes(client.buffer[client.taken : end])
        client.taken = end + 1
        self._mark_active(client)  # a complete line: the idle clock starts again
        if len(line) > protocol.MAX_LINE:
            self._refuse_oversized(client)
            return False
        decoded: Request[Reply] | ErrorReply
        try:
            protocol.check_cost(line)
            decoded = messages.decode_request(protocol.decode(line))
        except VoluteError as error:
            decoded = ErrorReply.of(error)
        except Exception as error:  # noqa: BLE001 - see client_failed
            self.client_failed(client, "reading a request", error)
            return False
        requests.append((client, decoded))
        self._attached(client, decoded)
        return True

    def _read(self, client: Client) -> None:
        try:
            chunk, ancillary, _, _ = client.sock.recvmsg(
                1 << 20, _ANCILLARY, socket.MSG_CMSG_CLOEXEC
            )
        except BlockingIOError:
            return
        except OSError:
            chunk, ancillary = b"", []
        fds = _passed_fds(ancillary) if ancillary else []
        if not chunk:
            _close_fds(fds)
            self._end_of_requests(client)
            return
        if client.skipping:  # the rest of a line refused while it arrived: not kept
            end = chunk.find(b"\n")
            if end < 0:
                _close_fds(fds)
                return
            chunk, client.skipping = chunk[end + 1 :], False
        if fds:  # counted on what is kept of the chunk: its lines are the ones decoded
            self._take_fds(client, fds, chunk)
        if client.taken:  # every complete line was taken: what is left is partial
            del client.buffer[: client.taken]
            client.taken = 0
        client.buffer += chunk  # a bytearray: a line that trickles in is not recopied
        if b"\n" in chunk:
            self.backlog[client.fd] = client
            client.partial = len(chunk) - chunk.rfind(b"\n") - 1
        else:
            client.partial += len(chunk)
        if client.partial > protocol.MAX_LINE:
            self._refuse_oversized(client)
        elif client.partial > _PARTIAL_CHECKED:
            self._check_partial(client)

    def _take_fds(self, client: Client, fds: list[int], chunk: bytes) -> None:
        """Keep the descriptors of a read for the last line it completes, if the client
        has none waiting; else close them now. Before a read a client's buffer holds no
        complete line (one with lines left is not read), so that line is the buffer's
        Nth, N the newlines in the chunk."""
        lines = chunk.count(b"\n")
        if fds and lines and client.incoming_fds is None and client.passed is None:
            client.incoming_fds = (tuple(fds), lines)
            return
        _close_fds(fds)

    def _attached(self, client: Client, request: Request[Reply] | ErrorReply) -> None:
        """One more line of the client's decoded: if the descriptors came with it, keep
        them for that request when it is a register_repo (the first) or an acquire
        (all), else close them."""
        if client.incoming_fds is None:
            return
        fds, lines = client.incoming_fds
        if lines > 1:
            client.incoming_fds = (fds, lines - 1)
            return
        client.incoming_fds = None
        if isinstance(request, messages.RegisterRepoRequest) and client.passed is None:
            client.passed = (request, fds[:1])
            _close_fds(list(fds[1:]))
        elif isinstance(request, messages.AcquireRequest) and client.passed is None:
            client.passed = (request, fds)
        else:
            _close_fds(list(fds))

    def take_passed(self, client: Client, request: Request[Reply]) -> tuple[int, ...]:
        """The descriptors that came with `request`, now the caller's to close."""
        if client.passed is None or client.passed[0] is not request:
            return ()
        fds = client.passed[1]
        client.passed = None
        return fds

    def _check_partial(self, client: Client) -> None:
        """A long line still arriving: refuse it now if it already holds more values
        than a request may, or takes its uid past its share of partial bytes, rather
        than once the whole line is in. What arrives of it until its end is dropped
        unread; the connection goes on with the next line."""
        refusal: VoluteError | None = None
        try:
            protocol.check_cost(client.buffer, len(client.buffer) - client.partial, partial=True)
        except DataError as error:
            refusal = error
        if refusal is None and client.uid != 0:
            held = sum(other.partial for other in self.clients.values() if other.uid == client.uid)
            if held > MAX_PARTIAL_BYTES_PER_UID:
                refusal = TemporaryError(
                    f"uid {client.uid} has {held} bytes of requests still arriving on its "
                    f"connections to the gate, its most ({MAX_PARTIAL_BYTES_PER_UID})",
                    hint="send each request whole, and fewer at once",
                )
        if refusal is not None:
            del client.buffer[len(client.buffer) - client.partial :]
            client.partial, client.skipping = 0, True
            self.reply(client, ErrorReply.of(refusal))

    def _refuse_oversized(self, client: Client) -> None:
        limit = self.settings.gate.max_message_bytes
        refusal = DataError(
            f"request too large: a line holds at most {protocol.MAX_LINE} bytes",
            hint=f"a message holds at most {limit} bytes (gate.max_message_bytes)",
        )
        self.reply(client, ErrorReply.of(refusal))
        self.drop(client)

    def _end_of_requests(self, client: Client) -> None:
        """It shut its side: drop it, unless it waits for an outcome it should still get
        (or has replies still to read): then stop reading, and close once it has them.

        An end of requests is also what a client that has gone looks like (closed, or
        its process dead): then nothing can reach it any more, and it goes at once. One
        that only shut its writing side may still read: it stays, watched for the
        hang-up that its going later brings."""
        client.eof = True
        if (not client.waiting and not client.outbox) or _gone(client.sock):
            self.drop(client)
            return
        self.idle.pop(client.fd, None)
        self._watch(client)
        if client.waiting:
            with contextlib.suppress(FileExistsError):
                self.hangups.register(client.fd, 0)

    def _on_hangups(self, mask: int) -> None:
        """Drop the waiting clients whose peers have gone since their end of requests."""
        for fd, _ in self.hangups.poll(0):
            client = self.clients.get(fd)
            if client is not None:
                self.drop(client)
            else:  # not ours any more (never so: drop unregisters it)
                with contextlib.suppress(OSError):
                    self.hangups.unregister(fd)

    # -- writing ----------------------------------------------------------------------------

    def reply(self, client: Client, reply: Reply) -> None:
        """Queue a reply and send what the socket takes now; never block the loop."""
        if client.closed:
            return
        client.outbox += protocol.encode(reply.to_wire())
        if client.kept():
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
                self.drop(client)  # a client that never reads
                return
        except OSError:
            self.drop(client)
            return
        if client.eof and not client.outbox and not client.waiting:
            self.drop(client)  # it asked for nothing more, and has everything
            return
        self._watch(client)

    def _watch(self, client: Client) -> None:
        """Watch it for reading (until its EOF) and, while replies wait, for writing."""
        events = 0 if client.eof else selectors.EVENT_READ
        events |= selectors.EVENT_WRITE if client.outbox else 0
        if events == client.events:
            return
        if client.events == 0:
            self.reactor.watch(client.sock, partial(self.on_client, client), events)
        elif events == 0:
            self.reactor.unwatch(client.sock)
        else:
            self.reactor.modify(client.sock, partial(self.on_client, client), events)
        client.events = events

    # -- clients that wait for an outcome (volutectl/gate/outcomes.py) -----------------------

    def stop_idle_clock(self, client: Client) -> None:
        """The client waits for an outcome now: it is not idle meanwhile."""
        self.idle.pop(client.fd, None)

    # -- failures and closing ----------------------------------------------------------------

    def client_failed(self, client: Client, what: str, error: Exception) -> None:
        """A bug met while serving one client: log it once, tell the client (70) if it
        still listens, and close it. The gate carries on with everyone else."""
        self.log_failure(what, error)
        with contextlib.suppress(Exception):
            self.reply(
                client,
                ErrorReply.of(
                    VoluteError(
                        f"internal error in the gate while {what}",
                        hint="see: journalctl -u volute-gate",
                        exit_code=EX_SOFTWARE,
                    )
                ),
            )
        self.drop(client)

    def log_failure(self, what: str, error: BaseException) -> None:
        frames = traceback.extract_tb(error.__traceback__)
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else None
        self.journal.emit(
            events.InternalError(
                what=what, error=str(error), exception=type(error).__name__, where=where
            )
        )

    def drop(self, client: Client) -> None:
        if client.closed:
            return
        client.closed = True
        self.idle.pop(client.fd, None)
        self.backlog.pop(client.fd, None)
        if self.clients.get(client.fd) is client:
            del self.clients[client.fd]
            self.reactor.unwatch(client.fd)
            if client.eof:
                with contextlib.suppress(OSError):
                    self.hangups.unregister(client.fd)
            self.per_uid[client.uid] -= 1
            if not self.per_uid[client.uid]:
                del self.per_uid[client.uid]
                with contextlib.suppress(ValueError):
                    self.served.remove(client.uid)
        self.on_drop(client)
        if client.incoming_fds is not None:
            _close_fds(list(client.incoming_fds[0]))
        if client.passed is not None:
            _close_fds(list(client.passed[1]))
        client.incoming_fds = client.passed = None
        with contextlib.suppress(OSError):
            client.sock.close()
        self._resume_accepting()  # one place free, or one descriptor

    def close(self) -> None:
        """Drop every client and close the listener. A socket from systemd stays: its
        backlog holds the connections that arrive until the next gate starts. Only a
        socket the gate bound itself is removed."""
        self.stopping = True
        for client in list(self.clients.values()):
            self.drop(client)
        if self.bound_socket is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.bound_socket)
        self.listener.close()
        self.hangups.close()


def _gone(sock: socket.socket) -> bool:
    """Has the peer closed its socket (not only shut its writing side), or reset it?"""
    poller = select.poll()
    poller.register(sock, 0)
    return any(mask & _GONE for _, mask in poller.poll(0))
