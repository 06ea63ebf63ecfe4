"""Pause and resume against the real gate in-process, and the status line it gives systemd.

A paused mind's new turns are held (reason `paused`, never an attempt) while its running
turn goes on and takes what folds into it; deliveries are still acknowledged; the pause
outlives a crash of the gate and, paused for all, covers minds configured later; resume
is the wake flush, every held delivery in id order, one batch per session. Bad requests
get their codes and the same gate goes on. The gate runs on real sockets and SQLite,
with tests/unit/fake_systemd.py for systemd (see tests/unit/test_gate_loop.py).
"""

from __future__ import annotations

import os
import socket
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness, Turns, gate_settings, settled
from volutectl import events
from volutectl.core import admission
from volutectl.errors import EX_DATAERR, EX_NOUSER, EX_TEMPFAIL
from volutectl.gate.status import status_line
from volutectl.states import HoldReason, QueueState


@pytest.fixture
def notified(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """What the gate tells its service manager: NOTIFY_SOCKET, read by the test."""
    path = f"\0volute-test-notify-{os.getpid()}-{id(monkeypatch)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + path[1:])
    yield sock
    sock.close()


def statuses(sock: socket.socket) -> list[str]:
    found: list[str] = []
    while True:
        try:
            datagram = sock.recv(4096).decode()
        except BlockingIOError:
            return found
        found += [
            line.removeprefix("STATUS=") for line in datagram.split("\n") if "STATUS=" in line
        ]


def request(harness: Harness, **fields: Any) -> dict[str, Any]:
    return harness.connect().request(fields)


def deliver(harness: Harness, mind: str, session: str = "main") -> int:
    reply = request(harness, op="deliver", mind=mind, session=session, message="m")
    assert reply["ok"] is True, reply
    return int(reply["id"])


def rows(harness: Harness, *ids: int) -> list[Any]:
    return harness.gate.state.store.rows(ids)


def held_for(harness: Harness, *ids: int) -> bool:
    return all(row.hold_reason is HoldReason.PAUSED for row in rows(harness, *ids))


def test_a_paused_mind_holds_new_turns_folds_into_its_running_one_and_resumes_in_order(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness], notified: socket.socket
) -> None:
    command, log = probe
    minds = {"m": f"{command} 0.5", "other": f"{command} 0.05"}
    # No global limit at all: its status line says "no cap".
    harness = Harness(
        tmp_path, minds=minds, limits={"adaptive": {"enabled": False}}, clock=FakeClock()
    )
    harnesses.append(harness)
    first = deliver(harness, "m", "s")
    harness.pump(lambda: log.started() == 1)
    reply = request(harness, op="pause", minds=["m"])
    assert reply["changed"] == ["m"] and [p["mind"] for p in reply["paused"]] == ["m"]
    folded = deliver(harness, "m", "s")  # its running session: still folds in
    a1, a2, b1 = deliver(harness, "m", "a"), deliver(harness, "m", "a"), deliver(harness, "m", "b")
    other = deliver(harness, "other")  # not paused: runs
    harness.pump(lambda: held_for(harness, a1, a2, b1) and other in log.runs())
    harness.pump(lambda: first in log.runs() and not harness.gate.state.turns.all())
    harness.advance(0.3)  # m's turn has ended: still nothing of a or b starts
    assert held_for(harness, a1, a2, b1)
    assert [row.attempts for row in rows(harness, a1, a2, b1)] == [0, 0, 0]
    assert log.runs() == {first: 1, folded: 1, other: 1}
    line = "0 turns (no cap), 3 held (paused), 0 backing off, 0 dead, 1 paused"
    assert statuses(notified)[-1] == line
    reply = request(harness, op="resume", minds=["m"])
    assert reply == {"v": 1, "ok": True, "changed": ["m"], "paused": []}
    harness.pump(lambda: settled(harness), timeout=15)
    starts = [[int(x) for x in fields[5:]] for fields in log.lines() if fields[0] == "start"]
    assert starts[-2:] == [[a1, a2], [b1]]  # the wake flush: in id order, a batch a session
    assert log.runs() == dict.fromkeys([first, folded, other, a1, a2, b1], 1)
    done = harness.gate.state.store.list_rows([QueueState.DONE])
    assert all(row.attempts == 0 for row in done)
    assert HoldReason.PAUSED in {e.reason for e in harness.journal.of(events.HoldEnded)}
    assert statuses(notified)[-1].endswith(", 0 paused")


