"""The faces of `volutectl pause`, `resume` and `wait` (volutectl/cli/client.py): what each
sends, what it prints, how it exits, and the arguments refused before any I/O. The
gate is a scripted peer on a real socket (tests/unit/fake_gate.py); the gate's side of
these ops is tests/unit/test_gate_pause.py and test_gate_wait.py."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_gate import FakeGate, remove_tree, short_socket_dir
from tests.unit.test_deliver_client import clean_environment
from volutectl.wire.messages import MAX_WAIT_IDS

VOLUTECTL = Path(sys.executable).parent / "volutectl"


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = short_socket_dir()
    yield path
    remove_tree(path)


def volutectl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VOLUTECTL), *args],
        capture_output=True,
        text=True,
        env=clean_environment(),
        timeout=60,
    )


def pause_reply(changed: list[str], paused: dict[str, float]) -> dict[str, Any]:
    pauses = [{"mind": mind, "since": since} for mind, since in paused.items()]
    return {"ok": True, "changed": changed, "paused": pauses}


def test_pause_names_the_minds_and_says_which_were_paused_already(socket_dir: Path) -> None:
    hour_ago = time.time() - 3725
    reply = pause_reply(["m"], {"n": hour_ago, "m": time.time()})
    with FakeGate(socket_dir / "gate.sock", [reply]) as gate:
        result = volutectl("pause", "m", "n", "--socket", str(gate.path))
    assert result.returncode == 0, result.stderr
    assert gate.requests == [{"v": 1, "op": "pause", "minds": ["m", "n"]}]
    assert result.stdout == "paused m\nn was already paused (1h02m ago)\n"


def test_pause_with_no_name_pauses_every_mind_and_says_if_a_pause_of_all_was_there(
    socket_dir: Path,
) -> None:
    replies: list[Any] = [[pause_reply(["*"], {"*": time.time()})]]
    replies.append([pause_reply([], {"*": time.time() - 65})])
    with FakeGate(socket_dir / "gate.sock", [], scripts=replies) as gate:
        first = volutectl("pause", "--socket", str(gate.path))
        again = volutectl("pause", "--socket", str(gate.path))
    assert gate.requests[0]["op"] == "pause" and gate.requests[0].get("minds") is None
    assert first.stdout == "paused every mind\n"
    # 65 s, and however long the command took to start on a loaded machine
    assert re.fullmatch(
        r"every mind was already paused \(1m(0[5-9]|[1-5]\d)s ago\)\n", again.stdout
    )


def test_resume_says_what_it_resumed_and_what_was_not_paused(socket_dir: Path) -> None:
    scripts: list[Any] = [
        [pause_reply(["m"], {})],
        [pause_reply(["*", "n"], {})],
        [pause_reply([], {})],
    ]
    with FakeGate(socket_dir / "gate.sock", [], scripts=scripts) as gate:
        named = volutectl("resume", "m", "x", "--socket", str(gate.path))
        every = volutectl("resume", "--socket", str(gate.path))
        nothing = volutectl("resume", "--socket", str(gate.path))
    assert gate.requests[0] == {"v": 1, "op": "resume", "minds": ["m", "x"]}
    assert named.stdout == "resumed m\nx was not paused\n"
    assert every.stdout == "resumed every mind, n\n"
    assert nothing.stdout == "nothing was paused\n"


def test_a_refused_pause_exits_with_the_gates_code_and_its_words(socket_dir: Path) -> None:
    refusal = {"ok": False, "error": "unknown mind 'ghost'", "code": 67, "hint": "add it"}
    with FakeGate(socket_dir / "gate.sock", [refusal]) as gate:
        result = volutectl("pause", "ghost", "--socket", str(gate.path))
    assert result.returncode == 67
    assert "unknown mind 'ghost'" in result.stderr and result.stdout == ""


def test_wait_exits_with_the_first_failure_in_the_order_given(socket_dir: Path) -> None:
    ended = {"ok": True, "event": "turn_ended", "id": 7, "turn_id": 2, "outcome": "ok",
             "exit_status": 0, "exit_code": 0}  # fmt: skip
    dead = {"ok": True, "event": "dead", "id": 8, "error": "turn 3 exited 3", "exit_code": 3,
            "turn_id": 3, "outcome": "failed"}  # fmt: skip
    replies = [{"ok": True, "ids": [8, 7]}, dead, ended]
    with FakeGate(socket_dir / "gate.sock", replies) as gate:
        result = volutectl("wait", "8", "7", "8", "--socket", str(gate.path))
    assert result.returncode == 3, result.stderr
    assert gate.requests == [{"v": 1, "op": "wait", "ids": [8, 7], "progress": True}]  # each once
    assert "delivery 8 is dead after turn 3 failed: turn 3 exited 3" in result.stderr
    assert result.stdout == ""


def test_wait_for_an_unknown_id_is_65_naming_it(socket_dir: Path) -> None:
    refusal = {"ok": False, "error": "ids: no delivery 404", "code": 65, "hint": "retention"}
    with FakeGate(socket_dir / "gate.sock", [refusal]) as gate:
        result = volutectl("wait", "404", "--socket", str(gate.path))
    assert result.returncode == 65
    assert "no delivery 404" in result.stderr


@pytest.mark.parametrize(
    "args",
    [(), ("0",), ("-3",), ("seven",), tuple(map(str, range(1, MAX_WAIT_IDS + 2)))],
    ids=["none", "zero", "negative", "word", "too-many"],
)
def test_wait_refuses_bad_ids_with_64_before_any_io(socket_dir: Path, args: tuple[str]) -> None:
    with FakeGate(socket_dir / "gate.sock", []) as gate:
        result = volutectl("wait", *args, "--socket", str(gate.path))
    assert result.returncode == 64, result.stderr
    assert gate.connections == 0


def test_wait_with_no_gate_at_all_is_69_at_once(socket_dir: Path) -> None:
    started = time.monotonic()
    result = volutectl("wait", "1", "--socket", str(socket_dir / "nothing.sock"))
    assert result.returncode == 69, result.stderr
    assert time.monotonic() - started < 10
