"""The one way volutectl writes a duration for people: `45.2s`, `3m05s`, `1h02m`.

`volutectl status`, `volutectl test`'s wait line and the gate's own messages all use it,
so an operator reads one format everywhere. Pure and import-free: the test wrapper's
core (volutectl/core/slotmath.py) and the status view both load it.
"""

from __future__ import annotations


def format_duration(seconds: float) -> str:
    """Tenths of a second under a minute, whole seconds under an hour, minutes beyond:
    `0.4s`, `45.2s`, `3m05s`, `1h02m`, `50h00m`. A negative duration (a clock step) is 0."""
    tenths = round(max(0.0, seconds), 1)
    if tenths < 60:
        return f"{tenths:.1f}s"
    whole = round(seconds)
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
