"""The pure part of watching every disk the turns use: a block device's counters
(/sys/block/DEV/stat) read twice make one interval's await and utilisation, as iostat
computes them; each device's await is judged against its own quiet await, put on the
probe's scale, and the worst device decides.

- `parse_stat`: the counters of one stat file (the kernel's Documentation/block/stat.rst:
  11 fields, 15 since 4.18 with discards, 17 since 5.5 with flushes).
- `interval`: two readings and the seconds between them. await is the time the
  requests completed in the interval spent queued and served, per request (reads,
  writes and discards, as iostat's `await`); utilisation the share of the interval the
  device had a request in flight (`io_ticks`, iostat's %util); the queue its mean depth
  (weighted time, iostat's aqu-sz). An interval with requests in flight for all of it
  and none completed is a stalled device: its await is at least the interval, as a
  probe still in flight is read (volutectl/gate/adaptive.py).
- `learn`: a device's baseline is the lowest await it showed, as the probe's is
  (core/adaptive.py's learn_baseline): a queue is never learnt as normal. Its first
  guess is its mean await since it appeared (`lifetime_await`), since an interval can
  only be read while turns run.
- `as_probe_ms`: a device's await on the probe's scale, so that core/adaptive.py's rule
  judges it as it judges the probe (whatever the rule's tolerance is): what a synced
  write waits there is SYNCED_WRITE_REQUESTS requests' await (its data, then the
  journal's commit); a device at its baseline reads as the probe's baseline, and one
  whose synced write is at its healthy bound reads as the probe's healthy bound; in
  between and beyond, in proportion.
- `worst`: the device whose reading is highest on that scale, by name (the first by
  name of equals, so that the answer does not depend on the order of a dict).

No I/O and no clock: volutectl/kernel/blockdevs.py reads the files and
volutectl/gate/disks.py keeps the readings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from volutectl.core.adaptive import healthy_below_ms

# A small synced write waits behind the queue more than once: for its data, then for the
# journal's commit (ext4's fdatasync of a write that allocates), each a request in turn.
# Measured on the testbed's SD card (docs/disks.md): 6 synced writers, await 85 ms and
# a 4 KiB write + fsync 190 ms; so a disk's await counts twice on the probe's scale.
SYNCED_WRITE_REQUESTS = 2
STALLED_UTILISATION = 0.95  # in flight for this share of an interval, none completed: stalled
BASELINE_FLOOR_MS = 0.1  # an await below this is the counters' resolution (ms), not a disk


@dataclass(frozen=True)
class DiskStat:
    """One reading of a device's cumulative counters."""

    ios: int  # requests completed: reads, writes, discards
    ticks_ms: int  # the time those requests took, queued and served, summed
    in_flight: int  # requests in flight now
    io_ticks_ms: int  # the time the device had a request in flight
    queue_ms: int  # weighted time: the in-flight requests' time, summed


@dataclass(frozen=True)
class DiskInterval:
    """What one device did between two readings."""

    await_ms: float | None  # per completed request; None: none completed, none stalled
    utilisation: float  # 0..1
    queue: float  # mean requests in flight
    ios: int


def parse_stat(text: str) -> DiskStat:
    """The counters of a /sys/block/DEV/stat file; ValueError if it is not one."""
    fields = text.split()
    if len(fields) < 11:
        raise ValueError(f"not a block device's stat ({len(fields)} fields): {text[:80]!r}")
    numbers = [int(field) for field in fields]
    ios = numbers[0] + numbers[4]
    ticks = numbers[3] + numbers[7]
    if len(numbers) >= 15:  # discards, since 4.18
        ios += numbers[11]
        ticks += numbers[14]
    return DiskStat(
        ios=ios, ticks_ms=ticks, in_flight=numbers[8], io_ticks_ms=numbers[9], queue_ms=numbers[10]
    )


def interval(before: DiskStat, after: DiskStat, elapsed_s: float) -> DiskInterval:
    """One interval's await, utilisation and queue, as iostat has them. Counters that
    went back (the device was replaced under its name) count as nothing done."""
    elapsed_ms = max(elapsed_s * 1000, 1e-3)
    ios = max(0, after.ios - before.ios)
    ticks = max(0, after.ticks_ms - before.ticks_ms)
    busy = min(1.0, max(0, after.io_ticks_ms - before.io_ticks_ms) / elapsed_ms)
    queue = max(0, after.queue_ms - before.queue_ms) / elapsed_ms
    await_ms: float | None = ticks / ios if ios else None
    if not ios and after.in_flight and busy >= STALLED_UTILISATION:
        await_ms = elapsed_ms  # nothing came back all interval: at least this slow
    return DiskInterval(await_ms=await_ms, utilisation=busy, queue=queue, ios=ios)


def learn(baseline_ms: float | None, seen: DiskInterval) -> float | None:
    """A device's baseline: the lowest await it showed (never below the counters'
    resolution)."""
    if seen.await_ms is None:
        return baseline_ms
    low = max(BASELINE_FLOOR_MS, seen.await_ms)
    return low if baseline_ms is None else min(baseline_ms, low)


def lifetime_await(stat: DiskStat) -> float | None:
    """A device's mean await since it appeared: the first guess at its quiet await,
    before an interval shows a lower one (a reading taken under the fan-out that woke
    the gate would otherwise learn a queue as quiet)."""
    return max(BASELINE_FLOOR_MS, stat.ticks_ms / stat.ios) if stat.ios else None


def as_probe_ms(await_ms: float, baseline_ms: float, probe_baseline_ms: float) -> float:
    """A device's await on the probe's scale: what a synced write waits there
    (SYNCED_WRITE_REQUESTS requests' await), its excess over the same at the device's
    baseline, as a share of that baseline's healthy margin, times the probe's healthy
    margin, over the probe's baseline. Never below the probe's baseline (a device
    quicker than it ever was is as healthy as a quiet probe)."""
    synced, quiet = SYNCED_WRITE_REQUESTS * await_ms, SYNCED_WRITE_REQUESTS * baseline_ms
    own_margin = healthy_below_ms(quiet) - quiet
    probe_margin = healthy_below_ms(probe_baseline_ms) - probe_baseline_ms
    excess = max(0.0, synced - quiet) / own_margin
    return probe_baseline_ms + excess * probe_margin


def worst(on_probe_scale: Mapping[str, float]) -> tuple[str, float] | None:
    """The device with the highest reading on the probe's scale (the first by name of
    equals), or None with none."""
    if not on_probe_scale:
        return None
    name = min(on_probe_scale, key=lambda device: (-on_probe_scale[device], device))
    return name, on_probe_scale[name]
