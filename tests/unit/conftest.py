"""Fixtures shared by the unit tests that run the real gate in-process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit.gate_harness import Harness
from volutectl import faults


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    """Gates a test makes: each closed after it, and any armed crash point disarmed."""
    made: list[Harness] = []
    yield made
    for harness in made:
        harness.close()
    faults.arm(None)
