"""The real gate in-process with a mind that fails preflight: it says so when it starts,
`status` flags the mind until it is fixed, and a turn whose working directory is missing
fails to start with that reason (it used to run in / instead).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.gate_harness import ME, Harness
from volutectl import events
from volutectl.cli.statusview import format_status
from volutectl.config.settings import MindSettings
from volutectl.gate import handlers, status
from volutectl.gate.handlers import Caller
from volutectl.launcher import preflight
from volutectl.store.queue import Row
from volutectl.wire.messages import ConfigStatus, StatusReply, StatusRequest


@pytest.fixture
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    # A test may ask for a backoff of its own (indirect parametrization): one that must
    # see the gate between a failure and its retry needs more than 0.05 s under load.
    backoff = getattr(request, "param", 0.05)
    opened = Harness(
        tmp_path, start=False, backoff_initial_seconds=backoff, backoff_max_seconds=backoff
    )
    out = tmp_path / "pwd"
    minds = {
        "lost": MindSettings(command=f"pwd > {out}", user=ME, working_directory=tmp_path / "gone"),
        "home": MindSettings(command="true", user=ME),
    }
    opened.settings = opened.settings.model_copy(update={"minds": minds})
    opened.restart()
    yield opened
    opened.close()


def row_of(harness: Harness, delivery_id: int) -> Row:
    row = harness.gate.state.store.row(delivery_id)
    assert row is not None
    return row


def test_the_gate_names_each_failing_mind_when_it_starts(harness: Harness, tmp_path: Path) -> None:
    problems = f"working directory {tmp_path}/gone does not exist"
    assert len(harness.journal.messages("warning")) == 1
    [failing] = harness.journal.of(events.MindFailsPreflight)
    assert failing == events.MindFailsPreflight(mind="lost", problems=problems)
    assert failing.journal_fields() == {"mind": "lost"}


def test_a_missing_working_directory_fails_the_start_and_never_becomes_root(
    harness: Harness, tmp_path: Path
) -> None:
    delivery = harness.deliver_ok(mind="lost")
    harness.pump(lambda: row_of(harness, delivery).attempts == 1)
    error = f"working directory {tmp_path}/gone does not exist"
    assert row_of(harness, delivery).last_error == error
    [failed] = harness.journal.of(events.TurnStartFailed)
    assert (failed.turn_id, failed.mind, failed.session, failed.error) == (1, "lost", "main", error)
    assert harness.manager.scopes == {}  # nothing was forked, let alone put in a scope
    assert not (tmp_path / "pwd").exists()  # the command never ran, in / or anywhere
    # Once the directory is there, the retry runs in it.
    (tmp_path / "gone").mkdir()
    harness.pump(lambda: row_of(harness, delivery).state == "done")
    assert (tmp_path / "pwd").read_text().strip() == f"{tmp_path}/gone"


def test_status_flags_the_mind_until_it_is_fixed(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(preflight, "_clock", lambda: clock[0])
    peer = harness.connect()
    reply = peer.request({"op": "status"})
    problem = f"working directory {tmp_path}/gone does not exist"
    assert reply["status"]["preflight"] == {"lost": [problem]}
    status = StatusReply.from_wire(reply).status
    assert (
        f"preflight: mind lost cannot start turns: {problem}" in format_status(status).splitlines()
    )
    (tmp_path / "gone").mkdir()
    # Asked at most every RECHECK_SECONDS: it runs on the gate's loop.
    clock[0] += preflight.RECHECK_SECONDS - 0.1
    assert peer.request({"op": "status"})["status"]["preflight"] == {"lost": [problem]}
    clock[0] += 0.1
    assert peer.request({"op": "status"})["status"]["preflight"] == {}  # asked anew


# The retry's backoff outlasts the crash, the restart and the checks even on a loaded
# machine: with 0.05 s, a slow restart let the new gate retry (attempt 2) before the
# check that the first attempt is still counted.
@pytest.mark.parametrize("harness", [3.0], indirect=True)
def test_a_gate_killed_and_started_again_names_the_mind_again(
    harness: Harness, tmp_path: Path
) -> None:
    """A crash (SIGKILL: nothing tidied) between a failed start and the fix: the new gate
    says it at its own start, status still flags the mind, the failed attempt is still
    counted, and the delivery runs once the directory is there."""
    problem = f"working directory {tmp_path}/gone does not exist"
    delivery = harness.deliver_ok(mind="lost")
    harness.pump(lambda: row_of(harness, delivery).attempts == 1)
    harness.crash()
    harness.journal.entries.clear()
    harness.journal.events.clear()
    harness.restart()
    assert len(harness.journal.messages("warning")) == 1
    assert harness.journal.of(events.MindFailsPreflight) == [
        events.MindFailsPreflight(mind="lost", problems=problem)
    ]
    assert harness.connect().request({"op": "status"})["status"]["preflight"] == {"lost": [problem]}
    assert row_of(harness, delivery).attempts == 1
    assert row_of(harness, delivery).last_error == problem
    (tmp_path / "gone").mkdir()
    harness.pump(lambda: row_of(harness, delivery).state == "done")
    assert (tmp_path / "pwd").read_text().strip() == f"{tmp_path}/gone"


def test_a_client_sees_which_mind_fails_never_its_paths_an_admin_sees_all(
    harness: Harness, tmp_path: Path
) -> None:
    """Issue 29, finding 4's leak: a member's `status` named other minds' working
    directories and commands, from a config it may not read."""
    harness.gate.state.config = ConfigStatus(
        loaded_at=1.0, refused=f"minds.lost.command: {tmp_path}/secret-tool", refused_at=2.0
    )
    member = Caller(64001, frozenset({"volute"}))
    admin = Caller(64003, frozenset({"volute", "volute-admin"}))
    seen = handlers.status_handler(harness.gate.state, StatusRequest(), member).status
    wire = json.dumps(seen.to_wire())
    assert str(tmp_path) not in wire and "pwd >" not in wire, wire
    assert seen.preflight == {"lost": (status.WITHHELD,)}  # which mind, not why
    assert seen.config is not None and seen.config.refused == status.WITHHELD
    assert sorted(seen.minds) == ["home", "lost"]  # every mind's name and counts
    whole = handlers.status_handler(harness.gate.state, StatusRequest(), admin).status
    assert whole.preflight == {"lost": (f"working directory {tmp_path}/gone does not exist",)}
    assert whole.config is not None and str(tmp_path) in str(whole.config.refused)
    root = handlers.status_handler(harness.gate.state, StatusRequest(), Caller(0)).status
    assert root.to_wire() == whole.to_wire()
