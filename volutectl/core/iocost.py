"""The pure part of the IO cost per mind: what one turn of each mind costs against the
adaptive limit, learnt from what its turns wrote.

A count of turns cannot tell a turn that writes 3 MiB from one that waits on the network
and writes 128 KiB: both take a place of the adaptive limit, so the limit that keeps the
probe healthy with two heavy writers holds the light turns too, and one that opens for
the light turns lets the heavy ones in together. As Meta's iocost gives each IO a cost
and shares a budget, the gate gives each mind's turn a cost (`cost_of`), and admission
(volutectl/core/admission.py) admits against the limit as a budget of costs: the limit
counts whole turns of cost 1, light turns fill what is left of the last place
(`Limits.full`), and a light turn may pass a heavy one the limit holds while the light
turns running cost less than one place (`admission.may_pass`: the bound on leaving FIFO
that keeps every turn from starving).

- **What a turn wrote** comes from its own rusage (`ru_oublock` of the turn's processes,
  reaped by the launcher: volutectl/launcher/hands.py), which works on any cgroup
  hierarchy. Each mind keeps the larger of its newest turn's bytes and the mean of that
  and what it had (`learn`): a mind that turns heavy is charged at once, one that turns
  light is believed over a few turns.
- **A cost is relative**: a turn that writes `FULL_BYTES` or more, or as much as the
  heaviest mind known, costs 1, one place of the limit, as every turn did before; a
  lighter one its share of that, rounded up to a power of two (1/2, 1/4, ...) and never
  under `FLOOR`. Rounded, the costs of a uniform workload are all 1 whatever the noise,
  and the limit means what it meant: the cells where every turn is alike run as before.
- **A turn that starts costs at least `STARTING`** until a sample after its probation
  has judged it (`starting_cost`), however light its mind is known to be: the gate's
  own synced writes for a turn (its start and end, bench_admission's section 4), its
  scope, and whatever its program writes as it starts land on the disk at once, and a
  mind's learnt cost spreads what its turns wrote over their lives. Priced at their
  learnt sixteenth, a warm gate's known light turns all started in one pass: at a limit
  of 1, one heavy writer and 15 light turns at once, the maximum reached through costs,
  the probe behind their starts at 2.2x cap 2's p99 (issue 32, docs/benchmarks.md). At
  a half, the starts are let in as a cold gate's are, a few per probation, and once
  sampled each costs what its mind has shown.
- **An unknown mind costs 1**, as the heaviest: a guess of light would let a heavy
  writer in at a fraction of its cost, which the probe sees only once it writes, and a
  lowered limit stops no running turn; a guess of heavy costs only waiting, which the
  limit's growth (it grows while deliveries wait) repays. So a cold gate admits by count.
- **A running turn shows what it writes** (`Running`, `running_cost`): the root launcher
  reads, at each reading of the adaptive limit, what each running turn's processes have
  written so far (`/proc/PID/io`'s `write_bytes` over its scope's processes:
  volutectl/kernel/processes.py), so a cold gate need not wait for turns to end to tell
  a heavy writer from a turn that waits on the network. A turn costs its mind's cost
  (`UNKNOWN` if none is known) until a sample taken `PROBATION_SECONDS` or more
  after it started that does not find it waiting on the disk (a writer held up behind the
  others has written nothing yet); from then on the larger of its mind's learnt cost and
  what it has written so far, and 1 for the rest of its life once it has written
  `WRITING_BYTES` or more between two samples (a writer now; a turn slowed by the
  writers beside it would otherwise look lighter the more of them run, and let more
  in). So the limit bounds
  the writers, and turns that wait on the network pass it at the floor's cost: the
  limit doubles in slow start only while some of the turns cost less than a place
  (volutectl/core/adaptive.py); a cold gate's unknown heavy writers, each a whole place
  until it has shown it does not write, grow it by one. What the samples cannot see: a
  quiet turn that starts writing later is charged from the next sample, and a lowered
  limit stops no running turn; its mind's learnt cost charges it from its next turn on.
- **Writers one at a time, in a mix** (`mixed`, `writes_now`): where the gate has seen
  writers among lighter turns, at least as many of those, a turn of a whole place waits
  while a running turn may be writing now (admission's `writer_hold`): two heavy writers
  at once on a slow disk are what the probe meets, and the lighter turns fill the
  places meanwhile, so the fan-out loses little time. Where every turn writes, or none,
  the limit alone decides.
- **A pause between writers** (`WRITER_PAUSE`): in a mix, the next writer also waits
  until that long after a turn was last seen maybe writing (a sample that found it
  so, or its end before a sample showed it had stopped). Started right after another,
  a writer on the eMMC profile met a slow probe sample about twice as often as one
  started later, in cap 2's runs as in the gate's: the card is still busy with the
  last one's writes (its file system's journal, its deleted file).
- Costs live in the gate's memory: a gate that starts again starts cold.

No I/O here: the bytes come in from the gate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

FULL_BYTES = 1 << 20  # a turn that writes this much or more costs a whole place
FLOOR = 1 / 16  # the least a turn costs: sixteen of the lightest fill one place
UNKNOWN = 1.0  # a mind with no turn measured yet: as the heaviest
WRITING_BYTES = 64 * 1024  # written between two samples: a writer, for the rest of the turn
# How long a turn runs before a sample may call it quiet: a program needs a moment to start
# writing (an interpreter's start, a session spinning up), and a sample taken before that
# would let a heavy writer in at the floor's cost (one busy meanwhile, waiting on the
# disk or running, is not judged: `Running.sample`). It paces a cold gate: at a limit of
# 2, two turns of unknown writes are let in per probation, so a network-bound fan-out of
# 16 took 1.18x cap 16's time on the SD card at 0.4 s, and 1.24-1.26x on the eMMC and
# unthrottled disks at 0.25 s; at 0.1 s, 1.12-1.13x (docs/benchmarks.md, "A shorter
# probation"). However short, a sample judges a turn light only when all its processes
# sleep: what a shorter one lets in sooner is a program asleep at once, as a turn
# waiting on the model is; one that sleeps briefly and then writes is charged from the
# next sample, as one that waited out the longer probation was.
PROBATION_SECONDS = 0.1
# What a turn of a known mind costs at least until a sample after its probation judges it
# (`starting_cost`): at a limit of 1 beside a heavy writer, one start at a time.
STARTING = 0.5
# How long writers one at a time pause after a turn was last seen maybe writing, before
# the next one starts: two sample intervals, so a writer that stopped just after a
# sample leaves the disk at least one interval to itself. On the eMMC profile, of the
# probe samples that met a heavy writer started within 0.1 s of another's end (the
# next pass's, 0.03-0.05 s), 25% were slow (over the cell's bound); of those that met
# one started later, 13% (docs/benchmarks.md, "A pause between writers").
WRITER_PAUSE = 2 * PROBATION_SECONDS


@dataclass(frozen=True)
class Costs:
    """What each mind's turns write, in bytes per turn, as learnt."""

    written: Mapping[str, float] = field(default_factory=dict)

    def learn(self, mind: str, written_bytes: int) -> Costs:
        """One more turn of `mind` ended having written `written_bytes`."""
        old = self.written.get(mind)
        new = float(written_bytes) if old is None else max(written_bytes, (old + written_bytes) / 2)
        return Costs({**self.written, mind: new})

    def of(self) -> dict[str, float]:
        """Each known mind's cost; a mind not listed costs `UNKNOWN`."""
        if not self.written:
            return {}
        full = max(FULL_BYTES, *self.written.values())
        return {mind: cost_of(written / full) for mind, written in self.written.items()}


