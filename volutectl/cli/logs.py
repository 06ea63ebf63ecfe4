"""`volutectl logs MIND [--turn ID] [--follow] [--since WHEN]`: a mind's turns, from the journal.

Built on journald's own matching: journalctl runs with field matches, and each entry it
returns (as JSON) is printed as one line that names its turn and session. No file of
ours holds a turn's output (docs/journal.md):
- a turn's output is its scope's stream: SYSLOG_IDENTIFIER=volute-<mind>, and the turn
  id in _SYSTEMD_UNIT (volute-turn-<mind>-<id>.scope);
- the gate's entries about the mind carry VOLUTE_MIND, and those about one turn
  VOLUTE_TURN_ID;
- a stream's fields cannot say its session, so the session of each turn is read from
  the gate's entries about that turn: one query for the start entries of the mind's
  turns, and one more for a turn that query did not name.

Anyone may send an entry with any of those fields but journald's trusted ones (a
leading underscore), which it sets from the kernel's credentials of the writer and from
the writer's cgroup. So each entry is taken only on its trusted fields (`Trust`):
- a gate entry only from the gate's units (_SYSTEMD_UNIT volute-gate.service or
  volute-launcher.service) and the gate's users (_UID 0 or volute-gate);
- a turn's line only from that mind's own scope (_SYSTEMD_UNIT), or, when journald
  could not name the writer's unit at all, from the mind's own user (_UID): the line is
  shown, placed in its turn by its stream (_STREAM_ID) when another line of that stream
  names the scope, else marked as a line of a turn that cannot be told.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from volutectl import names
from volutectl.cli.completion import complete_minds
from volutectl.cli.options import config_option
from volutectl.errors import (
    EX_NOUSER,
    DataError,
    PermissionDeniedError,
    UnavailableError,
    UsageError,
    VoluteError,
)
from volutectl.events import MESSAGE_IDS, EventName
from volutectl.visible import visible

# pydantic only when the command runs, not for a TAB (volutectl.cli.completion).
if TYPE_CHECKING:
    from volutectl.config.settings import Settings

SINCE_EXAMPLES = "e.g. --since -1h, --since today, --since '2024-05-01 12:00'"
# The units whose entries are the gate's: the socket-facing gate, and the root launcher
# that starts turns for it; and the system user the gate runs as (besides root).
GATE_UNITS = frozenset({"volute-gate.service", "volute-launcher.service"})
GATE_USER = "volute-gate"
# How a line is marked whose turn journald's fields cannot tell.
UNPLACED = "turn ? (journald did not record which)"


# -- what to ask journald (pure) ---------------------------------------------------------


def unit_field(manager: str) -> str:
    """The field journald puts a process's unit in: the system's, or a user manager's."""
    return "_SYSTEMD_USER_UNIT" if manager == "user" else "_SYSTEMD_UNIT"


def mind_matches(mind: str) -> list[str]:
    """Every turn's output (its identifier) or a gate entry about the mind."""
    return [f"SYSLOG_IDENTIFIER=volute-{mind}", "+", f"VOLUTE_MIND={mind}"]


def turn_matches(mind: str, turn_id: int, unit_key: str) -> list[str]:
    """One turn's output (its scope), a gate entry about that turn, or a line of the
    mind that journald may not have put in any unit (chosen here: `of_turn`)."""
    unit = names.turn_scope_name(mind, turn_id)
    return [
        f"{unit_key}={unit}",
        "+",
        f"VOLUTE_MIND={mind}",
        f"VOLUTE_TURN_ID={turn_id}",
        "+",
        f"SYSLOG_IDENTIFIER=volute-{mind}",
    ]


def start_matches(mind: str) -> list[str]:
    return [f"MESSAGE_ID={MESSAGE_IDS[EventName.START]}", f"VOLUTE_MIND={mind}"]


def journalctl_argv(
    journalctl: str,
    matches: Iterable[str],
    *,
    since: str | None = None,
    follow: bool = False,
    lines: int | str | None = None,
    after_cursor: str | None = None,
) -> list[str]:
    argv = [journalctl, "--no-pager", "--all", "--output=json"]
    if since is not None:
        argv.append(f"--since={since}")
    if follow:
        argv.append("--follow")
    if lines is not None:
        argv.append(f"--lines={lines}")
    if after_cursor is not None:
        argv.append(f"--after-cursor={after_cursor}")
    return [*argv, "--", *matches]


