"""The gate's pure core: who may start a turn now, and how a row moves through the queue.

No I/O here: no pystemd, sqlite3, fcntl, socket or fork. Admission's rule lives here once:
`decide` says whether one session's head may start, given what holds places (`Tally`,
built from typed `Place`s: the gate's turns, other scopes, test runs) and the pass's
`Rules`. The gate runs it through `PendingIndex.admit` (volutectl/store/index.py), which
asks it only about the heads that changed; `admit()` asks it about every row in id order,
and is the reference tests/unit/test_queueindex.py holds the index to over random
histories. A new rule goes in `decide` (or `Limits`), and both obey it.

Queue states: pending -> running -> done; a failed turn sends its rows back to pending
with an attempt counted and a backoff (`after_failure`), or to dead after the last
attempt. A hold is not a state: a held row simply stays pending, its attempts untouched.

Who may interrupt: an --interrupt cuts a turn short only if everything the turn runs
ahead of it is its sender's, or its sender was an admin (`interrupts_that_cut`); an
interrupted turn is done only for whoever cut it (`settle`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from volutectl.states import HoldReason, Outcome, QueueState


class EveryMind:
    """A pause of every mind, minds added to the config later included."""

    def __contains__(self, mind: object) -> bool:
        return True


EVERY_MIND = EveryMind()


@dataclass(frozen=True, slots=True)  # slots: a deep queue holds one per pending row
class Delivery:
    """A pending row, as admission sees it."""

    id: int
    mind: str
    session: str
    interrupt: bool = False
    not_before: float | None = None  # set while backing off after a failure


class PlaceKind(Enum):
    """What holds a place under the global cap. A turn waits for places of other kinds
    with the reason of the kind (`Tally.other_reason`)."""

    TURN = "turn"  # one of the gate's own turns: counts against its mind's limit too
    SCOPE = "scope"  # another scope in the turns slice that holds a process
    TEST_RUN = "test_run"  # a held test slot, with limits.test_runs_count_as_turns
    # A lease's scope (a turn a daemon runs itself): counts as a TURN does, against its
    # mind's limit too, at its mind's cost; deliveries to its session never fold into it.
    LEASE = "lease"


# Why a turn waits when places of other kinds fill the cap: the first kind present in
# this order names it; a kind not listed (another scope) is the cap's own, global_cap.
OTHER_REASONS: tuple[tuple[PlaceKind, HoldReason], ...] = (
    (PlaceKind.TEST_RUN, HoldReason.TEST_RUN),
)


class Place(Protocol):
    """Something that holds one place under the global cap: its kind, its mind if it has
    one, and its IO cost against the adaptive limit (None: `Limits.place_cost` prices it)."""

    @property
    def kind(self) -> PlaceKind: ...

    @property
    def mind(self) -> str | None: ...

    @property
    def cost(self) -> float | None: ...


@dataclass(frozen=True)
class LiveTurn:
    """A turn whose scope systemd lists as live: a place of kind TURN, which deliveries
    to its session fold into; or, with `lease`, a lease's scope (kind LEASE), which
    holds its session's deliveries `mind_busy` instead."""

    turn_id: int
    mind: str
    session: str
    cost: float | None = None  # None: what its mind's running turns cost (Limits)
    lease: bool = False

    @property
    def kind(self) -> PlaceKind:
        return PlaceKind.LEASE if self.lease else PlaceKind.TURN


@dataclass(frozen=True)
class Acquire:
    """A waiting acquire, as admission sees it. Its place in the FIFO is the moment it
    arrived among the pending deliveries: those with ids up to `after` are ahead of it,
    later ones behind it; acquires with the same `after` go by `lease_id` (arrival)."""

    lease_id: int
    mind: str
    session: str
    after: int

    @property
    def order(self) -> tuple[int, int]:
        return (self.after, self.lease_id)


# The turn kinds of place: each counts against its mind's limit, at its mind's cost.
MIND_KINDS = (PlaceKind.TURN, PlaceKind.LEASE)


@dataclass(frozen=True)
class Taken:
    """A place held by other work than the gate's own turns (another scope, a test run)."""

    kind: PlaceKind
    mind: str | None = None
    cost: float | None = None  # None: one place's worth


def other_work(*, scopes: int = 0, test_runs: int = 0) -> list[Taken]:
    """The places other work holds: `scopes` other scopes in the turns slice, `test_runs`
    held test slots (the gate counts them only with limits.test_runs_count_as_turns)."""
    return [Taken(PlaceKind.SCOPE)] * scopes + [Taken(PlaceKind.TEST_RUN)] * test_runs


