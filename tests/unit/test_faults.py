"""Crash points: unarmed they do nothing; armed in-process they raise once."""

from __future__ import annotations

import os

import pytest

from volutectl import faults


def test_unarmed_points_do_nothing() -> None:
    faults.arm(None)
    for point in faults.POINTS:
        faults.crash_point(point)


def test_an_armed_point_raises_once_and_only_there() -> None:
    faults.arm("forked")
    try:
        faults.crash_point("start_committed")  # another point: nothing
        with pytest.raises(faults.SimulatedCrash, match="forked"):
            faults.crash_point("forked")
        faults.crash_point("forked")  # disarmed by the crash
    finally:
        faults.arm(None)


def test_a_simulated_crash_is_not_an_exception_the_gate_could_swallow() -> None:
    assert not issubclass(faults.SimulatedCrash, Exception)


def test_an_unknown_point_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown crash point"):
        faults.arm("nowhere")


def test_the_own_cgroup_is_read_from_proc() -> None:
    # What kill_own_cgroup would kill: the processes of our cgroup, which include us.
    assert os.getpid() in faults._cgroup_pids()
