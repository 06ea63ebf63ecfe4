"""`volutectl config show|check`: the effective configuration, and where each value came from.

Both read the config exactly as every other command does (volutectl.config.load_settings),
so what `check` accepts is what the gate and `volutectl test` will run with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from volutectl.config import DEFAULT_CONFIG_PATH, LoadedSettings, Settings, flatten
from volutectl.config import load_settings as _load_settings
from volutectl.config_sources import ENV_NESTED, ENV_PREFIX
from volutectl.options import config_option


@click.group("config")
def config_command() -> None:
    """Show or check the configuration.

    Precedence, lowest first: defaults, the TOML file, VOLUTE_SECTION__KEY variables.
    """


@config_command.command("show")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
def show_command(config_path: str | None, as_json: bool) -> None:
    """Print every key's effective value and where it came from."""
    loaded = _load_settings(config_path)
    flat = flatten(loaded.settings)
    if as_json:
        document = {
            key: {"value": _plain(value), "source": loaded.source_of(key)}
            for key, value in flat.items()
        }
        click.echo(json.dumps(document, indent=2))
        return
    click.echo(f"# {_file_line(loaded)}")
    announced: set[str] = set()
    for key, value in flat.items():
        mind = _mind_of(loaded.settings, key)
        if mind is not None and mind not in announced:
            announced.add(mind)
            sources = ", ".join(loaded.table_sources(f"minds.{mind}"))
            click.echo(f"# [minds.{mind}] from {sources}")
        click.echo(f"{key} = {_render(value)}  # {loaded.source_of(key)}")


@config_command.command("check")
@config_option
def check_command(config_path: str | None) -> None:
    """Validate the configuration; exit 78 naming the bad key and its file or variable."""
    loaded = _load_settings(config_path)
    click.echo(f"ok: {loaded.path if loaded.path is not None else _file_line(loaded)}")
    for mind in loaded.settings.minds:
        sources = ", ".join(loaded.table_sources(f"minds.{mind}"))
        limit = loaded.settings.mind_limit(mind)
        click.echo(f"  mind {mind}: from {sources} (at most {limit} turn(s) at once)")
    for name in unused_variables(loaded):
        click.echo(f"volutectl: warning: {name} names no config section; it is ignored", err=True)


def unused_variables(loaded: LoadedSettings, environ: dict[str, str] | None = None) -> list[str]:
    """VOLUTE_X__Y variables whose X is no section: most likely a typo of one."""
    environ = dict(os.environ) if environ is None else environ
    return sorted(
        name
        for name in environ
        if name.upper().startswith(ENV_PREFIX)
        and ENV_NESTED in name
        and name not in loaded.variables
    )


def _file_line(loaded: LoadedSettings) -> str:
    if loaded.path is not None:
        return f"config file: {loaded.path}"
    return f"no config file ({DEFAULT_CONFIG_PATH} not found): defaults and environment only"


def _mind_of(settings: Settings, key: str) -> str | None:
    if not key.startswith("minds."):
        return None
    rest = key.removeprefix("minds.")
    # Mind names may contain dots: take the longest mind name that the key starts with.
    matches = [name for name in settings.minds if rest.startswith(f"{name}.")]
    return max(matches, key=len) if matches else None


def _plain(value: Any) -> Any:
    """A JSON-ready copy: paths become strings."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    return value


def _render(value: Any) -> str:
    # TOML-like: what you would write in the file to get this value. TOML has no null.
    if value is None:
        return "(unset)"
    return json.dumps(_plain(value))
