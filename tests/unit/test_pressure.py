"""Pressure-aware admission: the pure decisions, and the watch on this kernel's real PSI."""

from __future__ import annotations

import errno
import os
import selectors
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from volutectl import events
from volutectl.config.settings import IoPressureSettings, Settings, load_settings
from volutectl.core import admission as core
from volutectl.core import psi
from volutectl.core.psi import Trigger
from volutectl.errors import ConfigError
from volutectl.gate.pressure import PressureWatch
from volutectl.kernel import probes
from volutectl.states import HoldReason

PSI = Path("/proc/pressure/io")


def settings(**overrides: object) -> IoPressureSettings:
    return IoPressureSettings(**{"enabled": True, **overrides})


# -- trigger lines ---------------------------------------------------------------------


def test_trigger_line_is_what_the_kernel_parses() -> None:
    assert psi.trigger_line("some", 150000, 1000000) == "some 150000 1000000"
    assert Trigger("full", 300000, 2000000).line() == "full 300000 2000000"


@pytest.mark.parametrize(
    ("kind", "threshold", "window"),
    [("any", 1, 1000000), ("some", 0, 1000000), ("some", 1000000, 1000000),
     ("some", 100, 400000), ("some", 100, 12000000)],
)  # fmt: skip
def test_trigger_line_refuses_what_the_kernel_would(kind: str, threshold: int, window: int) -> None:
    with pytest.raises(ValueError):
        psi.trigger_line(kind, threshold, window)


def test_coarse_trigger_rounds_the_window_up_and_keeps_the_ratio() -> None:
    assert psi.coarse_trigger(Trigger("some", 150000, 1000000)) == Trigger("some", 300000, 2000000)
    assert psi.coarse_trigger(Trigger("some", 500000, 3000000)) == Trigger("some", 666667, 4000000)
    assert psi.coarse_trigger(Trigger("some", 150000, 2000000)) is None


@given(
    threshold=st.integers(1, 9_999_999),
    window=st.integers(psi.MIN_WINDOW_US, psi.MAX_WINDOW_US),
)
def test_coarse_trigger_is_always_registrable(threshold: int, window: int) -> None:
    if threshold >= window:
        return
    coarse = psi.coarse_trigger(Trigger("some", threshold, window))
    trigger = coarse or Trigger("some", threshold, window)
    assert trigger.window_us % psi.UNPRIVILEGED_WINDOW_US == 0
    psi.trigger_line(trigger.kind, trigger.threshold_us, trigger.window_us)  # valid
    assert abs(trigger.fraction - threshold / window) < 1e-3 or trigger.threshold_us in (
        1,
        trigger.window_us - 1,
    )


# -- reading PSI ----------------------------------------------------------------------------

SAMPLE = (
    "some avg10=1.42 avg60=1.03 avg300=0.57 total=10686162\n"
    "full avg10=0.38 avg60=0.31 avg300=0.10 total=5728245\n"
)


def test_parse_total_reads_some_and_full() -> None:
    assert psi.parse_total(SAMPLE) == 10686162
    assert psi.parse_total(SAMPLE, "full") == 5728245
    with pytest.raises(ValueError):
        psi.parse_total("garbage\n")


def test_stall_fraction() -> None:
    assert psi.stall_fraction(0, 500_000, 1.0) == pytest.approx(0.5)
    assert psi.stall_fraction(0, 5_000_000, 1.0) == 1.0  # clamped
    assert psi.stall_fraction(10, 5, 1.0) == 0.0  # a reset counter is no stall
    assert psi.stall_fraction(0, 10, 0.0) == 0.0


# -- hysteresis ---------------------------------------------------------------------------------


def test_next_state_has_hysteresis() -> None:
    s = settings(threshold_us=150_000, window_us=1_000_000, resume_below_percent=5.0)
    assert psi.next_state(False, 0.10, s) is False  # below the trigger's 15 %
    assert psi.next_state(False, 0.15, s) is True
    assert psi.next_state(True, 0.10, s) is True  # between: stays high
    assert psi.next_state(True, 0.05, s) is True
    assert psi.next_state(True, 0.049, s) is False  # below resume: released


