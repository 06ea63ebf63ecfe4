"""`queue list`: newest first, at most --limit rows (50 unless asked), and a line saying
how many were left out. The gate's half runs in-process (tests/unit/gate_harness.py); the
command's half is the console script against a peer that records what it was sent.
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
from tests.unit.gate_harness import Harness
from volutectl.store.queue import NewDelivery

VOLUTECTL = Path(sys.executable).parent / "volutectl"


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    opened = Harness(tmp_path)
    yield opened
    opened.close()


def dropped_rows(harness: Harness, count: int) -> list[int]:
    """`count` dropped deliveries, made in the store (dropped: no turn starts for them)."""
    store = harness.gate.state.store
    ids = store.add_deliveries([NewDelivery("mimsy", "s", b"m")] * count, now=time.time())
    made = [delivery_id for delivery_id in ids if isinstance(delivery_id, int)]
    assert store.drop(made, time.time()) == made
    return made


def test_the_gate_lists_the_newest_first_and_counts_the_rest(harness: Harness) -> None:
    made = dropped_rows(harness, 60)
    peer = harness.connect()
    reply = peer.request({"op": "queue", "states": ["dropped"], "limit": 5})
    assert [row["id"] for row in reply["rows"]] == made[::-1][:5]
    assert reply["not_shown"] == 55
    default = peer.request({"op": "queue", "states": ["dropped"]})  # no limit: 50
    assert [row["id"] for row in default["rows"]] == made[::-1][:50]
    assert default["not_shown"] == 10
    everything = peer.request({"op": "queue", "states": ["dropped"], "limit": 10000})
    assert len(everything["rows"]) == 60 and everything["not_shown"] == 0


def row(delivery_id: int) -> dict[str, Any]:
    return {
        "id": delivery_id, "mind": "mimsy", "session": "chat", "state": "done",
        "attempts": 0, "hold_reason": None, "held_ms": 0, "turn_id": 1,
        "created_at": 1.0, "last_error": None, "bytes": 5,
    }  # fmt: skip


Ran = tuple[subprocess.CompletedProcess[str], dict[str, Any]]


def queue_list(gate_reply: dict[str, Any], *args: str) -> Ran:
    """Run `volutectl queue list ARGS` against a peer answering `gate_reply`; returns the
    command's result and the request it sent."""
    socket_dir = short_socket_dir()
    try:
        with FakeGate(socket_dir / "gate.sock", [gate_reply]) as gate:
            done = subprocess.run(
                [str(VOLUTECTL), "queue", "--socket", str(socket_dir / "gate.sock"), "list",
                 *args],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
        return done, gate.requests[0]
    finally:
        remove_tree(socket_dir)


def test_the_command_asks_for_its_limit_and_says_how_many_were_not_shown() -> None:
    done, sent = queue_list({"ok": True, "rows": [row(9), row(8)], "not_shown": 7}, "--limit", "2")
    assert done.returncode == 0, done.stderr
    assert sent["limit"] == 2
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[:2]] == ["9", "8"]
    assert lines[-1] == "7 older rows not shown (--limit)"


def test_the_default_limit_is_50_and_all_shown_says_nothing() -> None:
    done, sent = queue_list({"ok": True, "rows": [row(1)], "not_shown": 0})
    assert done.returncode == 0, done.stderr
    assert sent["limit"] == 50
    assert "not shown" not in done.stdout + done.stderr


def test_with_json_stdout_stays_one_array_and_the_line_goes_to_stderr() -> None:
    done, _ = queue_list({"ok": True, "rows": [row(3)], "not_shown": 1}, "--json")
    assert done.returncode == 0, done.stderr
    assert [item["id"] for item in json.loads(done.stdout)] == [3]
    assert done.stderr.strip() == "1 older rows not shown (--limit)"


def test_a_gate_from_before_the_limit_sends_no_count_and_none_is_made_up() -> None:
    done, _ = queue_list({"ok": True, "rows": [row(2)]})
    assert done.returncode == 0, done.stderr
    assert "not shown" not in done.stdout + done.stderr


@pytest.mark.parametrize("bad", ["0", "10001", "many"])
def test_a_limit_out_of_range_is_a_usage_error_before_anything_is_sent(bad: str) -> None:
    socket_dir = short_socket_dir()
    try:
        with FakeGate(socket_dir / "gate.sock", [{"ok": True, "rows": []}]) as gate:
            done = subprocess.run(
                [str(VOLUTECTL), "queue", "--socket", str(socket_dir / "gate.sock"), "list",
                 "--limit", bad],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
        assert done.returncode == 64, (done.returncode, done.stderr)
        assert "--limit" in done.stderr
        assert gate.requests == []
    finally:
        remove_tree(socket_dir)
