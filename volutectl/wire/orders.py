"""The launcher's channel: the orders the gate gives volute-launcher, and its replies.

The gate (unprivileged, volute-gate.service) decides; the launcher (root,
volute-launcher.service) carries out. Both sides import this module, so an order is one
record here (volutectl/wire/records.py), never a string built on either side.

On the wire: one JSON object per line, `{"v": 1, "order": NAME, ...fields}`, the same
framing and value checks as the gate's own socket (volutectl/wire/protocol.py), with a much
smaller bound on a line (MAX_LINE). Bytes that are not the launcher's to read (a turn's
stdin, a folded delivery's record) never travel in a line: the gate writes them into a
sealed memfd and passes its descriptor beside the line (SCM_RIGHTS); the launcher copies
them, bounded, into the turn's directory, unparsed. A started turn's pidfd comes back
the same way, so the gate watches the process it was told of, without a PID race.

An order names a turn by its id and mind only: the launcher derives the scope's name,
the turn's directory, the user, the command, the working directory and the environment
from its own copy of the configuration.
"""

from __future__ import annotations

import array
import os
import select
import socket
import stat
from collections import deque
from typing import Any, ClassVar, Self, TypeVar

from volutectl import names
from volutectl.errors import DataError, VoluteError
from volutectl.wire import fields, protocol
from volutectl.wire.records import Message, Record

VERSION = protocol.VERSION
# Orders carry ids and names only (payloads go by descriptor): 2 MiB holds MAX_IDS ids
# of 19 digits. A turn's folded ids (an inspect) and the open turns (a sweep) are the
# longest lists; the queue would have to hold 100,000 deliveries folded into one turn.
MAX_LINE = 2 * 1024 * 1024
MAX_IDS = 100_000
MAX_FDS = 1  # at most one descriptor beside a line, but for a move's pidfds:
# A lease's processes, each a pidfd beside a MoveIn's line: at most this many per lease
# (docs/protocol.md); the launcher's reader takes this many with one line, and refuses
# (closing them all) a line that comes with more, before it keeps any. One number for
# the client, the gate and the launcher: fields.MAX_LEASE_PIDS.
MAX_LEASE_PIDS = fields.MAX_LEASE_PIDS
MAX_TEXT = 4096  # the longest string a field may hold (a refusal's reason)
# The payload a start may carry (a batch of deliveries) and an offer (one record).
MAX_STDIN_BYTES = 1 << 30
MAX_RECORD_BYTES = 64 * 1024 * 1024
# The one user besides root that the launcher takes orders from.
GATE_USER = "volute-gate"
DEFAULT_SOCKET = "/run/volute-launcher/launcher.sock"


class OrderError(DataError):
    """An order or reply that does not fit its type: the connection is closed."""


# -- replies ----------------------------------------------------------------------------


class OrderReply(Record):
    """A reply of the launcher's; `Refused` may answer any order."""

    REPLY: ClassVar[str]
    FDS: ClassVar[int] = 0  # descriptors that come beside its line
    LOCAL: ClassVar[frozenset[str]] = frozenset()  # fields never sent: a descriptor

    def descriptors(self) -> tuple[int, ...]:
        """What to pass beside the line (SCM_RIGHTS)."""
        return ()

    def with_fd(self, fd: int) -> Self:
        """This reply with the descriptor that came beside its line (FDS of them)."""
        return self


class Done(OrderReply):
    REPLY = "done"


class Started(OrderReply):
    """The turn runs in its scope, released; its pidfd comes beside the line."""

    REPLY = "started"
    FDS = 1
    pid: int
    # Never on the line: the descriptor the launcher passes beside it, and the gate's
    # copy of it once received (the caller's to watch and close).
    pidfd: int | None = None
    LOCAL = frozenset({"pidfd"})

    def descriptors(self) -> tuple[int, ...]:
        return () if self.pidfd is None else (self.pidfd,)

    def with_fd(self, fd: int) -> Self:
        return type(self)(self.pid, fd)


class Report(OrderReply):
    REPLY = "report"
    started: bool  # the wrapper got as far as running the command
    exit_status: int | None  # recorded by the wrapper, or reaped by the launcher
    ended_at: float | None
    not_taken: tuple[int, ...]
    # What the turn's processes wrote to storage (the wrapper's rusage, reaped by the
    # launcher); None when it was not reaped there (a launcher that started again).
    written_bytes: int | None = None


