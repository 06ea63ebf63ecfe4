"""Preflight: will each mind's turns start on this host, and what bounds them at once?

A mind whose user does not exist, whose command is missing or not executable by that
user, or whose working directory is missing fails every turn: each counts an attempt,
backs off, and its deliveries go dead some 20 minutes later. Preflight says so before
any delivery does. `volutectl config check` and `volutectl doctor` report every mind,
the gate logs each failing one when it starts, and `volutectl status` flags it.

What is checked is what a turn does (volutectl/launcher/fork.py, turn-wrapper.sh): as the
mind's user, in its working directory, /bin/sh runs the command's words with the turn's
environment. A list's first word is looked up in the turn's PATH as sh looks it up; a
string runs under /bin/sh -c, so only a plain leading command word can be checked, and
the rest is reported as unchecked. Permissions are computed for the mind's user from
modes and groups (volutectl/kernel/access.py), since the checker is often root. A mind's
environment_file must be root's alone (volutectl/launcher/envfile.py): as root it is read and
parsed as a turn's start would; another checker sees only what it may.

It also warns where minds are not kept apart (the turns still start): two minds that
run as one user share everything (files, /proc/PID/environ, signals); a mind's user in
the socket's group may use the socket, and one in group volute-admin may also read the
config (every mind's `environment`) and change others' work; a mind run as root may do
anything.
"""

from __future__ import annotations

import grp
import os
import re
import shlex
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from volutectl import events, roles
from volutectl.config.settings import MindSettings, Settings
from volutectl.errors import ConfigError, DataError, VoluteError
from volutectl.events import Emit
from volutectl.kernel.access import (
    EXECUTE,
    READ,
    Unknown,
    Who,
    blocking_directory,
    describe,
    permits,
    stat_or_none,
)
from volutectl.kernel.probes import block_device_dir, existing_ancestor
from volutectl.launcher import envfile, fork, home

# Debian's home for users that have none (Policy 9.2.1; the sysusers line of
# `volute-turn`): a mind of such a user, with no working_directory of its own, runs in a
# home of its own that the launcher makes (volutectl/launcher/home.py), never in "/".
NO_HOME = ("", "/nonexistent")

# What dash runs without a PATH lookup (POSIX special and regular built-ins).
SHELL_BUILTINS = frozenset(
    ": . [ alias bg break cd command continue echo eval exec exit export false fg getopts "
    "hash jobs kill local printf pwd read readonly return set shift test times trap true "
    "type ulimit umask unalias unset wait".split()
)
SHELL_RESERVED = frozenset(
    "! { } case do done elif else esac fi for if in then until while".split()
)
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)


# volutectl 0.1's default turn user, a member of group volute; an upgrade leaves it.
OLD_DEFAULT_USER = "volute"
APART_HINT = (
    "give each mind a user of its own (minds.NAME.user), neither root nor in the socket's "
    "group; the package's default turn user, volute-turn, is neither"
)


@dataclass(frozen=True)
class MindReport:
    """One mind's preflight: problems make every turn fail; notes say what was not
    checked; warnings say where it is not kept apart from other minds or the socket."""

    mind: str
    user: str
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    warnings: tuple[str, ...] = ()


Lookup = Callable[[str], fork.Account | None]
GroupLookup = Callable[[str], int | None]


def find_account(user: str) -> fork.Account | None:
    try:
        return fork.resolve_account(user)
    except DataError:
        return None


def find_group(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def who_of(account: fork.Account) -> Who:
    return Who(account.name, account.uid, account.gid, account.groups)


# -- the working directory ---------------------------------------------------------------


def uses_own_home(mind: MindSettings, account: fork.Account) -> bool:
    """Whether the mind's turns run in the home the launcher makes for it."""
    return mind.working_directory is None and account.home in NO_HOME


def working_directory(
    mind_name: str, mind: MindSettings, account: fork.Account, homes: Path = home.HOMES_DIR
) -> tuple[str, str]:
    """The directory a turn of this mind runs in, and how a message names it."""
    if mind.working_directory is not None:
        path = str(mind.working_directory)
        return path, f"working directory {path}"
    if uses_own_home(mind, account):
        path = str(home.home_of(mind_name, homes))
        return path, f"working directory {path} (the mind's own home)"
    return account.home, f"working directory {account.home} (the home of user {account.name!r})"


def directory_problem(path: str, what: str, who: Who) -> str | None:
    """Why `who` cannot run in `path`, or None. Unknown if this process may not look."""
    if not os.path.isabs(path):
        return f"{what} is not an absolute path"
    st = stat_or_none(path)
    if st is None:
        return f"{what} does not exist"
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} is not a directory"
    blocked = blocking_directory(path, who)
    if blocked is not None:
        parent, parent_st = blocked
        closed = f"{parent} is closed to it ({describe(parent_st)})"
        return f"user {who.name!r} cannot enter {what}: {closed}"
    if not permits(st, who, EXECUTE):
        return f"user {who.name!r} cannot enter {what} ({describe(st)})"
    return None


