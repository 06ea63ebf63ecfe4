"""bench/bench_adaptive.py's fan-outs on a simulated SD card, with the gate's own rule,
costs and admission (volutectl/core/adaptive.py, iocost.py, admission.py) as they are:
deterministic and fast (a cold and a warm fan-out of 33 minds in well under a second),
for designing a change to the rule before the real, slow and noisy bench confirms it.

The disk serves one request at a time, first come first served: a synced 64 KiB write
takes `WRITE_S` (the SD profile's 2 MB/s), a synced 4 KiB write `PROBE_S` (its 60 IOPS),
each within +-30 % at random; a writer thinks up to `THINK_S` between its writes, so a
probe behind k writers waits for up to k writes, or fewer by luck, as on the card. The
bench's probe (volute_testbed.diskprobe) writes every 200 ms; its p99 over the fan-out
is the figure the bench judges.

The workloads are the bench's (all-write: 48 synced 64 KiB writes; network: a wait of
4-8 s, the same per mind, then 2; mixed: every third mind all-write, the others
network). The deliveries land `DELIVERY_EVERY` apart, each with its synced commit and
an admission pass; a turn starts `START_S` after admission lets it, and the gate writes
for it as it starts and as it ends (`GATE_WRITE_S`). The gate's side follows
volutectl/gate/adaptive.py: a reading every interval with the probe that started at the
last one (the most turns and IO cost that ran while it did), samples of what each
running turn wrote at each reading and at the end of its probation, each ended turn's
bytes learnt as its mind's cost, `resume` when work arrives at an idle gate, and one
quiet probe before a cold gate's first fan-out.

    .venv/bin/python bench/simulate_adaptive.py [--minds 33] [--workload mixed]
        [--seeds 200] [--interval 0.5]

(docs/benchmarks.md, "The adaptive gate at the incident's scale", has what it showed of
issue 32's warm fan-out, and the variants of `iocost.STARTING` it compared. Those runs
used the gate's writes before issue 32 cut them (21.4 KB a delivery, 74 KB a turn); with
today's constants below the same command gives lower figures.)

prints, for ungated, cap 2 and the default (cold, then warm: the same fan-out again on
the gate the cold one left), over the seeds: the median and worst probe p99, the median
makespan, the most turns and the most heavy writers at once; and the cell's bound (as
the bench's: max(1.5 x cap 2's median p99, cap 2's + 20 ms)). The model is coarse (the
real card's journal commits, writeback and blkio throttle are not in it): it ranks
rules, the real bench gives the figures.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from volutectl.core import adaptive, iocost
from volutectl.core.adaptive import Bounds, Controller, Reading
from volutectl.core.admission import Delivery, Limits, LiveTurn, admit
from volutectl.states import HoldReason

KIB = 1024
WRITE_S = 64 * KIB / (2 * 1024 * KIB)  # a synced 64 KiB write at 2 MB/s: 31 ms
PROBE_S = 1 / 60  # a synced 4 KiB write at 60 IOPS: 17 ms
THINK_S = 0.010  # a writer's pause between two writes, at most
START_S = 0.05  # admission to the turn's first step
# The gate's own synced writes, on the same card (bench_admission's section 4, after
# issue 32 cut them: docs/benchmarks.md, "The gate's own writes, cut"): 11.5 KB a
# delivery, and 22 KB with 2 fsyncs a turn (one as it starts, one as it ends).
GATE_WRITE_S = 11 * KIB / (2 * 1024 * KIB) + PROBE_S
DELIVERY_WRITE_S = 11.5 * KIB / (2 * 1024 * KIB) + PROBE_S
# The fan-out's `volutectl deliver`s land this far apart (33 interpreters' starts on 2
# cores: the bench's first turn starts 1-8 s after the first delivery, under load).
DELIVERY_EVERY = 0.05
BENCH_PROBE_EVERY = 0.2
BOUNDS = Bounds(start=2, minimum=1, maximum=16)


@dataclass
class Turn:
    id: int
    mind: str
    writes: int  # synced 64 KiB writes left
    wait: float  # seconds of waiting on the network first
    started: float = 0.0
    written: int = 0
    blocked: bool = False  # a write of its is queued or in service
    ended: float | None = None
    heavy: bool = False


@dataclass
class Disk:
    rng: random.Random
    free_at: float = 0.0

    def submit(self, now: float, service: float) -> float:
        """When a request submitted now completes (first come, first served)."""
        done = max(now, self.free_at) + service * self.rng.uniform(0.7, 1.3)
        self.free_at = done
        return done


def workload(name: str, index: int) -> tuple[int, float]:
    """(synced 64 KiB writes, seconds of network wait first) of mind `index`'s turn."""
    heavy = name == "all-write" or (name == "mixed" and index % 3 == 0)
    if heavy:
        return 48, 0.0
    return 2, random.Random(index).uniform(4.0, 8.0)


