"""The gate's pure core: admission, failure backoff and turn outcomes.

`admit()` is checked against generated queues and live turns (hypothesis) for the
invariants in DESIGN.md: the global cap, the per-mind limit, every delivery in exactly
one place, fold-in only into its own session, id order within a session, FIFO under the
cap, the pressure hold, and independence from input order.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from volutectl.core import admission
from volutectl.core.admission import (
    Admission,
    Delivery,
    Fold,
    Hold,
    Limits,
    LiveTurn,
    PlaceKind,
    Start,
    Taken,
)
from volutectl.states import HoldReason, Outcome, QueueState

NOW = 1_000_000.0
MINDS = ("ada", "bob", "cyd", "dee")
SESSIONS = ("main", "chat", "heartbeat")
# None: never failed; in the past or exactly now: backoff over; in the future: backing off.
NOT_BEFORE = (None, None, None, NOW - 30.0, NOW, NOW + 30.0)
OTHER_KINDS = (PlaceKind.SCOPE, PlaceKind.TEST_RUN)  # places of other work than turns


@st.composite
def limits_strategy(draw: st.DrawFn) -> Limits:
    overrides = draw(
        st.dictionaries(st.sampled_from(MINDS), st.integers(min_value=1, max_value=3), max_size=3)
    )
    return Limits(
        global_cap=draw(st.one_of(st.none(), st.integers(min_value=1, max_value=5))),
        turns_per_mind=draw(st.integers(min_value=1, max_value=3)),
        per_mind=overrides,
    )


@st.composite
def pending_strategy(draw: st.DrawFn) -> list[Delivery]:
    ids = draw(st.lists(st.integers(min_value=1, max_value=200), unique=True, max_size=30))
    return [
        Delivery(
            id=delivery_id,
            mind=draw(st.sampled_from(MINDS)),
            session=draw(st.sampled_from(SESSIONS)),
            interrupt=draw(st.booleans()),
            not_before=draw(st.sampled_from(NOT_BEFORE)),
        )
        for delivery_id in ids
    ]


@st.composite
def live_strategy(draw: st.DrawFn, limits: Limits, other_busy: int) -> list[LiveTurn]:
    """Live turns as a correct gate would leave them: within every limit."""
    room = None if limits.global_cap is None else max(0, limits.global_cap - other_busy)
    turn_ids = iter(
        draw(st.lists(st.integers(min_value=1, max_value=500), unique=True, min_size=16))
    )
    live: list[LiveTurn] = []
    for mind in MINDS:
        count = draw(st.integers(min_value=0, max_value=limits.for_mind(mind)))
        for _ in range(count):
            if room is not None and len(live) >= room:
                break
            live.append(LiveTurn(next(turn_ids), mind, draw(st.sampled_from(SESSIONS))))
    return draw(st.permutations(live))


@dataclass(frozen=True)
class Case:
    pending: list[Delivery]
    live: list[LiveTurn]
    limits: Limits
    others: tuple[Taken, ...]
    pressure: bool

    @property
    def other_reason(self) -> HoldReason:
        """Why other work holds a turn: test runs if any, else the cap itself."""
        test_runs = any(place.kind is PlaceKind.TEST_RUN for place in self.others)
        return HoldReason.TEST_RUN if test_runs else HoldReason.GLOBAL_CAP


@st.composite
def scenario(draw: st.DrawFn) -> Case:
    limits = draw(limits_strategy())
    kinds = draw(st.lists(st.sampled_from(OTHER_KINDS), max_size=2))
    return Case(
        pending=draw(pending_strategy()),
        live=draw(live_strategy(limits, len(kinds))),
        limits=limits,
        others=tuple(Taken(kind) for kind in kinds),
        pressure=draw(st.booleans()),
    )


def run(case: Case) -> Admission:
    return admission.admit(
        case.pending,
        case.live,
        case.limits,
        now=NOW,
        others=case.others,
        pressure=case.pressure,
    )


def backing_off(delivery: Delivery) -> bool:
    return delivery.not_before is not None and delivery.not_before > NOW


def check_invariants(case: Case, decision: Admission) -> None:
    pending, live, limits = case.pending, case.live, case.limits
    pressure, other_reason = case.pressure, case.other_reason
    by_id = {d.id: d for d in pending}
    live_by_id = {t.turn_id: t for t in live}
    started_ids = [i for start in decision.starts for i in start.delivery_ids]
    folded_ids = [i for fold in decision.folds for i in fold.delivery_ids]
    held_ids = [hold.delivery_id for hold in decision.holds]

    # Every eligible delivery is in exactly one place; backing-off ones in none.
    placed = Counter(started_ids + folded_ids + held_ids)
    assert all(n == 1 for n in placed.values()), placed
    assert set(placed) == {d.id for d in pending if not backing_off(d)}

    # The global cap, counting the places other work holds (others).
    busy = len(live) + len(case.others)
    if limits.global_cap is not None and decision.starts:
        assert busy + len(decision.starts) <= limits.global_cap

    # The per-mind limit, whatever the sessions.
    live_per_mind = Counter(t.mind for t in live)
    starts_per_mind = Counter(s.mind for s in decision.starts)
    for mind, n in starts_per_mind.items():
        assert live_per_mind[mind] + n <= limits.for_mind(mind)

    # A start is one new (mind, session), not one that already runs; its batch is one
    # session's rows, ascending.
    live_sessions = {(t.mind, t.session) for t in live}
    start_keys = [(s.mind, s.session) for s in decision.starts]
    assert len(start_keys) == len(set(start_keys))
    assert not set(start_keys) & live_sessions
    for start in decision.starts:
        assert start.delivery_ids
        assert list(start.delivery_ids) == sorted(start.delivery_ids)
        for i in start.delivery_ids:
            assert (by_id[i].mind, by_id[i].session) == (start.mind, start.session)

    # Folds go only into a live turn of the same (mind, session), and carry the interrupt.
    fold_targets = [fold.turn_id for fold in decision.folds]
    assert len(fold_targets) == len(set(fold_targets))
    for fold in decision.folds:
        turn = live_by_id[fold.turn_id]
        assert fold.delivery_ids and list(fold.delivery_ids) == sorted(fold.delivery_ids)
        for i in fold.delivery_ids:
            assert (by_id[i].mind, by_id[i].session) == (turn.mind, turn.session)
        assert fold.interrupt == any(by_id[i].interrupt for i in fold.delivery_ids)

    # Id order within a session: nothing later reaches a turn while something earlier of
    # the same session is held or backing off.
    taken = started_ids + folded_ids
    waiting = held_ids + [d.id for d in pending if backing_off(d)]
    for w in waiting:
        key = (by_id[w].mind, by_id[w].session)
        for t in taken:
            if (by_id[t].mind, by_id[t].session) == key:
                assert t < w, f"{t} reached a turn while earlier {w} of {key} waits"

    # Every hold has its reason.
    cap_reasons = {HoldReason.GLOBAL_CAP, other_reason}
    backing_ids = [d.id for d in pending if backing_off(d)]
    for hold in decision.holds:
        held = by_id[hold.delivery_id]
        if hold.reason == HoldReason.MIND_BUSY:
            assert live_per_mind[held.mind] + starts_per_mind[held.mind] >= limits.for_mind(
                held.mind
            )
        elif hold.reason in cap_reasons:
            assert limits.global_cap is not None
            assert busy + len(decision.starts) >= limits.global_cap
        elif hold.reason == HoldReason.BEHIND_BACKOFF:
            assert any(
                b < held.id and (by_id[b].mind, by_id[b].session) == (held.mind, held.session)
                for b in backing_ids
            )
        elif hold.reason == HoldReason.IO_PRESSURE:
            assert pressure and busy + len(decision.starts) >= 1
        else:
            raise AssertionError(f"unknown hold reason {hold.reason!r}")

    # FIFO: the cap (and the pressure budget) is given in id order. A delivery held for
    # them is never overtaken by a later delivery starting a new turn.
    first_ids = [min(start.delivery_ids) for start in decision.starts]
    for hold in decision.holds:
        if hold.reason in cap_reasons | {HoldReason.IO_PRESSURE}:
            assert all(first < hold.delivery_id for first in first_ids)

    # Under I/O pressure, at most one turn runs.
    if pressure:
        assert len(decision.starts) <= (0 if busy else 1)


@settings(max_examples=400)
@given(scenario())
def test_admit_keeps_every_invariant(case: Case) -> None:
    check_invariants(case, run(case))


@settings(max_examples=200)
@given(scenario(), st.randoms(use_true_random=False))
def test_admit_is_deterministic_and_ignores_input_order(case: Case, rng: random.Random) -> None:
    first = run(case)
    assert run(case) == first
    pending, live = list(case.pending), list(case.live)
    rng.shuffle(pending)
    rng.shuffle(live)
    assert run(replace(case, pending=pending, live=live)) == first


@settings(max_examples=200)
@given(scenario())
def test_admit_adds_nothing_when_live_turns_already_fill_the_cap(case: Case) -> None:
    assume(case.limits.global_cap is not None)
    assert case.limits.global_cap is not None
    # e.g. the cap was lowered while turns ran, or foreign scopes fill the slice.
    crowded = replace(case, others=(Taken(PlaceKind.SCOPE),) * (case.limits.global_cap + 1))
    decision = run(crowded)
    assert decision.starts == []
    check_invariants(crowded, decision)


@settings(max_examples=200)
@given(scenario())
def test_admit_pressure_starts_nothing_beside_a_live_turn_and_at_most_one_alone(
    case: Case,
) -> None:
    decision = run(replace(case, pressure=True))
    if case.live or case.others:
        assert decision.starts == []
    else:
        assert len(decision.starts) <= 1


# -- examples --------------------------------------------------------------------------


def fan_out(minds: int, per_mind: int, session: str = "main") -> list[Delivery]:
    """Rounds of one delivery to each mind, as a cron-aligned fan-out queues them."""
    ids = iter(range(1, minds * per_mind + 1))
    return [
        Delivery(next(ids), f"mind{m:02d}", session)
        for _round in range(per_mind)
        for m in range(minds)
    ]


def test_fan_out_33_minds_3_deliveries_cap_2_starts_exactly_2() -> None:
    pending = fan_out(33, 3)
    decision = admission.admit(pending, [], Limits(global_cap=2), now=NOW)
    assert decision.starts == [
        Start("mind00", "main", (1, 34, 67)),
        Start("mind01", "main", (2, 35, 68)),
    ]
    assert decision.folds == []
    assert len(decision.holds) == 99 - 6
    assert {hold.reason for hold in decision.holds} == {HoldReason.GLOBAL_CAP}
    assert [hold.delivery_id for hold in decision.holds] == sorted(
        d.id for d in pending if d.mind not in ("mind00", "mind01")
    )


def test_fan_out_release_goes_to_the_oldest_held_mind() -> None:
    pending = [d for d in fan_out(33, 3) if d.mind not in ("mind00", "mind01")]
    live = [LiveTurn(2, "mind01", "main")]  # mind00's turn ended, mind01's still runs
    decision = admission.admit(pending, live, Limits(global_cap=2), now=NOW)
    assert decision.starts == [Start("mind02", "main", (3, 36, 69))]


def test_three_aligned_heartbeats_queue_behind_a_cap_of_1() -> None:
    pending = [Delivery(i, mind, "heartbeat") for i, mind in enumerate(("a", "b", "c"), 1)]
    decision = admission.admit(pending, [], Limits(global_cap=1), now=NOW)
    assert decision.starts == [Start("a", "heartbeat", (1,))]
    assert decision.holds == [Hold(2, HoldReason.GLOBAL_CAP), Hold(3, HoldReason.GLOBAL_CAP)]


def test_unset_cap_is_unlimited_but_per_mind_serializes() -> None:
    pending = [Delivery(1, "a", "x"), Delivery(2, "a", "y"), Delivery(3, "b", "x")]
    decision = admission.admit(pending, [], Limits(), now=NOW)
    assert decision.starts == [Start("a", "x", (1,)), Start("b", "x", (3,))]
    assert decision.holds == [Hold(2, HoldReason.MIND_BUSY)]


def test_per_mind_override_allows_more_turns_for_that_mind() -> None:
    pending = [Delivery(1, "a", "x"), Delivery(2, "a", "y"), Delivery(3, "b", "x")]
    decision = admission.admit(pending, [], Limits(per_mind={"a": 2}), now=NOW)
    assert [s.delivery_ids for s in decision.starts] == [(1,), (2,), (3,)]


def test_delivery_to_a_session_mid_turn_folds_in() -> None:
    live = [LiveTurn(7, "a", "main")]
    pending = [Delivery(1, "a", "main"), Delivery(2, "a", "side"), Delivery(3, "a", "main")]
    decision = admission.admit(pending, live, Limits(global_cap=1), now=NOW)
    assert decision.starts == []
    assert decision.folds == [Fold(7, (1, 3), interrupt=False)]
    assert decision.holds == [Hold(2, HoldReason.MIND_BUSY)]


def test_fold_in_adds_no_concurrency_even_at_the_cap_or_under_pressure() -> None:
    live = [LiveTurn(7, "a", "main")]
    decision = admission.admit(
        [Delivery(1, "a", "main")], live, Limits(global_cap=1), now=NOW, pressure=True
    )
    assert decision.folds == [Fold(7, (1,), interrupt=False)]


def test_an_interrupting_delivery_marks_its_fold() -> None:
    live = [LiveTurn(7, "a", "main"), LiveTurn(8, "b", "main")]
    pending = [
        Delivery(1, "a", "main"),
        Delivery(2, "a", "main", interrupt=True),
        Delivery(3, "b", "main"),
    ]
    decision = admission.admit(pending, live, Limits(), now=NOW)
    assert decision.folds == [Fold(7, (1, 2), interrupt=True), Fold(8, (3,), interrupt=False)]


def test_an_interrupt_to_an_idle_session_just_starts_a_turn() -> None:
    decision = admission.admit([Delivery(1, "a", "main", interrupt=True)], [], Limits(), now=NOW)
    assert decision.starts == [Start("a", "main", (1,))]
    assert decision.folds == []


def test_rows_behind_a_backing_off_row_wait_in_id_order() -> None:
    pending = [
        Delivery(1, "a", "main", not_before=NOW + 5),
        Delivery(2, "a", "main"),
        Delivery(3, "a", "side"),
    ]
    decision = admission.admit(pending, [], Limits(), now=NOW)
    assert decision.starts == [Start("a", "side", (3,))]
    assert decision.holds == [Hold(2, HoldReason.BEHIND_BACKOFF)]


def test_rows_behind_a_backing_off_row_do_not_fold_either() -> None:
    live = [LiveTurn(7, "a", "main")]
    pending = [Delivery(1, "a", "main", not_before=NOW + 5), Delivery(2, "a", "main")]
    decision = admission.admit(pending, live, Limits(), now=NOW)
    assert decision == Admission([], [], [Hold(2, HoldReason.BEHIND_BACKOFF)])


def test_a_backoff_that_has_expired_is_eligible() -> None:
    pending = [Delivery(1, "a", "main", not_before=NOW), Delivery(2, "a", "main")]
    decision = admission.admit(pending, [], Limits(), now=NOW)
    assert decision.starts == [Start("a", "main", (1, 2))]


def test_other_busy_counts_against_the_cap_with_its_own_reason() -> None:
    pending = [Delivery(1, "a", "main"), Delivery(2, "b", "main")]
    decision = admission.admit(
        pending,
        [],
        Limits(global_cap=2),
        now=NOW,
        others=admission.other_work(test_runs=1),
    )
    assert decision.starts == [Start("a", "main", (1,))]
    # The gate's own turn now fills half the cap, test runs the rest: blame the runs.
    assert decision.holds == [Hold(2, HoldReason.TEST_RUN)]


def test_turns_alone_filling_the_cap_are_a_global_cap_hold() -> None:
    live = [LiveTurn(1, "a", "main"), LiveTurn(2, "b", "main")]
    decision = admission.admit(
        [Delivery(3, "c", "main")],
        live,
        Limits(global_cap=2),
        now=NOW,
        others=admission.other_work(test_runs=1),
    )
    assert decision.holds == [Hold(3, HoldReason.GLOBAL_CAP)]


def test_decide_says_of_one_head_whether_it_starts_or_what_holds_it() -> None:
    rules = admission.Rules(Limits(global_cap=3), paused={"p"})
    tally = admission.Tally.of([LiveTurn(1, "a", "main"), Taken(PlaceKind.TEST_RUN)], rules.limits)
    assert admission.decide("p", tally, rules) == HoldReason.PAUSED
    assert admission.decide("a", tally, rules) == HoldReason.MIND_BUSY
    assert admission.decide("b", tally, rules) is None
    tally.note("b", None, rules.limits)  # b starts: the cap is full, one place a test run's
    assert admission.decide("c", tally, rules) == HoldReason.TEST_RUN
    tally.note("c", HoldReason.TEST_RUN, rules.limits)
    assert tally.regime == HoldReason.TEST_RUN and tally.per_mind["b"] == 1
    # A mind's own holds are not the pass's regime.
    tally.note("a", HoldReason.MIND_BUSY, rules.limits)
    assert tally.regime == HoldReason.TEST_RUN


def test_the_kinds_of_places_other_work_holds_name_the_hold() -> None:
    pending = [Delivery(1, "a", "main")]
    live = [LiveTurn(7, "b", "main")]
    scopes = admission.other_work(scopes=2)
    both = admission.other_work(scopes=1, test_runs=1)
    # Other scopes in the slice are the cap's own; a test run among them names the hold.
    held = admission.admit(pending, live, Limits(global_cap=3), now=NOW, others=scopes)
    assert held.holds == [Hold(1, HoldReason.GLOBAL_CAP)]
    held = admission.admit(pending, live, Limits(global_cap=3), now=NOW, others=both)
    assert held.holds == [Hold(1, HoldReason.TEST_RUN)]
    # They hold places, not turns: work of mind a does not fill a's limit of turns.
    mine = [Taken(PlaceKind.TEST_RUN, mind="a")]
    started = admission.admit(pending, [], Limits(global_cap=3), now=NOW, others=mine)
    assert started.starts == [Start("a", "main", (1,))]


def test_a_place_of_other_work_costs_what_it_says_against_the_adaptive_limit() -> None:
    pending = [Delivery(1, "a", "main")]
    limits = Limits(adaptive=1)  # one whole place; light work leaves room beside it
    whole = [Taken(PlaceKind.TEST_RUN)]
    light = [Taken(PlaceKind.TEST_RUN, cost=0.25)]
    held = admission.admit(pending, [], limits, now=NOW, others=whole)
    assert held.holds == [Hold(1, HoldReason.TEST_RUN)]
    started = admission.admit(pending, [], limits, now=NOW, others=light)
    assert started.starts == [Start("a", "main", (1,))]


def test_pressure_holds_a_second_turn() -> None:
    pending = [Delivery(1, "a", "main"), Delivery(2, "b", "main")]
    decision = admission.admit(pending, [], Limits(), now=NOW, pressure=True)
    assert decision.starts == [Start("a", "main", (1,))]
    assert decision.holds == [Hold(2, HoldReason.IO_PRESSURE)]


def test_two_live_turns_of_one_session_fold_into_the_oldest_whatever_the_order() -> None:
    # After a restart the gate may adopt two turns of one session (limit 2).
    pending = [Delivery(5, "a", "main")]
    for live in ([LiveTurn(3, "a", "main"), LiveTurn(4, "a", "main")],
                 [LiveTurn(4, "a", "main"), LiveTurn(3, "a", "main")]):  # fmt: skip
        decision = admission.admit(pending, live, Limits(turns_per_mind=2), now=NOW)
        assert decision.folds == [Fold(3, (5,), interrupt=False)]


# -- after_failure --------------------------------------------------------------------------


def test_backoff_doubles_up_to_the_ceiling_then_dead_at_max_attempts() -> None:
    delays = []
    attempts = 0
    while True:
        after = admission.after_failure(attempts, now=NOW, max_attempts=10, initial=5, ceiling=300)
        assert after.attempts == attempts + 1
        attempts = after.attempts
        if after.state == "dead":
            assert after.not_before is None
            break
        assert after.state == "pending"
        assert after.not_before is not None
        delays.append(after.not_before - NOW)
    assert delays == [5, 10, 20, 40, 80, 160, 300, 300, 300]
    assert attempts == 10


def test_max_attempts_1_is_dead_at_the_first_failure() -> None:
    after = admission.after_failure(0, now=NOW, max_attempts=1, initial=5, ceiling=300)
    assert after == admission.AfterFailure(QueueState.DEAD, 1, None)


@given(
    attempts=st.integers(min_value=0, max_value=5000),
    max_attempts=st.integers(min_value=1, max_value=10_000),
    initial=st.floats(min_value=0.001, max_value=600),
    ceiling=st.floats(min_value=0.001, max_value=86400),
)
def test_after_failure_counts_one_attempt_and_never_waits_past_the_ceiling(
    attempts: int, max_attempts: int, initial: float, ceiling: float
) -> None:
    after = admission.after_failure(
        attempts, now=0.0, max_attempts=max_attempts, initial=initial, ceiling=ceiling
    )
    assert after.attempts == attempts + 1
    if attempts + 1 >= max_attempts:
        assert after == admission.AfterFailure(QueueState.DEAD, attempts + 1, None)
        return
    assert after.state == "pending" and after.not_before is not None
    delay = after.not_before
    assert min(initial, ceiling) <= delay <= ceiling
    # Never shorter than the previous failure's wait.
    if attempts >= 1:
        before = admission.after_failure(
            attempts - 1, now=0.0, max_attempts=max_attempts, initial=initial, ceiling=ceiling
        )
        assert before.not_before is not None and before.not_before <= after.not_before


# -- turn outcomes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exit_status", "started_marker", "released", "kind", "status"),
    [
        (0, False, False, "ok", 0),
        (0, True, True, "ok", 0),
        (3, True, True, "failed", 3),
        (130, True, True, "failed", 130),
        (None, True, True, "failed", None),
        (None, True, False, "failed", None),
        (None, False, True, "failed", None),
        (None, False, False, "never_ran", None),
    ],
)
def test_turn_outcome_table(
    exit_status: int | None, started_marker: bool, released: bool, kind: str, status: int | None
) -> None:
    outcome = admission.turn_outcome(
        exit_status=exit_status, started_marker=started_marker, released=released
    )
    assert (outcome.kind, outcome.exit_status) == (kind, status)
    assert outcome.detail


@pytest.mark.parametrize(
    ("recorded", "released", "timed_out", "kind", "carried", "failed"),
    [
        (Outcome.START_FAILED, False, False, "start_failed", False, True),  # issue 29's window
        (Outcome.OK, True, False, "ok", True, False),
        (Outcome.INTERRUPTED, True, False, "interrupted", True, False),
        (Outcome.TIMEOUT, True, True, "timeout", False, True),
        (Outcome.NEVER_RAN, False, False, "never_ran", False, False),
        (None, False, False, "never_ran", False, False),  # no turn on record: no attempt
        (None, True, False, "failed", False, True),  # released, no outcome: as after a crash
        (None, True, True, "timeout", False, True),
    ],
)
def test_a_row_stranded_under_a_closed_turn_settles_by_the_turns_recorded_outcome(
    recorded: Outcome | None,
    released: bool,
    timed_out: bool,
    kind: str,
    carried: bool,
    failed: bool,
) -> None:
    outcome = admission.stranded_outcome(
        recorded,
        exit_status=None,
        detail=None,
        released=released,
        interrupted=False,
        timed_out=timed_out,
    )
    assert (outcome.kind, outcome.kind.carried, outcome.kind.failed) == (kind, carried, failed)
    assert outcome.detail


@pytest.mark.parametrize(
    ("exit_status", "code"), [(0, 0), (3, 3), (255, 255), (256, 1), (-2, 1), (None, 1)]
)
def test_wait_exit_code(exit_status: int | None, code: int) -> None:
    assert admission.wait_exit_code(exit_status) == code


@pytest.mark.parametrize(
    ("exit_status", "started", "released", "interrupted", "kind"),
    [
        (143, True, True, False, "timeout"),  # SIGTERM at the limit, status recorded
        (None, True, True, False, "timeout"),  # SIGKILLed with its wrapper
        (0, True, True, False, "timeout"),  # finished during the grace: still too late
        (130, True, True, True, "timeout"),  # a time limit outranks an interrupt
        (None, False, False, False, "never_ran"),  # stopped before it ever ran: no attempt
    ],
)
def test_a_timed_out_turn_is_a_timeout_unless_it_never_ran(
    exit_status: int | None, started: bool, released: bool, interrupted: bool, kind: str
) -> None:
    outcome = admission.turn_outcome(
        exit_status=exit_status,
        started_marker=started,
        released=released,
        interrupted=interrupted,
        timed_out=True,
    )
    assert outcome.kind == kind
    assert outcome.exit_status == exit_status


def test_an_interrupted_turn_that_exits_non_zero_carries_its_deliveries() -> None:
    outcome = admission.turn_outcome(
        exit_status=130, started_marker=True, released=True, interrupted=True
    )
    assert outcome.kind == "interrupted"


def test_a_timeout_waits_with_124_as_timeout1_does() -> None:
    assert admission.wait_exit_code(143, Outcome.TIMEOUT) == 124
    assert admission.wait_exit_code(None, Outcome.TIMEOUT) == 124
    assert admission.wait_exit_code(143, Outcome.FAILED) == 143


@pytest.mark.parametrize(
    ("deadline", "stopped_at", "ended_at", "now", "timed_out"),
    [
        (None, None, None, 100.0, False),  # no limit
        (50.0, 40.0, None, 45.0, True),  # the gate stopped it: its record decides
        (50.0, None, 49.0, 200.0, False),  # ended (status written) before its deadline
        (50.0, None, 50.0, 200.0, True),  # ended at the deadline: systemd's backstop
        (50.0, None, None, 49.0, False),  # no status, and the deadline not yet reached
        (50.0, None, None, 51.0, True),  # no status, found after the deadline
    ],
)
def test_timed_out_from_the_gates_record_or_the_turns_end(
    deadline: float | None,
    stopped_at: float | None,
    ended_at: float | None,
    now: float,
    timed_out: bool,
) -> None:
    assert (
        admission.timed_out(deadline, stopped_at=stopped_at, ended_at=ended_at, now=now)
        is timed_out
    )


def test_a_paused_mind_starts_nothing_but_its_running_session_still_folds() -> None:
    pending = [
        Delivery(1, "a", "chat"),  # a's running session: folds
        Delivery(2, "a", "dm"),  # a new turn of a: held, paused
        Delivery(3, "b", "main"),  # b is not paused
    ]
    decision = admission.admit(
        pending, [admission.LiveTurn(7, "a", "chat")], Limits(turns_per_mind=2), now=0.0,
        paused={"a"},
    )  # fmt: skip
    assert decision.folds == [admission.Fold(7, (1,), False)]
    assert decision.holds == [Hold(2, HoldReason.PAUSED)]
    assert decision.starts == [admission.Start("b", "main", (3,))]
    everyone = admission.admit(pending, [], Limits(), now=0.0, paused=admission.EVERY_MIND)
    assert everyone.starts == [] and {h.reason for h in everyone.holds} == {HoldReason.PAUSED}


# -- who may interrupt (issue 29, item 2) ---------------------------------------------------

ALICE, BOB, ROOT = 1001, 1002, 0
Sent = admission.Sent


def test_an_interrupt_may_cut_a_turn_of_its_senders_own_deliveries_only_unless_an_admins() -> None:
    assert admission.may_interrupt(ALICE, False, [ALICE, ALICE])
    assert admission.may_interrupt(ALICE, False, [])  # nothing ahead of it
    assert not admission.may_interrupt(BOB, False, [ALICE])
    assert not admission.may_interrupt(ALICE, False, [ALICE, BOB])
    assert admission.may_interrupt(ROOT, True, [ALICE, BOB])  # an admin's, any turn
    assert admission.may_interrupt(BOB, True, [ALICE])  # volute-admin when it delivered
    assert not admission.may_interrupt(None, False, [None])  # a sender not known owns nothing


def test_each_interrupt_of_a_fold_is_judged_on_what_the_turn_runs_ahead_of_it() -> None:
    fold = [
        Sent(5, BOB, interrupt=True),
        Sent(6, ALICE, interrupt=True),  # behind Bob's delivery: not Alice's turn alone
        Sent(7, ROOT, interrupt=True, admin=True),
    ]
    assert admission.interrupts_that_cut([BOB], fold) == (5, 7)
    assert admission.interrupts_that_cut([ALICE], fold) == (7,)
    # A delivery of another that comes after an interrupt does not undo it.
    assert admission.interrupts_that_cut([ALICE], [Sent(9, BOB), Sent(8, ALICE, True)]) == (8,)
    assert admission.interrupts_that_cut([ALICE], [Sent(8, ALICE), Sent(9, BOB)]) == ()


def test_an_interrupted_turn_is_done_only_for_whoever_cut_it() -> None:
    rows = [
        Sent(1, ALICE),
        Sent(2, ALICE),
        Sent(3, ROOT, interrupt=True, admin=True, cut=True),
        Sent(4, BOB, interrupt=True),  # refused: folded in as a plain delivery
        Sent(5, ROOT),  # the admin's own too
        Sent(6, ALICE),  # not taken from the inbox
    ]
    settled = admission.settle(Outcome.INTERRUPTED, rows, not_taken={6})
    assert settled.done == (3, 5)
    assert settled.failed == settled.cut_by_other == (1, 2, 4)
    assert settled.returned == (6,)
    # A turn that exits 0 did its work, whoever asked what; a failure fails them all.
    assert admission.settle(Outcome.OK, rows, {6}).done == (1, 2, 3, 4, 5)
    assert admission.settle(Outcome.FAILED, rows, {6}).failed == (1, 2, 3, 4, 5)
    assert admission.settle(Outcome.TIMEOUT, rows, {6}).cut_by_other == ()
    assert admission.settle(Outcome.NEVER_RAN, rows, {6}).returned == (6, 1, 2, 3, 4, 5)
    # Interrupted before volutectl recorded who cut it: done whole, as it was then.
    legacy = [Sent(1, None), Sent(2, ALICE, interrupt=True)]
    assert admission.settle(Outcome.INTERRUPTED, legacy).done == (1, 2)


@given(
    st.lists(
        st.tuples(st.sampled_from([ALICE, BOB, ROOT, None]), st.booleans(), st.booleans()),
        max_size=12,
    ),
    st.sampled_from(list(Outcome)),
    st.sets(st.integers(min_value=0, max_value=12)),
)
def test_no_delivery_is_done_by_another_users_interrupt(
    drawn: list[tuple[int | None, bool, bool]], kind: Outcome, not_taken: set[int]
) -> None:
    """Every row lands in exactly one place; under an interrupt, a row is done only if
    its sender cut the turn; a row is never lost."""
    rows = [
        Sent(i, uid, interrupt=cut or asked, cut=cut) for i, (uid, asked, cut) in enumerate(drawn)
    ]
    settled = admission.settle(kind, rows, not_taken)
    placed = settled.done + settled.returned + settled.failed
    assert sorted(placed) == [row.id for row in rows]
    assert set(settled.cut_by_other) <= set(settled.failed)
    cutters = {row.uid for row in rows if row.cut}
    if kind is Outcome.INTERRUPTED and cutters:
        for row in rows:
            if row.id in settled.done:
                assert row.cut or (row.uid is not None and row.uid in cutters)
