"""The pure part of adaptive admission: how many turns may run at once, learnt from how
the storage answers.

Every interval, while turns run or wait, the gate measures (volutectl/gate/adaptive.py)
and hands `step` a `Reading`: the latency of its own synced 4 KiB probe of the state
disk, PSI's stalled share of the interval, the turns running, and the deliveries that
wait at the limit. `step` says whether the limit moves, and why.

- **It grows only while deliveries wait at it**, the running turns fill it (`tested`:
  a limit not in use has not been shown healthy) and the storage is healthy: after
  `GROW_AFTER` healthy readings in a row (one probe is one 4 KiB write, and behind a
  disk kept busy by synced 64 KiB writes it is quick or slow by luck), not counting a
  fan-out's first (a cold gate's, or one's that `resume`d: its probe starts as the
  turns do, on the quiet disk, and says nothing of them); and after a growth, two
  more (the next reading's probe starts as the turns the growth let in do, and says
  nothing of them). It doubles while nothing has gone wrong yet (slow start, as
  TCP's) and some of the turns the reading saw cost less than a whole place; a
  reading of whole places only, or any after the first distress, grows it by one
  (congestion avoidance).
  A limit that met distress is tried again only after `RETRY_AFTER` healthy readings
  in a row (CUBIC's plateau at the window that last lost, W_max): a few lucky probes
  in a row are no evidence. Below that limit it grows as before. A distress is
  remembered so only once the fan-out has had a counted healthy reading (`calm_seen`):
  before it, the probe meets the fan-out's own arrival (the gate's commits of its
  deliveries and of its turns' starts, on the SD card the card's whole budget for a
  second: docs/benchmarks.md), which says nothing of what the turns bear. Such a
  distress lowers the limit all the same, and the limit grows back after `GROW_AFTER`
  healthy readings; if it meets distress again there, that one is remembered.
  Doubling is safe only for turns that cost less than a place (core/iocost.py): a
  turn whose writes are not known costs a whole place until a sample of what it has
  written shows otherwise, and so does a known heavy writer. Doubling a limit of whole
  places lets in as many more of them at once as run already, on probes that judged
  one more (`judge_latency`), and a lowered limit stops no running turn; so whole
  places grow by one.
- **It shrinks on distress**: by one when the storage is slower than healthy; by a
  third (multiplicative decrease) when it is far slower twice in a row, so a sudden
  slowdown is answered within a few intervals and one stray slow sample is not.
- **It never drifts up when idle**: no waiting, no growth. Work that arrives at a gate
  gone idle (nothing ran or waited) starts it again from `start` (`resume`), so a
  fan-out after an hour of quiet is let in at the start value and grows from there.
  Not only after an hour: the limit says what the turns running at once bear, and
  that mix is gone when the gate is idle. What the gate learnt stays: the disk's
  baseline, each mind's IO cost (core/iocost.py), by which a fan-out of light turns
  it knows fits a low limit, and one of heavy turns it knows starts no more of them at
  once than the start value, whatever the limit grew to for the last mix; and the
  limit of the last distress, in IO costs, below which it starts if that is lower
  than `start` (a distress says how many heavy writers the disk did not bear).
- It stays within the bounds; a new gate starts at `start` (the limit is not kept).

Two rules judge a reading (`RULES`, by name for the benchmark):
- "gradient" (the default): the probe's latency against a learnt baseline, as TCP
  Vegas and Netflix's Gradient limiter do. Healthy below max(2 x baseline, baseline +
  20 ms); far slower above twice that. A reading is scaled from the turns that ran
  while the probe did to the limit now (the queueing delay per turn, or per unit of
  IO cost when the turns' costs are known: core/iocost.py), so a reading one interval
  old does not make the limit overshoot. The baseline is the lowest latency
  seen, let up slowly only by readings taken while no turn ran.
- "aimd": PSI's `some` stalled share of the interval (healthy below 10 %, distress
  over 30 %, far over 60 %), as systemd-oomd reads PSI; the probe's latency when PSI is
  unreadable.

tests/unit/test_adaptive.py runs both against a simulated disk, and says why gradient
is the default: PSI `some` counts a lone writer's own waits, so a disk kept busy by
one turn reads as stalled, and aimd holds write-heavy work to one turn where the probe
shows the disk bears more. The runs that chose each rule above are in
docs/benchmarks.md, "The adaptive rule's choices".

No I/O and no clock here: times come in with the readings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import Enum

TOLERANCE_RATIO = 2.0  # healthy: latency within this multiple of the baseline...
TOLERANCE_MS = 20.0  # ...or within this much of it, whichever is larger
BASELINE_RISE = 0.05  # how far an idle disk's reading lets the baseline up
BACK_OFF = 0.7  # the multiplicative decrease
GROW_AFTER = 3  # healthy readings in a row before the limit grows
UNSEEN = -1  # `healthy` at a fan-out's start: its first reading counts for nothing
RETRY_AFTER = 12  # ...before it grows back to a limit that met distress
STALL_HEALTHY = 0.10  # aimd: PSI some share of the interval
STALL_DISTRESS = 0.30
STALL_SEVERE = 0.60


@dataclass(frozen=True)
class Bounds:
    start: int
    minimum: int
    maximum: int

    def clamp(self, limit: int) -> int:
        return max(self.minimum, min(self.maximum, limit))


@dataclass(frozen=True)
class Reading:
    """What one interval measured."""

    now: float  # monotonic seconds
    latency_ms: float | None  # the gate's synced probe of the state disk (None: none)
    stalled: float | None  # PSI io `some`: the share of the interval stalled, 0..1
    running: int  # turns running while the probe ran (at most)
    waiting: int  # deliveries held by the adaptive limit, and by nothing else
    load: float | None = None  # those turns' IO costs (core/iocost.py); None: one each


@dataclass(frozen=True)
class Change:
    old: int
    new: int
    reason: str


@dataclass(frozen=True)
class Controller:
    """The limit and what the rule has learnt."""

    limit: int
    baseline_ms: float | None = None  # the probe's latency on a quiet disk
    slow_start: bool = True  # no distress seen since the start: grow by doubling
    strained: int = 0  # readings in a row that were far over healthy
    healthy: int = 0  # readings in a row that were healthy
    last_reading: float | None = None
    distressed_at: int | None = None  # the limit of the last distress (CUBIC's W_max)
    calm_seen: bool = True  # a counted healthy reading since the fan-out's start


class Verdict(Enum):
    HEALTHY = "healthy"
    NEUTRAL = "neutral"  # neither grow nor shrink
    DISTRESS = "distress"  # shrink by one
    SEVERE = "severe"  # far over: shrink by a third if it lasts


Judgement = tuple[Verdict, str]
Rule = Callable[[Controller, Reading], Judgement]


def initial(bounds: Bounds) -> Controller:
    """A gate that starts, or starts again: the start value, nothing learnt."""
    return Controller(limit=bounds.clamp(bounds.start), healthy=UNSEEN, calm_seen=False)


def healthy_below_ms(baseline_ms: float) -> float:
    return max(TOLERANCE_RATIO * baseline_ms, baseline_ms + TOLERANCE_MS)


def learn_baseline(state: Controller, reading: Reading) -> float | None:
    """The lowest latency seen; let up slowly, and only by readings of an idle disk
    (no turn ran), so that a steady load cannot teach it that a queue is normal."""
    latency = reading.latency_ms
    if latency is None:
        return state.baseline_ms
    if state.baseline_ms is None or latency < state.baseline_ms:
        return latency
    if reading.running == 0:
        return state.baseline_ms + BASELINE_RISE * (latency - state.baseline_ms)
    return state.baseline_ms


def learn_quiet(state: Controller, latency_ms: float) -> Controller:
    """A probe taken while no turn ran or waited (a gate that has not measured its disk
    yet takes one, volutectl/gate/adaptive.py): the baseline learns from it as from an
    idle reading; nothing else moves. Without it a cold gate's first baseline would come
    from its first reading, under the fan-out that woke it, and read a queue as normal."""
    quiet = Reading(now=0.0, latency_ms=latency_ms, stalled=None, running=0, waiting=0)
    return replace(state, baseline_ms=learn_baseline(state, quiet))


def judge_latency(state: Controller, reading: Reading) -> Judgement:
    """Gradient: the probe's latency against the learnt baseline, as Vegas does it.

    The probe measured the disk while `reading.running` turns ran, which need not be
    the limit now (the limit moved since it started): its queueing delay, per turn,
    says what the current limit, and one more, would cost. So a reading taken before
    the last move is read at the concurrency it saw, and the limit does not overshoot
    by chasing stale readings."""
    latency, baseline = reading.latency_ms, state.baseline_ms
    if latency is None or baseline is None:
        return Verdict.NEUTRAL, "no probe"
    healthy = healthy_below_ms(baseline)
    load = reading.running if reading.load is None else reading.load
    per_turn = max(0.0, latency - baseline) / max(1.0, load)

    def at(turns: int) -> float:
        return baseline + per_turn * turns

    measured = f"probe {latency:.0f} ms with {reading.running} running, baseline {baseline:.0f} ms"
    if at(state.limit) > 2 * healthy:
        return Verdict.SEVERE, f"{measured}: far over healthy ({healthy:.0f} ms)"
    if at(state.limit) > healthy:
        return Verdict.DISTRESS, f"{measured}: over healthy ({healthy:.0f} ms)"
    if at(state.limit + 1) > healthy:
        return Verdict.NEUTRAL, f"{measured}: one more would be over healthy"
    return Verdict.HEALTHY, f"{measured}: healthy"


def judge_stall(state: Controller, reading: Reading) -> Judgement:
    """AIMD: PSI's stalled share of the interval; the probe when PSI is unreadable."""
    if reading.stalled is None:
        return judge_latency(state, reading)
    measured = f"{reading.stalled * 100:.0f}% stalled"
    if reading.stalled > STALL_SEVERE:
        return Verdict.SEVERE, f"{measured} (over {STALL_SEVERE * 100:.0f}%)"
    if reading.stalled > STALL_DISTRESS:
        return Verdict.DISTRESS, f"{measured} (over {STALL_DISTRESS * 100:.0f}%)"
    if reading.stalled < STALL_HEALTHY:
        return Verdict.HEALTHY, f"{measured}: healthy"
    return Verdict.NEUTRAL, measured


