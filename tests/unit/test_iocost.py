"""volutectl/core/iocost.py's costs per mind, and admission against the adaptive limit as
a budget of them (volutectl/core/admission.py): light turns pass while a heavy one
writes, FIFO holds, and no mind starves."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from volutectl.core.admission import Delivery, Limits, LiveTurn, admit
from volutectl.core.iocost import (
    FLOOR,
    FULL_BYTES,
    STARTING,
    UNKNOWN,
    WRITING_BYTES,
    Costs,
    Running,
    cost_of,
    mixed,
    running_cost,
    seen_writing,
    starting_cost,
    writes_now,
)
from volutectl.states import HoldReason

MIB = 1 << 20
REGIME = {HoldReason.GLOBAL_CAP, HoldReason.ADAPTIVE_LIMIT, HoldReason.TEST_RUN}
WRITER = HoldReason.WRITER_RUNNING


def test_a_cost_is_a_share_of_a_full_turn_rounded_up_to_a_power_of_two() -> None:
    assert cost_of(1.0) == 1.0
    assert cost_of(0.6) == 1.0
    assert cost_of(0.5) == 0.5
    assert cost_of(0.3) == 0.5
    assert cost_of(0.2) == 0.25
    assert cost_of(128 / 3072) == FLOOR  # the mixed workload's light turns
    assert cost_of(0.0) == FLOOR


def test_unknown_minds_are_not_listed_and_so_cost_one() -> None:
    costs = Costs().learn("heavy", 3 * MIB).learn("light", 128 << 10)
    assert costs.of() == {"heavy": 1.0, "light": FLOOR}
    assert Limits(costs=costs.of()).cost_of("new") == 1.0


def test_a_uniform_workload_costs_one_a_turn_whatever_its_noise() -> None:
    # Every turn alike: the limit counts turns, as before costs.
    costs = Costs()
    for i, written in enumerate([3.0, 3.1, 2.9, 3.05]):
        costs = costs.learn(f"m{i}", int(written * MIB))
    assert set(costs.of().values()) == {1.0}
    # Small writers alike are each a share of FULL_BYTES, not of the heaviest.
    costs = Costs().learn("a", 100 << 10).learn("b", 120 << 10)
    assert set(costs.of().values()) == {1 / 8}


def test_a_mind_that_turns_heavy_is_charged_at_once_and_one_that_turns_light_slowly() -> None:
    costs = Costs().learn("m", 128 << 10).learn("other", FULL_BYTES)
    assert costs.learn("m", FULL_BYTES).of()["m"] == 1.0
    lighter = Costs().learn("m", 4 * MIB).learn("other", 4 * MIB).learn("m", 0)
    assert lighter.of()["m"] == 0.5  # half believed after one light turn
    for _ in range(5):
        lighter = lighter.learn("m", 0)
    assert lighter.of()["m"] == FLOOR


def test_light_turns_pass_while_a_heavy_one_writes() -> None:
    costs = {"heavy1": 1.0} | {f"light{i}": FLOOR for i in range(8)}
    pending = [Delivery(i + 1, f"light{i}", "s") for i in range(8)]
    live = [LiveTurn(100, "heavy1", "s")]
    decided = admit(pending, live, Limits(adaptive=1, costs=costs), now=0.0)
    assert len(decided.starts) == 8 and decided.holds == []
    # Counted as turns, the same limit holds them all.
    decided = admit(pending, live, Limits(adaptive=1), now=0.0)
    assert decided.starts == []
    # A heavy turn behind light ones, at a limit of 1, starts too: the light ones fill
    # the last place, whichever came first.
    decided = admit(
        [Delivery(9, "heavy1", "s")],
        [LiveTurn(1, "light0", "s")],
        Limits(adaptive=1, costs=costs),
        now=0.0,
    )
    assert [start.mind for start in decided.starts] == ["heavy1"]


def test_light_turns_pass_a_heavy_one_the_limit_holds_until_they_fill_a_place() -> None:
    costs = {"heavy1": 1.0, "heavy2": 1.0} | {f"light{i}": FLOOR for i in range(20)}
    pending = [Delivery(1, "heavy2", "s")] + [Delivery(i + 2, f"light{i}", "s") for i in range(20)]
    live = [LiveTurn(100, "heavy1", "s")]
    decided = admit(pending, live, Limits(adaptive=1, costs=costs), now=0.0)
    assert [start.mind for start in decided.starts] == [f"light{i}" for i in range(15)]
    assert {(hold.delivery_id, hold.reason) for hold in decided.holds} == {
        (i, HoldReason.ADAPTIVE_LIMIT) for i in [1, 17, 18, 19, 20, 21]
    }
    # The limit's ceiling holds are FIFO: none passes.
    decided = admit(pending, live, Limits(global_cap=1, costs=costs), now=0.0)
    assert decided.starts == []


def test_a_light_turn_does_not_pass_while_light_ones_fill_a_place() -> None:
    # One heavy and sixteen light turns run (one place of light ones): the heavy one
    # held at 2 waits for no more than the heavy and the light turns running now, as
    # none passes it, though the budget has room for one more light one.
    costs = {"heavy1": 1.0, "heavy2": 1.0} | {f"light{i}": FLOOR for i in range(17)}
    live = [LiveTurn(100, "heavy1", "s")] + [LiveTurn(101 + i, f"light{i}", "s") for i in range(16)]
    pending = [Delivery(1, "heavy2", "s"), Delivery(2, "light16", "s")]
    decided = admit(pending, live, Limits(adaptive=2, costs=costs), now=0.0)
    assert decided.starts == []
    assert {hold.reason for hold in decided.holds} == {HoldReason.ADAPTIVE_LIMIT}
    # Ahead of the heavy one, it would have started.
    decided = admit(pending[1:], live, Limits(adaptive=2, costs=costs), now=0.0)
    assert [start.mind for start in decided.starts] == ["light16"]
    # One turn may always run: a heavy turn over the whole limit starts on an idle gate.
    decided = admit(pending, [], Limits(adaptive=1, costs=costs), now=0.0)
    assert [start.mind for start in decided.starts] == ["heavy2", "light16"]


def stream_of_deliveries(seed: int, limit: int, *, stagger: bool) -> None:
    """Deliveries to heavy and light minds arrive all the time for 300 passes; turns run
    1-5 passes. Asserts that only light turns pass a held delivery, that the oldest one
    starts within 11 passes of becoming the oldest, and, with writers one at a time
    (`stagger`: heavy turns write all their lives), that never two heavy turns run."""
    rng = random.Random(seed)
    minds = [f"h{i}" for i in range(3)] + [f"l{i}" for i in range(6)]
    costs = {m: 1.0 if m[0] == "h" else rng.choice([FLOOR, 0.25, 0.5]) for m in minds}
    pending: dict[int, Delivery] = {}
    live: dict[int, tuple[LiveTurn, int]] = {}  # turn id: (turn, the pass it ends at)
    oldest: tuple[int, int] | None = None  # (delivery id, the pass it became the oldest)
    next_id = 1
    for tick in range(300):
        for _ in range(rng.randrange(3)):
            pending[next_id] = Delivery(next_id, rng.choice(minds), "s")
            next_id += 1
        live = {k: v for k, v in live.items() if v[1] > tick}
        writers = sum(costs[turn.mind] >= 1 for turn, _ in live.values())
        assert writers <= 1 or not stagger
        limits = Limits(adaptive=limit, costs=costs, stagger=stagger, writers=writers)
        decided = admit(pending.values(), [turn for turn, _ in live.values()], limits, now=0.0)
        held = [h.delivery_id for h in decided.holds if h.reason in REGIME | {WRITER}]
        for start in decided.starts:
            if held and start.delivery_ids[0] > min(held):  # it passed a held one
                assert costs[start.mind] < 1
            turn = LiveTurn(start.delivery_ids[0], start.mind, start.session)
            live[turn.turn_id] = (turn, tick + rng.randint(1, 5))
        for taken in [s.delivery_ids for s in decided.starts] + [
            f.delivery_ids for f in decided.folds
        ]:
            for delivery_id in taken:
                del pending[delivery_id]
        if pending and (oldest is None or oldest[0] != min(pending)):
            oldest = (min(pending), tick)
        if oldest is not None and oldest[0] in pending:
            assert tick - oldest[1] <= 11, (oldest, tick)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 2, 3, 4]))
def test_no_mind_starves_while_light_deliveries_keep_coming(seed: int, limit: int) -> None:
    """Only light turns pass a delivery the caps hold, and only while the light turns
    cost less than a place. So the oldest delivery waits at most for its mind's turn to
    end, then for the whole turns then running: it starts within 11 passes of becoming
    the oldest, however many light ones come behind it."""
    stream_of_deliveries(seed, limit, stagger=False)


# -- writers one at a time (admission.writer_hold) ---------------------------------------


def test_a_writer_waits_while_one_writes_and_lighter_turns_go_past_it() -> None:
    costs = {"heavy1": 1.0, "heavy2": 1.0, "heavy3": 1.0} | {f"light{i}": FLOOR for i in range(3)}
    pending = [
        Delivery(1, "heavy2", "s"),
        Delivery(2, "light0", "s"),
        Delivery(3, "unknown", "s"),  # not known: it may write, as a heavy one may
        Delivery(4, "light1", "s"),
        Delivery(5, "heavy3", "s"),
    ]
    live = [LiveTurn(100, "heavy1", "s")]
    staggered = Limits(adaptive=3, costs=costs, stagger=True, writers=1)
    decided = admit(pending, live, staggered, now=0.0)
    assert [start.mind for start in decided.starts] == ["light0", "light1"]
    assert {(hold.delivery_id, hold.reason) for hold in decided.holds} == {
        (i, HoldReason.WRITER_RUNNING) for i in [1, 3, 5]
    }
    # The writer running has stopped writing (or ended): the oldest writer starts, and
    # the pass's own start holds the ones behind it.
    decided = admit(pending, live, replace(staggered, writers=0), now=0.0)
    assert [start.mind for start in decided.starts] == ["heavy2", "light0", "light1"]
    assert {hold.delivery_id for hold in decided.holds} == {3, 5}
    assert {hold.reason for hold in decided.holds} == {HoldReason.WRITER_RUNNING}
    # Where the gate has not seen writers among lighter turns, the limit alone decides:
    # two writers fit beside the one running at a limit of 3.
    decided = admit(pending, live, replace(staggered, stagger=False), now=0.0)
    assert [start.mind for start in decided.starts] == ["heavy2", "light0", "unknown", "light1"]
    assert {(hold.delivery_id, hold.reason) for hold in decided.holds} == {
        (5, HoldReason.ADAPTIVE_LIMIT)
    }


def test_a_writer_held_by_the_limit_says_writer_running_while_one_writes() -> None:
    # Both hold it; the writer running is what it waits for first, and `writer_running`
    # is not the limit's: it does not count as waiting at the limit, which it does not
    # grow (core/adaptive.py grows only while deliveries wait at it).
    costs = {"heavy1": 1.0, "heavy2": 1.0}
    live = [LiveTurn(100, "heavy1", "s")]
    limits = Limits(adaptive=1, costs=costs, stagger=True, writers=1)
    decided = admit([Delivery(1, "heavy2", "s")], live, limits, now=0.0)
    assert decided.holds[0].reason is HoldReason.WRITER_RUNNING
    decided = admit([Delivery(1, "heavy2", "s")], live, replace(limits, writers=0), now=0.0)
    assert decided.holds[0].reason is HoldReason.ADAPTIVE_LIMIT


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 2, 3, 4]))
def test_no_writer_starves_and_none_runs_beside_another_while_writers_go_one_at_a_time(
    seed: int, limit: int
) -> None:
    """As test_no_mind_starves_..., with writers one at a time: heavy turns write all
    their lives. Never two of them at once; a light turn passes a held one; and the
    oldest delivery still starts within a bounded number of passes, however many light
    ones come behind it: a held writer waits only for the writer running (1-5 passes)
    and its own mind's turn, and no writer starts past it."""
    stream_of_deliveries(seed, limit, stagger=True)