def cost_of(share: float) -> float:
    """A share of a full turn's writes, rounded up to a power of two, within FLOOR..1:
    sums of such costs are exact in floating point, so a budget check never errs by a
    rounding."""
    cost = 1.0
    while cost / 2 >= share and cost / 2 >= FLOOR:
        cost /= 2
    return cost


@dataclass(frozen=True)
class Running:
    """What a running turn has shown of its writes, sample by sample."""

    mind: str
    started: float  # monotonic: when the gate first counted it
    written: int = 0  # bytes its processes had written at the last sample
    sampled: float | None = None  # monotonic: the last sample taken after its probation
    writing: bool = False  # it wrote WRITING_BYTES or more between two samples
    recent: bool = False  # ...at that pace between the last two: it writes now (`writes_now`)
    last: float | None = None  # monotonic: its last sample, if any
    busy: bool = False  # at its last sample: waiting on the disk, or running

    def sample(
        self, now: float, written: int, blocked: bool = False, probation: float = PROBATION_SECONDS
    ) -> Running:
        """A sample at `now`: its processes have written `written` bytes so far, and one
        of them is busy (`blocked`: waiting on the disk, or running). A sample within its
        first `probation` seconds only moves the mark, and so does one that finds it
        busy before it has shown anything: a turn held up in its first write, or in the
        open before it, behind a disk kept busy by others, or still running its way to
        its first write, has not shown that it is quiet."""
        delta = written - self.written
        writing = self.writing or delta >= WRITING_BYTES
        # Samples come at every turn's probation's end, so two may be milliseconds
        # apart: over a span shorter than a probation, WRITING_BYTES's pace is a writer.
        span = now - (self.started if self.last is None else self.last)
        recent = delta > 0 and delta >= WRITING_BYTES * min(1.0, span / PROBATION_SECONDS)
        mark = max(self.written, written)
        seen = replace(self, written=mark, writing=writing, recent=recent, last=now, busy=blocked)
        if now - self.started < probation or (blocked and self.sampled is None):
            return seen
        return replace(seen, sampled=now)


