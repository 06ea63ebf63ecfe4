"""`volutectl deliver --batch`: the checks of each line (volutectl/cli/batch.py), and the
command as a user runs it against a real socket (tests/unit/fake_gate.py's peer), so
that each test says both what it printed and exited with and what it sent, or that it
sent nothing."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_gate import FakeGate, remove_tree, short_socket_dir
from tests.unit.test_deliver_client import run
from volutectl.cli import batch
from volutectl.errors import DataError, UsageError
from volutectl.wire import messages, protocol

REQUEST_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = short_socket_dir()
    yield path
    remove_tree(path)


def lines(*objects: dict[str, Any] | str) -> bytes:
    return b"".join((o if isinstance(o, str) else json.dumps(o)).encode() + b"\n" for o in objects)


def results(*ids: int | tuple[str, int]) -> dict[str, Any]:
    """A DeliverResults: an int is an ack with that id, (error, code) a refusal."""
    return {
        "ok": True,
        "results": [
            {"ok": True, "id": one}
            if isinstance(one, int)
            else {"ok": False, "error": one[0], "code": one[1]}
            for one in ids
        ],
    }


# -- each line's checks --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b"", "line 4: blank"),
        (b"   \t", "line 4: blank"),
        (b"\xff{}", "line 4: not UTF-8 text"),
        (b'{"mind": "ada", "message": "hi"', "line 4: not a JSON object: Expecting ',' "),
        (b'{"mind": "ada"} {}', "line 4: not a JSON object: Extra data (column 17)"),
        (b'["ada", "hi"]', "line 4: a delivery is a JSON object, not an array"),
        (b'"ada"', "line 4: a delivery is a JSON object, not a string"),
        (b'{"message": "hi"}', "line 4: mind: missing"),
        (b'{"mind": "ada"}', "line 4: message: missing"),
        (b'{"mind": 7, "message": "hi"}', "line 4: mind: must be a string"),
        (b'{"mind": "a b", "message": "hi"}', "line 4: invalid mind name"),
        (b'{"mind": "ada", "message": "hi", "session": "no/slash"}', "line 4: invalid session"),
        (b'{"mind": "ada", "message": "hi", "session": null}', "line 4: session: missing"),
        (b'{"mind": "ada", "message": "hi", "interrupt": 1}', "line 4: interrupt: must be true"),
        (b'{"mind": "ada", "message": "hi", "request_id": "a b"}', "line 4: request_id:"),
        (b'{"mind": "ada", "message": "hi", "sesion": "x"}', "line 4: 'sesion': not a field"),
        (b'{"mind": "ada", "message": "hi", "wait": true}', "line 4: 'wait': not a field"),
        (b'{"mind": "ada", "message": ""}', "line 4: message: empty"),
        (b'{"mind": "ada", "message": "\\ud800"}', "line 4: message: holds an unpaired surrogate"),
        (b"[" * 100_000, "line 4: nested too deep"),
    ],
)
def test_a_bad_line_is_65_naming_the_line_and_the_field(raw: bytes, said: str) -> None:
    with pytest.raises(DataError) as caught:
        batch.check_line(4, raw)
    assert caught.value.exit_code == 65
    assert caught.value.message.startswith(said), caught.value.message
    assert caught.value.hint is not None and "nothing was queued" in caught.value.hint


def test_a_good_line_is_the_item_the_gate_would_decode() -> None:
    raw = b'{"mind":"ada","message":"hi \\u00e9","session":"chat","interrupt":true}'
    item = batch.check_line(1, raw)
    assert item == messages.DeliverItem("ada", "hi \u00e9", "chat", True, None)
    # The gate's own decoding of the same object, as one item of a request with items.
    decoded = messages.decode_request({"v": 1, "op": "deliver", "items": [json.loads(raw)]})
    assert isinstance(decoded, messages.DeliverManyRequest) and decoded.items == (item,)


def test_each_line_without_a_request_id_gets_its_own_and_a_given_one_is_kept() -> None:
    read = batch.read_batch(
        iter([b'{"mind":"a","message":"x"}\n', b'{"mind":"b","message":"x","request_id":"n-1"}'])
    )
    assert [line.number for line in read] == [1, 2]
    assert REQUEST_ID.fullmatch(read[0].item.request_id or "") and not read[0].given_id
    assert read[1].item.request_id == "n-1" and read[1].given_id


def test_a_request_id_twice_in_one_batch_is_65_naming_both_lines() -> None:
    raw = [b'{"mind":"a","message":"x","request_id":"r"}', b'{"mind":"b","message":"y"}'] * 2
    with pytest.raises(DataError, match=r"^line 3: request_id: 'r' is line 1's too"):
        batch.read_batch(iter(raw))


def test_more_than_1000_lines_is_65_at_line_1001() -> None:
    one = b'{"mind":"a","message":"x"}\n'
    assert len(batch.read_batch(iter([one] * messages.MAX_DELIVER_ITEMS))) == 1000
    with pytest.raises(DataError, match=r"^line 1001: a batch holds at most 1000") as caught:
        batch.read_batch(iter([one] * 5000))
    assert "split -l 1000" in (caught.value.hint or "")


def test_no_line_at_all_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="no deliveries"):
        batch.read_batch(iter([]))


def test_a_batch_over_one_request_line_is_65_naming_the_line_where_it_overflows() -> None:
    big = "x" * (1024 * 1024)  # 1 MiB: 8 of them fit a line, a 9th does not
    raw = [json.dumps({"mind": "a", "message": big}).encode()] * 10
    read = batch.read_batch(iter(raw[:8]))
    assert len(protocol.encode(batch.encoded(read))) <= protocol.MAX_LINE
    with pytest.raises(DataError, match=r"^line 9: the batch up to here is over"):
        batch.encoded(batch.read_batch(iter(raw)))


# -- the command, against a socket ----------------------------------------------------------


THREE = lines(
    {"mind": "ada", "message": "one"},
    {"mind": "bob", "message": "two", "session": "chat", "interrupt": True},
    {"mind": "cy", "message": "three", "request_id": "mine-1"},
)


def test_a_batch_is_one_request_and_prints_one_id_per_line_in_order(socket_dir: Path) -> None:
    with FakeGate(socket_dir / "gate.sock", [results(12, 10, 11)]) as gate:
        result = run("--batch", "--socket", str(gate.path), stdin=THREE)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"12\n10\n11\n"
    assert result.stderr == b""
    [request] = gate.requests
    assert gate.connections == 1
    items = request.pop("items")
    assert request == {"v": 1, "op": "deliver"}
    ids = [item.pop("request_id") for item in items]
    assert all(REQUEST_ID.fullmatch(i) for i in ids[:2]) and ids[0] != ids[1]
    assert ids[2] == "mine-1"
    assert items == [
        {"mind": "ada", "message": "one"},
        {"mind": "bob", "message": "two", "session": "chat", "interrupt": True},
        {"mind": "cy", "message": "three"},
    ]


def test_one_bad_line_refuses_the_batch_and_sends_nothing(socket_dir: Path) -> None:
    bad = THREE + lines({"mind": "ada", "mesage": "typo"}) + THREE
    with FakeGate(socket_dir / "gate.sock", [results(1)]) as gate:
        result = run("--batch", "--socket", str(gate.path), stdin=bad)
    assert result.returncode == 65, result.stderr
    assert result.stdout == b""
    assert result.stderr.decode().startswith("volutectl: line 4: 'mesage': not a field")
    assert gate.connections == 0 and gate.requests == []


@pytest.mark.parametrize(
    "args",
    [
        ["ada"],
        ["--message", "x"],
        ["--session", "chat"],
        ["-s", "main"],
        ["--interrupt"],
        ["--request-id", "r"],
    ],
)
def test_what_each_line_gives_is_a_usage_error_on_the_command_line(
    socket_dir: Path, args: list[str]
) -> None:
    with FakeGate(socket_dir / "gate.sock", [results(1)]) as gate:
        result = run("--batch", *args, "--socket", str(gate.path), stdin=THREE)
    assert result.returncode == 64, result.stderr
    assert b"from each line of stdin" in result.stderr
    assert gate.requests == []


def test_without_batch_a_mind_is_still_required(socket_dir: Path) -> None:
    result = run("--message", "x", "--socket", str(socket_dir / "none.sock"))
    assert result.returncode == 64
    assert b"the following arguments are required: mind" in result.stderr


def test_empty_stdin_is_64_and_sends_nothing(socket_dir: Path) -> None:
    with FakeGate(socket_dir / "gate.sock", [results(1)]) as gate:
        result = run("--batch", "--socket", str(gate.path), stdin=b"")
    assert result.returncode == 64, result.stderr
    assert gate.requests == []


def test_a_terminal_on_stdin_is_a_usage_error_not_a_wait(socket_dir: Path) -> None:
    controller, terminal = os.openpty()
    try:
        with FakeGate(socket_dir / "gate.sock", [results(1)]) as gate:
            result = run("--batch", "--socket", str(gate.path), stdin_fd=terminal)
    finally:
        os.close(controller)
        os.close(terminal)
    assert result.returncode == 64, result.stderr
    assert b"pipe them in" in result.stderr
    assert gate.connections == 0


def test_a_line_the_gate_refuses_prints_an_empty_line_and_exits_with_its_code(
    socket_dir: Path,
) -> None:
    """Unknown mind (67) on line 2, quota (75) on line 3: line 1 is queued; stdout keeps
    one line per input line; the exit code is the first refused line's."""
    reply = results(5, ("unknown mind 'bob'", 67), ("uid 1000 has 10000 deliveries", 75))
    with FakeGate(socket_dir / "gate.sock", [reply]):
        result = run("--batch", "--socket", str(socket_dir / "gate.sock"), stdin=THREE)
    assert result.returncode == 67, result.stderr
    assert result.stdout == b"5\n\n\n"
    err = result.stderr.decode()
    assert "line 2 (bob/chat): not queued: unknown mind 'bob'" in err
    assert "line 3 (cy/main): not queued: uid 1000 has 10000 deliveries" in err
    assert "2 of 3 deliveries not queued (first: line 2, exit 67)" in err