@dataclass(frozen=True)
class Limits:
    global_cap: int | None = None  # the static ceiling; None: unlimited
    turns_per_mind: int = 1
    per_mind: Mapping[str, int] = field(default_factory=dict)
    adaptive: int | None = None  # the adaptive limit (volutectl/core/adaptive.py), if on
    # What one turn of each mind costs against the adaptive limit (core/iocost.py); a
    # mind not listed, and any other work that shares the budget, costs 1.
    costs: Mapping[str, float] = field(default_factory=dict)
    # What each of a mind's running turns costs now, from what they have written so far
    # (core/iocost.py's `running_cost`, their mean if several); a mind not listed: `costs`.
    running_costs: Mapping[str, float] = field(default_factory=dict)
    # The most turns the adaptive limit lets run at once, whatever their costs (its
    # maximum): light turns fill places by their costs, and never more than this many.
    adaptive_turns: int | None = None
    # Writers one at a time: the gate has seen writers among lighter turns (a mixed
    # fan-out: core/iocost.py's `mixed`), so a turn that may cost a whole place waits
    # while a running turn may be writing (`writers` of them: core/iocost.py's
    # `writes_now`; at least 1 during writers' pause, `WRITER_PAUSE`), and lighter ones
    # go past it (`writer_hold`).
    stagger: bool = False
    writers: int = 0

    def for_mind(self, mind: str) -> int:
        return self.per_mind.get(mind, self.turns_per_mind)

    def cost_of(self, mind: str) -> float:
        """What a new turn of `mind` costs."""
        return self.costs.get(mind, 1.0)

    def running_cost_of(self, mind: str) -> float:
        """What each running turn of `mind` costs now."""
        return self.running_costs.get(mind, self.cost_of(mind))

    def place_cost(self, place: Place) -> float:
        """What a place costs now: its own cost if it says; a turn, its mind's running
        cost; other work, one place."""
        if place.cost is not None:
            return place.cost
        if place.kind in MIND_KINDS and place.mind is not None:
            return self.running_cost_of(place.mind)
        return 1.0

    @property
    def cap(self) -> int | None:
        """The global cap in force: the lower of the ceiling and the adaptive limit."""
        caps = [cap for cap in (self.global_cap, self.adaptive) if cap is not None]
        return min(caps) if caps else None

    def full(self, busy: int, load: float, cost: float = 1.0) -> bool:
        """Whether a turn of `cost` may not start with `busy` places taken, of `load` in
        costs. The ceiling counts turns. The adaptive limit counts whole turns of cost
        1, and lighter ones fill what is left of the last place: a turn may start while
        the load with it stays under the limit plus one. So with turns of cost 1 it
        counts turns, as before costs; at a limit of 1, one heavy turn runs with light
        ones beside it, whichever came first; and one turn may always start."""
        if self.global_cap is not None and busy >= self.global_cap:
            return True
        if self.adaptive is None or busy == 0:
            return False
        if self.adaptive_turns is not None and busy >= self.adaptive_turns:
            return True
        return load + cost >= self.adaptive + 1

    def held_by(
        self,
        busy: int,
        running: int,
        other_reason: HoldReason,
        *,
        load: float | None = None,
        running_load: float | None = None,
        cost: float = 1.0,
    ) -> HoldReason | None:
        """Why a new turn of `cost` may not start with `busy` places taken (`running` of
        them turns; `load` and `running_load` the same in costs, by default one each),
        or None if the caps let it: other work filling the cap (`other_reason`), the
        ceiling, or the adaptive limit where the ceiling alone would let it start."""
        load = busy if load is None else load
        running_load = running if running_load is None else running_load
        if not self.full(busy, load, cost):
            return None
        if not self.full(running, running_load, cost):
            return other_reason
        if self.global_cap is not None and busy >= self.global_cap:
            return HoldReason.GLOBAL_CAP
        return HoldReason.ADAPTIVE_LIMIT


@dataclass(frozen=True)
class Start:
    mind: str
    session: str
    delivery_ids: tuple[int, ...]


@dataclass(frozen=True)
class Fold:
    """Hand deliveries to a live turn of the same session (its inbox)."""

    turn_id: int
    delivery_ids: tuple[int, ...]
    # One of the deliveries asks to interrupt: whether it may cut the turn short is
    # decided in the fold's commit (`interrupts_that_cut`), from who sent what.
    interrupt: bool


