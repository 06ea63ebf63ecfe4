"""Test tiers and the real-systemd fixture.

- unit tests: no marker, run everywhere.
- `system`: each test gets its own throwaway systemd (systemd-nspawn over an overlay of
  this machine's root, about 0.3 s to boot). The checkout and the virtualenv are bound
  at the same paths inside, so `volutectl` there is this checkout.
- `install` / `install_arm64`: the Debian package in a clean debootstrapped root.

A system test that cannot get a real systemd errors; it never passes or skips quietly.
./run-tests (and so .ci/run) fails a run in which a system or install test was skipped:
its verdict over the junit report is volute_testbed/junit.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

from volute_testbed.machine import Machine, dev_machine

# Property tests check what is decided, not how fast: no per-example deadline, which a
# loaded machine (another test run, a CPU hog) trips at random (test_store's handoff
# property did, on 98e6a5e too).
settings.register_profile("volute", deadline=None)
settings.load_profile("volute")

# The modules that take a minute or more, longest first. ./run-tests' parallel phase hands
# whole modules to its workers in collection order, so these go first: one started last
# would run on alone while the other workers sit idle. Only the order changes.
LONGEST_FIRST = (
    "tests/install/test_package.py",
    "tests/system/test_faults.py",
    "tests/unit/test_queueindex.py",
    "tests/system/test_gate.py",
    "tests/system/test_gate_split.py",
    "tests/system/test_logs.py",
    "tests/system/test_turn_dir_attacks.py",
    "tests/system/test_restarts.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        module = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module's tests keep their order


@pytest.fixture
def machine(request: pytest.FixtureRequest) -> Iterator[Machine]:
    """A fresh, booted systemd of our own; torn down after the test."""
    raw = "".join(ch if ch.isalnum() else "-" for ch in request.node.name.lower())
    name = "vt-" + "-".join(part for part in raw.split("-") if part)[:40].strip("-")
    with dev_machine(name=name) as booted:
        yield booted
