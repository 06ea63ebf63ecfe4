"""Hostile and broken requests against the real gate loop: none may take it down.

Each bad request gets its exact reply code, and then the same Gate object, in this same
process, serves a good one (a delivery, committed and acknowledged), on the same
connection when the gate kept it open and on a new one. The gate runs in-process on
real sockets and a real SQLite file; systemd is tests/unit/fake_systemd.py.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.gate_harness import Harness
from volutectl import events
from volutectl.errors import (
    EX_DATAERR,
    EX_NOPERM,
    EX_NOUSER,
    EX_PROTOCOL,
    EX_SOFTWARE,
    EX_TEMPFAIL,
    EX_USAGE,
)
from volutectl.gate import handlers, loop
from volutectl.states import QueueState
from volutectl.wire import protocol
from volutectl.wire.messages import Reply, StatusRequest

NOT_DEAD = [QueueState.PENDING, QueueState.RUNNING, QueueState.DONE]


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    opened = Harness(tmp_path, max_message_bytes=1000)
    yield opened
    opened.close()


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def line(text: str) -> Callable[[Path], bytes]:
    return lambda _tmp: text.encode()


def register(path: Callable[[Path], str]) -> Callable[[Path], bytes]:
    return lambda tmp: b'{"v":1,"op":"register_repo","path":"%s"}' % path(tmp).encode()


def a_file(tmp: Path) -> str:
    (tmp / "file").write_text("x")
    return str(tmp / "file")


def not_git(tmp: Path) -> str:
    (tmp / "plain").mkdir()
    (tmp / "plain" / "HEAD").write_text("ref: refs/heads/main\n")
    return str(tmp / "plain")


def via_symlink_to_proc(tmp: Path) -> str:
    (tmp / "link").symlink_to("/proc/self/cwd")
    return str(tmp / "link")


D = "deliver"
BAD_REQUESTS: list[tuple[str, Callable[[Path], bytes], int, str]] = [
    # (name, the line, the reply code, how the reply's message starts)
    ("int beyond 2^80 in ids", line('{"v":1,"op":"retry","ids":[1208925819614629174706176]}'),
     EX_DATAERR, "ids[0]: "),
    ("int 2^63 in ids", line('{"v":1,"op":"drop","ids":[9223372036854775808]}'),
     EX_DATAERR, "ids[0]: 9223372036854775808 is outside"),
    ("int below -2^63", line('{"v":1,"op":"ping","n":-9223372036854775809}'),
     EX_DATAERR, "n: -9223372036854775809 is outside"),
    ("5000-digit int", line('{"v":1,"op":"retry","ids":[' + "7" * 5000 + "]}"),
     EX_DATAERR, "ids[0]: 777777777777...7777 (5000 digits)"),
    # 200,000 arrays: over the values a request may hold, refused before it is parsed.
    ("nested 200,000 deep", lambda _t: b'{"v":1,"op":"ping","x":' + deep(200_000) + b"}",
     EX_DATAERR, f"x: a request holds at most {protocol.MAX_VALUES} values"),
    ("a million ids", lambda _t: b'{"v":1,"op":"wait","ids":[' + b"1234567," * 999_999 + b"1]}",
     EX_DATAERR, f"ids: a request holds at most {protocol.MAX_VALUES} values"),
    ("1,001 ids in a wait", line('{"v":1,"op":"wait","ids":[' + "1," * 1000 + "1]}"),
     EX_DATAERR, "ids: at most 1000 deliveries in one wait, not 1001"),
    ("nested 40 deep", lambda _t: b'{"v":1,"op":"status","x":' + deep(40) + b"}",
     EX_DATAERR, "x[0][0]"),
    ("interrupt NaN", line(f'{{"v":1,"op":"{D}","mind":"mimsy","message":"m","interrupt":NaN}}'),
     EX_DATAERR, "interrupt: NaN is not a finite number"),
    ("wait Infinity", line(f'{{"v":1,"op":"{D}","mind":"mimsy","message":"m","wait":Infinity}}'),
     EX_DATAERR, "wait: Infinity is not a finite number"),
    ("-Infinity in ids", line('{"v":1,"op":"retry","ids":[-Infinity]}'),
     EX_DATAERR, "ids[0]: -Infinity is not a finite number"),
    ("1e400 overflows to inf", line('{"v":1,"op":"drop","ids":[1e400]}'),
     EX_DATAERR, "ids[0]: inf is not a finite number"),
    ("interrupt 1", line(f'{{"v":1,"op":"{D}","mind":"mimsy","message":"m","interrupt":1}}'),
     EX_DATAERR, "interrupt: must be true or false, not an integer"),
    ("interrupt null", line(f'{{"v":1,"op":"{D}","mind":"mimsy","message":"m","interrupt":null}}'),
     EX_DATAERR, "interrupt: must be true or false, not null"),
    ("wait yes", line(f'{{"v":1,"op":"{D}","mind":"mimsy","message":"m","wait":"yes"}}'),
     EX_DATAERR, "wait: must be true or false, not a string"),
    ("mind an integer", line(f'{{"v":1,"op":"{D}","mind":7,"message":"m"}}'),
     EX_DATAERR, "mind: must be a string, not an integer"),
    ("mind missing", line(f'{{"v":1,"op":"{D}","message":"m"}}'),
     EX_DATAERR, "mind: missing"),
    ("session an array", line(f'{{"v":1,"op":"{D}","mind":"mimsy","session":["s"],"message":"m"}}'),
     EX_DATAERR, "session: must be a string, not an array"),
    ("message an object", line(f'{{"v":1,"op":"{D}","mind":"mimsy","message":{{"a":1}}}}'),
     EX_DATAERR, "message: must be a string, not an object"),
    ("message missing", line(f'{{"v":1,"op":"{D}","mind":"mimsy"}}'),
     EX_DATAERR, "message: missing"),
    ("message not UTF-8", line(f'{{"v":1,"op":"{D}","mind":"mimsy","message":"\\udcff"}}'),
     EX_DATAERR, "message: the message for mimsy is not valid UTF-8"),
    ("message over the limit",
     line(f'{{"v":1,"op":"{D}","mind":"mimsy","message":"{"x" * 1001}"}}'),
     EX_DATAERR, "message: the message for mimsy is 1001 bytes, over the limit of 1000"),
    ("mind not a name", line(f'{{"v":1,"op":"{D}","mind":"../etc","message":"m"}}'),
     EX_DATAERR, "invalid mind name '../etc'"),
    ("unknown mind", line(f'{{"v":1,"op":"{D}","mind":"ghost","message":"m"}}'),
     EX_NOUSER, "unknown mind 'ghost'"),
    ("states a string", line('{"v":1,"op":"queue","states":"dead"}'),
     EX_DATAERR, "states: must be an array of state names, not a string"),
    ("states unknown", line('{"v":1,"op":"queue","states":["dead","asleep"]}'),
     EX_DATAERR, "states[1]: 'asleep' is not one of"),
    ("states holds an object", line('{"v":1,"op":"queue","states":[{}]}'),
     EX_DATAERR, "states[0]: an object is not one of"),
    ("limit zero", line('{"v":1,"op":"queue","limit":0}'),
     EX_DATAERR, "limit: 0 is not between 1 and 10000"),
    ("limit over the most", line('{"v":1,"op":"queue","limit":10001}'),
     EX_DATAERR, "limit: 10001 is not between 1 and 10000"),
    ("limit a string", line('{"v":1,"op":"queue","limit":"5"}'),
     EX_DATAERR, "limit: must be an integer, not a string"),
    ("limit a boolean", line('{"v":1,"op":"queue","limit":true}'),
     EX_DATAERR, "limit: must be an integer, not a boolean"),
    ("ids a string", line('{"v":1,"op":"retry","ids":"1"}'),
     EX_DATAERR, "ids: must be an array of delivery ids, not a string"),
    ("ids missing", line('{"v":1,"op":"drop"}'),
     EX_DATAERR, "ids: must be an array of delivery ids, not null"),
    ("ids holds a boolean", line('{"v":1,"op":"retry","ids":[true]}'),
     EX_DATAERR, "ids[0]: a delivery id is an integer, not a boolean"),
    ("ids holds a float", line('{"v":1,"op":"retry","ids":[1.5]}'),
     EX_DATAERR, "ids[0]: a delivery id is an integer, not a number"),
    ("ids holds zero", line('{"v":1,"op":"drop","ids":[3,0]}'),
     EX_DATAERR, "ids[1]: delivery ids start at 1, not 0"),
    ("ids holds a negative", line('{"v":1,"op":"drop","ids":[-4]}'),
     EX_DATAERR, "ids[0]: delivery ids start at 1, not -4"),
    ("unknown op", line('{"v":1,"op":"frobnicate"}'), EX_USAGE, "op: unknown request 'frobnicate'"),
    ("missing op", line('{"v":1}'), EX_DATAERR, "op: missing"),
    ("op an array", line('{"v":1,"op":["ping"]}'), EX_DATAERR, "op: must be a string, not an"),
    ("version 2", line('{"v":2,"op":"ping"}'), EX_PROTOCOL, "protocol version 2 is not 1"),
    ("version missing", line('{"op":"ping"}'), EX_PROTOCOL, "protocol version None is not 1"),
    ("version true", line('{"v":true,"op":"ping"}'), EX_PROTOCOL, "protocol version True"),
    ("not JSON", line("deliver mimsy hello"), EX_PROTOCOL, "not a JSON line"),
    ("cut-off JSON", line('{"v":1,"op":"ping"'), EX_PROTOCOL, "not a JSON line"),
    ("not UTF-8", lambda _t: b'{"v":1,"op":"\xff\xfe"}', EX_PROTOCOL, "not a JSON line"),
    ("an empty line", line(""), EX_PROTOCOL, "not a JSON line"),
    ("JSON array", line('[{"v":1,"op":"ping"}]'), EX_PROTOCOL, "a request must be a JSON object"),
    ("JSON string", line('"ping"'), EX_PROTOCOL, "a request must be a JSON object"),
    ("register /", register(lambda _t: "/"), EX_DATAERR, "path: / is not a git common directory"),
    ("register /proc/self", register(lambda _t: "/proc/self"), EX_DATAERR,
     "path: /proc/self is under /proc"),
    ("register /sys", register(lambda _t: "/sys/kernel"), EX_DATAERR, "path: /sys/kernel is under"),
    ("register /dev/shm", register(lambda _t: "/dev/shm"), EX_DATAERR, "path: /dev/shm is under"),
    ("register a symlink to /proc", register(via_symlink_to_proc), EX_DATAERR, "path: "),
    ("register a file", register(a_file), EX_DATAERR, "path: "),
    ("register a non-git dir", register(not_git), EX_DATAERR, "path: "),
    ("register nothing there", register(lambda t: str(t / "gone")), EX_DATAERR, "path: "),
    ("register a relative path", register(lambda _t: "repo/.git"), EX_DATAERR,
     "path: 'repo/.git' is relative"),
    ("register a NUL", register(lambda _t: "/srv/\\u0000"), EX_DATAERR, "path: contains a NUL"),
    ("register no path", line('{"v":1,"op":"register_repo"}'), EX_DATAERR, "path: missing"),
    ("register path a number", line('{"v":1,"op":"register_repo","path":5}'), EX_DATAERR,
     "path: must be a string, not an integer"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("make_line", "code", "start"),
    [pytest.param(make, code, start, id=name) for name, make, code, start in BAD_REQUESTS],
)
def test_a_bad_request_gets_its_code_and_the_same_gate_serves_the_next(
    harness: Harness, tmp_path: Path, make_line: Callable[[Path], bytes], code: int, start: str
) -> None:
    gate, pid = harness.gate, os.getpid()
    peer = harness.connect()
    reply = peer.request(make_line(tmp_path))
    assert reply["ok"] is False
    assert (reply["code"], reply["error"][: len(start)]) == (code, start), reply
    assert harness.journal.messages("error") == []  # a refusal, not a failure of the gate
    # The same connection, and a new one, are served by the same gate, in this process.
    first = harness.deliver_ok(peer)
    assert harness.deliver_ok() == first + 1
    assert harness.gate is gate and os.getpid() == pid
    assert len(gate.state.store.list_rows(NOT_DEAD)) == 2


def test_at_least_thirty_bad_requests_are_tried() -> None:
    assert len(BAD_REQUESTS) >= 30
    assert len({name for name, *_ in BAD_REQUESTS}) == len(BAD_REQUESTS)


def test_an_oversized_line_is_refused_and_its_connection_closed(harness: Harness) -> None:
    peer = harness.connect()
    chunk = b'{"v":1,"op":"deliver","mind":"mimsy","message":"' + b"x" * (1 << 20)
    sent = 0
    while sent <= protocol.MAX_LINE and not peer.closed_by_gate():
        try:
            sent += peer.sock.send(chunk)
        except BlockingIOError:
            harness.step(0.01)
        except (BrokenPipeError, ConnectionResetError):
            break
    harness.pump(lambda: peer.has_line() or peer.eof)
    reply = peer.reply()
    assert (reply["code"], reply["error"], reply["hint"]) == (
        EX_DATAERR,
        f"request too large: a line holds at most {protocol.MAX_LINE} bytes",
        "a message holds at most 1000 bytes (gate.max_message_bytes)",
    )
    harness.pump(peer.closed_by_gate)
    harness.deliver_ok()


@pytest.mark.serial
def test_a_million_newlines_are_answered_without_stalling_the_gate(harness: Harness) -> None:
    flood = harness.connect()
    started = time.monotonic()
    # A million empty requests, each refused (76), none of the refusals read: the gate
    # takes them a pass at a time, and drops the client once a MiB of refusals is
    # waiting for it (the send may have finished by then, or be cut off).
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        flood.send(b"\n" * 1_000_000)
    harness.pump(flood.closed_by_gate, timeout=5)
    assert time.monotonic() - started < 5
    assert harness.gate.server.backlog == {}
    other = harness.connect()
    assert other.request({"op": "ping"}, timeout=10) == {"v": 1, "ok": True}
    harness.deliver_ok()


def test_a_failure_inside_a_request_ends_only_that_client_and_is_logged_once(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_status(*args: object) -> Reply:
        raise RuntimeError("status is broken")

    monkeypatch.setitem(handlers.HANDLERS, StatusRequest, broken_status)
    waiting = harness.connect()
    waiting.send(b'{"v":1,"op":"ping"')  # a partial request, from a bystander
    peer = harness.connect()
    reply = peer.request({"op": "status"})
    assert (reply["code"], reply["error"]) == (
        EX_SOFTWARE,
        "internal error in the gate while handling a status request",
    )
    harness.pump(peer.closed_by_gate)
    errors = harness.journal.messages("error")
    assert len(errors) == 1
    [failure] = harness.journal.of(events.InternalError)
    assert (failure.exception, failure.error) == ("RuntimeError", "status is broken")
    # The bystander and a newcomer are still served.
    waiting.send(b"}\n")
    assert waiting.reply() == {"v": 1, "ok": True}
    harness.deliver_ok()
    assert len(harness.journal.messages("error")) == 1


def test_a_failure_while_reading_ends_only_that_client(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_decode = protocol.decode

    def decode(line: bytes) -> dict[str, object]:
        if b"poison" in line:
            raise KeyError("poison")
        return real_decode(line)

    monkeypatch.setattr(protocol, "decode", decode)
    peer = harness.connect()
    reply = peer.request(b'{"v":1,"op":"ping","poison":1}')
    assert (reply["code"], reply["error"]) == (
        EX_SOFTWARE,
        "internal error in the gate while reading a request",
    )
    harness.pump(peer.closed_by_gate)
    assert len(harness.journal.messages("error")) == 1
    [failure] = harness.journal.of(events.InternalError)
    assert (failure.exception, failure.error) == ("KeyError", "'poison'")
    harness.deliver_ok()


def test_a_full_disk_refuses_every_delivery_of_the_batch_and_acknowledges_none(
    harness: Harness,
) -> None:
    first = harness.deliver_ok()
    store = harness.gate.state.store
    assert store is not None
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's view of a full disk
    peers = [harness.connect() for _ in range(3)]
    big = b'{"v":1,"op":"deliver","mind":"mimsy","message":"' + b"y" * 900 + b'"}\n'
    # Deliveries enough that the batch cannot fit; all in one batch of the pass.
    each = loop.REQUEST_BATCH // len(peers)
    for peer in peers:
        peer.send(big * each)
    replies = [peer.reply() for peer in peers for _ in range(each)]
    assert {(r["ok"], r["code"]) for r in replies} == {(False, EX_TEMPFAIL)}
    assert all("database or disk is full" in r["error"] for r in replies), replies[0]
    assert [row.id for row in store.list_rows(NOT_DEAD)] == [first]
    assert len(harness.journal.messages("error")) == 1
    [refusal] = harness.journal.of(events.DeliveriesNotStored)  # nothing acknowledged
    # Space returns: the same gate takes deliveries again, on the same connections too.
    store.db.execute(f"PRAGMA max_page_count = {pages * 1000}")
    assert harness.deliver_ok(peers[0]) > first
    assert harness.deliver_ok() > first


def test_a_failing_store_in_retry_is_temporary_not_a_crash(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:

    def locked(ids: list[int]) -> list[int]:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(harness.gate.state.store, "retry", locked)
    reply = harness.connect().request({"op": "retry", "ids": [1]})
    assert (reply["code"], reply["error"]) == (
        EX_TEMPFAIL,
        "retry: the queue failed: database is locked",
    )
    harness.deliver_ok()


def test_register_repo_refusals_past_a_bound_or_where_the_gate_may_not_look(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the registry's bound: 75, nothing kept. A repository the gate may not enter
    (run unprivileged): 77, and `status` lists it with why."""
    from volutectl.kernel import pathwalk
    from volutectl.slots import watch

    git = tmp_path / "repo" / ".git"
    for name in ("objects", "refs"):
        (git / name).mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    peer = harness.connect()
    register = {"op": "register_repo", "path": str(git)}
    monkeypatch.setattr(watch, "MAX_REPOSITORIES", 0)
    reply = peer.request(register)
    assert (reply["ok"], reply["code"]) == (False, EX_TEMPFAIL)
    assert "0 repositories registered" in reply["error"]
    monkeypatch.undo()
    real_open = pathwalk.open_directory

    def no_entry(path: object, **kwargs: Any) -> int:
        if str(path).startswith(str(tmp_path / "repo")):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pathwalk, "open_directory", no_entry)
    reply = peer.request(register)
    assert (reply["ok"], reply["code"]) == (False, EX_NOPERM)
    assert reply["error"] == f"path: the gate cannot watch {git}: permission denied"
    [entry] = peer.request({"op": "status"})["status"]["test_runs"]
    assert (entry["repository"], entry["slots_held"], entry["problem"]) == (
        str(git),
        None,
        "permission denied",
    )
    monkeypatch.undo()
    assert peer.request(register) == {"v": 1, "ok": True, "new": True}
    harness.deliver_ok(peer)