def turn_directory(
    mind_name: str, mind: MindSettings, account: fork.Account, homes: Path = home.HOMES_DIR
) -> str:
    """The working directory for a turn about to start; a DataError if it cannot be used.

    The turn's child enters it as the mind's user and never runs anywhere else, so a
    missing directory fails the start here, with its reason, instead of in the child.
    A mind's own home is made here (root's code: volutectl/launcher/home.py)."""
    if uses_own_home(mind, account):
        return home.ensure_home(mind_name, account.uid, account.gid, account.name, homes)
    path, what = working_directory(mind_name, mind, account)
    try:
        problem = directory_problem(path, what, who_of(account))
    except Unknown:
        return path  # not ours to see: the child's chdir, as the user, decides
    if problem is not None:
        raise DataError(problem, hint=f"create it, or set minds.{mind_name}.working_directory")
    return path


def own_home_problem(mind_name: str, account: fork.Account, homes: Path) -> str | None:
    """What keeps the launcher from making or using the mind's home, or None (a home
    not made yet is made at the mind's first turn)."""
    path = home.home_of(mind_name, homes)
    homes_st = stat_or_none(str(homes))
    if homes_st is not None and (problem := home.homes_problem(homes_st, homes)) is not None:
        return problem
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise Unknown(f"{homes} may not be searched") from None
    problem = home.home_problem(st, path, account.uid, account.name)
    return f"its home {problem}" if problem is not None else None


# -- the command -------------------------------------------------------------------------


def leading_word(script: str) -> tuple[str | None, str]:
    """The command word a shell command starts with, or None and why it cannot be told."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError as error:
        return None, f"it does not parse ({error})"
    index = 0
    while index < len(words) and ASSIGNMENT.fullmatch(words[index]):
        if words[index].startswith("PATH="):
            return None, "it sets PATH first"
        index += 1
    if index < len(words) - 1 and words[index] == "exec":
        index += 1
    if index == len(words):
        return None, "it runs no command"
    word = words[index]
    if word in SHELL_RESERVED or word[0] in "();&|<>":
        return None, f"it starts with {word!r}"
    if any(char in word for char in "$`*?[~"):
        return None, f"its first word {word!r} is expanded only when it runs"
    return word, ""


def executable_problem(path: str, who: Who) -> str | None:
    """Why `who` cannot execute the file at `path` (absolute), or None."""
    st = stat_or_none(path)
    if st is None:
        return f"command {path} does not exist"
    if stat.S_ISDIR(st.st_mode):
        return f"command {path} is a directory"
    if not stat.S_ISREG(st.st_mode):
        return f"command {path} is not a regular file"
    blocked = blocking_directory(path, who)
    if blocked is not None:
        parent, parent_st = blocked
        return (
            f"command {path} is out of reach of user {who.name!r}: {parent} is closed to it "
            f"({describe(parent_st)})"
        )
    if not permits(st, who, EXECUTE):
        return f"command {path} is not executable by user {who.name!r} ({describe(st)})"
    if _is_script(path) and not permits(st, who, READ):
        return f"command {path} is a script that user {who.name!r} may not read ({describe(st)})"
    return None


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(2) == b"#!"
    except OSError:
        return False


def command_problem(word: str, cwd: str, search_path: str, who: Who) -> str | None:
    """Why the turn's sh cannot run `word` as `who`, or None: a path (relative to the
    working directory), else the first file in PATH that `who` may execute."""
    if "/" in word:
        return executable_problem(os.path.join(cwd, word), who)
    found = []
    for directory in search_path.split(":"):
        candidate = os.path.join(cwd, directory or ".", word)
        st = stat_or_none(candidate)
        if st is not None and stat.S_ISREG(st.st_mode):
            found.append(os.path.normpath(candidate))
    if not found:
        return f"command {word!r} is not in the turn's PATH ({search_path})"
    problems = [executable_problem(candidate, who) for candidate in found]
    return None if None in problems else problems[0]


# -- one mind ----------------------------------------------------------------------------


# -- the environment file, and minds apart -----------------------------------------------


def environment_file_check(path: Path) -> tuple[dict[str, str], str | None, str | None]:
    """(its variables, a problem, a note) for a mind's environment file: read and parsed
    as a turn's start would, as root; only its owner, mode and directories otherwise."""
    try:
        if os.geteuid() == 0:
            return envfile.read_environment_file(path), None, None
        envfile.check_environment_file(path)
    except envfile.NotVisible as error:
        return {}, None, f"{error.message}; run as root to check it"
    except ConfigError as error:
        return {}, error.message, None
    return {}, None, f"environment file {path}: contents not checked; run as root to check them"