@dataclass(frozen=True)
class Hold:
    delivery_id: int
    reason: HoldReason


@dataclass(frozen=True)
class Admission:
    starts: list[Start]
    folds: list[Fold]
    holds: list[Hold]
    grants: list[int] = field(default_factory=list)  # the acquires granted: lease ids
    # Every acquire still waiting, with its reason (lease id, reason).
    lease_holds: list[tuple[int, HoldReason]] = field(default_factory=list)


Key = tuple[str, str]  # (mind, session)


def lease_hold(
    acquire: Acquire, tally: Tally, rules: Rules, taken: Container[Key]
) -> HoldReason | None:
    """Admission's rule for a waiting acquire: a session that a turn or a lease holds, or
    that a turn starts in this pass, is `mind_busy` (the acquire joins it in the next
    pass); else `decide`, as for a delivery's head of its mind."""
    if (acquire.mind, acquire.session) in taken:
        return HoldReason.MIND_BUSY
    return decide(acquire.mind, tally, rules)


@dataclass
class LeaseQueue:
    """The waiting acquires of one pass, in FIFO order, and what was decided of them:
    offered to admission before each delivery's head they are ahead of."""

    waiting: list[Acquire]
    at: int = 0
    grants: list[int] = field(default_factory=list)
    holds: list[tuple[int, HoldReason]] = field(default_factory=list)
    granted: set[Key] = field(default_factory=set)

    @classmethod
    def of(cls, acquires: Iterable[Acquire]) -> LeaseQueue:
        return cls(sorted(acquires, key=lambda a: a.order))

    def until(
        self, head: int | None, tally: Tally, rules: Rules, taken: Callable[[Key], bool]
    ) -> None:
        """Decide the acquires ahead of delivery `head` (None: all that are left)."""
        while self.at < len(self.waiting):
            acquire = self.waiting[self.at]
            if head is not None and acquire.after >= head:
                return
            self.at += 1
            key = (acquire.mind, acquire.session)
            busy = _Taken(taken, self.granted)
            reason = lease_hold(acquire, tally, rules, busy)
            tally.note(acquire.mind, reason, rules.limits)
            if reason is None:
                self.grants.append(acquire.lease_id)
                self.granted.add(key)
            else:
                self.holds.append((acquire.lease_id, reason))


@dataclass(frozen=True)
class _Taken:
    taken: Callable[[Key], bool]
    granted: set[Key]

    def __contains__(self, key: object) -> bool:
        return key in self.granted or (isinstance(key, tuple) and self.taken(key))


# A head held for one of these holds only its mind's sessions (`writer_running` holds
# each writer's for itself); any other reason is the regime's: once the caps or the
# pressure hold one head, they hold every later one.
MIND_REASONS = (HoldReason.PAUSED, HoldReason.MIND_BUSY, HoldReason.WRITER_RUNNING)


@dataclass(frozen=True)
class Rules:
    """What a pass decides by, besides what holds places: the limits, the paused minds
    (e.g. EVERY_MIND), the pressure, and the pacing (at most `max_starts` starts: PSI
    reacts late, so a burst is let out one turn at a time)."""

    limits: Limits
    paused: Container[str] = frozenset()
    pressure: bool = False
    max_starts: int | None = None

    @property
    def passing(self) -> bool:
        """Whether a light turn may pass a held one (`may_pass`); the pressure's holds
        are FIFO."""
        return not self.pressure and self.max_starts is None


