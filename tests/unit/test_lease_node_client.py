"""tests/node/lease_client.mjs, the protocol's second-language check, against a socket
peer (tests/unit/fake_lease_gate.py): what it sends, and that it reports each lease.
tests/system/test_lease_node.py runs it against the real gate."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.fake_gate import remove_tree, short_socket_dir
from tests.unit.fake_lease_gate import GRANT, TOKEN, LeaseGate, Peer, granted_then, released

NODE_CLIENT = Path(__file__).parents[1] / "node" / "lease_client.mjs"
NODE = shutil.which("node") or shutil.which("nodejs")
pytestmark = pytest.mark.skipif(NODE is None, reason="no node: packaging/dev-setup installs it")


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = short_socket_dir()
    yield path
    remove_tree(path)


def resident(path: Path, turns: int) -> threading.Thread:
    """A mind's resident process, as a thread: answers `turns` requests with `done 42 N`."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)

    def serve() -> None:
        with server:
            for _ in range(turns):
                conn, _ = server.accept()
                with conn:
                    words = conn.makefile().readline().split()
                    conn.sendall(f"done 42 {words[1]}\n".encode())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def run_node(socket_dir: Path, rounds: int = 1) -> subprocess.CompletedProcess[str]:
    plan = {
        "socket": str(socket_dir / "gate.sock"),
        "rounds": rounds,
        "turn_ms": 10,
        "minds": [{"mind": "pip", "session": "chat", "resident": str(socket_dir / "pip.sock")}],
    }
    (socket_dir / "plan.json").write_text(json.dumps(plan))
    assert NODE is not None
    return subprocess.run(
        [NODE, str(NODE_CLIENT), str(socket_dir / "plan.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_node_client_acquires_without_pids_runs_the_turn_and_releases(
    socket_dir: Path,
) -> None:
    gate = LeaseGate(socket_dir / "gate.sock", [granted_then(released)] * 2)
    turns = resident(socket_dir / "pip.sock", 2)
    done = run_node(socket_dir, rounds=2)
    gate.close()
    turns.join(timeout=10)
    assert done.returncode == 0, done.stderr
    leases = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(lease["round"], lease["lease"], lease["grants"]) for lease in leases] == [
        (0, 7, 1),
        (1, 7, 1),
    ]
    assert leases[0]["waited"] is True and leases[0]["resident"] == "done 42 0"
    for peer in gate.peers:
        acquire, release = peer.lines
        assert (acquire["op"], acquire["mind"], acquire["session"], acquire["pids"]) == (
            "acquire",
            "pip",
            "chat",
            0,
        )
        assert peer.pids[0] == []  # no descriptor: Node's net cannot pass one
        assert release == {"v": 1, "op": "release", "lease": GRANT["lease"], "token": TOKEN}


def test_the_node_client_says_an_older_gate_is_too_old_and_exits_64(socket_dir: Path) -> None:
    def old(peer: Peer) -> None:
        assert peer.line() is not None
        peer.send({"ok": False, "code": 64, "error": "op: unknown request 'acquire'"})

    gate = LeaseGate(socket_dir / "gate.sock", [old])
    done = run_node(socket_dir)
    gate.close()
    assert done.returncode == 64
    assert "the gate is too old for leases" in done.stderr
