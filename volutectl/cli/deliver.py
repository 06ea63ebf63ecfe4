"""`volutectl deliver`: the hot path, with nothing imported that it does not need.

`deliver` runs from cron-aligned timers and chat fan-outs, so `deliver_main`
parses its own arguments with argparse and imports neither click nor pydantic: it
finds the socket (flag, $VOLUTE_GATE__SOCKET, the config file's [gate] socket, the
default: a client may not read the config, an admin's, and needs not), sends one
request and prints the id once the gate has committed the row. The gate validates
mind, session and size against its config; the client checks the names too, so a typo
fails before any I/O.
"""

from __future__ import annotations

import argparse
import os
import sys

from volutectl.cli import waiting
from volutectl.errors import EX_DATAERR, EX_TEMPFAIL, UsageError, VoluteError
from volutectl.names import NameError_, check_mind, check_request_id, check_session
from volutectl.wire import messages, protocol
from volutectl.wire.messages import DeliverAck, DeliverRequest, Request

# Not `import typing`: this module is on deliver's hot path (~6 ms).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypeVar

    R = TypeVar("R", bound=messages.Reply)

DEFAULT_SOCKET = "/run/volute/gate.sock"
DEFAULT_CONFIG = "/etc/volute/volutectl.toml"


def socket_path(explicit: str | None, config: str | None) -> str:
    """The gate socket: flag, env, config file, default (same precedence as config). A
    config this user may not read (root:volute-admin 0640: a client's case) is skipped."""
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
        usage="%(prog)s [options] MIND\n       %(prog)s --batch [options] < JSON-LINES",
        description="Queue a message for MIND. Prints the delivery id once it is durably "
        "queued. Reads the message from stdin unless --message is given. With --batch, "
        "no MIND: each line of stdin is one delivery.",
    )
    parser.add_argument("mind", nargs="?", metavar="MIND")
    parser.add_argument("--session", "-s", help="session (default: main)")
    parser.add_argument("--message", "-m", help="the message (default: read stdin)")
    parser.add_argument(
        "--interrupt",
        action="store_true",
        help="interrupt the session's running turn, if every delivery it runs is yours (an "
        "admin's may interrupt any); else the message folds in as a plain delivery",
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help="wait until the delivery settles, saying on stderr each attempt that failed; "
        "exit with the code of the turn that settled it (with --batch: wait for every one; "
        "exit 0 if each ran, else the code of the first line that did not)",
    )
    parser.add_argument(
        "--max-wait",
        type=_seconds,
        metavar="SECONDS",
        help="with --wait: stop waiting after SECONDS and exit 75 (the delivery goes on)",
    )
    parser.add_argument(
        "--request-id",
        metavar="ID",
        help="a name for this request, kept unique per user: sent again (say after exit "
        "75), it gives back the delivery it queued instead of a second one",
    )
    parser.add_argument(
        "--batch",
        action="store_true",
        help='read one delivery per line of stdin, a JSON object: {"mind": ..., "message": '
        '...}, optional "session", "interrupt", "request_id"; check every line (one bad: '
        "65, nothing queued), queue them in one request and print one id per line, in order",
    )
    parser.add_argument("--socket", help=f"gate socket (default: {DEFAULT_SOCKET})")
    parser.add_argument("--config", help="config file, to find the socket")
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds the gate may take to acknowledge, retrying while it restarts; with "
        "--wait, also to answer again after a restart (default: 30)",
    )
    return parser


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds above 0")
    return value


def deliver_main(argv: list[str]) -> int:
    args = _deliver_parser().parse_args(argv)
    if args.max_wait is not None and not args.wait:
        raise UsageError("--max-wait needs --wait", hint="see: volutectl deliver --help")
    if args.batch:
        return _batch(args)
    _check_names(args)
    message = _message(args.message)
    request_id = args.request_id or os.urandom(16).hex()
    request_ = DeliverRequest(
        args.mind, message, args.session, args.interrupt, args.wait, request_id, args.wait
    )
    path = socket_path(args.socket, args.config)
    connection, ack = acknowledged(path, request_, args.timeout)
    try:
        print(ack.id, flush=True)
        if ack.already_queued and args.request_id is not None:
            print(
                f"volutectl: request id {args.request_id} was queued already, as delivery "
                f"{ack.id}; nothing new was queued",
                file=sys.stderr,
                flush=True,
            )
        if ack.interrupt_refused:
            print(
                f"volutectl: interrupt refused: the running turn of {args.mind}/{args.session} "
                "carries another user's delivery, so it goes on; the message is folded in "
                "as a plain delivery",
                file=sys.stderr,
                flush=True,
            )
    except BaseException:
        connection.close()
        raise
    if not args.wait:
        connection.close()
        return 0
    # The event comes on this connection; after a gate restart, on a new one (`wait`).
    events = waiting.settle(
        path,
        (ack.id,),
        args.timeout,
        connection,
        waiting.report,
        max_wait=args.max_wait,
        on_attempt=waiting.report_attempt,
    )
    return waiting.exit_code((ack.id,), events)


