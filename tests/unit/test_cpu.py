"""The CPU signal (issue 32, item 3): core/cpu.py's rule, gate/cpu.py's reading of PSI
cpu files in a real file tree (the slice's, else the system's; lost and found again),
and the real gate in-process (tests/unit/gate_harness.py): a CPU stall bounds the turns
at once below what the storage's limit lets in, a warm fan-out starts no more than the
CPUs bore, and a CPU file that fails falls back as an io.pressure file does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import CPU_PSI, Harness
from tests.unit.test_gate_adaptive import (
    MINDS,
    holds,
    limit_of,
    mode_of,
    read_until,
    readings,
    running,
)
from tests.unit.test_gate_pause import deliver
from volutectl import events
from volutectl.config.settings import Settings
from volutectl.core import cpu
from volutectl.core.cpu import CpuLimit, CpuReading
from volutectl.gate.adaptive import EVENT_SECONDS
from volutectl.gate.cpu import CpuSignal, cpu_pressure_file
from volutectl.states import AdaptiveMode

pytestmark = pytest.mark.serial  # the real probe times this host's disk (the harness)

FLOOR, MAXIMUM = 2, 16


def reading(stalled: float | None, running: int, waiting: int = 5) -> CpuReading:
    return CpuReading(stalled=stalled, running=running, waiting=waiting)


# -- the rule --------------------------------------------------------------------------


def test_a_stall_that_lasts_drops_the_limit_to_a_share_of_the_turns_that_ran() -> None:
    state, why = cpu.step(CpuLimit(limit=MAXIMUM), reading(0.9, 16), FLOOR, MAXIMUM)
    assert (state.limit, why) == (16, None)  # one reading: a fan-out's start-up, maybe
    state, why = cpu.step(state, reading(0.9, 16), FLOOR, MAXIMUM)
    assert state.limit == 11 and why is not None and "90% stalled" in why
    state, why = cpu.step(state, reading(0.9, 11), FLOOR, MAXIMUM)
    assert state.limit == 7
    for _ in range(5):
        state, _ = cpu.step(state, reading(1.0, state.limit), FLOOR, MAXIMUM)
    assert state.limit == FLOOR  # never below one turn per CPU


def test_a_stall_of_one_reading_between_calm_ones_moves_nothing() -> None:
    state = CpuLimit(limit=MAXIMUM)
    for stalled in (0.9, 0.1, 0.9, 0.3, 0.9):
        state, why = cpu.step(state, reading(stalled, 16), FLOOR, MAXIMUM)
        assert (state.limit, why) == (16, None)


def test_a_gate_that_starts_lets_in_one_turn_per_cpu_and_doubles_while_calm() -> None:
    """Nothing learnt of the CPUs: the floor, not the maximum, so a cold fan-out of
    CPU-bound turns is not let in as fast as the storage's limit allows before two
    stalled readings catch it; with no use known (no cgroup v2), calm readings double it
    every two readings while deliveries wait at it."""
    state = cpu.initial(FLOOR, MAXIMUM)
    assert state == CpuLimit(limit=FLOOR)
    assert cpu.initial(FLOOR, 1).limit == 1  # never over the maximum
    assert cpu.initial(32, MAXIMUM).limit == MAXIMUM  # a host of 32 CPUs
    for expected in (2, 4, 4, 8, 8, 16):
        state, _ = cpu.step(state, reading(0.0, state.limit), FLOOR, MAXIMUM)
        assert state.limit == expected
    idle = cpu.initial(FLOOR, MAXIMUM)
    for _ in range(4):  # calm, but nothing waits at it: it stays
        idle, why = cpu.step(idle, reading(0.0, idle.limit, waiting=0), FLOOR, MAXIMUM)
        assert (idle.limit, why) == (FLOOR, None)
    stalled = cpu.initial(FLOOR, MAXIMUM)
    for _ in range(2):  # CPU-bound turns at the floor: no distress, it stays
        stalled, _ = cpu.step(stalled, reading(0.9, stalled.limit), FLOOR, MAXIMUM)
    assert stalled.limit == FLOOR


def test_a_stall_with_no_more_turns_than_cpus_moves_nothing() -> None:
    """As many CPU-bound turns as cores stall each other too (and the host's other
    work stalls them): that is the floor's cap, not distress."""
    state = CpuLimit(limit=4)
    assert cpu.step(state, reading(1.0, FLOOR), FLOOR, MAXIMUM) == (state, None)


