"""Preflight of each mind (volutectl/launcher/preflight.py, volutectl/kernel/access.py):
will its turns start, as its user, with its command, in its working directory?

The checks run against real files in a directory every user may search, for a mind user
that is made up (`MIND`, a uid no file here belongs to), so that permissions are
computed for another user than the checker, as root's preflight must. The host's checks
and the commands' exact lines and exit codes are in tests/unit/test_preflight_host.py.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from volutectl.config.settings import Settings
from volutectl.kernel import access
from volutectl.kernel.access import EXECUTE, READ, WRITE, Who, permits
from volutectl.launcher import preflight
from volutectl.launcher.fork import TURN_PATH, Account

VOLUTECTL = Path(sys.executable).parent / "volutectl"
ME = pwd.getpwuid(os.getuid()).pw_name
MY_GROUP = grp.getgrgid(os.getgid()).gr_name
OWNER = f"{ME}:{MY_GROUP}"  # what describe() says of the files made here
MIND = Account("mindy", 64001, 64001, (64001,), "/nonexistent")


@pytest.fixture
def tree() -> Iterator[Path]:
    """A directory under /tmp that every user may search (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="volute-preflight-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def executable(path: Path, mode: int = 0o755, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def settings(**mind: object) -> Settings:
    return Settings(minds={"m": {"user": MIND.name, **mind}})


def report(account: Account | None = MIND, **mind: object) -> preflight.MindReport:
    return preflight.check_mind("m", settings(**mind), lambda user: account)


# -- permissions from mode, owner and groups ---------------------------------------------


def stat_of(mode: int, uid: int, gid: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))


REGULAR, DIRECTORY = 0o100000, 0o040000


def test_the_owner_bits_apply_to_the_owner_even_where_the_group_bits_allow_more() -> None:
    owner = Who("o", 10, 10, (20,))
    member = Who("g", 11, 11, (20,))
    other = Who("x", 12, 12, ())
    st = stat_of(REGULAR | 0o075, 10, 20)
    assert not permits(st, owner, EXECUTE)  # owner: ---
    assert permits(st, member, READ | WRITE | EXECUTE)  # group: rwx
    assert permits(st, other, READ | EXECUTE) and not permits(st, other, WRITE)  # other: r-x
    assert permits(stat_of(REGULAR | 0o070, 10, 11), member, EXECUTE)  # primary group


def test_root_may_do_anything_but_execute_a_file_without_an_execute_bit() -> None:
    root = Who("root", 0, 0, (0,))
    assert permits(stat_of(REGULAR | 0o000, 5, 5), root, READ | WRITE)
    assert not permits(stat_of(REGULAR | 0o644, 5, 5), root, EXECUTE)
    assert permits(stat_of(REGULAR | 0o001, 5, 5), root, EXECUTE)
    assert permits(stat_of(DIRECTORY | 0o000, 5, 5), root, EXECUTE)  # search


# -- the user ----------------------------------------------------------------------------


def test_a_missing_user_is_the_one_problem() -> None:
    result = report(None, command=["/bin/true"])
    assert result.problems == ("user 'mindy' does not exist",)
    assert result.user == "mindy"


def test_a_mind_without_a_user_runs_as_the_default_user(tree: Path) -> None:
    seen: list[str] = []

    def lookup(user: str) -> Account:
        seen.append(user)
        return MIND

    config = Settings(minds={"m": {"command": ["/bin/true"], "working_directory": tree}})
    assert preflight.check_mind("m", config, lookup).user == "volute-turn"
    assert seen == ["volute-turn"]


# -- the command -------------------------------------------------------------------------


def test_a_command_that_is_not_in_the_turns_path(tree: Path) -> None:
    result = report(command=["no-such-turn-command", "-x"], working_directory=str(tree))
    assert result.problems == (
        f"command 'no-such-turn-command' is not in the turn's PATH ({TURN_PATH})",
    )


def test_a_command_path_that_does_not_exist(tree: Path) -> None:
    result = report(command=[f"{tree}/turn"], working_directory=str(tree))
    assert result.problems == (f"command {tree}/turn does not exist",)


def test_a_command_that_is_not_executable(tree: Path) -> None:
    turn = executable(tree / "turn", 0o644)
    result = report(command=[str(turn)], working_directory=str(tree))
    assert result.problems == (
        f"command {turn} is not executable by user 'mindy' (mode 0644, owner {OWNER})",
    )


