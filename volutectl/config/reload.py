"""What a reload changes: the keys that differ between the running settings and the
file read again, and which of them only a restart can apply.

`systemctl reload volute-gate` (SIGHUP) has the gate read its config again
(volutectl/gate/loop.py's `reload`). New minds, caps, the adaptive limit's bounds,
backoffs, quotas and client limits take effect at once. What the gate opened at its
start from a key (its socket, its state directory, the launcher's socket, its systemd
manager, the PSI trigger, the slices it watches, the repositories' slot watch) cannot
move under it: those keys keep their old values, and are named as needing a restart.
`plan_reload` is pure: settings in, settings out; a key says itself that it needs a
restart (`Annotated[T, RESTART]` in volutectl/config/settings.py). `SettingsHolder` holds
the settings every part of the gate reads, and a reload swaps them in it.
`ConfigFile` is the file the gate
was started with: read again at each reload, and asked, when a delivery names a mind
the gate does not know, whether the file on disk names it (then a reload is owed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from volutectl.config.settings import (
    LoadedSettings,
    Restart,
    Settings,
    config_path,
    flatten,
    load_settings,
)
from volutectl.config.sources import read_toml
from volutectl.errors import VoluteError


def restart_keys(model: type[BaseModel] = Settings, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys (or whole tables) that only a restart of the gate applies: the
    fields marked `Annotated[T, RESTART]` (volutectl/config/settings.py), in the
    model's order."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        if any(isinstance(item, Restart) for item in field.metadata):
            keys.append(dotted)
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys.extend(restart_keys(field.annotation, f"{dotted}."))
    return tuple(keys)


RESTART_KEYS = restart_keys()


@dataclass(frozen=True)
class Reload:
    """The settings to run with, and what changed."""

    settings: Settings  # the new settings, but RESTART_KEYS as they were
    changed: tuple[str, ...]  # dotted keys; a mind added, removed or changed as minds.NAME
    needs_restart: tuple[str, ...]  # the RESTART_KEYS among them, kept as they were


def plan_reload(running: Settings, read: Settings) -> Reload:
    """What applying `read` over `running` changes, and the settings that result."""
    changed = changed_keys(running, read)
    kept = tuple(key for key in RESTART_KEYS if any(_under(name, key) for name in changed))
    settings = read
    for key in kept:
        settings = _with_value(settings, key.split("."), _value_at(running, key.split(".")))
    needs_restart = tuple(name for name in changed if any(_under(name, key) for key in kept))
    return Reload(settings, changed, needs_restart)


def changed_keys(running: Settings, read: Settings) -> tuple[str, ...]:
    """The dotted keys whose values differ, sorted; a mind's keys as one minds.NAME."""
    old, new = flatten(running), flatten(read)
    minds = set(running.minds) | set(read.minds)
    names = {
        _mind_table(key, minds) for key in old.keys() | new.keys() if old.get(key) != new.get(key)
    }
    return tuple(sorted(names))


def _mind_table(key: str, minds: set[str]) -> str:
    """minds.NAME.command -> minds.NAME (mind names may hold dots: the longest match)."""
    if not key.startswith("minds."):
        return key
    rest = key.removeprefix("minds.")
    matches = [name for name in minds if rest == name or rest.startswith(f"{name}.")]
    return f"minds.{max(matches, key=len)}" if matches else key


def _under(name: str, key: str) -> bool:
    return name == key or name.startswith(f"{key}.")


def _value_at(model: BaseModel, path: list[str]) -> Any:
    value: Any = model
    for part in path:
        value = getattr(value, part)
    return value


def _with_value(model: Any, path: list[str], value: Any) -> Any:
    """A copy of `model` with the key at `path` set to `value` (already validated: it
    comes from the running settings). Which keys count as set is kept as it was, so
    that "left unset" still reads so (limits.adaptive.enabled under io_pressure)."""
    head, rest = path[0], path[1:]
    inner = _with_value(getattr(model, head), rest, value) if rest else value
    copy = model.model_copy(update={head: inner})
    if head not in model.model_fields_set:
        copy.model_fields_set.discard(head)
    return copy


class SettingsHolder:
    """The settings the gate runs with now, held in one place. Each part is given the
    holder at construction and reads `current` when it needs a value: it keeps no copy
    of a key a reload may change (a RESTART key it may, as that never changes under
    it). A reload swaps what it holds at one stroke (`swap`), after the new settings
    were validated and planned (`plan_reload`)."""

    def __init__(self, settings: Settings) -> None:
        self._current = settings  # a subclass may read its file again (the launcher's)

    @property
    def current(self) -> Settings:
        return self._current

    def __call__(self) -> Settings:
        """The current settings (`current`), for a part that takes a getter."""
        return self.current

    def swap(self, settings: Settings) -> None:
        """Hold `settings` from now on: validated (load_settings), and with the RESTART
        keys as they were (`plan_reload`'s)."""
        self._current = settings


class ConfigFile:
    """The configuration as the gate was started with it (`--config`, $VOLUTE_CONFIG or
    the default file, and the environment), to read again."""

    def __init__(
        self, explicit: str | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        self.explicit = explicit
        self.environ = dict(os.environ if environ is None else environ)
        self._stamp: tuple[int, int, int] | None = None
        self._minds: frozenset[str] = frozenset()

    @property
    def path(self) -> str:
        return str(config_path(self.explicit, self.environ))

    def load(self) -> LoadedSettings:
        """Read and check it all again; a ConfigError (78) names what is wrong."""
        return load_settings(self.explicit, self.environ)

    def minds_on_disk(self) -> frozenset[str]:
        """The [minds.NAME] tables of the file as it is now, valid or not; read again
        only when it changed (inode, size, mtime). None readable: empty."""
        try:
            st = os.stat(self.path)
        except OSError:
            return frozenset()
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                minds = read_toml(config_path(self.explicit, self.environ)).get("minds")
            except (VoluteError, OSError):
                minds = None
            self._minds = frozenset(minds) if isinstance(minds, dict) else frozenset()
        return self._minds