@dataclass
class Tally:
    """What holds places as a pass starts turns: every place (`busy`), the turns among
    them (`running`, per mind, their costs `load`, and `light`: the costs under 1), the
    other work's costs and the reason it holds turns for; and what the pass did so far:
    its starts, and its regime (the hold that stopped the starts), if any."""

    busy: int = 0
    running: int = 0
    load: float = 0.0
    light: float = 0.0
    writers: int = 0  # turns that may be writing now (`Limits.writers`), and the pass's
    other_load: float = 0.0
    other_reason: HoldReason = HoldReason.GLOBAL_CAP
    per_mind: Counter[str] = field(default_factory=Counter)
    starts: int = 0
    regime: HoldReason | None = None

    @classmethod
    def of(cls, places: Iterable[Place], limits: Limits) -> Tally:
        tally = cls(writers=limits.writers)
        kinds: set[PlaceKind] = set()
        for place in places:
            cost = limits.place_cost(place)
            tally.busy += 1
            if place.kind in MIND_KINDS and place.mind is not None:
                tally._turn(place.mind, cost)
            else:
                tally.other_load += cost
                kinds.add(place.kind)
        tally.other_reason = next(
            (reason for kind, reason in OTHER_REASONS if kind in kinds), HoldReason.GLOBAL_CAP
        )
        return tally

    def _turn(self, mind: str, cost: float) -> None:
        self.running += 1
        self.per_mind[mind] += 1
        self.load += cost
        self.light += cost if cost < 1 else 0.0

    def note(self, mind: str, reason: HoldReason | None, limits: Limits) -> None:
        """Keep count of what `decide` said of a head of `mind`: a start takes a place;
        a hold by the caps or the pressure becomes the pass's regime."""
        if reason is None:
            cost = limits.cost_of(mind)
            self.busy += 1
            self.starts += 1
            self.writers += cost >= 1  # a whole place that starts may write at once
            self._turn(mind, cost)
        elif reason not in MIND_REASONS:
            self.regime = reason

    def held_by(self, limits: Limits, cost: float) -> HoldReason | None:
        """Why the caps alone hold a new turn of `cost` (`Limits.held_by`), or None."""
        return limits.held_by(
            self.busy,
            self.running,
            self.other_reason,
            load=self.load + self.other_load,
            running_load=self.load,
            cost=cost,
        )


def decide(mind: str, tally: Tally, rules: Rules) -> HoldReason | None:
    """Admission's one rule for one head: whether the oldest eligible row of a session of
    `mind` that no live turn runs may start a new turn now (None), or why it waits.

    - A paused mind (`Rules.paused`) starts no new turn: `paused`.
    - A mind at its limit of turns (`Limits.for_mind`): `mind_busy`.
    - A writer while another may be writing, where writers go one at a time
      (`writer_hold`): `writer_running`.
    - Otherwise the caps and the pressure decide (`cap_hold`)."""
    cost = rules.limits.cost_of(mind)
    return (
        mind_hold(mind, tally, rules)
        or writer_hold(cost, tally, rules)
        or cap_hold(cost, tally, rules)
    )


def mind_hold(mind: str, tally: Tally, rules: Rules) -> HoldReason | None:
    """The holds of a mind's own: its pause, its limit of turns."""
    if mind in rules.paused:
        return HoldReason.PAUSED
    if tally.per_mind[mind] >= rules.limits.for_mind(mind):
        return HoldReason.MIND_BUSY
    return None


def writer_hold(cost: float, tally: Tally, rules: Rules) -> HoldReason | None:
    """Writers one at a time (`Limits.stagger`): a turn of a whole place (a known writer,
    or a mind whose writes are not known) waits while a running turn may be writing
    (`Limits.writers`, and the pass's own starts of whole places), whatever the caps
    would say: `writer_running`. A hold of its mind's, as `mind_busy` is, not the
    regime's: lighter turns behind it start as the caps let them, and a writer behind it
    waits as it does, so writers keep their order among themselves.

    Why none starves: it waits only for the turns that may be writing now, and no turn
    of a whole place starts past it. The lighter turns that pass it hold it back only
    while a sample shows them writing, and a mind whose turn wrote a whole place's worth
    costs a whole place from its next turn on (core/iocost.py's `Costs.learn`), when it
    waits behind this one. tests/unit/test_iocost.py holds it to a bound on the oldest
    delivery's wait while light deliveries keep coming."""
    if rules.limits.stagger and cost >= 1 and tally.writers >= 1:
        return HoldReason.WRITER_RUNNING
    return None


def cap_hold(cost: float, tally: Tally, rules: Rules) -> HoldReason | None:
    """Whether the caps and the pressure let a new turn of `cost` start (None), or why not.

    - It starts only if the global count (every place: turns and other work that shares
      the budget) is under the ceiling, and the running costs (`Limits.costs`) leave
      room for its own under the adaptive limit (`Limits.held_by` says which holds, and
      names other work's kind when that is what fills the cap: `Tally.other_reason`).
    - Under pressure nothing starts beside anything else, and the pacing lets out at
      most `Rules.max_starts` starts: `io_pressure`.
    - FIFO, with one bounded departure: once the caps (or the pressure) hold one head,
      they hold every later one for the same reason (the regime), but that a turn
      lighter than a whole place may pass one the adaptive limit holds while the light
      turns running, with it, cost less than one place (`may_pass`)."""
    held = tally.held_by(rules.limits, cost)
    if tally.regime is None and held is None:
        paced = rules.max_starts is not None and tally.starts >= rules.max_starts
        if (rules.pressure and tally.busy >= 1) or paced:
            held = HoldReason.IO_PRESSURE
    regime = tally.regime or held
    if regime is None or (rules.passing and may_pass(regime, held, tally.light, cost)):
        return None
    return regime