# -- reading entries (pure) ----------------------------------------------------------------


def field_text(value: Any) -> str:
    """A field as journalctl's JSON gives it: text, bytes as a list of numbers (not
    UTF-8, or binary), or a list of values when the field came more than once."""
    if value is None:
        return ""
    if isinstance(value, list):
        if value and all(isinstance(item, int) for item in value):
            return bytes(value).decode(errors="replace")
        return field_text(value[0]) if value else ""
    return str(value)


def user_uid(user: str) -> str | None:
    try:
        return str(pwd.getpwnam(user).pw_uid)
    except KeyError:
        return None


@dataclass(frozen=True)
class Trust:
    """Whose entries count, by journald's trusted fields only (a client cannot send a
    field with a leading underscore; journald sets _UID from the kernel's credentials of
    the writer, and the unit from the writer's cgroup, or from a stream's header only
    when root opened the stream).

    `gate_uids`: the users the gate's units run as. `mind_uids`: the mind's own user,
    whose lines journald could not put in any unit still count. `owner_uid`: under a
    user manager, whose manager it must be (anyone can name a unit in their own)."""

    unit_key: str
    gate_uids: frozenset[str]
    mind_uids: frozenset[str]
    owner_uid: str | None = None

    @classmethod
    def of(cls, settings: Settings, mind: str) -> Trust:
        user = settings.minds[mind].user or settings.turns.default_user
        mine = frozenset(uid for uid in [user_uid(user)] if uid is not None)
        key = unit_field(settings.gate.manager)
        if settings.gate.manager == "user":
            me = str(os.getuid())
            return cls(key, frozenset({me}), mine, owner_uid=me)
        gate = frozenset(uid for uid in ["0", user_uid(GATE_USER)] if uid is not None)
        return cls(key, gate, mine)

    def unit_of(self, entry: Mapping[str, Any]) -> str | None:
        """The writer's unit as journald recorded it, or None if it recorded none."""
        if self.unit_key not in entry:
            return None
        owner = field_text(entry.get("_SYSTEMD_OWNER_UID"))
        if self.owner_uid is not None and owner != self.owner_uid:
            return ""  # another user's manager's unit: a unit, and never ours
        return field_text(entry.get(self.unit_key))

    def by_gate(self, entry: Mapping[str, Any]) -> bool:
        uid = field_text(entry.get("_UID"))
        return self.unit_of(entry) in GATE_UNITS and uid in self.gate_uids


@dataclass
class Turns:
    """The sessions of one mind's turns, as the gate's entries name them, the turns
    already asked about (so that a turn the journal cannot place is asked once), and the
    turn of each stream that one of its lines placed."""

    mind: str
    trust: Trust
    sessions: dict[int, str] = field(default_factory=dict)
    asked: set[int] = field(default_factory=set)
    streams: dict[str, int | None] = field(default_factory=dict)

    def learn(self, entry: Mapping[str, Any]) -> None:
        turn, session = field_text(entry.get("VOLUTE_TURN_ID")), entry.get("VOLUTE_SESSION")
        if turn.isdigit() and session is not None and self.is_ours(entry):
            self.sessions[int(turn)] = field_text(session)
        placed, stream = self.turn_of_output(entry), field_text(entry.get("_STREAM_ID"))
        if placed is not None and stream:
            self.streams[stream] = placed

    def is_ours(self, entry: Mapping[str, Any]) -> bool:
        """A gate entry about this mind, written by the gate."""
        return field_text(entry.get("VOLUTE_MIND")) == self.mind and self.trust.by_gate(entry)

    def turn_of_output(self, entry: Mapping[str, Any]) -> int | None:
        """The turn whose scope wrote this entry, if it is one of this mind's turns."""
        parsed = names.parse_turn_scope_name(self.trust.unit_of(entry) or "")
        if parsed is None or parsed[0] != self.mind:
            return None
        return parsed[1]

    def unattributed(self, entry: Mapping[str, Any]) -> bool:
        """A line with the mind's identifier that journald put in no unit (its writer had
        exited, or its cgroup could not be read), written by the mind's own user."""
        identifier = field_text(entry.get("SYSLOG_IDENTIFIER"))
        uid = field_text(entry.get("_UID"))
        return (
            identifier == f"volute-{self.mind}"
            and self.trust.unit_of(entry) is None
            and uid in self.trust.mind_uids
        )