def isolation_warnings(
    account: fork.Account, settings: Settings, group_lookup: GroupLookup = find_group
) -> list[str]:
    """Where a mind's user lets its turns reach past the mind: root, or the socket's group."""
    if account.uid == 0:
        return [
            "runs as root: its turns may do anything on this host, every mind's secrets included"
        ]

    def member(group: str) -> bool:
        gid = group_lookup(group)
        return gid is not None and (gid == account.gid or gid in account.groups)

    old = " (volutectl 0.1's default turn user)" if account.name == OLD_DEFAULT_USER else ""
    if member(roles.ADMIN_GROUP):
        return [
            f"runs as user {account.name!r}{old}, a member of group {roles.ADMIN_GROUP!r}: "
            "its turns can read the config (every mind's environment) and pause, retry or "
            "drop any mind's deliveries"
        ]
    group = settings.gate.socket_group
    if not member(group):
        return []
    return [
        f"runs as user {account.name!r}{old}, a member of group {group!r}: its turns can "
        "use the gate's socket (deliver to any mind)"
    ]


def shared_user_warnings(reports: list[MindReport]) -> list[MindReport]:
    """Each report, with a warning if another mind runs as the same user."""
    by_user: dict[str, list[str]] = {}
    for report in reports:
        by_user.setdefault(report.user, []).append(report.mind)
    out = []
    for report in reports:
        others = [mind for mind in by_user[report.user] if mind != report.mind]
        if not others:
            out.append(report)
            continue
        which = f"mind {others[0]}" if len(others) == 1 else f"minds {', '.join(others)}"
        warning = (
            f"shares user {report.user!r} with {which}: each can read and change the "
            "other's files, read its turns' environment in /proc/PID/environ (secrets "
            "included) and signal its processes"
        )
        out.append(
            MindReport(
                mind=report.mind,
                user=report.user,
                problems=report.problems,
                notes=report.notes,
                warnings=(*report.warnings, warning),
            )
        )
    return out


# -- one mind ----------------------------------------------------------------------------


def check_mind(
    name: str,
    settings: Settings,
    lookup: Lookup = find_account,
    group_lookup: GroupLookup = find_group,
    homes: Path = home.HOMES_DIR,
) -> MindReport:
    mind = settings.minds[name]
    user = mind.user or settings.turns.default_user
    account = lookup(user)
    if account is None:
        return MindReport(name, user, (f"user {user!r} does not exist",), ())
    if mind.command is None:  # a daemon runs its turns: nothing of a command to check
        return MindReport(name, user, (), ("no command: it takes leases only",))
    who = who_of(account)
    problems: list[str] = []
    notes: list[str] = []
    warnings = isolation_warnings(account, settings, group_lookup)
    environment = dict(mind.environment)
    if mind.environment_file is not None:
        variables, problem, note = environment_file_check(mind.environment_file)
        environment.update(variables)
        problems += [problem] if problem else []
        notes += [note] if note else []
    cwd, what = working_directory(name, mind, account, homes)
    try:
        if uses_own_home(mind, account):
            problem = own_home_problem(name, account, homes)
            if not os.path.isdir(cwd):
                made = "the launcher makes it at the mind's first turn"
                notes.append(f"turns run in {cwd} (user {user!r} has no home; {made})")
        else:
            problem = directory_problem(cwd, what, who)
    except Unknown as unknown:
        notes.append(f"{what} not checked: {unknown}; run as root to check it")
    else:
        if problem is not None:
            problems.append(problem)
    word = mind.command[0] if isinstance(mind.command, list) else None
    if isinstance(mind.command, str):
        word, why = leading_word(mind.command)
        if word is None:
            notes.append(f"the shell command is not checked: {why}")
        else:
            notes.append(f"of the shell command only {word!r} is checked; sh -c runs the rest")
    if word in SHELL_BUILTINS:
        notes.append(f"{word!r} is a shell builtin")
    elif word is not None:
        search_path = environment.get("PATH", fork.TURN_PATH)
        try:
            problem = command_problem(word, cwd, search_path, who)
        except Unknown as unknown:
            notes.append(f"command {word!r} not checked: {unknown}; run as root to check it")
        else:
            if problem is not None:
                problems.append(problem)
    return MindReport(name, user, tuple(problems), tuple(notes), tuple(warnings))


def check_minds(
    settings: Settings, lookup: Lookup = find_account, group_lookup: GroupLookup = find_group
) -> list[MindReport]:
    reports = [check_mind(name, settings, lookup, group_lookup) for name in sorted(settings.minds)]
    return shared_user_warnings(reports)


