"""volutectl/systemd/journal.py: the fields of the gate's entries, and the turns' output streams.

The fields are pure (`entry_fields`); libsystemd frames them, which the system tier
proves against a real journald (tests/system/test_logs.py). A turn's stream is proved
here against a stand-in for journald's stdout socket, with the real gate in-process:
who connects (the turn's own process, once released), what header it sends, and where
the output goes when there is no journald or it refuses.
"""

from __future__ import annotations

import ast
import os
import re
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_gate import remove_tree, short_socket_dir
from tests.unit.gate_harness import Harness, settled
from volutectl import events
from volutectl.events import MESSAGE_IDS, EventName
from volutectl.states import QueueState
from volutectl.systemd import journal
from volutectl.systemd.journal import Journal, TurnStream, entry_fields


def as_dict(items: list[bytes]) -> dict[str, str]:
    pairs = [item.decode().split("=", 1) for item in items]
    assert len({name for name, _ in pairs}) == len(pairs), "a field twice"
    return dict(pairs)


# -- the fields of one entry -----------------------------------------------------------------


def test_an_entry_carries_message_priority_identifier_and_volute_fields() -> None:
    fields = entry_fields(
        "volute-gate", "warning", "turn 4 of m/s ended", {"turn_id": 4, "mind": "m", "x": None}
    )
    assert as_dict(fields) == {
        "MESSAGE": "turn 4 of m/s ended",
        "PRIORITY": "4",
        "SYSLOG_IDENTIFIER": "volute-gate",
        "VOLUTE_TURN_ID": "4",
        "VOLUTE_MIND": "m",
    }


def test_a_multi_line_message_stays_one_field_with_its_newlines() -> None:
    text = "first line\nMESSAGE_ID=forged\n\nVOLUTE_MIND=other"
    fields = entry_fields("volute-gate", "error", text, {"error": "a\nb"})
    # Whole: no line of it can become a field of its own (libsystemd frames it by length).
    assert fields[0] == b"MESSAGE=" + text.encode()
    assert as_dict(fields)["VOLUTE_ERROR"] == "a\nb"
    assert "MESSAGE_ID" not in as_dict(fields)


def test_journal_log_sends_one_entry_per_call_multi_line_or_not() -> None:
    sent: list[tuple[bytes, ...]] = []
    log = Journal("volute-gate")
    log.sender = lambda *items: sent.append(items)
    log.log("info", "one\ntwo\nthree", event=EventName.START, turn_id=7)
    assert len(sent) == 1
    assert as_dict(list(sent[0]))["MESSAGE"] == "one\ntwo\nthree"
    assert as_dict(list(sent[0]))["MESSAGE_ID"] == MESSAGE_IDS[EventName.START]


# The ids of the first five: fixed, as scripts match on them.
FIRST_MESSAGE_IDS = {
    EventName.HOLD: "f026259c51dd4587b509f49f1bf70ad4",
    EventName.START: "7d39eb6579df482f9c349ceadc5a7dab",
    EventName.END: "3fa69a5f83114162ae608c873d89156c",
    EventName.TIMEOUT: "98f69cfd2dde4ff081cf73a80c7cbaa7",
    EventName.DEAD: "69b9ac8362694fa49b471479c58a75bf",
}


@pytest.mark.parametrize("event", list(EventName))
def test_the_events_an_operator_queries_carry_their_message_id(event: EventName) -> None:
    fields = as_dict(entry_fields("volute-gate", "info", "x", {"event": event}))
    assert fields["VOLUTE_EVENT"] == event.value
    wanted = set(EventName) - {EventName.HOLD_END, EventName.ADOPT, EventName.EMPTY_SCOPE}
    assert ("MESSAGE_ID" in fields) == (event in wanted)
    if event in wanted:
        assert fields["MESSAGE_ID"] == MESSAGE_IDS[event]
        # A plain string names the same event (fields read back from elsewhere).
        assert as_dict(entry_fields("g", "info", "x", {"event": event.value})) == fields | {
            "SYSLOG_IDENTIFIER": "g"
        }


def test_message_ids_are_distinct_128_bit_ids() -> None:
    ids = list(MESSAGE_IDS.values())
    assert len(set(ids)) == len(ids) == len(EventName) - 3
    assert {event: MESSAGE_IDS[event] for event in FIRST_MESSAGE_IDS} == FIRST_MESSAGE_IDS
    assert all(re.fullmatch(r"[0-9a-f]{32}", value) for value in ids)


def test_a_nul_cannot_cut_a_value_and_a_bad_key_cannot_name_a_field() -> None:
    fields = as_dict(entry_fields("g", "info", "a\0b", {"path": "x\0y"}))
    assert fields["MESSAGE"] == "a\ufffdb" and fields["VOLUTE_PATH"] == "x\ufffdy"
    with pytest.raises(ValueError, match="cannot name a journal field"):
        entry_fields("g", "info", "m", {"not-a-name": 1})


