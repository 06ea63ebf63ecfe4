"""`volutectl deliver --batch`: many deliveries from JSON lines on stdin, checked whole,
queued in one request (one connection, one commit), one id per line in input order.

A fan-out (a chat message to 33 minds, a timer waking every mind) would otherwise start
one `volutectl deliver` process per mind. Here each line of stdin is one delivery, an
object with `mind` and `message`, and optionally `session`, `interrupt` and
`request_id`: the fields of one item of docs/protocol.md's "deliver with items".

- Every line is checked before anything is sent, by the code the gate decodes an item
  with (`DeliverRequest.decode`), and more: no field but those five, no blank line, no
  empty message, UTF-8 text, no request id twice, at most MAX_DELIVER_ITEMS lines and
  one request line (protocol.MAX_LINE) in all. One bad line refuses the batch (65,
  naming the line and the field) and nothing is sent.
- What needs the gate's settings (is the mind configured, is the message within
  gate.max_message_bytes) the gate checks for every item before it queues any: one
  item it refuses refuses the batch, and nothing is queued. The sender's quota (75) it
  decides item by item, as for a deliver of one: an item over it is refused alone.
  A refused line prints an empty line where its id would be and says why on stderr;
  the exit code is the first refused line's.
- Each line without a request id gets one made here, so sending the request again after
  a lost connection gives back the ids it queued, never a second row.

Imported by volutectl/cli/deliver.py only with --batch; as light as it (no click, no
pydantic, no config).
"""

from __future__ import annotations

import json
import os
import sys

from volutectl.cli import waiting
from volutectl.errors import EX_TEMPFAIL, DataError, UsageError, VoluteError, format_error
from volutectl.visible import visible
from volutectl.wire import messages, protocol
from volutectl.wire.messages import (
    MAX_DELIVER_ITEMS,
    DeliverItem,
    DeliverManyRequest,
    DeliverRequest,
    DeliverResult,
    DeliverResults,
    Event,
)
from volutectl.wire.records import kind_of

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: a fan-out's path
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import BinaryIO

# The fields of a line: an item of a deliver with items (messages.DeliverItem).
FIELDS = ("mind", "message", "session", "interrupt", "request_id")
LINE_HINT = (
    'each line is one delivery: {"mind": "NAME", "message": "TEXT"}, with optional '
    '"session", "interrupt" and "request_id"; nothing was queued'
)


class Line:
    """One checked line: its number (from 1), its item, and whether its request id was
    the user's (else it is made here, and a resend's already_queued is not news)."""

    __slots__ = ("given_id", "item", "number")

    def __init__(self, number: int, item: DeliverItem, given_id: bool) -> None:
        self.number = number
        self.item = item
        self.given_id = given_id

    def where(self) -> str:
        return f"line {self.number} ({self.item.mind}/{self.item.session})"


def check_line(number: int, raw: bytes) -> DeliverItem:
    """Line `number` of the batch as an item, or a DataError (65) naming the line and
    the field. Its request id is None if it gives none."""
    where = f"line {number}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _bad(f"{where}: not UTF-8 text (byte {error.start + 1})") from None
    if not text.strip():
        raise _bad(f"{where}: blank: a batch has one delivery on each line")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as error:  # its own "line 1" would be the wrong line
        raise _bad(f"{where}: not a JSON object: {error.msg} (column {error.colno})") from None
    except RecursionError:
        raise _bad(f"{where}: nested too deep") from None
    if not isinstance(obj, dict):
        raise _bad(f"{where}: a delivery is a JSON object, not {kind_of(obj)}")
    for key in obj:
        if key not in FIELDS:
            shown = key if len(key) <= 40 else f"{key[:40]}..."
            raise _bad(f"{where}: {shown!r}: not a field of a delivery")
    try:
        one = DeliverRequest.decode(obj)  # what the gate does with each item
    except DataError as error:
        raise _bad(f"{where}: {error.message}") from None
    if not one.message:
        raise _bad(f"{where}: message: empty (a turn is given its message; send a word)")
    try:
        one.message.encode("utf-8")  # as the gate's volutectl/gate/validate.py
    except UnicodeEncodeError:
        raise _bad(
            f"{where}: message: holds an unpaired surrogate (a \\ud800-\\udfff escape that "
            "pairs with nothing), not UTF-8 text"
        ) from None
    return DeliverItem(one.mind, one.message, one.session, one.interrupt, one.request_id)


def _bad(message: str) -> DataError:
    return DataError(message, hint=LINE_HINT)


def read_batch(lines: Iterable[bytes]) -> list[Line]:
    """Every line checked, each with a request id (the user's, or one made here); the
    first bad one refused (65). No line at all is a usage error (64)."""
    batch: list[Line] = []
    first_of: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        if number > MAX_DELIVER_ITEMS:
            raise DataError(
                f"line {number}: a batch holds at most {MAX_DELIVER_ITEMS} deliveries "
                "(one request, one commit)",
                hint=f"split the input, e.g. `split -l {MAX_DELIVER_ITEMS}`, and send each "
                "part; nothing was queued",
            )
        item = check_line(number, raw.removesuffix(b"\n"))
        given = item.request_id is not None
        if item.request_id is not None:
            if item.request_id in first_of:
                raise _bad(
                    f"line {number}: request_id: {item.request_id!r} is line "
                    f"{first_of[item.request_id]}'s too; each delivery needs its own"
                )
            first_of[item.request_id] = number
        else:
            item = DeliverItem(
                item.mind, item.message, item.session, item.interrupt, os.urandom(16).hex()
            )
        batch.append(Line(number, item, given))
    if not batch:
        raise UsageError(
            "no deliveries: --batch reads one JSON object per line on stdin, and it was empty"
        )
    return batch


