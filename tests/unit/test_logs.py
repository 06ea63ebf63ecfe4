"""`volutectl logs`: its matches, how it reads entries, and its errors.

The command runs as a user runs it (the console script), against a stand-in journalctl
that applies journalctl's matching rules to a list of entries: FIELD=value terms, the
same field twice is either value, different fields must all hold, and `+` separates
alternatives. tests/system/test_logs.py runs it against the real journald.
"""

from __future__ import annotations

import grp
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from volutectl.cli import logs
from volutectl.events import MESSAGE_IDS, EventName
from volutectl.names import turn_scope_name

VOLUTECTL = Path(sys.executable).parent / "volutectl"

FAKE_JOURNALCTL = """#!PYTHON
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_JOURNALCTL_CALLS"], "a") as calls:
    calls.write(json.dumps(argv) + "\\n")
if os.environ.get("FAKE_JOURNALCTL_FAIL"):
    print(os.environ["FAKE_JOURNALCTL_FAIL"], file=sys.stderr)
    sys.exit(1)
options, matches = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
since, lines, after = 0, None, -1
for option in options:
    if option.startswith("--after-cursor="):
        after = int(option.split("=", 1)[1][1:])
    if option.startswith("--since="):
        when = option.split("=", 1)[1]
        if not when.startswith("@") or not when[1:].isdigit():
            print(f"Failed to parse timestamp: {when}", file=sys.stderr)
            sys.exit(1)
        since = int(when[1:]) * 1000000
    elif option.startswith("--lines="):
        value = option.split("=", 1)[1]
        lines = None if value == "all" else int(value)
groups, group = [], {}
for term in matches + ["+"]:
    if term == "+":
        groups.append(group)
        group = {}
    else:
        name, value = term.split("=", 1)
        group.setdefault(name, set()).add(value)
def matching(entry):
    return any(all(entry.get(k) in v for k, v in g.items()) for g in groups if g) or not matches
with open(os.environ["FAKE_JOURNAL"]) as journal:
    entries = json.load(journal)
for index, e in enumerate(entries):
    e["__CURSOR"] = f"c{index}"
chosen = [e for i, e in enumerate(entries)
          if matching(e) and int(e["__REALTIME_TIMESTAMP"]) >= since and i > after]
if lines is not None:
    chosen = chosen[max(0, len(chosen) - lines):] if lines else []
if os.environ.get("FAKE_EMPTY_TAIL") and lines == 1 and not matches:
    chosen = []  # the journal was empty when the follower looked at its end
for entry in chosen:
    print(json.dumps(entry))
"""

CONFIG = """
[minds.mimsy]
command = "true"
[minds.m-1]
command = "true"
[minds.gate]
command = "true"
[minds.whorl]
command = "true"
"""


def output(t: int, mind: str, turn: int, text: str, **extra: str) -> dict[str, Any]:
    """A line of a turn's stream, as journald records it."""
    return {
        "__REALTIME_TIMESTAMP": str(t * 1_000_000),
        "MESSAGE": text,
        "SYSLOG_IDENTIFIER": f"volute-{mind}",
        "_TRANSPORT": "stdout",
        "_SYSTEMD_UNIT": turn_scope_name(mind, turn),
        **extra,
    }


def entry(
    t: int, mind: str, text: str, event: EventName | None = None, **fields: str
) -> dict[str, Any]:
    """One of the gate's entries."""
    made = {
        "__REALTIME_TIMESTAMP": str(t * 1_000_000),
        "MESSAGE": text,
        "SYSLOG_IDENTIFIER": "volute-gate",
        "_TRANSPORT": "journal",
        "_SYSTEMD_UNIT": "volute-gate.service",
        "_UID": "0",
        "VOLUTE_MIND": mind,
        **fields,
    }
    if event is not None:
        made["VOLUTE_EVENT"] = event.value
        if event in MESSAGE_IDS:
            made["MESSAGE_ID"] = MESSAGE_IDS[event]
    return made


def start(t: int, mind: str, turn: int, session: str) -> dict[str, Any]:
    return entry(t, mind, f"turn {turn} of {mind}/{session} started", EventName.START,
                 VOLUTE_TURN_ID=str(turn), VOLUTE_SESSION=session)  # fmt: skip