@pytest.mark.parametrize("lost", ["eof", "reset"])
def test_a_lost_connection_sends_the_same_batch_again(socket_dir: Path, lost: str) -> None:
    """Every item carries a request id, the same in each try: the gate answers a resend
    with the ids it queued the first time (already_queued), never a second row. Only a
    user's own id that was queued already is news on stderr."""
    again = {
        "ok": True,
        "results": [{"ok": True, "id": i, "already_queued": True} for i in (12, 10, 11)],
    }
    scripts: list[Any] = [lost, lost]
    with FakeGate(socket_dir / "gate.sock", [again], scripts=scripts) as gate:
        result = run("--batch", "--socket", str(gate.path), stdin=THREE)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"12\n10\n11\n"
    assert gate.connections == 3
    assert gate.requests[0] == gate.requests[1] == gate.requests[2]
    [said] = result.stderr.decode().splitlines()
    assert "line 3 (cy/main): request id mine-1 was queued already, as delivery 11" in said


def test_a_gate_that_answers_too_few_results_is_a_protocol_error(socket_dir: Path) -> None:
    with FakeGate(socket_dir / "gate.sock", [results(1, 2)]):
        result = run("--batch", "--socket", str(socket_dir / "gate.sock"), stdin=THREE)
    assert result.returncode == 76, result.stderr
    assert b"2 results for 3 deliveries" in result.stderr