def test_writers_go_one_at_a_time_only_where_lighter_turns_are_as_many() -> None:
    heavy, light = 1.0, FLOOR
    # A mixed fan-out, warm: as many light minds as heavy ones, or more.
    assert mixed({"h": heavy, "l": light}, [])
    assert mixed({"h": heavy, "l1": light, "l2": light}, [])
    # Every turn writes, or none does: the limit alone decides.
    assert not mixed({"h1": heavy, "h2": heavy}, [])
    assert not mixed({"l1": light, "l2": light}, [])
    assert not mixed({}, [])
    # More writers than light turns: one at a time would cost the fan-out its time.
    assert not mixed({"h1": heavy, "h2": heavy, "l": light}, [])
    # Cold: what running turns show. One seen writing, one judged quiet.
    writer = Running("w", started=0.0).sample(0.2, MIB)
    quiet = Running("q", started=0.0).sample(0.2, 0)
    assert writer.writing and quiet.sampled is not None
    assert mixed({}, [writer, quiet])
    assert not mixed({}, [writer])
    assert not mixed({}, [quiet, Running("new", started=0.1)])  # not judged yet: neither
    # A light mind's turn seen writing is a writer, not a light one.
    assert not mixed({"w": light}, [writer])


def test_a_turn_writes_now_until_a_sample_shows_it_stopped() -> None:
    turn = Running("m", started=0.0)
    assert writes_now(turn, None)  # unknown, not judged yet: it may write
    assert writes_now(turn, 1.0)  # a known writer, not judged yet
    assert not writes_now(turn, FLOOR)  # a known light mind, not judged yet
    turn = turn.sample(0.2, MIB)
    assert writes_now(turn, None) and turn.writing
    turn = turn.sample(0.7, MIB + 4096)  # a little more in half a second: it waits now
    assert not writes_now(turn, None)
    assert turn.writing and running_cost(turn, None) == 1.0  # still a whole place
    turn = turn.sample(1.2, 2 * MIB)  # it writes again
    assert writes_now(turn, None)
    # Waiting on the disk, it wrote nothing since a sample 5 ms ago: still a writer.
    assert writes_now(turn.sample(1.205, 2 * MIB, blocked=True), None)
    # A quiet turn that is busy (running, say) is not one: it was never seen writing.
    quiet = Running("q", started=0.0).sample(0.2, 0)
    assert not writes_now(quiet.sample(0.7, 0, blocked=True), None)


