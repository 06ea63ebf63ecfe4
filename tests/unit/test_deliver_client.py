"""`volutectl deliver` as a user runs it: the console script against a real socket.

The gate's end is a small protocol peer in a thread (tests/unit/fake_gate.py) that
records what arrives, so each test can say both what deliver printed and exited with,
and what it sent (or that it sent nothing).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_gate import FakeGate, remove_tree, short_socket_dir
from volutectl.cli import deliver
from volutectl.errors import VoluteError

VOLUTECTL = Path(sys.executable).parent / "volutectl"
ACK = {"ok": True, "id": 7}
REQUEST_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = short_socket_dir()
    yield path
    remove_tree(path)


def run(
    *args: str | bytes,
    stdin: bytes | None = b"",
    env: dict[str, str] | None = None,
    stdin_fd: int | None = None,
) -> subprocess.CompletedProcess[bytes]:
    clean = clean_environment()
    clean.update(env or {})
    return subprocess.run(
        [str(VOLUTECTL), "deliver", *args],
        input=stdin if stdin_fd is None else None,
        stdin=stdin_fd,
        capture_output=True,
        env=clean,
        timeout=60,
    )


def clean_environment() -> dict[str, str]:
    """Ours, without VOLUTE_ settings, and without coverage's hook (which would load
    modules into the child that deliver itself never imports)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith(("VOLUTE_", "COVERAGE_", "COV_CORE_"))
    }


