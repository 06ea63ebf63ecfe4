"""The one duration format: tenths of a second, then m/s, then h/m."""

from __future__ import annotations

import pytest

from volutectl.core import slotmath
from volutectl.core.slotmath import InFlight
from volutectl.durations import format_duration


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0.0s"), (0.04, "0.0s"), (0.4, "0.4s"), (45.24, "45.2s"), (59.94, "59.9s"),
        (59.96, "1m00s"), (61, "1m01s"), (185, "3m05s"), (3599.6, "1h00m"),
        (3725, "1h02m"), (50 * 3600, "50h00m"), (-3, "0.0s"),
    ],
)  # fmt: skip
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_the_test_wait_line_uses_the_same_format() -> None:
    line = slotmath.wait_line(1, [InFlight("u.scope", "/srv/wt1", "make", 45.23)], 185_000, "/r")
    assert "`make` for 45.2s;" in line and "typically takes 3m05s" in line