def test_a_command_that_only_its_owner_may_execute(tree: Path) -> None:
    """Executable, by its owner (the checker): not by the mind's user."""
    turn = executable(tree / "turn", 0o700)
    assert os.access(turn, os.X_OK)  # the checker may; the mind's user may not
    result = report(command=[str(turn)], working_directory=str(tree))
    assert result.problems == (
        f"command {turn} is not executable by user 'mindy' (mode 0700, owner {OWNER})",
    )
    member = Account("mindy", 64001, 64001, (64001, os.getgid()), "/nonexistent")
    turn.chmod(0o750)  # its group may: a member of it passes
    assert report(member, command=[str(turn)], working_directory=str(tree)).problems == ()


def test_a_script_its_user_may_execute_but_not_read(tree: Path) -> None:
    turn = executable(tree / "turn", 0o711)
    result = report(command=[str(turn)], working_directory=str(tree))
    assert result.problems == (
        f"command {turn} is a script that user 'mindy' may not read (mode 0711, owner {OWNER})",
    )


def test_a_command_behind_a_directory_its_user_may_not_enter(tree: Path) -> None:
    private = tree / "private"
    private.mkdir(mode=0o700)
    turn = executable(private / "turn")
    result = report(command=[str(turn)], working_directory=str(tree))
    assert result.problems == (
        f"command {turn} is out of reach of user 'mindy': {private} is closed to it "
        f"(mode 0700, owner {OWNER})",
    )


def test_a_command_is_looked_up_in_the_minds_own_path_and_relative_to_its_directory(
    tree: Path,
) -> None:
    executable(tree / "turn")
    assert (
        report(
            command=["turn"], working_directory=str(tree), environment={"PATH": str(tree)}
        ).problems
        == ()
    )
    assert report(command=["./turn"], working_directory=str(tree)).problems == ()
    assert report(command=["sh", "-c", "true"], working_directory=str(tree)).problems == ()


def test_the_first_executable_file_in_path_wins(tree: Path) -> None:
    """As sh finds it: a file its user may not execute earlier in PATH is passed over."""
    (tree / "a").mkdir(mode=0o755)
    (tree / "b").mkdir(mode=0o755)
    executable(tree / "a" / "turn", 0o700)
    executable(tree / "b" / "turn", 0o755)
    both = f"{tree}/a:{tree}/b"
    assert (
        report(command=["turn"], working_directory=str(tree), environment={"PATH": both}).problems
        == ()
    )
    (tree / "b" / "turn").chmod(0o700)
    result = report(command=["turn"], working_directory=str(tree), environment={"PATH": both})
    assert result.problems == (
        f"command {tree}/a/turn is not executable by user 'mindy' (mode 0700, owner {OWNER})",
    )


@pytest.mark.parametrize(
    ("script", "word", "why"),
    [
        ("exec /opt/turn --once", "/opt/turn", ""),
        ("MODEL=small LANG=C run-turn arg", "run-turn", ""),
        ("cd /srv && exec ./run", "cd", ""),
        ("PATH=/opt/bin turn", None, "it sets PATH first"),
        ("if true; then x; fi", None, "it starts with 'if'"),
        ("(cd /srv; run)", None, "it starts with '('"),
        ("$HOME/bin/turn", None, "its first word '$HOME/bin/turn' is expanded only when it runs"),
        ("echo 'unfinished", None, "it does not parse (No closing quotation)"),
        ("A=1", None, "it runs no command"),
    ],
)
def test_the_leading_word_of_a_shell_command(script: str, word: str | None, why: str) -> None:
    assert preflight.leading_word(script) == (word, why)


def test_a_shell_command_checks_its_leading_word_and_says_the_rest_is_not(tree: Path) -> None:
    result = report(command="exec no-such-turn-command --once", working_directory=str(tree))
    assert result.problems == (
        f"command 'no-such-turn-command' is not in the turn's PATH ({TURN_PATH})",
    )
    assert result.notes == (
        "of the shell command only 'no-such-turn-command' is checked; sh -c runs the rest",
    )
    builtin = report(command="cd /srv && ./run", working_directory=str(tree))
    assert builtin.problems == ()
    assert builtin.notes == (
        "of the shell command only 'cd' is checked; sh -c runs the rest",
        "'cd' is a shell builtin",
    )
    opaque = report(command="if true; then x; fi", working_directory=str(tree))
    assert opaque.notes == ("the shell command is not checked: it starts with 'if'",)


# -- the working directory ---------------------------------------------------------------


def test_a_missing_working_directory(tree: Path) -> None:
    result = report(command=["/bin/sh"], working_directory=str(tree / "gone"))
    assert result.problems == (f"working directory {tree}/gone does not exist",)


