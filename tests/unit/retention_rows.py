"""A queue with something of everything retention must tell apart, made through the
Store's own calls at chosen times: what must go, what must stay.

With a retention of KEEP_DAYS, relative to `now`:
- go: done and dropped deliveries that finished OLD days ago, their turns, and an old
  ended turn that never carried a delivery (its delivery went back to the queue);
- stay: dead deliveries however old, and their turns; a pending delivery created long
  ago (backing off for a day, so no gate starts it); with `running`, a delivery in a
  turn that started long ago and is still open; a delivery done a day ago, and its turn.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from volutectl.core.admission import AfterFailure
from volutectl.states import Outcome, QueueState
from volutectl.store.queue import NewDelivery, Store

DAY = 86400.0
KEEP_DAYS = 7.0
OLD = 30 * DAY
RECENT = 1 * DAY


@dataclass
class Seeded:
    gone: set[int] = field(default_factory=set)  # deliveries retention deletes
    kept: set[int] = field(default_factory=set)
    gone_turns: set[int] = field(default_factory=set)
    kept_turns: set[int] = field(default_factory=set)


def unit_for(turn_id: int) -> str:
    return f"volute-turn-m-{turn_id}.scope"


def add(store: Store, when: float, mind: str = "m", size: int = 40, tag: str = "x") -> int:
    message = (tag * size)[:size].encode()
    [delivery_id] = store.add_deliveries([NewDelivery(mind, f"s{tag}", message)], now=when)
    assert isinstance(delivery_id, int)
    return delivery_id


def run_turn(
    store: Store,
    ids: list[int],
    when: float,
    *,
    outcome: Outcome = Outcome.OK,
    failed: dict[int, AfterFailure] | None = None,
    returned: list[int] | None = None,
) -> int:
    turn_id, _ = store.start_turn("m", "s", unit_for, ids, when)
    done = [] if failed or returned else ids
    store.settle_turn(
        turn_id, outcome=outcome, exit_status=0 if outcome is Outcome.OK else 1, detail="",
        done=done, returned=returned or [], failed=failed or {}, error="turn failed",
        now=when + 1,
    )  # fmt: skip
    return turn_id


def seed(
    store: Store, now: float, *, old_done: int = 3, size: int = 40, running: bool = True
) -> Seeded:
    seeded = Seeded()
    old, recent = now - OLD, now - RECENT
    for index in range(old_done):
        delivery_id = add(store, old, size=size, tag=f"d{index}")
        seeded.gone.add(delivery_id)
        seeded.gone_turns.add(run_turn(store, [delivery_id], old))
    dropped = add(store, old)
    assert store.drop([dropped], old + 1) == [dropped]
    seeded.gone.add(dropped)
    returned = add(store, old, tag="r")  # its turn never ran; it ran later, a day ago
    seeded.gone_turns.add(run_turn(store, [returned], old, returned=[returned]))
    seeded.kept_turns.add(run_turn(store, [returned], recent))
    seeded.kept.add(returned)
    dead = add(store, old, tag="dead")
    dead_after = {dead: AfterFailure(QueueState.DEAD, 10, None)}
    seeded.kept_turns.add(run_turn(store, [dead], old, outcome=Outcome.FAILED, failed=dead_after))
    seeded.kept.add(dead)
    waiting = add(store, old, tag="wait")  # failed long ago, backing off until tomorrow
    backoff = {waiting: AfterFailure(QueueState.PENDING, 1, now + DAY)}
    seeded.gone_turns.add(run_turn(store, [waiting], old, outcome=Outcome.FAILED, failed=backoff))
    seeded.kept.add(waiting)
    if running:
        busy = add(store, old, tag="run")
        turn_id, _ = store.start_turn("m", "srun", unit_for, [busy], old)
        seeded.kept.add(busy)
        seeded.kept_turns.add(turn_id)
    return seeded


def snapshot(path: Path) -> dict[str, dict[int, tuple[object, ...]]]:
    """Every row of both tables, by id, read with a connection of its own."""
    db = sqlite3.connect(path)
    try:
        return {
            table: {row[0]: tuple(row) for row in db.execute(f"SELECT * FROM {table}")}
            for table in ("deliveries", "turns")
        }
    finally:
        db.close()
