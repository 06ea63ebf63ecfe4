"""Leases (issue 31) against the real gate in-process, with the fake systemd: acquire,
grant, release, joining, the FIFO among deliveries, a closed connection, the time
limit, the per-uid bound, an admin's end, and a claim after a restart.

The lease's scope is a turn scope (volutectl/gate/leases.py): these tests read what the
gate counts, what the fake systemd holds, and what the holder is told.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness, Peer, connect_as
from volutectl import events, faults
from volutectl.core.iocost import PROBATION_SECONDS
from volutectl.errors import EX_DATAERR, EX_NOPERM, EX_TEMPFAIL, VoluteError
from volutectl.kernel.written import Written
from volutectl.states import HoldReason, LeaseState, QueueState, TurnKind


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path, limits={"global_concurrent_turns": 1})
    yield h
    h.close()


def acquire(peer: Peer, mind: str = "mimsy", session: str = "main", **extra: Any) -> dict[str, Any]:
    reply = peer.request({"op": "acquire", "mind": mind, "session": session, **extra})
    assert reply["ok"] is True, reply
    return reply


def granted(peer: Peer) -> dict[str, Any]:
    event = peer.reply()
    assert event.get("event") == "lease_granted", event
    return event


def live_units(harness: Harness) -> set[str]:
    live, _ = harness.gate.state.liveness.count_live()
    return {harness.gate.state.turns.get(t.turn_id).unit for t in live}  # type: ignore[union-attr]


def test_an_acquire_is_granted_a_scope_that_counts_and_a_release_frees_it(
    harness: Harness,
) -> None:
    holder = harness.connect()
    reply = acquire(holder)
    assert reply["state"] == "waiting"
    grant = granted(holder)
    assert grant["created"] is True and grant["lease"] == reply["lease"]
    assert len(grant["token"]) == 32 and grant["pids_moved"] == 0
    assert grant["unit"] == f"volute-turn-mimsy-{grant['turn_id']}.scope"
    turn = harness.gate.state.store.turn(grant["turn_id"])
    assert turn is not None and turn.kind is TurnKind.LEASE
    assert live_units(harness) == {grant["unit"]}
    # The cap (1) is full: a delivery to another session waits for it.
    other = harness.connect().request(
        {"op": "deliver", "mind": "mimsy", "session": "s2", "message": "m"}
    )["id"]
    harness.pump(lambda: harness.gate.state.store.row(other).hold_reason is not None)  # type: ignore[union-attr]
    reply = holder.request({"op": "release", "lease": grant["lease"], "token": grant["token"]})
    assert reply == {"v": 1, "ok": True, "lease": grant["lease"], "released": True}
    harness.pump(lambda: harness.gate.state.store.row(other).state is QueueState.DONE)  # type: ignore[union-attr]
    assert harness.manager.active_state(grant["unit"]) in (None, "inactive")
    ended = harness.gate.state.store.turn(grant["turn_id"])
    assert ended is not None and ended.ended_at is not None


def test_a_delivery_to_a_leased_session_waits_mind_busy_and_runs_after_release(
    tmp_path: Path,
) -> None:
    harness = Harness(tmp_path, limits={"global_concurrent_turns": 4, "turns_per_mind": 2})
    try:
        holder = harness.connect()
        acquire(holder)
        grant = granted(holder)
        delivery = harness.deliver_ok()
        harness.pump(lambda: harness.gate.state.store.row(delivery).hold_reason is not None)  # type: ignore[union-attr]
        row = harness.gate.state.store.row(delivery)
        assert row is not None and row.hold_reason == HoldReason.MIND_BUSY
        assert row.state is QueueState.PENDING
        holder.request({"op": "release", "lease": grant["lease"], "token": grant["token"]})
        harness.pump(lambda: harness.gate.state.store.row(delivery).state is QueueState.DONE)  # type: ignore[union-attr]
    finally:
        harness.close()


def test_a_waiting_acquire_keeps_its_place_among_deliveries_and_the_cap_is_shared(
    tmp_path: Path,
) -> None:
    harness = Harness(
        tmp_path, limits={"global_concurrent_turns": 1}, minds={"a": "sleep 3", "b": "true"}
    )
    try:
        first = harness.deliver_ok(mind="a")  # runs, holds the one place
        harness.pump(lambda: len(harness.gate.state.turns.all()) == 1)
        holder = harness.connect()
        reply = acquire(holder, mind="b")
        after = harness.deliver_ok(mind="b", peer=harness.connect())  # behind the acquire
        harness.pump(lambda: harness.gate.state.leases.leases[reply["lease"]].reason is not None)  # type: ignore[union-attr]
        lease = harness.gate.state.leases.leases[reply["lease"]]  # type: ignore[union-attr]
        assert lease.reason == HoldReason.GLOBAL_CAP
        status = harness.connect().request({"op": "status"})
        [shown] = status["status"]["leases"]
        assert shown["state"] == "waiting" and shown["reason"] == "global_cap"
        grant = granted(holder)  # once the turn of `a` ended (3 s): before `after`
        assert harness.gate.state.store.row(first).state is QueueState.DONE  # type: ignore[union-attr]
        row = harness.gate.state.store.row(after)
        assert row is not None and row.state is QueueState.PENDING
        holder.request({"op": "release", "lease": grant["lease"], "token": grant["token"]})
        harness.pump(lambda: harness.gate.state.store.row(after).state is QueueState.DONE)  # type: ignore[union-attr]
    finally:
        harness.close()


def test_a_second_acquire_of_the_same_session_joins_and_ends_with_its_creator(
    harness: Harness,
) -> None:
    creator, joiner = harness.connect(), harness.connect()
    acquire(creator)
    first = granted(creator)
    reply = acquire(joiner)
    assert reply["state"] == "granted"
    joined = granted(joiner)
    assert joined["created"] is False and joined["turn_id"] == first["turn_id"]
    assert joined["unit"] == first["unit"] and joined["token"] != first["token"]
    assert len(live_units(harness)) == 1  # no new place
    creator.request({"op": "release", "lease": first["lease"], "token": first["token"]})
    ended = joiner.reply()
    assert ended == {
        "v": 1, "ok": True, "event": "lease_ended", "lease": joined["lease"],
        "reason": "creator_released",
    }  # fmt: skip


def test_a_closed_connection_ends_its_lease_and_drops_its_waiting_acquire(
    harness: Harness,
) -> None:
    holder, waiter = harness.connect(), harness.connect()
    acquire(holder)
    grant = granted(holder)
    waiting = acquire(waiter, mind="mimsy", session="other")
    assert waiting["state"] == "waiting"
    waiter.close()
    harness.pump(lambda: waiting["lease"] not in harness.gate.state.leases.leases)  # type: ignore[union-attr]
    holder.close()
    harness.pump(lambda: not harness.gate.state.turns.all())
    row = harness.gate.state.store.leases.get(grant["lease"])
    assert row is not None and row.reason == "closed"


def test_a_lease_holder_is_never_closed_as_idle(tmp_path: Path) -> None:
    clock = FakeClock()
    harness = Harness(tmp_path, clock=clock, client_idle_seconds=5.0)
    try:
        holder, idle = harness.connect(), harness.connect()
        idle.request({"op": "ping"})
        acquire(holder)
        granted(holder)
        harness.advance(60.0)
        assert idle.closed_by_gate()
        assert not holder.closed_by_gate()
        assert len(harness.gate.state.turns.all()) == 1
    finally:
        harness.close()


def test_release_checks_the_token_and_the_uid_and_the_lease(harness: Harness) -> None:
    holder = harness.connect()
    acquire(holder)
    grant = granted(holder)
    wrong = holder.request({"op": "release", "lease": grant["lease"], "token": "0" * 32})
    assert wrong["ok"] is False and wrong["code"] == EX_NOPERM and "token" in wrong["error"]
    unknown = holder.request({"op": "release", "lease": 999, "token": grant["token"]})
    assert unknown["ok"] is False and unknown["code"] == EX_DATAERR and "lease" in unknown["error"]
    bad = holder.request({"op": "release", "lease": grant["lease"], "token": "xyz"})
    assert bad["ok"] is False and bad["code"] == EX_DATAERR and "token" in bad["error"]


def test_an_acquire_with_pids_is_refused_naming_the_field(harness: Harness) -> None:
    reply = harness.connect().request({"op": "acquire", "mind": "mimsy", "pids": 1})
    assert reply["ok"] is False and reply["code"] == EX_DATAERR
    assert reply["error"].startswith("pids:")


MEMBER = 65534  # a uid other than root (nobody)


def test_the_per_uid_bound_refuses_past_it_and_another_uids_lease_is_refused(
    tmp_path: Path,
) -> None:
    harness = Harness(tmp_path, max_leases_per_uid=2)
    try:
        member = connect_as(harness, MEMBER)
        acquire(member, session="a")
        grant = granted(member)
        acquire(member, session="b")  # waits (mimsy's limit): held and awaited both count
        reply = member.request({"op": "acquire", "mind": "mimsy", "session": "c"})
        assert reply["ok"] is False and reply["code"] == EX_TEMPFAIL
        assert "gate.max_leases_per_uid" in reply["error"]
        root = harness.connect()  # root has no bound
        for session in ("d", "e", "f"):
            acquire(root, session=session)
        other = connect_as(harness, MEMBER - 1)
        taken = other.request({"op": "release", "lease": grant["lease"], "token": grant["token"]})
        assert taken["ok"] is False and taken["code"] == EX_NOPERM
        assert taken["error"].startswith("lease:")
        ended = root.request({"op": "release", "lease": grant["lease"], "token": grant["token"]})
        assert ended["ok"] is True  # root may
    finally:
        harness.close()


def test_an_admin_ends_a_lease_and_its_holder_is_told(harness: Harness) -> None:
    holder = harness.connect()
    acquire(holder)
    grant = granted(holder)
    member = connect_as(harness, MEMBER).request({"op": "end_lease", "lease": grant["lease"]})
    assert member["ok"] is False and member["code"] == EX_NOPERM
    reply = harness.connect().request({"op": "end_lease", "lease": grant["lease"]})
    assert reply == {"v": 1, "ok": True, "lease": grant["lease"], "ended": True}
    assert holder.reply() == {
        "v": 1, "ok": True, "event": "lease_ended", "lease": grant["lease"],
        "reason": "ended_by_admin",
    }  # fmt: skip
    harness.pump(lambda: not harness.gate.state.turns.all())


def test_a_lease_past_its_time_limit_is_stopped_and_its_holder_told_timeout(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    harness = Harness(tmp_path, clock=clock, turns={"max_runtime_seconds": 30})
    try:
        holder = harness.connect()
        acquire(holder)
        grant = granted(holder)
        harness.advance(31.0)
        harness.pump(lambda: holder.has_line())
        assert holder.reply() == {
            "v": 1, "ok": True, "event": "lease_ended", "lease": grant["lease"],
            "reason": "timeout",
        }  # fmt: skip
    finally:
        harness.close()


def test_a_lease_survives_a_gate_restart_and_is_claimed_or_ends_unclaimed(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    harness = Harness(tmp_path, clock=clock, lease_reclaim_seconds=30, limits={"turns_per_mind": 2})
    try:
        holder = harness.connect()
        acquire(holder, session="kept")
        kept = granted(holder)
        other = harness.connect()
        acquire(other, session="lost")
        lost = granted(other)
        harness.crash()
        harness.restart()
        harness.step(0)
        leases = harness.gate.state.leases
        assert leases is not None
        assert leases.leases[kept["lease"]].state is LeaseState.RECLAIM
        claimer = harness.connect()
        wrong = claimer.request({"op": "claim", "lease": kept["lease"], "token": lost["token"]})
        assert wrong["ok"] is False and wrong["code"] == EX_NOPERM
        reply = claimer.request({"op": "claim", "lease": kept["lease"], "token": kept["token"]})
        assert reply == {
            "v": 1, "ok": True, "lease": kept["lease"], "unit": kept["unit"],
            "turn_id": kept["turn_id"],
        }  # fmt: skip
        harness.advance(31.0)
        harness.pump(lambda: len(harness.gate.state.turns.all()) == 1)
        assert lost["lease"] not in leases.leases
        row = harness.gate.state.store.leases.get(lost["lease"])
        assert row is not None and row.reason == "reclaim_expired"
        assert leases.leases[kept["lease"]].state is LeaseState.HELD
    finally:
        harness.close()


def test_a_repeated_acquire_after_a_gate_restart_gets_the_same_lease_by_its_request_id(
    harness: Harness,
) -> None:
    """The connection was lost with the gate (before or after the grant came): the same
    uid's acquire with the same request_id answers the same lease, its grant again."""
    first = harness.connect()
    acquire(first, request_id="r1")
    grant = granted(first)
    harness.crash()
    harness.restart()
    again = harness.connect()
    reply = acquire(again, request_id="r1")
    assert reply == {"v": 1, "ok": True, "lease": grant["lease"], "state": "granted",
                     "already": True}  # fmt: skip
    assert granted(again) == grant
    assert len(harness.gate.state.turns.all()) == 1  # one place, as before
    other = acquire(harness.connect(), request_id="r2")
    assert other["lease"] != grant["lease"]


