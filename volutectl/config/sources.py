"""Where each configuration value comes from: the TOML file and the VOLUTE_ variables, as
pydantic-settings sources of our own that record the origin of every key they set.

pydantic-settings has no provenance, and its own environment source reads os.environ
and reports a variable it cannot decode in prose. These sources read exactly the file
and the environment mapping they are given, and never os.environ. Each records, for
every key path it sets (a table, or a key inside one), the source's label: "file PATH"
or "env NAME". A key path that no source recorded has its default value. `Origins`
answers `config show`, `config check` and the errors that name a key's source.

The environment, as pydantic-settings reads it with env_nested_delimiter="__" and
case_sensitive=False: VOLUTE_<SECTION>__<KEY>..., the name lowercased into a key path
(mind names included). A variable for a list, a table or a section is JSON; one for a
value that may be either (a mind's command) is JSON if it parses, else text. A variable
that names a section sets the keys it holds, and a deeper one then overrides keys inside.
"""

from __future__ import annotations

import difflib
import json
import tomllib
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from volutectl import roles
from volutectl.errors import ConfigError

ENV_PREFIX = "VOLUTE_"
# Not `config show`: it reads the same config, and fails with the same error.
FIX_HINT = "fix it, then check again with `volutectl config check`"
ENV_NESTED = "__"

Key = tuple[str, ...]


class RecordingSource(PydanticBaseSettingsSource):
    """A source whose values are read when it is made, with each key path's origin."""

    def __init__(
        self, settings_cls: type[BaseSettings], values: dict[str, Any], origins: dict[Key, str]
    ) -> None:
        super().__init__(settings_cls)
        self.values = values
        self.origins = origins

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.values)


class TomlFileSource(RecordingSource):
    """The config file: every table and key in it, labelled "file PATH"."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        values = read_toml(path)
        origins: dict[Key, str] = {}
        _record(origins, (), values, f"file {path}")
        super().__init__(settings_cls, values, origins)


class EnvironSource(RecordingSource):
    """The VOLUTE_<SECTION>... variables of `environ`, each key labelled "env NAME"."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self.variables = settings_variables(settings_cls, environ)
        values: dict[str, Any] = {}
        origins: dict[Key, str] = {}
        # Shallow first (sorted is stable: environ order among equals), so that a deeper
        # variable overrides a key inside a table that a shallower one set as JSON.
        for name in sorted(self.variables, key=lambda name: len(env_key(name))):
            key = env_key(name)
            value = _decode(settings_cls, key, name, self.variables[name])
            _put(values, origins, key, value, f"env {name}")
        super().__init__(settings_cls, values, origins)


def env_key(name: str) -> Key:
    """VOLUTE_MINDS__ALICE__USER -> ("minds", "alice", "user")."""
    return tuple(name[len(ENV_PREFIX) :].lower().split(ENV_NESTED))


def settings_variables(
    settings_cls: type[BaseSettings], environ: Mapping[str, str]
) -> dict[str, str]:
    """The variables of `environ` whose VOLUTE_<SECTION> names a section, in its order."""
    sections = set(settings_cls.model_fields)
    return {
        name: value
        for name, value in environ.items()
        if name.upper().startswith(ENV_PREFIX) and env_key(name)[0] in sections
    }


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(
            f"{path}: not valid TOML: {error}",
            hint="fix the syntax at that line; `volutectl config check --config PATH` rechecks it",
        ) from None
    except PermissionError:
        # The package's config is root:volute-admin 0640: it may name minds' secrets.
        raise roles.admin_refusal(f"{path}: permission denied reading the config") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None


# -- decoding a variable by the type of the key it sets ------------------------------------


def _decode(settings_cls: type[BaseSettings], key: Key, name: str, raw: str) -> Any:
    is_json, may_be_text = _json_kind(_annotation_at(settings_cls, key))
    if not is_json or not raw:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        if may_be_text:
            return raw
        raise ConfigError(
            f"invalid config: {key[0]}: cannot parse {name}",
            hint=f"lists and tables in the environment are JSON, e.g. "
            f"{ENV_PREFIX}TESTS{ENV_NESTED}REPOSITORIES='[\"/srv/repo\"]'",
        ) from None


def _annotation_at(model: type[BaseModel], key: Key) -> Any:
    """The type of the value at `key` (through models and dicts), or None if no field."""
    node: Any = model
    for part in key:
        node = _unwrap(node)
        if isinstance(node, type) and issubclass(node, BaseModel):
            field = node.model_fields.get(part)
            if field is None:
                return None
            node = field.annotation
        elif get_origin(node) is dict:
            node = get_args(node)[1]
        else:
            return None
    return node


