"""A clock the test moves by hand (volutectl/clock.py's Clock): time stands still
between `advance` calls, so a deadline comes exactly when the test says it does."""

from __future__ import annotations

import time


class FakeClock:
    """Starts at the real time (rows it stamps read as today's), then moves only when
    told to."""

    def __init__(self) -> None:
        self._wall = time.time()
        self._monotonic = time.monotonic()

    def wall(self) -> float:
        return self._wall

    def monotonic(self) -> float:
        return self._monotonic

    def advance(self, seconds: float) -> None:
        """Both clocks move on by `seconds`."""
        assert seconds >= 0, "a clock never goes back"
        self._wall += seconds
        self._monotonic += seconds