def format_line(entry: Mapping[str, Any], source: str) -> str:
    """One entry as a line: its time, who wrote it, and its message, with every control
    character shown (volutectl/visible.py) but the newlines, after which each line of
    the message is indented. A turn's output is the turn's to write: a `\\r\\033[2K`
    in it must not erase the `mind/session turn N:` that says whose it is, under a
    terminal or in a file that a terminal shows later."""
    usec = field_text(entry.get("__REALTIME_TIMESTAMP"))
    when = time.localtime(int(usec) / 1e6) if usec.isdigit() else None
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", when) if when else "-"
    message = visible(field_text(entry.get("MESSAGE")).rstrip("\n"), newlines=True)
    indented = message.replace("\n", "\n    ")
    return f"{stamp} {visible(source)}: {indented}"


def source_of(entry: Mapping[str, Any], turns: Turns) -> str | None:
    """Who wrote an entry worth showing (a turn, named with its session, or the gate),
    or None: a stranger's entry that only shares the identifier or the gate's fields (a
    mind named "gate" shares the gate's identifier)."""
    turn_id = turns.turn_of_output(entry)
    if turn_id is None and turns.unattributed(entry):
        turn_id = turns.streams.get(field_text(entry.get("_STREAM_ID")))
        if turn_id is None:
            return f"{turns.mind}/? {UNPLACED}"
    if turn_id is not None:
        return f"{turns.mind}/{turns.sessions.get(turn_id, '?')} turn {turn_id}"
    return "gate" if turns.is_ours(entry) else None


# -- running journalctl ----------------------------------------------------------------------


def find_journalctl() -> str:
    found = shutil.which("journalctl")
    if found is None:
        raise UnavailableError(
            "journalctl is not installed here: turns' output is in the journal",
            hint="install systemd's journalctl (Debian: the systemd package)",
        )
    return found


# Where journald keeps the system journal: persistent, else volatile.
JOURNAL_DIRS = (Path("/var/log/journal"), Path("/run/log/journal"))
# What journalctl says when it may read none of the system journal, or only the caller's
# own: a mind's turns are system scopes, so either way they cannot be shown.
NO_ACCESS = ("insufficient permissions", "permission denied", "not seeing messages from other")


def journal_group(dirs: Iterable[Path] = JOURNAL_DIRS) -> str:
    """The group that may read the system journal: its directory's (systemd-journal)."""
    for directory in dirs:
        try:
            gid = directory.stat().st_gid
        except OSError:
            continue
        try:
            return grp.getgrgid(gid).gr_name
        except KeyError:
            return str(gid)
    return "systemd-journal"


def cannot_read_journal() -> PermissionDeniedError:
    """77, naming the group to join: the group `volute` lets a user deliver, not read
    the system journal, which journald keeps for root and its own group."""
    group = journal_group()
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = str(os.getuid())
    return PermissionDeniedError(
        f"user {user} may not read the system journal, where turns' output goes "
        f"(it is for root and the group {group})",
        hint=f"an admin adds you to it: usermod -aG {group} {user} (then log in again); "
        "or run volutectl logs as root",
    )


def check_journal_access(
    dirs: Iterable[Path] = JOURNAL_DIRS, machine_id: Path = Path("/etc/machine-id")
) -> None:
    """Refuse (77) before journalctl runs when the system journal's file is there but not
    readable: journalctl would show the caller's own journal, or nothing, and say so
    only in a hint."""
    if os.geteuid() == 0:
        return
    try:
        machine = machine_id.read_text().strip()
    except OSError:
        return
    for directory in dirs:
        system = directory / machine / "system.journal"
        if system.exists():
            if not os.access(system, os.R_OK):
                raise cannot_read_journal()
            return


