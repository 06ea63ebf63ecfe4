"""The pure part of the test-run cap: where the cap comes from, which slots to probe,
what a queued run says while it waits, how long runs typically take, and how the gate
reads the texts that tell it which slots are held.

No I/O here (no fcntl, os, pystemd or sqlite3): the adapters in `volutectl.slots.slotfiles`,
`volutectl.slots.watch` and `volutectl.slots.testrun` gather the facts and these functions
decide and format.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from volutectl.durations import format_duration
from volutectl.errors import ConfigError
from volutectl.names import UNIT_NAME_MAX, escape_unit_part

SLOT_DIR_PARTS = ("volute", "test-slots")  # under the git common dir
HISTORY_PARTS = ("volute", "test-history.jsonl")
GIT_CONFIG_KEY = "volute.testSlots"
CONFIG_KEY = "tests.concurrent_runs"
# The nesting marker: set in a run's environment; its value is the held slot's path, or
# "-" when the run holds none (cap 0, or the slots failed open).
NESTING_MARKER = "VOLUTE_TEST_SLOT"
SCOPE_PREFIX = "volute-test-"
DESCRIPTION_PREFIX = "volutectl test in "
# How many recent runs the typical duration looks at.
HISTORY_WINDOW = 20

Device = tuple[int, int]  # (major, minor)


@dataclass(frozen=True)
class Cap:
    """How many runs may be in flight, and which source said so."""

    slots: int
    source: str  # "--slots", "git config volute.testSlots", "tests.concurrent_runs (...)"


def resolve_cap(
    flag: int | None,
    repository_value: str | None,
    config_value: int,
    config_source: str = "default",
) -> Cap:
    """--slots, then the repository's own git config, then tests.concurrent_runs."""
    if flag is not None:
        if flag < 0:
            raise ConfigError(f"--slots {flag}: the cap must be 0 or more")
        return Cap(flag, "--slots")
    if repository_value is not None and repository_value.strip() != "":
        text = repository_value.strip()
        if not text.isdigit():
            raise ConfigError(
                f"{GIT_CONFIG_KEY} = {text!r}: not a whole number of slots",
                hint=f"fix it with `git config {GIT_CONFIG_KEY} N` (0 turns the cap off)",
            )
        return Cap(int(text), f"git config {GIT_CONFIG_KEY}")
    return Cap(config_value, f"{CONFIG_KEY} ({config_source})")


def slot_names(cap: int) -> list[str]:
    """The slot files a cap of N uses, in probe order: slot-1 first.

    Always probing from slot-1 packs runs onto the low slots, so files left behind by a
    lowered cap stay idle and inert."""
    return [f"slot-{index}" for index in range(1, cap + 1)]


def slot_index(name: str) -> int | None:
    """K for a slot file named `slot-K` as slot_names writes it (K >= 1, no leading zero
    or sign); None for any other name."""
    digits = name.removeprefix("slot-")
    if digits == name or not digits.isascii() or not digits.isdigit() or digits[0] == "0":
        return None
    return int(digits)


def choose_slot(free: Sequence[bool]) -> int | None:
    """The index (0-based) of the first free slot, or None when all are held."""
    for index, is_free in enumerate(free):
        if is_free:
            return index
    return None


# -- what a queued run says ---------------------------------------------------------------


@dataclass(frozen=True)
class InFlight:
    """A live run, as read from a scope in the tests slice."""

    unit: str
    worktree: str
    command: str
    running_seconds: float | None


def scope_description(worktree: str, command: Sequence[str]) -> str:
    """The scope's Description=, which is how other runs learn what this one is."""
    return f"{DESCRIPTION_PREFIX}{worktree}: {join_command(command)}"


def parse_scope_description(description: str) -> tuple[str, str] | None:
    """(worktree, command) from a description written by scope_description."""
    if not description.startswith(DESCRIPTION_PREFIX):
        return None
    rest = description[len(DESCRIPTION_PREFIX) :]
    worktree, separator, command = rest.partition(": ")
    if not separator:
        return None
    return worktree, command


def join_command(argv: Sequence[str]) -> str:
    """A shell-like one-line rendering, for humans (not for re-parsing)."""
    return " ".join(_quote(arg) for arg in argv)


def _quote(arg: str) -> str:
    if arg and all(ch.isalnum() or ch in "@%+=:,./-_" for ch in arg):
        return arg
    return "'" + arg.replace("'", "'\"'\"'") + "'"


def short_command(command: str, limit: int = 40) -> str:
    return command if len(command) <= limit else command[: limit - 1] + "…"