def starting_cost(learnt: float | None) -> float:
    """What a new turn of a mind of cost `learnt` (None: not known) costs until a sample
    after its probation judges it: UNKNOWN if not known, else at least STARTING."""
    return UNKNOWN if learnt is None else max(learnt, STARTING)


def running_cost(turn: Running, learnt: float | None) -> float:
    """What a running turn costs now: `starting_cost` of its mind's (`learnt`) until
    it has been sampled after its probation, then the larger of that learnt cost and
    what it wrote so far; 1 once it has been seen writing."""
    if turn.writing:
        return 1.0
    if turn.sampled is None:
        return starting_cost(learnt)
    so_far = cost_of(turn.written / FULL_BYTES)
    return so_far if learnt is None else max(learnt, so_far)


def writes_now(turn: Running, learnt: float | None) -> bool:
    """Whether a running turn may be writing now, for writers one at a time: it wrote
    at WRITING_BYTES's pace between its last two samples, or it was seen writing and
    was busy at its last sample (a writer waiting on a slow disk's sync writes little
    between two samples close together), or no sample has judged it yet and its mind is
    not known to be light (`starting_cost` a whole place). A turn that wrote once and
    then waits (on the model, for seconds) is not: it still costs a whole place against
    the limit (`running_cost`), but it holds no writer back."""
    if seen_writing(turn):
        return True
    return turn.sampled is None and not turn.writing and starting_cost(learnt) >= 1


def seen_writing(turn: Running) -> bool:
    """Whether its last sample showed it writing: at WRITING_BYTES's pace since the one
    before, or seen writing before and busy now (`writes_now` on evidence alone, not on
    what a turn not judged yet may do)."""
    return turn.recent or (turn.writing and turn.busy)


def mixed(learnt: Mapping[str, float], running: Iterable[Running]) -> bool:
    """Whether the gate has seen writers among lighter turns, as many of those at least
    as of the writers: then writers go one at a time (admission's `Limits.stagger`).

    A mind is a writer if its learnt cost (`learnt`, from `Costs.of`) is a whole place or
    a turn of it runs seen writing; light if its learnt cost is less, or a turn of it
    runs judged quiet after its probation. Where every turn writes (all writers) or none
    does (none), this is false and the limit alone decides, as before; where the lighter
    turns are at least as many, running the writers one at a time costs the fan-out
    little (the lighter turns fill the places) and keeps their bursts apart, which two
    at once on a slow disk do not (docs/benchmarks.md, "Writers one at a time")."""
    writers = {mind for mind, cost in learnt.items() if cost >= 1}
    lights = {mind for mind, cost in learnt.items() if cost < 1}
    for turn in running:
        if turn.writing:
            writers.add(turn.mind)
        elif turn.sampled is not None and running_cost(turn, learnt.get(turn.mind)) < 1:
            lights.add(turn.mind)
    lights -= writers
    return bool(writers) and len(lights) >= len(writers)
