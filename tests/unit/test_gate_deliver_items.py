"""A deliver with items (docs/protocol.md, "deliver with items"): each item is checked as
a deliver of one is, with its own result. One the gate refuses for what it is refuses
the batch (nothing stored); its sender's quota counts item by item; what is stored is
durably stored before the one reply, as a deliver of one is."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.unit.gate_harness import Harness, connect_as
from volutectl import events
from volutectl.errors import EX_DATAERR, EX_NOUSER, EX_TEMPFAIL
from volutectl.states import QueueState
from volutectl.wire import protocol

MEMBER = 65534
NOT_DONE = [QueueState.PENDING, QueueState.RUNNING, QueueState.DEAD]


def many(*items: dict[str, Any]) -> dict[str, Any]:
    return {"op": "deliver", "items": list(items)}


def rows_on_disk(harness: Harness) -> list[tuple[int, str, str, bytes]]:
    """The queue's rows as another connection to its file reads them: committed only."""
    [(_, _, path)] = harness.gate.state.store.db.execute("PRAGMA database_list").fetchall()
    with sqlite3.connect(path) as other:
        rows = other.execute("SELECT id, mind, session, message FROM deliveries ORDER BY id")
        return [(i, mind, session, bytes(message)) for i, mind, session, message in rows]


@pytest.fixture
def harness(tmp_path: Path) -> Any:
    opened = Harness(tmp_path, max_message_bytes=100, minds={"mimsy": "true", "nap": "true"})
    assert opened.connect().request({"op": "pause"})["ok"] is True  # nothing runs
    yield opened
    opened.close()


def test_each_item_has_its_own_result_and_a_bad_one_refuses_the_batch(harness: Harness) -> None:
    items = [
        {"mind": "mimsy", "message": "one"},
        {"mind": "nosuch", "message": "two"},
        {"mind": "nap", "session": "chat", "message": "three"},
        {"mind": "mimsy", "message": "x" * 101},
    ]
    reply = harness.connect().request(many(*items))
    assert reply["ok"] is True
    first, unknown, third, too_long = reply["results"]
    assert (unknown["ok"], unknown["code"]) == (False, EX_NOUSER)
    assert unknown["error"] == "unknown mind 'nosuch'" and "id" not in unknown
    assert (too_long["ok"], too_long["code"]) == (False, EX_DATAERR)
    assert too_long["error"].startswith("message: the message for mimsy is 101 bytes")
    # The good ones name the first bad one, with its code: nothing of the batch is stored.
    whole = "item 2 of the batch was refused, and a batch is queued whole or not at all"
    for good in (first, third):
        assert (good["ok"], good["code"], good["error"]) == (False, EX_NOUSER, whole)
        assert "id" not in good
    assert rows_on_disk(harness) == []
    assert harness.journal.of(events.DeliveryQueued) == []
    # Without the bad ones, the same batch is queued, each item with its own id.
    reply = harness.connect().request(many(items[0], items[2]))
    one, three = reply["results"]
    assert one["ok"] is True and three["ok"] is True and three["id"] > one["id"]
    assert rows_on_disk(harness) == [
        (one["id"], "mimsy", "main", b"one"),
        (three["id"], "nap", "chat", b"three"),
    ]
    queued = harness.journal.of(events.DeliveryQueued)
    assert [event.delivery_id for event in queued] == [one["id"], three["id"]]


def test_items_share_the_pass_commit_with_deliveries_of_one_in_order(harness: Harness) -> None:
    peer = harness.connect()
    one = {"op": "deliver", "mind": "mimsy", "message": "alone"}
    peer.send(
        b"".join(protocol.encode(m) for m in (one, many({"mind": "nap", "message": "a"}), one))
    )
    replies = [peer.reply() for _ in range(3)]
    ids = [replies[0]["id"], replies[1]["results"][0]["id"], replies[2]["id"]]
    assert ids == sorted(ids) and len(set(ids)) == 3
    assert [row[0] for row in rows_on_disk(harness)] == ids


def test_quotas_count_item_by_item(tmp_path: Path) -> None:
    harness = Harness(tmp_path, max_pending_per_uid=3, minds={"nap": "true"})
    try:
        assert harness.connect().request({"op": "pause"})["ok"] is True
        member = connect_as(harness, MEMBER)
        reply = member.request(many(*[{"mind": "nap", "message": str(n)} for n in range(5)]))
        codes = [result.get("code") for result in reply["results"]]
        assert codes == [None, None, None, EX_TEMPFAIL, EX_TEMPFAIL]
        refused = reply["results"][3]
        assert "uid 65534 has 3 deliveries not yet done" in refused["error"]
        assert "nothing was queued" in refused["hint"]
        assert [row[3] for row in rows_on_disk(harness)] == [b"0", b"1", b"2"]
        [warned] = harness.journal.of(events.DeliveriesRefused)  # once, not per item
        assert warned.uid == MEMBER
    finally:
        harness.close()


def test_items_acknowledged_survive_the_gates_death_and_are_not_queued_twice(
    harness: Harness,
) -> None:
    """The ack comes after the commit: a gate that dies right after it has every item,
    and a client that sends the request again (it never saw the reply) gets each item's
    id back, already queued."""
    items = [{"mind": "mimsy", "message": f"m{n}", "request_id": f"{n:032x}"} for n in range(3)]
    ids = [r["id"] for r in harness.connect().request(many(*items))["results"]]
    harness.crash()
    harness.restart()
    assert [row[0] for row in rows_on_disk(harness)] == ids
    again = harness.connect().request(many(*items, {"mind": "mimsy", "message": "new"}))
    assert [r["id"] for r in again["results"][:3]] == ids
    assert all(r["already_queued"] is True for r in again["results"][:3])
    assert "already_queued" not in again["results"][3]
    assert len(rows_on_disk(harness)) == 4


def test_a_full_disk_refuses_every_item_and_stores_none(harness: Harness) -> None:
    first = harness.deliver_ok()
    store = harness.gate.state.store
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's view of a full disk
    items = [{"mind": "mimsy", "message": "y" * 90} for _ in range(200)]
    reply = harness.connect().request(many(*items))
    assert {(r["ok"], r["code"]) for r in reply["results"]} == {(False, EX_TEMPFAIL)}
    assert [row.id for row in store.list_rows(NOT_DONE)] == [first]


def test_the_ids_of_a_deliver_with_items_are_waited_for_as_any(tmp_path: Path) -> None:
    harness = Harness(tmp_path, minds={"mimsy": "true"})
    try:
        peer = harness.connect()
        reply = peer.request(many(*[{"mind": "mimsy", "message": str(n)} for n in range(2)]))
        ids = [result["id"] for result in reply["results"]]
        assert peer.request({"op": "wait", "ids": ids}) == {"v": 1, "ok": True, "ids": ids}
        told: list[dict[str, Any]] = []

        def both_told() -> bool:
            while peer.has_line():
                told.append(peer.reply())
            return len(told) == 2

        harness.pump(both_told)
        assert sorted(event["id"] for event in told) == ids
        assert {event["event"] for event in told} == {"turn_ended"}
    finally:
        harness.close()