def test_it_grows_only_after_healthy_readings_with_deliveries_waiting_at_it() -> None:
    state = CpuLimit(limit=3)
    state, why = cpu.step(state, reading(0.05, 3), FLOOR, MAXIMUM)
    assert (state.limit, why) == (3, None)  # one healthy reading is not enough
    state, why = cpu.step(state, reading(0.05, 3), FLOOR, MAXIMUM)
    assert state.limit == 6 and why is not None  # doubled
    idle = CpuLimit(limit=3, healthy=5)
    assert cpu.step(idle, reading(0.0, 3, waiting=0), FLOOR, MAXIMUM)[0].limit == 3
    unfilled = CpuLimit(limit=6, healthy=5)
    assert cpu.step(unfilled, reading(0.0, 4), FLOOR, MAXIMUM)[0].limit == 6
    between = CpuLimit(limit=3, healthy=5)
    assert cpu.step(between, reading(0.3, 3), FLOOR, MAXIMUM)[0] == CpuLimit(limit=3)


def test_after_a_stall_it_grows_back_to_below_it_then_by_one() -> None:
    state = CpuLimit(limit=3, healthy=1, distressed_at=8)
    state, _ = cpu.step(state, reading(0.0, 3), FLOOR, MAXIMUM)
    assert state.limit == 6
    state = cpu.step(state, reading(0.0, 6), FLOOR, MAXIMUM)[0]
    state = cpu.step(state, reading(0.0, 6), FLOOR, MAXIMUM)[0]
    assert state.limit == 7  # one below the stall's 8
    state = cpu.step(state, reading(0.0, 7), FLOOR, MAXIMUM)[0]
    state = cpu.step(state, reading(0.0, 7), FLOOR, MAXIMUM)[0]
    assert state.limit == 8


def test_no_reading_moves_nothing_and_the_floor_is_the_cpus_within_the_bounds() -> None:
    state = CpuLimit(limit=5)
    assert cpu.step(state, reading(None, 16), FLOOR, MAXIMUM) == (state, None)
    assert cpu.floor_of(1, 16, 2) == 2
    assert cpu.floor_of(3, 16, 2) == 3
    assert cpu.floor_of(1, 4, 64) == 4
    assert cpu.clamp(CpuLimit(limit=16), 2, 8).limit == 8


# -- the reading, from a real file tree -------------------------------------------------


def test_it_grows_no_further_than_the_cpus_hold_at_what_each_turn_used() -> None:
    """PSI reads calm with as many CPU-bound turns as CPUs: nothing waits for one yet.
    What they use says a doubling would make them wait (the SD card's cpu cell)."""
    calm = CpuLimit(limit=2, healthy=1)

    def used(cores: float, running: int = 2) -> CpuReading:
        """`running` turns that ran the whole half-second interval, using `cores`."""
        return CpuReading(
            stalled=0.02,
            running=running,
            waiting=5,
            used=cores,
            cpus=2,
            seconds=0.5,
            turn_seconds=running * 0.5,
        )

    assert cpu.step(calm, used(1.95), FLOOR, MAXIMUM) == (CpuLimit(limit=2, healthy=2), None)
    # Turns that wait on the network use next to no CPU: the CPUs hold the maximum, and
    # before any distress it goes there at once rather than doubling every two readings.
    grown, why = cpu.step(calm, used(0.04), FLOOR, MAXIMUM)
    assert grown.limit == MAXIMUM and why is not None and "using 0.0 of 2 CPUs" in why
    assert "0.02 per turn" in why
    # A tenth of a CPU each: 20 would fit, the maximum is 16; a fifth: 10.
    assert cpu.step(calm, used(0.2), FLOOR, MAXIMUM)[0].limit == MAXIMUM
    assert cpu.step(calm, used(0.4), FLOOR, MAXIMUM)[0].limit == 10
    # After a distress at 8 it doubles to one below it at most, room or not.
    after = CpuLimit(limit=2, healthy=1, distressed_at=8)
    assert cpu.step(after, used(0.04), FLOOR, MAXIMUM)[0].limit == 4
    four_after = CpuLimit(limit=4, healthy=1, distressed_at=8)
    assert cpu.step(four_after, used(0.04, 4), FLOOR, MAXIMUM)[0].limit == 7
    # Half a CPU each: the CPUs hold 4 of them, so 2 grows to 4, and 4 to no more than 4.
    assert cpu.step(calm, used(1.0), FLOOR, MAXIMUM)[0].limit == 4
    four = CpuLimit(limit=4, healthy=1)
    assert cpu.step(four, used(2.0, running=4), FLOOR, MAXIMUM)[0].limit == 4
    # A third of a CPU each: 6 fit, so 4 grows to 6, not 8.
    assert cpu.step(four, used(4 / 3, running=4), FLOOR, MAXIMUM)[0].limit == 6
    # Unknown use (no cgroup v2): PSI alone, as before.
    unknown = CpuReading(stalled=0.02, running=2, waiting=5, used=None, cpus=2)
    assert cpu.step(calm, unknown, FLOOR, MAXIMUM)[0].limit == 4


