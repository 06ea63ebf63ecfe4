"""Runs INSIDE the test container: samples the live turn scopes from systemd over D-Bus.

    python -m volute_testbed.scope_sampler STOP_FILE OUT_FILE [INTERVAL]   (gate.Sampler)

Independent of the gate (it speaks to systemd directly), so the caps it observes are
systemd's truth, not the gate's bookkeeping. Every ~2 ms it lists the live
volute-turn-*.scope units and records the count and the per-mind count; it stops when
the stop file appears and prints a JSON summary.

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
from typing import TypedDict

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


def main() -> None:
    stop_file = sys.argv[1]
    out_file = sys.argv[2]
    interval = float(sys.argv[3]) if len(sys.argv) > 3 else 0.002
    bus = DBus()
    bus.open()
    args = apply_signature(
        b"asas",
        [
            [b"active", b"activating", b"deactivating"],
            [b"volute-turn-*.scope", b"volute-test-*.scope"],
        ],
    )
    samples = 0
    gaps = 0  # listings systemd did not answer (e.g. while it re-executed)
    empty_seen: dict[str, list[float]] = {}  # name -> [first seen, last seen]
    max_turns = 0
    max_tests = 0
    max_per_mind: dict[str, int] = {}
    worst: list[str] = []
    seen: set[str] = set()
    timeline: list[tuple[float, int, int]] = []
    while not os.path.exists(stop_file):
        try:
            rows = bus.call_method(DEST, PATH, IFACE, b"ListUnitsByPatterns", args).body
        except Exception:  # noqa: BLE001 - systemd re-executing: no answer, ask again
            gaps += 1
            time.sleep(interval)
            continue
        turns: dict[str, int] = {}
        count = tests = 0
        names = []
        for row in rows:
            name = row[0].decode()
            match = PATTERN.fullmatch(name)
            if not match:
                continue
            names.append(name)
            seen.add(name)
            if match.group(1) == "test":
                tests += 1
                continue
            if not holds_process(bus, row[0]):
                now = time.time()
                empty_seen.setdefault(name, [now, now])[1] = now
                continue
            count += 1
            turns[match.group(2)] = turns.get(match.group(2), 0) + 1
        samples += 1
        if count > max_turns:
            max_turns = count
            worst = names
        max_tests = max(max_tests, tests)
        for mind, n in turns.items():
            max_per_mind[mind] = max(max_per_mind.get(mind, 0), n)
        if not timeline or timeline[-1][1:] != (count, tests):
            timeline.append((time.time(), count, tests))
        time.sleep(interval)
    summary: Samples = {
        "samples": samples,
        "gaps": gaps,
        "max_turns": max_turns,
        "max_tests": max_tests,
        "max_per_mind": max_per_mind,
        "worst": worst,
        "seen": sorted(seen),
        "empty_seen": empty_seen,
        "timeline": timeline,
    }
    with open(out_file, "w") as handle:
        json.dump(summary, handle)


if __name__ == "__main__":
    main()
