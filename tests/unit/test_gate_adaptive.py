"""The adaptive limit in the real gate, in-process (tests/unit/gate_harness.py, with
tests/unit/fake_systemd.py for systemd): admission holds at the limit with its own
reason, the limit moves with the readings fed to it, status and STATUS= show it, each
move is one rate-limited event, a PSI file that turns to garbage falls back to the start
value, a restarted gate starts at the start value, and an idle gate does not wake for it.

Readings are fed with `AdaptiveLimit.apply` where a test wants the limit to move (the
rule itself is tests/unit/test_adaptive.py's); the real probe and PSI run where a test
is about measuring (fallback, idling). The gate's clock is tests/unit/fake_clock.py's:
its own readings come only when the test moves the clock to them (`read_until`), so a
fed reading is never joined by one of the gate's at random.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness
from tests.unit.test_gate_pause import deliver, notified, request, statuses
from volutectl import events
from volutectl.core.adaptive import GROW_AFTER, UNSEEN, Controller, Reading
from volutectl.core.iocost import FLOOR, PROBATION_SECONDS, STARTING, WRITER_PAUSE
from volutectl.core.psi import parse_total
from volutectl.errors import VoluteError
from volutectl.gate import adaptive as gate_adaptive
from volutectl.gate.adaptive import EVENT_SECONDS, AdaptiveLimit, StorageSensor
from volutectl.gate.disks import DiskWatch
from volutectl.host import doctor
from volutectl.kernel.written import Written
from volutectl.states import AdaptiveMode, HoldReason

__all__ = ["notified"]  # the fixture, used by name

# The real probe times this host's disk and reads its PSI: alone, as ./run-tests runs it.
pytestmark = pytest.mark.serial

MINDS = {f"m{i}": "exec sleep 30" for i in range(5)}
PSI = (
    "some avg10=0.00 avg60=0.00 avg300=0.00 total={}\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)


def adaptive_harness(tmp_path: Path, harnesses: list[Harness], **limits: Any) -> Harness:
    config = {"start": 2, "minimum": 1, "maximum": 4, "interval_seconds": 10.0}
    config |= limits.pop("adaptive", {})
    harness = Harness(
        tmp_path, minds=MINDS, limits={"adaptive": config, **limits}, clock=FakeClock()
    )
    harnesses.append(harness)
    writing(harness)
    return harness


def writing(harness: Harness) -> None:
    """Every sample shows every turn writing (1 MiB more each time), so that each stays
    a whole place: the tests that use it move the limit with fed readings, and their
    `sleep` turns, sampled quiet at the end of their probation, would cost a sixteenth
    and let the held ones by whenever a pump outlasts 0.25 s (on a loaded machine,
    now and then: a flaky test). What samples do is test_a_cold_gate_...'s."""
    written: dict[int, int] = {}

    def sample(turn_ids: Sequence[int]) -> dict[int, Written]:
        for turn_id in turn_ids:
            written[turn_id] = written.get(turn_id, 0) + (1 << 20)
        return {turn_id: Written(written[turn_id], blocked=False) for turn_id in turn_ids}

    harness.gate.state.turns.hands.sample = sample  # type: ignore[method-assign]


def limit_of(harness: Harness) -> AdaptiveLimit:
    adaptive = harness.gate.state.adaptive
    assert adaptive is not None
    return adaptive


def mode_of(adaptive: AdaptiveLimit) -> AdaptiveMode:
    return adaptive.mode


def running(harness: Harness) -> int:
    return len(harness.gate.state.turns.all())


def holds(harness: Harness) -> dict[str, int]:
    return {str(k): v for k, v in harness.gate.state.store.index.counts.items()}


def feed(harness: Harness, latency_ms: float) -> None:
    """One reading, as if the interval had ended: the probe took `latency_ms`."""
    adaptive = limit_of(harness)
    reading = Reading(
        now=harness.clock.monotonic(),
        latency_ms=latency_ms,
        stalled=None,
        running=running(harness),
        waiting=adaptive.waiting,
    )
    if adaptive.apply(reading):
        harness.gate.mark_dirty()


def fan_out(harness: Harness) -> list[int]:
    """Five deliveries, two started, three held at the limit; and the healthy readings
    in a row that move nothing (the fan-out's first, which counts for nothing, and
    GROW_AFTER - 1), so that the next healthy one grows it."""
    ids = [deliver(harness, mind) for mind in MINDS]
    harness.pump(lambda: running(harness) == 2 and sum(holds(harness).values()) == 3)
    # The clock stood still: the gate took no reading of its own, so what follows counts
    # the fed readings alone.
    adaptive = limit_of(harness)
    assert adaptive.limit() == 2 and adaptive.last is None
    assert adaptive.controller.healthy == UNSEEN
    for _ in range(GROW_AFTER):
        feed(harness, 1.0)
    assert limit_of(harness).limit() == 2
    return ids


def read_until(harness: Harness, until: Callable[[], bool], most: int = 50) -> None:
    """The gate's own readings, one interval of the clock at a time, until `until()`:
    each waits for the real probe in flight to answer (a real disk), then the clock
    moves to the reading's deadline."""
    adaptive = limit_of(harness)
    for _ in range(most):
        if until():
            return
        harness.pump(lambda: adaptive.probe is None or not adaptive.probe.in_flight)
        due = adaptive.deadline()
        harness.advance(adaptive.interval if due is None else due - harness.clock.monotonic())
    raise AssertionError(f"not after {most} readings: {until}")


