"""volutectl/core/disks.py: a block device's counters, one interval's await and
utilisation as iostat computes them, and the worst disk on the probe's scale."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from volutectl.core import disks
from volutectl.core.adaptive import Controller, Reading, Verdict, healthy_below_ms, judge_latency
from volutectl.core.disks import DiskStat

# /sys/block/DEV/stat as kernels write them: 11 fields (before 4.18), 15 (discards), 17
# (flushes). reads, merged, sectors, ticks; writes, merged, sectors, ticks; in flight,
# io_ticks, time in queue; discards, merged, sectors, ticks; flushes, ticks.
OLD = "  100 0 800 50   200 0 1600 450   3 1000 1500\n"
NEW = "100 0 800 50 200 0 1600 450 3 1000 1500 10 0 80 100 7 20\n"


def test_the_counters_of_each_kernels_stat_are_read_as_iostat_counts_them() -> None:
    assert disks.parse_stat(OLD) == DiskStat(
        ios=300, ticks_ms=500, in_flight=3, io_ticks_ms=1000, queue_ms=1500
    )
    # Discards count as requests (iostat's await); flushes do not.
    assert disks.parse_stat(NEW) == DiskStat(
        ios=310, ticks_ms=600, in_flight=3, io_ticks_ms=1000, queue_ms=1500
    )


@pytest.mark.parametrize("text", ["", "1 2 3", "a b c d e f g h i j k"])
def test_what_is_not_a_stat_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        disks.parse_stat(text)


def test_an_interval_has_iostats_await_utilisation_and_queue() -> None:
    before = DiskStat(ios=100, ticks_ms=1000, in_flight=0, io_ticks_ms=5000, queue_ms=7000)
    after = DiskStat(ios=150, ticks_ms=5000, in_flight=4, io_ticks_ms=5400, queue_ms=9000)
    seen = disks.interval(before, after, 0.5)
    # 4000 ms over 50 requests; busy 400 of 500 ms; 2000 ms of queue over 500 ms.
    assert seen == disks.DiskInterval(await_ms=80.0, utilisation=0.8, queue=4.0, ios=50)


def test_a_device_busy_all_interval_that_completed_nothing_is_at_least_that_slow() -> None:
    before = DiskStat(ios=100, ticks_ms=1000, in_flight=2, io_ticks_ms=5000, queue_ms=7000)
    stalled = DiskStat(ios=100, ticks_ms=1000, in_flight=2, io_ticks_ms=5500, queue_ms=8000)
    assert disks.interval(before, stalled, 0.5).await_ms == pytest.approx(500.0)
    idle = DiskStat(ios=100, ticks_ms=1000, in_flight=0, io_ticks_ms=5000, queue_ms=7000)
    assert disks.interval(before, idle, 0.5).await_ms is None  # nothing asked, nothing said


def test_counters_that_went_back_count_as_nothing_done() -> None:
    """A device replaced under its name starts its counters again."""
    before = DiskStat(ios=100, ticks_ms=1000, in_flight=0, io_ticks_ms=5000, queue_ms=7000)
    after = DiskStat(ios=3, ticks_ms=9, in_flight=0, io_ticks_ms=10, queue_ms=9)
    assert disks.interval(before, after, 0.5) == disks.DiskInterval(None, 0.0, 0.0, 0)


def test_the_baseline_is_the_lowest_await_first_guessed_from_the_devices_life() -> None:
    first = disks.lifetime_await(
        DiskStat(ios=200, ticks_ms=600, in_flight=0, io_ticks_ms=0, queue_ms=0)
    )
    assert first == 3.0
    busy = disks.DiskInterval(await_ms=40.0, utilisation=1.0, queue=5.0, ios=10)
    assert disks.learn(first, busy) == 3.0  # a queue is not learnt as quiet
    quiet = disks.DiskInterval(await_ms=1.5, utilisation=0.1, queue=0.1, ios=10)
    assert disks.learn(first, quiet) == 1.5
    assert disks.learn(None, disks.DiskInterval(None, 0.0, 0.0, 0)) is None
    assert disks.lifetime_await(DiskStat(0, 0, 0, 0, 0)) is None


millis = st.floats(min_value=0.1, max_value=5000, allow_nan=False)


@given(baseline=millis, probe=millis)
def test_a_disk_at_its_baseline_or_its_healthy_bound_reads_as_the_probe_at_its_own(
    baseline: float, probe: float
) -> None:
    assert disks.as_probe_ms(baseline, baseline, probe) == pytest.approx(probe)
    # A synced write there waits for SYNCED_WRITE_REQUESTS requests in turn.
    requests = disks.SYNCED_WRITE_REQUESTS
    bound = healthy_below_ms(requests * baseline) / requests
    assert disks.as_probe_ms(bound, baseline, probe) == pytest.approx(healthy_below_ms(probe))


@given(low=millis, high=millis, baseline=millis, probe=millis)
def test_a_slower_disk_never_reads_as_quicker(
    low: float, high: float, baseline: float, probe: float
) -> None:
    low, high = sorted((low, high))
    assert disks.as_probe_ms(low, baseline, probe) <= disks.as_probe_ms(high, baseline, probe)
    assert disks.as_probe_ms(low, baseline, probe) >= probe


@given(await_ms=millis, baseline=millis, probe=millis, running=st.integers(1, 16))
def test_the_rule_judges_a_disk_on_the_probes_scale_as_on_its_own(
    await_ms: float, baseline: float, probe: float, running: int
) -> None:
    """Healthy, or over healthy, is the same verdict whether the rule reads the disk's
    await against its own baseline or its reading on the probe's scale against the
    probe's: the scale moves no disk across the healthy bound."""

    def verdict(latency: float, learnt: float) -> Verdict:
        state = Controller(limit=running, baseline_ms=learnt)
        reading = Reading(now=0.0, latency_ms=latency, stalled=None, running=running, waiting=1)
        return judge_latency(state, reading)[0]

    requests = disks.SYNCED_WRITE_REQUESTS  # a synced write's wait there: its own scale
    own = verdict(requests * await_ms, requests * baseline)
    scaled = verdict(disks.as_probe_ms(await_ms, baseline, probe), probe)
    margin = healthy_below_ms(requests * baseline) - requests * baseline
    excess = requests * (await_ms - baseline)
    near = min(abs(excess * (running + 1) / running - margin), abs(excess - margin))
    if near > 1e-6 * margin:  # not a float's rounding at the very bound
        assert (own is Verdict.HEALTHY) == (scaled is Verdict.HEALTHY)
        assert (own in (Verdict.HEALTHY, Verdict.NEUTRAL)) == (
            scaled in (Verdict.HEALTHY, Verdict.NEUTRAL)
        )


@given(st.dictionaries(st.sampled_from(["sda", "sdb", "mmcblk0", "loop3", "dm-0"]), millis))
def test_the_worst_disk_is_the_highest_reading_whatever_the_order(
    readings: dict[str, float],
) -> None:
    found = disks.worst(readings)
    if not readings:
        assert found is None
        return
    assert found is not None
    name, value = found
    assert value == max(readings.values()) and readings[name] == value
    assert disks.worst(dict(reversed(list(readings.items())))) == found