def test_a_pause_of_every_mind_outlives_a_crash_and_covers_minds_configured_later(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    command, log = probe
    harness = Harness(tmp_path, minds={"m": command}, clock=FakeClock())
    harnesses.append(harness)
    reply = request(harness, op="pause")
    assert reply["changed"] == ["*"]
    held = deliver(harness, "m")  # acknowledged while paused
    harness.pump(lambda: held_for(harness, held))
    harness.crash()  # SIGKILL: nothing tidied; the pause is in the store
    harness.settings = gate_settings(tmp_path, harness.socket_path, minds={"m": command,
                                     "late": command})  # fmt: skip
    harness.restart()
    late = deliver(harness, "late")
    harness.pump(lambda: held_for(harness, held, late))
    harness.advance(0.3)
    assert log.started() == 0
    status = request(harness, op="status")["status"]
    assert [p["mind"] for p in status["paused"]] == ["*"]
    assert status["minds"]["late"]["paused_since"] == status["paused"][0]["since"]
    assert status["holds"] == {"paused": 2}
    assert request(harness, op="resume") == {"v": 1, "ok": True, "changed": ["*"], "paused": []}
    harness.pump(lambda: settled(harness), timeout=15)
    assert log.runs() == {held: 1, late: 1}


def test_pause_and_resume_refuse_bad_names_and_say_what_changed(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(tmp_path, minds={"m": "true", "n": "true"})
    harnesses.append(harness)
    peer = harness.connect()
    refused: list[tuple[dict[str, object], int, str]] = [
        ({"op": "pause", "minds": ["ghost"]}, EX_NOUSER, "unknown mind 'ghost'"),
        ({"op": "pause", "minds": ["m", "ghost"]}, EX_NOUSER, "unknown mind 'ghost'"),
        ({"op": "pause", "minds": []}, EX_DATAERR, "minds: empty"),
        ({"op": "pause", "minds": "m"}, EX_DATAERR, "minds: must be an array"),
        ({"op": "pause", "minds": [7]}, EX_DATAERR, "minds[0]: a mind name is a string"),
        ({"op": "pause", "minds": ["bad/name"]}, EX_DATAERR, "minds[0]: invalid mind name"),
        ({"op": "pause", "minds": ["x" * 100_000]}, EX_DATAERR, "minds[0]: invalid mind name"),
        ({"op": "resume", "minds": ["ghost"]}, EX_NOUSER, "unknown mind 'ghost'"),
    ]
    for fields, code, error in refused:
        reply = peer.request(fields)
        assert (reply["ok"], reply["code"]) == (False, code), (fields, reply)
        assert reply["error"].startswith(error) and len(reply["error"]) < 500, reply
    assert harness.gate.state.store.minds.pauses() == {}  # a refusal paused nothing
    assert peer.request({"op": "pause", "minds": ["m", "m"]})["changed"] == ["m"]
    again = peer.request({"op": "pause", "minds": ["m", "n"]})
    assert again["changed"] == ["n"]  # m was paused already: no error, and not changed
    assert [p["mind"] for p in again["paused"]] == ["m", "n"]
    assert peer.request({"op": "resume", "minds": ["n"]})["changed"] == ["n"]
    assert peer.request({"op": "resume", "minds": ["n"]})["changed"] == []  # not paused
    assert peer.request({"op": "pause"})["changed"] == ["*"]
    assert peer.request({"op": "pause", "minds": ["n"]})["changed"] == []  # all are
    alone = peer.request({"op": "resume", "minds": ["m"]})
    assert (alone["ok"], alone["code"]) == (False, EX_DATAERR)
    assert "every mind is paused" in alone["error"] and "volutectl resume" in alone["hint"]
    assert set(harness.gate.state.store.minds.pauses()) == {"*", "m"}
    assert sorted(peer.request({"op": "resume"})["changed"]) == ["*", "m"]
    assert peer.request({"op": "resume"})["changed"] == []
    assert peer.request({"op": "ping"}) == {"v": 1, "ok": True}


def test_a_paused_mind_removed_from_the_config_can_still_be_resumed(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(tmp_path, minds={"m": "true", "gone": "true"})
    harnesses.append(harness)
    assert request(harness, op="pause", minds=["gone"])["changed"] == ["gone"]
    harness.crash()
    harness.settings = gate_settings(tmp_path, harness.socket_path, minds={"m": "true"})
    harness.restart()
    assert "gone" in request(harness, op="status")["status"]["minds"]  # still shown: paused
    assert request(harness, op="resume", minds=["gone"])["changed"] == ["gone"]
    assert request(harness, op="resume", minds=["gone"])["code"] == EX_NOUSER


# -- the status line ---------------------------------------------------------------------


def test_the_status_line_is_sent_when_it_changes_not_on_every_pass(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness], notified: socket.socket
) -> None:
    command, log = probe
    harness = Harness(
        tmp_path,
        minds={"a": f"{command} 0.4", "b": f"{command} 0.4", "c": "exit 3"},
        limits={"global_concurrent_turns": 1, "adaptive": {"enabled": False}},  # held: global_cap
        max_attempts=1,
        clock=FakeClock(),
    )
    harnesses.append(harness)
    deliver(harness, "a")
    deliver(harness, "b")
    harness.pump(lambda: log.started() == 1)
    harness.advance(0.1)
    line = "1/1 turns, 1 held (global_cap), 0 backing off, 0 dead, 0 paused"
    assert statuses(notified)[-1] == line
    steps = harness.steps
    harness.advance(0.2)
    assert harness.steps > steps and statuses(notified) == []  # nothing changed: nothing sent
    deliver(harness, "c")
    harness.pump(lambda: settled(harness), timeout=15)
    seen = statuses(notified)
    assert seen[-1] == "0/1 turns, 0 held, 0 backing off, 1 dead, 0 paused"
    assert all(x != y for x, y in zip(seen, seen[1:], strict=False))  # each one a change


def test_the_status_line_names_every_hold_reason_the_cap_and_what_is_paused() -> None:
    holds: dict[str, int] = {
        HoldReason.GLOBAL_CAP: 2,
        HoldReason.PAUSED: 1,
        HoldReason.MIND_BUSY: 0,
    }
    line = status_line(
        turns=2, cap=2, test_runs=0, holds=holds, backing_off=1, dead=4, paused=frozenset({"m"})
    )
    assert line == "2/2 turns, 3 held (2 global_cap, 1 paused), 1 backing off, 4 dead, 1 paused"
    line = status_line(
        turns=1, cap=None, test_runs=1, holds={}, backing_off=0, dead=0, paused=admission.EVERY_MIND
    )
    assert line == "1 turn (no cap) + 1 test run, 0 held, 0 backing off, 0 dead, all paused"


def test_status_gives_each_mind_its_last_turn_attempts_and_next_retry(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(
        tmp_path,
        minds={"ok": "true", "flaky": "exit 4", "idle": "true"},
        max_attempts=2,
        backoff_initial_seconds=60,
    )
    harnesses.append(harness)
    flaky = deliver(harness, "flaky")
    first, second = deliver(harness, "ok", "a"), deliver(harness, "ok", "b")
    store = harness.gate.state.store
    harness.pump(lambda: rows(harness, flaky)[0].attempts == 1)
    harness.pump(lambda: all(r.state is QueueState.DONE for r in rows(harness, first, second)))
    minds = request(harness, op="status")["status"]["minds"]
    last = max(row.turn_id or 0 for row in rows(harness, first, second))
    assert (minds["ok"]["last_turn_id"], minds["ok"]["last_outcome"]) == (last, "ok")
    assert 0 <= minds["ok"]["last_turn_s"] < 10
    assert (minds["flaky"]["last_outcome"], minds["flaky"]["attempts"]) == ("failed", 1)
    assert 50 < minds["flaky"]["next_retry_s"] <= 60  # its backoff, counted down
    assert (minds["flaky"]["pending"], minds["flaky"]["dead"]) == (1, 0)
    assert minds["idle"] == {
        "running_sessions": [], "pending": 0, "paused_since": None, "attempts": 0,
        "next_retry_s": None, "last_turn_id": None, "last_turn_s": None,
        "last_outcome": None, "dead": 0,
    }  # fmt: skip
    assert set(store.minds.last_turns(["ok", "flaky", "idle", "ghost"])) == {"ok", "flaky"}


def test_a_pause_the_disk_cannot_store_is_75_and_pauses_nothing(
    tmp_path: Path, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = Harness(tmp_path, minds={"m": "true"})
    harnesses.append(harness)
    minds = harness.gate.state.store.minds

    def full(*args: object) -> list[str]:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(minds, "pause", full)
    reply = request(harness, op="pause", minds=["m"])
    assert (reply["ok"], reply["code"]) == (False, EX_TEMPFAIL)
    assert "disk is full" in reply["error"]
    assert harness.gate.state.paused == frozenset() and minds.pauses() == {}
    monkeypatch.undo()  # space again: the same gate pauses, and holds m's turns
    assert request(harness, op="pause", minds=["m"])["changed"] == ["m"]
    held = deliver(harness, "m")
    harness.pump(lambda: held_for(harness, held))