def readings(harness: Harness, count: int, cpu: bool = False) -> None:
    """`count` of the gate's own readings (read_until's): of the storage, those the
    limit applied (with a probe); with `cpu`, of the CPUs, one every interval."""
    taken = [0]
    adaptive = limit_of(harness)

    def latest() -> object:
        return adaptive.cpu.last if cpu else adaptive.last

    last = [latest()]

    def counted() -> bool:
        if latest() is not last[0]:
            taken[0], last[0] = taken[0] + 1, latest()
        return taken[0] >= count

    read_until(harness, counted)


def test_the_limit_holds_a_fan_out_with_its_own_reason_and_moves_with_readings(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = adaptive_harness(tmp_path, harnesses)
    fan_out(harness)
    assert holds(harness) == {HoldReason.ADAPTIVE_LIMIT: 3}
    assert limit_of(harness).waiting == 3
    feed(harness, 1.0)  # healthy, deliveries wait: up by one (writers: whole places)
    harness.pump(lambda: running(harness) == 3)
    assert holds(harness) == {HoldReason.ADAPTIVE_LIMIT: 2}
    feed(harness, 1.0)  # its probe began as the new turn did: no growth on it...
    feed(harness, 1.0)  # ...but on the next: to its maximum
    harness.pump(lambda: running(harness) == 4)
    assert holds(harness) == {HoldReason.ADAPTIVE_LIMIT: 1}
    feed(harness, 1.0)  # at the maximum: no further
    harness.advance(0)
    assert running(harness) == 4 and limit_of(harness).limit() == 4
    feed(harness, 500.0)  # far over healthy: down by one...
    feed(harness, 500.0)  # ...and by a third when it lasts; running turns go on
    assert limit_of(harness).limit() == 2
    harness.advance(0)
    assert running(harness) == 4 and holds(harness) == {HoldReason.ADAPTIVE_LIMIT: 1}


def test_each_move_is_one_event_and_moves_within_a_few_seconds_are_said_together(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = adaptive_harness(tmp_path, harnesses, adaptive={"maximum": 8})
    fan_out(harness)
    feed(harness, 1.0)  # 2 -> 3 (writers: whole places grow by one)
    harness.pump(lambda: running(harness) == 3)
    feed(harness, 1.0)  # its probe began as the new turn did: no growth on it...
    feed(harness, 1.0)  # ...but on the next: 3 -> 4, kept for the next entry
    [first] = harness.journal.of(events.AdaptiveLimitChanged)
    assert (first.old_limit, first.new_limit, first.changes) == (2, 3, 1)
    assert first.probe_ms == 1.0 and first.baseline_ms == 1.0
    assert first.message_id() is not None
    log = limit_of(harness).log
    due = log.deadline()
    assert due is not None and due == pytest.approx(harness.clock.monotonic() + EVENT_SECONDS)
    log.on_deadline(due)
    second = harness.journal.of(events.AdaptiveLimitChanged)[1]
    assert (second.old_limit, second.new_limit, second.changes) == (3, 4, 1)
    feed(harness, 500.0)  # within 5 s of the last entry: kept...
    feed(harness, 500.0)
    assert len(harness.journal.of(events.AdaptiveLimitChanged)) == 2
    log.on_deadline(due + EVENT_SECONDS)  # ...and said as one
    third = harness.journal.of(events.AdaptiveLimitChanged)[2]
    assert (third.old_limit, third.new_limit, third.changes) == (4, 2, 2)  # 3, then 3 x 0.7
    assert third.probe_ms == 500.0
    assert log.deadline() is None


def test_the_static_ceiling_holds_with_its_own_reason_under_the_limit(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = adaptive_harness(tmp_path, harnesses, global_concurrent_turns=1)
    for mind in MINDS:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 1 and sum(holds(harness).values()) == 4)
    assert holds(harness) == {HoldReason.GLOBAL_CAP: 4}
    assert limit_of(harness).waiting == 0  # none waits at the adaptive limit: no growth
    feed(harness, 1.0)
    assert limit_of(harness).limit() == 2


def test_status_and_the_status_line_show_the_mode_and_the_limit(
    tmp_path: Path, harnesses: list[Harness], notified: socket.socket
) -> None:
    harness = adaptive_harness(tmp_path, harnesses, global_concurrent_turns=8)
    fan_out(harness)
    harness.advance(0)
    line = "2/2 turns (adaptive limit, ceiling 8), 3 held (adaptive_limit), "
    assert statuses(notified)[-1].startswith(line)
    feed(harness, 1.0)
    harness.pump(lambda: running(harness) == 3)
    reply = request(harness, op="status")["status"]
    assert reply["holds"] == {"adaptive_limit": 2}
    adaptive = reply["adaptive"]
    assert {k: adaptive[k] for k in ("mode", "limit", "minimum", "maximum", "ceiling")} == {
        "mode": "adaptive",
        "limit": 3,
        "minimum": 1,
        "maximum": 4,
        "ceiling": 8,
    }
    assert "healthy" in adaptive["reason"] and adaptive["rule"] == "gradient"
    assert statuses(notified)[-1].startswith("3/3 turns (adaptive limit, ceiling 8)")


def test_off_it_is_static_and_only_the_ceiling_holds(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = adaptive_harness(tmp_path, harnesses, adaptive={"enabled": False})
    for mind in MINDS:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 5)
    adaptive = request(harness, op="status")["status"]["adaptive"]
    assert (adaptive["mode"], adaptive["limit"]) == ("static", None)
    assert limit_of(harness).deadline() is None  # nothing measured


def test_a_psi_file_that_turns_to_garbage_falls_back_to_the_start_value(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = adaptive_harness(tmp_path, harnesses, adaptive={"interval_seconds": 0.1})
    psi = tmp_path / "io.pressure"
    psi.write_text(PSI.format(1000))
    adaptive = limit_of(harness)
    adaptive.use_pressure_file(psi)
    fan_out(harness)
    readings(harness, 2)  # readings go on: PSI reads, the probe answers
    assert mode_of(adaptive) is AdaptiveMode.ADAPTIVE and adaptive.last is not None
    adaptive.controller = Controller(limit=3)  # as if it had grown
    psi.write_text("some garbage\n")
    read_until(harness, lambda: mode_of(adaptive) is AdaptiveMode.FALLBACK)
    [fallback] = harness.journal.of(events.AdaptiveFallback)
    assert fallback.limit == 2 and str(psi) in fallback.why
    status = request(harness, op="status")["status"]["adaptive"]
    assert (status["mode"], status["limit"]) == ("fallback", 2)
    assert str(psi) in status["reason"]
    psi.unlink()  # gone altogether: still fallback, said once
    readings(harness, 2)
    assert mode_of(adaptive) is AdaptiveMode.FALLBACK
    assert len(harness.journal.of(events.AdaptiveFallback)) == 1
    psi.write_text(PSI.format(2000))  # back: it measures again, from the start value
    read_until(harness, lambda: mode_of(adaptive) is AdaptiveMode.ADAPTIVE)
    [again] = harness.journal.of(events.AdaptiveMeasuring)
    assert again.limit == 2


def test_a_restarted_gate_starts_at_the_start_value_not_where_it_was(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = adaptive_harness(tmp_path, harnesses)
    fan_out(harness)
    feed(harness, 1.0)  # 2 -> 3
    harness.pump(lambda: running(harness) == 3)
    feed(harness, 1.0)
    feed(harness, 1.0)  # 3 -> 4
    harness.pump(lambda: running(harness) == 4)
    harness.crash()
    harness.restart()
    writing(harness)  # the new gate's hands
    assert limit_of(harness).limit() == 2
    harness.pump(lambda: len(harness.gate.state.turns.all()) == 4)  # adopted, not stopped
    harness.advance(0)
    # Four run (adopted), over the limit: none of them is stopped, and the fifth waits.
    assert holds(harness) == {HoldReason.ADAPTIVE_LIMIT: 1}
    status = request(harness, op="status")["status"]["adaptive"]
    assert status["limit"] == 2


def test_an_idle_gate_does_not_wake_for_the_limit(tmp_path: Path, harnesses: list[Harness]) -> None:
    harness = adaptive_harness(tmp_path, harnesses, adaptive={"interval_seconds": 0.1})
    adaptive = limit_of(harness)
    assert adaptive.deadline() is None
    harness = Harness(
        tmp_path / "short",
        minds={"quick": "true"},
        limits={"adaptive": {"interval_seconds": 0.1}},
    )
    harnesses.append(harness)
    adaptive = limit_of(harness)
    deliver(harness, "quick")
    assert adaptive.deadline() is not None  # a turn runs: it measures
    harness.pump(lambda: not harness.gate.state.turns.all())
    harness.pump(lambda: adaptive.deadline() is None)
    assert adaptive.probe is not None and adaptive.probe.path.exists()


def test_a_gate_probes_its_quiet_disk_once_before_any_turn(
    tmp_path: Path, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = Harness(
        tmp_path, minds={"brief": "exec sleep 0.5"}, limits={"adaptive": {"interval_seconds": 0.1}}
    )
    harnesses.append(harness)
    adaptive = limit_of(harness)
    harness.pump(lambda: adaptive.controller.baseline_ms is not None)
    # The baseline is the quiet disk's; it was no reading: the limit did not move, the
    # gate keeps no deadline, and nothing says it measured under load.
    assert adaptive.last is None and adaptive.deadline() is None
    assert adaptive.limit() == 2 and adaptive.controller.last_reading is None
    assert adaptive.probe is not None and adaptive.probe.path.exists()
    assert not adaptive.probe.in_flight
    # Once: going idle again takes no second quiet probe.
    baseline = adaptive.controller.baseline_ms
    deliver(harness, "brief")
    harness.pump(lambda: adaptive.last is not None and not harness.gate.state.turns.all())
    harness.pump(lambda: adaptive.deadline() is None)
    harness.run_for(0.2)  # the last reading's probe ends
    probe = adaptive.probe
    started: list[float] = []
    real_start = probe.start

    def counted(now: float) -> None:
        started.append(now)
        real_start(now)

    monkeypatch.setattr(probe, "start", counted)
    harness.gate.mark_dirty()  # an admission pass while idle
    harness.run_for(0.3)
    assert started == [] and not probe.in_flight
    assert adaptive.controller.baseline_ms is not None
    last = adaptive.last
    assert last is not None
    assert adaptive.controller.baseline_ms <= max(baseline or 0.0, last.latency_ms or 0.0)


def test_a_probe_that_fails_falls_back_to_the_start_value(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = adaptive_harness(tmp_path, harnesses, adaptive={"interval_seconds": 0.1})
    adaptive = limit_of(harness)
    assert adaptive.probe is not None
    adaptive.probe.path = tmp_path / "no such directory" / "adaptive-probe"
    # Not fan_out: its fed readings, healthy and with no failure, would take the gate out
    # of fallback between two of its own (a second AdaptiveFallback entry, at random).
    for mind in MINDS:
        deliver(harness, mind)
    read_until(harness, lambda: mode_of(adaptive) is AdaptiveMode.FALLBACK)
    [fallback] = harness.journal.of(events.AdaptiveFallback)
    assert "the probe of" in fallback.why and "no such directory" in fallback.why
    assert adaptive.limit() == 2


def test_a_psi_file_lost_with_no_other_to_read_stays_in_fallback_and_doctor_says_so(
    tmp_path: Path, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the packaged gate finds its file (no test's file given): when the one it read
    turns to garbage and pressure_file() then finds none that reads as PSI, the gate
    stays at the start value reading after reading, not only for the one reading that
    failed (a host that never had PSI measures by the probe; one that lost it does not
    trust it). `volutectl doctor`'s adaptive check, asking the live gate, warns."""
    psi = tmp_path / "io.pressure"
    psi.write_text(PSI.format(1000))

    def found(settings: object, *roots: Path) -> Path | None:
        try:
            parse_total(psi.read_text())
        except (OSError, ValueError):
            return None
        return psi

    monkeypatch.setattr(gate_adaptive, "pressure_file", found)
    harness = adaptive_harness(tmp_path, harnesses, adaptive={"interval_seconds": 0.1})
    adaptive = limit_of(harness)
    assert adaptive.psi_path == psi
    fan_out(harness)
    readings(harness, 2)
    assert mode_of(adaptive) is AdaptiveMode.ADAPTIVE
    psi.write_text("garbage\n")
    read_until(harness, lambda: mode_of(adaptive) is AdaptiveMode.FALLBACK)
    readings(harness, 5)  # several readings with no PSI file at all: still fallback
    assert mode_of(adaptive) is AdaptiveMode.FALLBACK and adaptive.limit() == 2
    assert harness.journal.of(events.AdaptiveMeasuring) == []
    assert len(harness.journal.of(events.AdaptiveFallback)) == 1

    check = doctor_check(harness)
    assert check.status == "warn" and "fell back to a static 2" in check.found
    assert str(psi) in check.found

    psi.write_text(PSI.format(5000))  # readable again: measuring again
    read_until(harness, lambda: mode_of(adaptive) is AdaptiveMode.ADAPTIVE)
    assert len(harness.journal.of(events.AdaptiveMeasuring)) == 1
    assert doctor_check(harness).status == "ok"


def test_a_gate_started_before_the_slice_reads_the_slices_io_pressure_once_it_reads(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    """A gate started at boot, before the first turn made the slice's cgroup, reads the
    system's io.pressure (every stall on the host: the gate's own probe, a backup). Once
    the slice's reads as PSI, the readings are the turns' own stall; the interval read
    from both files measures no stall at all."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    slice_file = root / "volute.slice" / "volute-turns.slice" / "io.pressure"
    system = tmp_path / "proc-pressure-io"
    system.write_text(PSI.format(0))
    config = {"start": 2, "minimum": 1, "maximum": 4, "interval_seconds": 10.0, "rule": "aimd"}
    harness = Harness(
        tmp_path, start=False, minds=MINDS, limits={"adaptive": config}, clock=FakeClock()
    )
    harnesses.append(harness)
    harness.sensor = StorageSensor(harness.settings, True, cgroup_root=root, system=system)
    harness.restart()
    writing(harness)
    adaptive = limit_of(harness)
    assert adaptive.psi_path == system
    for mind in MINDS:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 2)

    def stalled_after(host: float, turns: float) -> float | None:
        """The next reading's stall, the system's file having counted `host` seconds
        more and the slice's `turns` (if it reads)."""
        system.write_text(PSI.format(parse_total(system.read_text()) + int(host * 1e6)))
        if slice_file.exists():
            total = parse_total(slice_file.read_text()) + int(turns * 1e6)
            slice_file.write_text(PSI.format(total))
        readings(harness, 1)
        assert adaptive.last is not None
        return adaptive.last.stalled

    readings(harness, 1)  # the first interval's mark
    assert stalled_after(host=1.0, turns=0.0) == pytest.approx(0.1)  # the host's
    slice_file.parent.mkdir(parents=True)  # the first turn started: systemd made the slice
    slice_file.write_text(PSI.format(0))
    assert stalled_after(host=8.0, turns=0.0) is None  # read from both: no measure
    assert adaptive.psi_path == slice_file
    assert stalled_after(host=8.0, turns=0.5) == pytest.approx(0.05)  # the turns' own


def doctor_check(harness: Harness) -> doctor.Check:
    """`volutectl doctor`'s adaptive check against the harness's gate: its blocking
    request runs in a thread while the test steps the gate."""
    result: list[doctor.Check] = []
    asking = threading.Thread(
        target=lambda: result.append(
            doctor.check_adaptive(*doctor.gate_adaptive(harness.socket_path, timeout=10))
        )
    )
    asking.start()
    harness.pump(lambda: not asking.is_alive())
    asking.join()
    return result[0]


def test_a_turn_tells_what_it_wrote_and_light_minds_pass_while_a_heavy_one_writes(
    tmp_path: Path, harnesses: list[Harness], hold: Path
) -> None:
    # While `hold` exists, turns stay (sleep) after they wrote.
    then = f"if [ -e {hold} ]; then exec sleep 30; fi"
    writes = f"head -c {3 << 20} /dev/zero > {tmp_path}/written-$VOLUTE_MIND; {then}"
    minds = {"heavy": writes, "heavy2": writes, "heavy3": writes}
    minds |= {f"light{i}": then for i in range(3)}
    # A maximum over the five that run: it bounds the turns at once whatever their costs.
    config = {"start": 2, "minimum": 1, "maximum": 8, "interval_seconds": 10.0}
    harness = Harness(tmp_path, minds=minds, limits={"adaptive": config})
    harnesses.append(harness)
    adaptive = limit_of(harness)
    assert adaptive.costs() == {}  # cold: every mind costs 1, the limit counts turns
    for mind in ["heavy", "light0", "light1", "light2"]:
        deliver(harness, mind)
    harness.pump(lambda: len(adaptive.costs()) == 4 and running(harness) == 0)
    assert adaptive.io_costs.written["heavy"] >= 3 << 20  # the turn's own rusage
    assert adaptive.io_costs.of() == {"heavy": 1.0} | {f"light{i}": FLOOR for i in range(3)}
    # A new turn costs at least STARTING until a sample after its probation judges it.
    assert adaptive.costs() == {"heavy": 1.0} | {f"light{i}": STARTING for i in range(3)}
    # Warm: the heavy mind takes one place of two; light ones fit beside it (each once
    # sampled); a second heavy one (unknown: as heavy) takes the other, a third waits,
    # and a light one behind it passes it (the light turns cost less than a place).
    hold.touch()
    for mind in ["heavy", "light0", "heavy2", "light1", "heavy3", "light2"]:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 5 and holds(harness) == {"adaptive_limit": 1})
    assert "heavy3" not in {turn.mind for turn in harness.gate.state.turns.all()}


def test_a_cold_gate_lets_quiet_turns_by_once_a_sample_shows_them_and_holds_writers_whole(
    tmp_path: Path, harnesses: list[Harness], hold: Path
) -> None:
    # Six minds the gate has never seen: one writes 1 MiB (to the test's own disk, where
    # write_bytes counts), five wait; all stay while `hold` exists. At a limit of 2 (no
    # reading in this test moves it) the first two start as whole places. A sample at
    # the end of each turn's probation shows what it wrote: the writer stays whole, a
    # quiet one costs the floor, and its place goes to the next unknown turn, one at a
    # time, each judged in turn, until all six run beside the one writer. The samples
    # are the launcher's own, of the real processes; the gate's clock is a fake one, so
    # that a loaded machine cannot let a probation pass between two steps of the test.
    hold.touch()
    # Asleep nearly always: a sample that finds any of a turn's processes runnable does
    # not judge it, and on a loaded machine a shell that forks a short sleep twenty
    # times a second is found runnable again and again.
    stay = f"while [ -e {hold} ]; do sleep 1; done"
    written = tmp_path / "w"
    minds = {"writer": f"head -c {1 << 20} /dev/zero > {written}; {stay}"}
    minds |= {f"quiet{i}": stay for i in range(5)}
    config = {"start": 2, "minimum": 1, "maximum": 8, "interval_seconds": 10.0}
    harness = Harness(tmp_path, minds=minds, limits={"adaptive": config}, clock=FakeClock())
    harnesses.append(harness)
    adaptive = limit_of(harness)
    for mind in minds:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 2 and holds(harness) == {"adaptive_limit": 4})
    assert {turn.mind for turn in harness.gate.state.turns.all()} == {"writer", "quiet0"}
    # The writer's MiB is written before its first sample can judge it.
    harness.pump(lambda: written.exists() and written.stat().st_size == 1 << 20)
    shown = {"writer": 1.0} | {f"quiet{i}": FLOOR for i in range(5)}
    deadline = time.monotonic() + 60
    while adaptive.running_costs() != shown and time.monotonic() < deadline:
        # A sample that finds a turn's shell still starting (running) does not judge it:
        # the real processes get a moment to reach their sleep before the next.
        time.sleep(0.05)
        harness.advance(PROBATION_SECONDS)
    assert adaptive.running_costs() == shown
    assert running(harness) == 6
    assert adaptive.limit() == 2  # the limit did not move: the costs did
    assert adaptive.sample_failure is None
    # Paced: each quiet turn started once the one before it had been judged.
    started = sorted(t.started_at for t in harness.gate.state.turns.all() if t.mind != "writer")
    gaps = [later - earlier for earlier, later in zip(started, started[1:], strict=False)]
    assert min(gaps) >= PROBATION_SECONDS * 0.9, gaps
    hold.unlink()
    harness.pump(lambda: running(harness) == 0 and not holds(harness), timeout=20)


def staying(
    tmp_path: Path, harnesses: list[Harness], order: list[str], *, start: int
) -> tuple[Harness, dict[str, Path]]:
    """A cold gate on a fake clock whose minds (`order`) each stay while a file of
    theirs exists (the files, by mind), at an adaptive limit of `start` that no reading
    moves (a 10 s interval)."""
    stays = {mind: tmp_path / f"{mind}.stays" for mind in order}
    for path in stays.values():
        path.touch()
    minds = {mind: f"while [ -e {path} ]; do sleep 0.05; done" for mind, path in stays.items()}
    config = {"start": start, "minimum": 1, "maximum": 8, "interval_seconds": 10.0}
    harness = Harness(tmp_path, minds=minds, limits={"adaptive": config}, clock=FakeClock())
    harnesses.append(harness)
    return harness, stays


class ScriptedWrites:
    """The launcher's samples, scripted: a turn of a mind `bursting` says so writes 1 MiB
    between any two samples; others write nothing. Keeps when each sample was asked for,
    the most bursting turns seen running at once, and fails while `failing`."""

    def __init__(self, harness: Harness, bursting: dict[str, bool]) -> None:
        self.harness = harness
        self.bursting = bursting
        self.failing = False
        self.asked: list[float] = []
        self.most_bursting = 0
        self.written: dict[int, int] = {}
        harness.gate.state.turns.hands.sample = self.sample  # type: ignore[method-assign]

    def sample(self, turn_ids: Sequence[int]) -> dict[int, Written]:
        self.asked.append(self.harness.clock.monotonic())
        if self.failing:
            raise VoluteError("the launcher did not answer")
        turns = {turn.id: turn.mind for turn in self.harness.gate.state.turns.all()}
        for turn_id in turn_ids:
            more = self.bursting.get(turns.get(turn_id, ""), False)
            self.written[turn_id] = self.written.get(turn_id, 0) + (1 << 20 if more else 0)
        now = sum(self.bursting.get(mind, False) for mind in turns.values())
        self.most_bursting = max(self.most_bursting, now)
        return {turn_id: Written(self.written[turn_id], blocked=False) for turn_id in turn_ids}


def test_a_mixed_fan_out_runs_its_writers_one_at_a_time_and_lets_quiet_turns_by(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    # A cold gate at a limit of 3 (no reading moves it here), a fan-out of two writers
    # and four quiet minds, each staying while its file exists. The samples are
    # scripted: a writer's turn writes 1 MiB between any two while `bursting` says so.
    # Once a sample has shown a writer and quiet turns (as many), writers go one at a
    # time: a turn of unknown cost may write, so it waits while a writer writes
    # (`writer_running`, where the limit alone would let it start), and starts once the
    # writer has stopped, or ended, and writers' pause after it is over (WRITER_PAUSE);
    # the quiet ones then start one judged at a time.
    order = ["w0", "q0", "q1", "w1", "q2", "q3"]
    harness, stays = staying(tmp_path, harnesses, order, start=3)
    adaptive = limit_of(harness)
    writes = ScriptedWrites(harness, bursting={"w0": True, "w1": True})

    def minds_running() -> set[str]:
        return {turn.mind for turn in harness.gate.state.turns.all()}

    for mind in order:
        deliver(harness, mind)
    harness.pump(lambda: minds_running() == {"w0", "q0", "q1"})
    assert not adaptive.stagger()  # nothing judged yet: three unknown turns at 3
    harness.advance(PROBATION_SECONDS)
    now = harness.clock.monotonic()
    assert adaptive.stagger() and adaptive.writers(adaptive.running_turns, now) == 1
    assert holds(harness) == {"writer_running": 3}
    assert minds_running() == {"w0", "q0", "q1"}
    # w0 stops writing and waits (on the model, say): the next sample lets the oldest
    # held one by, w1, whose start holds the others again.
    writes.bursting["w0"] = False
    harness.advance(10.0)  # a reading's sample
    assert minds_running() == {"w0", "q0", "q1", "w1"}
    assert holds(harness) == {"writer_running": 2}
    harness.advance(PROBATION_SECONDS)  # w1 is seen writing: they still wait
    assert holds(harness) == {"writer_running": 2}
    # w1 ends: writers pause, then the quiet ones start, one at a time, each judged
    # before the next (not known quiet, each may write until a sample shows it).
    stays["w1"].unlink()
    harness.pump(lambda: "w1" not in minds_running(), timeout=10)
    assert minds_running() == {"w0", "q0", "q1"}
    assert holds(harness) == {"writer_running": 2}  # the pause after w1
    harness.advance(WRITER_PAUSE * 0.9)
    assert minds_running() == {"w0", "q0", "q1"}
    harness.advance(WRITER_PAUSE * 0.1)
    assert minds_running() == {"w0", "q0", "q1", "q2"}
    assert holds(harness) == {"writer_running": 1}  # q2 may write, till a sample shows
    harness.advance(PROBATION_SECONDS)
    assert minds_running() == {"w0", "q0", "q1", "q2", "q3"}
    assert not holds(harness)
    assert writes.most_bursting == 1
    assert adaptive.limit() == 3  # no reading moved it: writers one at a time did this
    for path in stays.values():
        path.unlink(missing_ok=True)
    harness.pump(lambda: running(harness) == 0, timeout=20)


def test_the_next_writer_waits_out_writers_pause_after_a_short_one_ends_unsampled(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    # A warm gate that knows two writers and two quiet minds (a mix: writers go one at a
    # time) and a fan-out of the two writers alone. w0 ends before any sample judged it
    # (a short heavy writer, as the eMMC's 20-60 ms ones): it may have been writing to
    # its end, so w1 waits WRITER_PAUSE from that end, and starts then, with no turn
    # running to be sampled. Without the pause it would start in the pass that saw w0
    # end: back to back, when a writer on the card meets slow samples twice as often.
    order = ["w0", "w1", "q0", "q1"]
    harness, stays = staying(tmp_path, harnesses, order, start=3)
    adaptive = limit_of(harness)
    ScriptedWrites(harness, bursting={"w0": True, "w1": True})
    for mind, written in {"w0": 2 << 20, "w1": 2 << 20, "q0": 0, "q1": 0}.items():
        adaptive.learn_cost(mind, written)
    assert adaptive.stagger()
    deliver(harness, "w0")
    deliver(harness, "w1")

    def minds_running() -> set[str]:
        return {turn.mind for turn in harness.gate.state.turns.all()}

    harness.pump(lambda: minds_running() == {"w0"})
    assert holds(harness) == {"writer_running": 1}
    stays["w0"].unlink()
    harness.pump(lambda: "w0" not in minds_running(), timeout=10)  # the fake clock stands
    harness.step(0)
    assert not minds_running(), "w1 started back to back with w0"
    assert holds(harness) == {"writer_running": 1}
    ended = harness.clock.monotonic()
    assert adaptive.writers([], ended) == 1  # none runs: the pause holds it
    harness.advance(WRITER_PAUSE * 0.9)
    assert not minds_running()
    harness.advance(WRITER_PAUSE * 0.1)
    assert minds_running() == {"w1"}
    assert adaptive.writers([], harness.clock.monotonic()) == 0  # the pause is over
    stays["w1"].unlink()
    harness.pump(lambda: running(harness) == 0, timeout=20)


def test_a_writer_held_while_samples_fail_starts_when_the_one_writing_ends(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    # The launcher stops answering samples while w0 writes and w1 waits for it
    # (`writer_running`): nothing shows w0 stopped, so w1 keeps waiting, but only for
    # w0's turn: once it ends, w1 starts. Nothing is wedged, and no sample is asked for
    # again before SAMPLE_PAUSE (no busy loop on the re-sample of a writer).
    order = ["w0", "q0", "w1"]
    harness, stays = staying(tmp_path, harnesses, order, start=2)
    adaptive = limit_of(harness)
    writes = ScriptedWrites(harness, bursting={"w0": True, "w1": True})
    for mind in order:
        deliver(harness, mind)
    harness.pump(lambda: len(harness.gate.state.turns.all()) == 2)
    harness.advance(PROBATION_SECONDS)
    assert holds(harness) == {"writer_running": 1}
    writes.failing = True
    before = len(writes.asked)
    harness.advance(5.0)
    assert holds(harness) == {"writer_running": 1}  # no evidence w0 stopped: it waits
    assert len(writes.asked) - before <= 2  # one failed try, and none again before the pause
    assert adaptive.sample_failure == "the launcher did not answer"
    stays["w0"].unlink()
    harness.pump(lambda: "w0" not in {turn.mind for turn in harness.gate.state.turns.all()})
    # Writers' pause after w0, which a failed sample does not lengthen.
    harness.advance(WRITER_PAUSE)
    assert "w1" in {turn.mind for turn in harness.gate.state.turns.all()}
    assert not holds(harness)
    for path in stays.values():
        path.unlink(missing_ok=True)
    harness.pump(lambda: running(harness) == 0, timeout=20)


def test_a_sample_that_fails_leaves_turns_at_their_minds_cost_and_waits_to_try_again(
    tmp_path: Path, harnesses: list[Harness], hold: Path
) -> None:
    hold.touch()
    # Asleep nearly always: a sample that finds any of a turn's processes runnable does
    # not judge it, and on a loaded machine a shell that forks a short sleep twenty
    # times a second is found runnable again and again.
    stay = f"while [ -e {hold} ]; do sleep 1; done"
    config = {"start": 1, "minimum": 1, "maximum": 4, "interval_seconds": 10.0}
    harness = Harness(
        tmp_path,
        minds={"a": stay, "b": stay},
        limits={"adaptive": config},
        clock=FakeClock(),
    )
    harnesses.append(harness)
    adaptive = limit_of(harness)
    asked: list[float] = []

    def refuse(turn_ids: Sequence[int]) -> dict[int, Written]:
        asked.append(harness.clock.monotonic())
        raise VoluteError("unknown order 'sample'")  # an older launcher

    hands = harness.gate.state.turns.hands
    original = hands.sample
    hands.sample = refuse  # type: ignore[method-assign]
    deliver(harness, "a")
    deliver(harness, "b")
    harness.pump(lambda: running(harness) == 1 and holds(harness) == {"adaptive_limit": 1})
    started = harness.clock.monotonic()
    harness.advance(PROBATION_SECONDS * 0.9)
    assert asked == []
    harness.advance(PROBATION_SECONDS * 0.1)
    assert asked == [pytest.approx(started + PROBATION_SECONDS, abs=1e-3)]  # a's probation
    assert adaptive.sample_failure == "unknown order 'sample'"
    assert adaptive.running_costs() == {"a": 1.0}  # unknown, unshown: a whole place
    harness.advance(gate_adaptive.SAMPLE_PAUSE - 1)
    assert len(asked) == 1  # not asked again at once...
    assert running(harness) == 1  # ...and b still waits: nothing let by on no evidence
    assert adaptive.wants_sample(asked[0] + gate_adaptive.SAMPLE_PAUSE - 1) == []
    assert adaptive.wants_sample(asked[0] + gate_adaptive.SAMPLE_PAUSE) != []  # ...but later
    hands.sample = original  # type: ignore[method-assign]
    hold.unlink()
    harness.pump(lambda: running(harness) == 0 and not holds(harness), timeout=20)


class ScriptedSensor:
    """A sensor the test scripts (the gate's Sensor): no probe, and PSI's cumulative
    stall as the test sets it, or why it cannot be read. Counts its reads."""

    def __init__(self) -> None:
        self.probe: gate_adaptive.Probe | None = None
        self.psi_path: Path | None = None
        self.disks: DiskWatch | None = None
        self.total: int | str | None = 0
        self.reads = 0

    def psi_total(self) -> int | str | None:
        self.reads += 1
        return self.total

    def use_pressure_file(self, path: Path) -> None:
        self.psi_path = path

    def close(self) -> None:
        pass


def test_the_gate_reads_its_sensor_once_an_interval_and_falls_back_while_it_fails(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    sensor = ScriptedSensor()
    config = {"start": 2, "minimum": 1, "maximum": 4, "interval_seconds": 10.0}
    harness = Harness(
        tmp_path, minds=MINDS, limits={"adaptive": config}, clock=FakeClock(), sensor=sensor
    )
    harnesses.append(harness)
    writing(harness)
    adaptive = limit_of(harness)
    assert adaptive.sensor is sensor
    for mind in MINDS:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 2 and holds(harness) == {"adaptive_limit": 3})
    assert sensor.reads == 1 and adaptive.last is None  # the interval's mark, no reading
    sensor.total = "io.pressure cannot be read (gone)"
    harness.advance(10.0 * 0.99)
    assert sensor.reads == 1 and adaptive.last is None  # not before the interval ends
    harness.advance(10.0 * 0.01)
    assert sensor.reads == 2 and mode_of(adaptive) is AdaptiveMode.FALLBACK
    [fallback] = harness.journal.of(events.AdaptiveFallback)
    assert (fallback.limit, fallback.why) == (2, "io.pressure cannot be read (gone)")
    harness.advance(10.0)  # still failing: still fallback, said once
    assert sensor.reads == 3 and mode_of(adaptive) is AdaptiveMode.FALLBACK
    assert len(harness.journal.of(events.AdaptiveFallback)) == 1
    sensor.total = 1_000_000
    harness.advance(10.0)  # reads again: measuring again, from the start value
    assert sensor.reads == 4 and mode_of(adaptive) is AdaptiveMode.ADAPTIVE
    [measuring] = harness.journal.of(events.AdaptiveMeasuring)
    assert measuring.limit == 2
    sensor.total = 1_000_000 + 6_000_000  # 6 s stalled of the 10 s interval
    harness.advance(10.0)
    assert sensor.reads == 5 and adaptive.last is not None
    assert adaptive.last.stalled == pytest.approx(0.6)
    assert running(harness) == 2 and adaptive.deadline() == pytest.approx(
        harness.clock.monotonic() + 10.0, abs=1e-3
    )  # the next reading, one interval on


class ScriptedProbe:
    """A probe that answers as the test says: each start takes the next latency (ms) at
    once, or None for a probe that never ends. As the real Probe, a pipe says it ended."""

    def __init__(self, path: Path, script: list[float | None]) -> None:
        self.path = path
        self.script = list(script)
        self.started: list[float] = []
        self.started_at: float | None = None
        self._read, self._write = socket.socketpair()
        self._result: float | None = None

    @property
    def in_flight(self) -> bool:
        return self.started_at is not None

    def fileno(self) -> int:
        return self._read.fileno()

    def start(self, now: float) -> None:
        if self.in_flight:
            return
        self.started_at = now
        self.started.append(now)
        result = self.script.pop(0)
        if result is not None:
            self._result = result
            self._write.send(b"!")

    def take(self) -> float | None:
        self._read.setblocking(False)
        try:
            self._read.recv(64)
        except BlockingIOError:
            pass
        result, self._result = self._result, None
        if result is not None:
            self.started_at = None
        return result

    def close(self) -> None:
        self._read.close()
        self._write.close()


def unmeasured(harness: Harness, script: list[float | None]) -> tuple[AdaptiveLimit, Any]:
    """The harness's adaptive limit as a gate's just started would find it (no baseline,
    no quiet probe asked), its probe the test's."""
    adaptive = limit_of(harness)
    probe = ScriptedProbe(adaptive.probe.path if adaptive.probe else Path("p"), script)
    adaptive.probe = probe  # type: ignore[assignment]
    adaptive._quiet_asked = False
    adaptive.controller = Controller(limit=adaptive.controller.limit)
    return adaptive, probe


@pytest.mark.parametrize(
    ("script", "probes", "baseline"),
    [
        ([70.0, 5.0, 4.2], 3, 4.2),  # a disk still writing back: the probes agree later
        ([1.0, 1.2], 2, 1.01),  # a quiet disk: two probes (a higher one lets it up 5%)
        ([80.0, 78.0], 2, 78.0),  # a disk busy all along: what it shows, as before
    ],
)
def test_at_its_start_the_gate_probes_until_two_quiet_probes_agree(
    tmp_path: Path,
    harnesses: list[Harness],
    script: list[float | None],
    probes: int,
    baseline: float,
) -> None:
    harness = adaptive_harness(tmp_path, harnesses)
    adaptive, probe = unmeasured(harness, [*script, 1.0])
    try:
        adaptive.measure_quiet_disk(harness.clock.monotonic())
        assert len(probe.started) == probes
        assert adaptive.controller.baseline_ms == pytest.approx(baseline)
        assert not probe.in_flight and adaptive.last is None  # no reading: nothing moved
        adaptive.measure_quiet_disk(harness.clock.monotonic())  # once only
        assert len(probe.started) == probes
    finally:
        probe.close()


def test_a_quiet_probe_not_done_in_its_wait_is_left_in_flight(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = adaptive_harness(tmp_path, harnesses)
    adaptive, probe = unmeasured(harness, [None])
    try:
        adaptive.measure_quiet_disk(harness.clock.monotonic(), wait=0.05)
        assert len(probe.started) == 1 and probe.in_flight
        assert adaptive.controller.baseline_ms is None
    finally:
        probe.close()