@given(
    fractions=st.lists(st.floats(0, 1), max_size=50),
    threshold=st.integers(100_000, 900_000),
    resume=st.floats(0.5, 9.5),
)
def test_next_state_never_flaps_inside_the_band(
    fractions: list[float], threshold: int, resume: float
) -> None:
    s = settings(threshold_us=threshold, window_us=1_000_000, resume_below_percent=resume)
    high = False
    for fraction in fractions:
        new = psi.next_state(high, fraction, s)
        if resume / 100 <= fraction < threshold / 1_000_000:
            assert new == high  # inside the band nothing changes
        if fraction >= threshold / 1_000_000:
            assert new
        if fraction < resume / 100:
            assert not new
        high = new


# -- pacing ------------------------------------------------------------------------------------


def test_pacing_keeps_the_oldest_start_and_holds_the_rest_for_pressure() -> None:
    pending = [core.Delivery(i, f"m{i}", "s") for i in range(1, 6)]
    pending.append(core.Delivery(6, "m1", "s"))  # batched with 1
    admission = core.admit(pending, [], core.Limits(), now=0)
    assert len(admission.starts) == 5
    paced = core.admit(pending, [], core.Limits(), now=0, max_starts=1)
    assert [s.delivery_ids for s in paced.starts] == [(1, 6)]
    assert [(h.delivery_id, h.reason) for h in paced.holds] == [
        (i, HoldReason.IO_PRESSURE) for i in (2, 3, 4, 5)
    ]


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2)), max_size=30))
def test_pacing_loses_no_delivery(rows: list[tuple[int, int]]) -> None:
    pending = [core.Delivery(i, f"m{m}", f"s{s}") for i, (m, s) in enumerate(rows, 1)]
    admission = core.admit(pending, [], core.Limits(global_cap=3), now=0)
    paced = core.admit(pending, [], core.Limits(global_cap=3), now=0, max_starts=1)
    before = {i for s in admission.starts for i in s.delivery_ids} | {
        h.delivery_id for h in admission.holds
    }
    after = {i for s in paced.starts for i in s.delivery_ids} | {h.delivery_id for h in paced.holds}
    assert before == after
    assert len(paced.starts) <= 1
    if admission.starts:
        assert paced.starts[0] == admission.starts[0]  # FIFO: the oldest goes first


# -- where the trigger goes -----------------------------------------------------------------------


def test_slice_cgroup_follows_systemd_slice_nesting(tmp_path: Path) -> None:
    assert probes.slice_cgroup("volute-turns.slice", tmp_path) is None  # no v2 hierarchy
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified/cgroup.controllers").write_text("")
    assert probes.slice_cgroup("volute-turns.slice", tmp_path) == (
        tmp_path / "unified/volute.slice/volute-turns.slice"
    )
    (tmp_path / "cgroup.controllers").write_text("cpu io")
    assert probes.slice_cgroup("a-b-c.slice", tmp_path) == (
        tmp_path / "a.slice/a-b.slice/a-b-c.slice"
    )
    assert probes.slice_cgroup("-.slice", tmp_path) == tmp_path
    with pytest.raises(ValueError):
        probes.slice_cgroup("volute.scope", tmp_path)


# -- config -------------------------------------------------------------------------------------


def test_io_pressure_is_off_by_default_and_validated(tmp_path: Path) -> None:
    assert Settings().limits.io_pressure.enabled is False
    path = tmp_path / "c.toml"
    path.write_text("[limits.io_pressure]\nenabled = true\nthreshold_us = 200000\n")
    loaded = load_settings(path, environ={"VOLUTE_LIMITS__IO_PRESSURE__TARGET": "system"})
    io = loaded.settings.limits.io_pressure
    assert (io.enabled, io.threshold_us, io.target) == (True, 200000, "system")
    assert loaded.source_of("limits.io_pressure.target").startswith("env ")
    path.write_text("[limits.io_pressure]\nresume_below_percent = 20\n")
    with pytest.raises(ConfigError, match="limits.io_pressure"):
        load_settings(path, environ={})
    path.write_text("[limits.io_pressure]\nwindow_us = 100\n")
    with pytest.raises(ConfigError, match="window_us"):
        load_settings(path, environ={})


def test_open_returns_none_when_disabled() -> None:
    logged: list[events.BaseEvent] = []
    watch = PressureWatch.open(IoPressureSettings(), slice_cgroup=None, emit=logged.append)
    assert watch is None