def _check_names(args: argparse.Namespace) -> None:
    """MIND is given (with no --batch), and its names are names; the session defaults."""
    if args.mind is None:
        raise UsageError(
            "deliver: the following arguments are required: mind",
            hint="see: volutectl deliver --help",
        )
    if args.session is None:
        args.session = "main"
    try:
        check_mind(args.mind)
        check_session(args.session)
        if args.request_id is not None:
            check_request_id(args.request_id)
    except NameError_ as error:
        raise VoluteError(str(error), exit_code=EX_DATAERR) from None


# What a line of --batch gives: with --batch, these options (and MIND) are usage errors.
PER_LINE = (
    ("mind", "MIND"),
    ("message", "--message"),
    ("session", "--session"),
    ("interrupt", "--interrupt"),
    ("request_id", "--request-id"),
)


def _batch(args: argparse.Namespace) -> int:
    given = [name for field, name in PER_LINE if getattr(args, field) not in (None, False)]
    if given:
        raise UsageError(
            f"--batch takes {', '.join(given)} from each line of stdin, not the command line",
            hint='each line: {"mind": "NAME", "message": "TEXT", "session": "S"}',
        )
    from volutectl.cli.batch import batch_main  # only for a batch: the hot path stays light

    if sys.stdin is None:
        raise UsageError("--batch reads JSON lines on stdin, and there is none")
    path = socket_path(args.socket, args.config)
    return batch_main(
        path, sys.stdin.buffer, wait=args.wait, timeout=args.timeout, max_wait=args.max_wait
    )


# One rule for both paths: an empty message is refused (64), from --message as from
# stdin. A turn is given its message; an empty one is a script's bug (an unset variable,
# a unit whose stdin is /dev/null), not something to wake a mind for.
EMPTY_MESSAGE = "no message: the message is empty"
EMPTY_HINT = (
    "pass --message TEXT or pipe it on stdin; to wake a mind, send a word: --message heartbeat"
)


def _message(given: str | None) -> str:
    """The message: --message, else stdin; UTF-8 text either way, never empty."""
    if given == "":
        raise UsageError(EMPTY_MESSAGE, hint=EMPTY_HINT)
    if given is not None:
        try:
            # Bytes that are not UTF-8 reach argv as lone surrogates; JSON would carry
            # them to the gate as text it cannot store.
            given.encode("utf-8")
        except UnicodeEncodeError:
            raise VoluteError("the --message is not UTF-8 text", exit_code=EX_DATAERR) from None
        return given
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no message: pass --message TEXT or pipe it on stdin")
    raw = sys.stdin.buffer.read()
    if not raw:
        raise UsageError(f"{EMPTY_MESSAGE} (stdin was empty)", hint=EMPTY_HINT)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise VoluteError("the message on stdin is not UTF-8 text", exit_code=EX_DATAERR) from None


def acknowledged(
    path: str, message: DeliverRequest, timeout: float
) -> tuple[protocol.Connection, DeliverAck]:
    """Send a deliver request until the gate acknowledges it; the connection and the ack.

    A connection lost before the ack (EOF, ECONNRESET: the gate restarted or died, maybe
    after committing the row) is retried with the same request id after a short backoff:
    the gate keeps request ids unique, so a retry gets the original delivery id back and
    nothing is queued twice. A gate that is absent on the first try (no socket file, or a
    refused connection) fails at once with 69. After a lost connection the gate was there
    a moment ago and the request may be queued, so failing to connect is retried too.
    Running out of `timeout` seconds is 75: the request may or may not have been queued.
    """
    return protocol.request_through_restarts(
        path,
        message.to_wire(),
        lambda reply: messages.expect(DeliverAck, reply),
        timeout,
        lambda lost: _out_of_time(timeout, lost),
    )


def _out_of_time(timeout: float, lost: protocol.ConnectionLost | None) -> VoluteError:
    why = f" (last: {lost.message})" if lost is not None else ""
    return VoluteError(
        f"the gate did not acknowledge the delivery within {timeout:g} s{why}",
        hint="it may have been queued all the same: see `volutectl queue list`",
        exit_code=EX_TEMPFAIL,
    )


def call(request_: Request[R], reply: type[R], socket: str | None, config: str | None) -> R:
    """One request to the gate, and its reply as `reply` (a refusal is raised)."""
    connection = protocol.Connection(socket_path(socket, config))
    try:
        connection.send(request_.to_wire())
        return messages.expect(reply, connection.receive())
    finally:
        connection.close()