JOURNAL = [
    start(1, "mimsy", 1, "chat"),
    output(2, "mimsy", 1, "hello from one"),
    output(3, "m-1", 2, "another mind, a longer name"),
    output(4, "mimsy", 3, "before its start entry"),
    start(5, "mimsy", 3, "dm"),
    entry(6, "mimsy", "turn 1 of mimsy/chat ended: exit 0", EventName.END,
          VOLUTE_TURN_ID="1", VOLUTE_SESSION="chat", VOLUTE_OUTCOME="ok"),
    output(7, "mimsy", 1, "an impostor", _SYSTEMD_UNIT="cron.service"),
    entry(8, "mimsy", "delivery 9 for mimsy/chat held: global_cap", EventName.HOLD,
          VOLUTE_DELIVERY_ID="9"),
    entry(9, "mimsy", "turn 3 of mimsy/dm failed to start: first\nsecond", EventName.END,
          VOLUTE_TURN_ID="3", VOLUTE_SESSION="dm"),
    start(10, "whorl", 5, "main"),
    output(11, "whorl", 5, "whorl's own"),
    output(12, "gate", 6, "the mind named gate"),
    output(13, "mimsy", 7, "a turn the gate never logged"),
    output(14, "mimsy", 1, [98, 121, 116, 101, 115, 255]),  # type: ignore[arg-type]
]  # fmt: skip


class Run:
    def __init__(self, tmp_path: Path) -> None:
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        script = self.bin / "journalctl"
        script.write_text(FAKE_JOURNALCTL.replace("PYTHON", sys.executable))
        script.chmod(0o755)
        self.calls_file = tmp_path / "calls"
        self.journal = tmp_path / "journal.json"
        self.journal.write_text(json.dumps(JOURNAL))
        self.config = tmp_path / "volutectl.toml"
        self.config.write_text(CONFIG)
        self.env: dict[str, str] = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "FAKE_JOURNAL": str(self.journal),
            "FAKE_JOURNALCTL_CALLS": str(self.calls_file),
            "VOLUTE_CONFIG": str(self.config),
            "TZ": "UTC",
        }

    def __call__(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("VOLUTE_")}
        return subprocess.run([str(VOLUTECTL), "logs", *args], capture_output=True, text=True,
                              env={**clean, **self.env, **env}, timeout=60)  # fmt: skip

    def calls(self) -> list[list[str]]:
        if not self.calls_file.exists():
            return []
        return [json.loads(line) for line in self.calls_file.read_text().splitlines()]


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(tmp_path)