def test_a_closed_connection_s_request_id_starts_over(harness: Harness) -> None:
    first = harness.connect()
    acquire(first, request_id="r1")
    grant = granted(first)
    first.close()
    harness.pump(lambda: not harness.gate.state.turns.all())  # closing ended it
    again = harness.connect()
    reply = acquire(again, request_id="r1")
    assert reply["lease"] != grant["lease"]  # the first one ended with its connection


@pytest.mark.parametrize("point", faults.LEASE_POINTS)
def test_a_crash_at_each_step_of_a_grant_leaves_one_lease_at_most_and_no_unheld_scope(
    tmp_path: Path, point: str
) -> None:
    """In-process (tests/system/test_leases.py does it with a SIGKILL): the gate dies at
    `point`; the next one counts the lease once at most, and a scope nobody claims ends
    after gate.lease_reclaim_seconds, freeing the place for the next acquire."""
    clock = FakeClock()
    harness = Harness(tmp_path, clock=clock, lease_reclaim_seconds=30)
    try:
        holder = harness.connect()
        faults.arm(point)
        with pytest.raises(faults.SimulatedCrash):
            acquire(holder)
            holder.reply()
        faults.arm(None)
        harness.crash()
        harness.restart()
        harness.step(0)
        leases = harness.gate.state.leases
        assert leases is not None
        assert len(leases.leases) <= 1 and len(harness.gate.state.turns.all()) <= 1
        harness.advance(31.0)
        harness.pump(lambda: not harness.gate.state.turns.all())
        assert not leases.leases and harness.gate.state.store.leases.open() == []
        after = harness.connect()
        acquire(after)
        assert granted(after)["created"] is True
    finally:
        faults.arm(None)
        harness.close()


