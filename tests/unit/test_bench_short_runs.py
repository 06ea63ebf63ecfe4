"""bench/bench_adaptive.py's warning under a cell whose p99 verdict is a toss: a judged
gate's runs so short that their p99 is their highest sample, where cap2's leaves one
out (docs/benchmarks.md, "The ruling on short runs"). And the rank it counts by,
volute_testbed.diskprobe's, held to the percentile the runs are judged on."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from volute_testbed.diskprobe import above_percentile, percentile

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_adaptive.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_adaptive_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_above_percentile_counts_the_values_over_the_percentile() -> None:
    for count in [*range(1, 320), 1000]:
        values = random.Random(count).sample(range(10 * count), count)
        p99 = percentile([float(v) for v in values], 0.99)
        assert above_percentile(count, 0.99) == sum(1 for v in values if v > p99), count


def test_the_counts_the_docs_quote() -> None:
    assert [above_percentile(n, 0.99) for n in (0, 45, 51, 52, 150, 151)] == [0, 0, 0, 1, 1, 2]


def runs(bench: ModuleType, label: str, repeats: int, samples: int, p99: float) -> list[object]:
    return [
        bench.Run(
            profile="emmc",
            workload="mixed",
            label=label,
            makespan=1.0,
            stopped_after=None,
            p50=0.0,
            p99=p99,
            most_at_once=2,
            samples=samples,
        )
        for _ in range(repeats)
    ]


def warning(bench: ModuleType, cell: list[object]) -> str | None:
    summaries = bench.cell_summaries(cell)
    result: str | None = bench.short_runs(cell, summaries, bench.probe_bound(summaries))
    return result


def test_a_fail_on_runs_shorter_than_cap2s_is_flagged_until_ten_of_each(
    bench: ModuleType,
) -> None:
    cell = runs(bench, "cap2", 3, 150, 8.0) + runs(bench, "adaptive", 3, 45, 40.0)
    flagged = warning(bench, cell)
    assert flagged is not None
    assert "adaptive 45 (0 left out)" in flagged and "cap2's 150 (1 left out)" in flagged
    assert "--repeats 10" in flagged
    ten = runs(bench, "cap2", 10, 150, 8.0) + runs(bench, "adaptive", 10, 45, 40.0)
    assert warning(bench, ten) is None


def test_a_pass_on_short_runs_stands(bench: ModuleType) -> None:
    """The short runs' bias is against the judged gate: within the bound, no warning."""
    cell = runs(bench, "cap2", 3, 150, 8.0) + runs(bench, "adaptive", 3, 45, 27.0)
    assert warning(bench, cell) is None


def test_a_fail_on_runs_as_long_as_cap2s_is_a_verdict(bench: ModuleType) -> None:
    alike = runs(bench, "cap2", 3, 150, 8.0) + runs(bench, "adaptive", 3, 120, 40.0)
    assert warning(bench, alike) is None


def test_a_short_static_cap_is_not_flagged(bench: ModuleType) -> None:
    """Only the judged gates: a wide cap's short runs are for choosing the best safe cap."""
    cell = runs(bench, "cap2", 3, 150, 8.0) + runs(bench, "cap16", 3, 40, 40.0)
    assert warning(bench, cell) is None
