"""The adaptive limit, the gate's side: it measures the storage, moves the limit with
volutectl/core/adaptive.py's rule, and says so.

Every `limits.adaptive.interval_seconds`, and only while turns run or deliveries wait
(an idle gate has no deadline here, so it never wakes for it), the gate takes a
reading (while turns run and nothing waits at the limit, the probe only every
QUIET_READINGS of them, and only those readings move the limit, the disks' and PSI's
with them; deliveries held by the bound on turns at once, the maximum or the CPUs',
wait for a turn to end or for the CPUs' readings, not for the probe's):
- **the probe**: a 4 KiB write and fdatasync to a file of its own in its state
  directory, the disk its queue commits to (on a Pi, the disk its turns write to),
  timed in a worker thread so that a stalled disk never blocks the loop; the thread
  says it is done through a pipe the reactor watches. A probe still running when the
  interval ends is read as at least that slow;
- **PSI**: the `some total=` stall of the turns slice's io.pressure when readable, else
  of /proc/pressure/io, as the share of the interval (plain reads, no trigger);
- **every disk the turns use** (volutectl/gate/disks.py): the await of each block device
  that holds a mind's working directory or home, the state directory, the journal, or
  that limits.adaptive.devices names, from /sys/block/DEV/stat, each against its own
  quiet await and put on the probe's scale (volutectl/core/disks.py). The worst of
  them and the probe is the reading's latency: the worst disk decides, and `status`
  and the journal (AdaptiveDiskHolds) name it when it is not the probe's;
- **the CPUs**: PSI `cpu` the same way (volutectl/gate/cpu.py), which moves a bound of
  its own on turns at once (volutectl/core/cpu.py), given to admission with the
  maximum by `turns_bound()`. Its file failing is a failure as io.pressure's is.

A gate that has not measured its disk yet probes it once while nothing runs or waits,
at its start as a rule: that probe teaches the baseline what a quiet disk answers
(core/adaptive.py's learn_quiet), before the first fan-out's readings show a queue.

A probe that fails, a PSI file that was readable and then vanishes or reads as garbage,
or a watched disk that was read and then cannot be (a USB disk pulled), puts the gate
in mode "fallback": a static cap of `start` that counts turns (no costs), said once in
the journal (AdaptiveFallback) and in `status`, until the signals work again
(AdaptiveMeasuring). A host with no PSI at all measures with the probe alone.

Admission takes `limit()` as its adaptive cap (volutectl/gate/loop.py: the effective
cap is the lower of it and `global_concurrent_turns`), as a budget of IO costs
(volutectl/core/iocost.py), and `turns_bound()` (the maximum) as a bound on turns at
once whatever their costs:
- each turn that ends tells `learn_cost` what it wrote (its rusage, reaped by the
  launcher), and `costs()` gives each known mind's cost for its next turn;
- the loop tells `track` which turns run, and at each reading, and when a running
  turn's probation ends (`sample_deadline`), asks the launcher what each has written so
  far and whether it is busy, waiting on the disk or running (the `sample` order);
  `observe` takes the answer, and `running_costs()` gives what each running turn costs
  now. A sample that fails (an older launcher, or none) leaves running turns at their
  minds' costs and is tried again SAMPLE_PAUSE later;
- the readings scale the probe's latency by the running turns' costs, not their count.

Each move is one AdaptiveLimitChanged event, at most one every `EVENT_SECONDS`: the
moves in between are said in one entry, with their count (the journal may live on the
stalled disk).

The reading is a `Sensor`'s (the probe and PSI: `StorageSensor`), given to the gate
(volutectl/gate/loop.py's `Gate(sensor=...)`; a test's is scripted); the decisions are
the controller's (volutectl/core/adaptive.py), and the times are those the loop passes
in, from the gate's clock (volutectl/clock.py). Only the probe's own latency is timed
on the host's clock: it is what is measured.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from volutectl import events
from volutectl.core import adaptive, iocost
from volutectl.core import disks as disk_rule
from volutectl.core.adaptive import Bounds, Change, Reading
from volutectl.core.psi import parse_total, stall_fraction
from volutectl.events import Emit
from volutectl.gate.cpu import CpuSignal
from volutectl.gate.disks import DiskWatch, describe, holdings
from volutectl.kernel import blockdevs
from volutectl.kernel.probes import (
    CGROUP_ROOT,
    SYSTEM_PRESSURE,
    preferring_slice,
    readable_pressure,
)
from volutectl.kernel.written import Written
from volutectl.states import AdaptiveMode
from volutectl.wire.messages import AdaptiveStatus, DiskStatus

if TYPE_CHECKING:
    from volutectl.config.reload import SettingsHolder
    from volutectl.config.settings import Settings

EVENT_SECONDS = 5.0  # at most one AdaptiveLimitChanged entry this often
SAMPLE_PAUSE = 30.0  # after a sample failed, the next is tried this long after
PROBE_BYTES = 4096
# While turns run and nothing waits, the probe (a synced 4 KiB on the disk the gate
# guards) runs for one reading in QUIET_READINGS, not each: the limit cannot grow then,
# and a distress is still seen within QUIET_READINGS intervals. The readings between
# take PSI, the CPUs and samples, and move the limit on none of them (a reading with no
# probe would end a healthy streak). A delivery that waits at the limit has the next
# one probe; one that waits at the bound on turns at once (`turns_bound`: the maximum,
# or the CPUs' bound) does not: no growth of the limit would let it in. On the SD card
# a probe is an fsync, 3-4 of the card's 60 IOs a second, and a fan-out of 33 network
# turns waited at the maximum of 16 for most of its 17 s with the probe at every
# reading: 3-5 samples a run over the bound as turns ended, where cap 16, with no probe,
# had 0-1 (docs/benchmarks.md, "Deliveries that keep coming share commits").
QUIET_READINGS = 4
# At its start, the gate waits at most this long for its quiet disk's probe before it
# serves (`measure_quiet_disk`).
QUIET_PROBE_WAIT = 1.0
QUIET_AGREE = 0.25  # two quiet probes agree within this share of the first (or 1 ms)
PROBE_FILE = "adaptive-probe"


class Probe:
    """A timed 4 KiB synced write, done by a worker thread; `fileno()` becomes readable
    when one is done, and `take()` gives its latency in ms, or the OSError it met."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wanted = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._result: float | OSError | None = None
        self._closing = False
        self.started_at: float | None = None  # monotonic: the probe in flight, if any
        self._thread: threading.Thread | None = None

    def fileno(self) -> int:
        return self._read_fd

    @property
    def in_flight(self) -> bool:
        return self.started_at is not None

    def start(self, now: float) -> None:
        """Ask for one probe, unless one is in flight (a stalled disk is not piled on)."""
        if self.in_flight or self._closing:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="adaptive-probe", daemon=True)
            self._thread.start()
        self.started_at = now
        self._wanted.release()

    def take(self) -> float | OSError | None:
        """The probe that ended, if one did since the last take."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._read_fd, 64)
        with self._lock:
            result, self._result = self._result, None
        if result is not None:
            self.started_at = None
        return result

    def _work(self) -> None:
        block = b"\0" * PROBE_BYTES
        fd = -1
        while True:
            self._wanted.acquire()
            if self._closing:
                break
            began = time.monotonic()
            result: float | OSError
            try:
                if fd < 0:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
                os.pwrite(fd, block, 0)
                os.fdatasync(fd)
                result = (time.monotonic() - began) * 1000
            except OSError as error:
                result = error
                if fd >= 0:
                    os.close(fd)
                    fd = -1
            with self._lock:
                self._result = result
            with contextlib.suppress(OSError):
                os.write(self._write_fd, b"!")
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        """Stop the worker; one stuck in a stalled fdatasync is left to finish alone."""
        self._closing = True
        self._wanted.release()
        if self._thread is not None:
            self._thread.join(timeout=0.1)
        if self._thread is None or not self._thread.is_alive():
            for fd in (self._read_fd, self._write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)


def pressure_file(
    settings: Settings, cgroup_root: Path = CGROUP_ROOT, system: Path = SYSTEM_PRESSURE
) -> Path | None:
    """The turns slice's io.pressure when it reads as PSI, else the system's, else None."""
    return readable_pressure(settings.turns.slice, "io.pressure", system, cgroup_root)


class Sensor(Protocol):
    """What the adaptive limit measures the storage with. The gate is given one (by
    default a StorageSensor) and gives it to its AdaptiveLimit: the sensor reads, the
    limit (with core/adaptive.py's controller) decides."""

    probe: Probe | None  # the timed synced write; None: none (the limit is off)
    psi_path: Path | None
    disks: DiskWatch | None  # every disk the turns use; None: none watched

    def psi_total(self) -> int | str | None:
        """PSI's `some total=` stall (µs); None: no PSI file; a text: why it fails."""
        ...

    def use_pressure_file(self, path: Path) -> None: ...

    def close(self) -> None: ...


class StorageSensor:
    """The probe and PSI. `probe` is None when the limit is off. `psi_total` gives PSI's
    cumulative stall, or None (no file: a host with no PSI), or why the file that read
    before now fails. The file is the turns slice's io.pressure, or the system's while
    the slice's does not read: a gate started before the slice (systemd makes its cgroup
    with the first turn) reads the slice's as soon as it does, the turns' own stall and
    not the host's. `cgroup_root` and `system`: where the files are (a test's tree)."""

    def __init__(
        self,
        settings: Settings,
        enabled: bool,
        psi: Path | None = None,
        sys_root: Path | None = None,
        cgroup_root: Path = CGROUP_ROOT,
        system: Path = SYSTEM_PRESSURE,
    ) -> None:
        self._settings = settings
        self._roots = (cgroup_root, system)
        self._psi_given = psi  # a test's file: no other is looked for
        self.psi_path = psi if psi is not None or not enabled else self._find()
        self.probe = Probe(settings.gate.state_dir / PROBE_FILE) if enabled else None
        self._psi_lost: str | None = None  # why the PSI file that read failed, until one reads
        # /sys, or a test's tree: looked up now, so that a test may put its own there
        watched = sys_root if sys_root is not None else blockdevs.SYS
        self.disks = DiskWatch(settings, watched) if enabled else None

    def use_pressure_file(self, path: Path) -> None:
        """Read PSI from `path` alone (a test's file)."""
        self._psi_given = self.psi_path = path

    def _find(self) -> Path | None:
        return self._psi_given or pressure_file(self._settings, *self._roots)

    def psi_total(self) -> int | str | None:
        """The `some total=` stall (µs), None with no PSI file, or why it cannot be read."""
        if self.psi_path is None and self._psi_lost is not None:
            # PSI read once and failed: look for a file again (the slice's cgroup may
            # have gone with the slice), and stay in fallback until one reads as PSI;
            # no file at all is not "a host with no PSI", which measures by the probe.
            self.psi_path = self._find()
            if self.psi_path is None:
                return self._psi_lost
        if self.psi_path is None:
            return None
        if self._psi_given is None:
            cgroup_root, system = self._roots
            slice_name = self._settings.turns.slice
            self.psi_path = preferring_slice(
                self.psi_path, slice_name, "io.pressure", system, cgroup_root
            )
        try:
            total = parse_total(self.psi_path.read_text())
        except (OSError, ValueError) as error:
            why = error.strerror if isinstance(error, OSError) else "not PSI text"
            self._psi_lost = f"{self.psi_path} cannot be read ({why})"
            self.psi_path = self._find()
            return self._psi_lost
        self._psi_lost = None
        return total

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()


class ChangeLog:
    """AdaptiveLimitChanged entries, at most one every EVENT_SECONDS: the moves within
    are said in the next entry, from the first's old limit to the last's new one."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self._last_sent: float | None = None
        self._pending: events.AdaptiveLimitChanged | None = None

    def note(self, event: events.AdaptiveLimitChanged, now: float) -> None:
        if self._pending is not None:
            event = replace(
                event, old_limit=self._pending.old_limit, changes=self._pending.changes + 1
            )
        if self._last_sent is None or now - self._last_sent >= EVENT_SECONDS:
            self._send(event, now)
        else:
            self._pending = event

    def deadline(self) -> float | None:
        if self._pending is None or self._last_sent is None:
            return None
        return self._last_sent + EVENT_SECONDS

    def on_deadline(self, now: float) -> None:
        if self._pending is not None:
            self._send(self._pending, now)

    def _send(self, event: events.AdaptiveLimitChanged, now: float) -> None:
        self._pending = None
        self._last_sent = now
        if event.old_limit != event.new_limit:  # moves that came back say nothing
            self._emit(event)


class AdaptiveLimit:
    """The limit, its measurements and its mode: "adaptive", "static" (limits.adaptive
    is off: no sensor reads, and `limit()` holds no adaptive cap) or "fallback" (a
    signal failed: `start`, until it works again). What it reads comes from `sensor`
    (the gate's; by default one of its own), and when from the times it is given."""

    def __init__(
        self,
        held: SettingsHolder,
        emit: Emit,
        psi: Path | None = None,
        sensor: Sensor | None = None,
        cpu: CpuSignal | None = None,
    ) -> None:
        self.held = held  # the bounds, interval and global cap, as a reload leaves them
        settings = held.current
        config = settings.limits.adaptive
        # limits.io_pressure is today's binary hold: the two are not stacked (the
        # config's checks refuse both, and turn this off when only that is set). Both,
        # and the rule, need a restart.
        self.enabled = config.enabled and not settings.limits.io_pressure.enabled
        self.rule = config.rule
        self.controller = adaptive.initial(self.bounds)
        self.fallback: str | None = None  # why, while in fallback
        self.reason: str | None = None  # of the last change
        self.sensor: Sensor = sensor or StorageSensor(settings, self.enabled, psi)
        self.probe = self.sensor.probe
        # The CPUs' own bound on turns at once (volutectl/gate/cpu.py).
        self.cpu = cpu or CpuSignal(settings, self.enabled)
        self.cpu_log = ChangeLog(emit)
        self.log = ChangeLog(emit)
        self._emit = emit
        self._deadline: float | None = None
        self._latency: float | None = None  # the last probe that ended, not yet read
        self._failure: str | None = None  # what failed since the last reading
        self._quiet_probe = False  # the probe in flight was started while nothing ran
        self._quiet_asked = False  # that first probe of a quiet disk was asked for
        self._probed = True  # the interval now ending has a probe of its own
        self._quiet_readings = 0  # readings in a row with turns running, nothing waiting
        self._probe_running = 0  # the most turns running while the probe ran
        self._probe_load = 0.0  # the most IO cost running while the probe ran
        self.io_costs = iocost.Costs()  # what each mind's turns write, as learnt
        self._costs: Mapping[str, float] = {}  # each known mind's cost, from io_costs
        # The running turns, by id, and what each has shown of its writes so far.
        self.running_turns: dict[int, iocost.Running] = {}
        self._asked: set[int] = set()  # turns sampled (or tried) after their probation
        self._sample_after = 0.0  # monotonic: no sample before (one failed)
        self._sampled_at = 0.0  # monotonic: the last sample asked for
        # monotonic: when a turn was last seen maybe writing (a sample, or its end), for
        # writers' pause (core/iocost.py's WRITER_PAUSE); and whether a pause runs whose
        # end admission has not yet been told of
        self._writing_seen: float | None = None
        self._pause_due = False
        self.sample_failure: str | None = None  # why the last sample failed, if it did
        self.load = 0.0
        # (total µs, monotonic, the file read) at the interval's start
        self._psi_mark: tuple[int, float, Path | None] | None = None
        self.running = 0
        self.waiting = 0
        self.at_limit = 0  # of those waiting, held by the limit, not by `turns_bound`
        self.last: Reading | None = None
        self.probe_ms: float | None = None  # the probe's own part of the last reading
        self.held_by: str | None = None  # the disk whose reading decided the last one
        self._said_disk: str | None = None  # the last AdaptiveDiskHolds's disk

    @property
    def bounds(self) -> Bounds:
        config = self.held.current.limits.adaptive
        return Bounds(config.start, config.minimum, config.maximum)

    @property
    def interval(self) -> float:
        return self.held.current.limits.adaptive.interval_seconds

    @property
    def global_cap(self) -> int | None:
        """limits.global_concurrent_turns: a hard ceiling over the limit."""
        return self.held.current.limits.global_concurrent_turns

    def reconfigure(self) -> None:
        """A reload swapped the settings held: new bounds, interval and global cap from the
        next pass on; the limit learnt so far is kept, moved into the new bounds.
        Whether it is on, and its rule, need a restart (volutectl/config/reload.py keeps
        them as they were)."""
        self.controller = replace(self.controller, limit=self.bounds.clamp(self.controller.limit))
        self.cpu.reconfigure(self.bounds.minimum, self.bounds.maximum)

    @property
    def psi_path(self) -> Path | None:
        return self.sensor.psi_path

    def use_pressure_file(self, path: Path) -> None:
        """Read PSI from `path` alone (a test's file), from the next interval on."""
        self.sensor.use_pressure_file(path)
        self._psi_mark = None

    @property
    def mode(self) -> AdaptiveMode:
        if not self.enabled:
            return AdaptiveMode.STATIC
        return AdaptiveMode.FALLBACK if self.fallback is not None else AdaptiveMode.ADAPTIVE

    def limit(self) -> int | None:
        """The adaptive cap for admission; None when off."""
        if not self.enabled:
            return None
        if self.fallback is not None:
            return self.bounds.clamp(self.bounds.start)
        return self.controller.limit

    # -- around each admission pass ----------------------------------------------------

    def before_pass(self, now: float, live: Iterable[int] = ()) -> None:
        """Work may arrive at a gate gone idle: start again from `start` before admission
        lets a fan-out in at what the last one's mix bore. A running turn no longer among
        those `live` (by id) that may have been writing when it ended starts writers'
        pause now: a writer's end is what lets the next one start."""
        alive = set(live)
        gone = (turn for turn_id, turn in self.running_turns.items() if turn_id not in alive)
        self._note_writing(now, any(iocost.writes_now(t, self._costs.get(t.mind)) for t in gone))
        if self.enabled and self._deadline is None:
            self.controller, change = adaptive.resume(self.controller, now, self.bounds)
            if change is not None:
                self._changed(change, now)

    def after_pass(self, now: float, running: int, waiting: int, load: float | None = None) -> None:
        """What admission left (`load`: the running turns' IO costs, by default one
        each): measure while anything runs or waits, else sleep."""
        self.running, self.waiting = running, waiting
        bound = self.turns_bound()
        self.at_limit = waiting if bound is None or running < bound else 0
        self.load = float(running) if load is None else load
        if self.probe is not None and self.probe.in_flight:
            self._probe_running = max(self._probe_running, running)
            self._probe_load = max(self._probe_load, self.load)
        self.cpu.note_running(now, running)
        if not self.enabled or not (running or waiting):
            self._deadline = None  # idle: no wakeups
            self._psi_mark = None
            if self.sensor.disks is not None:
                self.sensor.disks.mark_idle()
            self.cpu.idle()
            self._probe_quiet(now)
            return
        self._quiet_probe = False  # work came while it ran: it is this reading's
        if self._deadline is None:
            self._deadline = now + self.interval
            self._psi_mark = self._psi_total(now)
            self._read_disks(now)
            self._failure = self.cpu.mark(now, running) or self._failure
            self._start_probe(now)

    # -- IO costs per mind (volutectl/core/iocost.py) -----------------------------------

    def sampled_written(self, turn_id: int) -> int | None:
        """What a running turn's scope had written at its last sample (a lease's cost,
        whose daemon's processes no wrapper's rusage counts), if it was sampled."""
        turn = self.running_turns.get(turn_id)
        return turn.written if turn is not None and turn.sampled is not None else None

    def learn_cost(self, mind: str, written_bytes: int) -> None:
        """A turn of `mind` ended having written `written_bytes` (its rusage)."""
        if self.enabled:
            self.io_costs = self.io_costs.learn(mind, written_bytes)
            self._costs = self.io_costs.of()

    def costs(self) -> Mapping[str, float]:
        """What a new turn of each known mind costs against the limit until a sample
        judges it (core/iocost.py's `starting_cost`); others cost 1. In fallback none:
        the static cap of `start` counts turns, whatever they write."""
        if self.fallback is not None:
            return {}
        return {mind: iocost.starting_cost(cost) for mind, cost in self._costs.items()}

    def stagger(self) -> bool:
        """Whether writers go one at a time (core/iocost.py's `mixed`): never in
        fallback, where the static cap counts turns."""
        if not self.enabled or self.fallback is not None:
            return False
        return iocost.mixed(self._costs, self.running_turns.values())

    def writers(self, live: Iterable[int], now: float) -> int:
        """Of the turns live now (by id), those that may be writing (core/iocost.py's
        `writes_now`); while writers pause (`WRITER_PAUSE` after a turn was last seen
        maybe writing) at least one: one that ended since the last `track` holds no
        writer back but by that pause."""
        turns = (self.running_turns.get(turn_id) for turn_id in live)
        writing = sum(
            iocost.writes_now(turn, self._costs.get(turn.mind))
            for turn in turns
            if turn is not None
        )
        return max(writing, int(self._pausing(now)))

    def _pausing(self, now: float) -> bool:
        return self._writing_seen is not None and now < self._writing_seen + iocost.WRITER_PAUSE

    def _note_writing(self, now: float, writing: bool) -> None:
        """If a turn was seen writing, or ended while it may have been, writers' pause
        runs from `now`."""
        if self.enabled and writing:
            self._writing_seen = now
            self._pause_due = True

    def pause_over(self, now: float) -> bool:
        """Whether writers' pause has ended since admission last heard of it (True once,
        then admission should decide again: a writer may wait for it)."""
        if self._pause_due and not self._pausing(now):
            self._pause_due = False
            return True
        return False

    def running_costs(self) -> dict[str, float]:
        """What each mind's running turns cost now (their mean), from what they wrote;
        in fallback none, as `costs`."""
        return self.shown_costs() if self.fallback is None else {}

    def shown_costs(self) -> dict[str, float]:
        """What each mind's running turns cost now, whatever the mode (for `status`)."""
        sums: dict[str, list[float]] = {}
        for turn in self.running_turns.values():
            cost = iocost.running_cost(turn, self._costs.get(turn.mind))
            sums.setdefault(turn.mind, []).append(cost)
        return {mind: sum(costs) / len(costs) for mind, costs in sums.items()}

    def turns_bound(self) -> int | None:
        """The most turns the limit lets run at once whatever their costs: its maximum,
        or fewer while the CPUs bear fewer (volutectl/gate/cpu.py); in fallback, the
        maximum (the static cap counts turns)."""
        if self.limit() is None:
            return None
        cpu = self.cpu.bound(self.bounds.minimum, self.bounds.maximum)
        if cpu is None or self.fallback is not None:
            return self.bounds.maximum
        return min(self.bounds.maximum, cpu)

    def load_of(self, running: Iterable[str], starting: Iterable[str] = ()) -> float:
        """The IO cost of the running turns of these minds, and of new turns of those."""
        now, known = self.running_costs(), self.costs()
        return sum(now.get(mind, known.get(mind, iocost.UNKNOWN)) for mind in running) + sum(
            known.get(mind, iocost.UNKNOWN) for mind in starting
        )

    # -- what running turns have written so far ------------------------------------------

    def track(self, now: float, turns: Mapping[int, str]) -> None:
        """The turns that run now (id: mind): new ones are counted from `now`."""
        if not self.enabled:
            return
        known = self.running_turns
        self.running_turns = {
            turn_id: known.get(turn_id) or iocost.Running(mind, now)
            for turn_id, mind in turns.items()
        }
        self._asked &= set(turns)

    def wants_sample(self, now: float) -> list[int]:
        """The running turns to sample now, at a reading or a turn's probation's end
        (none while a failed sample's pause lasts)."""
        if not self.enabled or now < self._sample_after:
            return []
        self._sampled_at = now
        return list(self.running_turns)

    def sample_deadline(self) -> float | None:
        """When a running turn's probation ends that no sample has judged yet: a sample
        then, not at the next reading, lets a quiet turn's place go to the next one at
        once (the ramp of a cold gate's fan-out). While writers go one at a time, a turn
        seen writing is sampled again a probation after its last sample, and writers'
        pause ends (`pause_over`), so that the writer held for it starts soon after it
        stops, not at the next reading."""
        if not self.enabled:
            return None
        due = [
            turn.started + iocost.PROBATION_SECONDS
            for turn_id, turn in self.running_turns.items()
            if turn_id not in self._asked
        ]
        # A turn seen writing first: it is rare, and the loop asks this every wake.
        if any(turn.recent for turn in self.running_turns.values()) and self.stagger():
            due.append(self._sampled_at + iocost.PROBATION_SECONDS)
        deadline = max(min(due), self._sample_after) if due else None
        if self._pause_due and self._writing_seen is not None:
            # Writers' pause ends: the writer held for it may start then (`pause_over`),
            # with a sample or without one (none while a failed sample's pause lasts).
            end = self._writing_seen + iocost.WRITER_PAUSE
            deadline = end if deadline is None else min(deadline, end)
        return deadline

    def _mark_asked(self, now: float) -> None:
        self._asked |= {
            turn_id
            for turn_id, turn in self.running_turns.items()
            if now - turn.started >= iocost.PROBATION_SECONDS
        }

    def observe(self, now: float, written: Mapping[int, Written]) -> bool:
        """A sample: what each running turn has written so far, and whether it waits on
        the disk. True if a running turn's cost changed, or what says writers go one at a
        time did (admission should decide again). A turn this sample could not judge
        (found waiting on the disk) is judged again at the next reading."""
        before = self._admitted_by(now)
        self.sample_failure = None
        self._mark_asked(now)
        for turn_id, seen in written.items():
            turn = self.running_turns.get(turn_id)
            if turn is not None:
                self.running_turns[turn_id] = turn.sample(now, seen.bytes, seen.blocked)
        # A turn not judged yet may write (`writes_now`), but only one seen writing starts
        # the pause: one judged quiet at its first sample has left the disk alone.
        self._note_writing(now, any(map(iocost.seen_writing, self.running_turns.values())))
        return self._admitted_by(now) != before

    def _admitted_by(self, now: float) -> tuple[dict[str, float], bool, int]:
        """What of the running turns admission decides by: their costs, and whether
        writers go one at a time and how many may be writing."""
        return self.shown_costs(), self.stagger(), self.writers(self.running_turns, now)

    def sample_failed(self, now: float, why: str) -> None:
        """A sample could not be taken (an older launcher, or none): running turns keep
        their minds' costs, and the next sample is tried SAMPLE_PAUSE seconds on."""
        self.sample_failure = why
        self._sample_after = now + SAMPLE_PAUSE
        self._mark_asked(now)

    # -- the interval ------------------------------------------------------------------

    def deadline(self) -> float | None:
        return self._deadline

    def log_deadline(self) -> float | None:
        """When a rate-limited entry is due (the limit's or the CPUs')."""
        due = [d for d in (self.log.deadline(), self.cpu_log.deadline()) if d is not None]
        return min(due) if due else None

    def on_log_deadline(self, now: float) -> None:
        for log in (self.log, self.cpu_log):
            deadline = log.deadline()
            if deadline is not None and now >= deadline:
                log.on_deadline(now)

    def on_deadline(self, now: float) -> bool:
        """Take a reading and apply it; True if the limit moved."""
        self.on_probe_done(0)
        latency = self._latency
        if self.probe is not None and self.probe.started_at is not None:
            # Still in flight: at least this slow (it started an interval ago or more).
            latency = max(latency or 0.0, (now - self.probe.started_at) * 1000)
        stalled = self._psi_stalled(now)
        self._read_disks(now)  # each interval, so that the next reading's is its own
        self._latency = None
        self._deadline = now + self.interval if (self.running or self.waiting) else None
        bound = self.turns_bound()
        self._cpu_reading(now)
        moved = False
        probing = self.probe is not None and self.probe.in_flight  # a stalled one, say
        if self._probed or probing or self._failure is not None or self.fallback is not None:
            moved = self.apply(self._reading(now, latency, stalled), self._failure)
        self._failure = None
        self._quiet_readings = 0 if self.at_limit else self._quiet_readings + 1
        if self.at_limit or self._quiet_readings % QUIET_READINGS == 0:
            self._start_probe(now)
        else:
            self._probed = False  # the next reading has no probe of its own
        return moved or self.turns_bound() != bound

    def _reading(self, now: float, latency: float | None, stalled: float | None) -> Reading:
        """The reading to apply: the probe's latency, or the worst disk's when higher (a
        reading not applied leaves `held_by` and `probe_ms` as the last applied set them)."""
        self.probe_ms = latency
        return Reading(
            now=now,
            latency_ms=self._worst_disk(latency),
            stalled=stalled,
            running=self._probe_running,
            waiting=self.at_limit,
            load=self._probe_load,
        )

    def _cpu_reading(self, now: float) -> None:
        """The CPUs' share of the reading: a file that fails is the reading's failure."""
        old = self.cpu.state.limit
        failure, why = self.cpu.read(
            now, self.running, self.waiting, self.bounds.minimum, self.bounds.maximum
        )
        self._failure = self._failure or failure
        if why is None:
            return
        self.reason = why
        last = self.cpu.last
        stalled = last.stalled if last is not None else None
        self.cpu_log.note(
            events.CpuLimitChanged(
                old_limit=old,
                new_limit=self.cpu.state.limit,
                stalled_percent=_round(stalled * 100 if stalled is not None else None),
                cpus_used=_round(last.used if last is not None else None),
                why=why,
            ),
            now,
        )

    def apply(self, reading: Reading, failure: str | None = None) -> bool:
        """Move the limit by one reading (or enter or leave fallback); True if it moved."""
        before = self.limit()
        self.last = reading
        if failure is not None:
            if self.fallback is None:
                self.fallback = failure
                start = self.bounds.clamp(self.bounds.start)
                self.controller = replace(
                    self.controller, limit=start, slow_start=True, distressed_at=None
                )
                self._emit(events.AdaptiveFallback(limit=start, why=failure))
            return self.limit() != before
        if self.fallback is not None:
            self.fallback = None
            self._emit(events.AdaptiveMeasuring(limit=self.controller.limit))
        self.controller, change = adaptive.step(self.controller, reading, self.bounds, self.rule)
        if change is not None:
            self._changed(self._disk_said(change), reading.now)
        return self.limit() != before

    # -- every disk the turns use (volutectl/gate/disks.py) -----------------------------

    def _read_disks(self, now: float) -> None:
        """Take the watched disks' interval; one that cannot be read is a failure."""
        if self.sensor.disks is not None:
            lost = self.sensor.disks.read(now)
            if lost is not None:
                self._failure = lost

    def _worst_disk(self, latency: float | None) -> float | None:
        """The reading's latency: the probe's, or the worst disk's on the probe's scale
        when that is higher (core/disks.py), which then holds the limit (`held_by`)."""
        watch, baseline = self.sensor.disks, self.controller.baseline_ms
        self.held_by = None
        if watch is None or baseline is None:
            return latency
        found = disk_rule.worst(watch.on_probe_scale(baseline))
        if found is None or (latency is not None and found[1] <= latency):
            return latency
        self.held_by = found[0]
        return found[1]

    def _disk_said(self, change: Change) -> Change:
        """A move down that a disk decided names it, and AdaptiveDiskHolds says so when
        the disk that holds the limit down is not the one it last said."""
        watch = self.sensor.disks
        if change.new >= change.old or self.held_by is None or watch is None:
            if change.new < change.old:
                self._said_disk = None
            return change
        device = self.held_by
        if device != self._said_disk:
            self._said_disk = device
            seen = next((disk for disk in watch.shown() if disk.device == device), None)
            self._emit(
                events.AdaptiveDiskHolds(
                    device=device,
                    holds=holdings(watch.devices.get(device, ())),
                    await_ms=_round(seen.await_ms) if seen else None,
                    baseline_ms=_round(seen.baseline_ms) if seen else None,
                    utilisation_percent=_round(seen.utilisation * 100) if seen else None,
                    limit=change.new,
                )
            )
        why = f"{change.reason}; held down by the disk {describe(watch.devices, device)}"
        return replace(change, reason=why)

    def _changed(self, change: Change, now: float) -> None:
        self.reason = change.reason
        reading = self.last
        stalled = reading.stalled if reading is not None else None
        self.log.note(
            events.AdaptiveLimitChanged(
                old_limit=change.old,
                new_limit=change.new,
                probe_ms=_round(self._probe_shown()),
                baseline_ms=_round(self.controller.baseline_ms),
                stalled_percent=_round(stalled * 100 if stalled is not None else None),
                why=change.reason,
            ),
            now,
        )

    # -- the probe and PSI -------------------------------------------------------------

    def _probe_quiet(self, now: float) -> None:
        """A gate that has not measured its disk yet probes it once while nothing runs
        or waits (at its start, as a rule), so that the baseline is the quiet disk's
        and not what the first fan-out's first reading shows (core/adaptive.py's
        learn_quiet). A gate started under load learns from that, as before."""
        if self.probe is None or self._quiet_asked or self.controller.baseline_ms is not None:
            return
        self._quiet_asked = True
        if not self.probe.in_flight:
            self._start_probe(now)
            self._quiet_probe = True

    def measure_quiet_disk(self, now: float, wait: float = QUIET_PROBE_WAIT) -> None:
        """At the gate's start, before it serves (no turn of a previous gate open): the
        quiet disk's baseline, from probes taken one after another for at most `wait`
        seconds, until two in a row agree (QUIET_AGREE); the lowest is the baseline.

        - Before it serves: a fan-out that comes with the start (a wake flush, clients
          queued on the socket) would otherwise overtake the first pass's quiet probe,
          whose result then counts as a loaded reading.
        - Until two agree: a disk still writing back what came before the start (a
          gate restarted after a fan-out) answers the first probe late. A baseline learnt
          from it reads a queue as normal: on the slow-disk test, a first probe of 66-81
          ms where the quiet card's is 1 ms let in 3 writers and more, and the probe's
          p99 went from cap 2's 85 ms to 265 ms. The writeback drains within the wait.
        A probe not done in time is left in flight, as the first pass's would be."""
        if not self.enabled or self.probe is None or self._quiet_asked:
            return
        self._quiet_asked = True
        deadline = time.monotonic() + wait  # a real wait on a real disk, whatever `now`
        last: float | None = None
        while self.controller.baseline_ms is None or last is not None:
            self._start_probe(now)
            self._quiet_probe = True
            left = max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([self.probe.fileno()], [], [], left)
            except (OSError, ValueError):
                return
            if not ready:
                return  # in flight: the first pass reads it as before
            result = self.probe.take()
            self._quiet_probe = False
            if not isinstance(result, float):
                self._failure = (
                    f"the probe of {self.probe.path} failed: {result.strerror}"
                    if isinstance(result, OSError)
                    else None
                )
                return
            self.controller = adaptive.learn_quiet(self.controller, result)
            if last is not None and abs(result - last) <= max(QUIET_AGREE * last, 1.0):
                return
            last = result
            if time.monotonic() >= deadline:
                return

    def _start_probe(self, now: float) -> None:
        self._probed = True
        if self.probe is not None and not self.probe.in_flight:
            self._probe_running, self._probe_load = self.running, self.load
            self.probe.start(now)

    def on_probe_done(self, mask: int) -> None:
        """The worker finished a probe (the reactor saw its pipe), or a reading looks."""
        if self.probe is None:
            return
        result = self.probe.take()
        if isinstance(result, OSError):
            self._failure = f"the probe of {self.probe.path} failed: {result.strerror}"
        elif result is not None and self._quiet_probe:
            self.controller = adaptive.learn_quiet(self.controller, result)
        elif result is not None:
            self._latency = max(self._latency or 0.0, result)
        if result is not None:
            self._quiet_probe = False

    def _psi_total(self, now: float) -> tuple[int, float, Path | None] | None:
        total = self.sensor.psi_total()
        if isinstance(total, str):
            self._failure = total
            return None
        return (total, now, self.sensor.psi_path) if total is not None else None

    def _psi_stalled(self, now: float) -> float | None:
        mark, self._psi_mark = self._psi_mark, self._psi_total(now)
        if mark is None or self._psi_mark is None or mark[2] != self._psi_mark[2]:
            return None  # no file, or the slice's read from here on: no stall measured
        return stall_fraction(mark[0], self._psi_mark[0], now - mark[1])

    # -- what it shows -----------------------------------------------------------------

    def status(self) -> AdaptiveStatus:
        return AdaptiveStatus(
            mode=self.mode,
            limit=self.limit(),
            minimum=self.bounds.minimum,
            maximum=self.bounds.maximum,
            ceiling=self.global_cap,
            reason=self.fallback or self.reason,
            rule=self.rule,
            probe_ms=_round(self._probe_shown()),
            costs=dict(sorted(self._costs.items())),
            running_costs=dict(sorted(self.shown_costs().items())),
            disks=self._disks_shown(),
            held_by=self.held_by,
        )

    def _probe_shown(self) -> float | None:
        """The probe's own latency in the last reading (not a disk's that decided it)."""
        if self.last is None:
            return None
        return self.probe_ms if self.held_by is not None else self.last.latency_ms

    def _disks_shown(self) -> tuple[DiskStatus, ...]:
        if self.sensor.disks is None:
            return ()
        return tuple(
            DiskStatus(
                device=seen.device,
                holds=seen.holds,
                await_ms=_round(seen.await_ms),
                utilisation_percent=round(seen.utilisation * 100, 1),
                baseline_ms=_round(seen.baseline_ms),
            )
            for seen in self.sensor.disks.shown()
        )

    def close(self) -> None:
        self.sensor.close()


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None