def admit(
    pending: Iterable[Delivery],
    live: Sequence[LiveTurn],
    limits: Limits,
    *,
    now: float,
    others: Collection[Place] = (),
    pressure: bool = False,
    paused: Container[str] = frozenset(),
    max_starts: int | None = None,
    acquires: Iterable[Acquire] = (),
) -> Admission:
    """Decide, in id order, what starts, what folds into a live turn, and what waits: the
    reference the gate's incremental index (volutectl/store/index.py) is held to.

    - Deliveries to a (mind, session) that has a live turn fold into it, even if the
      mind is paused: a pause holds new turns only.
    - Any other session's first eligible row is a head: `decide` says if it starts, given
      the places live turns, `others` (other scopes, test runs) and the pass's starts hold.
    - A started turn takes every eligible pending row of its session (batch flush).
    - A row behind a backing-off row of its session waits: a session's rows reach turns
      in id order.
    - A waiting acquire is decided where it stands in the FIFO (`Acquire.after`), as a
      head is (`lease_hold`); a row of a session a live lease holds waits, `mind_busy`."""
    rules = Rules(limits, paused, pressure, max_starts)
    tally = Tally.of([*live, *others], limits)
    scan = _Scan(*live_sessions(live))
    leases = LeaseQueue.of(acquires)
    for delivery in sorted(pending, key=lambda d: d.id):
        leases.until(delivery.id, tally, rules, scan.taken)
        scan.take(delivery, tally, rules, now)
    leases.until(None, tally, rules, scan.taken)
    started, folds, holds = scan.started, scan.folds, scan.holds

    return Admission(
        starts=[Start(mind, session, tuple(ids)) for (mind, session), ids in started.items()],
        folds=[
            Fold(turn_id, tuple(d.id for d in rows), any(d.interrupt for d in rows))
            for turn_id, rows in sorted(folds.items())
        ],
        holds=holds,
        grants=leases.grants,
        lease_holds=leases.holds,
    )


@dataclass
class _Scan:
    """admit()'s walk over the pending rows, in id order."""

    live_session: dict[Key, int]
    leased: set[Key]
    backing_off: set[Key] = field(default_factory=set)
    started: dict[Key, list[int]] = field(default_factory=dict)
    folds: dict[int, list[Delivery]] = field(default_factory=dict)
    holds: list[Hold] = field(default_factory=list)

    def taken(self, key: Key) -> bool:
        return key in self.started or key in self.live_session or key in self.leased

    def take(self, delivery: Delivery, tally: Tally, rules: Rules, now: float) -> None:
        key = (delivery.mind, delivery.session)
        if delivery.not_before is not None and delivery.not_before > now:
            self.backing_off.add(key)
        elif key in self.backing_off:
            self.holds.append(Hold(delivery.id, HoldReason.BEHIND_BACKOFF))
        elif key in self.started:
            self.started[key].append(delivery.id)
        elif key in self.live_session:
            self.folds.setdefault(self.live_session[key], []).append(delivery)
        elif key in self.leased:
            self.holds.append(Hold(delivery.id, HoldReason.MIND_BUSY))
        else:
            reason = decide(delivery.mind, tally, rules)
            tally.note(delivery.mind, reason, rules.limits)
            if reason is None:
                self.started[key] = [delivery.id]
            else:
                self.holds.append(Hold(delivery.id, reason))


def live_sessions(live: Sequence[LiveTurn]) -> tuple[dict[Key, int], set[Key]]:
    """The sessions live turns hold (each to its oldest turn, which deliveries fold into,
    whatever order systemd listed two adopted ones in), and those live leases hold."""
    sessions: dict[Key, int] = {}
    for turn in sorted(live, key=lambda t: t.turn_id):
        if not turn.lease:
            sessions.setdefault((turn.mind, turn.session), turn.turn_id)
    return sessions, {(turn.mind, turn.session) for turn in live if turn.lease}