def test_room_is_the_maximum_when_the_turns_use_next_to_nothing() -> None:
    def room(used: float | None, running: int, cpus: int = 2) -> int:
        whole = CpuReading(
            None, running, 0, used=used, cpus=cpus, seconds=0.5, turn_seconds=running * 0.5
        )
        return cpu.room(whole, 16)

    assert room(None, 4) == 16 and room(0.0, 4) == 16 and room(1.0, 0) == 16
    assert room(0.125, 1) == 16  # 16 of them use 2 CPUs: the maximum fits
    assert (room(2.0, 2), room(1.0, 2), room(3.0, 2, cpus=4)) == (2, 4, 2)


def test_what_a_turn_uses_is_per_second_it_ran_not_per_interval() -> None:
    """Two turns that started half-way through the interval and kept both CPUs busy
    from then on used one CPU over it: per turn and interval, half a CPU each, room for
    4; per second they ran, a whole one each, room for 2."""
    late = CpuReading(0.02, 2, 5, used=1.0, cpus=2, seconds=0.5, turn_seconds=0.5)
    assert late.busy() == pytest.approx(1.0) and cpu.room(late, 16) == 2
    # Unknown without the slice's CPU time or with no turn-seconds.
    assert CpuReading(0.02, 2, 5, used=None, seconds=0.5, turn_seconds=1.0).busy() is None
    assert CpuReading(0.02, 2, 5, used=1.0, seconds=0.5, turn_seconds=0.0).busy() is None


def test_one_calm_reading_that_measured_the_turns_is_enough_to_grow() -> None:
    """A cold gate at the floor, its 2 turns waiting on the network for the whole first
    interval: that one calm reading says they use next to no CPU, and the bound goes to
    the room at once. Turns that ran for under half the interval (they started just
    before it ended) say too little: two calm readings, as with PSI alone."""
    cold = cpu.initial(FLOOR, MAXIMUM)
    whole = CpuReading(0.02, 2, 5, used=0.02, cpus=2, seconds=0.5, turn_seconds=1.0)
    grown, why = cpu.step(cold, whole, FLOOR, MAXIMUM)
    assert grown.limit == MAXIMUM and why is not None
    brief = replace(whole, turn_seconds=0.4)  # 2 turns for 0.2 s of the 0.5
    once, why = cpu.step(cold, brief, FLOOR, MAXIMUM)
    assert (once.limit, why) == (FLOOR, None)
    assert cpu.step(once, brief, FLOOR, MAXIMUM)[0].limit == MAXIMUM
    # Burners that filled the floor for the whole interval: calm, no room, it stays.
    burners = replace(whole, used=1.96)
    assert cpu.step(cold, burners, FLOOR, MAXIMUM)[0].limit == FLOOR


def psi(total: int) -> str:
    return CPU_PSI.format(total)


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """A cgroup v2 root with the turns slice's cgroup, and a system PSI file."""
    root = tmp_path / "cgroup"
    slice_dir = root / "volute.slice" / "volute-turns.slice"
    slice_dir.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (slice_dir / "cpu.pressure").write_text(psi(0))
    system = tmp_path / "proc-pressure-cpu"
    system.write_text(psi(0))
    return {
        "root": root,
        "slice": slice_dir / "cpu.pressure",
        "stat": slice_dir / "cpu.stat",
        "system": system,
    }


def cpu_stat(usage_usec: int) -> str:
    return f"usage_usec {usage_usec}\nuser_usec {usage_usec}\nsystem_usec 0\n"