class Written(OrderReply):
    """A sample's answer: `written[i]` bytes for `turn_ids[i]`, and which of them wait on
    the disk; a turn the launcher could not read (not its child, or gone) is left out."""

    REPLY = "written"
    turn_ids: tuple[int, ...]
    written: tuple[int, ...]
    # The turns (of turn_ids) with a process busy right now: waiting on the disk (state
    # D) or running (R): not shown quiet (volutectl/kernel/written.py).
    blocked: tuple[int, ...] = ()


class Refused(OrderReply):
    """The order was not carried out; `error` says why. For a start: the turn never
    ran (its child, if forked, exited unreleased)."""

    REPLY = "refused"
    error: str
    # systemd gave no answer: nothing of the order took effect that matters (a start's
    # child exited unreleased), and the same order may work in a moment.
    no_answer: bool = False


class Moved(OrderReply):
    REPLY = "moved"
    moved: tuple[int, ...]  # the pids now in the scope
    origins: tuple[str, ...]  # the unit each came from, same order


Reply = OrderReply  # the name the gate's hands and the launcher know it by
REPLIES: dict[str, type[OrderReply]] = {
    kind.REPLY: kind for kind in (Done, Started, Report, Written, Refused, Moved)
}
R = TypeVar("R", bound=OrderReply)

# -- orders -----------------------------------------------------------------------------


class Order(Message[R]):
    """An order: `Order[SomeReply]` declares the reply that answers it, on the same base
    as the gate's requests (volutectl/wire/records.py's Message). Its name is sent as the
    "order" field; `PAYLOAD` is the most bytes its descriptor may hold (0: none comes)."""

    ORDER: ClassVar[str]
    PAYLOAD: ClassVar[int] = 0

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        """Strict: the root launcher reads it, so it must hold exactly what we know."""
        order: Self = _build(cls.ORDER, cls, obj)
        return order


class StartTurn(Order[Started]):
    """Start turn `turn_id` of `mind` for `session`; its stdin comes as the payload."""

    ORDER = "start"
    PAYLOAD = MAX_STDIN_BYTES
    turn_id: int
    mind: str
    session: str
    delivery_ids: tuple[int, ...]


class StartLease(Order[Started]):
    """Start lease `turn_id`'s scope for `mind`/`session`: a placeholder process as the
    mind's user holds it (no RuntimeMaxSec=); no command runs."""

    ORDER = "start_lease"
    turn_id: int
    mind: str
    session: str


class Offer(Order[Done]):
    """Put a folded delivery (its record is the payload) into a running turn's inbox."""

    ORDER = "offer"
    PAYLOAD = MAX_RECORD_BYTES
    turn_id: int
    mind: str
    delivery_id: int


class Interrupt(Order[Done]):
    """SIGINT to every process of the turn's scope."""

    ORDER = "interrupt"
    turn_id: int
    mind: str


class Stop(Order[Done]):
    """Stop the turn's scope (SIGTERM, SIGKILL after its stop timeout); no wait."""

    ORDER = "stop"
    turn_id: int
    mind: str


class Inspect(Order[Report]):
    """What the turn's directory says of how it ran; `folded`: ids offered to it."""

    ORDER = "inspect"
    turn_id: int
    folded: tuple[int, ...]


class Remove(Order[Done]):
    """Remove a settled turn's directory."""

    ORDER = "remove"
    turn_id: int


class Sweep(Order[Done]):
    """Remove the directory of every turn not in `open_ids` (settled ones left behind)."""

    ORDER = "sweep"
    open_ids: tuple[int, ...]


class Sample(Order[Written]):
    """What each of these running turns' processes have written so far (an `Written`)."""

    ORDER = "sample"
    turn_ids: tuple[int, ...]


class MoveIn(Order[Moved]):
    """Move the processes whose pidfds come with the order (SCM_RIGHTS) into lease
    `turn_id`'s scope, after the launcher's own checks; remember where each came from."""

    ORDER = "move_in"
    turn_id: int
    mind: str
    pids: int  # how many pidfds came with the line


