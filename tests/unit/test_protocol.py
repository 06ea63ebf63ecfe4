"""The gate's wire protocol: JSON lines with a version, and the client's connection errors.

Connections go to real unix sockets: missing, stale (nobody listening), and without
permission for an unprivileged user.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.fake_gate import FakeGate, remove_tree, short_socket_dir
from volutectl.errors import (
    EX_DATAERR,
    EX_NOPERM,
    EX_PROTOCOL,
    EX_TEMPFAIL,
    EX_UNAVAILABLE,
    DataError,
    PermissionDeniedError,
    UnavailableError,
    VoluteError,
)
from volutectl.wire import messages, protocol
from volutectl.wire.messages import DeliverAck, ErrorReply
from volutectl.wire.protocol import ProtocolError


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = short_socket_dir()
    yield path
    remove_tree(path)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=protocol.INT_MIN, max_value=protocol.INT_MAX)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text().filter(lambda k: k != "v"), json_values, max_size=6)


@given(json_objects)
def test_encode_decode_round_trip_is_one_line(message: dict[str, Any]) -> None:
    line = protocol.encode(message)
    assert line.endswith(b"\n")
    assert b"\n" not in line[:-1]  # newlines in text are escaped: one request, one line
    assert protocol.decode(line[:-1]) == {"v": protocol.VERSION, **message}


def test_encode_carries_the_version() -> None:
    assert json.loads(protocol.encode({"op": "ping"})) == {"v": 1, "op": "ping"}


@pytest.mark.parametrize(
    "line",
    [
        b'{"op": "ping"}',
        b'{"v": 2, "op": "ping"}',
        b'{"v": "1", "op": "ping"}',
        b'{"v": true, "op": "ping"}',
        b'{"v": 1.0, "op": "ping"}',
        b'{"v": null}',
    ],
)
def test_decode_refuses_other_versions(line: bytes) -> None:
    with pytest.raises(ProtocolError, match="protocol version") as caught:
        protocol.decode(line)
    assert caught.value.exit_code == EX_PROTOCOL


@pytest.mark.parametrize("line", [b"[1, 2]", b'"deliver"', b"1", b"null", b"true"])
def test_decode_refuses_non_objects(line: bytes) -> None:
    with pytest.raises(ProtocolError, match="JSON object"):
        protocol.decode(line)


@pytest.mark.parametrize("line", [b"", b"{", b"{'v': 1}", b"\xff\xfe{", b'{"v": 1,}'])
def test_decode_refuses_bad_json(line: bytes) -> None:
    with pytest.raises(ProtocolError, match="not a JSON line"):
        protocol.decode(line)


def deep(levels: int, inner: bytes = b"1") -> bytes:
    return b"[" * levels + inner + b"]" * levels


@pytest.mark.parametrize(
    ("line", "start"),
    [
        (b'{"v":1,"op":"retry","ids":[1208925819614629174706176]}', "ids[0]: 120892581961"),
        (b'{"v":1,"ids":[1,9223372036854775808]}', "ids[1]: 9223372036854775808 is outside"),
        (b'{"v":1,"ids":[-9223372036854775809]}', "ids[0]: -9223372036854775809 is outside"),
        (b'{"v":1,"ids":[' + b"9" * 5000 + b"]}", "ids[0]: 999999999999...9999 (5000 digits)"),
        (b'{"v":1,"interrupt":NaN}', "interrupt: NaN is not a finite number"),
        (b'{"v":1,"wait":Infinity}', "wait: Infinity is not a finite number"),
        (b'{"v":1,"a":{"b":[-Infinity]}}', "a.b[0]: -Infinity is not a finite number"),
        (b'{"v":1,"x":1e400}', "x: inf is not a finite number"),
        (
            b'{"v":1,"x":' + deep(20) + b"}",
            "x[0][0][0][0][0][0][0][0][0][0][0][0][0][0][0]: nested",
        ),
        (b'{"v":1,"op":"ping","x":' + deep(200_000) + b"}", "x: nested deeper than 16 levels"),
        (b'{"v":1,"k\\"ey":' + deep(200_000) + b"}", 'k"ey: nested deeper than 16 levels'),
        (deep(200_000), "the request: nested deeper than 16 levels"),
    ],
)
def test_decode_refuses_what_the_gate_must_not_take_naming_the_field(
    line: bytes, start: str
) -> None:
    with pytest.raises(DataError) as caught:
        protocol.decode(line)
    assert caught.value.exit_code == EX_DATAERR
    assert caught.value.message.startswith(start), caught.value.message


def test_decode_takes_the_64_bit_extremes_and_shallow_nesting() -> None:
    line = b'{"v":1,"ids":[-9223372036854775808,9223372036854775807],"x":' + deep(14) + b"}"
    assert protocol.decode(line)["ids"] == [protocol.INT_MIN, protocol.INT_MAX]


BEYOND_64_BITS = st.integers(min_value=protocol.INT_MAX + 1) | st.integers(
    max_value=protocol.INT_MIN - 1
)


@given(st.text(min_size=1, max_size=10).filter(lambda k: k != "v"), BEYOND_64_BITS)
def test_every_integer_beyond_64_bits_is_refused_by_name(key: str, number: int) -> None:
    with pytest.raises(DataError) as caught:
        protocol.decode(json.dumps({"v": 1, key: [number]}).encode())
    assert caught.value.message.startswith(f"{key}[0]: ")


def test_an_error_reply_becomes_the_same_error_on_the_client() -> None:
    refusal = ErrorReply.of(DataError("message too big", hint="send a path"))
    reply = protocol.decode(protocol.encode(refusal.to_wire()))
    with pytest.raises(VoluteError) as caught:
        messages.expect(DeliverAck, reply)
    assert caught.value.message == "message too big"
    assert caught.value.hint == "send a path"
    assert caught.value.exit_code == EX_DATAERR


@pytest.mark.parametrize("code", ["x", None, True, [77]])
def test_a_malformed_error_code_is_a_protocol_error_not_a_crash(code: object) -> None:
    with pytest.raises(VoluteError) as caught:
        messages.expect(DeliverAck, {"ok": False, "error": "no", "code": code, "hint": 5})
    assert caught.value.exit_code == EX_PROTOCOL
    assert caught.value.hint is None


@pytest.mark.parametrize("code", [0, 300, -1])
def test_an_error_code_out_of_range_is_a_protocol_error(code: int) -> None:
    with pytest.raises(VoluteError) as caught:
        messages.expect(DeliverAck, {"ok": False, "error": "no", "code": code})
    assert caught.value.exit_code == EX_PROTOCOL


def test_an_ok_reply_passes_through() -> None:
    assert messages.expect(DeliverAck, {"v": 1, "ok": True, "id": 3}) == DeliverAck(3)


# -- connections ------------------------------------------------------------------------------


def test_missing_socket_is_unavailable_69_with_a_hint(socket_dir: Path) -> None:
    path = socket_dir / "gate.sock"
    with pytest.raises(UnavailableError) as caught:
        protocol.Connection(str(path))
    assert caught.value.exit_code == EX_UNAVAILABLE
    assert str(path) in caught.value.message
    assert caught.value.hint is not None and "volute-gate.service" in caught.value.hint


def test_stale_socket_file_is_unavailable_69(socket_dir: Path) -> None:
    path = socket_dir / "gate.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # the file stays; nobody will ever listen (a crashed gate)
    dead.close()
    assert path.is_socket()
    with pytest.raises(UnavailableError, match="refuses connections") as caught:
        protocol.Connection(str(path))
    assert caught.value.exit_code == EX_UNAVAILABLE


def test_a_regular_file_at_the_socket_path_is_unavailable(socket_dir: Path) -> None:
    path = socket_dir / "gate.sock"
    path.write_text("not a socket")
    with pytest.raises(UnavailableError) as caught:
        protocol.Connection(str(path))
    assert caught.value.exit_code == EX_UNAVAILABLE


def connect_as_nobody(path: Path) -> subprocess.CompletedProcess[str]:
    """Connect from a process that dropped root for nobody (65534) before connecting."""
    script = textwrap.dedent(
        f"""
        import os, sys
        from volutectl.wire import protocol
        from volutectl.errors import VoluteError
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        try:
            protocol.Connection({str(path)!r}, timeout=5).close()
        except VoluteError as error:
            print(type(error).__name__, error.message, error.hint, sep="|")
            sys.exit(error.exit_code)
        print("connected")
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a socket nobody can't use")
@pytest.mark.parametrize(("mode", "expected"), [(0o000, EX_NOPERM), (0o666, 0)])
def test_socket_without_permission_is_77_for_an_unprivileged_user(
    socket_dir: Path, mode: int, expected: int
) -> None:
    path = socket_dir / "gate.sock"
    with FakeGate(path, []):
        os.chmod(path, mode)
        result = connect_as_nobody(path)
    assert result.returncode == expected, result.stdout + result.stderr
    if expected:
        kind, message, hint = result.stdout.strip().split("|")
        assert kind == PermissionDeniedError.__name__
        assert str(path) in message
        assert "group" in hint
    else:
        assert result.stdout.strip() == "connected"