def signal_of(tree: dict[str, Path], settings: Settings) -> CpuSignal:
    return CpuSignal(settings, True, cpus=2, cgroup_root=tree["root"], system=tree["system"])


@pytest.fixture
def settings() -> Settings:
    return Settings()


def test_the_slice_file_is_read_when_it_reads_as_psi_else_the_systems(
    tree: dict[str, Path],
) -> None:
    found = cpu_pressure_file("volute-turns.slice", tree["root"], tree["system"])
    assert found == tree["slice"]
    tree["slice"].write_text("not psi\n")
    found = cpu_pressure_file("volute-turns.slice", tree["root"], tree["system"])
    assert found == tree["system"]
    tree["system"].unlink()
    assert cpu_pressure_file("volute-turns.slice", tree["root"], tree["system"]) is None


def test_an_interval_stalled_bounds_the_turns(tree: dict[str, Path], settings: Settings) -> None:
    signal = signal_of(tree, settings)
    assert signal.path == tree["slice"] and signal.bound(1, 16) == 2  # one per CPU
    signal.state = CpuLimit(limit=16)  # grown to the maximum by calm readings since
    assert signal.mark(100.0, running=16) is None
    tree["slice"].write_text(psi(450_000))  # 0.45 s of 0.5 s stalled
    assert signal.read(100.5, running=16, waiting=17, minimum=1, maximum=16) == (None, None)
    tree["slice"].write_text(psi(900_000))  # and the next half second too
    failure, why = signal.read(101.0, running=16, waiting=17, minimum=1, maximum=16)
    assert failure is None and why is not None and "90% stalled with 16 running" in why
    assert signal.bound(1, 16) == 11
    assert signal.last is not None and signal.last.stalled == pytest.approx(0.9)
    assert (signal.last.running, signal.last.waiting) == (16, 17)


def test_the_slices_cpu_stat_says_what_the_turns_used_and_holds_the_growth(
    tree: dict[str, Path], settings: Settings
) -> None:
    signal = signal_of(tree, settings)  # 2 CPUs, the bound at 2
    tree["stat"].write_text(cpu_stat(5_000_000))
    signal.mark(10.0, running=2)
    for n in (1, 2):  # two calm intervals in which the 2 turns kept both CPUs busy
        tree["stat"].write_text(cpu_stat(5_000_000 + n * 980_000))
        assert signal.read(10.0 + n * 0.5, running=2, waiting=9, minimum=1, maximum=16) == (
            None,
            None,
        )
    assert signal.last is not None and signal.last.used == pytest.approx(1.96)
    assert signal.bound(1, 16) == 2  # calm, but no CPU to spare: it stays
    # Then they wait on the network, next to no CPU: the calm it had seen counts, and
    # the CPUs hold the maximum at 0.01 CPUs each (no stall yet: straight there).
    tree["stat"].write_text(cpu_stat(5_000_000 + 2 * 980_000 + 10_000))
    failure, why = signal.read(11.5, running=2, waiting=9, minimum=1, maximum=16)
    assert failure is None and why is not None and "using 0.0 of 2 CPUs" in why
    assert signal.bound(1, 16) == 16
    tree["stat"].unlink()  # no cpu.stat (no cgroup v2 controller): PSI alone, no failure
    signal.mark(20.0, running=4)
    assert signal.read(20.5, running=4, waiting=9, minimum=1, maximum=16)[0] is None
    assert signal.last is not None and signal.last.used is None


