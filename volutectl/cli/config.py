"""`volutectl config show|check`: the effective configuration, and where each value came from.

Both read the config exactly as every other command does
(volutectl.config.settings.load_settings), so what `check` accepts is what the gate and
`volutectl test` will run with.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

from volutectl import roles
from volutectl.cli.options import config_option
from volutectl.config.settings import DEFAULT_CONFIG_PATH, LoadedSettings, Settings, flatten
from volutectl.config.settings import config_path as config_path_of
from volutectl.config.settings import load_settings as _load_settings
from volutectl.config.sources import ENV_NESTED, ENV_PREFIX
from volutectl.errors import EX_CONFIG, ConfigError, VoluteError
from volutectl.launcher import preflight
from volutectl.visible import visible
from volutectl.wire.messages import ConfigStatus


@click.group("config")
def config_command() -> None:
    """Show or check the configuration.

    Precedence, lowest first: defaults, the TOML file, VOLUTE_SECTION__KEY variables.
    """


def say(line: str) -> None:
    """One line of `show` or `check`. It may quote what is not the caller's: a path in
    the file, a preflight finding, a refusal the running gate sent. Shown, not obeyed
    (volutectl/visible.py); `show --json` is exact."""
    click.echo(visible(line))


@config_command.command("show")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
def show_command(config_path: str | None, as_json: bool) -> None:
    """Print every key's effective value and where it came from.

    The package's config is an admin's (root or group volute-admin): a client may show
    only a file of its own. An environment_file is named, never read."""
    check_may_show(config_path_of(config_path, os.environ), os.geteuid())
    loaded = _load_settings(config_path)
    flat = flatten(loaded.settings)
    if as_json:
        document = {
            key: {"value": _plain(value), "source": _source(loaded, key)}
            for key, value in flat.items()
        }
        click.echo(json.dumps(document, indent=2))
        return
    say(f"# {_file_line(loaded)}")
    announced: set[str] = set()
    for key, value in flat.items():
        mind = _mind_of(loaded.settings, key)
        if mind is not None and mind not in announced:
            announced.add(mind)
            sources = ", ".join(loaded.table_sources(f"minds.{mind}"))
            say(f"# [minds.{mind}] from {sources}")
        say(f"{key} = {_render(value)}  # {_source(loaded, key)}")


@config_command.command("check")
@config_option
def check_command(config_path: str | None) -> None:
    """Validate the configuration, and check that every mind's turns can start here.

    Notes how the [limits] keys combine: a global_concurrent_turns that is a ceiling over
    the adaptive limit, an io_pressure that turned the adaptive limit off.

    Exits 78 naming the bad key and its file or variable, or the minds that fail
    preflight: a user that does not exist, a command that is missing or not executable
    by that user, a working directory that is missing or closed to it, an environment
    file that is not root's alone or does not parse. Warns (exit 0) when minds share a
    user, or a mind's user is root or in the socket's group.
    """
    gate = gate_notes(config_path)
    try:
        loaded = _load_settings(config_path)
    except ConfigError:
        for note in gate:
            say(f"  note: {note}")
        raise  # its one line and hint are the verdict, last
    settings = loaded.settings
    for note in [*limits_notes(settings), *gate]:
        say(f"  note: {note}")
    reports = {report.mind: report for report in preflight.check_minds(settings)}
    for mind in settings.minds:
        sources = ", ".join(loaded.table_sources(f"minds.{mind}"))
        limit = settings.mind_limit(mind)
        say(f"  mind {mind}: from {sources} (at most {limit} turn(s) at once)")
        for problem in reports[mind].problems:
            say(f"    fail: {problem}")
        for warning in (*reports[mind].warnings, *inline_secret_warnings(settings, mind)):
            say(f"    warn: {warning}")
        for note in reports[mind].notes:
            say(f"    note: {note}")
    _warn(loaded, reports)
    failing = [mind for mind in settings.minds if reports[mind].problems]
    verdict = loaded.path if loaded.path is not None else _file_line(loaded)
    if not failing:
        say(f"ok: {verdict}")  # last: the verdict follows what it judged
        return
    say(f"fail: {verdict}")
    if len(failing) == 1:
        which = f"mind {failing[0]} fails preflight: its turns"
    else:
        which = f"minds {', '.join(failing)} fail preflight: their turns"
    raise ConfigError(
        f"{which} cannot start on this host",
        hint="fix what each fail line says; until then every turn fails and goes dead",
    )


def _warn(loaded: LoadedSettings, reports: dict[str, preflight.MindReport]) -> None:
    """The warnings of `config check`, on stderr, before its verdict."""
    settings = loaded.settings
    for name in unused_variables(loaded):
        click.echo(f"volutectl: warning: {name} names no config section; it is ignored", err=True)
    apart = [mind for mind in settings.minds if reports[mind].warnings]
    if apart:
        which = f"mind {apart[0]} is" if len(apart) == 1 else f"minds {', '.join(apart)} are"
        click.echo(
            f"volutectl: warning: {which} not kept apart (see the warn lines)\n"
            f"  hint: {preflight.APART_HINT}",
            err=True,
        )
    status, found, change = preflight.check_cap(settings)
    if status != "ok":
        click.echo(f"volutectl: warning: {found}\n  hint: {change}", err=True)


def gate_notes(config_path: str | None) -> list[str]:
    """What the running gate says of its config, if one answers within a second: a
    reload it refused, keys that wait for a restart, a file changed since it read it,
    or no valid config at all. No gate, or none that answers: nothing."""
    from volutectl.cli.deliver import socket_path
    from volutectl.wire import messages, protocol
    from volutectl.wire.messages import StatusReply, StatusRequest

    try:
        path = socket_path(None, config_path)
    except (VoluteError, OSError):
        return []  # a file that does not parse, or no file: the check itself says so
    try:
        connection = protocol.Connection(path, timeout=1.0)
        try:
            connection.send(StatusRequest().to_wire())
            reply = messages.expect(StatusReply, connection.receive(timeout=1.0))
        finally:
            connection.close()
    except VoluteError as error:
        if error.exit_code != EX_CONFIG:
            return []
        return [
            "the running gate has no valid config: it refuses every request (78) until "
            "`systemctl reload volute-gate` finds the file valid"
        ]
    except OSError:
        return []
    return config_status_notes(reply.status.config, _mtime(config_path))


def config_status_notes(config: ConfigStatus | None, file_mtime: float | None) -> list[str]:
    """The notes `gate_notes` makes of the gate's config status."""
    if config is None:
        return []
    notes = []
    if config.refused is not None:
        notes.append(
            f"the running gate refused this file at its last reload ({_clock(config.refused_at)})"
            f" and runs its config from before: {config.refused}"
        )
    elif file_mtime is not None and file_mtime > config.loaded_at:
        notes.append(
            "the file changed after the running gate read it: `systemctl reload "
            "volute-gate` applies it"
        )
    if config.needs_restart:
        notes.append(
            "the running gate keeps these keys until `systemctl restart volute-gate`: "
            + ", ".join(config.needs_restart)
        )
    return notes


