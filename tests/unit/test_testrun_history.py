"""`volutectl test`'s history of finished runs, as the next waiter reads it for its
estimate (`typical_ms`): every finished run counts, the first one too."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from volutectl.core import slotmath
from volutectl.slots import testrun
from volutectl.slots.testrun import RunReport, read_history, record_history


@pytest.fixture
def common_dir(tmp_path: Path) -> Path:
    (tmp_path / "volute").mkdir()  # made by the slots before any run finishes
    return tmp_path


def finish(common_dir: Path, execution_ms: int, exit_status: int = 0) -> None:
    record_history(
        common_dir, "/srv/wt1", ["pytest", "-x"], RunReport(exit_status, execution_ms=execution_ms)
    )


def typical_ms(common_dir: Path) -> int | None:
    """What the next waiter's wait line and --json carry."""
    typical = slotmath.typical_duration_ms(read_history(common_dir), "pytest -x")
    return slotmath.wait_info(1, "--slots", [], typical)["typical_ms"]  # type: ignore[return-value]


def test_no_history_no_estimate(common_dir: Path) -> None:
    assert typical_ms(common_dir) is None


def test_after_one_finished_run_the_next_waiter_has_its_duration(common_dir: Path) -> None:
    finish(common_dir, 1_234)
    assert typical_ms(common_dir) == 1_234
    # Another run after it (here a failure, which is left out) must not hide it: the
    # first line of the file was dropped as if cut, and the estimate was null.
    finish(common_dir, 50, exit_status=1)
    assert typical_ms(common_dir) == 1_234


def test_the_first_run_counts_as_much_as_the_others(common_dir: Path) -> None:
    finish(common_dir, 1_000)
    finish(common_dir, 3_000)
    assert [record.execution_ms for record in read_history(common_dir)] == [1_000, 3_000]
    assert typical_ms(common_dir) == 2_000  # the median of both
    finish(common_dir, 9_000, exit_status=1)  # a failure says little: left out
    assert typical_ms(common_dir) == 2_000


def line_length(common_dir: Path) -> int:
    return len(testrun.history_path(common_dir).read_bytes().splitlines(keepends=True)[0])


@pytest.mark.parametrize("cut", [0, 1, 7])
def test_a_tail_read_drops_only_a_cut_line(
    common_dir: Path, monkeypatch: pytest.MonkeyPatch, cut: int
) -> None:
    """Reading the last N bytes of a long history: a line the read starts inside is
    dropped; one it starts exactly at is whole, and kept."""
    # One clock reading for all three: finished_at is rounded to the millisecond, and
    # 1796061877.94 is a byte shorter than 1796061877.941 (lines must be as long).
    monkeypatch.setattr(time, "time", lambda: 1_796_000_000.125)
    for ms in (1_000, 2_000, 3_000):
        finish(common_dir, ms)
    size = line_length(common_dir)  # every line here is as long
    monkeypatch.setattr(testrun, "HISTORY_TAIL_BYTES", 2 * size + cut)
    kept = [record.execution_ms for record in read_history(common_dir)]
    assert kept == ([2_000, 3_000] if cut < size else [1_000, 2_000, 3_000])
    monkeypatch.setattr(testrun, "HISTORY_TAIL_BYTES", 2 * size - cut)
    kept = [record.execution_ms for record in read_history(common_dir)]
    assert kept == ([2_000, 3_000] if cut == 0 else [3_000])
