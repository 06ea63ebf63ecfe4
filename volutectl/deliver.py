"""`volutectl deliver`: the hot path, with nothing imported that it does not need.

`deliver` runs from cron-aligned timers and chat fan-outs, so `deliver_main`
parses its own arguments with argparse and imports neither click nor pydantic: it
finds the socket (flag, $VOLUTE_GATE__SOCKET, the config file's [gate] socket, the
default), sends one request and prints the id once the gate has committed the row.
The gate validates mind, session and size against its config; the client checks the
names too, so a typo fails before any I/O.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from volutectl import protocol
from volutectl.errors import EX_DATAERR, EX_TEMPFAIL, UnavailableError, UsageError, VoluteError

# Not `import typing`: this module is on deliver's hot path (~6 ms).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

DEFAULT_SOCKET = "/run/volute/gate.sock"
DEFAULT_CONFIG = "/etc/volute/volutectl.toml"
# Backoff between tries after the gate lost a connection before acknowledging it. A
# socket-activated gate's restart takes about a second; systemd holds the connections
# that arrive meanwhile, so a retry mostly waits in the socket's backlog, not here.
RETRY_FIRST_SECONDS = 0.05
RETRY_MAX_SECONDS = 1.0


def socket_path(explicit: str | None, config: str | None) -> str:
    """The gate socket: flag, env, config file, default (same precedence as config)."""
    if explicit:
        return explicit
    from_env = os.environ.get("VOLUTE_GATE__SOCKET")
    if from_env:
        return from_env
    path = config or os.environ.get("VOLUTE_CONFIG") or DEFAULT_CONFIG
    try:
        import tomllib

        with open(path, "rb") as handle:
            value = tomllib.load(handle).get("gate", {}).get("socket")
        if isinstance(value, str) and value:
            return value
    except FileNotFoundError:
        if config or os.environ.get("VOLUTE_CONFIG"):
            raise VoluteError(f"{path}: config file not found", exit_code=78) from None
    except PermissionError:
        pass
    except ValueError as error:  # TOMLDecodeError
        raise VoluteError(f"{path}: not valid TOML: {error}", exit_code=78) from None
    return DEFAULT_SOCKET


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise UsageError(f"deliver: {message}", hint="see: volutectl deliver --help")


def _deliver_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="volutectl deliver",
        description="Queue a message for MIND. Prints the delivery id once it is durably "
        "queued. Reads the message from stdin unless --message is given.",
    )
    parser.add_argument("mind")
    parser.add_argument("--session", "-s", default="main", help="session (default: main)")
    parser.add_argument("--message", "-m", help="the message (default: read stdin)")
    parser.add_argument(
        "--interrupt", action="store_true", help="interrupt the session's running turn"
    )
    parser.add_argument(
        "--wait", action="store_true", help="wait for the turn that carries it; exit with its code"
    )
    parser.add_argument("--socket", help=f"gate socket (default: {DEFAULT_SOCKET})")
    parser.add_argument("--config", help="config file, to find the socket")
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the ack, retrying while the gate restarts (default: 30)",
    )
    return parser


def deliver_main(argv: list[str]) -> int:
    args = _deliver_parser().parse_args(argv)
    from volutectl.names import NameError_, check_mind, check_session

    try:
        check_mind(args.mind)
        check_session(args.session)
    except NameError_ as error:
        raise VoluteError(str(error), exit_code=EX_DATAERR) from None
    if args.message is not None:
        message = args.message
        try:
            # Bytes that are not UTF-8 reach argv as lone surrogates; JSON would carry
            # them to the gate as text it cannot store.
            message.encode("utf-8")
        except UnicodeEncodeError:
            raise VoluteError("the --message is not UTF-8 text", exit_code=EX_DATAERR) from None
    else:
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("no message: pass --message TEXT or pipe it on stdin")
        raw = sys.stdin.buffer.read()
        if not raw:
            raise UsageError("no message: stdin was empty; pass --message TEXT or pipe it in")
        try:
            message = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise VoluteError(
                "the message on stdin is not UTF-8 text", exit_code=EX_DATAERR
            ) from None
    request_ = {
        "op": "deliver",
        "mind": args.mind,
        "session": args.session,
        "message": message,
        "interrupt": args.interrupt,
        "wait": args.wait,
        "request_id": os.urandom(16).hex(),
    }
    connection, reply = acknowledged(socket_path(args.socket, args.config), request_, args.timeout)
    try:
        delivery_id = reply.get("id")
        if type(delivery_id) is not int:
            raise protocol.ProtocolError(f"the gate acknowledged without a delivery id: {reply}")
        print(delivery_id, flush=True)
        if not args.wait:
            return 0
        event = protocol.raise_for_reply(connection.receive(timeout=None))
    finally:
        connection.close()
    kind = event.get("event")
    if kind == "turn_ended":
        if event.get("outcome") != "ok":
            print(
                f"volutectl: turn {event.get('turn_id')} {event.get('outcome')}: "
                f"exit status {event.get('exit_status')}",
                file=sys.stderr,
            )
        return int(event.get("exit_code", 1))
    if kind == "dead":
        print(f"volutectl: delivery {delivery_id} is dead: {event.get('error')}", file=sys.stderr)
        return 1
    if kind == "dropped":
        print(f"volutectl: delivery {delivery_id} was dropped", file=sys.stderr)
        return 1
    raise protocol.ProtocolError(f"unexpected reply from the gate: {event}")


def acknowledged(
    path: str, message: dict[str, Any], timeout: float
) -> tuple[protocol.Connection, dict[str, Any]]:
    """Send a deliver request until the gate acknowledges it; the connection and the ack.

    A connection lost before the ack (EOF, ECONNRESET: the gate restarted or died, maybe
    after committing the row) is retried with the same request id after a short backoff:
    the gate keeps request ids unique, so a retry gets the original delivery id back and
    nothing is queued twice. A gate that is absent on the first try (no socket file, or a
    refused connection) fails at once with 69. After a lost connection the gate was there
    a moment ago and the request may be queued, so failing to connect is retried too.
    Running out of `timeout` seconds is 75: the request may or may not have been queued.
    """
    deadline = time.monotonic() + timeout
    delay = RETRY_FIRST_SECONDS
    lost: protocol.ConnectionLost | None = None
    while True:
        try:
            connection = protocol.Connection(path, timeout=_left(deadline, timeout, lost))
        except UnavailableError:
            if lost is None:
                raise
        else:
            try:
                connection.send(message)
                reply = connection.receive(timeout=_left(deadline, timeout, lost))
                return connection, protocol.raise_for_reply(reply)
            except protocol.ConnectionLost as error:
                lost = error
                connection.close()
            except BaseException:
                connection.close()
                raise
        pause = min(delay, deadline - time.monotonic())
        if pause <= 0:
            raise _out_of_time(timeout, lost)
        time.sleep(pause)
        delay = min(delay * 2, RETRY_MAX_SECONDS)


def _left(deadline: float, timeout: float, lost: protocol.ConnectionLost | None) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _out_of_time(timeout, lost)
    return left


def _out_of_time(timeout: float, lost: protocol.ConnectionLost | None) -> VoluteError:
    why = f" (last: {lost.message})" if lost is not None else ""
    return VoluteError(
        f"the gate did not acknowledge the delivery within {timeout:g} s{why}",
        hint="it may have been queued all the same: see `volutectl queue list`",
        exit_code=EX_TEMPFAIL,
    )


def request(message: dict[str, Any], socket: str | None, config: str | None) -> dict[str, Any]:
    connection = protocol.Connection(socket_path(socket, config))
    try:
        return connection.request(message)
    finally:
        connection.close()
