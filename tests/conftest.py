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
from pathlib import Path

import pytest

from tests.machine import CLEAN_PATH, Machine, boot

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
TIER_MARKERS = ("system", "install", "install_arm64")


def machine_binds() -> list[Path]:
    binds = [REPO]
    venv = Path(sys.prefix)
    if not venv.is_relative_to(REPO):
        binds.append(venv)
    return binds


@pytest.fixture
def machine(request: pytest.FixtureRequest) -> Iterator[Machine]:
    """A fresh, booted systemd of our own; torn down after the test."""
    raw = "".join(ch if ch.isalnum() else "-" for ch in request.node.name.lower())
    name = "vt-" + "-".join(part for part in raw.split("-") if part)[:40].strip("-")
    with boot(binds=machine_binds(), name=name) as booted:
        booted.env["PATH"] = f"{VENV_BIN}:{CLEAN_PATH}"
        open_interpreter_path(booted)
        yield booted


def open_interpreter_path(machine: Machine) -> None:
    """Let non-root users in the container run the venv (its python may live under /root).

    Only the container's overlay copy of each directory changes, never the host's.
    """
    real = Path(os.path.realpath(sys.executable))
    dirs = [str(parent) for parent in real.parents if str(parent) != "/"]
    machine.run(["chmod", "a+x", *dirs])


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