class MoveBack(Order[Done]):
    """Move lease `turn_id`'s processes back to the units they came from (or the
    documented fallback), before its scope is stopped."""

    ORDER = "move_back"
    turn_id: int
    mind: str


ORDERS: dict[str, type[Order[Any]]] = {
    kind.ORDER: kind
    for kind in (
        StartTurn,
        StartLease,
        Offer,
        Interrupt,
        Stop,
        Inspect,
        Remove,
        Sweep,
        Sample,
        MoveIn,
        MoveBack,
    )
}

# -- encoding and strict decoding -------------------------------------------------------


def encode(message: Order[Any] | OrderReply) -> bytes:
    if isinstance(message, Order):
        body: dict[str, Any] = {"order": message.ORDER}
    else:
        body = {"reply": message.REPLY}
    local = message.LOCAL if isinstance(message, OrderReply) else frozenset()
    body.update((name, value) for name, value in message.to_wire().items() if name not in local)
    return protocol.encode(body)


def _check_field(kind: str, name: str, value: Any, annotation: str) -> Any:
    where = f"{kind}.{name}"
    if annotation == "int":
        if type(value) is not int or value < 0:
            raise OrderError(f"{where}: expected a non-negative integer, got {value!r:.40}")
        return value
    if annotation == "bool":
        if type(value) is not bool:
            raise OrderError(f"{where}: expected true or false, got {value!r:.40}")
        return value
    if annotation == "str":
        if type(value) is not str or len(value) > MAX_TEXT:
            raise OrderError(f"{where}: expected a string, got {value!r:.40}")
        return value
    if annotation == "int | None":
        return None if value is None else _check_field(kind, name, value, "int")
    if annotation == "float | None":
        if value is None:
            return None
        if type(value) not in (int, float):
            raise OrderError(f"{where}: expected a number, got {value!r:.40}")
        return float(value)
    if annotation == "tuple[int, ...]":
        if type(value) is not list or len(value) > MAX_IDS:
            raise OrderError(f"{where}: expected a list of at most {MAX_IDS} ids")
        return tuple(_check_field(kind, f"{name}[]", item, "int") for item in value)
    if annotation == "tuple[str, ...]":
        if type(value) is not list or len(value) > MAX_IDS:
            raise OrderError(f"{where}: expected a list of at most {MAX_IDS} strings")
        return tuple(_check_field(kind, f"{name}[]", item, "str") for item in value)
    raise AssertionError(f"no check for {annotation}")  # pragma: no cover - a bug here


def _build(kind: str, cls: type[Any], body: dict[str, Any], *, tolerant: bool = False) -> Any:
    """Check and build one message. A field with a default may be absent (a message
    from an older peer, across an upgrade). `tolerant` also drops fields we do not
    know: for replies only, which the root launcher sends to the gate; an order, which
    the root launcher reads, must hold exactly what we know."""
    local: frozenset[str] = getattr(cls, "LOCAL", frozenset())
    wanted = {name: kind for name, kind in cls.TYPES.items() if name not in local}
    optional = {name for name in wanted if hasattr(cls, name)}
    extra = sorted(set(body) - set(wanted))
    missing = sorted(set(wanted) - set(body) - optional)
    if (extra and not tolerant) or missing:
        raise OrderError(f"{kind}: unexpected fields {extra}, missing fields {missing}")
    values = {
        name: _check_field(kind, name, body[name], wanted[name]) for name in wanted if name in body
    }
    for name in ("mind",):
        if name in values:
            try:
                names.check_mind(values[name])
            except names.NameError_ as error:
                raise OrderError(f"{kind}.mind: {error}") from None
    if "session" in values:
        try:
            names.check_session(values["session"])
        except names.NameError_ as error:
            raise OrderError(f"{kind}.session: {error}") from None
    return cls(**values)


def _body(line: bytes, tag: str) -> tuple[str, dict[str, Any]]:
    try:
        body = protocol.decode(line)
    except VoluteError as error:
        raise OrderError(error.message) from None
    body.pop("v")
    kind = body.pop(tag, None)
    if type(kind) is not str:
        raise OrderError(f"a line without its {tag!r} name")
    return kind, body