def test_a_missing_home_as_the_working_directory(tree: Path) -> None:
    homeless = Account("mindy", 64001, 64001, (64001,), f"{tree}/home/mindy")
    result = report(homeless, command=["/bin/sh"])
    assert result.problems == (
        f"working directory {tree}/home/mindy (the home of user 'mindy') does not exist",
    )


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another uid")


@needs_root
def test_a_user_with_no_home_runs_in_a_home_of_the_minds_own(tree: Path) -> None:
    # MIND's home is /nonexistent, Debian's "none": never "/", but HOMES_DIR/m.
    result = preflight.check_mind("m", settings(command=["/bin/sh"]), lambda user: MIND, homes=tree)
    assert result.problems == ()
    made = "the launcher makes it at the mind's first turn"
    assert result.notes == (f"turns run in {tree}/m (user 'mindy' has no home; {made})",)
    (tree / "m").mkdir()
    os.chown(tree / "m", MIND.uid, MIND.gid)
    result = preflight.check_mind("m", settings(command=["/bin/sh"]), lambda user: MIND, homes=tree)
    assert (result.problems, result.notes) == ((), ())


@needs_root
def test_a_link_or_another_users_directory_as_the_minds_home_fails(tree: Path) -> None:
    (tree / "m").symlink_to("/etc")
    result = preflight.check_mind("m", settings(command=["/bin/sh"]), lambda user: MIND, homes=tree)
    assert result.problems == (f"its home {tree}/m is a symbolic link",)
    (tree / "m").unlink()
    (tree / "m").mkdir()
    os.chown(tree / "m", MIND.uid + 1, MIND.gid)
    result = preflight.check_mind("m", settings(command=["/bin/sh"]), lambda user: MIND, homes=tree)
    assert result.problems == (f"its home {tree}/m belongs to uid 64002, not to user 'mindy'",)


def test_a_working_directory_its_user_may_not_enter(tree: Path) -> None:
    closed = tree / "closed"
    closed.mkdir(mode=0o700)
    result = report(command=["/bin/sh"], working_directory=str(closed))
    assert result.problems == (
        f"user 'mindy' cannot enter working directory {closed} (mode 0700, owner {OWNER})",
    )
    inner = closed / "inner"
    inner.mkdir(mode=0o755)
    result = report(command=["/bin/sh"], working_directory=str(inner))
    assert result.problems == (
        f"user 'mindy' cannot enter working directory {inner}: {closed} is closed to it "
        f"(mode 0700, owner {OWNER})",
    )


def test_a_working_directory_that_is_a_file_or_relative(tree: Path) -> None:
    executable(tree / "file")
    assert report(command=["/bin/sh"], working_directory=str(tree / "file")).problems == (
        f"working directory {tree}/file is not a directory",
    )
    assert report(command=["/bin/sh"], working_directory="srv/mind").problems == (
        "working directory srv/mind is not an absolute path",
    )