def wait_line(
    cap: int,
    in_flight: Sequence[InFlight],
    typical_ms: int | None,
    repository: str,
) -> str:
    """The one calm line a queued run prints on stderr."""
    plural = "run" if cap == 1 else "runs"
    parts = [f"volutectl test: waiting for a test slot ({cap} {plural} at a time in {repository})"]
    if in_flight:
        described = []
        for run in in_flight:
            age = ""
            if run.running_seconds is not None:
                age = f" for {format_duration(run.running_seconds)}"
            described.append(f"{run.worktree} `{short_command(run.command)}`{age}")
        parts.append("in flight: " + ", ".join(described))
    if typical_ms is not None:
        parts.append(f"a run typically takes {format_duration(typical_ms / 1000)}")
    return "; ".join(parts)


def wait_info(
    cap: int, cap_source: str, in_flight: Sequence[InFlight], typical_ms: int | None
) -> dict[str, object]:
    """The same facts as wait_line, for --json."""
    return {
        "cap": cap,
        "cap_source": cap_source,
        "in_flight": [
            {
                "unit": run.unit,
                "worktree": run.worktree,
                "command": run.command,
                "running_seconds": None
                if run.running_seconds is None
                else round(run.running_seconds, 3),
            }
            for run in in_flight
        ],
        "typical_ms": typical_ms,
    }


# -- history and the typical duration ------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    worktree: str
    command: str
    execution_ms: int
    exit_status: int


def history_line(record: RunRecord, finished_at: float) -> str:
    return (
        json.dumps(
            {
                "finished_at": round(finished_at, 3),
                "worktree": record.worktree,
                "command": record.command,
                "execution_ms": record.execution_ms,
                "exit_status": record.exit_status,
            },
            separators=(",", ":"),
        )
        + "\n"
    )


def parse_history(lines: Iterable[str]) -> list[RunRecord]:
    """Records from JSON lines; a torn or foreign line is skipped, never fatal."""
    records = []
    for line in lines:
        try:
            item = json.loads(line)
            records.append(
                RunRecord(
                    worktree=str(item["worktree"]),
                    command=str(item["command"]),
                    execution_ms=int(item["execution_ms"]),
                    exit_status=int(item["exit_status"]),
                )
            )
        except (ValueError, KeyError, TypeError):
            continue
    return records


def typical_duration_ms(records: Sequence[RunRecord], command: str | None = None) -> int | None:
    """The median execution time of recent successful runs (queue time excluded).

    Runs of the same command are preferred when there are any; failures are left out
    because a fail-fast run says little about how long a green one takes."""
    green = [record for record in records if record.exit_status == 0]
    same = [record for record in green if record.command == command]
    chosen = (same or green)[-HISTORY_WINDOW:]
    if not chosen:
        return None
    return median([record.execution_ms for record in chosen])


def median(values: Sequence[int]) -> int:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return int(math.floor((ordered[middle - 1] + ordered[middle]) / 2))


def test_scope_name(worktree_name: str, pid: int) -> str:
    """`volute-test-<escaped worktree name>-<pid>.scope`, within systemd's length limit."""
    tail = f"-{pid}.scope"
    room = UNIT_NAME_MAX - len(SCOPE_PREFIX) - len(tail)
    escaped = escape_unit_part(worktree_name) or "repository"
    if len(escaped) > room:
        escaped = escaped[:room]
        # Never end on half of a \xNN escape.
        cut = escaped.rfind("\\")
        if cut >= len(escaped) - 3:
            escaped = escaped[:cut]
    return f"{SCOPE_PREFIX}{escaped}{tail}"


# -- what the gate reads: /proc/locks and mountinfo --------------------------------------


def parse_proc_locks(text: str) -> frozenset[tuple[int, int, int]]:
    """(major, minor, inode) of every granted flock in /proc/locks text.

    `1: FLOCK  ADVISORY  WRITE 4242 fe:00:5309070 0 EOF` is held; a line with `->`
    after the number is a process blocked waiting for that lock, so it is skipped."""
    held = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        fields = parts[5].split(":")
        if len(fields) != 3:
            continue
        with contextlib.suppress(ValueError):
            held.add((int(fields[0], 16), int(fields[1], 16), int(fields[2])))
    return frozenset(held)


def parse_mount_device(mountinfo: str, path: str) -> Device | None:
    """The superblock device of the mount that holds `path` (absolute, resolved).

    The longest mount point that contains the path wins; of equal ones, the later line,
    which is the mount on top."""
    best: tuple[int, Device] | None = None
    for line in mountinfo.splitlines():
        parts = line.split()
        if len(parts) < 5:
            continue
        point = _unescape_mount(parts[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if not inside:
            continue
        major, _, minor = parts[2].partition(":")
        if not (major.isdigit() and minor.isdigit()):
            continue
        if best is None or len(point) >= best[0]:
            best = (len(point), (int(major), int(minor)))
    return None if best is None else best[1]


def _unescape_mount(text: str) -> str:
    """mountinfo writes space, tab, newline and backslash as \\ooo."""
    for code in ("040", "011", "012", "134"):
        text = text.replace("\\" + code, chr(int(code, 8)))
    return text
