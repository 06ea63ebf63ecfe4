"""Who may interrupt (issue 29, item 2), against the real gate in-process.

An --interrupt cuts a turn short only if every delivery that turn runs ahead of it is
its sender's own, or its sender was an admin when it delivered. One that may not folds
in as a plain delivery: no SIGINT, its ack says so, and the journal too. A turn cut
short is done only for whoever asked: another user's delivery it carried counts a
failed attempt and is tried again, never marked done by someone else's interrupt.

The tests run as root (as the test tier does); a member is this process with its
effective uid set to another for the moment of connect() (SO_PEERCRED records it), as
in tests/unit/test_gate_fair_shares.py. Root is the admin.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.unit.gate_harness import Harness, Peer, Turns, connect_as, settled
from volutectl import events
from volutectl.states import Outcome, QueueState

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="connects as other uids: needs root")

ALICE, BOB = 65534, 65533  # members of the socket's group, no admins


def deliver(peer: Peer, **fields: Any) -> dict[str, Any]:
    reply = peer.request(
        {"op": "deliver", "mind": "m", "session": "chat", "message": "m", **fields}
    )
    assert reply.get("ok") is True, reply
    return reply


def gate(tmp_path: Path, command: str, harnesses: list[Harness]) -> Harness:
    # A turn holds 3 s unless a SIGINT ends it (exit 130); a failed attempt is tried
    # again a tenth of a second later.
    harness = Harness(
        tmp_path, minds={"m": f"{command} 3 exit-on-int"}, backoff_initial_seconds=0.1
    )
    harnesses.append(harness)
    return harness


def row(harness: Harness, delivery_id: int) -> Any:
    found = harness.gate.state.store.row(delivery_id)
    assert found is not None
    return found


def test_a_members_interrupt_of_another_members_turn_folds_in_and_cuts_nothing(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    command, log = probe
    harness = gate(tmp_path, command, harnesses)
    alice = deliver(connect_as(harness, ALICE))["id"]
    harness.pump(lambda: log.started() == 1)
    ack = deliver(connect_as(harness, BOB), interrupt=True)
    bob = ack["id"]
    harness.pump(lambda: settled(harness), timeout=30)
    assert harness.manager.signals == []  # no SIGINT reached Alice's turn
    assert [f[4] for f in log.lines() if f[0] == "end"] == ["0"]  # it ran its course
    assert [(r.state, r.attempts) for r in (row(harness, alice), row(harness, bob))] == [
        (QueueState.DONE, 0),
        (QueueState.DONE, 0),
    ]
    assert ack.get("interrupt_refused") is True  # the ack said so
    assert not row(harness, bob).cut
    [refused] = harness.journal.of(events.InterruptRefused)
    assert (refused.delivery_id, refused.uid) == (bob, BOB)
    assert harness.journal.of(events.TurnInterrupted) == []


def test_an_admins_interrupt_cuts_a_members_turn_but_does_not_mark_her_delivery_done(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    command, log = probe
    harness = gate(tmp_path, command, harnesses)
    waiter = connect_as(harness, ALICE)
    alice = deliver(waiter, wait=True, progress=True)["id"]
    harness.pump(lambda: log.started() == 1)
    ack = deliver(harness.connect(), interrupt=True)  # root: an admin
    admin = ack["id"]
    assert "interrupt_refused" not in ack
    harness.pump(lambda: bool(harness.journal.of(events.TurnEnded)))
    [(unit, signum)] = harness.manager.signals
    assert unit.startswith("volute-turn-m-") and signum == signal.SIGINT
    [ended] = harness.journal.of(events.TurnEnded)
    assert (ended.outcome, ended.exit_status) == (Outcome.INTERRUPTED, 130)
    # The admin's delivery is done, as asked; Alice's counts a failed attempt, and her
    # wait goes on (told of the attempt, not of an end).
    hers = row(harness, alice)
    assert hers.state is QueueState.PENDING and hers.attempts == 1
    assert "another user's interrupt" in (hers.last_error or "")
    assert (row(harness, admin).state, row(harness, admin).cut) == (QueueState.DONE, True)
    told = waiter.reply()
    assert (told["event"], told["id"], told["outcome"]) == ("attempt_failed", alice, "interrupted")
    # Tried again, in a turn of its own that runs its course: done then, and only then.
    harness.pump(lambda: settled(harness), timeout=30)
    hers = row(harness, alice)
    assert (hers.state, hers.attempts) == (QueueState.DONE, 1)
    told = waiter.reply()
    assert (told["event"], told["id"], told["exit_code"]) == ("turn_ended", alice, 0)
    starts = [[int(i) for i in f[5:]] for f in log.lines() if f[0] == "start"]
    assert starts == [[alice], [alice]]


def test_a_members_interrupt_cuts_her_own_turn_and_her_deliveries_are_done(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    command, log = probe
    harness = gate(tmp_path, command, harnesses)
    first = deliver(connect_as(harness, ALICE))["id"]
    harness.pump(lambda: log.started() == 1)
    ack = deliver(connect_as(harness, ALICE), interrupt=True)
    assert "interrupt_refused" not in ack
    harness.pump(lambda: settled(harness), timeout=30)
    [(_, signum)] = harness.manager.signals
    assert signum == signal.SIGINT
    done = [row(harness, i) for i in (first, ack["id"])]
    assert [(r.state, r.attempts) for r in done] == [(QueueState.DONE, 0)] * 2
    assert log.started() == 1


def test_a_members_interrupt_behind_another_members_delivery_in_her_own_turn_is_refused(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    """Alice's turn took Bob's delivery in its inbox: it is no longer hers alone."""
    command, log = probe
    harness = gate(tmp_path, command, harnesses)
    alice = deliver(connect_as(harness, ALICE))["id"]
    harness.pump(lambda: log.started() == 1)
    bob = deliver(connect_as(harness, BOB))["id"]
    harness.pump(lambda: row(harness, bob).state is QueueState.RUNNING)
    ack = deliver(connect_as(harness, ALICE), interrupt=True)
    assert ack.get("interrupt_refused") is True
    harness.pump(lambda: settled(harness), timeout=30)
    assert harness.manager.signals == []
    ids = (alice, bob, ack["id"])
    assert [(row(harness, i).state, row(harness, i).attempts) for i in ids] == [
        (QueueState.DONE, 0)
    ] * 3


def test_who_cut_a_turn_short_outlives_a_gate_crash(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    """The fold's commit records which interrupt cut the turn: a gate that restarts
    while the turn winds down settles it as the first would have. The admin's delivery
    is done; Alice's counts a failed attempt."""
    command, log = probe
    harness = Harness(
        tmp_path, minds={"m": f"{command} 5 exit-on-int 0 1"}, backoff_initial_seconds=30
    )
    harnesses.append(harness)
    alice = deliver(connect_as(harness, ALICE))["id"]
    harness.pump(lambda: log.started() == 1)
    admin = deliver(harness.connect(), interrupt=True)["id"]
    harness.pump(lambda: bool(harness.journal.of(events.TurnInterrupted)))
    harness.crash()
    harness.restart()
    harness.pump(lambda: row(harness, alice).state is not QueueState.RUNNING, timeout=15)
    assert [f[4] for f in log.lines() if f[0] == "end"] == ["130"]
    hers = row(harness, alice)
    assert (hers.state, hers.attempts) == (QueueState.PENDING, 1)
    assert row(harness, admin).state is QueueState.DONE