def test_request_round_trip_over_a_real_socket(socket_dir: Path) -> None:
    path = socket_dir / "gate.sock"
    # Two replies in one write, the second split over two: the client's buffer copes.
    replies = [b'{"v":1,"ok":true,"id":7}\n{"v":1,"ok":true,', b'"event":"x"}\n']
    with FakeGate(path, replies) as gate:
        connection = protocol.Connection(str(path), timeout=10)
        try:
            assert connection.request({"op": "deliver", "mind": "a"}) == {
                "v": 1,
                "ok": True,
                "id": 7,
            }
            assert connection.receive() == {"v": 1, "ok": True, "event": "x"}
        finally:
            connection.close()
    assert gate.requests == [{"v": 1, "op": "deliver", "mind": "a"}]


def test_request_raises_the_gates_refusal(socket_dir: Path) -> None:
    path = socket_dir / "gate.sock"
    refusal = {"ok": False, "error": "unknown mind 'x'", "hint": "add it", "code": 67}
    with FakeGate(path, [refusal]):
        connection = protocol.Connection(str(path), timeout=10)
        try:
            with pytest.raises(VoluteError, match="unknown mind") as caught:
                connection.request({"op": "deliver"})
        finally:
            connection.close()
    assert caught.value.exit_code == 67
    assert caught.value.hint == "add it"


