"""The gate's own writes (issue 32, item 4): what a delivery and a turn add to the WAL on
the disk the gate guards, counted in WAL frames of the real store (every commit writes
each page it changes, in full, plus a 24-byte frame header), and the adaptive limit's
probe, which writes while turns run only as often as a reading needs it.

bench/bench_admission.py's section 4 measures the same in bytes and fsyncs; these hold
the figures that docs/benchmarks.md gives, so that a new index or a bigger page shows.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness
from tests.unit.test_gate_adaptive import MINDS, ScriptedProbe, ScriptedSensor, limit_of, running
from tests.unit.test_gate_pause import deliver
from volutectl.core import iocost
from volutectl.gate.adaptive import QUIET_READINGS
from volutectl.states import HoldReason, Outcome, QueueState
from volutectl.store import indexed, schema
from volutectl.store.indexed import IndexedStore
from volutectl.store.queue import NewDelivery, NewTurn

NOW = 1_700_000_000.0
FRAME = schema.PAGE_SIZE + 24


def wal_bytes(store: IndexedStore) -> int:
    return os.path.getsize(f"{store.path}-wal")


def wal_frames(store: IndexedStore, since: int) -> tuple[int, int]:
    """(frames, commits) in the WAL after byte `since`: read from the file itself, each
    frame's header giving the database's size in pages for a commit's last frame and 0
    for the others (sqlite.org/fileformat2.html#walformat)."""
    data = Path(f"{store.path}-wal").read_bytes()
    frames = commits = 0
    for offset in range(max(since, 32), len(data), FRAME):
        _page, size_after = struct.unpack(">II", data[offset : offset + 8])
        frames += 1
        commits += size_after != 0
    return frames, commits


@pytest.fixture
def store(tmp_path: Path) -> IndexedStore:
    store = IndexedStore(tmp_path / "queue.sqlite3")
    # Rows of other minds before, so that the pages measured are not the first ones.
    store.add_deliveries([NewDelivery(f"o{i}", "s", b"x" * 200) for i in range(50)], NOW)
    store.checkpoint()
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    return store


def test_a_new_database_has_small_pages_in_wal_mode(store: IndexedStore) -> None:
    assert schema.page_size(store.db) == schema.PAGE_SIZE == 1024
    assert schema.converted(store.db)
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    indexes = {
        name for (name,) in store.db.execute("SELECT name FROM sqlite_master WHERE type='index'")
    }
    assert "turns_open" not in indexes and "turns_mind_ended" in indexes


def test_a_delivery_and_its_hold_write_at_most_six_small_frames(store: IndexedStore) -> None:
    """The table, deliveries_open, sqlite_sequence, and the pass's hold: 4 pages, and a
    B-tree split now and then (5.4 here). At 4 KiB pages the same was 17 KB of WAL."""
    before = wal_bytes(store)
    for n in range(20):
        [delivery_id] = store.add_deliveries([NewDelivery("m", "s", b"x" * 200)], NOW + n)
        assert isinstance(delivery_id, int)
        store.mark_held([(delivery_id, HoldReason.ADAPTIVE_LIMIT)], NOW + n)
    per_delivery = (wal_bytes(store) - before) / 20
    assert per_delivery <= 6 * FRAME, per_delivery / FRAME


def test_a_turn_writes_at_most_sixteen_small_frames(store: IndexedStore) -> None:
    """Start, release, settlement: about 14 pages (the turn's and its row's pages and
    their indexes, turns_open gone). At 4 KiB pages and with turns_open, 66 KB."""
    ids = store.add_deliveries([NewDelivery("m", f"s{n}", b"x" * 200) for n in range(20)], NOW)
    before = wal_bytes(store)
    for delivery_id in ids:
        assert isinstance(delivery_id, int)
        turn_id, rows = store.start_turn("m", "s", lambda t: f"u{t}", [delivery_id], NOW)
        store.mark_released(turn_id, 123)
        store.settle_turn(
            turn_id, outcome=Outcome.OK, exit_status=0, detail="", done=[delivery_id],
            returned=[], failed={}, error="", now=NOW + 1,
        )  # fmt: skip
    per_turn = (wal_bytes(store) - before) / 20
    assert per_turn <= 16 * FRAME, per_turn / FRAME


def test_the_turns_a_pass_starts_share_one_commit(store: IndexedStore) -> None:
    """Eight turns started by one pass: one commit (one fsync on the disk the gate guards,
    not eight), and fewer frames than eight lone starts, whose commits each write the
    pages they share again. Each turn is as a lone start leaves it."""
    added = store.add_deliveries([NewDelivery("m", f"s{n}", b"x" * 200) for n in range(16)], NOW)
    ids = [delivery_id for delivery_id in added if isinstance(delivery_id, int)]
    assert len(ids) == 16
    before = wal_bytes(store)
    together = store.start_turns(
        [
            NewTurn(mind="m", session=f"s{n}", delivery_ids=[ids[n]], unit_for=lambda t: f"u{t}")
            for n in range(8)
        ],
        NOW,
    )
    grouped, commits = wal_frames(store, before)
    assert commits == 1
    assert [[row.id for row in rows] for _, rows in together] == [[i] for i in ids[:8]]
    for turn_id, _ in together:
        turn = store.turn(turn_id)
        assert turn is not None and turn.unit == f"u{turn_id}" and not turn.released
    assert {row.state for row in store.rows(ids[:8])} == {QueueState.RUNNING}
    before = wal_bytes(store)
    for n in range(8, 16):
        store.start_turn("m", f"s{n}", lambda t: f"u{t}", [ids[n]], NOW)
    lone, commits = wal_frames(store, before)
    assert commits == 8 and grouped < lone / 2, (grouped, lone)


# -- the probe --------------------------------------------------------------------------


def calm_harness(tmp_path: Path, minds: dict[str, str], config: dict[str, Any]) -> Harness:
    """A gate on a fake clock whose disk always reads healthy (each probe 1 ms, no
    stall): the probe's cadence is the gate's rule, and the host's own disk and load (a
    real probe, the host's PSI) would move the limit under it, so that the turns a test
    waits for never start."""
    sensor = ScriptedSensor()
    sensor.probe = ScriptedProbe(tmp_path / "probe", [1.0] * 1000)  # type: ignore[assignment]
    limits = {"adaptive": config}
    return Harness(tmp_path, minds=minds, limits=limits, clock=FakeClock(), sensor=sensor)


def counted_probes(harness: Harness) -> list[float]:
    """When each of the adaptive limit's probes starts, from now on."""
    probe = limit_of(harness).probe
    assert probe is not None
    starts: list[float] = []
    real_start = probe.start

    def counted(now: float) -> None:
        starts.append(now)
        real_start(now)

    probe.start = counted  # type: ignore[method-assign]
    return starts


def probes_per_reading(harness: Harness, starts: list[float], count: int) -> list[int]:
    probe = limit_of(harness).probe
    assert probe is not None
    readings = []
    for _ in range(count):
        harness.pump(lambda: not probe.in_flight)
        before = len(starts)
        harness.advance(1.0)
        readings.append(len(starts) - before)
    return readings


def test_while_turns_only_run_the_probe_comes_every_few_readings_and_a_wait_brings_it_back(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    config = {"start": 4, "minimum": 1, "maximum": 8, "interval_seconds": 1.0}
    minds = {f"m{i}": "exec sleep 30" for i in range(8)}
    harness = calm_harness(tmp_path, minds, config)
    harnesses.append(harness)
    adaptive = limit_of(harness)
    starts = counted_probes(harness)
    for mind in minds:  # known heavy writers: a whole place each, growth by one
        adaptive.learn_cost(mind, 64 * iocost.FULL_BYTES)
    for mind in ["m0", "m1"]:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 2)
    readings = probes_per_reading(harness, starts, 2 * QUIET_READINGS)  # nothing waits
    # One probe per QUIET_READINGS readings, not one per reading; readings go on.
    assert sum(readings) == 2 and adaptive.deadline() is not None, readings
    for mind in ["m2", "m3", "m4", "m5", "m6", "m7"]:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) >= 4 and adaptive.at_limit >= 1)
    # They wait at the limit of 4, under the maximum of 8, and a growth would let them
    # in: a probe every reading.
    readings = probes_per_reading(harness, starts, 3)
    assert readings[-2:] == [1, 1] and running(harness) < 8 and adaptive.at_limit, readings