def _mtime(config_path: str | None) -> float | None:
    try:
        return config_path_of(config_path, os.environ).stat().st_mtime
    except OSError:
        return None


def _clock(when: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if when else "?"


def check_may_show(path: Path, uid: int, groups: frozenset[str] | None = None) -> None:
    """Refuse (77) to show `path` to a client (volutectl/roles.py) unless it is the
    client's own file: the system's config may name minds' environments, an admin's to
    read. `groups`: the uid's (None: looked up)."""
    if uid == 0:
        return
    try:
        owner = path.stat().st_uid
    except FileNotFoundError:
        return  # defaults and environment only: nothing of anyone else's
    except PermissionError:
        owner = None  # a directory on the way is closed to this user
    if owner == uid:
        return
    role = roles.role_of(uid, roles.group_names(uid) if groups is None else groups)
    if role is not roles.Role.ADMIN:
        raise roles.admin_refusal(f"config show: {path} is an admin's to read")


def inline_secret_warnings(settings: Settings, mind: str) -> list[str]:
    """A mind's `environment` in the main config: every admin reads it there, and it is
    no place for a secret. Names the variables, never their values."""
    names = sorted(settings.minds[mind].environment)
    if not names:
        return []
    return [
        f"environment in the main config ({', '.join(names)}): every admin may read it; "
        f"keep secrets in minds.{mind}.environment_file (root's, mode 0600) instead"
    ]


def limits_notes(settings: Settings) -> list[str]:
    """What the [limits] keys do together, where that is not what each says alone."""
    limits = settings.limits
    notes = []
    if limits.adaptive_off_for_io_pressure:
        notes.append(
            "limits.adaptive is off because limits.io_pressure.enabled is true (its PSI hold "
            "alone guards the storage); set limits.io_pressure.enabled = false to use the "
            "adaptive limit instead"
        )
    cap = limits.global_concurrent_turns
    if cap is not None and limits.adaptive.enabled:
        notes.append(
            f"limits.global_concurrent_turns = {cap} is a hard ceiling over the adaptive "
            f"limit: at most {min(cap, limits.adaptive.maximum)} turns at once, even when the "
            "storage could take more; unset it to let the limit find its own"
        )
    return notes


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


def _source(loaded: LoadedSettings, key: str) -> str:
    source = loaded.source_of(key)
    if key == "limits.adaptive.enabled" and loaded.settings.limits.adaptive_off_for_io_pressure:
        return f"{source}, off for limits.io_pressure.enabled"  # not the default's true
    return source


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
