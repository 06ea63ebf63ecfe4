"""The incremental index decides exactly what admission.admit decides over the same rows.

Random histories: deliveries arrive (some backing off after a failure, some returned to
the queue with their old ids), turns start and fold as decided, turns end, time passes,
minds are paused and resumed, pressure and other work come and go, limits and the
minds' IO costs (of new turns and of running ones) change, acquires wait among the
deliveries and leases hold places. After every step both admissions run over the same
state, and must agree on the starts, the folds, the hold reason of every pending row
(what the store records for it), the acquires granted, and every waiting one's reason.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from volutectl.core import admission
from volutectl.core.admission import Acquire, Delivery, Limits, LiveTurn, PlaceKind, Taken
from volutectl.states import HoldReason
from volutectl.store.index import PendingIndex

MINDS = ["a", "b", "c", "d"]
SESSIONS = ["x", "y", "z"]


@dataclass
class World:
    """The store's pending rows and systemd's live turns, as the gate would see them."""

    index: PendingIndex = field(default_factory=PendingIndex)
    pending: dict[int, Delivery] = field(default_factory=dict)
    live: dict[int, LiveTurn] = field(default_factory=dict)
    next_id: int = 1
    next_turn: int = 1
    now: float = 1000.0
    paused: set[str] = field(default_factory=set)
    all_paused: bool = False
    pressure: bool = False
    others: tuple[Taken, ...] = ()  # the places other work holds
    max_starts: int | None = None
    limits: Limits = field(default_factory=lambda: Limits(global_cap=2))
    taken: list[Delivery] = field(default_factory=list)  # rows that left for a turn
    acquires: dict[int, Acquire] = field(default_factory=dict)  # waiting, by lease id
    next_lease: int = 1

    def add(self, row: Delivery) -> None:
        self.pending[row.id] = row
        self.index.add(row)

    def remove(self, ids: list[int]) -> None:
        for i in ids:
            self.taken.append(self.pending.pop(i))
        self.index.remove(ids)

    def step(self) -> None:
        """One admission pass both ways; they must agree; then carry out its decisions."""
        paused = admission.EVERY_MIND if self.all_paused else frozenset(self.paused)
        arguments = dict(
            now=self.now, others=self.others, pressure=self.pressure,
            max_starts=self.max_starts, acquires=list(self.acquires.values()),
        )  # fmt: skip
        live = list(self.live.values())
        full = admission.admit(self.pending.values(), live, self.limits, paused=paused, **arguments)  # type: ignore[arg-type]
        fast, _ = self.index.admit(
            live,
            self.limits,
            paused=self.paused,
            all_paused=self.all_paused,
            **arguments,  # type: ignore[arg-type]
        )
        assert fast.starts == full.starts
        assert fast.folds == full.folds
        assert fast.grants == full.grants
        assert sorted(fast.lease_holds) == sorted(full.lease_holds)
        assert len(full.grants) + len(full.lease_holds) == len(self.acquires)
        taken = {i for s in full.starts for i in s.delivery_ids}
        taken |= {i for f in full.folds for i in f.delivery_ids}
        reasons = {hold.delivery_id: hold.reason for hold in full.holds}
        for row_id in self.pending:
            if row_id not in taken:
                assert self.index.recorded[row_id] == reasons.get(row_id), (row_id, self)
        counts: dict[HoldReason, int] = {}
        for reason in reasons.values():
            counts[reason] = counts.get(reason, 0) + 1
        assert dict(self.index.counts) == counts
        for start in full.starts:
            turn = LiveTurn(self.next_turn, start.mind, start.session)
            self.live[turn.turn_id] = turn
            self.next_turn += 1
            self.remove(list(start.delivery_ids))
        for fold in full.folds:
            self.remove(list(fold.delivery_ids))
        for lease_id in full.grants:
            acquire = self.acquires.pop(lease_id)
            lease = LiveTurn(self.next_turn, acquire.mind, acquire.session, lease=True)
            self.live[lease.turn_id] = lease
            self.next_turn += 1


ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["deliver", "deliver", "deliver", "fail", "return", "end", "tick", "pause",
             "resume", "pause_all", "pressure", "other", "drop", "limits", "acquire",
             "acquire", "acquire", "acquire", "give_up"]
        ),
        st.integers(0, 10_000),
    ),
    min_size=1,
    max_size=120,
)  # fmt: skip


def apply(world: World, op: str, seed: int) -> None:
    rng = random.Random(seed)
    if op == "deliver":
        row = Delivery(world.next_id, rng.choice(MINDS), rng.choice(SESSIONS), rng.random() < 0.2)
        world.next_id += 1
        world.add(row)
    elif op in ("fail", "return") and world.taken:
        # A turn failed (back with a backoff) or never ran (back as it was), old id kept.
        row = world.taken.pop(rng.randrange(len(world.taken)))
        backoff = world.now + rng.choice([1.0, 5.0, 30.0]) if op == "fail" else None
        world.add(Delivery(row.id, row.mind, row.session, row.interrupt, backoff))
    elif op == "acquire":
        # A waiting acquire: behind every delivery stored before it.
        mind, session = rng.choice(MINDS), rng.choice(SESSIONS)
        world.acquires[world.next_lease] = Acquire(
            world.next_lease, mind, session, world.next_id - 1
        )
        world.next_lease += 1
    elif op == "give_up" and world.acquires:
        del world.acquires[rng.choice(sorted(world.acquires))]  # its connection closed
    elif op == "end" and world.live:
        del world.live[rng.choice(sorted(world.live))]
    elif op == "tick":
        world.now += rng.choice([0.5, 2.0, 10.0, 40.0])
        if rng.random() < 0.5:
            # The gate asks when to wake next before its pass: a backoff that ended
            # meanwhile must still be seen by that pass, and is due now.
            wake = world.index.next_backoff(after=world.now)
            assert wake is None or wake >= world.now
    elif op == "pause":
        world.paused.add(rng.choice(MINDS))
    elif op == "resume":
        world.paused.discard(rng.choice(MINDS))
        world.all_paused = False if rng.random() < 0.5 else world.all_paused
    elif op == "pause_all":
        world.all_paused = not world.all_paused
    elif op == "pressure":
        world.pressure = not world.pressure
        world.max_starts = rng.choice([None, None, 0, 1])
    elif op == "other":
        kinds = [PlaceKind.SCOPE, PlaceKind.TEST_RUN]
        costs = [None, None, 0.5]  # None: one place; a place may say its own IO cost
        world.others = tuple(
            Taken(rng.choice(kinds), cost=rng.choice(costs)) for _ in range(rng.randrange(3))
        )
    elif op == "drop" and world.pending:
        world.index.remove([world.pending.pop(rng.choice(sorted(world.pending))).id])
    elif op == "limits":
        world.limits = Limits(
            global_cap=rng.choice([None, 1, 2, 3]),
            turns_per_mind=rng.choice([1, 2]),
            per_mind={"a": rng.choice([1, 3])},
            adaptive=rng.choice([None, None, 1, 2, 4]),
            # IO costs per mind (core/iocost.py): the budget holds a heavy head and,
            # FIFO, every lighter delivery behind it.
            costs=rng.choice([{}, {"a": 0.25, "b": 0.5}, {"c": 0.0625, "d": 0.125}]),
            # What running turns cost now (core/iocost.py's samples), and the adaptive
            # limit's bound on turns at once whatever their costs.
            running_costs=rng.choice([{}, {"a": 0.0625, "c": 1.0}, {"b": 1.0, "d": 0.0625}]),
            adaptive_turns=rng.choice([None, None, 2, 3]),
            # Writers one at a time (core/iocost.py's `mixed`): a whole place waits
            # while one may be writing, and lighter heads go past it.
            stagger=rng.choice([False, True, True]),
            writers=rng.choice([0, 0, 1, 2]),
        )


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_the_index_decides_what_full_admission_decides(history: list[tuple[str, int]]) -> None:
    world = World()
    for op, seed in history:
        apply(world, op, seed)
        world.step()


def test_a_deep_queue_held_by_the_cap_costs_no_writes_per_delivery() -> None:
    world = World(limits=Limits(global_cap=1))
    for i in range(1, 2001):
        world.add(Delivery(i, f"m{i % 100}", "s"))
    world.step()  # the first pass records every hold
    assert len(world.live) == 1 and world.index.counts[HoldReason.GLOBAL_CAP] > 1900
    world.add(Delivery(5000, "m7", "s"))
    _, changes = world.index.admit(list(world.live.values()), world.limits, now=world.now)
    assert changes == [(5000, HoldReason.GLOBAL_CAP)]


@settings(max_examples=200, deadline=None)
@given(ops)
def test_an_index_loaded_from_the_store_decides_what_full_admission_decides(
    history: list[tuple[str, int]],
) -> None:
    # The gate's start: the store's pending rows, with the reasons it recorded, are
    # loaded in bulk into a new index; its first pass must agree with admission.admit.
    world = World()
    for op, seed in history:
        apply(world, op, seed)
        world.step()
    loaded = PendingIndex()
    loaded.load(
        (row, world.index.recorded[row.id])
        for row in sorted(world.pending.values(), key=lambda r: r.id)
    )
    world.index = loaded
    world.step()


def test_loading_rows_out_of_id_order_is_refused() -> None:
    index = PendingIndex()
    rows = [(Delivery(2, "a", "x"), None), (Delivery(1, "a", "x"), None)]
    try:
        index.load(rows)
    except ValueError as error:
        assert "id order" in str(error)
    else:
        raise AssertionError("rows out of order were loaded")


def test_the_heap_of_startable_heads_stays_bounded_while_the_cap_holds() -> None:
    # The first passes go both ways (World.step: the index must agree with the full
    # scan); the rest only through the index, since the full scan over every pending row
    # on each of 5,000 passes is quadratic (minutes under coverage), and the random
    # histories above hold the two to each other already.
    world = World(limits=Limits(global_cap=1))
    for i in range(1, 5001):
        world.add(Delivery(i, f"m{i % 10}", "s"))
        if i <= 100:
            world.step()
            continue
        decided, _ = world.index.admit(list(world.live.values()), world.limits, now=world.now)
        assert decided.starts == []  # the cap holds every new turn
        for fold in decided.folds:  # the running turn's own mind's: they join it
            world.remove(list(fold.delivery_ids))
        assert len(world.index.startable) <= 2 * len(world.index.minds) + 64
    assert len(world.live) == 1 and world.index.counts[HoldReason.GLOBAL_CAP] > 4000


def test_a_waiting_acquire_takes_the_place_before_a_later_delivery_in_both() -> None:
    """The FIFO between acquires and deliveries, in the index as in admission.admit: a
    place that frees goes to the acquire that came first, not to a delivery after it."""
    world = World(limits=Limits(global_cap=1))
    world.add(Delivery(1, "a", "x"))
    world.step()  # a's turn takes the one place
    world.acquires[1] = Acquire(1, "b", "x", after=world.next_id)  # behind delivery 1
    world.add(Delivery(2, "c", "x"))  # behind the acquire
    world.next_id = 3
    world.step()
    assert world.acquires  # it waits for the place
    world.live.clear()  # a's turn ended
    world.step()  # both admissions must agree: the acquire is granted, c's row waits
    assert not world.acquires and 2 in world.pending