def test_only_a_sample_that_shows_writing_is_seen_writing() -> None:
    # What starts writers' pause (gate/adaptive.py): evidence, not what a turn not
    # judged yet may do, which `writes_now` counts as well.
    turn = Running("m", started=0.0)
    assert writes_now(turn, None) and not seen_writing(turn)
    turn = turn.sample(0.2, MIB)
    assert seen_writing(turn)
    assert not seen_writing(turn.sample(0.7, MIB))  # stopped: nothing since
    assert seen_writing(turn.sample(0.7, MIB, blocked=True))  # a writer held on the disk
    quiet = Running("q", started=0.0).sample(0.2, 0)
    assert not seen_writing(quiet) and not seen_writing(quiet.sample(0.7, 0, blocked=True))


def test_samples_close_together_judge_a_writer_by_its_pace() -> None:
    # Samples come at every turn's probation's end: 5 ms after the last, 20 KiB is a
    # writer's pace (64 KiB a probation), and 1 KiB is not.
    turn = Running("m", started=0.0).sample(0.2, MIB)
    assert writes_now(turn.sample(0.205, MIB + 20 * 1024), None)
    assert not writes_now(turn.sample(0.205, MIB + 1024), None)
    assert not writes_now(turn.sample(0.205, MIB), None)


# -- what a running turn shows of its writes ---------------------------------------------