def encoded(batch: list[Line]) -> dict[str, object]:
    """The request, within the bounds of one line (65 naming the line where it overflows)."""
    wire = DeliverManyRequest(tuple(line.item for line in batch)).to_wire()
    size = len(protocol.encode(wire))
    if size > protocol.MAX_LINE:
        raise DataError(
            f"line {_overflowing(batch)}: the batch up to here is over {protocol.MAX_LINE} "
            f"bytes as one request ({size} in all)",
            hint="split the input in smaller batches, or send large messages one by one; "
            "nothing was queued",
        )
    return wire


def _overflowing(batch: list[Line]) -> int:
    """The number of the line at which the request grows past protocol.MAX_LINE."""
    total = len(protocol.encode(DeliverManyRequest(()).to_wire()))
    for line in batch:
        total += len(json.dumps(line.item.to_wire(), separators=(",", ":"))) + 1
        if total > protocol.MAX_LINE:
            return line.number
    return batch[-1].number


def queued(path: str, wire: dict[str, object], count: int, timeout: float) -> DeliverResults:
    """Send the batch until the gate answers it, through restarts (the request ids make a
    resend safe); its results, one per line."""

    def answer(reply: dict[str, object]) -> DeliverResults:
        try:
            results = messages.expect(DeliverResults, reply)
        except VoluteError as error:
            if error.message.startswith("mind: missing"):  # it read a deliver of one
                raise VoluteError(
                    "the gate is too old for deliver --batch: it read the batch as one "
                    f"delivery ({error.message})",
                    hint="nothing was queued; upgrade volutectl where the gate runs, or "
                    "deliver one at a time",
                    exit_code=error.exit_code,
                ) from None
            raise
        if len(results.results) != count:
            raise protocol.ProtocolError(
                f"the gate answered {len(results.results)} results for {count} deliveries"
            )
        return results

    connection, results = protocol.request_through_restarts(
        path, wire, answer, timeout, lambda lost: _out_of_time(timeout, lost)
    )
    connection.close()
    return results


def _out_of_time(timeout: float, lost: protocol.ConnectionLost | None) -> VoluteError:
    why = f" (last: {lost.message})" if lost is not None else ""
    return VoluteError(
        f"the gate did not acknowledge the batch within {timeout:g} s{why}",
        hint="it may have been queued all the same (see `volutectl queue list`); lines with "
        "a request_id of their own may be sent again safely, the others would queue twice",
        exit_code=EX_TEMPFAIL,
    )


def report(batch: list[Line], results: DeliverResults) -> dict[int, int]:
    """Print each line's id on stdout (an empty line for one refused), and on stderr
    why each was refused and what else the gate said; the code of each refused line."""
    refused: dict[int, int] = {}
    out = []
    for line, result in zip(batch, results.results, strict=True):
        out.append("" if result.id is None or not result.ok else str(result.id))
        _say(line, result, refused)
    print("\n".join(out), flush=True)
    if refused:
        first = min(refused)
        others = "none was queued" if len(refused) == len(batch) else "the others are queued"
        print(
            f"volutectl: {len(refused)} of {len(batch)} deliveries not queued (first: line "
            f"{first}, exit {refused[first]}); {others}",
            file=sys.stderr,
            flush=True,
        )
    return refused


def _say(line: Line, result: DeliverResult, refused: dict[int, int]) -> None:
    reply = result.reply()
    if isinstance(reply, messages.ErrorReply):
        refused[line.number] = reply.code if 1 <= reply.code <= 255 else 1
        error = VoluteError(f"{line.where()}: not queued: {reply.error}", hint=reply.hint)
        print(format_error(error), file=sys.stderr, flush=True)
        return
    if reply.already_queued and line.given_id:
        print(
            f"volutectl: {visible(line.where())}: request id {visible(line.item.request_id or '')} "
            f"was queued already, as delivery {reply.id}; nothing new was queued",
            file=sys.stderr,
        )
    if reply.interrupt_refused:
        print(
            f"volutectl: {visible(line.where())}: interrupt refused: the running turn carries "
            "another user's delivery, so it goes on; the message is folded in as a plain "
            "delivery",
            file=sys.stderr,
        )


def exit_code(
    batch: list[Line], results: DeliverResults, refused: dict[int, int], events: dict[int, Event]
) -> int:
    """0 if every line was queued (and, waited for, ran with exit 0); else the code of the
    first line, in input order, that was not: its refusal's, or as `volutectl wait`."""
    for line, result in zip(batch, results.results, strict=True):
        if line.number in refused:
            return refused[line.number]
        if result.id is not None and result.id in events:
            code = waiting.exit_code((result.id,), events)
            if code:
                return code
    return 0


def batch_main(
    path: str, stream: BinaryIO, *, wait: bool, timeout: float, max_wait: float | None
) -> int:
    """`deliver --batch`: read and check stdin, queue it in one request, print the ids;
    with `wait`, wait for the ones queued."""
    if stream.isatty():
        raise UsageError("--batch reads JSON lines on stdin: pipe them in")
    batch = read_batch(stream)
    results = queued(path, encoded(batch), len(batch), timeout)
    refused = report(batch, results)
    events: dict[int, Event] = {}
    ids = tuple(dict.fromkeys(r.id for r in results.results if r.ok and r.id is not None))
    if wait and ids:
        events = waiting.settle(
            path,
            ids,
            timeout,
            None,
            waiting.report,
            max_wait=max_wait,
            on_attempt=waiting.report_attempt,
        )
    return exit_code(batch, results, refused, events)