def _unwrap(annotation: Any) -> Any:
    """Annotated[X, ...] -> X, and X | None -> X."""
    if get_origin(annotation) is Annotated:
        return _unwrap(get_args(annotation)[0])
    if _is_union(annotation):
        members = [m for m in get_args(annotation) if m is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
    return annotation


def _json_kind(annotation: Any) -> tuple[bool, bool]:
    """(the value is JSON, text is acceptable if it does not parse as JSON)."""
    if annotation is None:
        return False, False
    annotation = _unwrap(annotation)
    members = get_args(annotation) if _is_union(annotation) else (annotation,)
    structured = [_is_structured(_unwrap(m)) for m in members if m is not type(None)]
    return any(structured), any(structured) and not all(structured)


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _is_structured(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    origin = get_origin(annotation) or annotation
    return origin in (list, dict, tuple, set, frozenset)


# -- recording where each key path came from -----------------------------------------------


def _record(origins: dict[Key, str], key: Key, value: Any, label: str) -> None:
    """`key` and every key path inside `value`'s tables came from `label`."""
    if key:
        origins[key] = label
    if isinstance(value, Mapping):
        for name, item in value.items():
            _record(origins, (*key, str(name)), item, label)


def _put(values: dict[str, Any], origins: dict[Key, str], key: Key, value: Any, label: str) -> None:
    """Set `key` in `values`, merging a table into a table; a replaced value's origins go."""
    node = values
    for size, part in enumerate(key[:-1], start=1):
        if not isinstance(node.get(part), dict):
            node[part] = {}
            _forget(origins, key[:size])
        node = node[part]
    last = key[-1]
    if isinstance(node.get(last), dict) and isinstance(value, dict):
        node[last] = _merged(node[last], value)
    else:
        node[last] = value
        _forget(origins, key)
    _record(origins, key, value, label)


def _merged(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for name, item in update.items():
        old = merged.get(name)
        merged[name] = (
            _merged(old, item) if isinstance(old, dict) and isinstance(item, dict) else item
        )
    return merged


def _forget(origins: dict[Key, str], key: Key) -> None:
    for path in [path for path in origins if path[: len(key)] == key]:
        del origins[path]


# -- answering: where did this come from? -------------------------------------------------


@dataclass(frozen=True)
class Origins:
    """Where each key path's value came from; a key path in neither map has its default."""

    path: Path | None  # the config file read, if any
    file: Mapping[Key, str]
    env: Mapping[Key, str]
    variables: tuple[str, ...]  # the VOLUTE_<SECTION> variables read, in environ order

    def source_of(self, key: Key) -> str:
        """'default', 'file PATH' or 'env VOLUTE_X__Y'."""
        return self.env.get(key) or self.file.get(key) or "default"

    def table_sources(self, key: Key) -> list[str]:
        """Every source that set the table at `key` or a key inside it, file first."""
        found = [self.file[key]] if key in self.file else []
        labels = {label for path, label in self.env.items() if path[: len(key)] == key}
        found += [f"env {name}" for name in self.variables if f"env {name}" in labels]
        return found or ["default"]

    def where(self, key: Key) -> str:
        """For an error: "from env NAME", "in PATH" or "in defaults". A missing or unknown
        key exists in no source, so the tables around it are looked at too."""
        for size in range(len(key), 0, -1):
            prefix = key[:size]
            if prefix in self.env:
                return f"from {self.env[prefix]}"
            if prefix in self.file:
                return f"in {self.path}"
            for path, label in self.env.items():
                if path[:size] == prefix:
                    return f"from {label}"
        return f"in {self.path}" if self.path is not None else "in defaults"


def key_path(settings: BaseModel, dotted: str) -> Key:
    """Split a dotted key into its parts, knowing that mind names may contain dots."""
    parts: list[str] = []
    node: Any = settings
    rest = dotted
    while rest:
        if isinstance(node, BaseModel):
            head, _, rest = rest.partition(".")
            parts.append(head)
            node = getattr(node, head, None)
        elif isinstance(node, Mapping):
            matches = [k for k in node if rest == k or rest.startswith(f"{k}.")]
            head = max(matches, key=len) if matches else rest.partition(".")[0]
            rest = rest[len(head) + 1 :]
            parts.append(head)
            node = node.get(head)
        else:
            parts.extend(rest.split("."))
            break
    return tuple(parts)


def config_error(
    error: ValidationError, origins: Origins, model: type[BaseModel] | None = None
) -> ConfigError:
    """Every problem, one per key, each naming the key and where it came from; an
    unknown key of `model` gets the known key it most resembles ("did you mean")."""
    # One entry per key: a union (the turn command) fails once per member type.
    problems: dict[Key, list[str]] = {}
    for item in error.errors():
        key = _error_key(item["loc"])
        if item["type"] == "extra_forbidden":
            message = "unknown key" + _did_you_mean(model, key)
        else:
            message = item["msg"]
        message = message.removeprefix("Value error, ")  # our own validators' ValueErrors
        if message not in problems.setdefault(key, []):
            problems[key].append(message)
    lines = [
        f"{'.'.join(key) or '(top level)'}: {' or '.join(messages)} ({origins.where(key)})"
        for key, messages in problems.items()
    ]
    first, rest = lines[0], lines[1:]
    hint = "; ".join(rest) if rest else FIX_HINT
    return ConfigError(f"invalid config: {first}", hint=hint)


def known_keys(model: type[BaseModel], table: Key) -> list[str]:
    """The keys the table at `table` may hold (`()`: the sections), or [] if it is no
    table of fixed keys (the minds, a mind's environment)."""
    node = _unwrap(_annotation_at(model, table)) if table else model
    if isinstance(node, type) and issubclass(node, BaseModel):
        return list(node.model_fields)
    return []


def _did_you_mean(model: type[BaseModel] | None, key: Key) -> str:
    """' (did you mean `X`?)' for an unknown key close to a known one, else ''."""
    if model is None or not key:
        return ""
    close = difflib.get_close_matches(key[-1], known_keys(model, key[:-1]), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _error_key(loc: tuple[int | str, ...]) -> Key:
    parts = [str(part) for part in loc]
    # pydantic adds the union member's type to the location ("list[str]", "str"); a
    # mind's name (minds.NAME) is never such a tag, even if it is spelt "str".
    keep = 2 if parts[:1] == ["minds"] else 1
    return tuple(parts[:keep]) + tuple(
        part for part in parts[keep:] if "[" not in part and part not in ("str", "int")
    )