def query(argv: list[str], since: str | None) -> list[dict[str, Any]]:
    """Run journalctl to the end; its entries, or one clear error. Through subprocess,
    not volutectl/kernel/processes.py: its stdout and stderr are both read (that
    module's docstring says why)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError as error:
        raise UnavailableError(f"cannot run journalctl: {error}") from None
    if done.returncode != 0:
        raise journalctl_error(done.stderr, since)
    if NO_ACCESS[2] in done.stderr.lower():
        raise cannot_read_journal()
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def journalctl_error(stderr: str, since: str | None) -> VoluteError:
    said = (stderr.strip().splitlines() or ["no message"])[-1]
    if since is not None and "timestamp" in stderr.lower():
        return UsageError(
            f"--since {since!r}: journalctl cannot read it ({said})", hint=SINCE_EXAMPLES
        )
    if any(words in stderr.lower() for words in NO_ACCESS):
        return cannot_read_journal()
    return UnavailableError(f"journalctl failed: {said}")


def entries(argv: list[str]) -> Iterator[dict[str, Any]]:
    """journalctl's entries as it writes them (for --follow, for as long as it runs), read
    through subprocess as the lines come (volutectl/kernel/processes.py says why)."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        for line in process.stdout:
            if line.strip():
                yield json.loads(line)
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait()
    if process.returncode not in (0, -15):
        raise UnavailableError(f"journalctl exited {process.returncode}")


# -- the command -------------------------------------------------------------------------------


def configured_mind(settings: Settings, mind: str) -> str:
    try:
        names.check_mind(mind)
    except names.NameError_ as error:
        raise DataError(str(error)) from None
    if mind not in settings.minds:
        known = ", ".join(sorted(settings.minds)) or "none"
        raise VoluteError(
            f"unknown mind {mind!r}", hint=f"configured minds: {known}", exit_code=EX_NOUSER
        )
    return mind


def ask_about_turn(journalctl: str, turns: Turns, turn_id: int) -> None:
    """Learn a turn's session from the gate's entries about it, once per turn."""
    if turn_id in turns.sessions or turn_id in turns.asked:
        return
    turns.asked.add(turn_id)
    argv = journalctl_argv(journalctl, [f"VOLUTE_MIND={turns.mind}", f"VOLUTE_TURN_ID={turn_id}"])
    for entry in query(argv, None):
        turns.learn(entry)


def ask_about_stream(journalctl: str, turns: Turns, entry: Mapping[str, Any]) -> None:
    """For a line journald put in no unit: learn its turn from the other lines of its
    stream (one of them may name the scope), once per stream."""
    stream = field_text(entry.get("_STREAM_ID"))
    if not stream or stream in turns.streams or not turns.unattributed(entry):
        return
    turns.streams[stream] = None
    for other in query(journalctl_argv(journalctl, [f"_STREAM_ID={stream}"]), None):
        turns.learn(other)


def never_ran(journalctl: str, turns: Turns, turn_id: int) -> DataError:
    """The error for a turn of which the journal holds nothing; says whose it was."""
    argv = journalctl_argv(journalctl, [f"VOLUTE_TURN_ID={turn_id}"])
    found = query(argv, None)
    others = sorted(
        {field_text(e.get("VOLUTE_MIND")) for e in found if turns.trust.by_gate(e)}
        - {turns.mind, ""}
    )
    hint = (
        f"turn {turn_id} was {others[0]}'s: volutectl logs {others[0]} --turn {turn_id}"
        if others
        else f"see the turns that did: volutectl logs {turns.mind}; reading the system "
        "journal takes root or the systemd-journal group"
    )
    return DataError(
        f"turn {turn_id} of {turns.mind} never ran: the journal has no entry of it", hint=hint
    )


def print_entries(
    stream: Iterable[dict[str, Any]],
    journalctl: str,
    turns: Turns,
    *,
    turn_id: int | None,
    follow: bool,
) -> None:
    """Print each entry worth showing (`source_of`) of the turn asked for (any, without
    --turn), learning as they pass the sessions and streams that place later ones."""
    for entry in stream:
        turns.learn(entry)  # a start entry that streams past names its turn's session
        ask_about_stream(journalctl, turns, entry)
        if not of_turn(entry, turns, turn_id):
            continue  # another turn's: nothing to ask about it
        placed = turns.turn_of_output(entry)
        if placed is not None:
            ask_about_turn(journalctl, turns, placed)
        source = source_of(entry, turns)
        if source is not None:
            click.echo(format_line(entry, source))
            if follow:
                sys.stdout.flush()