def may_pass(regime: HoldReason, held: HoldReason | None, light_load: float, cost: float) -> bool:
    """Whether a turn of `cost` may start past a delivery the caps hold (`regime`): only
    past one the adaptive limit holds, only if the caps let it (`held` is None), and only
    while the light turns running (`light_load`), with it, cost less than one place.

    Why no turn starves: no turn of cost 1 passes, so the whole turns running when one
    was held only end; the light ones never reach one place, so once those have ended
    the load is under 1 and it fits (`Limits.full`), whatever the limit, and however
    many light turns keep coming. tests/unit/test_iocost.py holds it to that."""
    return regime is HoldReason.ADAPTIVE_LIMIT and held is None and light_load + cost < 1


# -- who may interrupt ---------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """A delivery as the interrupt rules see it: who sent it (`uid`, SO_PEERCRED; None:
    not known), and, for an --interrupt, whether its sender was an admin when it
    delivered (`admin`) and whether it cut its turn short (`cut`, decided at its fold)."""

    id: int
    uid: int | None
    interrupt: bool = False
    admin: bool = False
    cut: bool = False


def may_interrupt(sender: int | None, admin: bool, ahead: Iterable[int | None]) -> bool:
    """Whether an interrupt may cut a turn short: its sender was an admin when it
    delivered, or every delivery the turn runs ahead of it (`ahead`: their senders) is
    the sender's own. A sender not known owns nothing."""
    return admin or (sender is not None and all(uid == sender for uid in ahead))


def interrupts_that_cut(running: Iterable[int | None], fold: Sequence[Sent]) -> tuple[int, ...]:
    """The ids of the fold's interrupts that cut its turn short; the others fold in as
    plain deliveries. `running`: the senders of the deliveries the turn runs already.
    Each interrupt is judged on what the turn runs when it arrives: those, and the
    fold's deliveries before it (by id). One delivered after it cannot undo it, and is
    not done by it either (`settle`)."""
    ahead = set(running)
    cut = []
    for sent in sorted(fold, key=lambda s: s.id):
        if sent.interrupt and may_interrupt(sent.uid, sent.admin, ahead):
            cut.append(sent.id)
        ahead.add(sent.uid)
    return tuple(cut)


@dataclass(frozen=True)
class Settlement:
    """What becomes of an ended turn's deliveries."""

    done: tuple[int, ...] = ()
    returned: tuple[int, ...] = ()  # back to pending, no attempt counted
    failed: tuple[int, ...] = ()  # one attempt counted: backoff, or dead after the last
    # Of `failed`: cut short by someone else's interrupt (said in their error).
    cut_by_other: tuple[int, ...] = ()


def settle(kind: Outcome, rows: Sequence[Sent], not_taken: Container[int] = ()) -> Settlement:
    """Settle a turn's deliveries by its outcome. A folded delivery it did not take goes
    back with no attempt; so does every one of a turn whose command never ran. Of those
    it carried: exit 0, done; a failure, one attempt each.

    An interrupted turn (it exited non-zero after an interrupt cut it short) is done
    only for whoever asked: the deliveries of a sender whose interrupt cut it, and
    those interrupts. Every other delivery it carried counts one failed attempt and is
    tried again, so that nobody's delivery is marked done by someone else's interrupt.
    A turn interrupted before volutectl recorded who cut it (no row says so) is done
    whole, as it was then."""
    returned = [s.id for s in rows if s.id in not_taken]
    carried = [s for s in rows if s.id not in not_taken]
    ids = tuple(s.id for s in carried)
    if kind is Outcome.NEVER_RAN:
        return Settlement(returned=tuple(returned) + ids)
    if kind.failed:
        return Settlement(returned=tuple(returned), failed=ids)
    askers = {s.uid for s in rows if s.cut and s.uid is not None}
    if kind is not Outcome.INTERRUPTED or not any(s.cut for s in rows):
        return Settlement(done=ids, returned=tuple(returned))
    done = tuple(s.id for s in carried if s.cut or (s.uid is not None and s.uid in askers))
    others = tuple(i for i in ids if i not in done)
    return Settlement(done=done, returned=tuple(returned), failed=others, cut_by_other=others)


@dataclass(frozen=True)
class AfterFailure:
    state: QueueState  # PENDING (backing off) or DEAD
    attempts: int
    not_before: float | None