def test_what_the_checker_may_not_look_at_is_a_note_not_a_problem(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(path: str) -> os.stat_result:
        raise access.Unknown(path)

    monkeypatch.setattr(preflight, "stat_or_none", refused)
    result = report(command=["turn"], working_directory=str(tree))
    assert result.problems == ()
    assert result.notes[0].startswith(
        f"working directory {tree} not checked: cannot look at {tree}"
    )
    assert result.notes[0].endswith("(permission denied); run as root to check it")


# -- minds apart: shared users, the socket's group, root, secrets ------------------------

SOCKET_GID = 64100  # the made-up gid of group volute (gate.socket_group) below
ADMIN_GID = 64101  # and of group volute-admin


def apart_report(
    account: Account, *, group: int | None = SOCKET_GID, **mind: object
) -> preflight.MindReport:
    def lookup(user: str) -> Account:
        return account

    gids = {"volute": group, "volute-admin": ADMIN_GID}
    config = Settings(minds={"m": {"command": ["/bin/true"], "user": account.name, **mind}})
    return preflight.check_mind("m", config, lookup, gids.get)


def test_a_user_of_its_own_outside_the_group_gets_no_warning() -> None:
    assert apart_report(MIND).warnings == ()
    assert apart_report(MIND, group=None).warnings == ()  # no such group on this host


@pytest.mark.parametrize(
    "account",
    [
        Account("agent", 64002, 64002, (64002, SOCKET_GID), "/nonexistent"),  # supplementary
        Account("agent", 64002, SOCKET_GID, (SOCKET_GID,), "/nonexistent"),  # primary
    ],
)
def test_a_user_in_the_sockets_group_is_warned_of(account: Account) -> None:
    assert apart_report(account).warnings == (
        "runs as user 'agent', a member of group 'volute': its turns can use the gate's "
        "socket (deliver to any mind)",
    )


def test_a_user_in_the_admin_group_is_warned_it_reads_the_config() -> None:
    admin = Account("agent", 64002, 64002, (64002, SOCKET_GID, ADMIN_GID), "/nonexistent")
    [warning] = apart_report(admin).warnings
    assert "member of group 'volute-admin'" in warning and "read the config" in warning


def test_the_old_default_turn_user_is_named_as_such() -> None:
    # volutectl 0.1's default, left by an upgrade: a config naming it still runs.
    old = Account("volute", 998, SOCKET_GID, (SOCKET_GID,), "/nonexistent")
    report = apart_report(old)
    assert report.problems == ()
    [warning] = report.warnings
    assert warning.startswith("runs as user 'volute' (volutectl 0.1's default turn user), a ")


def test_root_is_warned_of() -> None:
    root = Account("root", 0, 0, (0,), "/root")
    assert apart_report(root).warnings == (
        "runs as root: its turns may do anything on this host, every mind's secrets included",
    )


def test_minds_that_share_a_user_are_each_warned_of_the_others() -> None:
    accounts = {
        "volute-turn": Account("volute-turn", 64010, 64010, (64010,), "/nonexistent"),
        "bob": Account("bob", 64011, 64011, (64011,), "/nonexistent"),
    }
    config = Settings(
        minds={
            "a": {"command": ["/bin/true"]},  # the default user
            "b": {"command": ["/bin/true"], "user": "volute-turn"},
            "c": {"command": ["/bin/true"]},
            "own": {"command": ["/bin/true"], "user": "bob"},
        }
    )
    reports = {
        report.mind: report
        for report in preflight.check_minds(config, accounts.get, lambda name: SOCKET_GID)
    }
    shares = (
        "shares user 'volute-turn' with {}: each can read and change the other's files, read "
        "its turns' environment in /proc/PID/environ (secrets included) and signal its processes"
    )
    assert reports["a"].warnings == (shares.format("minds b, c"),)
    assert reports["b"].warnings == (shares.format("minds a, c"),)
    assert reports["c"].warnings == (shares.format("minds a, b"),)
    assert reports["own"].warnings == ()
    assert all(report.problems == () for report in reports.values())


def secret_file(directory: Path, text: str, mode: int = 0o600) -> Path:
    path = directory / "m.env"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_an_environment_file_open_to_others_fails_preflight(tmp_path: Path) -> None:
    assert os.geteuid() == 0, "run as root, as the gate's preflight does"
    path = secret_file(tmp_path, "API_KEY=sk-1\n", 0o640)
    report = apart_report(MIND, environment_file=str(path))
    [problem] = report.problems
    assert problem.startswith(f"environment file {path}: is open to group or others")


def test_an_environment_file_that_does_not_parse_fails_preflight(tmp_path: Path) -> None:
    assert os.geteuid() == 0, "run as root, as the gate's preflight does"
    path = secret_file(tmp_path, "API_KEY=sk-1\nsk-2\n")
    assert apart_report(MIND, environment_file=str(path)).problems == (
        f"environment file {path}: line 2 has no '='",
    )


def test_the_environment_files_path_is_where_the_command_is_looked_up(
    tmp_path: Path, tree: Path
) -> None:
    assert os.geteuid() == 0, "run as root, as the gate's preflight does"
    executable(tree / "agent-turn")
    path = secret_file(tmp_path, f"PATH={tree}:/usr/bin\n")
    command, directory = ["agent-turn"], str(tree)
    found = apart_report(
        MIND, environment_file=str(path), command=command, working_directory=directory
    )
    assert found.problems == ()
    missing = apart_report(MIND, command=command, working_directory=directory).problems
    assert missing == (f"command 'agent-turn' is not in the turn's PATH ({TURN_PATH})",)


def test_another_checker_than_root_checks_only_owner_and_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = secret_file(tmp_path, "does not parse\n")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    report = apart_report(MIND, environment_file=str(path))
    assert report.problems == ()
    unchecked = f"environment file {path}: contents not checked; run as root to check them"
    assert unchecked in report.notes
    path.chmod(0o644)
    [problem] = apart_report(MIND, environment_file=str(path)).problems
    assert problem.startswith(f"environment file {path}: is open to group or others")