@dataclass
class Gate:
    """The gate's side of volutectl/gate/adaptive.py, on the simulated clock."""

    cap: int | None  # a static cap (the adaptive limit off), or None
    adaptive: bool
    interval: float = 0.5
    controller: Controller = field(default_factory=lambda: adaptive.initial(BOUNDS))
    costs: iocost.Costs = field(default_factory=iocost.Costs)
    running: dict[int, iocost.Running] = field(default_factory=dict)
    asked: set[int] = field(default_factory=set)
    scheduled: set[int] = field(default_factory=set)  # turns with a probation's sample due
    deadline: float | None = None
    probe_started: float | None = None
    probe_done: float | None = None
    probe_running: int = 0
    probe_load: float = 0.0
    latency: float | None = None
    waiting: int = 0
    busy: int = 0
    load: float = 0.0
    limits_seen: list[tuple[float, int]] = field(default_factory=list)

    def mind_costs(self) -> dict[str, float]:
        return self.costs.of() if self.adaptive else {}

    def running_costs(self) -> dict[str, float]:
        known = self.mind_costs()
        sums: dict[str, list[float]] = {}
        for turn in self.running.values():
            sums.setdefault(turn.mind, []).append(iocost.running_cost(turn, known.get(turn.mind)))
        return {mind: sum(c) / len(c) for mind, c in sums.items()}

    def limits(self) -> Limits:
        if not self.adaptive:
            return Limits(global_cap=self.cap)
        return Limits(
            adaptive=self.controller.limit,
            costs={mind: iocost.starting_cost(c) for mind, c in self.mind_costs().items()},
            running_costs=self.running_costs(),
            adaptive_turns=BOUNDS.maximum,
        )


@dataclass
class Result:
    makespan: float
    p99: float
    most: int
    most_heavy: int
    limits: list[tuple[float, int]]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


