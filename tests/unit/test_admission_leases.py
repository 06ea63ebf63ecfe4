"""Admission with leases (issue 31): a lease is a place (PlaceKind.LEASE) counted as a
turn is, against the cap and its mind's limit; a waiting acquire keeps its FIFO place
among the deliveries; a delivery to a leased session waits `mind_busy`.

tests/unit/test_queueindex.py holds the gate's index to admission.admit over random
histories with acquires and leases; these are the rules, one by one, on admit()."""

from __future__ import annotations

from volutectl.core import admission
from volutectl.core.admission import Acquire, Delivery, Limits, LiveTurn, PlaceKind, Tally
from volutectl.states import HoldReason

NOW = 1000.0


def test_a_live_lease_is_a_place_of_its_mind_at_its_minds_cost() -> None:
    lease = LiveTurn(1, "pip", "main", lease=True)
    assert lease.kind is PlaceKind.LEASE
    limits = Limits(global_cap=4, costs={"pip": 0.5}, running_costs={"pip": 0.25})
    tally = Tally.of([lease], limits)
    assert (tally.busy, tally.running, tally.per_mind["pip"]) == (1, 1, 1)
    assert tally.load == 0.25  # what pip's running turns cost now


def test_a_lease_fills_the_cap_and_its_minds_limit() -> None:
    lease = LiveTurn(1, "pip", "main", lease=True)
    rows = [Delivery(1, "pip", "other"), Delivery(2, "whorl", "main")]
    decided = admission.admit(rows, [lease], Limits(global_cap=1), now=NOW)
    assert decided.starts == []
    assert {h.delivery_id: h.reason for h in decided.holds} == {
        1: HoldReason.MIND_BUSY,
        2: HoldReason.GLOBAL_CAP,
    }


def test_a_delivery_to_a_leased_session_waits_mind_busy_and_never_folds() -> None:
    lease = LiveTurn(1, "pip", "main", lease=True)
    limits = Limits(global_cap=4, turns_per_mind=2)
    decided = admission.admit([Delivery(1, "pip", "main")], [lease], limits, now=NOW)
    assert decided.folds == [] and decided.starts == []
    assert decided.holds == [admission.Hold(1, HoldReason.MIND_BUSY)]
    # A turn of another session of the same mind may start beside it (limit 2).
    other = admission.admit([Delivery(2, "pip", "s2")], [lease], limits, now=NOW)
    assert [s.delivery_ids for s in other.starts] == [(2,)]


def test_a_waiting_acquire_keeps_its_place_among_the_deliveries() -> None:
    rows = [Delivery(1, "a", "main"), Delivery(3, "c", "main")]
    acquire = Acquire(lease_id=7, mind="b", session="main", after=2)  # after 1 and 2
    limits = Limits(global_cap=2)
    decided = admission.admit(rows, [], limits, now=NOW, acquires=[acquire])
    assert [s.delivery_ids for s in decided.starts] == [(1,)]
    assert decided.grants == [7]  # ahead of delivery 3, which waits
    assert decided.holds == [admission.Hold(3, HoldReason.GLOBAL_CAP)]


def test_a_held_acquire_waits_with_the_reason_a_delivery_would() -> None:
    busy = LiveTurn(1, "a", "main")
    acquires = [Acquire(7, "b", "main", after=0), Acquire(8, "a", "s2", after=0)]
    paused = admission.admit(
        [], [busy], Limits(global_cap=1), now=NOW, acquires=acquires, paused={"b"}
    )
    assert dict(paused.lease_holds) == {7: HoldReason.PAUSED, 8: HoldReason.MIND_BUSY}
    capped = admission.admit([], [busy], Limits(global_cap=1, turns_per_mind=2), now=NOW,
                             acquires=acquires[1:])  # fmt: skip
    assert capped.lease_holds == [(8, HoldReason.GLOBAL_CAP)]


def test_an_acquire_of_a_session_a_turn_holds_waits_to_join_it() -> None:
    running = LiveTurn(1, "a", "main")
    decided = admission.admit(
        [], [running], Limits(global_cap=4, turns_per_mind=4), now=NOW,
        acquires=[Acquire(7, "a", "main", after=0)],
    )  # fmt: skip
    assert decided.grants == [] and decided.lease_holds == [(7, HoldReason.MIND_BUSY)]