def timed_out(
    deadline: float | None, *, stopped_at: float | None, ended_at: float | None, now: float
) -> bool:
    """Whether a turn ran past its max runtime.

    The gate's own record (`stopped_at`: it stopped the turn at its deadline) decides.
    A turn that ended while no gate was watching was stopped by systemd's RuntimeMaxSec=
    backstop if it ended at or after its deadline: `ended_at` is when its wrapper
    recorded the exit status, or, with no status at all, `now`."""
    if stopped_at is not None:
        return True
    if deadline is None:
        return False
    return (ended_at if ended_at is not None else now) >= deadline


def after_failure(
    attempts: int, *, now: float, max_attempts: int, initial: float, ceiling: float
) -> AfterFailure:
    """A real failure (not a hold): count the attempt, back off, or give up."""
    attempts += 1
    if attempts >= max_attempts:
        return AfterFailure(QueueState.DEAD, attempts, None)
    # The exponent is bounded: past ~1024 doublings the float conversion overflows,
    # and any max_attempts that large would otherwise crash the gate on that failure.
    delay = min(initial * 2.0 ** min(attempts - 1, 1000), ceiling)
    return AfterFailure(QueueState.PENDING, attempts, now + delay)


@dataclass(frozen=True)
class TurnOutcome:
    """How a turn ended, decided from what could be observed."""

    kind: Outcome
    exit_status: int | None
    detail: str


def turn_outcome(
    *,
    exit_status: int | None,
    started_marker: bool,
    released: bool,
    interrupted: bool = False,
    timed_out: bool = False,
) -> TurnOutcome:
    """Decide a turn's outcome from its exit status or, after a restart, its traces.

    `released`: the gate recorded that it let the command exec. `started_marker`: the
    turn's wrapper got as far as running the command. `interrupted`: the gate sent it
    SIGINT for an --interrupt delivery; a turn that then exits non-zero did what it
    was asked (stop): not a failure, and `settle` says whose deliveries that carries.
    `timed_out`: it ran past its max runtime and was stopped; that is a failed attempt,
    whatever it exited with, and it outranks an interrupt.
    """
    if timed_out and (started_marker or released or exit_status is not None):
        status = "no exit status" if exit_status is None else f"exit status {exit_status}"
        return TurnOutcome(Outcome.TIMEOUT, exit_status, f"ran past its time limit ({status})")
    if exit_status is not None:
        if exit_status == 0:
            return TurnOutcome(Outcome.OK, 0, "exited 0")
        if interrupted:
            return TurnOutcome(
                Outcome.INTERRUPTED, exit_status, f"interrupted, exited {exit_status}"
            )
        return TurnOutcome(Outcome.FAILED, exit_status, f"exited {exit_status}")
    if started_marker or released:
        return TurnOutcome(Outcome.FAILED, None, "ended without recording an exit status")
    return TurnOutcome(Outcome.NEVER_RAN, None, "the command never started")


EXIT_TIMEOUT = 124  # what timeout(1) exits with when the time limit stopped the command


def wait_exit_code(exit_status: int | None, kind: Outcome = Outcome.OK) -> int:
    """The exit code `deliver --wait` reports for a turn's outcome and exit status."""
    if kind == Outcome.TIMEOUT:
        return EXIT_TIMEOUT
    if exit_status is None:
        return 1
    return exit_status if 0 <= exit_status <= 255 else 1


def stranded_outcome(
    recorded: Outcome | None,
    *,
    exit_status: int | None,
    detail: str | None,
    released: bool,
    interrupted: bool,
    timed_out: bool,
) -> TurnOutcome:
    """How to settle a delivery found `running` under a turn that is no longer open: a
    gate died between the commit that ended the turn and the one that settled its rows
    (two commits before issue 29; one since).

    The turn's recorded outcome decides, as the turn's own settlement would have used
    it (`Outcome.carried`: done; `Outcome.failed`: one attempt; never ran: back with
    none). A turn with no outcome recorded, or none at all (`released` False, nothing
    known), is judged as a turn whose scope is gone after a crash: by `turn_outcome` on
    what its record says, its directory's traces being gone with the turn."""
    if recorded is not None:
        return TurnOutcome(recorded, exit_status, detail or str(recorded))
    return turn_outcome(
        exit_status=exit_status,
        started_marker=False,
        released=released,
        interrupted=interrupted,
        timed_out=timed_out,
    )