class Fanout:
    """One fan-out of `minds` minds on `gate`, from t = 0 (the gate's clock goes on)."""

    def __init__(self, gate: Gate, minds: int, load: str, seed: int, t0: float) -> None:
        self.gate, self.t0 = gate, t0
        self.rng = random.Random(seed)
        self.disk = Disk(self.rng, t0)
        self.events: list[tuple[float, int, str, object]] = []
        self.order = itertools.count()
        self.pending: list[Delivery] = []  # deliveries landed and not started
        self.specs = {f"m{i:02d}": workload(load, i) for i in range(minds)}
        self.turns: dict[int, Turn] = {}
        self.next_id = itertools.count(1000 * seed + int(t0))
        self.probes: list[float] = []
        self.most = self.most_heavy = 0
        self.minds = minds

    def at(self, when: float, what: str, subject: object = None) -> None:
        heapq.heappush(self.events, (when, next(self.order), what, subject))

    def live(self) -> list[Turn]:
        return [turn for turn in self.turns.values() if turn.ended is None]

    def run(self) -> Result:
        gate = self.gate
        if gate.adaptive and gate.controller.baseline_ms is None:
            quiet = PROBE_S * 1000
            gate.controller = adaptive.learn_quiet(gate.controller, quiet)
        self.at(self.t0, "bench-probe")
        for i in range(self.minds):  # the fan-out's `volutectl deliver`s land one by one
            self.at(self.t0 + i * DELIVERY_EVERY, "deliver", i)
        ends: list[float] = []
        while self.events and len(ends) < self.minds:
            now, _, what, subject = heapq.heappop(self.events)
            handler: Callable[[float, object], float | None] = getattr(
                self, "on_" + what.replace("-", "_")
            )
            ended = handler(now, subject)
            if ended is not None:
                ends.append(ended)
        makespan = max(ends) - self.t0
        gate.deadline = None  # idle: the gate sleeps
        return Result(
            makespan, percentile(self.probes, 0.99), self.most, self.most_heavy, gate.limits_seen
        )

    # -- the gate ----------------------------------------------------------------------

    def admission(self, now: float) -> None:
        gate = self.gate
        if gate.adaptive and gate.deadline is None:
            gate.controller, _ = adaptive.resume(gate.controller, now, BOUNDS)
        live = [LiveTurn(t.id, t.mind, "s") for t in self.live()]
        limits = gate.limits()
        decision = admit(self.pending, live, limits, now=now)
        started = {start.mind for start in decision.starts}
        for start in decision.starts:
            writes, wait = self.specs[start.mind]
            turn = Turn(next(self.next_id), start.mind, writes, wait, now, heavy=writes > 2)
            self.turns[turn.id] = turn
            self.disk.submit(now, GATE_WRITE_S)
            self.at(now + START_S, "step", turn)
        self.pending = [d for d in self.pending if d.mind not in started]
        live_turns = self.live()
        self.most = max(self.most, len(live_turns))
        self.most_heavy = max(self.most_heavy, sum(t.heavy for t in live_turns))
        if not gate.adaptive:
            return
        gate.running = {
            t.id: gate.running.get(t.id) or iocost.Running(t.mind, now) for t in live_turns
        }
        for turn in live_turns:
            if turn.id not in gate.asked and turn.id not in gate.scheduled:
                gate.scheduled.add(turn.id)
                self.at(turn.started + iocost.PROBATION_SECONDS, "sample", turn.id)
        known, now_costs = gate.mind_costs(), gate.running_costs()
        gate.busy = len(live_turns)
        gate.load = sum(now_costs.get(t.mind, known.get(t.mind, 1.0)) for t in live_turns)
        gate.waiting = sum(h.reason is HoldReason.ADAPTIVE_LIMIT for h in decision.holds)
        if gate.probe_started is not None:
            gate.probe_running = max(gate.probe_running, gate.busy)
            gate.probe_load = max(gate.probe_load, gate.load)
        if not (gate.busy or gate.waiting):
            gate.deadline = None
            return
        if gate.deadline is None:
            gate.deadline = now + gate.interval
            self.at(gate.deadline, "reading")
            self.start_probe(now)

    def start_probe(self, now: float) -> None:
        gate = self.gate
        if gate.probe_started is not None:
            return
        gate.probe_started = now
        gate.probe_running, gate.probe_load = gate.busy, gate.load
        self.at(self.disk.submit(now, PROBE_S), "gate-probe", now)

    def on_gate_probe(self, now: float, began: object) -> None:
        gate = self.gate
        assert isinstance(began, float)
        if gate.probe_started == began:
            gate.latency = max(gate.latency or 0.0, (now - began) * 1000)
            gate.probe_started = None

    def on_reading(self, now: float, _: object) -> None:
        gate = self.gate
        if gate.deadline != now:
            return
        latency = gate.latency
        if gate.probe_started is not None:
            latency = max(latency or 0.0, (now - gate.probe_started) * 1000)
        reading = Reading(now, latency, None, gate.probe_running, gate.waiting, gate.probe_load)
        gate.latency = None
        gate.controller, _change = adaptive.step(gate.controller, reading, BOUNDS)
        gate.limits_seen.append((now - self.t0, gate.controller.limit))
        self.sample(now)
        gate.deadline = now + gate.interval if (gate.busy or gate.waiting) else None
        if gate.deadline is not None:
            self.at(gate.deadline, "reading")
        self.start_probe(now)
        self.admission(now)

    def sample(self, now: float) -> None:
        gate = self.gate
        for turn_id, running in list(gate.running.items()):
            turn = self.turns[turn_id]
            gate.running[turn_id] = running.sample(now, turn.written, turn.blocked)
            if now - running.started >= iocost.PROBATION_SECONDS:
                gate.asked.add(turn_id)

    def on_sample(self, now: float, turn_id: object) -> None:
        if turn_id in self.gate.running and turn_id not in self.gate.asked:
            self.sample(now)
            self.admission(now)

    # -- the turns and the bench's probe -----------------------------------------------

    def on_step(self, now: float, turn: object) -> float | None:
        assert isinstance(turn, Turn)
        if turn.wait > 0:
            wait, turn.wait = turn.wait, 0.0
            self.at(now + wait, "step", turn)
            return None
        if turn.writes > 0:
            turn.blocked = True
            self.at(self.disk.submit(now, WRITE_S), "written", turn)
            return None
        turn.ended = now
        self.disk.submit(now, GATE_WRITE_S)
        self.gate.running.pop(turn.id, None)
        if self.gate.adaptive:
            self.gate.costs = self.gate.costs.learn(turn.mind, turn.written)
        self.admission(now)
        return now

    def on_written(self, now: float, turn: object) -> None:
        assert isinstance(turn, Turn)
        turn.writes -= 1
        turn.written += 64 * KIB
        turn.blocked = False
        self.at(now + self.rng.uniform(0.0, THINK_S), "step", turn)

    def on_deliver(self, now: float, index: object) -> None:
        """A delivery lands: its commit, then an admission pass."""
        assert isinstance(index, int)
        self.pending.append(Delivery(index, f"m{index:02d}", "s"))
        self.at(self.disk.submit(now, DELIVERY_WRITE_S), "admit")

    def on_admit(self, now: float, _: object) -> None:
        self.admission(now)

    def on_bench_probe(self, now: float, _: object) -> None:
        self.at(self.disk.submit(now, PROBE_S), "bench-probe-done", now)

    def on_bench_probe_done(self, now: float, began: object) -> None:
        assert isinstance(began, float)
        self.probes.append((now - began) * 1000)
        self.at(max(now, began + BENCH_PROBE_EVERY), "bench-probe")


