"""Shell completion: the values click cannot know by itself, and `deliver`'s options.

The scripts in packaging/completion/ (bash, zsh, fish) are click's own: at each TAB the
shell runs `volutectl` with _VOLUTECTL_COMPLETE set, and click answers from the command
tree, so every command's options complete with no list kept here. What this module adds:
- mind names, read from the config file with tomllib alone (a TAB must not pay for
  pydantic); a config the user may not read completes no mind;
- queue states, from volutectl.states;
- `lease --pid`'s processes, from /proc: this user's (root's: all), each with its name;
- `deliver`, which volutectl.cli.deliver parses with argparse, not click: its options, their
  values, and its MIND, from that parser.
"""

from __future__ import annotations

import os
import tomllib
from typing import TYPE_CHECKING

import click
from click.shell_completion import CompletionItem

from volutectl.cli.deliver import DEFAULT_CONFIG
from volutectl.states import QueueState
from volutectl.visible import visible

if TYPE_CHECKING:
    import argparse

# deliver's options whose value is a path: the shell completes files there.
PATH_OPTIONS = frozenset({"--config", "--socket"})


def config_minds(config: str | None) -> list[str]:
    """The names of the [minds.NAME] tables in the config file, sorted; [] if unreadable."""
    path = config or os.environ.get("VOLUTE_CONFIG") or DEFAULT_CONFIG
    try:
        with open(path, "rb") as handle:
            minds = tomllib.load(handle).get("minds")
    except (OSError, ValueError):  # ValueError: TOMLDecodeError
        return []
    return sorted(minds) if isinstance(minds, dict) else []


def _config_path(ctx: click.Context | None) -> str | None:
    """A --config given on the command line so far, by this command or a parent."""
    while ctx is not None:
        value = ctx.params.get("config_path")
        if isinstance(value, str) and value:
            return value
        ctx = ctx.parent
    return None


def _items(values: list[str], incomplete: str) -> list[CompletionItem]:
    return [CompletionItem(value) for value in values if value.startswith(incomplete)]


def complete_minds(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """A `shell_complete` for an argument or option that names a configured mind."""
    return _items(config_minds(_config_path(ctx)), incomplete)


def complete_states(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    return _items([state.value for state in QueueState], incomplete)


def complete_pids(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """`lease --pid`: this user's processes (root's: any), each with its command name."""
    uid = os.getuid()
    items = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or not entry.startswith(incomplete):
            continue
        try:
            if uid != 0 and os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/comm", encoding="utf-8", errors="replace") as handle:
                name = handle.read().strip()
        except OSError:
            continue  # it exited meanwhile
        items.append(CompletionItem(entry, help=visible(name)))
    return sorted(items, key=lambda item: int(item.value))


# -- deliver -----------------------------------------------------------------------------


def _deliver_parser() -> argparse.ArgumentParser:
    from volutectl.cli.deliver import _deliver_parser as parser

    return parser()


# With --batch, each line of stdin gives these (and the mind); with a mind, no --batch.
PER_LINE_OPTIONS = frozenset({"--session", "-s", "--message", "-m", "--interrupt", "--request-id"})


def _scan(words: list[str]) -> tuple[str | None, int, str | None]:
    """Of `volutectl deliver WORDS...`: the --config given, the minds named, and the
    option whose value is the word being completed (None if it is not a value)."""
    actions = [action for action in _deliver_parser()._actions if action.option_strings]
    takes_value = {opt for action in actions if action.nargs != 0 for opt in action.option_strings}
    config, minds_named, index = None, 0, 0
    while index < len(words):
        word = words[index]
        if word in takes_value:
            if index + 1 == len(words):  # its value is the word being completed
                return config, minds_named, word
            if word == "--config":
                config = words[index + 1]
            index += 2
            continue
        minds_named += not word.startswith("-")
        index += 1
    return config, minds_named, None


def deliver_completions(words: list[str], incomplete: str) -> list[CompletionItem]:
    """What may come next after `volutectl deliver WORDS...`: a value for the option just
    given (files for a path), or the mind if none is named yet (and no --batch)."""
    config, minds_named, option = _scan(words)
    if option is not None:
        return [CompletionItem(incomplete, type="file")] if option in PATH_OPTIONS else []
    if minds_named or "--batch" in words:
        return []
    return _items(config_minds(config), incomplete)


def deliver_options(incomplete: str, words: list[str] | None = None) -> list[CompletionItem]:
    """deliver's options that fit after `words`: with --batch none that a line gives,
    with a mind no --batch."""
    words = words or []
    if "--batch" in words:
        left_out = PER_LINE_OPTIONS
    else:
        left_out = frozenset({"--batch"}) if _scan(words)[1] else frozenset()
    return [
        CompletionItem(option, help=action.help)
        for action in _deliver_parser()._actions
        for option in action.option_strings
        if option.startswith(incomplete) and option not in left_out
    ]


class DeliverCommand(click.Command):
    """`deliver`'s click face: only for help and completion (see volutectl.cli.client)."""

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
        words = ctx.params.get("args") or ()
        return deliver_options(incomplete, [str(word) for word in words])


def complete_deliver(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    words = ctx.params.get(param.name or "") or ()
    return deliver_completions([str(word) for word in words], incomplete)