def test_deliveries_that_wait_at_the_maximum_have_the_probe_every_few_readings(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    """The limit's maximum (or the CPUs' bound) holds them, not the limit: no growth
    would let them in, and they wait for a turn to end. The probe keeps the cadence of
    turns that only run."""
    config = {"start": 4, "minimum": 1, "maximum": 4, "interval_seconds": 1.0}
    harness = calm_harness(tmp_path, MINDS, config)
    harnesses.append(harness)
    adaptive = limit_of(harness)
    starts = counted_probes(harness)
    for mind in ["m0", "m1", "m2", "m3", "m4"]:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 4 and adaptive.waiting == 1)
    assert adaptive.at_limit == 0 and adaptive.turns_bound() == 4
    readings = probes_per_reading(harness, starts, 2 * QUIET_READINGS)
    assert sum(readings) == 2, readings


def test_the_wal_is_checkpointed_after_a_quiet_second_only_once_it_holds_many_commits(
    store: IndexedStore,
) -> None:
    """A checkpoint per turn (each quiet second of a fan-out) wrote each hot page again:
    once the WAL holds CHECKPOINT_MIN_COMMITS, a quiet second; before, a quiet while."""
    clock = store.clock.monotonic
    for n in range(indexed.CHECKPOINT_MIN_COMMITS - 1):
        store.add_deliveries([NewDelivery("m", f"s{n}", b"x" * 200)], NOW)
    deadline = store.checkpoint_deadline()
    assert deadline is not None
    assert deadline - clock() == pytest.approx(indexed.CHECKPOINT_IDLE_SECONDS, abs=0.5)
    store.add_deliveries([NewDelivery("m", "last", b"x" * 200)], NOW)
    deadline = store.checkpoint_deadline()
    assert deadline is not None
    assert deadline - clock() == pytest.approx(indexed.CHECKPOINT_QUIET_SECONDS, abs=0.5)