def cold_and_warm(minds: int, load: str, seed: int, interval: float) -> tuple[Result, Result]:
    gate = Gate(cap=None, adaptive=True, interval=interval)
    cold = Fanout(gate, minds, load, seed, 0.0).run()
    gate.limits_seen = []
    warm = Fanout(gate, minds, load, seed + 7919, 1000.0).run()
    return cold, warm


def static(cap: int | None, minds: int, load: str, seed: int) -> Result:
    return Fanout(Gate(cap=cap, adaptive=False), minds, load, seed, 0.0).run()


def summary(name: str, results: list[Result], bound: float | None) -> str:
    p99s = [r.p99 for r in results]
    over = sum(p > bound for p in p99s) if bound is not None else 0
    return (
        f"| {name} | {statistics.median(p99s):.0f} ms | {max(p99s):.0f} ms | {over} "
        f"| {statistics.median(r.makespan for r in results):.1f} s "
        f"| {max(r.most for r in results)} | {max(r.most_heavy for r in results)} "
        f"| {statistics.median(r.most_heavy for r in results):.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--minds", type=int, default=33)
    parser.add_argument("--workload", default="mixed", choices=["all-write", "network", "mixed"])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    seeds = range(1, args.seeds + 1)
    ungated = [static(None, args.minds, args.workload, s) for s in seeds]
    cap2 = [static(2, args.minds, args.workload, s) for s in seeds]
    pairs = [cold_and_warm(args.minds, args.workload, s, args.interval) for s in seeds]
    cap2_p99 = statistics.median(r.p99 for r in cap2)
    bound = max(1.5 * cap2_p99, cap2_p99 + 20)
    print(f"{args.minds} minds, {args.workload}, {args.seeds} seeds: bound {bound:.0f} ms")
    print(
        "| run | p99 median | p99 worst | runs over the bound | makespan median "
        "| most at once | most heavy at once | median most heavy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(summary("ungated", ungated, bound))
    print(summary("cap 2", cap2, bound))
    print(summary("default, cold", [c for c, _ in pairs], bound))
    print(summary("default, warm", [w for _, w in pairs], bound))


if __name__ == "__main__":
    main()