RULES: Mapping[str, Rule] = {"gradient": judge_latency, "aimd": judge_stall}
DEFAULT_RULE = "gradient"


def tested(state: Controller, reading: Reading) -> bool:
    """Whether the reading measured the limit in use: the turns running while its probe
    ran took the whole limit, in IO costs. A limit that deliveries wait at but that the
    running turns do not fill (those waiting are held by something else, such as the
    bound on turns at once) has not been shown to be healthy, and does not grow, as TCP
    grows no window that was not in use (RFC 7661)."""
    load = reading.running if reading.load is None else reading.load
    return load >= state.limit


def below_distress(state: Controller) -> int | None:
    """The highest limit below the last distress's, if any."""
    return None if state.distressed_at is None else max(1, state.distressed_at - 1)


def grow_after(state: Controller) -> int:
    """Healthy readings in a row that the next growth needs: `RETRY_AFTER` to reach
    the limit of the last distress again (or pass it), `GROW_AFTER` below it."""
    below = below_distress(state)
    if below is not None and state.limit >= below:
        return RETRY_AFTER
    return GROW_AFTER


def whole_places(reading: Reading) -> bool:
    """Whether every turn running while the probe ran cost a whole place: writers known
    to be heavy, or turns whose writes are not known yet (core/iocost.py)."""
    return reading.load is None or reading.load >= reading.running


