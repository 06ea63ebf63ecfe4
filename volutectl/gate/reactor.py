"""The gate's one wait: a select() over file descriptors, and deadlines on one clock.

Each part of the gate registers what it waits for: a file descriptor with the callback
that serves it (`watch`), and a deadline with the callback that serves it (`at`). A
deadline is a function that says, whenever asked, when (on the monotonic clock) the part
next has work, or None; so a part keeps its own deadline, and the reactor only asks.
A time that is stored on the wall clock (a delivery's backoff, a turn's time limit)
is turned into the monotonic clock where it is registered (`from_wall_clock`). Both
clocks are the one the gate was given (volutectl/clock.py).

`wait(timeout)` sleeps in select() and calls back each descriptor that is ready, in the
order select() gives them; `run_due()` then calls back each deadline that has come, in
the order they were registered. The gate's pass (volutectl/gate/loop.py) calls both,
and `timeout()` says how long the next wait may sleep: until the nearest deadline, or
for ever.
"""

from __future__ import annotations

import contextlib
import selectors
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from volutectl.clock import SYSTEM, Clock, to_monotonic

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike as FileLike

OnReady = Callable[[int], None]  # called with the events that are ready (EVENT_READ...)
Deadline = Callable[[], float | None]  # when (monotonic) the part next has work
OnDue = Callable[[float], None]  # called with the monotonic time, once that has come


def only_wake(mask: int) -> None:
    """For a descriptor whose news the pass reads anyway: it needs only to wake it."""


@dataclass(frozen=True)
class Timer:
    deadline: Deadline
    on_due: OnDue | None  # None: it only wakes the loop (the pass does the work)


class Reactor:
    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self.selector = selectors.DefaultSelector()
        self._timers: list[Timer] = []

    def from_wall_clock(self, wall: float | None) -> float | None:
        """A wall-clock time (seconds since the epoch) as a time on the monotonic clock."""
        return to_monotonic(self.clock, wall)

    # -- file descriptors -------------------------------------------------------------------

    def watch(self, fd: FileLike, on_ready: OnReady, events: int = selectors.EVENT_READ) -> None:
        """Call `on_ready(mask)` whenever `fd` is ready for `events`."""
        self.selector.register(fd, events, on_ready)

    def modify(self, fd: FileLike, on_ready: OnReady, events: int) -> None:
        self.selector.modify(fd, events, on_ready)

    def unwatch(self, fd: FileLike) -> None:
        """Stop watching `fd`; one not watched (or closed already) is no error."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fd)

    # -- deadlines --------------------------------------------------------------------------

    def at(self, deadline: Deadline, on_due: OnDue | None = None) -> None:
        """Wake the loop at `deadline()` (asked anew before each wait), and from then on
        call `on_due(now)` in each pass until `deadline()` moves or says None."""
        self._timers.append(Timer(deadline, on_due))

    def timeout(self) -> float | None:
        """How long the next wait may sleep: until the nearest deadline, else for ever."""
        deadlines = [due for timer in self._timers if (due := timer.deadline()) is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - self.clock.monotonic())

    def run_due(self) -> None:
        """Call back every deadline that has come."""
        now = self.clock.monotonic()
        for timer in self._timers:
            due = timer.deadline()
            if timer.on_due is not None and due is not None and now >= due:
                timer.on_due(now)

    # -- one wait ---------------------------------------------------------------------------

    def wait(self, timeout: float | None) -> bool:
        """Sleep until a descriptor is ready or `timeout` passes; call back each ready
        one. Whether any was."""
        ready = self.selector.select(timeout)
        for key, mask in ready:
            key.data(mask)
        return bool(ready)

    def close(self) -> None:
        self.selector.close()