def test_a_gate_before_items_is_said_to_be_too_old(socket_dir: Path) -> None:
    refusal = {"ok": False, "error": "mind: missing", "code": 65, "hint": None}
    with FakeGate(socket_dir / "gate.sock", [refusal]):
        result = run("--batch", "--socket", str(socket_dir / "gate.sock"), stdin=THREE)
    assert result.returncode == 65, result.stderr
    assert b"the gate is too old for deliver --batch" in result.stderr
    assert result.stdout == b""


def ended(delivery: int, code: int) -> dict[str, Any]:
    outcome = "ok" if code == 0 else "failed"
    return {
        "ok": True, "event": "turn_ended", "id": delivery, "turn_id": delivery,
        "outcome": outcome, "exit_status": code, "exit_code": code,
    }  # fmt: skip


@pytest.mark.parametrize(("codes", "expected"), [((0, 0, 0), 0), ((0, 3, 4), 3), ((0, 0, 9), 9)])
def test_wait_waits_for_every_one_and_exits_with_the_first_failures_code(
    socket_dir: Path, codes: tuple[int, int, int], expected: int
) -> None:
    # The events come in another order than the lines: the code is the first line's.
    events = [ended(11, codes[2]), ended(10, codes[1]), ended(12, codes[0])]
    scripts: list[Any] = [[results(12, 10, 11)], [{"ok": True, "ids": [12, 10, 11]}, *events]]
    with FakeGate(socket_dir / "gate.sock", [], scripts=scripts) as gate:
        result = run("--batch", "--wait", "--socket", str(gate.path), stdin=THREE)
    assert result.returncode == expected, result.stderr
    assert result.stdout == b"12\n10\n11\n"
    assert gate.requests[1] == {"v": 1, "op": "wait", "ids": [12, 10, 11], "progress": True}


