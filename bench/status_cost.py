"""What the live status costs the gate's loop, on a big queue database.

- `dead_counts`: the STATUS= line's one store query, run on every admission pass;
- `status_line`: formatting that line (sent only when it changes);
- `last_turns`: `volutectl status`'s per-mind last-turn lookup, the one status query that
  grows with the history (schema 5 indexes turns(mind, ended_at) for it);
- `pending`: the admission pass's own read of the pending rows, for scale.

Baseline: the last-turn query as it was before schema 5, one GROUP BY over every turn.
The database is built in a temporary directory with N ended turns and N done deliveries
over 30 minds, plus 200 dead and 30 pending. Run: .venv/bin/python bench/status_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from volutectl.core import admission
from volutectl.gate.status import status_line
from volutectl.states import HoldReason
from volutectl.store.queue import Store

MINDS = [f"m{i}" for i in range(30)]
# The query before schema 5, run last, once the index is dropped.
BEFORE = (
    "SELECT mind, id, outcome, MAX(ended_at) FROM turns WHERE ended_at IS NOT NULL GROUP BY mind"
)


def fill(store: Store, history: int) -> None:
    now = time.time()
    with store.db:
        store.db.executemany(
            "INSERT INTO turns (mind, session, state, started_at, ended_at, outcome) "
            "VALUES (?, 's', 'ended', ?, ?, 'ok')",
            ((MINDS[i % 30], now - i, now - i + 1) for i in range(history)),
        )
        states = ["done"] * history + ["dead"] * 200 + ["pending"] * 30
        store.db.executemany(
            "INSERT INTO deliveries (mind, session, message, state, created_at) "
            "VALUES (?, 's', x'00', ?, 0)",
            ((MINDS[i % 30], state) for i, state in enumerate(states)),
        )


def median_ms(call: Callable[[], object], runs: int) -> float:
    call()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", type=int, default=100_000, help="ended turns and done rows")
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "queue.sqlite3")
        fill(store, args.history)
        holds = [admission.Hold(i, HoldReason.GLOBAL_CAP) for i in range(28)]
        figures = {
            "dead_counts (every admission pass)": lambda: store.minds.dead_counts(),
            "status_line (format)": lambda: status_line(
                turns=2,
                cap=2,
                test_runs=0,
                holds=holds,
                backing_off=0,
                dead=200,
                paused=frozenset({"m1"}),
            ),  # fmt: skip
            "last_turns, 30 minds (status op)": lambda: store.minds.last_turns(MINDS),
            "pending() (every admission pass, for scale)": lambda: store.pending(),
        }
        print(f"{args.history} ended turns and done rows, 30 minds; median of {args.runs}")
        for label, call in figures.items():
            print(f"  {label:<45} {median_ms(call, args.runs):8.3f} ms")
        store.db.execute("DROP INDEX turns_mind_ended")
        before = median_ms(lambda: store.db.execute(BEFORE).fetchall(), args.runs)
        print(f"  {'baseline: the GROUP BY before schema 5':<45} {before:8.3f} ms")
        store.close()


if __name__ == "__main__":
    main()