def failing(settings: Settings, lookup: Lookup = find_account) -> dict[str, tuple[str, ...]]:
    """Each mind that fails preflight, with its problems."""
    return {r.mind: r.problems for r in check_minds(settings, lookup) if r.problems}


# What status shows is asked at most this often. It runs on the gate's loop, and 33 minds
# cost ~7 ms on a 2-core amd64 VM (more on a Pi): `watch volutectl status` must not make
# every delivery wait for it. A fix still shows within this long.
RECHECK_SECONDS = 2.0
_clock = time.monotonic
_last: tuple[Settings, float, dict[str, tuple[str, ...]]] | None = None


def failing_recently(settings: Settings) -> dict[str, tuple[str, ...]]:
    """failing(settings), asked again when the last answer for these settings is older
    than RECHECK_SECONDS (what status shows)."""
    global _last  # one gate per process; keyed on its settings object
    now = _clock()
    if _last is None or _last[0] is not settings or not 0 <= now - _last[1] < RECHECK_SECONDS:
        _last = (settings, now, failing(settings))
    return _last[2]


# -- the host: what bounds the turns at once, on flash storage most of all ---------------


def flash_kind(disk: Path) -> str | None:
    """'an SD card', 'eMMC' (or 'an SD card or eMMC') for an MMC disk, following a
    device-mapper or md device to the disks under it; None for any other disk."""
    slaves = disk / "slaves"
    for slave in sorted(slaves.iterdir()) if slaves.is_dir() else []:
        whole = slave.resolve()
        if (whole / "partition").exists():
            whole = whole.parent
        kind = flash_kind(whole)
        if kind is not None:
            return kind
    if not disk.name.startswith("mmcblk"):
        return None
    try:
        kind = (disk / "device" / "type").read_text().strip()
    except OSError:
        kind = ""
    return {"SD": "an SD card", "MMC": "eMMC"}.get(kind, "an SD card or eMMC")


def check_cap(
    settings: Settings,
    *,
    device: tuple[int, int] | None = None,
    sys_root: Path = Path("/sys"),
) -> tuple[Literal["ok", "warn"], str, str]:
    """(status, found, change): what bounds the turns running at once. The adaptive limit
    (on by default) protects any disk, under a ceiling if one is set; warn only when it is
    off and no cap is set on a host whose state directory is on an SD card or eMMC, where
    turns that all wake at once stall the storage."""
    limits = settings.limits
    cap = limits.global_concurrent_turns
    adaptive = limits.adaptive
    if adaptive.enabled:
        bounds = (
            f"limits.adaptive is on: between {adaptive.minimum} and {adaptive.maximum} turns "
            f"at once, starting at {adaptive.start}"
        )
        if cap is None:
            return "ok", f"{bounds}; no ceiling (limits.global_concurrent_turns is unset)", ""
        return "ok", f"{bounds}, under the ceiling limits.global_concurrent_turns = {cap}", ""
    off = (
        "limits.adaptive is off (limits.io_pressure is on)"
        if limits.adaptive_off_for_io_pressure
        else "limits.adaptive is off"
    )
    if cap is not None:
        return "ok", f"limits.global_concurrent_turns = {cap} ({off})", ""
    state_dir = settings.gate.state_dir
    if device is None:
        st_dev = existing_ancestor(state_dir).stat().st_dev
        device = (os.major(st_dev), os.minor(st_dev))
    disk = block_device_dir(*device, sys_root)
    kind = flash_kind(disk) if disk is not None else None
    unset = f"{off} and limits.global_concurrent_turns is unset"
    if disk is None or kind is None:
        where = f"on {disk.name}" if disk is not None else "on no block device"
        return "ok", f"{unset} (no global limit); {state_dir} is {where}", ""
    turn_on = (
        "set limits.io_pressure.enabled = false to let the adaptive limit take over"
        if limits.adaptive_off_for_io_pressure
        else "remove limits.adaptive.enabled = false (the adaptive limit is on by default)"
    )
    return (
        "warn",
        f"{unset}, and {state_dir} is on {disk.name}, {kind}: "
        "turns that all wake at once can stall it until the host starves",
        f"{turn_on}, or set limits.global_concurrent_turns = 2 in the config",
    )


def log_failing(settings: Settings, emit: Emit) -> None:
    """At the gate's start: one warning per mind whose turns cannot start."""
    try:
        reports = check_minds(settings)
    except (OSError, VoluteError) as error:  # never keep the gate from starting
        emit(events.PreflightFailed(error=str(error)))
        return
    for report in reports:
        if report.problems:
            problems = "; ".join(report.problems)
            emit(events.MindFailsPreflight(mind=report.mind, problems=problems))