def test_text_that_is_not_utf8_encodable_is_escaped_not_refused() -> None:
    fields = entry_fields("g", "info", "bad \udcff byte", {})
    assert fields[0] == b"MESSAGE=bad \\udcff byte"


# -- is our stderr the journal? -----------------------------------------------------------------


def test_stderr_is_the_journal_only_when_journal_stream_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{found.st_dev}:{found.st_ino}")
    assert journal.stderr_is_journal()
    for value in (f"{found.st_dev}:{found.st_ino + 1}", "junk", ":", ""):
        monkeypatch.setenv("JOURNAL_STREAM", value)
        assert not journal.stderr_is_journal()
    # Inherited from a service, with stderr since pointed elsewhere: entries and turns'
    # output then go where stderr goes, like the rest of our output.
    log = Journal("volute-gate")
    assert (log.sender, log.stdout_socket, log.turn_stream("m", "u.scope")) == (None, None, None)


def test_under_the_journal_turns_get_journalds_stdout_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{found.st_dev}:{found.st_ino}")
    monkeypatch.setattr(journal, "JOURNAL_SOCKET", "/nonexistent/socket")
    log = Journal("volute-gate")
    assert log.sender is None  # no journald to send entries to: stderr
    stream = log.turn_stream("mimsy", "volute-turn-mimsy-3.scope")
    assert stream == TurnStream(journal.STDOUT_SOCKET, "volute-mimsy", "volute-turn-mimsy-3.scope")


# -- a turn's stream -----------------------------------------------------------------------


class FakeJournald:
    """journald's stdout socket, as far as a connecting turn can tell."""

    def __init__(self) -> None:
        self.directory = short_socket_dir()
        self.path = str(self.directory / "stdout")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.streams: list[tuple[socket.socket, int]] = []  # (connection, peer pid)

    def accept(self) -> int:
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return len(self.streams)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            self.streams.append((conn, struct.unpack("3i", creds)[0]))

    def read(self, index: int) -> bytes:
        """Everything the stream's writers sent, until they all closed it."""
        conn = self.streams[index][0]
        conn.settimeout(10)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        return data

    def close(self) -> None:
        for conn, _ in self.streams:
            conn.close()
        self.listener.close()
        remove_tree(self.directory)


@pytest.fixture
def journald() -> Iterator[FakeJournald]:
    fake = FakeJournald()
    yield fake
    fake.close()


def gate(tmp_path: Path, harnesses: list[Harness], stdout: str | None, **options: Any) -> Harness:
    harness = Harness(tmp_path, **options)
    harness.journal.stdout_socket = stdout
    harnesses.append(harness)
    return harness


def test_a_turns_output_is_one_stream_opened_by_the_turn_itself_in_its_scope(
    tmp_path: Path,
    harnesses: list[Harness],
    journald: FakeJournald,
    capfd: pytest.CaptureFixture[str],
) -> None:
    harness = gate(tmp_path, harnesses, journald.path,
                   minds={"m-1.x": "echo to-stdout; echo to-stderr >&2; sleep 0.2"})  # fmt: skip
    harness.deliver_ok(mind="m-1.x")
    harness.pump(lambda: journald.accept() == 1)
    [turn] = harness.gate.state.turns.all()
    assert turn.pid is not None and list(harness.manager.scopes) == [turn.unit]
    # The peer is the scope's main process (the gate's child after its release).
    assert journald.streams[0][1] == turn.pid != os.getpid()
    unit = turn.unit
    harness.pump(lambda: settled(harness))
    assert unit == r"volute-turn-m\x2d1.x-1.scope"
    header = f"volute-m-1.x\n{unit}\n6\n0\n0\n0\n0\n".encode()
    assert journald.read(0) == header + b"to-stdout\nto-stderr\n"
    out, err = capfd.readouterr()
    assert "to-std" not in out + err


def test_a_child_never_released_opens_no_stream(
    tmp_path: Path, harnesses: list[Harness], journald: FakeJournald
) -> None:
    harness = gate(tmp_path, harnesses, journald.path, minds={"m": "echo hello"},
                   max_attempts=5, backoff_initial_seconds=0.05)  # fmt: skip
    harness.manager.failing.add("start_scope")
    delivery = harness.deliver_ok(mind="m")
    harness.pump(lambda: harness.manager.calls.get("start_scope", 0) >= 2)
    assert journald.accept() == 0  # forked, never in a scope, never released: no stream
    harness.manager.failing.clear()
    harness.pump(lambda: settled(harness))
    assert harness.gate.state.store.row(delivery).state == "done"  # type: ignore[union-attr]
    assert journald.accept() == 1
    assert journald.read(0).endswith(b"\nhello\n")


def test_without_journalds_socket_a_turn_keeps_the_gates_output_and_says_nothing(
    tmp_path: Path, harnesses: list[Harness], capfd: pytest.CaptureFixture[str]
) -> None:
    harness = gate(tmp_path, harnesses, str(tmp_path / "no-journald"),
                   minds={"m": "echo to-stdout; echo to-stderr >&2"})  # fmt: skip
    harness.deliver_ok(mind="m")
    harness.pump(lambda: settled(harness))
    out, err = capfd.readouterr()
    assert "to-stdout" in out and "to-stderr" in err
    assert "journald" not in err