def test_gate_closing_without_a_reply_is_unavailable(socket_dir: Path) -> None:
    path = socket_dir / "gate.sock"
    with FakeGate(path, []):
        connection = protocol.Connection(str(path), timeout=10)
        try:
            with pytest.raises(VoluteError, match="closed the connection") as caught:
                connection.request({"op": "ping"})
        finally:
            connection.close()
    assert caught.value.exit_code == EX_UNAVAILABLE
    assert caught.value.hint is not None and "acknowledged deliveries are kept" in caught.value.hint


def test_a_gate_that_never_answers_is_a_temporary_failure(socket_dir: Path) -> None:
    path = socket_dir / "gate.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)  # accepts (in the backlog) but never reads or answers
    try:
        connection = protocol.Connection(str(path), timeout=10)
        try:
            with pytest.raises(VoluteError, match="did not answer") as caught:
                connection.request({"op": "ping"}, timeout=0.2)
        finally:
            connection.close()
    finally:
        listener.close()
    assert caught.value.exit_code == EX_TEMPFAIL


# -- what one request may cost: protocol.check_cost, before the line is parsed ----------

IDS = b'{"v":1,"op":"wait","ids":['


def refusal_of(line: bytes, start: int = 0, *, partial: bool = False) -> str | None:
    try:
        protocol.check_cost(line, start, partial=partial)
    except DataError as error:
        assert error.exit_code == 65
        return error.message
    return None


