"""The gate's durable commits (its fsyncs) while a fan-out's clients deliver one after
another: the deliveries' own commits acknowledged at once (each with its fsync: the
path before 89db72f, the baseline) against acknowledged after the pass's durable
commit (its starts', or its sync before the gate sleeps), in the same run.

No systemd is needed: the unit tests' harness (tests/unit/gate_harness.py) runs the real
gate loop on a real SQLite file, with a fake systemd and the launcher's order loop in a
thread. Each client delivers to its own mind (`sleep 3`) 27 ms after the last, as 33
`volutectl deliver` processes arrived in bench_fanout_start.py's fan-outs; counted until
the last is acknowledged: the durable commits (the store's `_synced`), by where they
came from, and the gate's passes.

    .venv/bin/python bench/bench_pass_fsyncs.py [--minds 33] [--gap 0.027] [--runs 3]

Gates: a static cap of 16 (adaptive off), where each client's pass starts its mind's
turn, and the default (the adaptive limit), whose starts mostly come in passes of
their own as a reading grows the limit.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.unit.gate_harness import Harness
from volutectl.errors import VoluteError
from volutectl.store.queue import Store
from volutectl.store.rows import NewDelivery

GATES: dict[str, dict[str, Any]] = {
    "cap16": {"global_concurrent_turns": 16, "adaptive": {"enabled": False}},
    "default": {},
}
PATHS = ("old", "new")


@contextmanager
def old_path() -> Iterator[None]:
    """The deliveries' commits synced each, as before: a commit that leaves nothing to
    sync holds no reply back, so each is acknowledged as it commits."""
    add = Store.add_deliveries

    def synced(
        self: Store,
        items: Iterable[NewDelivery],
        now: float | None = None,
        *,
        refuse: Callable[[NewDelivery], VoluteError | None] | None = None,
        durable: bool = True,
    ) -> list[int | VoluteError]:
        return add(self, items, now, refuse=refuse, durable=True)

    Store.add_deliveries = synced  # type: ignore[method-assign]
    try:
        yield
    finally:
        Store.add_deliveries = add  # type: ignore[method-assign]


def fan_out(gate: str, minds: int, gap: float) -> dict[str, Any]:
    """One fan-out on a new gate: its durable commits by caller, and its passes."""
    names = [f"m{i:02d}" for i in range(minds)]
    with tempfile.TemporaryDirectory() as work:
        harness = Harness(Path(work), minds=dict.fromkeys(names, "sleep 3"), limits=GATES[gate])
        try:
            store = harness.gate.state.store
            synced, by = store._synced, collections.Counter[str]()

            def counted(seconds: float) -> None:
                by[_committer()] += 1
                synced(seconds)

            store._synced = counted  # type: ignore[method-assign]
            steps = harness.steps
            peers = [harness.connect() for _ in names]
            for n, (peer, name) in enumerate(zip(peers, names, strict=True)):
                request = {"v": 1, "op": "deliver", "mind": name, "message": "x"}
                peer.send(json.dumps({**request, "request_id": f"r{n}"}).encode() + b"\n")
                until = time.monotonic() + gap
                while time.monotonic() < until:
                    harness.step(0.005)
            harness.pump(lambda: all(peer.has_line() for peer in peers))
            return {"syncs": sum(by.values()), "by": dict(by), "passes": harness.steps - steps}
        finally:
            harness.close()


# The store's methods whose commit this was, innermost first, and what the table calls it.
COMMITTERS = {
    "add_deliveries": "deliveries",
    "start_turns": "starts",
    "fold_into": "folds",
    "sync": "syncs",
}


def _committer() -> str:
    names = {frame.name for frame in traceback.extract_stack()}
    return next((label for name, label in COMMITTERS.items() if name in names), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minds", type=int, default=33)
    parser.add_argument("--gap", type=float, default=0.027, help="seconds between clients")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.runs):
        for gate in GATES:
            for path in PATHS:  # alternated, so that drift on the machine falls on both
                if path == "old":
                    with old_path():
                        run = fan_out(gate, args.minds, args.gap)
                else:
                    run = fan_out(gate, args.minds, args.gap)
                results.setdefault((gate, path), []).append(run)
    print(f"\n{args.minds} clients, {args.gap * 1000:.0f} ms apart; medians of {args.runs}")
    print("| gate | path | durable commits [runs] | by caller (last run) | passes |")
    print("|---|---|---|---|---|")
    for (gate, path), runs in results.items():
        syncs = [run["syncs"] for run in runs]
        passes = statistics.median(run["passes"] for run in runs)
        by = ", ".join(f"{name} {count}" for name, count in sorted(runs[-1]["by"].items()))
        label = "acked at once, each synced" if path == "old" else "acked after the pass's sync"
        print(f"| {gate} | {label} | {statistics.median(syncs):g} {syncs} | {by} | {passes:g} |")


if __name__ == "__main__":
    main()
