"""Shell completion, as the shells' scripts ask for it: the console script run with
_VOLUTECTL_COMPLETE and the words typed so far. The install tier runs the same scripts
in real bash, zsh and fish (tests/install/test_package.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from volutectl.cli import COMMANDS

VOLUTECTL = Path(sys.executable).parent / "volutectl"
CHECKOUT = Path(__file__).resolve().parents[2]
SCRIPTS = {  # shell -> the file the package installs for it
    "bash": CHECKOUT / "packaging" / "completion" / "volutectl",
    "zsh": CHECKOUT / "packaging" / "completion" / "_volutectl",
    "fish": CHECKOUT / "packaging" / "completion" / "volutectl.fish",
}
CONFIG = """\
[minds.mimsy]
command = "true"

[minds."whorl.v2"]
command = ["true"]

[minds.pip]
command = "true"
"""


def env(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("VOLUTE_")}
    clean.update(extra)
    return clean


def complete(line: str, **extra: str) -> list[str]:
    """bash's view: the values offered after `line` (the last word is being typed)."""
    words = line.split(" ")
    result = subprocess.run(
        [str(VOLUTECTL)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(
            _VOLUTECTL_COMPLETE="bash_complete",
            COMP_WORDS=line,
            COMP_CWORD=str(len(words) - 1),
            **extra,
        ),
    )
    assert result.returncode == 0, result.stderr
    return [item.split(",", 1)[1] for item in result.stdout.split()]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "volutectl.toml"
    path.write_text(CONFIG)
    return path


def test_the_commands_and_volutectls_own_options() -> None:
    assert complete("volutectl ") == sorted(COMMANDS)
    assert complete("volutectl qu") == ["queue"]
    assert complete("volutectl --") == ["--debug", "--version", "--help"]


def test_listing_the_commands_imports_none_of_them() -> None:
    """A TAB must stay quick: no pydantic, no command module, just the table."""
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(sorted(m for m in sys.modules"
        " if m.startswith(('volutectl.', 'pydantic')))))\n"
        "from volutectl.cli import main\nmain([])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(_VOLUTECTL_COMPLETE="bash_complete", COMP_WORDS="volutectl ", COMP_CWORD="1"),
    )
    assert "plain,status" in result.stdout.split()
    assert result.stdout.splitlines()[-1] == "['volutectl.cli']"


def test_deliver_completes_the_configs_minds_then_its_options(config: Path) -> None:
    assert complete("volutectl deliver ", VOLUTE_CONFIG=str(config)) == ["mimsy", "pip", "whorl.v2"]
    assert complete("volutectl deliver p", VOLUTE_CONFIG=str(config)) == ["pip"]
    assert complete(f"volutectl deliver --config {config} w") == ["whorl.v2"]
    assert complete("volutectl deliver mimsy ", VOLUTE_CONFIG=str(config)) == []  # one mind
    assert complete("volutectl deliver mimsy --") == [
        "--help", "--session", "--message", "--interrupt", "--wait", "--max-wait",
        "--request-id", "--socket", "--config", "--timeout",
    ]  # fmt: skip
    assert complete("volutectl deliver mimsy -m ") == []  # free text
    assert complete("volutectl deliver mimsy --socket ") == [""]  # type file: the shell's


def test_deliver_batch_completes_no_mind_and_no_option_a_line_gives(config: Path) -> None:
    assert "--batch" in complete("volutectl deliver --")
    assert complete("volutectl deliver --batch ", VOLUTE_CONFIG=str(config)) == []
    assert complete("volutectl deliver --batch --") == [
        "--help", "--wait", "--max-wait", "--batch", "--socket", "--config", "--timeout",
    ]  # fmt: skip
    assert complete("volutectl deliver --batch --socket ") == [""]


def test_pause_and_resume_complete_the_configs_minds(config: Path) -> None:
    for command in ("pause", "resume"):
        line = f"volutectl {command} "
        assert complete(line, VOLUTE_CONFIG=str(config)) == ["mimsy", "pip", "whorl.v2"]
        assert complete(f"{line}mimsy w", VOLUTE_CONFIG=str(config)) == ["whorl.v2"]
        assert complete(f"{line}--config {config} p") == ["pip"]


def test_logs_completes_the_configs_minds(config: Path) -> None:
    assert complete("volutectl logs ", VOLUTE_CONFIG=str(config)) == ["mimsy", "pip", "whorl.v2"]
    assert complete(f"volutectl logs --config {config} w") == ["whorl.v2"]


def test_lease_completes_the_configs_minds_its_options_and_this_users_pids(
    config: Path,
) -> None:
    assert complete("volutectl lease ", VOLUTE_CONFIG=str(config)) == ["mimsy", "pip", "whorl.v2"]
    assert complete("volutectl lease --") == [
        "--session", "--pid", "--end", "--request-id", "--timeout", "--socket", "--config",
        "--help",
    ]  # fmt: skip
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        offered = complete(f"volutectl lease mimsy --pid {sleeper.pid}")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert str(sleeper.pid) in offered
    assert all(pid.isdigit() and pid.startswith(str(sleeper.pid)) for pid in offered)


def test_an_unreadable_or_missing_config_completes_no_mind(tmp_path: Path) -> None:
    assert complete("volutectl deliver ", VOLUTE_CONFIG=str(tmp_path / "absent.toml")) == []
    broken = tmp_path / "broken.toml"
    broken.write_text("[minds\n")
    assert complete("volutectl deliver ", VOLUTE_CONFIG=str(broken)) == []


def test_queue_states_and_other_options() -> None:
    assert complete("volutectl queue list --state ") == [
        "pending", "running", "done", "dead", "dropped",
    ]  # fmt: skip
    assert complete("volutectl queue list --state d") == ["done", "dead", "dropped"]
    assert complete("volutectl queue ") == ["drop", "list", "retry"]
    assert "--slots" in complete("volutectl test --")
    assert complete("volutectl config ") == ["check", "show"]


def test_file_values_are_left_to_the_shell() -> None:
    result = subprocess.run(
        [str(VOLUTECTL)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(
            _VOLUTECTL_COMPLETE="bash_complete",
            COMP_WORDS="volutectl status --config ",
            COMP_CWORD="3",
        ),
    )
    assert result.stdout.split() == ["file,"]


@pytest.mark.parametrize("shell", sorted(SCRIPTS))
def test_the_packaged_scripts_are_clicks_for_this_program(shell: str) -> None:
    """Each script only hands the words to volutectl; regenerate with
    _VOLUTECTL_COMPLETE={shell}_source volutectl > packaging/completion/FILE."""
    result = subprocess.run(
        [str(VOLUTECTL)], capture_output=True, text=True, timeout=60,
        env=env(_VOLUTECTL_COMPLETE=f"{shell}_source"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert SCRIPTS[shell].read_text() == result.stdout


# What each script sends as COMP_CWORD: zsh the index of the word being typed, fish the
# word itself (`commandline -t`); and how each reads the answer.
SHELLS: dict[str, tuple[str, Callable[[str], list[str]]]] = {
    "zsh": ("2", lambda out: out.splitlines()[1::3]),  # type, value, help: 3 lines each
    "fish": ("", lambda out: [item.split(",", 1)[1] for item in out.split()]),
}


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_zsh_and_fish_get_the_same_answers(shell: str, config: Path) -> None:
    cword, values = SHELLS[shell]
    result = subprocess.run(
        [str(VOLUTECTL)], capture_output=True, text=True, timeout=60,
        env=env(_VOLUTECTL_COMPLETE=f"{shell}_complete", COMP_WORDS="volutectl deliver ",
                COMP_CWORD=cword, VOLUTE_CONFIG=str(config)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert values(result.stdout) == ["mimsy", "pip", "whorl.v2"]
