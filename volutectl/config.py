"""The configuration, declared once: one frozen pydantic-settings model.

Precedence, lowest to highest:
  1. the defaults below;
  2. the TOML file: `--config PATH`, else $VOLUTE_CONFIG, else /etc/volute/volutectl.toml
     (a missing default file is fine; a missing named file is an error);
  3. environment variables: VOLUTE_<SECTION>__<KEY>, e.g. VOLUTE_LIMITS__TURNS_PER_MIND=2;
  4. command-line flags of the command that reads the value.

An unknown key, a wrong type or a negative cap is a ConfigError (exit 78) that names
the key and where it came from.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from volutectl import names
from volutectl.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/volute/volutectl.toml")
ENV_PREFIX = "VOLUTE_"
ENV_NESTED = "__"

Weight = Annotated[int, Field(ge=1, le=10000)]
NonNegative = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GateSettings(Section):
    socket: Path = Path("/run/volute/gate.sock")
    socket_group: str = "volute"
    state_dir: Path = Path("/var/lib/volute")
    runtime_dir: Path = Path("/run/volute")
    manager: Literal["system", "user"] = "system"
    max_message_bytes: Positive = 1024 * 1024
    max_attempts: Positive = 10
    backoff_initial_seconds: Annotated[float, Field(gt=0)] = 5.0
    backoff_max_seconds: Annotated[float, Field(gt=0)] = 300.0
    watchdog: bool = True
    # Connections served at once; beyond them the gate stops accepting (they wait in the
    # listen backlog) until one leaves. Each holds a file descriptor.
    max_clients: Positive = 512
    # A connection whose request has not become a complete line in this long is closed
    # (one that waits for its turn with `deliver --wait` is not idle).
    client_idle_seconds: Annotated[float, Field(gt=0)] = 60.0


class IoPressureSettings(Section):
    """limits.io_pressure: hold new turns while PSI says the storage is stalled.

    A PSI trigger `some THRESHOLD WINDOW` on the turns slice's io.pressure (target
    "slice", cgroup v2) or /proc/pressure/io ("system") marks pressure high; it is
    re-read every recheck_seconds and released below resume_below_percent of the time
    stalled. Without CAP_SYS_RESOURCE the kernel takes only 2 s multiples as windows;
    the gate then rounds the window up and scales the threshold to the same ratio.
    """

    enabled: bool = False
    target: Literal["slice", "system"] = "slice"
    threshold_us: Positive = 150_000
    window_us: Annotated[int, Field(ge=500_000, le=10_000_000)] = 1_000_000
    resume_below_percent: Annotated[float, Field(gt=0, lt=100)] = 5.0
    recheck_seconds: Annotated[float, Field(ge=0.1, le=60)] = 1.0

    @model_validator(mode="after")
    def _ratios(self) -> IoPressureSettings:
        if self.threshold_us >= self.window_us:
            raise ValueError("threshold_us must be below window_us")
        if self.resume_below_percent >= 100 * self.threshold_us / self.window_us:
            raise ValueError(
                "resume_below_percent must be below threshold_us / window_us, or a hold "
                "could never end"
            )
        return self


class LimitsSettings(Section):
    global_concurrent_turns: Positive | None = None
    turns_per_mind: Positive = 1
    test_runs_count_as_turns: bool = False
    io_pressure: IoPressureSettings = Field(default_factory=IoPressureSettings)


class TurnsSettings(Section):
    slice: str = "volute-turns.slice"
    cpu_weight: Weight = 100
    io_weight: Weight = 100
    # "DEVICE BYTES" pairs for IOReadBandwidthMax=/IOWriteBandwidthMax= (io.max works
    # with any IO scheduler, unlike IOWeight), e.g. ["/dev/mmcblk0 8M"].
    io_read_bandwidth_max: list[str] = Field(default_factory=list)
    io_write_bandwidth_max: list[str] = Field(default_factory=list)
    default_user: str = "volute"
    # A turn that runs longer is stopped (SIGTERM, then SIGKILL after the grace) and
    # counts one failed attempt, outcome "timeout". 0: no limit.
    max_runtime_seconds: Annotated[float, Field(ge=0)] = 3600.0
    timeout_grace_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0

    @field_validator("slice")
    @classmethod
    def _slice(cls, value: str) -> str:
        return names.check_slice_name(value)

    @field_validator("io_read_bandwidth_max", "io_write_bandwidth_max")
    @classmethod
    def _bandwidth(cls, values: list[str]) -> list[str]:
        for value in values:
            parse_bandwidth(value)
        return values


class TestsSettings(Section):
    __test__ = False  # not a pytest class
    concurrent_runs: NonNegative = 0
    slice: str = "volute-tests.slice"
    cpu_weight: Weight = 50
    io_weight: Weight = 50
    repositories: list[Path] = Field(default_factory=list)

    @field_validator("slice")
    @classmethod
    def _slice(cls, value: str) -> str:
        return names.check_slice_name(value)


class MindSettings(Section):
    # A list is exec'd as is; a string runs under /bin/sh -c.
    command: list[str] | str
    user: str | None = None
    turns_per_mind: Positive | None = None
    working_directory: Path | None = None
    environment: dict[str, str] = Field(default_factory=dict)
    max_runtime_seconds: Annotated[float, Field(ge=0)] | None = None  # turns.max_runtime_seconds

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str] | str) -> list[str] | str:
        if not value:
            raise ValueError("the turn command must not be empty")
        return value


class Settings(BaseSettings):
    """All of volutectl's configuration. Frozen: read once, then passed around."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED,
        extra="forbid",
        frozen=True,
        case_sensitive=False,
    )

    gate: GateSettings = Field(default_factory=GateSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    turns: TurnsSettings = Field(default_factory=TurnsSettings)
    tests: TestsSettings = Field(default_factory=TestsSettings)
    minds: dict[str, MindSettings] = Field(default_factory=dict)

    @field_validator("minds")
    @classmethod
    def _mind_names(cls, minds: dict[str, MindSettings]) -> dict[str, MindSettings]:
        for name in minds:
            try:
                names.check_mind(name)
            except names.NameError_ as error:
                raise ValueError(str(error)) from None
        return minds

    def max_runtime(self, mind: str) -> float | None:
        """The mind's turn time limit in seconds, or None for no limit."""
        configured = self.minds.get(mind)
        seconds = self.turns.max_runtime_seconds
        if configured is not None and configured.max_runtime_seconds is not None:
            seconds = configured.max_runtime_seconds
        return seconds or None

    def mind_limit(self, mind: str) -> int:
        configured = self.minds.get(mind)
        if configured is not None and configured.turns_per_mind is not None:
            return configured.turns_per_mind
        return self.limits.turns_per_mind

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values arrive as init kwargs (see load_settings), so env wins.
        return (env_settings, init_settings)


def parse_bandwidth(value: str) -> tuple[str, int]:
    """ "/dev/mmcblk0 8M" -> ("/dev/mmcblk0", 8388608)."""
    parts = value.split()
    if len(parts) != 2 or not parts[0].startswith("/"):
        raise ValueError(f"{value!r} is not 'DEVICE BYTES', e.g. '/dev/mmcblk0 8M'")
    device, amount = parts
    units = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
    factor = units.get(amount[-1].upper(), 1) if amount[-1].isalpha() else 1
    digits = amount[:-1] if amount[-1].isalpha() else amount
    if not digits.isdigit() or (amount[-1].isalpha() and amount[-1].upper() not in units):
        raise ValueError(f"{amount!r} in {value!r} is not a byte count such as 8M")
    return device, int(digits) * factor


@dataclass(frozen=True)
class LoadedSettings:
    """The settings, plus where they came from (for `config show` and error messages)."""

    settings: Settings
    path: Path | None  # the file read, if any
    file_values: Mapping[str, Any]
    env_values: Mapping[str, str]  # VOLUTE_ variables that name settings

    def source_of(self, dotted: str) -> str:
        """'default', 'file PATH' or 'env VOLUTE_X__Y' for a dotted key (as `flatten` gives)."""
        key = key_path(self.settings, dotted)
        for name, raw in self.env_values.items():
            if _env_sets(name, raw, key):
                return f"env {name}"
        if _lookup(self.file_values, key) is not None:
            return f"file {self.path}"
        return "default"

    def table_sources(self, dotted: str) -> list[str]:
        """Every source that contributed to a table such as `minds.NAME`, file first."""
        key = key_path(self.settings, dotted)
        found = [f"file {self.path}"] if _lookup(self.file_values, key) is not None else []
        for name, raw in self.env_values.items():
            parts = _env_parts(name)
            if parts[: len(key)] == key or _env_sets(name, raw, key):
                found.append(f"env {name}")
        return found or ["default"]


def key_path(settings: Settings, dotted: str) -> tuple[str, ...]:
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


def _env_parts(name: str) -> tuple[str, ...]:
    # pydantic-settings (case_sensitive=False) lowercases the whole name, mind names too.
    return tuple(name[len(ENV_PREFIX) :].lower().split(ENV_NESTED))


def _env_sets(name: str, raw: str, key: tuple[str, ...]) -> bool:
    """Whether the variable sets `key`: by name, or as a JSON table that contains it."""
    parts = _env_parts(name)
    if parts == key:
        return True
    if len(parts) >= len(key) or key[: len(parts)] != parts:
        return False
    try:
        value = json.loads(raw)
    except ValueError:
        return True  # unparseable: it failed loading, and the error named it
    return _lookup(value, key[len(parts) :]) is not None


def _lookup(node: Any, key: tuple[str, ...]) -> object | None:
    """The value at `key` in nested mappings, or None if absent (a present value is boxed)."""
    for part in key:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return (node,)


def env_var_for(dotted: str) -> str:
    return ENV_PREFIX + dotted.replace(".", ENV_NESTED).upper()


def config_path(explicit: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> Path:
    if explicit:
        return Path(explicit)
    if environ.get("VOLUTE_CONFIG"):
        return Path(environ["VOLUTE_CONFIG"])
    return DEFAULT_CONFIG_PATH


def _settings_env(environ: Mapping[str, str]) -> dict[str, str]:
    sections = {name.upper() for name in Settings.model_fields}
    picked = {}
    for name, value in environ.items():
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        head = upper[len(ENV_PREFIX) :].split(ENV_NESTED, 1)[0]
        if head in sections:
            picked[name] = value
    return picked


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
        raise ConfigError(
            f"{path}: permission denied reading the config",
            hint="run as a member of the volute group, or pass --config",
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None


def load_settings(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> LoadedSettings:
    """Read the file and environment, validate, and say where each value came from."""
    environ = os.environ if environ is None else environ
    chosen = config_path(path, environ)
    explicit = bool(path) or bool(environ.get("VOLUTE_CONFIG"))
    file_values: dict[str, Any] = {}
    used_path: Path | None = None
    if chosen.exists():
        file_values = read_toml(chosen)
        used_path = chosen
    elif explicit:
        raise ConfigError(
            f"{chosen}: config file not found",
            hint="pass an existing file with --config, or unset VOLUTE_CONFIG",
        )
    env_values = _settings_env(environ)
    loaded_env = _EnvOverride(env_values)
    try:
        with loaded_env:
            settings = Settings(**file_values)
    except ValidationError as error:
        raise _config_error(error, used_path, file_values, env_values) from None
    except SettingsError as error:
        raise _env_parse_error(error, env_values) from None
    return LoadedSettings(settings, used_path, file_values, env_values)


class _EnvOverride:
    """pydantic-settings reads os.environ; make it read exactly `values` instead."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.values = dict(values)
        self.saved: dict[str, str] = {}

    def __enter__(self) -> None:
        self.saved = dict(os.environ)
        for name in list(os.environ):
            if name.upper().startswith(ENV_PREFIX):
                del os.environ[name]
        os.environ.update(self.values)

    def __exit__(self, *exc: object) -> None:
        os.environ.clear()
        os.environ.update(self.saved)


def _config_error(
    error: ValidationError,
    path: Path | None,
    file_values: Mapping[str, Any],
    env_values: Mapping[str, str],
) -> ConfigError:
    # One entry per key: a union (the turn command) fails once per member type.
    problems: dict[tuple[str, ...], list[str]] = {}
    for item in error.errors():
        key = _error_key(item["loc"])
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        message = message.removeprefix("Value error, ")  # our own validators' ValueErrors
        if message not in problems.setdefault(key, []):
            problems[key].append(message)
    lines = [
        f"{'.'.join(key) or '(top level)'}: {' or '.join(messages)} "
        f"({_where(key, path, file_values, env_values)})"
        for key, messages in problems.items()
    ]
    first, rest = lines[0], lines[1:]
    hint = "; ".join(rest) if rest else "see `volutectl config show` for every key and default"
    return ConfigError(f"invalid config: {first}", hint=hint)


def _error_key(loc: tuple[int | str, ...]) -> tuple[str, ...]:
    parts = [str(part) for part in loc]
    # pydantic adds the union member's type to the location ("list[str]", "str"); a
    # mind's name (minds.NAME) is never such a tag, even if it is spelt "str".
    keep = 2 if parts[:1] == ["minds"] else 1
    return tuple(parts[:keep]) + tuple(
        part for part in parts[keep:] if "[" not in part and part not in ("str", "int")
    )


def _where(
    key: tuple[str, ...],
    path: Path | None,
    file_values: Mapping[str, Any],
    env_values: Mapping[str, str],
) -> str:
    # A missing or unknown key exists in no source, so look at the tables around it too.
    for size in range(len(key), 0, -1):
        prefix = key[:size]
        for name, raw in env_values.items():
            if _env_sets(name, raw, prefix):
                return f"from env {name}"
        if path is not None and _lookup(file_values, prefix) is not None:
            return f"in {path}"
        for name in env_values:
            if _env_parts(name)[:size] == prefix:
                return f"from env {name}"
    return f"in {path}" if path is not None else "in defaults"


def _env_parse_error(error: SettingsError, env_values: Mapping[str, str]) -> ConfigError:
    """pydantic-settings could not decode a variable (a list or table must be JSON)."""
    match = re.search(r'field "([^"]+)"', str(error))
    section = match.group(1) if match else ""
    culprits = [name for name in env_values if _env_parts(name)[:1] == (section,)]
    where = ", ".join(culprits) or f"a {ENV_PREFIX}{section.upper()}{ENV_NESTED}* variable"
    return ConfigError(
        f"invalid config: {section or 'environment'}: cannot parse {where}",
        hint=f"lists and tables in the environment are JSON, e.g. "
        f"{ENV_PREFIX}TESTS{ENV_NESTED}REPOSITORIES='[\"/srv/repo\"]'",
    )


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values, for `config show`."""
    if isinstance(value, BaseModel):
        value = {name: getattr(value, name) for name in type(value).model_fields}
    if isinstance(value, dict) and (value or not prefix):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}
