"""Issue 29, item 3: every command that prints another party's text (the gate's words, a
member's paths, a turn's error) shows its control characters instead of passing them to
the terminal; `--json` stays exact.

Each command runs as a user runs it (the console script) against a scripted peer on a
real socket (tests/unit/fake_gate.py) that answers with text holding escapes: what a
compromised gate could send, or what others put in the text a real gate relays.
`volutectl logs` is tests/unit/test_logs.py's, `status`'s layout
tests/unit/test_statusview.py's, and the escape itself tests/unit/test_visible.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_gate import FakeGate, remove_tree, short_socket_dir
from tests.unit.test_deliver_client import clean_environment
from tests.unit.test_statusview import status
from volutectl.errors import VoluteError, format_error
from volutectl.wire.messages import RepositoryStatus

VOLUTECTL = Path(sys.executable).parent / "volutectl"
# Erases the line so far and writes one of its own, retitles the window, writes the
# clipboard (OSC 52), and starts a C1 control sequence.
EVIL = "x\r\033[2Kall is well\033]0;TITLE\007\033]52;c;ZXZpbA==\007\x9b2J\u202e"
SHOWN = r"x\r\x1b[2Kall is well\x1b]0;TITLE\a\x1b]52;c;ZXZpbA==\a\x9b2J\u202e"


def controls(text: str) -> list[str]:
    """What a terminal would obey in `text`, but the newlines that end its lines."""
    return [
        char
        for char in text
        if (ord(char) < 32 and char != "\n") or 0x7F <= ord(char) < 0xA0 or char == "\u202e"
    ]


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = short_socket_dir()
    yield path
    remove_tree(path)


def run(
    socket_dir: Path, replies: list[Any], *commands: tuple[str, ...]
) -> list[subprocess.CompletedProcess[str]]:
    """Each command (SOCKET in it: the peer's socket) against a peer that answers each
    connection with `replies`."""
    path = socket_dir / "gate.sock"
    with FakeGate(path, replies):
        return [
            subprocess.run(
                [str(VOLUTECTL), *(str(path) if arg == "SOCKET" else arg for arg in argv)],
                capture_output=True,
                text=True,
                env=clean_environment(),
                timeout=60,
            )
            for argv in commands
        ]


def test_an_error_and_its_hint_show_their_controls() -> None:
    text = format_error(VoluteError(f"refused: {EVIL}", hint=f"try {EVIL}"))
    assert text == f"volutectl: refused: {SHOWN}\n  hint: try {SHOWN}"


def test_a_refusal_from_the_gate_is_shown_not_obeyed(socket_dir: Path) -> None:
    refusal = {"ok": False, "error": f"no: {EVIL}", "code": 77, "hint": EVIL}
    commands = [
        ("pause", "m", "--socket", "SOCKET"),
        ("queue", "--socket", "SOCKET", "drop", "3"),
        ("wait", "3", "--socket", "SOCKET"),
        ("status", "--socket", "SOCKET"),
        ("deliver", "m", "-m", "hi", "--socket", "SOCKET"),
    ]
    for argv, result in zip(commands, run(socket_dir, [refusal], *commands), strict=True):
        assert result.returncode == 77, (argv, result.stderr)
        assert controls(result.stderr) == [] and SHOWN in result.stderr, (argv, result.stderr)


def test_status_shows_a_members_path_escaped_and_json_keeps_it_exact(socket_dir: Path) -> None:
    watched = RepositoryStatus(f"/srv/{EVIL}", None, None, (), "no such file or directory")
    reply = {"ok": True, "status": status(test_runs=(watched,)).to_wire()}
    text, exact = run(
        socket_dir,
        [reply],
        ("status", "--socket", "SOCKET"),
        ("status", "--json", "--socket", "SOCKET"),
    )
    assert text.returncode == 0, text.stderr
    assert controls(text.stdout) == [] and f"cannot watch /srv/{SHOWN}" in text.stdout
    assert json.loads(exact.stdout)["test_runs"][0]["repository"] == f"/srv/{EVIL}"


def test_queue_list_shows_a_last_error_escaped_and_json_keeps_it_exact(socket_dir: Path) -> None:
    row = {
        "id": 3, "mind": "m", "session": "s", "state": "dead", "attempts": 1,
        "hold_reason": None, "held_ms": 0, "turn_id": 1, "created_at": 1.0,
        "last_error": EVIL, "bytes": 5,
    }  # fmt: skip
    reply = {"ok": True, "rows": [row], "not_shown": 0}
    queue = ("queue", "--socket", "SOCKET", "list")
    text, exact = run(socket_dir, [reply], queue, (*queue, "--json"))
    assert text.returncode == 0, text.stderr
    assert controls(text.stdout) == [] and f"last error: {SHOWN}" in text.stdout
    assert json.loads(exact.stdout)[0]["last_error"] == EVIL


def test_wait_shows_a_failed_attempt_and_a_dead_delivery_escaped(socket_dir: Path) -> None:
    attempt = {"ok": True, "event": "attempt_failed", "id": 3, "error": EVIL, "attempt": 1,
               "max_attempts": 2, "next_try_at": time.time() + 1}  # fmt: skip
    dead = {"ok": True, "event": "dead", "id": 3, "error": EVIL, "exit_code": 3}
    [result] = run(
        socket_dir, [{"ok": True, "ids": [3]}, attempt, dead], ("wait", "3", "--socket", "SOCKET")
    )
    assert result.returncode == 3, result.stderr
    assert controls(result.stderr) == [], result.stderr
    assert f"attempt 1 of 2 failed: {SHOWN}" in result.stderr
    assert f"delivery 3 is dead: {SHOWN}" in result.stderr


def test_resume_shows_the_names_the_gate_sent_escaped(socket_dir: Path) -> None:
    reply = {"ok": True, "changed": [EVIL], "paused": []}
    [result] = run(socket_dir, [reply], ("resume", "--socket", "SOCKET"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"resumed {SHOWN}\n"


def test_a_path_that_is_not_utf8_shows_escaped_rather_than_ending_the_command(
    socket_dir: Path,
) -> None:
    """A member's directory named with bytes that are not UTF-8 reaches the client as a
    lone surrogate (JSON's `\\udcff`): written out, it reached root's terminal as the
    raw bytes (0x9b is CSI in 8-bit mode), or, where Python's stdout encodes strictly,
    ended `status` with an encoding error (70)."""
    watched = RepositoryStatus("/srv/bob/\udcff\udc9b", None, None, (), "permission denied")
    reply = {"ok": True, "status": status(test_runs=(watched,)).to_wire()}
    [text] = run(socket_dir, [reply], ("status", "--socket", "SOCKET"))
    assert text.returncode == 0, text.stderr
    assert r"cannot watch /srv/bob/\udcff\udc9b: permission denied" in text.stdout
