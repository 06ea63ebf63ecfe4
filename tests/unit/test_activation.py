"""Socket activation: the gate serves the socket systemd passes, and leaves it in place.

The protocol end to end comes from systemd's own `systemd-socket-activate`, which
listens, then starts a child with LISTEN_FDS/LISTEN_PID exactly as a .socket unit does.
The gate's side (`Gate._listen` and `Gate.close`) runs in-process on real sockets.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_gate import remove_tree, short_socket_dir
from volutectl.config.reload import SettingsHolder
from volutectl.config.settings import Settings
from volutectl.errors import EX_CONFIG, ConfigError
from volutectl.gate.reactor import Reactor
from volutectl.gate.server import Server
from volutectl.systemd import activation
from volutectl.systemd.journal import Journal

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = short_socket_dir()
    yield path
    remove_tree(path)


def listening(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(8)
    return sock


# -- the protocol, through systemd-socket-activate --------------------------------------------

CHILD = textwrap.dedent(
    """
    import fcntl, json, os, sys
    from volutectl.systemd import activation
    from volutectl.errors import ConfigError
    before = {name: os.environ.get(name) for name in activation.VARIABLES}
    try:
        sock = activation.inherited_listener()
    except ConfigError as error:
        print(json.dumps({"error": error.message, "hint": error.hint}))
        sys.exit(error.exit_code)
    conn, _ = sock.accept()  # the connection that started us, queued meanwhile
    conn.close()
    print(json.dumps({
        "before": before,
        "after": {name: os.environ.get(name) for name in activation.VARIABLES},
        "fd": sock.fileno(),
        "cloexec": bool(fcntl.fcntl(sock.fileno(), fcntl.F_GETFD) & fcntl.FD_CLOEXEC),
        "path": activation.served_path(sock),
    }))
    """
)


def activate(paths: list[Path]) -> tuple[int, dict[str, Any]]:
    """Run CHILD as a .socket unit would start it, listening on `paths`; its exit and report."""
    tool = shutil.which("systemd-socket-activate")
    assert tool, "systemd-socket-activate is missing (apt-get install systemd)"
    listen = [arg for path in paths for arg in ("-l", str(path))]
    launcher = subprocess.Popen(
        [tool, *listen, sys.executable, "-c", CHILD],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 10
        while not all(path.exists() for path in paths):
            assert time.monotonic() < deadline, "systemd-socket-activate never listened"
            time.sleep(0.01)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(paths[0]))  # the first connection starts the child
            out, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert out, err
    report: dict[str, Any] = json.loads(out)
    return launcher.returncode, report


def test_the_socket_systemd_passes_is_taken_made_close_on_exec_and_its_variables_unset(
    socket_dir: Path,
) -> None:
    path = socket_dir / "gate.sock"
    code, seen = activate([path])
    assert code == 0, seen
    assert seen["before"]["LISTEN_FDS"] == "1"
    assert seen["before"]["LISTEN_PID"] is not None
    assert seen["after"] == {"LISTEN_PID": None, "LISTEN_FDS": None, "LISTEN_FDNAMES": None}
    assert seen["fd"] == activation.LISTEN_FDS_START
    assert seen["cloexec"] is True  # systemd passes it inheritable; turns must not get it
    assert seen["path"] == str(path)


def test_more_than_one_socket_is_refused(socket_dir: Path) -> None:
    code, seen = activate([socket_dir / "a.sock", socket_dir / "b.sock"])
    assert code == EX_CONFIG
    assert "passed 2 sockets" in seen["error"]
    assert "ListenStream" in seen["hint"]


# -- the variables --------------------------------------------------------------------------


def test_variables_for_another_process_are_not_taken_but_still_unset() -> None:
    environ = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x", "HOME": "/root"}
    assert activation.listen_fds(environ, pid=4242) == []
    assert environ == {"HOME": "/root"}


def test_no_variables_means_run_by_hand() -> None:
    environ: dict[str, str] = {}
    assert activation.inherited_listener(environ, pid=4242) is None
    assert activation.listen_fds({"LISTEN_PID": "4242", "LISTEN_FDS": "0"}, pid=4242) == []


@pytest.mark.parametrize(
    ("pid", "fds", "says"),
    [("x", "1", "not numbers"), ("4242", "one", "not numbers"), ("4242", "900", "not open")],
)
def test_broken_variables_are_a_config_error(pid: str, fds: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as raised:
        activation.listen_fds({"LISTEN_PID": pid, "LISTEN_FDS": fds}, pid=4242)
    assert raised.value.exit_code == EX_CONFIG


# -- what the gate accepts as its listener --------------------------------------------------


def test_a_listening_unix_stream_socket_is_accepted(socket_dir: Path) -> None:
    sock = listening(socket_dir / "gate.sock")
    try:
        taken = activation.listener_from_fd(os.dup(sock.fileno()))
        assert activation.served_path(taken) == str(socket_dir / "gate.sock")
        taken.close()
    finally:
        sock.close()


def wrong_sockets(socket_dir: Path) -> Iterator[tuple[str, socket.socket]]:
    datagram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    datagram.bind(str(socket_dir / "dgram.sock"))
    yield "AF_UNIX SOCK_DGRAM", datagram
    unlistened = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unlistened.bind(str(socket_dir / "idle.sock"))
    yield "not listening", unlistened
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(1)
    yield "AF_INET SOCK_STREAM", tcp


def test_any_other_socket_is_refused_and_left_open(socket_dir: Path) -> None:
    for what, sock in wrong_sockets(socket_dir):
        with sock:
            with pytest.raises(ConfigError) as raised:
                activation.listener_from_fd(sock.fileno())
            assert what in raised.value.message
            assert "ListenStream" in (raised.value.hint or "")
            os.fstat(sock.fileno())  # still open: refusing it closed nothing
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ConfigError, match="not a socket"):
            activation.listener_from_fd(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)


# -- the gate's socket: inherited or bound, and what close() leaves --------------------------


class RecordingJournal(Journal):
    def __init__(self) -> None:
        super().__init__("test")
        self.sender = None
        self.lines: list[tuple[str, str]] = []

    def log(self, level: str, message: str, **fields: Any) -> None:
        self.lines.append((level, message))


def server_for(
    socket_path: Path, listener: socket.socket | None
) -> tuple[Server, RecordingJournal]:
    """The gate's socket side (volutectl/gate/server.py), as the gate builds it."""
    settings = Settings(gate={"socket": socket_path})
    journal = RecordingJournal()
    server = Server(SettingsHolder(settings), Reactor(), journal, inherited=listener)
    return server, journal


