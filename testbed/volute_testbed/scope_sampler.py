"""Runs INSIDE the test container: samples the live turn scopes from systemd over D-Bus.

    python -m volute_testbed.scope_sampler STOP_FILE OUT_FILE [INTERVAL]   (gate.Sampler)

Independent of the gate (it speaks to systemd directly), so the caps it observes are
systemd's truth, not the gate's bookkeeping. Every ~2 ms it lists the live
volute-turn-*.scope units and records the count and the per-mind count; it stops when
the stop file appears, after one last listing, and prints a JSON summary.

A turn scope counts only while it holds a process (GetUnitProcesses): a scope started
around a PID that had died is active but empty, runs nothing, and must not count against
the cap; the summary lists such scopes under "empty_seen" with how long each was seen.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from pystemd.dbuslib import DBus, apply_signature

DEST = b"org.freedesktop.systemd1"
PATH = b"/org/freedesktop/systemd1"
IFACE = b"org.freedesktop.systemd1.Manager"
PATTERN = re.compile(r"volute-(turn|test)-(.+)-([0-9]+)\.scope")


class Samples(TypedDict):
    """The JSON summary the sampler writes (and gate.Sampler.stop() reads back)."""

    samples: int
    gaps: int  # listings systemd did not answer (e.g. while it re-executed)
    max_turns: int
    max_tests: int
    max_per_mind: dict[str, int]
    worst: list[str]  # the scopes live when max_turns was seen
    seen: list[str]
    empty_seen: dict[str, list[float]]  # name -> [first seen, last seen]
    timeline: Sequence[Sequence[float]]  # (time, turns, tests) at each change


def holds_process(bus: DBus, name: bytes) -> bool:
    try:
        rows = bus.call_method(
            DEST, PATH, IFACE, b"GetUnitProcesses", apply_signature(b"s", [name])
        ).body
    except Exception:  # noqa: BLE001 - it ended between the two calls
        return False
    return bool(rows)


# ListUnitsByPatterns' arguments: the live states, and the scopes of turns and test runs.
LIVE_SCOPES = (
    [b"active", b"activating", b"deactivating"],
    [b"volute-turn-*.scope", b"volute-test-*.scope"],
)


@dataclass
class Sample:
    """One listing: the turn scopes that hold a process (per mind), the test scopes, and
    the names of both."""

    turns: int = 0
    tests: int = 0
    per_mind: dict[str, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)


@dataclass
class Summary:
    """What the samples add up to: the JSON the sampler prints at its end."""

    samples: int = 0
    gaps: int = 0  # listings systemd did not answer (e.g. while it re-executed)
    max_turns: int = 0
    max_tests: int = 0
    max_per_mind: dict[str, int] = field(default_factory=dict)
    worst: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    empty_seen: dict[str, list[float]] = field(default_factory=dict)  # [first, last seen]
    timeline: list[tuple[float, int, int]] = field(default_factory=list)

    def add(self, sample: Sample) -> None:
        self.samples += 1
        if sample.turns > self.max_turns:
            self.max_turns = sample.turns
            self.worst = sample.names
        self.max_tests = max(self.max_tests, sample.tests)
        for mind, n in sample.per_mind.items():
            self.max_per_mind[mind] = max(self.max_per_mind.get(mind, 0), n)
        if not self.timeline or self.timeline[-1][1:] != (sample.turns, sample.tests):
            self.timeline.append((time.time(), sample.turns, sample.tests))

    def as_json(self) -> Samples:
        return {
            "samples": self.samples,
            "gaps": self.gaps,
            "max_turns": self.max_turns,
            "max_tests": self.max_tests,
            "max_per_mind": self.max_per_mind,
            "worst": self.worst,
            "seen": sorted(self.seen),
            "empty_seen": self.empty_seen,
            "timeline": self.timeline,
        }


def read_sample(bus: DBus, rows: list[Any], summary: Summary) -> Sample:
    """Count one listing's scopes; note every name in `summary.seen`, and each turn scope
    that holds no process in `summary.empty_seen` (it does not count)."""
    sample = Sample()
    for row in rows:
        name = row[0].decode()
        match = PATTERN.fullmatch(name)
        if not match:
            continue
        sample.names.append(name)
        summary.seen.add(name)
        if match.group(1) == "test":
            sample.tests += 1
            continue
        if not holds_process(bus, row[0]):
            now = time.time()
            summary.empty_seen.setdefault(name, [now, now])[1] = now
            continue
        sample.turns += 1
        mind = match.group(2)
        sample.per_mind[mind] = sample.per_mind.get(mind, 0) + 1
    return sample


def main() -> None:
    stop_file = sys.argv[1]
    out_file = sys.argv[2]
    interval = float(sys.argv[3]) if len(sys.argv) > 3 else 0.002
    bus = DBus()
    bus.open()
    args = apply_signature(b"asas", list(LIVE_SCOPES))
    summary = Summary()
    # The stop file is read before each listing, so the last listing comes after it
    # appeared: whatever the test saw before it stopped the sampler is in the timeline,
    # even if this process was not scheduled for a while (a loaded host). A last listing
    # systemd does not answer is asked again, a few times.
    last_tries = 50
    while last_tries:
        stopping = os.path.exists(stop_file)
        try:
            rows = bus.call_method(DEST, PATH, IFACE, b"ListUnitsByPatterns", args).body
        except Exception:  # noqa: BLE001 - systemd re-executing: no answer, ask again
            summary.gaps += 1
            last_tries -= stopping
            time.sleep(interval)
            continue
        summary.add(read_sample(bus, rows, summary))
        if stopping:
            break
        time.sleep(interval)
    with open(out_file, "w") as handle:
        json.dump(summary.as_json(), handle)


if __name__ == "__main__":
    main()
