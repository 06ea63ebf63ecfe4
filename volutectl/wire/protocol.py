"""The gate's socket framing: one JSON object per line, each with a version field.

What the objects say (every request and reply, typed) is volutectl/wire/messages.py; here
are the lines, the checks no field of any message may fail (nesting, 64-bit integers,
finite numbers), and a client's connection. docs/protocol.md documents both. Kept free
of heavy imports: `volutectl deliver` loads this module on its hot path.
"""

from __future__ import annotations

import array
import json
import re
import socket
import time
from socket import SCM_RIGHTS, SOL_SOCKET

from volutectl.errors import (
    EX_NOPERM,
    EX_PROTOCOL,
    EX_TEMPFAIL,
    DataError,
    PermissionDeniedError,
    UnavailableError,
    VoluteError,
)

# Not `import typing`: this module is on deliver's hot path (~6 ms).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, TypeVar

    T = TypeVar("T")

VERSION = 1
# A line may carry a 1 MiB message JSON-escaped (up to 6 bytes per byte) plus fields.
MAX_LINE = 8 * 1024 * 1024 + 4096
# Requests are flat (the deepest, a list of ids, is 2) and replies shallow (status: 6).
MAX_DEPTH = 16
# SQLite stores integers as signed 64 bits; a larger one must never reach the store.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
# A request holds at most this many values (numbers, strings, arrays, objects, ...)
# outside a deliver's messages. Parsed, each costs the gate 30 to 100 bytes, so a line of
# a few bytes per value would cost it 20 times its length; the largest request a client
# sends, a `wait` for 1,000 deliveries, holds 1,002.
MAX_VALUES = 16_384
# The long strings a request may hold: a deliver's message, or each of its items'.
# Matched once escaped quotes are out: then a `"` begins or ends a string, and this one
# is a key.
_MESSAGE_KEY = re.compile(rb'"message"\s*:\s*"')
_KEY = rb'"([^"]*)"\s*:'  # in a line without escaped quotes
_SEPARATORS = rb"[,\[{]"
# Enough characters for any 64-bit integer ("-9223372036854775808"): a longer literal is
# refused without building the number (Python refuses beyond 4,300 digits anyway).
_INT_DIGITS = 20
_INFINITY = float("inf")  # not `math`: one import less on the hot path


class ProtocolError(VoluteError):
    exit_code = EX_PROTOCOL


class ConnectionLost(UnavailableError):
    """The gate went away after the connection was made: EOF, ECONNRESET or EPIPE.

    Unlike a socket that is missing or refuses connections (the gate is absent), this is
    what a gate restarting or dying mid-request looks like, and a request carrying a
    request id may be sent again."""


class _Refused:
    """A JSON number we will not take (NaN, Infinity, a huge integer), kept in place by
    the parser so that the check after parsing can name the field it sits in."""

    __slots__ = ("text", "why")

    def __init__(self, text: str, why: str) -> None:
        self.text = text
        self.why = why


_OUT_OF_RANGE = "is outside SQLite's 64-bit integer range"


def _parse_int(text: str) -> int | _Refused:
    return _Refused(text, _OUT_OF_RANGE) if len(text) > _INT_DIGITS else int(text)


def _parse_constant(text: str) -> _Refused:  # NaN, Infinity, -Infinity
    return _Refused(text, "is not a finite number")


def _field(path: str, key: object) -> str:
    name = str(key) if len(str(key)) <= 40 else f"{str(key)[:40]}..."
    name = name or '""'
    return f"{path}.{name}" if path else name


def _shown(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:12]}...{text[-4:]} ({len(text)} digits)"


