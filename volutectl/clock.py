"""The gate's one clock: the wall clock (what is stored, what people read) and the
monotonic clock (deadlines, intervals), given to every part that reads the time.

`SYSTEM` is the real one. Tests give the gate a clock they move by hand
(tests/unit/fake_clock.py), so that a deadline, a backoff or a reading comes exactly
when the test says, and a test proves that something did not happen without waiting
for it on the wall clock.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def wall(self) -> float:
        """Seconds since the epoch, as stored and shown."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: deadlines and intervals."""
        ...


class SystemClock:
    """The host's clocks."""

    def wall(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM: Clock = SystemClock()


def to_monotonic(clock: Clock, wall: float | None) -> float | None:
    """A wall-clock time (seconds since the epoch) as a time on `clock`'s monotonic one."""
    if wall is None:
        return None
    return clock.monotonic() + wall - clock.wall()
