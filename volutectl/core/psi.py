"""The pure part of pressure-aware admission: PSI trigger lines, the stalled share of an
interval, and the hysteresis. (Pacing a burst is admission.admit's `max_starts`.)

A PSI trigger `some THRESHOLD WINDOW` fires when tasks stalled on IO for THRESHOLD µs
within WINDOW µs. PSI never reports that pressure fell, so a hold ends when the stalled
share of a re-check interval, from two readings of the cumulative `total=`, drops below
`resume_below_percent`: lower than the trigger's ratio, so the state does not flap.

No I/O here: volutectl.gate.pressure (the watch) and volutectl.kernel.probes (what doctor
asks of the kernel) read the files, and these functions decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

UNPRIVILEGED_WINDOW_US = 2_000_000  # the kernel's granularity without CAP_SYS_RESOURCE
MIN_WINDOW_US = 500_000
MAX_WINDOW_US = 10_000_000


@dataclass(frozen=True)
class Trigger:
    kind: str  # "some" or "full"
    threshold_us: int
    window_us: int

    def line(self) -> str:
        return trigger_line(self.kind, self.threshold_us, self.window_us)

    @property
    def fraction(self) -> float:
        return self.threshold_us / self.window_us


def trigger_line(kind: str, threshold_us: int, window_us: int) -> str:
    """The text written to an io.pressure file to register a trigger."""
    if kind not in ("some", "full"):
        raise ValueError(f"PSI trigger kind must be 'some' or 'full', not {kind!r}")
    if not MIN_WINDOW_US <= window_us <= MAX_WINDOW_US:
        raise ValueError(f"PSI window {window_us} µs is outside 500000..10000000")
    if not 0 < threshold_us < window_us:
        raise ValueError(f"PSI threshold {threshold_us} µs must be within (0, {window_us})")
    return f"{kind} {threshold_us} {window_us}"


def coarse_trigger(trigger: Trigger) -> Trigger | None:
    """The nearest trigger an unprivileged writer may register: a 2 s multiple window,
    the threshold scaled to keep the same stalled share. None if it is already one."""
    if trigger.window_us % UNPRIVILEGED_WINDOW_US == 0:
        return None
    steps = -(-trigger.window_us // UNPRIVILEGED_WINDOW_US)  # round up
    window = min(steps * UNPRIVILEGED_WINDOW_US, MAX_WINDOW_US - MAX_WINDOW_US % 2_000_000)
    threshold = max(1, round(trigger.threshold_us * window / trigger.window_us))
    return Trigger(trigger.kind, min(threshold, window - 1), window)


def parse_total(text: str, kind: str = "some") -> int:
    """The cumulative stall in µs (`total=`) of the `some` or `full` line of a PSI file."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == kind:
            for field in fields[1:]:
                if field.startswith("total="):
                    return int(field[len("total=") :])
    raise ValueError(f"no '{kind} ... total=' line in PSI text {text[:80]!r}")


def stall_fraction(total_before_us: int, total_after_us: int, elapsed_s: float) -> float:
    """The share of wall time (0..1) stalled between two readings of `total=`."""
    if elapsed_s <= 0:
        return 0.0
    delta = max(0, total_after_us - total_before_us)
    return min(1.0, delta / (elapsed_s * 1e6))


class Hysteresis(Protocol):
    """The thresholds `next_state` reads: config's `limits.io_pressure` has them."""

    @property
    def threshold_us(self) -> int: ...
    @property
    def window_us(self) -> int: ...
    @property
    def resume_below_percent(self) -> float: ...


def next_state(high: bool, fraction: float, settings: Hysteresis) -> bool:
    """Hysteresis: become high at the trigger's ratio, stay high until below resume."""
    if high:
        return fraction * 100 >= settings.resume_below_percent
    return fraction >= settings.threshold_us / settings.window_us