def test_wait_with_a_refused_line_waits_for_the_others_and_exits_with_the_refusal(
    socket_dir: Path,
) -> None:
    reply = results(12, ("unknown mind 'bob'", 67), 11)
    scripts: list[Any] = [[reply], [{"ok": True, "ids": [12, 11]}, ended(11, 0), ended(12, 0)]]
    with FakeGate(socket_dir / "gate.sock", [], scripts=scripts) as gate:
        result = run("--batch", "--wait", "--socket", str(gate.path), stdin=THREE)
    assert result.returncode == 67, result.stderr
    assert result.stdout == b"12\n\n11\n"
    assert gate.requests[1]["ids"] == [12, 11]


def test_the_batch_path_imports_no_heavy_module(socket_dir: Path) -> None:
    import subprocess
    import sys

    from tests.unit.test_deliver_client import clean_environment

    path = str(socket_dir / "gate.sock")
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(' '.join(sorted(sys.modules)), file=sys.stderr))\n"
        "from volutectl.cli import main\n"
        f"main(['deliver', '--batch', '--socket', {path!r}])\n"
    )
    with FakeGate(socket_dir / "gate.sock", [results(12, 10, 11)]):
        result = subprocess.run(
            [sys.executable, "-c", script],
            input=THREE,
            capture_output=True,
            env=clean_environment(),
            timeout=60,
        )
    assert result.returncode == 0, result.stderr
    loaded = set(result.stderr.decode().split())
    assert "volutectl.cli.batch" in loaded
    heavy = {"click", "pydantic", "pydantic_settings", "typing", "dataclasses", "secrets", "random"}
    assert not heavy & loaded, sorted(heavy & loaded)


def test_one_delivery_does_not_load_the_batch_module(socket_dir: Path) -> None:
    import subprocess
    import sys

    from tests.unit.test_deliver_client import clean_environment

    path = str(socket_dir / "gate.sock")
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(' '.join(sorted(sys.modules)), file=sys.stderr))\n"
        "from volutectl.cli import main\n"
        f"main(['deliver', 'ada', '-m', 'hi', '--socket', {path!r}])\n"
    )
    with FakeGate(socket_dir / "gate.sock", [{"ok": True, "id": 7}]):
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, env=clean_environment(), timeout=60
        )
    assert result.returncode == 0, result.stderr
    assert "volutectl.cli.batch" not in result.stderr.decode().split()


@pytest.mark.serial
def test_a_gate_that_never_answers_is_75_and_says_when_sending_again_is_safe(
    socket_dir: Path,
) -> None:
    with FakeGate(socket_dir / "gate.sock", [], scripts=["eof"] * 1000) as gate:
        result = run("--batch", "--socket", str(gate.path), "--timeout", "1", stdin=THREE)
    assert result.returncode == 75, result.stderr
    assert result.stdout == b""
    err = result.stderr.decode()
    assert "did not acknowledge the batch within 1 s" in err
    assert "lines with a request_id of their own may be sent again safely" in err
    assert gate.connections >= 2
    assert all(request == gate.requests[0] for request in gate.requests)