PROBATION = 0.5


def test_an_unknown_turn_costs_a_whole_place_until_a_sample_after_its_probation() -> None:
    turn = Running("new", started=10.0)
    assert running_cost(turn, None) == UNKNOWN
    turn = turn.sample(10.2, 0, probation=PROBATION)  # too early to tell: not started writing yet
    assert running_cost(turn, None) == UNKNOWN
    turn = turn.sample(10.5, 4096, probation=PROBATION)  # quiet for a whole probation: light
    assert running_cost(turn, None) == FLOOR
    turn = turn.sample(11.0, 4096 + 48 * 1024, probation=PROBATION)  # a little: still under WRITING
    assert running_cost(turn, None) == FLOOR


def test_a_turn_found_waiting_on_the_disk_is_not_judged_quiet_until_it_shows() -> None:
    # Behind a busy disk a heavy writer may wait in its first write, or the open before
    # it, past its probation, having written nothing: not quiet, only held up.
    turn = Running("held-up", started=0.0).sample(0.5, 0, blocked=True)
    assert running_cost(turn, None) == UNKNOWN and turn.sampled is None
    turn = turn.sample(1.0, 0, blocked=True)
    assert running_cost(turn, None) == UNKNOWN
    writer = turn.sample(1.5, WRITING_BYTES)  # it got through: a writer
    assert running_cost(writer, None) == 1.0
    quiet = turn.sample(1.5, 0)  # or it was a quiet turn's read: quiet once seen so
    assert running_cost(quiet, None) == FLOOR
    # Once judged, a wait on the disk is a write's like any other: it changes nothing.
    assert running_cost(quiet.sample(2.0, 0, blocked=True), None) == FLOOR


