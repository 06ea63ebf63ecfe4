"""packaging/volutectl.1 against the program: every exit code volutectl can end with,
and every command's options as `volutectl COMMAND --help` lists them."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import click

from volutectl import errors
from volutectl.cli import COMMANDS
from volutectl.cli.deliver import _deliver_parser
from volutectl.core import admission

CHECKOUT = Path(__file__).resolve().parents[2]
MANPAGE = CHECKOUT / "packaging" / "volutectl.1"
HELP_OPTIONS = {"-h", "--help"}  # said once, for every command, under OPTIONS


def plain(roff: str) -> str:
    """The text of roff source: font escapes gone, \\- as -, no quotes around arguments."""
    text = re.sub(r"\\f[BIRP]", "", roff).replace("\\-", "-")
    return text.replace('"', "")


def sections(level: str) -> dict[str, str]:
    """`.SH`/`.SS` heading -> the plain text under it, up to the next heading of any level."""
    found: dict[str, str] = {}
    heading = None
    for line in MANPAGE.read_text().splitlines():
        if line.startswith((".SH ", ".SS ")):
            heading = plain(line[4:]).strip() if line.startswith(level) else None
            if heading is not None:
                found[heading] = ""
        elif heading is not None:
            found[heading] += plain(line) + "\n"
    return found


def commands() -> dict[str, click.Command]:
    """Every command and subcommand, by its full name (deliver's click face aside)."""
    found: dict[str, click.Command] = {}

    def walk(name: str, command: click.Command) -> None:
        found[name] = command
        if isinstance(command, click.Group):
            for sub_name, sub in command.commands.items():
                walk(f"{name} {sub_name}", sub)

    for name, (module, attribute, _) in COMMANDS.items():
        if name != "deliver":
            walk(name, getattr(importlib.import_module(module), attribute))
    return found


def options_of(command: click.Command) -> set[str]:
    opts = {o for p in command.params if isinstance(p, click.Option) for o in p.opts}
    return opts - HELP_OPTIONS


def documented() -> dict[str, str]:
    """The COMMANDS section's subsections by the command they name: the leading words of
    their heading that are command names ("queue [list|retry|drop]" -> "queue")."""
    by_command: dict[str, str] = {}
    for heading, text in sections(".SS").items():
        words = heading.split()
        name = words[0]
        if len(words) > 1 and f"{name} {words[1]}" in commands():
            name = f"{name} {words[1]}"
        by_command[name] = text
    return by_command


def test_every_command_and_subcommand_has_its_section() -> None:
    wanted = {
        name
        for name, cmd in commands().items()
        if options_of(cmd) or not isinstance(cmd, click.Group)
    }
    assert wanted | {"deliver"} <= set(documented()), sorted(
        wanted | {"deliver"} - set(documented())
    )


def test_every_option_of_every_command_is_in_its_section() -> None:
    missing = []
    sections_by_command = documented()
    wanted = {name: options_of(command) for name, command in commands().items()}
    wanted["deliver"] = {
        option for action in _deliver_parser()._actions for option in action.option_strings
    } - HELP_OPTIONS
    for name, options in wanted.items():
        text = sections_by_command.get(name, "")
        missing += [
            f"{name} {o}"
            for o in sorted(options)
            if not re.search(rf"(?<![\w-]){o}(?![\w-])", text)
        ]
    assert not missing, f"not in packaging/volutectl.1: {missing}"


def exit_codes_of_the_program() -> set[int]:
    """Every code volutectl can exit with on its own: each error class's, each EX_* name
    the code uses, success, a --wait's time limit, and an interrupt."""
    classes: list[type[errors.VoluteError]] = [errors.VoluteError]
    for module in {entry[0] for entry in COMMANDS.values()} | {"volutectl.wire.records"}:
        importlib.import_module(module)
    codes = set()
    while classes:
        cls = classes.pop()
        codes.add(cls.exit_code)
        classes += cls.__subclasses__()
    source = "".join(
        p.read_text() for p in (CHECKOUT / "volutectl").rglob("*.py") if p.name != "errors.py"
    )
    codes |= {getattr(errors, name) for name in set(re.findall(r"\bEX_[A-Z]+\b", source))}
    return codes | {0, admission.EXIT_TIMEOUT, 130}


def test_exit_status_lists_every_exit_code() -> None:
    text = MANPAGE.read_text().split(".SH EXIT STATUS", 1)[1].split("\n.SH ", 1)[0]
    listed = {int(code) for code in re.findall(r"^\.TP\n\.B (\d+)$", text, flags=re.M)}
    program = exit_codes_of_the_program()
    assert {64, 65, 67, 69, 70, 75, 76, 77, 78} <= program  # the list, at least
    assert listed == program, (
        f"missing: {sorted(program - listed)}; extra: {sorted(listed - program)}"
    )
