"""The gate's socket protocol: one JSON object per line, each with a version field.

Kept free of heavy imports: `volutectl deliver` loads this module and nothing else of
ours but the errors table. Validation happens here, at the edge, on both sides.
"""

from __future__ import annotations

import json
import socket

from volutectl.errors import (
    EX_DATAERR,
    EX_NOPERM,
    EX_PROTOCOL,
    EX_TEMPFAIL,
    PermissionDeniedError,
    UnavailableError,
    VoluteError,
)

# Not `import typing`: this module is on deliver's hot path (~6 ms).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

VERSION = 1
# A line may carry a 1 MiB message JSON-escaped (up to 6 bytes per byte) plus fields.
MAX_LINE = 8 * 1024 * 1024 + 4096
OPS = ("deliver", "status", "queue", "retry", "drop", "ping")


class ProtocolError(VoluteError):
    exit_code = EX_PROTOCOL


class ConnectionLost(UnavailableError):
    """The gate went away after the connection was made: EOF, ECONNRESET or EPIPE.

    Unlike a socket that is missing or refuses connections (the gate is absent), this is
    what a gate restarting or dying mid-request looks like, and a request carrying a
    request id may be sent again."""


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps({"v": VERSION, **message}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError) as error:
        raise ProtocolError(f"not a JSON line: {error}") from None
    if not isinstance(value, dict):
        raise ProtocolError("a request must be a JSON object")
    version = value.get("v")
    # `type(...) is int`: in Python true == 1 and 1.0 == 1, but neither is version 1.
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"protocol version {version!r} is not {VERSION}")
    return value


def error_reply(error: VoluteError) -> dict[str, Any]:
    return {"ok": False, "error": error.message, "hint": error.hint, "code": error.exit_code}


def raise_for_reply(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("ok"):
        return reply
    code = reply.get("code", EX_DATAERR)
    hint = reply.get("hint")
    raise VoluteError(
        str(reply.get("error", "the gate refused the request")),
        hint=hint if isinstance(hint, str) else None,
        # A malformed code must not turn a refusal into a traceback.
        exit_code=code if type(code) is int and 1 <= code <= 255 else EX_PROTOCOL,
    )


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

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.sock.sendall(encode(message))
        except (BrokenPipeError, ConnectionResetError) as error:
            raise ConnectionLost(f"lost the gate at {self.path}: {error}") from None
        except TimeoutError:
            raise VoluteError(
                f"the gate at {self.path} did not take the request in time", exit_code=EX_TEMPFAIL
            ) from None
        except OSError as error:
            raise UnavailableError(f"lost the gate at {self.path}: {error}") from None

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
        self.send(message)
        return raise_for_reply(self.receive(timeout))

    def close(self) -> None:
        self.sock.close()
