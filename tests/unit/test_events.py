"""volutectl/events.py: the catalog of events, how the journal sends one, and the Latch."""

from __future__ import annotations

from tests.unit.test_journal import as_dict
from volutectl import events
from volutectl.events import MESSAGE_IDS, EventName, Latch
from volutectl.states import Outcome
from volutectl.systemd.journal import Journal, entry_fields


def test_an_event_is_one_entry_its_fields_in_order_then_its_event_and_message_id() -> None:
    sent: list[tuple[bytes, ...]] = []
    journal = Journal("volute-gate")
    journal.sender = lambda *items: sent.append(items)
    ended = events.TurnEnded(
        mind="m",
        session="s",
        unit="u.scope",
        turn_id=4,
        outcome=Outcome.TIMEOUT,
        exit_status=None,
        detail="timed out",
    )
    journal.emit(ended)
    [items] = sent
    assert [item.split(b"=", 1)[0].decode() for item in items] == [
        "MESSAGE",
        "PRIORITY",
        "SYSLOG_IDENTIFIER",
        "MESSAGE_ID",
        "VOLUTE_MIND",
        "VOLUTE_SESSION",
        "VOLUTE_UNIT",
        "VOLUTE_TURN_ID",
        "VOLUTE_OUTCOME",
        "VOLUTE_EVENT",
    ]
    fields = as_dict(list(items))
    assert fields["MESSAGE"] == "turn 4 of m/s ended: timed out"
    assert fields["PRIORITY"] == "4"  # a failed outcome is a warning
    assert fields["MESSAGE_ID"] == MESSAGE_IDS[EventName.END]
    assert (fields["VOLUTE_OUTCOME"], fields["VOLUTE_EVENT"]) == ("timeout", "end")


def test_every_event_of_the_catalog_names_fields_the_journal_can_send() -> None:
    kinds = events.catalog()
    assert len(kinds) == len(set(kinds)) >= 40
    for kind in kinds:
        names = kind.sent_field_names()
        assert len(names) == len(set(names)), kind
        entry_fields("g", kind.LEVEL, kind.__name__, dict.fromkeys(names, "x"))  # no ValueError
        assert kind.message_id() == (MESSAGE_IDS.get(kind.EVENT) if kind.EVENT else None)
        # Its own docstring, not the signature @dataclass writes for a class with none.
        doc = kind.__doc__ or ""
        assert doc.strip() and not doc.startswith(f"{kind.__name__}("), kind


def test_the_latch_says_a_failure_once_and_its_recovery_once() -> None:
    said: list[events.BaseEvent] = []
    latch = Latch(said.append, retry_seconds=5.0)
    latch.works(events.AdmissionWorks())  # nothing was failing: nothing to say
    failing = events.AdmissionFailing(error="no systemd", retry_seconds=5.0)
    assert latch.failed(failing, 100.0) == 105.0
    assert latch.failed(failing, 105.0) == 110.0  # tried again at the deadline, not said
    latch.works(events.AdmissionWorks())
    latch.works(events.AdmissionWorks())
    assert said == [failing, events.AdmissionWorks()]
    assert latch.failed(failing, 200.0) == 205.0 and said[-1] is failing  # a new episode