def test_an_acquire_after_a_release_waits_for_the_scope_to_go_rather_than_join_it(
    harness: Harness,
) -> None:
    first, second = harness.connect(), harness.connect()
    acquire(first)
    grant = granted(first)
    # Both in one pass: the release stops the scope, which is not gone yet.
    release = {"v": 1, "op": "release", "lease": grant["lease"], "token": grant["token"]}
    first.send(json.dumps(release).encode() + b"\n")
    second.send(json.dumps({"v": 1, "op": "acquire", "mind": "mimsy"}).encode() + b"\n")
    assert first.reply()["released"] is True
    assert second.reply()["state"] == "waiting"
    again = granted(second)
    assert again["created"] is True and again["turn_id"] != grant["turn_id"]


def test_a_leases_io_cost_is_learnt_for_its_mind_from_what_its_scope_wrote(
    tmp_path: Path,
) -> None:
    """As a turn's: its scope is sampled while it runs (the daemon's processes write
    there), and what it had written at its last sample is its mind's cost once it ends."""
    config = {"start": 2, "minimum": 1, "maximum": 4, "interval_seconds": 10.0}
    harness = Harness(tmp_path, limits={"adaptive": config}, clock=FakeClock())
    try:
        adaptive = harness.gate.state.adaptive
        assert adaptive is not None
        hands = harness.gate.state.turns.hands
        asked: list[list[int]] = []

        def sample(turn_ids: Sequence[int]) -> dict[int, Written]:
            asked.append(list(turn_ids))
            return {turn_id: Written(64 << 20, False) for turn_id in turn_ids}

        hands.sample = sample  # type: ignore[method-assign]
        holder = harness.connect()
        acquire(holder)
        grant = granted(holder)
        before = dict(adaptive.costs())
        harness.advance(PROBATION_SECONDS + 0.1)
        assert [grant["turn_id"]] in asked  # the lease's scope is sampled
        holder.request({"op": "release", "lease": grant["lease"], "token": grant["token"]})
        harness.pump(lambda: not harness.gate.state.turns.all())
        assert "mimsy" not in before and "mimsy" in adaptive.costs()  # learnt
    finally:
        harness.close()


