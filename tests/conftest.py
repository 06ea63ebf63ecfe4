"""Test tiers and the real-systemd fixture.

- unit tests: no marker, run everywhere.
- `system`: each test gets its own throwaway systemd (systemd-nspawn over an overlay of
  this machine's root, about 0.3 s to boot). The checkout and the virtualenv are bound
  at the same paths inside, so `volutectl` there is this checkout.
- `install` / `install_arm64`: the Debian package in a clean debootstrapped root.

A system test that cannot get a real systemd errors; it never passes or skips quietly.
With VOLUTE_REQUIRE_SYSTEM=1 (set by .ci/run), a skipped system or install test fails
the whole run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from volute_testbed.machine import Machine, dev_machine

TIER_MARKERS = ("system", "install", "install_arm64")


@pytest.fixture
def machine(request: pytest.FixtureRequest) -> Iterator[Machine]:
    """A fresh, booted systemd of our own; torn down after the test."""
    raw = "".join(ch if ch.isalnum() else "-" for ch in request.node.name.lower())
    name = "vt-" + "-".join(part for part in raw.split("-") if part)[:40].strip("-")
    with dev_machine(name=name) as booted:
        yield booted


_skipped_tier_tests: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and any(marker in report.keywords for marker in TIER_MARKERS):
        _skipped_tier_tests.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("VOLUTE_REQUIRE_SYSTEM") == "1" and _skipped_tier_tests:
        print(
            f"\nVOLUTE_REQUIRE_SYSTEM=1 but {len(_skipped_tier_tests)} system/install "
            "tests were skipped:\n  " + "\n  ".join(_skipped_tier_tests),
            file=sys.stderr,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
