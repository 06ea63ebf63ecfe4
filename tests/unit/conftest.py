"""Fixtures shared by the unit tests that run the real gate in-process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.gate_harness import Harness, Turns
from volute_testbed import turn_probe
from volutectl import faults
from volutectl.kernel import blockdevs


@pytest.fixture(autouse=True)
def no_host_disks(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gates the unit tests run watch no disk of the host's (its /sys/block counters
    move with whatever else the machine does): an empty /sys of their own. A test of
    the disks gives its sensor a tree of its own (tests/unit/test_gate_disks.py)."""
    monkeypatch.setattr(blockdevs, "SYS", tmp_path_factory.mktemp("no-sys"))


@pytest.fixture
def hold(tmp_path: Path) -> Iterator[Path]:
    """A file a test's turns wait on while it exists (the test makes it): removed after
    the test whatever its end, so no turn of a failed test is left waiting."""
    path = tmp_path / "hold"
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    """Gates a test makes: each closed after it, and any armed crash point disarmed."""
    made: list[Harness] = []
    yield made
    for harness in made:
        harness.close()
    faults.arm(None)


@pytest.fixture
def probe(tmp_path: Path) -> tuple[str, Turns]:
    """The turn probe (volute_testbed.turn_probe) as a mind's command, and its log."""
    log = tmp_path / "turns.log"
    script = tmp_path / "probe"
    script.write_text(turn_probe.script(str(log)))
    script.chmod(0o755)
    return str(script), Turns(log)