def test_a_stop_the_launcher_refuses_is_tried_again_until_the_scope_goes(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    harness = Harness(tmp_path, clock=clock)
    try:
        holder = harness.connect()
        acquire(holder)
        grant = granted(holder)
        hands = harness.gate.state.turns.hands
        stop = hands.stop
        refusals: list[int] = []

        def refuse(turn_id: int, mind: str) -> None:
            refusals.append(turn_id)
            raise VoluteError("the launcher does not answer")

        hands.stop = refuse  # type: ignore[method-assign]
        holder.request({"op": "release", "lease": grant["lease"], "token": grant["token"]})
        assert refusals == [grant["turn_id"]]
        harness.advance(1.5)
        assert len(refusals) == 2  # tried again a second later
        assert len(harness.journal.of(events.ScopeStopFailed)) == 1  # said once
        hands.stop = stop  # type: ignore[method-assign]
        harness.advance(1.5)
        harness.pump(lambda: not harness.gate.state.turns.all())
    finally:
        harness.close()


def test_every_end_of_a_leases_scope_moves_its_processes_back_before_the_stop(
    tmp_path: Path,
) -> None:
    """docs/protocol.md, "A lease's processes": MoveBack before the scope's Stop, for a
    release, an admin's end, a closed connection and the time limit alike."""
    clock = FakeClock()
    harness = Harness(tmp_path, clock=clock, turns={"max_runtime_seconds": 30})
    hands = harness.gate.state.turns.hands
    asked: list[tuple[str, int]] = []
    move_back, stop = hands.move_back, hands.stop

    def spied_move_back(turn_id: int, mind: str) -> None:
        asked.append(("move_back", turn_id))
        move_back(turn_id, mind)

    def spied_stop(turn_id: int, mind: str) -> None:
        asked.append(("stop", turn_id))
        stop(turn_id, mind)

    hands.move_back, hands.stop = spied_move_back, spied_stop  # type: ignore[method-assign]
    try:
        ends: dict[str, Callable[[Peer, dict[str, Any]], object]] = {
            "release": lambda peer, grant: peer.request(
                {"op": "release", "lease": grant["lease"], "token": grant["token"]}
            ),
            "end_lease": lambda peer, grant: harness.connect().request(
                {"op": "end_lease", "lease": grant["lease"]}
            ),
            "close": lambda peer, grant: peer.close(),
            "timeout": lambda peer, grant: harness.advance(31.0),
        }
        for how, end in ends.items():
            asked.clear()
            holder = harness.connect()
            acquire(holder, session=how)
            grant = granted(holder)
            end(holder, grant)
            turn: int = grant["turn_id"]
            harness.pump(lambda: ("stop", turn) in asked)  # noqa: B023 - pumped at once
            assert asked[:2] == [("move_back", turn), ("stop", turn)], (how, asked)
            harness.pump(lambda: not harness.gate.state.turns.all())
    finally:
        harness.close()