def test_open_logs_why_when_no_psi_file_takes_a_trigger(tmp_path: Path) -> None:
    logged: list[events.BaseEvent] = []
    # A slice cgroup whose io.pressure is a plain file: not a PSI file, so refused...
    (tmp_path / "io.pressure").write_text(SAMPLE)
    watch = PressureWatch.open(settings(target="slice"), slice_cgroup=tmp_path, emit=logged.append)
    if watch is not None:  # ... but /proc/pressure/io may still take one on this host
        assert "/proc/pressure/io" in watch.describe()
        assert f"slice refused: cannot watch {tmp_path}/io.pressure" in watch.note
        watch.close()
    else:
        assert logged and isinstance(logged[-1], events.PressureGateOff)
        assert logged[-1].level == "warning"
    # A slice that has no cgroup yet: said so, and the system file is used instead.
    logged.clear()
    watch = PressureWatch.open(
        settings(target="slice"),
        slice_cgroup=tmp_path / "gone",
        emit=logged.append,
    )
    if watch is not None:
        assert "not the turns slice" in watch.describe() and "does not exist" in watch.note
        watch.close()


# -- the watch on this kernel's PSI ------------------------------------------------------------


def psi_trigger_works() -> bool:
    try:
        fd = os.open(PSI, os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.write(fd, b"some 150000 2000000\0")
        return True
    except OSError as error:
        return error.errno not in (errno.EINVAL, errno.EPERM, errno.EOPNOTSUPP, errno.EACCES)
    finally:
        os.close(fd)


needs_psi = pytest.mark.skipif(not psi_trigger_works(), reason="no PSI triggers on this host")


@needs_psi
def test_watch_on_real_psi_says_which_trigger_it_uses() -> None:
    logged: list[events.BaseEvent] = []
    watch = PressureWatch.open(settings(target="system"), slice_cgroup=None, emit=logged.append)
    assert watch is not None
    try:
        text = watch.describe()
        assert "/proc/pressure/io" in text and "resume below 5% stalled" in text
        assert watch.trigger.line() in ("some 150000 1000000", "some 300000 2000000")
        if watch.trigger.window_us == 2_000_000:
            assert "2 s windows" in text
        assert logged[0] == events.PressureGateOn(
            description=text, pressure_file="/proc/pressure/io"
        )
        assert not watch.high and watch.deadline() is None
        # fileno() is selectable for EVENT_READ and quiet when nothing stalls.
        with selectors.DefaultSelector() as sel:
            sel.register(watch.fileno(), selectors.EVENT_READ)
    finally:
        watch.close()


@needs_psi
def test_watch_hysteresis_and_settling_with_real_psi_readings() -> None:
    logged: list[events.BaseEvent] = []
    s = settings(target="system", recheck_seconds=0.5)
    watch = PressureWatch.open(s, slice_cgroup=None, emit=logged.append)
    assert watch is not None
    try:
        # The trigger fired: high, with a re-check deadline.
        assert watch.on_ready(100.0) is True
        assert watch.high and watch.reason == "pressure" and watch.deadline() == 100.5
        assert watch.on_ready(100.1) is False  # again while high: no change
        assert watch.on_deadline(100.2) is False  # not yet due
        # Due, measured over a long (fake) interval: the host's stall share is tiny.
        assert watch.on_deadline(10_000.0) is True
        assert not watch.high and watch.deadline() is None
        assert any(isinstance(event, events.PressureFell) for event in logged)
        # A start while low: hold further starts until its stall is measured.
        pending = [core.Delivery(i, f"m{i}", "s") for i in (1, 2, 3)]
        paced = core.admit(pending, [], core.Limits(), now=0, max_starts=watch.may_start())
        assert [s.delivery_ids for s in paced.starts] == [(1,)]
        watch.note_started(20_000.0)
        assert watch.high and watch.reason == "settling"
        again = core.admit(
            pending[1:], [core.LiveTurn(1, "m1", "s")], core.Limits(), now=0, pressure=watch.high
        )
        assert not again.starts
        assert {h.reason for h in again.holds} == {HoldReason.IO_PRESSURE}
        assert watch.on_deadline(30_000.0) is True and not watch.high
    finally:
        watch.close()