def test_a_request_of_more_values_than_allowed_is_refused_before_parsing_naming_its_field() -> None:
    most = protocol.MAX_VALUES
    assert refusal_of(IDS + b"7," * (most - 10) + b"7]}") is None
    refused = refusal_of(IDS + b"1234567," * 1_000_000 + b"7]}")  # 8 MB, as the attack's
    values = "values (numbers, strings, arrays, objects)"
    assert refused == f"ids: a request holds at most {most} {values}, this one more"
    # Arrays, objects and strings count as much as numbers do.
    assert (refusal_of(b'{"v":1,"x":[' + b"[]," * most + b"1]}") or "").startswith("x: ")
    assert (refusal_of(b'{"v":1,"k\\"y":[' + b'"",' * most + b"1]}") or "").startswith("ky: ")
    assert (refusal_of(b"[" + b"{}," * most + b"1]") or "").startswith("the request: ")


def test_a_delivers_message_counts_as_one_value_whatever_it_holds() -> None:
    message = json.dumps(',[{"\\' * 100_000 + "\u00e9")
    line = b'{"v":1,"op":"deliver","mind":"m","message":' + message.encode() + b"}"
    assert refusal_of(line) is None
    assert refusal_of(line[: len(line) // 2], partial=True) is None  # still arriving
    # Values outside the message count, even behind it, and even in escaped keys.
    tail = b',"x\\\\":[' + b"1," * protocol.MAX_VALUES + b"1]}"
    assert (refusal_of(line[:-1] + tail) or "").startswith("x: ")  # escapes left out
    # Only from `start`: what comes before it is another, complete, line.
    assert refusal_of(b"[" + b"1," * 20_000 + b"1]\n" + line, start=40_004) is None


def test_each_items_message_counts_as_one_value_and_what_lies_between_them_counts() -> None:
    """A deliver with items holds a message per item: each is left out of the count as a
    deliver's one message is, so that messages full of commas fit; the values outside
    them, ids and names of 1,000 items included, still count."""
    message = json.dumps(",[{" * 50)  # 150 separators in each message
    item = b'{"mind":"m","message":' + message.encode() + b"}"
    line = b'{"v":1,"op":"deliver","items":[' + b",".join([item] * 1000) + b"]}"
    assert line.count(b",") > protocol.MAX_VALUES  # counted whole, it would be refused
    assert refusal_of(line) is None
    assert refusal_of(line[: len(line) // 2 + 7], partial=True) is None  # still arriving
    crowded = b',"x":[' + b"1," * protocol.MAX_VALUES + b"1]"
    assert (refusal_of(line[:-2] + crowded + b"]}") or "").startswith("x: ")


def test_a_deliver_with_items_is_bounded_and_refuses_whole_for_an_item_that_does_not_decode() -> (
    None
):
    items = [{"mind": "m", "message": "hi"}] * messages.MAX_DELIVER_ITEMS
    read = messages.decode_request({"v": 1, "op": "deliver", "items": items})
    assert isinstance(read, messages.DeliverManyRequest) and len(read.items) == 1000
    with pytest.raises(DataError, match="items: at most 1000 deliveries in one request, not 1001"):
        messages.decode_request({"v": 1, "op": "deliver", "items": [*items, items[0]]})
    bad = [items[0], {"mind": "../etc", "message": "hi"}]
    with pytest.raises(DataError, match=r"^items\[1\]: invalid mind name"):
        messages.decode_request({"v": 1, "op": "deliver", "items": bad})
    with pytest.raises(DataError, match="^wait: a deliver with items cannot wait"):
        messages.decode_request({"v": 1, "op": "deliver", "items": items[:1], "wait": True})
    # The one-delivery shape is read as it always was.
    one = messages.decode_request({"v": 1, "op": "deliver", "mind": "m", "message": "hi"})
    assert one == messages.DeliverRequest("m", "hi")