def test_turn_seconds_are_the_turns_each_pass_left_running_summed_over_the_interval(
    tree: dict[str, Path], settings: Settings
) -> None:
    """The passes say how many turns run from when: 2 from the mark's 0.25 s in, 2
    more at 0.4, none after 0.45 (all four ended): 2 x 0.15 + 4 x 0.05 = 0.5
    turn-seconds in the half-second interval. The slice used 0.5 CPU-seconds in it, so
    a whole CPU per turn, and the CPUs hold 2 such turns (per interval and the most
    turns at once it would read a quarter of a CPU each, and room for 8)."""
    signal = signal_of(tree, settings)
    tree["stat"].write_text(cpu_stat(1_000_000))
    signal.mark(50.0, running=0)
    signal.note_running(50.25, 2)
    signal.note_running(50.4, 4)
    signal.note_running(50.45, 0)
    tree["stat"].write_text(cpu_stat(1_500_000))
    assert signal.read(50.5, running=0, waiting=9, minimum=1, maximum=16)[0] is None
    last = signal.last
    assert last is not None and last.running == 4
    assert last.turn_seconds == pytest.approx(0.5) and last.seconds == pytest.approx(0.5)
    assert last.used == pytest.approx(1.0) and last.busy() == pytest.approx(1.0)
    assert cpu.room(last, 16) == 2
    # The next interval starts from the read, with the turns the last pass left: none.
    signal.read(51.0, running=0, waiting=9, minimum=1, maximum=16)
    assert signal.last is not None and signal.last.turn_seconds == 0.0
    assert signal.last.busy() is None
    signal.idle()  # an idle gate sums nothing until the next mark
    signal.note_running(60.0, 3)
    signal.mark(60.0, running=3)
    tree["stat"].write_text(cpu_stat(1_530_000))
    signal.read(60.5, running=3, waiting=9, minimum=1, maximum=16)
    assert signal.last is not None and signal.last.turn_seconds == pytest.approx(1.5)


def test_the_bound_is_kept_while_the_gate_is_idle_so_a_warm_fan_out_starts_at_it(
    tree: dict[str, Path], settings: Settings
) -> None:
    signal = signal_of(tree, settings)
    assert signal.bound(1, 16) == 2  # a gate that starts: one turn per CPU
    signal.state = CpuLimit(limit=16)  # grown to the maximum by calm readings since
    signal.mark(0.0, running=16)
    for n in (1, 2):  # two whole intervals stalled
        tree["slice"].write_text(psi(n * 500_000))
        signal.read(n * 0.5, running=16, waiting=0, minimum=1, maximum=16)
    assert signal.bound(1, 16) == 11
    signal.idle()  # the fan-out is over: nothing runs or waits
    assert signal.bound(1, 16) == 11  # the next one starts at what this one bore
    signal.mark(100.0, running=0)
    tree["slice"].write_text(psi(1_000_000))  # calm, but nothing waits: it stays
    assert signal.read(100.5, running=0, waiting=0, minimum=1, maximum=16) == (None, None)
    assert signal.bound(1, 16) == 11


def test_a_slice_file_lost_fails_one_reading_then_the_systems_is_read(
    tree: dict[str, Path], settings: Settings
) -> None:
    """As io.pressure's: the slice's cgroup goes with the slice."""
    signal = signal_of(tree, settings)
    signal.mark(0.0, running=2)
    tree["slice"].unlink()
    failure, _ = signal.read(0.5, running=2, waiting=0, minimum=1, maximum=16)
    assert failure is not None and str(tree["slice"]) in failure
    assert signal.path == tree["system"]
    tree["system"].write_text(psi(100))
    assert signal.read(1.0, running=2, waiting=0, minimum=1, maximum=16) == (None, None)
    tree["system"].write_text(psi(200))
    assert signal.read(1.5, running=2, waiting=0, minimum=1, maximum=16) == (None, None)
    assert signal.last is not None and signal.last.stalled == pytest.approx(0.0002)


def test_a_gate_started_before_the_slice_reads_the_slices_file_once_it_reads(
    tree: dict[str, Path], settings: Settings
) -> None:
    """A gate started at boot, before the first turn made the slice's cgroup, reads the
    system's file (every stall on the host); once the slice's reads as PSI it reads
    that, the turns' own. The interval read from both files is no reading: 0.45 s of the
    system's stall and 0 of the slice's are no measure of anything."""
    tree["slice"].unlink()
    signal = signal_of(tree, settings)
    assert signal.path == tree["system"]
    tree["system"].write_text(psi(1_000_000))
    signal.mark(0.0, running=2)
    tree["slice"].write_text(psi(0))  # the first turn started: systemd made the slice
    tree["system"].write_text(psi(1_450_000))
    assert signal.read(0.5, running=2, waiting=9, minimum=1, maximum=16) == (None, None)
    assert signal.path == tree["slice"] and signal.last is None
    tree["slice"].write_text(psi(50_000))
    tree["system"].write_text(psi(1_900_000))  # the host's burner: not the turns'
    assert signal.read(1.0, running=2, waiting=9, minimum=1, maximum=16)[0] is None
    assert signal.last is not None and signal.last.stalled == pytest.approx(0.1)