def show_logs(
    settings: Settings, mind: str, turn_id: int | None, follow: bool, since: str | None
) -> None:
    mind = configured_mind(settings, mind)
    journalctl = find_journalctl()
    if since is not None:  # journalctl's own reading of WHEN; a bad one is a usage error
        query(journalctl_argv(journalctl, [], since=since, lines=0), since)
    turns = Turns(mind, Trust.of(settings, mind))
    if turn_id is None:
        for entry in query(journalctl_argv(journalctl, start_matches(mind), since=since), since):
            turns.learn(entry)
        matches = mind_matches(mind)
    else:
        matches = turn_matches(mind, turn_id, turns.trust.unit_key)
        ask_about_turn(journalctl, turns, turn_id)
        session = turns.sessions.get(turn_id)
        if session is None and not query(journalctl_argv(journalctl, matches[:1], lines=1), None):
            raise never_ran(journalctl, turns, turn_id)
        unit = names.turn_scope_name(mind, turn_id)
        shown = visible(f"-- turn {turn_id} of {mind}, session {session or '?'} ({unit})")
        click.echo(shown)
    if not follow:
        stream = entries(journalctl_argv(journalctl, matches, since=since))
        print_entries(stream, journalctl, turns, turn_id=turn_id, follow=False)
        return
    follow_entries(journalctl, matches, turns, turn_id, since)


def follow_entries(
    journalctl: str, matches: list[str], turns: Turns, turn_id: int | None, since: str | None
) -> None:
    """--follow: the recent entries by journald's matching, then every new entry of the
    journal, chosen here. journalctl --follow with a match shows nothing new while the
    matched value is absent from the journal file it started on (systemd 252: a mind
    with no entry yet in the current file), so the follow itself matches nothing. It
    starts after the journal's last entry as it was before the recent ones were read,
    and skips those already shown: nothing is lost in between, nothing shown twice."""
    tail = query(journalctl_argv(journalctl, [], lines=1), None)
    cursor = field_text(tail[-1].get("__CURSOR")) if tail else ""
    # The last 10 of the mind's; all of one turn's (the matches for it take every line
    # of the mind that journald put in no unit, which `of_turn` then chooses from).
    lines = 10 if since is None and turn_id is None else None
    recent = query(journalctl_argv(journalctl, matches, since=since, lines=lines), since)
    shown = {field_text(entry.get("__CURSOR")) for entry in recent} - {""}
    print_entries(recent, journalctl, turns, turn_id=turn_id, follow=True)
    argv = journalctl_argv(
        journalctl,
        [],
        follow=True,
        after_cursor=cursor or None,
        lines=None if cursor else "all",
    )
    new = (e for e in entries(argv) if field_text(e.get("__CURSOR")) not in shown)
    print_entries(new, journalctl, turns, turn_id=turn_id, follow=True)


def of_turn(entry: Mapping[str, Any], turns: Turns, turn_id: int | None) -> bool:
    """Whether an entry belongs to the turn asked for (any, without --turn). A line
    whose turn cannot be told may be this turn's: it is shown, marked (`source_of`)."""
    if turn_id is None:
        return True
    if turns.turn_of_output(entry) == turn_id:
        return True
    if turns.unattributed(entry):
        return turns.streams.get(field_text(entry.get("_STREAM_ID"))) in (turn_id, None)
    return turns.is_ours(entry) and field_text(entry.get("VOLUTE_TURN_ID")) == str(turn_id)


@click.command("logs")
@click.argument("mind", shell_complete=complete_minds)
@click.option("--turn", "turn_id", type=click.IntRange(min=1), help="Only this turn.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new entries.")
@click.option("--since", metavar="WHEN", help=f"Only entries since then ({SINCE_EXAMPLES}).")
@config_option
def logs_command(
    mind: str, turn_id: int | None, follow: bool, since: str | None, config_path: str | None
) -> None:
    """Show a mind's turns' output and the gate's entries about them, from the journal.

    Each line names its turn and session. With journalctl alone:

    \b
      journalctl -u volute-turn-MIND-ID.scope   one turn's output
      journalctl -t volute-MIND                 the output of every turn of MIND
    """
    check_journal_access()  # first: a member of volute may not read the config either
    try:
        from volutectl.config.settings import load_settings

        show_logs(load_settings(config_path).settings, mind, turn_id, follow, since)
    except BrokenPipeError:
        # The reader left (`| head`): not an error. Python's last flush would raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
