"""The top-level `volutectl` entry point: help, usage errors (64) and --debug.

These run the installed console script, as a user would.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from volutectl import cli
from volutectl.cli import COMMANDS, options

VOLUTECTL = Path(sys.executable).parent / "volutectl"


def volutectl(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("VOLUTE_")}
    clean.update(env)
    return subprocess.run(
        [str(VOLUTECTL), *args], capture_output=True, text=True, env=clean, timeout=60
    )


def test_help_lists_every_command() -> None:
    result = volutectl("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: volutectl")
    commands = result.stdout.split("Commands:", 1)[1]
    for name, (_, _, help_text) in COMMANDS.items():
        assert f"  {name} " in commands
        assert help_text in commands
    assert "--debug" in result.stdout


def test_short_help_option() -> None:
    assert volutectl("-h").stdout == volutectl("--help").stdout


def test_no_arguments_shows_usage() -> None:
    result = volutectl()
    assert "Usage: volutectl" in result.stdout + result.stderr
    assert result.returncode in (0, 64)


def test_unknown_command_exits_64() -> None:
    result = volutectl("frobnicate")
    assert result.returncode == 64
    assert "frobnicate" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_option_exits_64() -> None:
    result = volutectl("config", "check", "--no-such-option")
    assert result.returncode == 64
    assert "--no-such-option" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--debug", "--help"),
        ("--help", "--debug"),
        ("--debug", "config", "show"),
        ("--debug", "--debug", "config", "show"),
    ],
)
def test_debug_is_accepted_before_the_command(args: tuple[str, ...]) -> None:
    result = volutectl(*args, VOLUTE_CONFIG="")
    assert result.returncode == 0, result.stderr
    assert "no such option" not in result.stderr.lower()


@pytest.mark.parametrize(
    ("argv", "debug", "rest"),
    [
        (["--debug", "status"], True, ["status"]),
        (["status", "--debug"], False, ["status", "--debug"]),
        (["-h", "--debug"], True, ["-h"]),
        (["test", "--", "pytest", "--debug"], False, ["test", "--", "pytest", "--debug"]),
        (["--debug", "test", "--", "pytest", "--debug"], True, ["test", "--", "pytest", "--debug"]),
        (["deliver", "m", "-m", "--debug"], False, ["deliver", "m", "-m", "--debug"]),
        (["--", "--debug"], False, ["--", "--debug"]),
        ([], False, []),
    ],
)
def test_debug_is_taken_only_before_the_command_name(
    argv: list[str], debug: bool, rest: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VOLUTE_DEBUG", raising=False)
    assert cli.split_debug(argv) == (debug, rest)
    monkeypatch.setenv("VOLUTE_DEBUG", "1")
    assert cli.split_debug(argv) == (True, rest)


def test_a_debug_after_the_command_is_the_commands(tmp_path: Path) -> None:
    """`volutectl test -- CMD --debug` hands --debug to CMD; after a click command it is
    that command's option, which it does not have (64)."""
    seen = tmp_path / "argv"
    script = f"import sys; open({str(seen)!r}, 'w').write(repr(sys.argv[1:]))"
    result = volutectl("test", "--slots", "0", "--", sys.executable, "-c", script, "--debug")
    assert result.returncode == 0, result.stderr
    assert seen.read_text() == "['--debug']"
    refused = volutectl("status", "--debug")
    assert refused.returncode == 64
    assert "No such option" in refused.stderr and "--debug" in refused.stderr


def test_debug_still_exits_64_for_unknown_command() -> None:
    result = volutectl("--debug", "frobnicate")
    assert result.returncode == 64


def test_volute_debug_variable_gives_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[limits]\nbogus = 1\n")
    quiet = volutectl("config", "check", "--config", str(bad))
    loud = volutectl("config", "check", "--config", str(bad), VOLUTE_DEBUG="1")
    assert quiet.returncode == loud.returncode == 78
    assert "Traceback" not in quiet.stderr
    assert "Traceback" in loud.stderr


def test_version() -> None:
    result = volutectl("--version")
    assert result.returncode == 0
    assert "volutectl" in result.stdout and "version" in result.stdout


def _commands_with_config() -> dict[str, click.Command]:
    """Every command and subcommand, by its full name, that takes --config."""
    found: dict[str, click.Command] = {}

    def walk(name: str, command: click.Command) -> None:
        if any("--config" in getattr(p, "opts", []) for p in command.params):
            found[name] = command
        if isinstance(command, click.Group):
            for sub_name, sub in command.commands.items():
                walk(f"{name} {sub_name}", sub)

    for name, (module, attribute, _) in COMMANDS.items():
        walk(name, getattr(importlib.import_module(module), attribute))
    return found


def test_one_config_option_everywhere() -> None:
    """--config is defined once (volutectl.cli.options) and means the same in every command."""
    found = _commands_with_config()
    assert sorted(found) == [
        "config check", "config show", "doctor", "gate", "lease", "logs", "pause", "queue",
        "resume", "status", "test", "wait",
    ]  # fmt: skip

    @click.command()
    @options.config_option
    def probe(config_path: str | None) -> None:
        """Only carries the option."""

    [reference] = probe.params
    assert isinstance(reference, click.Option)
    for name, command in found.items():
        [param] = [p for p in command.params if "--config" in getattr(p, "opts", [])]
        assert isinstance(param, click.Option), name
        assert (param.name, param.help, param.metavar) == (
            reference.name, reference.help, reference.metavar,
        ), name  # fmt: skip
        assert param.type == reference.type, name


@pytest.mark.parametrize("args", [["gate"], ["test", "--slots", "0"], ["config", "check"]])
def test_a_directory_as_config_is_a_config_error(tmp_path: Path, args: list[str]) -> None:
    """78 from every command, naming the directory, not click's usage error (64)."""
    command = [*args, "--config", str(tmp_path)]
    if args[0] == "test":
        command += ["--", "true"]
    result = volutectl(*command)
    assert result.returncode == 78, result.stderr
    assert f"{tmp_path}: is a directory" in result.stderr