def test_no_file_left_keeps_failing_until_one_reads(
    tree: dict[str, Path], settings: Settings
) -> None:
    signal = signal_of(tree, settings)
    signal.mark(0.0, running=1)
    tree["slice"].write_text("garbage\n")
    tree["system"].unlink()
    failure, _ = signal.read(0.5, running=1, waiting=0, minimum=1, maximum=16)
    assert failure is not None and "not PSI text" in failure
    failure, _ = signal.read(1.0, running=1, waiting=0, minimum=1, maximum=16)
    assert failure is not None  # still: no file at all is not "a host with no PSI"
    assert signal.bound(1, 16) is not None
    tree["system"].write_text(psi(5))
    assert signal.read(1.5, running=1, waiting=0, minimum=1, maximum=16)[0] is None


def test_a_host_with_no_cpu_psi_has_no_cpu_bound(tmp_path: Path, settings: Settings) -> None:
    signal = CpuSignal(
        settings, True, cpus=2, cgroup_root=tmp_path / "none", system=tmp_path / "absent"
    )
    assert signal.path is None and signal.bound(1, 16) is None
    assert signal.mark(0.0, running=3) is None
    assert signal.read(0.5, running=3, waiting=1, minimum=1, maximum=16) == (None, None)


# -- in the gate ------------------------------------------------------------------------


def cpu_harness(tmp_path: Path, harnesses: list[Harness], **adaptive: Any) -> Harness:
    config = {"start": 4, "minimum": 1, "maximum": 4, "interval_seconds": 1.0} | adaptive
    harness = Harness(tmp_path, minds=MINDS, limits={"adaptive": config}, clock=FakeClock(), cpus=2)
    harnesses.append(harness)
    return harness


def stall(harness: Harness, share: float) -> None:
    """The CPU file shows `share` of the next interval stalled (read at its end)."""
    total = int(harness.cpu_file.read_text().split("total=")[1].split()[0])
    harness.cpu_file.write_text(CPU_PSI.format(total + int(share * 1_000_000)))


def test_a_cpu_stall_bounds_the_turns_at_once_and_the_next_delivery_waits(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = cpu_harness(tmp_path, harnesses)
    for mind in list(MINDS)[:4]:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 2)
    adaptive = limit_of(harness)
    assert adaptive.turns_bound() == 2  # a gate that starts: one turn per CPU
    readings(harness, 2, cpu=True)  # two calm readings with two deliveries waiting at it: doubled
    harness.pump(lambda: running(harness) == 4)
    assert adaptive.turns_bound() == 4
    stall(harness, 0.95)
    readings(harness, 1, cpu=True)
    assert adaptive.turns_bound() == 4  # one reading stalled: a start-up, maybe
    stall(harness, 0.95)
    readings(harness, 1, cpu=True)
    assert adaptive.turns_bound() == 2
    harness.advance(EVENT_SECONDS)  # the journal's entries: at most one every 5 s
    grown, changed = harness.journal.of(events.CpuLimitChanged)
    assert (grown.old_limit, grown.new_limit) == (2, 4) and "healthy, 2 waiting" in grown.why
    assert (changed.old_limit, changed.new_limit) == (4, 2)
    assert "cpu 95% stalled with 4 running" in changed.why
    deliver(harness, "m4")  # the fifth mind: held, the CPUs bear fewer
    harness.pump(lambda: holds(harness) == {"adaptive_limit": 1})
    assert running(harness) == 4  # a lowered bound stops nothing that runs


def test_a_cpu_file_that_turns_to_garbage_falls_back_as_an_io_pressure_file_does(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = cpu_harness(tmp_path, harnesses, start=2)
    for mind in MINDS:
        deliver(harness, mind)
    harness.pump(lambda: running(harness) == 2)
    adaptive = limit_of(harness)
    readings(harness, 1)
    assert mode_of(adaptive) is AdaptiveMode.ADAPTIVE
    harness.cpu_file.write_text("some garbage\n")
    read_until(harness, lambda: mode_of(adaptive) is AdaptiveMode.FALLBACK)
    [fallback] = harness.journal.of(events.AdaptiveFallback)
    assert fallback.limit == 2 and str(harness.cpu_file) in fallback.why
    harness.cpu_file.write_text(CPU_PSI.format(0))
    read_until(harness, lambda: mode_of(adaptive) is AdaptiveMode.ADAPTIVE)
    assert len(harness.journal.of(events.AdaptiveMeasuring)) == 1