def decode_order(line: bytes) -> Order[Any]:
    kind, body = _body(line, "order")
    cls = ORDERS.get(kind)
    if cls is None:
        raise OrderError(f"unknown order {kind!r:.40}")
    order: Order[Any] = cls.decode(body)
    return order


def decode_reply(line: bytes) -> OrderReply:
    kind, body = _body(line, "reply")
    cls = REPLIES.get(kind)
    if cls is None:
        raise OrderError(f"unknown reply {kind!r:.40}")
    reply: OrderReply = _build(kind, cls, body, tolerant=True)
    return reply


# -- lines with descriptors -------------------------------------------------------------


def send_line(sock: socket.socket, line: bytes, fds: tuple[int, ...] = ()) -> None:
    """Send one whole line, its descriptors with its first byte."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([line], ancillary)
    while sent < len(line):
        sent += sock.send(line[sent:])


class LineReader:
    """Lines and the descriptors that came with them, from one stream connection.

    The sender attaches a line's descriptors to its first byte, so they arrive no later
    than the line; each line says how many it claims (`take_fd`, `take_fds`). At most
    `max_fds` come with one line (the launcher's reader: a MoveIn's MAX_LEASE_PIDS
    pidfds): one recvmsg that brings more, or whose descriptors the kernel had to
    truncate, is refused with every descriptor it brought closed, before any is kept.
    Descriptors left unclaimed are closed with the reader."""

    def __init__(self, max_line: int = MAX_LINE, max_fds: int = MAX_FDS) -> None:
        self.max_line = max_line
        self.max_fds = max_fds
        self.buffer = b""
        self.fds: deque[int] = deque()
        self.eof = False

    def receive(self, sock: socket.socket) -> None:
        """One recvmsg: raises BlockingIOError on a non-blocking socket with nothing."""
        size = socket.CMSG_SPACE(self.max_fds * array.array("i").itemsize)
        data, ancillary, flags, _ = sock.recvmsg(1 << 16, size, socket.MSG_CMSG_CLOEXEC)
        got = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
        if flags & socket.MSG_CTRUNC or len(got) + len(self.fds) > self.max_fds:
            for fd in got:  # the kernel closed those it could not pass; these too
                os.close(fd)
            raise OrderError(f"more descriptors than a line may carry (at most {self.max_fds})")
        self.fds.extend(got)
        if not data:
            self.eof = True
        self.buffer += data
        if b"\n" not in self.buffer and len(self.buffer) > self.max_line:
            raise OrderError(f"a line longer than {self.max_line} bytes")

    def line(self) -> bytes | None:
        if b"\n" not in self.buffer:
            return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        if len(line) > self.max_line:
            raise OrderError(f"a line longer than {self.max_line} bytes")
        return line

    def take_fd(self) -> int:
        if not self.fds:
            raise OrderError("a payload was announced but no descriptor came with it")
        return self.fds.popleft()

    def take_fds(self, count: int) -> tuple[int, ...]:
        """The `count` descriptors a line announced: exactly that many came, or the
        order is refused (those that came are closed with the reader)."""
        if count > self.max_fds or len(self.fds) != count:
            raise OrderError(
                f"{count} descriptors were announced, {len(self.fds)} came (at most {self.max_fds})"
            )
        taken = tuple(self.fds)
        self.fds.clear()
        return taken

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popleft())


def peer_gone(sock: socket.socket) -> bool:
    """The other end hung up (what it sent before may still be unread)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)
    return any(event & (select.POLLRDHUP | select.POLLHUP) for _, event in poller.poll(0))


# -- payloads ---------------------------------------------------------------------------


def payload_fd(data: bytes, name: str) -> int:
    """A sealed memfd holding `data`, to pass beside a line."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        import fcntl

        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_payload(fd: int, limit: int) -> bytes:
    """The bytes of a payload descriptor: a regular file (a memfd) of at most `limit`
    bytes, read from offset 0 and never blocking; anything else is refused."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise OrderError("a payload descriptor that is not a regular file")
    if st.st_size > limit:
        raise OrderError(f"a payload of {st.st_size} bytes, more than {limit}")
    chunks, offset = [], 0
    while offset < st.st_size:
        chunk = os.pread(fd, min(1 << 20, st.st_size - offset), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