def grown(state: Controller, reading: Reading) -> int:
    """The next limit up: doubled in slow start while some running turns cost less than
    a place, else one more; but never past the limit below the last distress in one
    step from under it, and by one from there on."""
    double = state.slow_start and not whole_places(reading)
    new = state.limit * 2 if double else state.limit + 1
    below = below_distress(state)
    if below is None:
        return new
    return min(new, below) if state.limit < below else state.limit + 1


def step(
    state: Controller, reading: Reading, bounds: Bounds, rule: str = DEFAULT_RULE
) -> tuple[Controller, Change | None]:
    """One interval: learn from `reading`, and move the limit at most once."""
    state = replace(state, baseline_ms=learn_baseline(state, reading), last_reading=reading.now)
    verdict, why = RULES[rule](state, reading)
    limit = state.limit
    # A distress before the fan-out's first counted healthy reading is not remembered.
    distressed_at = limit if state.calm_seen else state.distressed_at
    if verdict is Verdict.SEVERE:
        strained = state.strained + 1
        state = replace(state, slow_start=False, strained=strained, distressed_at=distressed_at)
        new = int(limit * BACK_OFF) if state.strained >= 2 else limit - 1
    elif verdict is Verdict.DISTRESS:
        state = replace(state, slow_start=False, strained=0, distressed_at=distressed_at)
        new = limit - 1
    elif verdict is Verdict.HEALTHY:
        healthy = state.healthy + 1
        state = replace(
            state, strained=0, healthy=healthy, calm_seen=state.calm_seen or healthy > 0
        )
        new = limit
        if reading.waiting > 0 and state.healthy >= grow_after(state) and tested(state, reading):
            new = grown(state, reading)
            why += f" {state.healthy} times in a row, {reading.waiting} waiting"
            # The next reading's probe starts as the turns this growth lets in do: it
            # says nothing of them yet. The one after it does.
            state = replace(state, healthy=GROW_AFTER - 2)
    else:
        state = replace(state, strained=0)
        new = limit
    if verdict is not Verdict.HEALTHY:
        state = replace(state, healthy=0)
    new = bounds.clamp(new)
    if new == limit:
        return state, None
    return replace(state, limit=new), Change(limit, new, why)


def resume(state: Controller, now: float, bounds: Bounds) -> tuple[Controller, Change | None]:
    """Work arrives at a gate gone idle: start again from `start`, or from below the
    limit of the last distress if that is lower, so that a fan-out is let in at the
    start value and grows from there. What was learnt of the disk stays: its baseline,
    and the limit that met distress, which counts IO costs (core/iocost.py), so it says
    how many heavy writers at once the disk did not bear, whatever the mix was."""
    if state.last_reading is None:
        return state, None
    start = bounds.start
    below = below_distress(state)
    if below is not None:
        start = min(start, below)
    start = bounds.clamp(start)
    quiet = f"idle for {now - state.last_reading:.0f} s: starting again from {start}"
    state = replace(
        state, slow_start=True, strained=0, healthy=UNSEEN, calm_seen=False, last_reading=now
    )
    if state.limit == start:
        return state, None
    return replace(state, limit=start), Change(state.limit, start, quiet)