def test_a_refused_interrupt_reaches_the_turn_as_a_plain_delivery(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    """The turn's inbox record of an interrupt that may not cut it says
    "interrupt": false; one that did, true."""
    seen = tmp_path / "seen"
    seen.mkdir()
    # Keeps what reaches its inbox, for 3 s, or until a SIGINT (keeping it then too).
    keep = f'for f in "$VOLUTE_INBOX"/*.json; do [ -e "$f" ] && mv "$f" {seen}/; done'
    keeper = (
        f"trap '{keep}; exit 130' INT; i=0; "
        f"while [ $i -lt 150 ]; do {keep}; sleep 0.02; i=$((i+1)); done"
    )
    harness = Harness(tmp_path, minds={"m": keeper})
    harnesses.append(harness)
    deliver(connect_as(harness, ALICE))
    harness.pump(lambda: bool(harness.gate.state.turns.all()))
    bob = deliver(connect_as(harness, BOB), interrupt=True)["id"]
    harness.pump(lambda: (seen / f"{bob}.json").exists())
    assert json.loads((seen / f"{bob}.json").read_text())["interrupt"] is False
    admin = deliver(harness.connect(), interrupt=True)["id"]
    harness.pump(lambda: settled(harness), timeout=30)
    assert json.loads((seen / f"{admin}.json").read_text())["interrupt"] is True
