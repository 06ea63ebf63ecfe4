"""The verdict ./run-tests and .ci/run both take over their junit reports
(volute_testbed.junit): what it counts, and when it fails a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from volute_testbed.junit import main, merge, verdict


def case(name: str, *children: str, tier: str | None = None) -> str:
    props = f'<properties><property name="tier" value="{tier}"/></properties>' if tier else ""
    inner = "".join(f"<{child}/>" for child in children)
    return f'<testcase classname="t" name="{name}">{props}{inner}</testcase>'


def report(tmp_path: Path, *cases: str, name: str = "junit.xml") -> str:
    path = tmp_path / name
    path.write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
    return str(path)


def test_each_case_counts_once_and_errors_apart_from_failures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = report(
        tmp_path,
        case("ok"),
        case("failed", "failure"),
        case("failed-and-teardown-error", "failure", "error"),
        case("error", "error"),
        case("skipped", "skipped"),
        case("system", tier="system"),
        case("install", tier="install"),
    )
    assert verdict([path], status=1) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "run-tests: system tier: 1 executed, 0 skipped",
        "run-tests: install tier: 1 executed, 0 skipped",
        "3 passed, 2 failed, 1 errors, 1 skipped",
    ]
    assert "run-tests: FAIL: pytest exited 1" in err


def test_an_error_fails_the_run_even_when_pytest_said_nothing(tmp_path: Path) -> None:
    path = report(tmp_path, case("ok"), case("broken-fixture", "error"))
    assert verdict([path], status=0) == 1
    assert verdict([report(tmp_path, case("ok"), name="clean.xml")], status=0) == 0


def test_a_skipped_tier_test_or_a_required_tier_that_never_ran_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    skipped = report(tmp_path, case("s", "skipped", tier="system"), case("i", tier="install"))
    assert verdict([skipped], status=0) == 0  # skips allowed unless asked
    assert verdict([skipped], status=0, no_skips=True) == 1
    assert "1 system tests were skipped: t::s" in capsys.readouterr().err
    assert verdict([skipped], status=0, required=("install",)) == 0
    assert verdict([skipped], status=0, required=("system",)) == 1
    assert "the system tier did not run" in capsys.readouterr().err


def test_several_reports_add_up_and_a_missing_one_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = report(tmp_path, case("s", tier="system"), case("i", tier="install"))
    arm64 = report(tmp_path, case("a", tier="install_arm64"), name="arm64.xml")
    tiers = ("system", "install", "install_arm64")
    assert verdict([first, arm64], required=tiers, label="ci", count_prefix="ci: ") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [
        "ci: install_arm64 tier: 1 executed, 0 skipped",
        "ci: 3 passed, 0 failed, 0 errors, 0 skipped",
    ]
    assert verdict([first, str(tmp_path / "absent.xml")]) == 1
    assert "run-tests: FAIL: no junit report at" in capsys.readouterr().err
    assert verdict([first], status=5) == 1
    assert "pytest collected no tests (exit 5)" in capsys.readouterr().err


def test_a_full_runs_two_phases_merge_into_one_report_with_every_case(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    serial = report(tmp_path, case("timed", tier="system"), name="serial.xml")
    parallel = report(tmp_path, case("s", tier="system"), case("f", "failure"), name="par.xml")
    merged = str(tmp_path / "junit.xml")
    assert main(["--status", "0", "--merge-into", merged, serial, parallel]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "2 passed, 1 failed, 0 errors, 0 skipped"
    assert verdict([merged], required=("system",)) == 1
    assert capsys.readouterr().out.splitlines() == [
        "run-tests: system tier: 2 executed, 0 skipped",
        "run-tests: install tier: 0 executed, 0 skipped",
        "2 passed, 1 failed, 0 errors, 0 skipped",
    ]
    merge([serial, str(tmp_path / "absent.xml")], merged)
    assert verdict([merged], required=("system",)) == 0