def wait_until(predicate: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def gate_at(socket_dir: Path, replies: list[dict[str, Any] | bytes] | None = None) -> FakeGate:
    return FakeGate(socket_dir / "gate.sock", [ACK] if replies is None else replies)


# -- refused before any I/O -----------------------------------------------------------------


@pytest.mark.parametrize("mind", ["bad/mind", "_under", "a b", "x" * 65, ".hidden", "caf\u00e9"])
def test_bad_mind_name_is_65_and_nothing_is_sent(socket_dir: Path, mind: str) -> None:
    with gate_at(socket_dir) as gate:
        result = run(mind, "--message", "hi", "--socket", str(gate.path))
    assert result.returncode == 65, result.stderr
    assert b"invalid mind name" in result.stderr
    assert b"Traceback" not in result.stderr
    assert gate.connections == 0


@pytest.mark.parametrize("session", ["a b", "-x", "", "s/t"])
def test_bad_session_name_is_65_and_nothing_is_sent(socket_dir: Path, session: str) -> None:
    with gate_at(socket_dir) as gate:
        result = run("ada", f"--session={session}", "--message", "hi", "--socket", str(gate.path))
    assert result.returncode == 65, result.stderr
    assert b"invalid session name" in result.stderr
    assert gate.connections == 0


@pytest.mark.parametrize("given", [["--message", ""], ["-m="], []])
def test_an_empty_message_is_a_usage_error_from_the_flag_as_from_stdin(
    socket_dir: Path, given: list[str]
) -> None:
    """One rule on both paths: an empty message is refused (64), nothing sent."""
    with gate_at(socket_dir) as gate:
        result = run("ada", *given, "--socket", str(gate.path), stdin=b"")
    assert result.returncode == 64, result.stderr
    assert b"no message: the message is empty" in result.stderr
    assert gate.connections == 0


def test_a_terminal_on_stdin_is_a_usage_error_not_a_wait(socket_dir: Path) -> None:
    controller, terminal = os.openpty()
    try:
        with gate_at(socket_dir) as gate:
            result = run("ada", "--socket", str(gate.path), stdin_fd=terminal)
    finally:
        os.close(controller)
        os.close(terminal)
    assert result.returncode == 64, result.stderr
    assert b"--message" in result.stderr
    assert gate.connections == 0


def test_non_utf8_stdin_is_65_and_nothing_is_sent(socket_dir: Path) -> None:
    with gate_at(socket_dir) as gate:
        result = run("ada", "--socket", str(gate.path), stdin=b"caf\xe9\n")
    assert result.returncode == 65, result.stderr
    assert b"not UTF-8" in result.stderr
    assert gate.connections == 0


def test_non_utf8_message_argument_is_65_and_nothing_is_sent(socket_dir: Path) -> None:
    with gate_at(socket_dir) as gate:
        result = run("ada", "--socket", str(gate.path), "--message", b"caf\xe9")
    assert result.returncode == 65, result.stderr
    assert b"not UTF-8" in result.stderr
    assert gate.connections == 0


def test_unknown_option_is_64() -> None:
    result = run("ada", "--frobnicate")
    assert result.returncode == 64
    assert b"--frobnicate" in result.stderr


# -- the gate's end ---------------------------------------------------------------------------


def timed(*args: str | bytes) -> tuple[subprocess.CompletedProcess[bytes], float]:
    start = time.monotonic()
    result = run(*args)
    return result, time.monotonic() - start


@pytest.mark.serial
def test_missing_socket_is_69_with_the_hint_and_fails_fast(socket_dir: Path) -> None:
    path = socket_dir / "gate.sock"
    result, elapsed = timed("ada", "--message", "hi", "--socket", str(path), "--timeout", "30")
    assert result.returncode == 69
    lines = result.stderr.decode().splitlines()
    assert lines[0] == f"volutectl: the gate is not running: no socket at {path}"
    assert lines[1] == "  hint: start it with: systemctl start volute-gate.service"
    assert result.stdout == b""
    # An absent gate is not a restarting one: no waiting out the 30 s timeout.
    assert elapsed < 5, elapsed


@pytest.mark.serial
def test_a_socket_nobody_listens_on_is_69_and_fails_fast(socket_dir: Path) -> None:
    path = socket_dir / "gate.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # the file exists, but nothing listens: ECONNREFUSED
    try:
        result, elapsed = timed("ada", "--message", "hi", "--socket", str(path), "--timeout", "30")
    finally:
        stale.close()
    assert result.returncode == 69, result.stderr
    assert f"{path} refuses connections".encode() in result.stderr
    assert b"hint: start it with" in result.stderr
    assert elapsed < 5, elapsed


def test_acknowledged_delivery_prints_its_id(socket_dir: Path) -> None:
    with gate_at(socket_dir) as gate:
        result = run("ada", "--message", "hello", "--socket", str(gate.path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"7\n"
    [request] = gate.requests
    assert REQUEST_ID.fullmatch(request.pop("request_id"))
    assert request == {
        "v": 1,
        "op": "deliver",
        "mind": "ada",
        "session": "main",
        "message": "hello",
        "interrupt": False,
        "wait": False,
    }


def test_a_refused_interrupt_is_said_on_one_line_of_stderr(socket_dir: Path) -> None:
    """The gate's ack says the interrupt may not cut the running turn short (it runs
    another user's delivery): the id still goes to stdout, and stderr says why, once.
    A field this client does not know is ignored, as an older client ignores this one."""
    ack = {"v": 1, "ok": True, "id": 7, "interrupt_refused": True, "later_field": [1]}
    with gate_at(socket_dir, [ack]) as gate:
        result = run("ada", "-s", "chat", "--interrupt", "-m", "stop", "--socket", str(gate.path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"7\n"
    [line] = result.stderr.decode().splitlines()
    assert line.startswith("volutectl: interrupt refused: the running turn of ada/chat")
    assert "folded in as a plain delivery" in line
    with FakeGate(socket_dir / "again.sock", [ACK]) as gate:  # no such field: nothing said
        result = run("ada", "--interrupt", "-m", "stop", "--socket", str(gate.path))
    assert (result.returncode, result.stderr) == (0, b"")


def test_every_delivery_gets_a_new_request_id(socket_dir: Path) -> None:
    with gate_at(socket_dir) as gate:
        for _ in range(3):
            assert run("ada", "--message", "same", "--socket", str(gate.path)).returncode == 0
    assert len({request["request_id"] for request in gate.requests}) == 3


# -- a gate that dies or restarts before it acknowledges ----------------------------------------


@pytest.mark.parametrize("lost", ["eof", "reset"])
def test_a_connection_lost_before_the_ack_is_retried_with_the_same_request_id(
    socket_dir: Path, lost: str
) -> None:
    with FakeGate(socket_dir / "gate.sock", [ACK], scripts=[lost, lost]) as gate:  # type: ignore[list-item]
        result = run("ada", "--message", "hello", "--socket", str(gate.path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"7\n"
    assert result.stderr == b""
    # Three tries, the same request each time: the gate can tell a retry from a new one.
    assert gate.connections == 3
    assert len(gate.requests) == 3
    assert gate.requests[0] == gate.requests[1] == gate.requests[2]
    assert REQUEST_ID.fullmatch(gate.requests[0]["request_id"])


@pytest.mark.serial
def test_a_gate_that_never_acknowledges_is_75_after_the_timeout(socket_dir: Path) -> None:
    with FakeGate(socket_dir / "gate.sock", [], scripts=["eof"] * 1000) as gate:
        result, elapsed = timed(
            "ada", "--message", "hi", "--socket", str(gate.path), "--timeout", "1.5"
        )
    assert result.returncode == 75, result.stderr
    lines = result.stderr.decode().splitlines()
    assert lines[0].startswith("volutectl: the gate did not acknowledge the delivery within 1.5 s")
    assert "closed the connection" in lines[0]
    assert "volutectl queue list" in lines[1]
    assert result.stdout == b""
    assert 1.5 <= elapsed < 6, elapsed
    # It kept trying, with a backoff: more than a couple of tries, far fewer than a spin.
    assert 4 <= gate.connections <= 20, gate.connections
    assert len({request["request_id"] for request in gate.requests}) == 1


def test_after_a_lost_connection_a_missing_socket_is_waited_for(socket_dir: Path) -> None:
    """A gate run by hand (not socket-activated) unlinks its socket while it restarts."""
    path = socket_dir / "gate.sock"
    first = FakeGate(path, [], scripts=["eof"])
    try:
        child = subprocess.Popen(
            [str(VOLUTECTL), "deliver", "ada", "--message", "hi", "--socket", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=clean_environment(),
        )
        wait_until(lambda: first.connections == 1)
    finally:
        first.close()
        path.unlink()
    time.sleep(0.5)  # the client now finds no socket at all, and keeps trying
    with FakeGate(path, [ACK]) as second:
        out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    assert out == b"7\n"
    assert second.requests[0]["request_id"] == first.requests[0]["request_id"]


def test_message_from_stdin_arrives_byte_for_byte(socket_dir: Path) -> None:
    text = 'line one\nline "two" \u00e9\u2603\n\n\ttab\\end'
    with gate_at(socket_dir) as gate:
        result = run(
            "ada", "-s", "chat:42", "--interrupt", "--socket", str(gate.path), stdin=text.encode()
        )
    assert result.returncode == 0, result.stderr
    [request] = gate.requests
    assert request["message"] == text
    assert (request["session"], request["interrupt"]) == ("chat:42", True)


def test_the_gates_refusal_is_one_line_with_its_code(socket_dir: Path) -> None:
    refusal = {
        "ok": False,
        "error": "unknown mind 'zed'",
        "hint": "configured minds: ada",
        "code": 67,
    }
    with gate_at(socket_dir, [refusal]) as gate:
        result = run("zed", "--message", "hi", "--socket", str(gate.path))
    assert result.returncode == 67
    assert result.stderr.decode().splitlines() == [
        "volutectl: unknown mind 'zed'",
        "  hint: configured minds: ada",
    ]
    assert result.stdout == b""


def test_an_ack_without_an_id_is_a_protocol_error(socket_dir: Path) -> None:
    with gate_at(socket_dir, [{"ok": True}]) as gate:
        result = run("ada", "--message", "hi", "--socket", str(gate.path))
    assert result.returncode == 76, result.stderr
    assert b"Traceback" not in result.stderr
    assert result.stdout == b""


def test_wait_exits_with_the_turns_exit_code(socket_dir: Path) -> None:
    ended = {
        "ok": True,
        "event": "turn_ended",
        "id": 7,
        "turn_id": 4,
        "outcome": "failed",
        "exit_status": 3,
        "exit_code": 3,
    }
    with gate_at(socket_dir, [ACK, ended]) as gate:
        result = run("ada", "--message", "hi", "--wait", "--socket", str(gate.path))
    assert result.returncode == 3, result.stderr
    assert result.stdout == b"7\n"  # the id comes first, before the wait
    assert b"turn 4 failed: exit status 3" in result.stderr
    assert gate.requests[0]["wait"] is True


def test_wait_on_a_turn_that_succeeded_is_0(socket_dir: Path) -> None:
    ended = {
        "ok": True, "event": "turn_ended", "id": 7, "turn_id": 4, "outcome": "ok",
        "exit_status": 0, "exit_code": 0,
    }  # fmt: skip
    with gate_at(socket_dir, [ACK, ended]) as gate:
        result = run("ada", "--message", "hi", "--wait", "--socket", str(gate.path))
    assert (result.returncode, result.stdout, result.stderr) == (0, b"7\n", b"")


@pytest.mark.parametrize(
    ("event", "said"),
    [
        ({"ok": True, "event": "dead", "id": 7, "error": "turn 9 exited 1"}, b"delivery 7 is dead"),
        ({"ok": True, "event": "dropped", "id": 7}, b"delivery 7 was dropped"),
    ],
)
def test_wait_on_a_dead_or_dropped_delivery_is_1(
    socket_dir: Path, event: dict[str, Any], said: bytes
) -> None:
    with gate_at(socket_dir, [ACK, event]) as gate:
        result = run("ada", "--message", "hi", "--wait", "--socket", str(gate.path))
    assert result.returncode == 1
    assert said in result.stderr


def test_wait_on_an_unknown_event_is_a_protocol_error(socket_dir: Path) -> None:
    with gate_at(socket_dir, [ACK, {"ok": True, "event": "confetti"}]) as gate:
        result = run("ada", "--message", "hi", "--wait", "--socket", str(gate.path))
    assert result.returncode == 76
    assert b"unexpected reply" in result.stderr


def test_a_gate_lost_during_the_wait_is_asked_again_with_wait(socket_dir: Path) -> None:
    ended = {
        "ok": True, "event": "turn_ended", "id": 7, "turn_id": 4, "outcome": "interrupted",
        "exit_status": 130, "exit_code": 130,
    }  # fmt: skip
    # The first gate acks, then dies (EOF); the next takes `wait` and tells the outcome.
    scripts: list[Any] = [[ACK], [{"ok": True, "ids": [7]}, ended]]
    with FakeGate(socket_dir / "gate.sock", [], scripts=scripts) as gate:
        result = run("ada", "--message", "hi", "--wait", "--socket", str(gate.path))
    assert result.returncode == 130, result.stderr
    assert result.stdout == b"7\n"
    assert b"turn 4 interrupted: exit status 130" in result.stderr
    assert gate.requests[1] == {"v": 1, "op": "wait", "ids": [7], "progress": True}


@pytest.mark.serial
def test_a_gate_that_does_not_come_back_during_the_wait_is_75(socket_dir: Path) -> None:
    scripts: list[Any] = [[ACK], *["eof"] * 1000]
    with FakeGate(socket_dir / "gate.sock", [], scripts=scripts) as gate:
        result, elapsed = timed(
            "ada", "--message", "hi", "--wait", "--socket", str(gate.path), "--timeout", "1"
        )
    assert result.returncode == 75, result.stderr
    assert result.stdout == b"7\n"
    assert b"wait again with: volutectl wait 7" in result.stderr
    assert 1 <= elapsed < 6, elapsed
    assert 3 <= gate.connections <= 20  # it kept trying, with a backoff


# -- where the socket is -----------------------------------------------------------------------


def write_config(path: Path, socket_path: Path | str) -> Path:
    path.write_text(f'[gate]\nsocket = "{socket_path}"\n')
    return path


def test_socket_flag_beats_the_environment(socket_dir: Path) -> None:
    with gate_at(socket_dir) as gate:
        result = run(
            "ada",
            "--message",
            "hi",
            "--socket",
            str(gate.path),
            env={"VOLUTE_GATE__SOCKET": str(socket_dir / "elsewhere.sock")},
        )
    assert result.returncode == 0, result.stderr
    assert len(gate.requests) == 1


def test_environment_beats_the_config_file(socket_dir: Path) -> None:
    config = write_config(socket_dir / "volutectl.toml", socket_dir / "from-config.sock")
    with gate_at(socket_dir) as gate:
        result = run(
            "ada",
            "--message",
            "hi",
            "--config",
            str(config),
            env={"VOLUTE_GATE__SOCKET": str(gate.path)},
        )
    assert result.returncode == 0, result.stderr
    assert len(gate.requests) == 1


@pytest.mark.parametrize("how", ["--config", "VOLUTE_CONFIG"])
def test_config_file_gate_socket_is_used(socket_dir: Path, how: str) -> None:
    with gate_at(socket_dir) as gate:
        config = write_config(socket_dir / "volutectl.toml", gate.path)
        if how == "--config":
            result = run("ada", "--message", "hi", "--config", str(config))
        else:
            result = run("ada", "--message", "hi", env={"VOLUTE_CONFIG": str(config)})
    assert result.returncode == 0, result.stderr
    assert len(gate.requests) == 1


def test_explicit_config_that_is_missing_is_78(socket_dir: Path) -> None:
    result = run("ada", "--message", "hi", "--config", str(socket_dir / "nope.toml"))
    assert result.returncode == 78
    assert b"nope.toml" in result.stderr


def test_config_that_is_not_toml_is_78(socket_dir: Path) -> None:
    config = socket_dir / "volutectl.toml"
    config.write_text("[gate\nsocket = 1\n")
    result = run("ada", "--message", "hi", "--config", str(config))
    assert result.returncode == 78
    assert b"not valid TOML" in result.stderr


def test_socket_path_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("VOLUTE_GATE__SOCKET", raising=False)
    monkeypatch.delenv("VOLUTE_CONFIG", raising=False)
    # The system-wide config, absent: the built-in default.
    monkeypatch.setattr(deliver, "DEFAULT_CONFIG", str(tmp_path / "absent.toml"))
    assert deliver.socket_path(None, None) == "/run/volute/gate.sock"
    # A system-wide config without [gate] socket: still the default.
    system = tmp_path / "system.toml"
    system.write_text("[limits]\nturns_per_mind = 2\n")
    monkeypatch.setattr(deliver, "DEFAULT_CONFIG", str(system))
    assert deliver.socket_path(None, None) == "/run/volute/gate.sock"
    # The system-wide config's [gate] socket.
    write_config(system, "/srv/system.sock")
    assert deliver.socket_path(None, None) == "/srv/system.sock"
    # $VOLUTE_CONFIG replaces the system-wide file; --config replaces both.
    monkeypatch.setenv("VOLUTE_CONFIG", str(write_config(tmp_path / "env.toml", "/srv/env.sock")))
    assert deliver.socket_path(None, None) == "/srv/env.sock"
    flag_config = write_config(tmp_path / "flag.toml", "/srv/flag-config.sock")
    assert deliver.socket_path(None, str(flag_config)) == "/srv/flag-config.sock"
    # The environment variable beats any config file; the flag beats everything.
    monkeypatch.setenv("VOLUTE_GATE__SOCKET", "/srv/env-var.sock")
    assert deliver.socket_path(None, str(flag_config)) == "/srv/env-var.sock"
    assert deliver.socket_path("/srv/flag.sock", str(flag_config)) == "/srv/flag.sock"


def test_missing_config_named_by_environment_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("VOLUTE_GATE__SOCKET", raising=False)
    monkeypatch.setenv("VOLUTE_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(VoluteError, match="gone.toml") as caught:
        deliver.socket_path(None, None)
    assert caught.value.exit_code == 78


def test_the_hot_path_imports_no_heavy_module(socket_dir: Path) -> None:
    """deliver runs from timers and fan-outs: retries must not cost it click or pydantic."""
    path = str(socket_dir / "gate.sock")
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(' '.join(sorted(sys.modules)), file=sys.stderr))\n"
        "from volutectl.cli import main\n"
        f"main(['deliver', 'ada', '--message', 'hi', '--socket', {path!r}])\n"
    )
    with gate_at(socket_dir):
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, env=clean_environment(), timeout=60
        )
    assert result.returncode == 0, result.stderr
    loaded = set(result.stderr.decode().split())
    assert "volutectl.cli.deliver" in loaded
    heavy = {"click", "pydantic", "pydantic_settings", "typing", "dataclasses", "secrets", "random"}
    assert not heavy & loaded, sorted(heavy & loaded)
