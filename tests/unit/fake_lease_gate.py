"""A lease gate's end of the socket, for client tests: a real unix socket served from a
thread, as tests/unit/fake_gate.py, but a lease's connection stays open and carries
several lines, and descriptors. Each connection is played by a script, a function given
the connection, which records what arrives (lines, and the processes of the pidfds that
came with them) and answers as docs/protocol.md's lease ops say.
"""

from __future__ import annotations

import array
import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

TOKEN = "ab" * 16
UNIT = "volute-turn-pip-12.scope"
GRANT = {
    "ok": True,
    "event": "lease_granted",
    "lease": 7,
    "token": TOKEN,
    "unit": UNIT,
    "turn_id": 12,
    "created": True,
    "pids_moved": 1,
}


class Peer:
    """One connection, from the gate's side."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""
        self.lines: list[dict[str, Any]] = []
        self.pids: list[list[int]] = []  # per line: the processes of the pidfds it carried

    def line(self, timeout: float = 20) -> dict[str, Any] | None:
        """The next line (None at EOF); the pids of the pidfds with it are in self.pids."""
        self.conn.settimeout(timeout)
        fds: list[int] = []
        while b"\n" not in self.buffer:
            data, ancillary, _, _ = self.conn.recvmsg(65536, socket.CMSG_SPACE(64 * 4))
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[: len(payload) // 4 * 4]))
            if not data:
                return None
            self.buffer += data
        raw, self.buffer = self.buffer.split(b"\n", 1)
        self.pids.append([_pid_of(fd) for fd in fds])
        for fd in fds:
            os.close(fd)
        obj: dict[str, Any] = json.loads(raw)
        self.lines.append(obj)
        return obj

    def send(self, obj: dict[str, Any]) -> None:
        self.conn.sendall(json.dumps({"v": 1, **obj}).encode() + b"\n")


def _pid_of(fd: int) -> int:
    """The pid a pidfd refers to (its fdinfo's Pid:), -1 if it is no pidfd."""
    with open(f"/proc/self/fdinfo/{fd}") as info:
        for row in info:
            if row.startswith("Pid:"):
                return int(row.split()[1])
    return -1


Script = Callable[[Peer], None]


class LeaseGate:
    """A listening socket whose n-th connection is played by scripts[n], in a thread."""

    def __init__(self, path: Path, scripts: list[Script]) -> None:
        self.path = path
        self.scripts = scripts
        self.peers: list[Peer] = []
        self.errors: list[BaseException] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.listener.settimeout(0.2)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        threads = []
        while not self.stopped.is_set() and len(self.peers) < len(self.scripts):
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            peer = Peer(conn)
            script = self.scripts[len(self.peers)]
            self.peers.append(peer)
            # Each connection in a thread of its own: a lease's stays open while another
            # (a status, a claim) is served.
            thread = threading.Thread(target=self._play, args=(script, peer), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(timeout=60)

    def _play(self, script: Script, peer: Peer) -> None:
        try:
            with peer.conn:
                script(peer)
        except BaseException as error:  # noqa: BLE001 - shown by the test
            self.errors.append(error)

    def all_lines(self) -> list[dict[str, Any]]:
        return [line for peer in self.peers for line in peer.lines]

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=30)
        self.listener.close()
        assert not self.errors, self.errors


def granted_then(after: Script, *, first: dict[str, Any] | None = None) -> Script:
    """A gate that answers the acquire with a wait, then grants; then plays `after`."""

    def script(peer: Peer) -> None:
        assert peer.line() is not None
        peer.send(first or {"ok": True, "lease": 7, "state": "waiting", "reason": "mind_busy"})
        peer.send(GRANT)
        after(peer)

    return script


def released(peer: Peer) -> None:
    """Wait for the release, and answer it."""
    line = peer.line(timeout=60)
    assert line is not None and line["op"] == "release", line
    peer.send({"ok": True, "lease": 7, "released": True})
