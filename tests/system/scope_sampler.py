"""Runs INSIDE the test container: samples the live turn scopes from systemd over D-Bus.

Independent of the gate (it speaks to systemd directly), so the caps it observes are
systemd's truth, not the gate's bookkeeping. Every ~2 ms it lists the live
volute-turn-*.scope units and records the count and the per-mind count; it stops when
the stop file appears and prints a JSON summary.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

from pystemd.dbuslib import DBus, apply_signature

DEST = b"org.freedesktop.systemd1"
PATH = b"/org/freedesktop/systemd1"
IFACE = b"org.freedesktop.systemd1.Manager"
PATTERN = re.compile(r"volute-(turn|test)-(.+)-([0-9]+)\.scope")


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
    max_turns = 0
    max_tests = 0
    max_per_mind: dict[str, int] = {}
    worst: list[str] = []
    seen: set[str] = set()
    timeline: list[tuple[float, int, int]] = []
    while not os.path.exists(stop_file):
        rows = bus.call_method(DEST, PATH, IFACE, b"ListUnitsByPatterns", args).body
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
    with open(out_file, "w") as handle:
        json.dump(
            {
                "samples": samples,
                "max_turns": max_turns,
                "max_tests": max_tests,
                "max_per_mind": max_per_mind,
                "worst": worst,
                "seen": sorted(seen),
                "timeline": timeline,
            },
            handle,
        )


if __name__ == "__main__":
    main()