def shown(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The printed lines without their timestamps."""
    assert result.returncode == 0, result.stderr
    return [line[20:] if line[:2] == "19" else line for line in result.stdout.splitlines()]


# -- the matches (pure) ----------------------------------------------------------------


def test_the_matches_name_the_identifier_the_scope_and_the_gates_fields() -> None:
    assert logs.mind_matches("m-1.x") == [
        "SYSLOG_IDENTIFIER=volute-m-1.x", "+", "VOLUTE_MIND=m-1.x"
    ]  # fmt: skip
    assert logs.turn_matches("m-1.x", 5, "_SYSTEMD_UNIT") == [
        r"_SYSTEMD_UNIT=volute-turn-m\x2d1.x-5.scope", "+", "VOLUTE_MIND=m-1.x",
        "VOLUTE_TURN_ID=5", "+", "SYSLOG_IDENTIFIER=volute-m-1.x",
    ]  # fmt: skip
    start = f"MESSAGE_ID={MESSAGE_IDS[EventName.START]}"
    assert logs.start_matches("m") == [start, "VOLUTE_MIND=m"]
    assert logs.unit_field("system") == "_SYSTEMD_UNIT"
    assert logs.unit_field("user") == "_SYSTEMD_USER_UNIT"
    argv = logs.journalctl_argv("jc", ["A=1"], since="-1h", follow=True, lines=0)
    assert argv == ["jc", "--no-pager", "--all", "--output=json", "--since=-1h", "--follow",
                    "--lines=0", "--", "A=1"]  # fmt: skip


def test_a_field_reads_as_text_whatever_form_journalctl_gives_it() -> None:
    assert logs.field_text("plain") == "plain"
    assert logs.field_text([104, 105, 255]) == "hi\ufffd"  # not UTF-8: a list of bytes
    assert logs.field_text(["first", "second"]) == "first"  # the field came twice
    assert logs.field_text(None) == logs.field_text([]) == ""


SYSTEM = logs.Trust("_SYSTEMD_UNIT", gate_uids=frozenset({"0"}), mind_uids=frozenset({"999"}))


def test_only_the_minds_own_scopes_count_as_its_turns() -> None:
    turns = logs.Turns("m", SYSTEM)
    assert turns.turn_of_output({"_SYSTEMD_UNIT": "volute-turn-m-12.scope"}) == 12
    for unit in (turn_scope_name("m-1", 3), "volute-turn-mx-3.scope", "cron.service", ""):
        assert turns.turn_of_output({"_SYSTEMD_UNIT": unit}) is None, unit
    assert logs.Turns("m-1", SYSTEM).turn_of_output(
        {"_SYSTEMD_UNIT": turn_scope_name("m-1", 3)}
    ) == 3  # fmt: skip


def test_a_multi_line_message_prints_as_one_indented_entry() -> None:
    line = logs.format_line({"MESSAGE": "one\ntwo\n", "__REALTIME_TIMESTAMP": "x"}, "gate")
    assert line == "- gate: one\n    two"


# A turn's line that erases its own prefix and writes a gate line in its place, then
# retitles the window and writes the clipboard (issue 29, finding 3).
FORGED = "x\r\033[2K2099-01-01 00:00:00 gate: all is well\033]0;TITLE\007\033]52;c;ZXZpbA==\007"


def test_a_turns_control_characters_are_shown_not_obeyed() -> None:
    line = logs.format_line({"MESSAGE": f"{FORGED}\nnext\x9b2J\n", "__REALTIME_TIMESTAMP": "x"},
                            "m/main turn 1")  # fmt: skip
    assert line == (
        r"- m/main turn 1: x\r\x1b[2K2099-01-01 00:00:00 gate: all is well"
        r"\x1b]0;TITLE\a\x1b]52;c;ZXZpbA==\a"
        "\n    next\\x9b2J"
    )


def test_logs_prints_no_control_character_of_a_turns_but_its_indented_newlines(
    run: Run,
) -> None:
    run.journal.write_text(json.dumps([
        start(1, "mimsy", 1, "chat"),
        output(2, "mimsy", 1, FORGED),
        output(3, "mimsy", 1, "bell\a and\ttab\nsecond line\u202eevil"),
    ]))  # fmt: skip
    for args in (("mimsy",), ("mimsy", "--turn", "1"), ("mimsy", "--follow")):
        result = run(*args)
        assert result.returncode == 0, result.stderr
        bad = [
            ch for ch in result.stdout if (ord(ch) < 32 and ch != "\n") or 0x7F <= ord(ch) < 0xA0
        ]
        assert bad == [] and "\u202e" not in result.stdout, (args, result.stdout)
        assert r"mimsy/chat turn 1: x\r\x1b[2K2099-01-01" in result.stdout
        assert "mimsy/chat turn 1: bell\\a and\\ttab\n    second line\\u202eevil" in result.stdout


# -- the command --------------------------------------------------------------------------


def test_a_minds_log_names_each_turn_and_its_session_and_leaves_out_strangers(run: Run) -> None:
    assert shown(run("mimsy")) == [
        "gate: turn 1 of mimsy/chat started",
        "mimsy/chat turn 1: hello from one",
        "mimsy/dm turn 3: before its start entry",
        "gate: turn 3 of mimsy/dm started",
        "gate: turn 1 of mimsy/chat ended: exit 0",
        "gate: delivery 9 for mimsy/chat held: global_cap",
        "gate: turn 3 of mimsy/dm failed to start: first",
        "    second",
        "mimsy/? turn 7: a turn the gate never logged",
        "mimsy/chat turn 1: bytes\ufffd",
    ]
    # journald did the matching: the stand-in was asked for the start entries, then the
    # mind's entries, then about the one turn neither named (7), once.
    calls = run.calls()
    assert [call[call.index("--") + 1 :] for call in calls] == [
        logs.start_matches("mimsy"),
        logs.mind_matches("mimsy"),
        ["VOLUTE_MIND=mimsy", "VOLUTE_TURN_ID=7"],
    ]


def test_a_mind_named_like_the_gate_gets_its_own_turns_not_the_gates_entries(run: Run) -> None:
    assert shown(run("gate")) == ["gate/? turn 6: the mind named gate"]


def test_one_turn_shows_its_session_its_output_and_the_gates_entries_about_it(run: Run) -> None:
    assert shown(run("mimsy", "--turn", "1")) == [
        "-- turn 1 of mimsy, session chat (volute-turn-mimsy-1.scope)",
        "gate: turn 1 of mimsy/chat started",
        "mimsy/chat turn 1: hello from one",
        "gate: turn 1 of mimsy/chat ended: exit 0",
        "mimsy/chat turn 1: bytes\ufffd",
    ]
    assert shown(run("m-1", "--turn", "2")) == [
        r"-- turn 2 of m-1, session ? (volute-turn-m\x2d1-2.scope)",
        "m-1/? turn 2: another mind, a longer name",
    ]


def test_since_is_journalctls_and_a_turn_started_before_it_still_has_its_session(
    run: Run,
) -> None:
    assert shown(run("mimsy", "--since", "@2")) == [
        "mimsy/chat turn 1: hello from one",
        "mimsy/dm turn 3: before its start entry",
        "gate: turn 3 of mimsy/dm started",
        "gate: turn 1 of mimsy/chat ended: exit 0",
        "gate: delivery 9 for mimsy/chat held: global_cap",
        "gate: turn 3 of mimsy/dm failed to start: first",
        "    second",
        "mimsy/? turn 7: a turn the gate never logged",
        "mimsy/chat turn 1: bytes\ufffd",
    ]
    assert all("--since=@2" in call for call in run.calls()[:3])
    assert shown(run("mimsy", "--turn", "1", "--since", "@7"))[1:] == [
        "mimsy/chat turn 1: bytes\ufffd"
    ]


def test_follow_reads_the_recent_entries_by_match_then_follows_every_entry(run: Run) -> None:
    # The recent ones by journald's matching; then journalctl --follow with no match
    # (systemd 252 shows nothing new for a match on a value its file lacks), from the
    # journal's last entry as it was, each of the mind's entries once.
    lines = shown(run("mimsy", "--follow"))
    assert lines == shown(run("mimsy"))  # every entry once, in order, no stranger's
    calls = run.calls()
    followed = [call for call in calls if "--follow" in call]
    assert [call[call.index("--") + 1 :] for call in followed] == [[]]
    assert "--after-cursor=c13" in followed[0]
    before = calls[: calls.index(followed[0])]
    assert [c for c in before if "--lines=1" in c and c[c.index("--") + 1 :] == []]


def test_what_follow_reads_as_new_is_chosen_here_and_shown_once(run: Run) -> None:
    # Every entry of the journal comes through the unmatched follow (it was empty when
    # the follower looked), strangers' included: each of the mind's is shown once, in
    # order, and no other; with --turn, only that turn's.
    expected = {args: shown(run(*args)) for args in [("mimsy",), ("mimsy", "--turn", "1")]}
    run.env["FAKE_EMPTY_TAIL"] = "1"
    assert shown(run("mimsy", "--follow")) == expected[("mimsy",)]
    assert shown(run("mimsy", "--turn", "1", "--follow")) == expected[("mimsy", "--turn", "1")]
    followed = [call for call in run.calls() if "--follow" in call]
    assert all("--lines=all" in call for call in followed)


@pytest.mark.parametrize(
    ("args", "code", "said"),
    [
        (["nobody"], 67, "unknown mind 'nobody'"),
        (["bad/name"], 65, "invalid mind name 'bad/name'"),
        (["mimsy", "--turn", "99"], 65, "turn 99 of mimsy never ran"),
        (["mimsy", "--turn", "5"], 65, "turn 5 was whorl's: volutectl logs whorl --turn 5"),
        (["mimsy", "--turn", "0"], 64, "--turn"),
        (["mimsy", "--since", "yesterday-ish"], 64, "--since 'yesterday-ish'"),
    ],
)
def test_clear_errors(run: Run, args: list[str], code: int, said: str) -> None:
    result = run(*args)
    assert (result.returncode, result.stdout) == (code, ""), result.stderr
    assert said in result.stderr and "Traceback" not in result.stderr


def test_without_journalctl_it_exits_69(run: Run) -> None:
    result = run("mimsy", PATH="/nonexistent")
    assert result.returncode == 69
    assert "journalctl is not installed" in result.stderr


def test_a_failing_journalctl_is_unavailable_with_its_reason(run: Run) -> None:
    result = run("mimsy", FAKE_JOURNALCTL_FAIL="Failed to open journal: Input/output error")
    assert result.returncode == 69
    assert "journalctl failed: Failed to open journal: Input/output error" in result.stderr


@pytest.mark.parametrize(
    "said",
    [
        "No journal files were opened due to insufficient permissions.",
        "Failed to open journal: Permission denied",
    ],
)
def test_a_journal_the_user_may_not_read_is_77_naming_its_group(run: Run, said: str) -> None:
    result = run("mimsy", FAKE_JOURNALCTL_FAIL=said)
    assert result.returncode == 77, result.stderr
    group = logs.journal_group()
    assert f"the group {group}" in result.stderr
    assert f"usermod -aG {group} " in result.stderr
    assert "journalctl failed" not in result.stderr


def test_the_journals_group_is_its_directorys(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()
    os.chown(journal, -1, os.getgid())
    assert logs.journal_group([tmp_path / "absent", journal]) == grp.getgrgid(os.getgid()).gr_name
    assert logs.journal_group([tmp_path / "absent"]) == "systemd-journal"


def test_a_reader_that_leaves_early_is_not_an_error(run: Run) -> None:
    run.journal.write_text(json.dumps([output(t, "mimsy", 1, "x" * 200) for t in range(5000)]))
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("VOLUTE_")}
    pipeline = subprocess.run(
        f"{VOLUTECTL} logs mimsy | head -n 1; echo \"status ${{PIPESTATUS[0]}}\"",
        shell=True, executable="/bin/bash", capture_output=True, text=True,
        env={**clean, **run.env}, timeout=60,
    )  # fmt: skip
    assert pipeline.stdout.splitlines()[-1] == "status 0", pipeline.stderr
    assert "Traceback" not in pipeline.stderr and "Error" not in pipeline.stderr


# -- whose entries count: journald's trusted fields (docs/journal.md, "Who wrote it") ----


def no_unit(made: dict[str, Any]) -> dict[str, Any]:
    """The entry as journald records it when it cannot name the writer's unit."""
    return {k: v for k, v in made.items() if k != "_SYSTEMD_UNIT"}


def test_a_gate_entry_counts_only_from_the_gates_units_and_users() -> None:
    turns = logs.Turns("m", SYSTEM)
    real = start(1, "m", 1, "s")
    assert turns.is_ours(real)
    assert turns.is_ours({**real, "_SYSTEMD_UNIT": "volute-launcher.service"})
    # Sent by a local user: journald records their uid, and their own unit or none.
    for forged in (
        {**real, "_UID": "1234"},
        no_unit({**real, "_UID": "1234"}),
        no_unit(real),
        {**real, "_SYSTEMD_UNIT": "session-3.scope", "_UID": "0"},
        {k: v for k, v in real.items() if k != "_UID"},
    ):
        assert not turns.is_ours(forged), forged
        turns.learn(forged)
        assert turns.sessions == {} and logs.source_of(forged, turns) is None
    turns.learn(real)
    assert turns.sessions == {1: "s"}


def test_a_line_journald_put_in_no_unit_counts_only_from_the_minds_user() -> None:
    turns = logs.Turns("m", SYSTEM)
    placed = output(1, "m", 4, "its writer still there", _STREAM_ID="s1", _UID="999")
    late = no_unit(placed)
    assert turns.unattributed(late) and not turns.unattributed(placed)
    assert logs.source_of(late, turns) == f"m/? {logs.UNPLACED}"  # shown, marked
    turns.learn(placed)  # another line of its stream names the scope: its turn
    assert logs.source_of(late, turns) == "m/? turn 4"
    assert logs.of_turn(late, turns, 4) and not logs.of_turn(late, turns, 5)
    unknown = {**late, "_STREAM_ID": "s2"}
    assert logs.of_turn(unknown, turns, 5)  # may be turn 5's: shown, marked
    strangers = [
        {**late, "_UID": "1234"},
        {**late, "SYSLOG_IDENTIFIER": "volute-mx"},
        {**late, "_SYSTEMD_UNIT": "cron.service"},
    ]
    for stranger in strangers:
        assert logs.source_of(stranger, turns) is None, stranger
    # Under a user manager, a unit counts only from that user's own manager.
    uids = frozenset({"1000"})
    user = logs.Turns("m", logs.Trust("_SYSTEMD_USER_UNIT", uids, uids, owner_uid="1000"))
    mine = {"_SYSTEMD_USER_UNIT": "volute-turn-m-2.scope", "_SYSTEMD_OWNER_UID": "1000"}
    assert user.turn_of_output(mine) == 2
    assert user.turn_of_output({**mine, "_SYSTEMD_OWNER_UID": "1001"}) is None


TRUSTED = """
[minds.mimsy]
command = "true"
user = "root"
[minds.m-1]
command = "true"
user = "root"
"""


def test_lines_without_a_unit_are_shown_once_placed_by_their_stream_or_marked(
    run: Run,
) -> None:
    # The mind runs as root here (uid 0: a user this host has); the other lines are a
    # stranger's (another uid), and entries forged by one with the gate's fields.
    run.config.write_text(TRUSTED)
    bare = {"_UID": "0", "_STREAM_ID": "aa"}
    journal = [
        start(1, "mimsy", 1, "chat"),
        no_unit(output(2, "mimsy", 1, "exited before journald looked", **bare)),
        output(3, "mimsy", 1, "journald saw its scope", **bare),
        no_unit(output(4, "mimsy", 1, "a logger that exited at once", _UID="0")),
        no_unit(output(5, "mimsy", 1, "a stranger's", _UID="1234")),
        {**start(6, "mimsy", 9, "forged"), "_UID": "1234", "_SYSTEMD_UNIT": "session-2.scope"},
        no_unit(start(7, "mimsy", 1, "forged")),
        {**start(8, "mimsy", 2, "dm"), "_SYSTEMD_UNIT": "volute-launcher.service"},
        no_unit(output(9, "m-1", 3, "another mind's", _UID="0")),
    ]
    run.journal.write_text(json.dumps(journal))
    expected = [
        "gate: turn 1 of mimsy/chat started",
        "mimsy/chat turn 1: exited before journald looked",
        "mimsy/chat turn 1: journald saw its scope",
        f"mimsy/? {logs.UNPLACED}: a logger that exited at once",
        "gate: turn 2 of mimsy/dm started",
    ]
    assert shown(run("mimsy")) == expected
    assert shown(run("mimsy", "--follow")) == expected
    run.env["FAKE_EMPTY_TAIL"] = "1"  # all of it through the unmatched follow
    assert shown(run("mimsy", "--follow")) == expected
    one = expected[:4]
    assert shown(run("mimsy", "--turn", "1"))[1:] == one
    assert shown(run("mimsy", "--turn", "1", "--follow"))[1:] == one
    assert shown(run("mimsy", "--turn", "2"))[1:] == expected[3:]
    # The stream was asked about once, for its first line without a unit.
    streams = [c for c in run.calls() if "_STREAM_ID=aa" in c]
    assert len(streams) == 6  # once in each of the six runs


def test_one_turn_asks_about_no_other_turn(run: Run) -> None:
    # --turn reads every line of the mind's identifier (for those without a unit): the
    # other turns' lines are left out without a query each for their sessions.
    run.journal.write_text(json.dumps([output(t, "mimsy", t, f"turn {t}") for t in range(1, 40)]))
    assert shown(run("mimsy", "--turn", "3"))[1:] == ["mimsy/? turn 3: turn 3"]
    matches = [call[call.index("--") + 1 :] for call in run.calls()]
    asked = [m for m in matches if len(m) == 2 and m[0] == "VOLUTE_MIND=mimsy"]
    assert asked == [["VOLUTE_MIND=mimsy", "VOLUTE_TURN_ID=3"]]