def test_a_turn_seen_writing_costs_a_whole_place_for_the_rest_of_its_life() -> None:
    turn = Running("heavy", started=0.0).sample(0.2, WRITING_BYTES, probation=PROBATION)
    assert turn.writing and running_cost(turn, None) == 1.0  # no need to wait: it writes
    # Slowed by the writers beside it, it writes less per sample: it stays whole, or more
    # writers at once would make each look lighter and let more in.
    for moment in (0.5, 1.0, 1.5):
        turn = turn.sample(moment, turn.written + 4096, probation=PROBATION)
    assert running_cost(turn, FLOOR) == 1.0


def test_a_quiet_turn_is_charged_its_minds_learnt_cost_and_what_it_wrote_so_far() -> None:
    quiet = Running("m", started=0.0).sample(1.0, 0, probation=PROBATION)
    assert running_cost(quiet, 1.0) == 1.0  # a heavy mind, between its writes: still heavy
    assert running_cost(quiet, FLOOR) == FLOOR
    grown = quiet
    for moment, written in ((1.5, 60 << 10), (2.0, 120 << 10), (2.5, 180 << 10), (3.0, 240 << 10)):
        grown = grown.sample(moment, written, probation=PROBATION)
    assert not grown.writing  # never WRITING_BYTES between two samples...
    assert running_cost(grown, FLOOR) == cost_of((240 << 10) / FULL_BYTES) == 0.25  # ...but so far


def test_a_sample_that_reads_less_than_the_last_moves_nothing_back() -> None:
    # A process that exited before the read, not yet reaped: its bytes are missed once.
    turn = Running("m", started=0.0).sample(0.6, 200 << 10, probation=PROBATION)
    again = turn.sample(1.2, 10 << 10, probation=PROBATION)
    assert again.written == 200 << 10 and running_cost(again, None) == running_cost(turn, None)