def test_when_journald_refuses_the_stream_the_gates_log_says_so_and_gets_the_output(
    tmp_path: Path, harnesses: list[Harness], capfd: pytest.CaptureFixture[str]
) -> None:
    directory = short_socket_dir()
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(directory / "stdout"))  # a socket file nobody listens on: refused
    try:
        harness = gate(tmp_path, harnesses, str(directory / "stdout"),
                       minds={"m": "echo to-stdout"})  # fmt: skip
        harness.deliver_ok(mind="m")
        harness.pump(lambda: settled(harness))
    finally:
        dead.close()
        remove_tree(directory)
    out, err = capfd.readouterr()
    assert "to-stdout" in out
    assert "volute-turn-m-1.scope: journald refused the turn's output stream" in err
    assert harness.gate.state.store.list_rows([QueueState.DONE])  # the turn ran all the same


def test_a_turns_stream_outlives_a_crash_of_the_gate(
    tmp_path: Path, harnesses: list[Harness], journald: FakeJournald
) -> None:
    flag = tmp_path / "crashed"
    command = f"echo before; while [ ! -e {flag} ]; do sleep 0.01; done; echo after"
    harness = gate(tmp_path, harnesses, journald.path, minds={"m": command})
    harness.deliver_ok(mind="m")
    harness.pump(lambda: journald.accept() == 1)
    harness.crash()  # the gate dies with the turn running
    flag.touch()
    harness.restart()  # a new gate adopts the turn and settles it
    harness.pump(lambda: settled(harness))
    assert journald.accept() == 1  # one stream, the turn's, from before and after the crash
    assert journald.read(0).endswith(b"\nbefore\nafter\n")


# -- the gate's entries -------------------------------------------------------------------


def test_the_gates_hold_start_end_timeout_and_dead_entries_carry_message_ids(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = gate(tmp_path, harnesses, None,
                   minds={"slow": "sleep 30", "quick": "true"},
                   limits={"global_concurrent_turns": 1, "adaptive": {"enabled": False}},
                   turns={"max_runtime_seconds": 0.3, "timeout_grace_seconds": 0.1},
                   max_attempts=1)  # fmt: skip
    harness.deliver_ok(mind="slow")
    harness.pump(lambda: bool(harness.manager.scopes))
    harness.deliver_ok(mind="quick")  # held behind the cap
    harness.pump(lambda: settled(harness), timeout=15)
    ids: dict[str, set[str]] = {}
    for level, message, fields in harness.journal.entries:
        sent = as_dict(entry_fields("volute-gate", level, message, fields))
        if "MESSAGE_ID" in sent:
            ids.setdefault(sent["VOLUTE_EVENT"], set()).add(sent["MESSAGE_ID"])
    assert ids == {event.value: {MESSAGE_IDS[event]} for event in FIRST_MESSAGE_IDS}
    ends = [f for _, _, f in harness.journal.entries if f.get("event") == EventName.END]
    assert {(f["mind"], f["session"], f["outcome"]) for f in ends} == {
        ("slow", "main", "timeout"),
        ("quick", "main", "ok"),
    }


def test_a_turn_that_fails_to_start_has_an_end_entry_with_its_turn_id(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = gate(tmp_path, harnesses, None, minds={"m": "true"}, max_attempts=1)
    harness.manager.failing.add("start_scope")
    harness.deliver_ok(mind="m")
    harness.pump(lambda: settled(harness))
    [end] = [f for _, _, f in harness.journal.entries if f.get("event") == EventName.END]
    assert (end["turn_id"], end["outcome"], end["mind"]) == (1, "start_failed", "m")


# -- docs/journal.md lists every field ---------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def logged_fields() -> set[str]:
    """VOLUTE_* fields the code can send: those of every event in volutectl/events.py's
    catalog, and the keywords of every plain journal.log call in volutectl/."""
    found = {
        f"VOLUTE_{name.upper()}" for kind in events.catalog() for name in kind.sent_field_names()
    }
    for path in (REPO / "volutectl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "log"
            ):
                found.update(f"VOLUTE_{k.arg.upper()}" for k in node.keywords if k.arg)
    return found


def test_docs_journal_lists_every_field_event_and_message_id() -> None:
    doc = (REPO / "docs" / "journal.md").read_text()
    fields = logged_fields()
    assert {"VOLUTE_EVENT", "VOLUTE_TURN_ID", "VOLUTE_OUTCOME"} <= fields  # the scan works
    assert [f for f in sorted(fields) if f"`{f}`" not in doc] == []
    assert [e.value for e in EventName if f"`{e.value}`" not in doc] == []
    for event, message_id in MESSAGE_IDS.items():
        [row] = [line for line in doc.splitlines() if f"`{message_id}`" in line]
        assert row.startswith(f"| {event.value} "), (event, row)