def test_an_activated_gate_serves_systemds_socket_and_never_unlinks_it(socket_dir: Path) -> None:
    path = socket_dir / "gate.sock"
    held_by_systemd = listening(path)
    passed = socket.socket(fileno=os.dup(held_by_systemd.fileno()))
    gate, journal = server_for(path, passed)
    assert gate.listener is passed
    assert not gate.listener.getblocking()
    gate.close()
    assert passed.fileno() == -1  # the gate's copy is closed...
    assert path.exists()  # ...but the file stays, and systemd's copy still queues:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(5)
    try:
        client.connect(str(path))
        client.sendall(b"waiting for the next gate\n")
        held_by_systemd.settimeout(5)
        queued, _ = held_by_systemd.accept()
        assert queued.recv(100) == b"waiting for the next gate\n"
        queued.close()
    finally:
        client.close()
        held_by_systemd.close()
    assert not [line for line in journal.lines if line[0] == "warning"]


def test_when_the_unit_and_the_config_disagree_the_inherited_socket_wins(
    socket_dir: Path,
) -> None:
    unit_path, config_path = socket_dir / "unit.sock", socket_dir / "config.sock"
    held_by_systemd = listening(unit_path)
    gate, journal = server_for(config_path, socket.socket(fileno=os.dup(held_by_systemd.fileno())))
    try:
        assert activation.served_path(gate.listener) == str(unit_path)
        assert not config_path.exists()  # no second socket that nobody would queue on
        [(level, message)] = journal.lines
        assert level == "warning"
        assert str(unit_path) in message and str(config_path) in message
    finally:
        gate.close()
        held_by_systemd.close()


def test_a_gate_run_by_hand_binds_its_socket_and_unlinks_it_on_close(socket_dir: Path) -> None:
    path = socket_dir / "gate.sock"
    gate, _ = server_for(path, None)
    assert path.exists()
    assert fcntl.fcntl(gate.listener.fileno(), fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    gate.close()
    assert not path.exists()