def test_the_maximum_bounds_the_turns_at_once_whatever_their_costs() -> None:
    pending = [Delivery(i, f"light{i}", "s") for i in range(1, 30)]
    costs = {f"light{i}": FLOOR for i in range(30)}
    without = admit(pending, [], Limits(adaptive=2, costs=costs), now=0.0)
    assert len(without.starts) == 29  # 29 at the floor's cost are under two places
    bounded = admit(pending, [], Limits(adaptive=2, costs=costs, adaptive_turns=16), now=0.0)
    assert len(bounded.starts) == 16
    assert {hold.reason for hold in bounded.holds} == {HoldReason.ADAPTIVE_LIMIT}
    live = [LiveTurn(100 + i, f"light{i}", "s") for i in range(1, 17)]
    running = Limits(adaptive=2, costs=costs, running_costs=costs, adaptive_turns=16)
    assert admit(pending[16:], live, running, now=0.0).starts == []


def test_running_turns_are_charged_what_they_show_and_new_ones_their_minds_cost() -> None:
    # Two unknown minds' turns run; a sample showed one quiet: a third unknown fits.
    live = [LiveTurn(1, "a", "s"), LiveTurn(2, "b", "s")]
    pending = [Delivery(3, "c", "s")]
    assert admit(pending, live, Limits(adaptive=2), now=0.0).starts == []
    shown = Limits(adaptive=2, running_costs={"a": FLOOR})
    [start] = admit(pending, live, shown, now=0.0).starts
    assert start.mind == "c"


def test_a_known_light_turn_costs_starting_until_a_sample_after_its_probation() -> None:
    """Its mind's learnt cost spreads what its turns wrote over their lives; the gate's
    own synced writes for a start, its scope and its program's first writes land at
    once. Judged by a sample after its probation, it costs what its mind has shown."""
    assert starting_cost(None) == UNKNOWN and starting_cost(1.0) == 1.0
    assert starting_cost(FLOOR) == STARTING
    turn = Running("light", started=0.0)
    assert running_cost(turn, FLOOR) == STARTING
    assert running_cost(turn.sample(0.1, 0, probation=PROBATION), FLOOR) == STARTING
    assert running_cost(turn.sample(0.5, 0, probation=PROBATION), FLOOR) == FLOOR


def test_a_warm_gate_starts_its_known_light_turns_a_few_at_a_time_not_all_in_one_pass() -> None:
    """Issue 32: a warm gate at a limit of 1 (its last fan-out met distress at 2) started
    one heavy writer and 15 light turns it knew in one pass, 16 at once, the maximum
    reached through costs: the probe behind their starts at 2.2x cap 2's p99. New turns
    priced as the gate prices them (`starting_cost` of each mind's learnt cost) start
    one beside the heavy writer per pass; once sampled, each costs its mind's floor and
    the next one starts."""
    learnt = Costs().learn("heavy", 3 * MIB)
    for i in range(15):
        learnt = learnt.learn(f"light{i}", 128 << 10)
    costs = learnt.of()
    assert costs["heavy"] == 1.0 and {costs[f"light{i}"] for i in range(15)} == {FLOOR}
    new = {mind: starting_cost(cost) for mind, cost in costs.items()}
    pending = [Delivery(0, "heavy", "s")] + [Delivery(i + 1, f"light{i}", "s") for i in range(15)]
    limits = Limits(adaptive=1, costs=new, adaptive_turns=16)
    first = admit(pending, [], limits, now=0.0)
    assert [start.mind for start in first.starts] == ["heavy", "light0"]
    # light0 sampled after its probation: it costs its mind's floor, one more starts.
    live = [LiveTurn(100, "heavy", "s"), LiveTurn(101, "light0", "s")]
    judged = Running("light0", started=0.0).sample(0.5, 0, probation=PROBATION)
    running = {"heavy": 1.0, "light0": running_cost(judged, costs["light0"])}
    second = admit(pending[2:], live, replace(limits, running_costs=running), now=0.5)
    assert [start.mind for start in second.starts] == ["light1"]