def check_values(value: object, path: str = "", depth: int = 1) -> None:
    """Refuse what JSON allows but the gate must not take, naming the field: nesting
    deeper than MAX_DEPTH, integers outside SQLite's 64 bits, NaN and infinities."""
    where = path or "the request"
    if depth > MAX_DEPTH:
        raise DataError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            check_values(item, _field(path, key), depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_values(item, f"{where}[{index}]", depth + 1)
    elif isinstance(value, _Refused):
        raise DataError(f"{where}: {_shown(value.text)} {value.why}")
    elif type(value) is int and not INT_MIN <= value <= INT_MAX:
        raise DataError(f"{where}: {value} {_OUT_OF_RANGE}")
    elif type(value) is float and not -_INFINITY < value < _INFINITY:  # 1e400; NaN too
        raise DataError(f"{where}: {value} is not a finite number")


# A string (a key when a colon follows), or a bracket: enough to follow the nesting.
# Compiled on first use, by re.finditer: not at import, on deliver's hot path.
_TOKENS = rb'("(?:[^"\\]|\\.)*")\s*:|"(?:[^"\\]|\\.)*"|[][{}]'


def _too_deep(line: bytes) -> DataError:
    """The refusal of a line too deep for the parser, naming its top-level field. Only
    run on such a line, never on the normal path."""
    depth, key = 0, ""
    for token in re.finditer(_TOKENS, line):
        if token.group(1) is not None:
            if depth == 1:
                try:
                    key = _field("", json.loads(token.group(1)))
                except ValueError:
                    key = "a field"
        elif token.group() in (b"{", b"["):
            depth += 1
            if depth > MAX_DEPTH:
                break
        elif token.group() in (b"}", b"]"):
            depth -= 1
    return DataError(f"{key or 'the request'}: nested deeper than {MAX_DEPTH} levels")


def _separators(line: bytes | bytearray, start: int = 0) -> int:
    """At least the values the line holds but one (each follows a `,`, `[`, `{`)."""
    return line.count(b",", start) + line.count(b"[", start) + line.count(b"{", start)


def check_cost(line: bytes | bytearray, start: int = 0, *, partial: bool = False) -> None:
    """Refuse a request line (65, naming the field) that holds more than MAX_VALUES
    values, before it is parsed: a line of 8 MB could otherwise hold a million ids, and
    cost the gate seconds and hundreds of MB. Linear and in C: when the line holds more
    separators than values allowed, a deliver's messages (each item's) are left out, and they are
    counted again. The line is `line[start:]`; `partial`: its end has not arrived yet
    (a message not yet ended is left out to the end)."""
    if _separators(line, start) <= MAX_VALUES:
        return
    # Without its escaped backslashes and quotes, a string is a `"`, no `"`, a `"`.
    flat = bytes(line[start:]).replace(b"\\\\", b"").replace(b'\\"', b"")
    flat = _without_messages(flat, partial)
    if _separators(flat) <= MAX_VALUES:
        return
    raise DataError(
        f"{_crowded(flat)}: a request holds at most {MAX_VALUES} values "
        "(numbers, strings, arrays, objects), this one more"
    )


def _without_messages(flat: bytes, partial: bool) -> bytes:
    """`flat` without the text of each message (a deliver's, or each of its items'); one
    not yet ended is left out to the end if the line is `partial`."""
    kept, at = [], 0
    while (found := _MESSAGE_KEY.search(flat, at)) is not None:
        end = flat.find(b'"', found.end())
        if end < 0 and not partial:
            break
        kept.append(flat[at : found.end()])
        at = end if end >= 0 else len(flat)
    kept.append(flat[at:])
    return b"".join(kept)


def _crowded(line: bytes) -> str:
    """The field in which the MAX_VALUES-th value sits: the last key before it."""
    position = 0
    for count, separator in enumerate(re.finditer(_SEPARATORS, line)):
        if count == MAX_VALUES:
            position = separator.start()
            break
    key = None
    for key in re.compile(_KEY).finditer(line, 0, position):  # noqa: B007 - the last one
        pass
    if key is None:
        return "the request"
    try:
        return _field("", json.loads(b'"' + key.group(1) + b'"'))
    except ValueError:
        return "a field"


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps({"v": VERSION, **message}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """One line to a JSON object: a ProtocolError (76) if it is none, a DataError (65)
    naming the field if it holds what the gate must not take (see check_values)."""
    try:
        value = json.loads(line, parse_int=_parse_int, parse_constant=_parse_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise ProtocolError(f"not a JSON line: {error}") from None
    except RecursionError:
        raise _too_deep(line) from None
    if not isinstance(value, dict):
        raise ProtocolError("a request must be a JSON object")
    check_values(value)
    version = value.get("v")
    # `type(...) is int`: in Python true == 1 and 1.0 == 1, but neither is version 1.
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"protocol version {version!r} is not {VERSION}")
    return value


class Connection:
    """A client's connection to the gate socket."""

    def __init__(self, path: str, timeout: float | None = 30.0) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except FileNotFoundError:
            self.sock.close()
            raise UnavailableError(
                f"the gate is not running: no socket at {path}",
                hint="start it with: systemctl start volute-gate.service",
            ) from None
        except ConnectionRefusedError:
            self.sock.close()
            raise UnavailableError(
                f"the gate is not running: {path} refuses connections",
                hint="start it with: systemctl start volute-gate.service",
            ) from None
        except PermissionError:
            self.sock.close()
            raise PermissionDeniedError(
                f"permission denied on the gate socket {path}",
                hint="add your user to the socket's group (default: volute), then log in again",
                exit_code=EX_NOPERM,
            ) from None
        except TimeoutError:
            self.sock.close()  # a full backlog: the gate is there but far behind
            raise VoluteError(
                f"the gate at {path} did not accept the connection in time",
                exit_code=EX_TEMPFAIL,
            ) from None
        except OSError as error:
            self.sock.close()
            raise UnavailableError(f"cannot connect to the gate at {path}: {error}") from None
        self.buffer = b""

    def send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        """Send one request line; `fds` go with it (SCM_RIGHTS), in the same sendmsg."""
        try:
            line = encode(message)
            if fds:
                rights = array.array("i", fds).tobytes()
                line = line[self.sock.sendmsg([line], [(SOL_SOCKET, SCM_RIGHTS, rights)]) :]
            self.sock.sendall(line)
        except (BrokenPipeError, ConnectionResetError) as error:
            if self._refused_at_once():
                return  # receive() gives the refusal, which answers this request
            raise ConnectionLost(f"lost the gate at {self.path}: {error}") from None
        except TimeoutError:
            raise VoluteError(
                f"the gate at {self.path} did not take the request in time", exit_code=EX_TEMPFAIL
            ) from None
        except OSError as error:
            raise UnavailableError(f"lost the gate at {self.path}: {error}") from None

    def _refused_at_once(self) -> bool:
        """Did the gate refuse this connection as it accepted it (too many connections of
        this uid, or of all), before it read anything? Its one line of refusal is then
        in our buffer already, though it closed before our request went out."""
        self.sock.setblocking(False)
        try:
            while b"\n" not in self.buffer:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                self.buffer += chunk
        except OSError:
            pass
        finally:
            self.sock.setblocking(True)
        return b"\n" in self.buffer

    def receive(self, timeout: float | None = 30.0) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        while b"\n" not in self.buffer:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise VoluteError(
                    f"the gate at {self.path} did not answer in time", exit_code=EX_TEMPFAIL
                ) from None
            except ConnectionResetError as error:
                raise ConnectionLost(f"lost the gate at {self.path}: {error}") from None
            except OSError as error:
                raise UnavailableError(f"lost the gate at {self.path}: {error}") from None
            if not chunk:
                raise ConnectionLost(
                    f"the gate at {self.path} closed the connection",
                    hint="it may have restarted; acknowledged deliveries are kept",
                )
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return decode(line)

    def request(self, message: dict[str, Any], timeout: float | None = 30.0) -> dict[str, Any]:
        """Send one request and receive its reply; a refusal is raised as its error."""
        from volutectl.wire.messages import ErrorReply

        self.send(message)
        reply = self.receive(timeout)
        if reply.get("ok") is False:
            ErrorReply.from_wire(reply).raise_it()
        return reply

    def close(self) -> None:
        self.sock.close()


# Pauses between tries to reach a gate that is restarting. A socket-activated gate's
# restart takes about a second; systemd holds the connections that arrive meanwhile, so
# a retry mostly waits in the socket's backlog, not here.
RETRY_FIRST_SECONDS = 0.05
RETRY_MAX_SECONDS = 1.0


def request_through_restarts(
    path: str,
    message: dict[str, Any],
    answer: Callable[[dict[str, Any]], T],
    timeout: float,
    out_of_time: Callable[[ConnectionLost | None], VoluteError],
    lost: ConnectionLost | None = None,
) -> tuple[Connection, T]:
    """Send `message` until the gate answers it; the connection and `answer(reply)`.

    A connection lost before the answer (EOF, ECONNRESET: the gate restarted or died) is
    tried again after a short backoff, and so is failing to connect after such a loss. A
    gate absent on the first try fails at once (69), unless `lost` says the caller lost
    it a moment ago. After `timeout` seconds in all, the
    error is `out_of_time(the last loss)`. deliver (the same request id, so nothing is
    queued twice) and wait (the ids not yet settled) both go through here."""
    deadline = time.monotonic() + timeout
    delay = RETRY_FIRST_SECONDS

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise out_of_time(lost)
        return remaining

    while True:
        try:
            connection = Connection(path, timeout=left())
        except UnavailableError:
            if lost is None:
                raise
        else:
            try:
                connection.send(message)
                return connection, answer(connection.receive(timeout=left()))
            except ConnectionLost as error:
                lost = error
                connection.close()
            except BaseException:
                connection.close()
                raise
        pause = min(delay, deadline - time.monotonic())
        if pause <= 0:
            raise out_of_time(lost)
        time.sleep(pause)
        delay = min(delay * 2, RETRY_MAX_SECONDS)
