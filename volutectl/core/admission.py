"""The gate's pure core: who may start a turn now, and how a row moves through the queue.

No I/O here: no pystemd, sqlite3, fcntl, socket or fork. `admit()` states the rule over
plain data (pending deliveries, live turns as systemd lists them), every row in id order.
The gate does not call it: it runs `PendingIndex.admit` (volutectl/store/index.py), which
decides the same from an index kept in step with the store, built on this module's
records and `may_pass`; tests/unit/test_queueindex.py holds the two to the same decisions
over random histories.

Queue states: pending -> running -> done; a failed turn sends its rows back to pending
with an attempt counted and a backoff (`after_failure`), or to dead after the last
attempt. A hold is not a state: a held row simply stays pending, its attempts untouched.

Who may interrupt: an --interrupt cuts a turn short only if everything the turn runs
ahead of it is its sender's, or its sender was an admin (`interrupts_that_cut`); an
interrupted turn is done only for whoever cut it (`settle`).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class LiveTurn:
    """A turn whose scope systemd lists as live."""

    turn_id: int
    mind: str
    session: str


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

    def for_mind(self, mind: str) -> int:
        return self.per_mind.get(mind, self.turns_per_mind)

    def cost_of(self, mind: str) -> float:
        """What a new turn of `mind` costs."""
        return self.costs.get(mind, 1.0)

    def running_cost_of(self, mind: str) -> float:
        """What each running turn of `mind` costs now."""
        return self.running_costs.get(mind, self.cost_of(mind))

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


def admit(
    pending: Iterable[Delivery],
    live: Sequence[LiveTurn],
    limits: Limits,
    *,
    now: float,
    other_busy: int = 0,
    pressure: bool = False,
    other_busy_reason: HoldReason = HoldReason.GLOBAL_CAP,
    paused: Container[str] = frozenset(),
    max_starts: int | None = None,
) -> Admission:
    """Decide, in id order, what starts, what folds into a live turn, and what waits.

    - Deliveries to a (mind, session) that has a live turn fold into it, even if the
      mind is paused: a pause holds new turns only.
    - A paused mind (`paused`, e.g. EVERY_MIND) starts no new turn.
    - At most `max_starts` turns start (the pressure gate's pacing: PSI reacts late, so
      a burst is let out one turn at a time); what would start beyond that is held for
      `io_pressure`.
    - A new turn starts only if the mind is under its limit, the global count (live
      turns plus `other_busy`, e.g. foreign scopes or test runs that share the budget)
      is under the ceiling, the running turns' costs (`Limits.costs`) leave room for
      its own under the adaptive limit (`Limits.held_by` says which holds), and, under
      pressure, nothing else runs at all.
    - FIFO, with one bounded departure: once the caps (or the pressure) hold one
      delivery, they hold every later one for the same reason, but that a turn lighter
      than a whole place (cost under 1) may pass one the adaptive limit holds while the
      light turns running, with it, cost less than one place (`may_pass`). So no turn
      of cost 1 ever passes another, the light ones beside it never fill a place, and a
      held turn starts once the whole turns running when it was held have ended.
    - A started turn takes every eligible pending row of its session (batch flush).
    - A row behind a backing-off row of its session waits, so a session's rows reach
      turns in id order.
    """
    ordered = sorted(pending, key=lambda d: d.id)
    per_mind: dict[str, int] = {}
    live_session: dict[tuple[str, str], int] = {}
    # In turn-id order, so that when two live turns share a session (adopted after a
    # restart), deliveries fold into the oldest whatever order systemd listed them in.
    for turn in sorted(live, key=lambda t: t.turn_id):
        per_mind[turn.mind] = per_mind.get(turn.mind, 0) + 1
        live_session.setdefault((turn.mind, turn.session), turn.turn_id)
    running = len(live)
    running_costs = [limits.running_cost_of(turn.mind) for turn in live]
    running_load = sum(running_costs)
    light_load = sum(cost for cost in running_costs if cost < 1)
    # The first delivery the caps or the pressure hold holds every later one, for the
    # same reason, but for the light turns `may_pass` lets by.
    regime: HoldReason | None = None
    passing = not pressure and max_starts is None  # the pressure's holds are FIFO

    backing_off: set[tuple[str, str]] = set()
    started: dict[tuple[str, str], list[int]] = {}
    start_order: list[tuple[str, str]] = []
    folds: dict[int, list[Delivery]] = {}
    holds: list[Hold] = []

    for delivery in ordered:
        key = (delivery.mind, delivery.session)
        if delivery.not_before is not None and delivery.not_before > now:
            backing_off.add(key)
            continue
        if key in backing_off:
            holds.append(Hold(delivery.id, HoldReason.BEHIND_BACKOFF))
            continue
        if key in started:
            started[key].append(delivery.id)
            continue
        if key in live_session:
            folds.setdefault(live_session[key], []).append(delivery)
            continue
        if delivery.mind in paused:
            holds.append(Hold(delivery.id, HoldReason.PAUSED))
            continue
        if per_mind.get(delivery.mind, 0) >= limits.for_mind(delivery.mind):
            holds.append(Hold(delivery.id, HoldReason.MIND_BUSY))
            continue
        busy = running + other_busy
        cost = limits.cost_of(delivery.mind)
        held = limits.held_by(
            busy,
            running,
            other_busy_reason,
            load=running_load + other_busy,
            running_load=running_load,
            cost=cost,
        )
        if regime is None and held is None:
            if (pressure and busy >= 1) or (
                max_starts is not None and len(start_order) >= max_starts
            ):
                held = HoldReason.IO_PRESSURE
        if regime is None and held is not None:
            regime = held
        if regime is not None and not (passing and may_pass(regime, held, light_load, cost)):
            holds.append(Hold(delivery.id, regime))
            continue
        started[key] = [delivery.id]
        start_order.append(key)
        per_mind[delivery.mind] = per_mind.get(delivery.mind, 0) + 1
        running += 1
        running_load += cost
        light_load += cost if cost < 1 else 0.0

    return Admission(
        starts=[
            Start(mind, session, tuple(started[(mind, session)])) for mind, session in start_order
        ],
        folds=[
            Fold(turn_id, tuple(d.id for d in rows), any(d.interrupt for d in rows))
            for turn_id, rows in folds.items()
        ],
        holds=holds,
    )


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
