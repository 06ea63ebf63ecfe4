"""The configuration, declared once: one frozen pydantic-settings model.

Precedence, lowest to highest:
  1. the defaults below;
  2. the TOML file: `--config PATH`, else $VOLUTE_CONFIG, else /etc/volute/volutectl.toml
     (a missing default file is fine; a missing named file is an error);
  3. environment variables: VOLUTE_<SECTION>__<KEY>, e.g. VOLUTE_LIMITS__TURNS_PER_MIND=2;
  4. command-line flags of the command that reads the value.

An unknown key, a wrong type, a negative cap or settings that contradict each other
(limits.adaptive's bounds; it and limits.io_pressure both enabled) is a ConfigError
(exit 78) that names the key and where it came from. The file and the environment are
read by sources of our own (volutectl.config.sources), which record where each value
came from and never touch os.environ.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
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
)

from volutectl import names
from volutectl.config.sources import (
    EnvironSource,
    Origins,
    TomlFileSource,
    config_error,
    key_path,
)
from volutectl.errors import ConfigError, PermissionDeniedError

DEFAULT_CONFIG_PATH = Path("/etc/volute/volutectl.toml")

Weight = Annotated[int, Field(ge=1, le=10000)]
NonNegative = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]


class Restart:
    """Field metadata: a reload of the gate keeps this key (or whole table) as it was,
    and names it as needing a restart. The gate opened something from it at its start
    (its socket, its state directory, a slice's watch): that cannot move under it.
    `Annotated[T, RESTART]`; volutectl/config/reload.py's `restart_keys` lists them."""

    def __repr__(self) -> str:
        return "RESTART"


RESTART = Restart()


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GateSettings(Section):
    socket: Annotated[Path, RESTART] = Path("/run/volute/gate.sock")
    socket_group: Annotated[str, RESTART] = "volute"
    state_dir: Annotated[Path, RESTART] = Path("/var/lib/volute")
    runtime_dir: Annotated[Path, RESTART] = Path("/run/volute")
    # Where the gate gives its orders to volute-launcher (volutectl/wire/orders.py); unset:
    # the gate forks turns itself, in-process (a root gate run by hand, the unit tests).
    # volute-gate.service sets it (VOLUTE_GATE__LAUNCHER_SOCKET).
    launcher_socket: Annotated[Path | None, RESTART] = None
    manager: Annotated[Literal["system", "user"], RESTART] = "system"
    max_message_bytes: Positive = 1024 * 1024
    max_attempts: Positive = 10
    backoff_initial_seconds: Annotated[float, Field(gt=0)] = 5.0
    backoff_max_seconds: Annotated[float, Field(gt=0)] = 300.0
    watchdog: Annotated[bool, RESTART] = True
    # Connections served at once; beyond them the gate stops accepting (they wait in the
    # listen backlog) until one leaves. Each holds a file descriptor.
    max_clients: Positive = 512
    # Fair shares for the members of socket_group, who may all connect: each uid other
    # than root holds at most max_clients_per_uid connections (a `wait` holds one each),
    # and the last clients_reserved_for_root places of max_clients are root's alone, so
    # that no member's connections can keep the operator out. Beyond either, a new
    # connection is refused with 75 (EX_TEMPFAIL), naming the key.
    max_clients_per_uid: Positive = 64
    clients_reserved_for_root: NonNegative = 16
    # Each uid's quota of deliveries not yet done (pending, running or dead; root has
    # none): past either, `deliver` is refused with 75 and nothing is stored. Dead ones
    # count until retried or dropped, as retention never removes them.
    max_pending_per_uid: Positive = 10_000
    max_pending_bytes_per_uid: Positive = 64 * 1024 * 1024
    # A connection whose request has not become a complete line in this long is closed
    # (one that waits for its turn with `deliver --wait` is not idle).
    client_idle_seconds: Annotated[float, Field(gt=0)] = 60.0
    # Done and dropped deliveries (message included) and ended turns are deleted this
    # long after they finished; dead deliveries stay until retried or dropped.
    retention_days: Annotated[float, Field(gt=0)] = 7.0
    # Leases (issue 31): each uid other than root holds and awaits at most this many at
    # once (past it, acquire is refused with 75); a lease granted before the gate
    # restarted waits this long for its holder to claim it again, then ends.
    max_leases_per_uid: Positive = 64
    lease_reclaim_seconds: Annotated[float, Field(gt=0)] = 30.0

    @model_validator(mode="after")
    def _root_reserve(self) -> GateSettings:
        if self.clients_reserved_for_root >= self.max_clients:
            raise ValueError(
                f"clients_reserved_for_root ({self.clients_reserved_for_root}) must be below "
                f"max_clients ({self.max_clients}), or no other user could connect"
            )
        return self


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


class AdaptiveSettings(Section):
    """limits.adaptive: a global limit on turns at once that the gate finds for itself.

    It starts at `start` each time the gate starts, grows while deliveries wait at it and
    the storage stays responsive, shrinks when the storage stalls, and stays within
    [minimum, maximum]; it moves at most once per interval_seconds. A set
    limits.global_concurrent_turns is a hard ceiling over it.
    """

    enabled: Annotated[bool, RESTART] = True
    start: Positive = 2
    minimum: Positive = 1
    maximum: Positive = 16
    interval_seconds: Annotated[float, Field(ge=0.1, le=10)] = 0.5
    # The control rule (volutectl/core/adaptive.py's RULES): "gradient" moves on the
    # latency of the gate's own synced probe, "aimd" on PSI's stalled share.
    rule: Annotated[Literal["gradient", "aimd"], RESTART] = "gradient"
    # Block devices watched besides those the gate finds (each mind's working directory
    # or home, the state directory, the journal): "/dev/sdb", "sdb", or a path on the
    # device (volutectl/gate/disks.py). Read at the gate's start.
    devices: Annotated[tuple[str, ...], RESTART] = ()

    @model_validator(mode="after")
    def _bounds(self) -> AdaptiveSettings:
        if self.minimum > self.maximum:
            raise ValueError(
                f"minimum ({self.minimum}) is over maximum ({self.maximum}): the limit "
                "would have no room"
            )
        if not self.minimum <= self.start <= self.maximum:
            raise ValueError(
                f"start ({self.start}) is outside [minimum, maximum] "
                f"([{self.minimum}, {self.maximum}])"
            )
        return self


class LimitsSettings(Section):
    # A hard ceiling: with adaptive admission on, the limit never goes above it. The code
    # calls it `global_cap` (admission.Limits, the status, GateReady).
    global_concurrent_turns: Positive | None = None
    turns_per_mind: Positive = 1
    test_runs_count_as_turns: bool = False
    io_pressure: Annotated[IoPressureSettings, RESTART] = Field(default_factory=IoPressureSettings)
    adaptive: AdaptiveSettings = Field(default_factory=AdaptiveSettings)

    @model_validator(mode="after")
    def _one_pressure_rule(self) -> LimitsSettings:
        # Today's PSI hold and the adaptive limit both answer "is the storage stalled?",
        # each its own way: one gate takes one answer. A config from before the adaptive
        # limit that turned the hold on keeps it, and adaptive admission goes off.
        if not (self.io_pressure.enabled and self.adaptive.enabled):
            return self
        if "enabled" in self.adaptive.model_fields_set:
            raise ValueError(
                "io_pressure.enabled and adaptive.enabled are both true: choose one "
                "(the adaptive limit already backs off when the storage stalls)"
            )
        adaptive = self.adaptive.model_copy(update={"enabled": False})
        # Still "not set": adaptive_off_for_io_pressure tells it from an explicit false.
        adaptive.model_fields_set.discard("enabled")
        object.__setattr__(self, "adaptive", adaptive)  # frozen: this is its validation
        return self

    @property
    def adaptive_off_for_io_pressure(self) -> bool:
        """Adaptive admission is off only because io_pressure is on and it was left unset."""
        return not self.adaptive.enabled and "enabled" not in self.adaptive.model_fields_set


class TurnsSettings(Section):
    slice: Annotated[str, RESTART] = "volute-turns.slice"
    cpu_weight: Weight = 100
    io_weight: Weight = 100
    # "DEVICE BYTES" pairs for IOReadBandwidthMax=/IOWriteBandwidthMax= (io.max works
    # with any IO scheduler, unlike IOWeight), e.g. ["/dev/mmcblk0 8M"].
    io_read_bandwidth_max: list[str] = Field(default_factory=list)
    io_write_bandwidth_max: list[str] = Field(default_factory=list)
    # A user of its own, outside group volute (which may read this file and use the
    # socket). Before 0.2 it was `volute`, a member: a config naming that still works,
    # and `config check` and `doctor` warn about it.
    default_user: str = "volute-turn"
    # A turn that runs longer is stopped (SIGTERM, then SIGKILL after the grace) and
    # counts one failed attempt, outcome "timeout". 0: no limit.
    max_runtime_seconds: Annotated[float, Field(ge=0)] = 3600.0
    timeout_grace_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0
    # A turn ends with its main process: what it left behind in its scope (`setsid
    # sleep 600 &`, a daemon) is stopped this long after it exited, and its place freed.
    leftover_grace_seconds: Annotated[float, Field(ge=0, le=3600)] = 5.0

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
    repositories: Annotated[list[Path], RESTART] = Field(default_factory=list)
    # The gate counts slot-1 .. slot-N of each repository, and no file past them.
    max_slot_files: Annotated[int, Field(ge=1, le=4096), RESTART] = 256

    @field_validator("slice")
    @classmethod
    def _slice(cls, value: str) -> str:
        return names.check_slice_name(value)


class MindSettings(Section):
    # A list is exec'd as is; a string runs under /bin/sh -c. None: the mind takes
    # leases only (a daemon runs its turns), and a delivery to it is refused.
    command: list[str] | str | None = None
    user: str | None = None
    turns_per_mind: Positive | None = None
    working_directory: Path | None = None
    # Readable by group volute with the rest of this file: not for secrets.
    environment: dict[str, str] = Field(default_factory=dict)
    # KEY=VALUE lines that only root may read (volutectl/launcher/envfile.py), over
    # `environment`.
    environment_file: Path | None = None
    max_runtime_seconds: Annotated[float, Field(ge=0)] | None = None  # turns.max_runtime_seconds

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str] | str | None) -> list[str] | str | None:
        if value is not None and not value:
            raise ValueError("the turn command must not be empty")
        return value

    @field_validator("environment_file")
    @classmethod
    def _environment_file(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError(f"{value} is not an absolute path")
        return value


class Settings(BaseSettings):
    """All of volutectl's configuration. Frozen: read once, then passed around."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

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
        # Highest first. pydantic-settings asks the class, but which file and which
        # environment to read belong to one load_settings() call: it puts its sources
        # here for the length of the call. Settings(...) outside of one reads neither:
        # just its arguments over the defaults. Never pydantic-settings' env_settings,
        # which reads os.environ.
        return (init_settings, *_LOADING.get())


# The sources of the load_settings() call running in this thread (or task), if any.
_LOADING: ContextVar[tuple[PydanticBaseSettingsSource, ...]] = ContextVar(
    "volutectl_config_sources", default=()
)


@contextmanager
def _loading(*sources: PydanticBaseSettingsSource) -> Iterator[None]:
    token = _LOADING.set(sources)
    try:
        yield
    finally:
        _LOADING.reset(token)


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
    origins: Origins
    unreadable: Path | None = None  # the default file, not read: closed to this user

    @property
    def variables(self) -> tuple[str, ...]:
        """The VOLUTE_<SECTION>... variables that were read, in the environment's order."""
        return self.origins.variables

    def source_of(self, dotted: str) -> str:
        """'default', 'file PATH' or 'env VOLUTE_X__Y' for a dotted key (as `flatten` gives)."""
        return self.origins.source_of(key_path(self.settings, dotted))

    def table_sources(self, dotted: str) -> list[str]:
        """Every source that contributed to a table such as `minds.NAME`, file first."""
        return self.origins.table_sources(key_path(self.settings, dotted))


def config_path(explicit: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> Path:
    if explicit:
        return Path(explicit)
    if environ.get("VOLUTE_CONFIG"):
        return Path(environ["VOLUTE_CONFIG"])
    return DEFAULT_CONFIG_PATH


def load_settings(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    defaults_if_unreadable: bool = False,
) -> LoadedSettings:
    """Read the file and environment, validate, and say where each value came from.

    `environ` defaults to os.environ, which is only read. A default file this user may
    not read (an admin's: volutectl/roles.py) is refused with 77, unless
    `defaults_if_unreadable` (a client's `volutectl test`): then it is left out, and
    named in LoadedSettings.unreadable."""
    environ = os.environ if environ is None else environ
    chosen = config_path(path, environ)
    explicit = bool(path) or bool(environ.get("VOLUTE_CONFIG"))
    file: TomlFileSource | None = None
    unreadable: Path | None = None
    if chosen.exists():
        try:
            file = TomlFileSource(Settings, chosen)
        except PermissionDeniedError:
            if explicit or not defaults_if_unreadable:
                raise
            unreadable = chosen
    elif explicit:
        raise ConfigError(
            f"{chosen}: config file not found",
            hint="pass an existing file with --config, or unset VOLUTE_CONFIG",
        )
    env = EnvironSource(Settings, environ)
    sources: list[PydanticBaseSettingsSource] = [env] if file is None else [env, file]
    used_path = chosen if file is not None else None
    origins = Origins(used_path, file.origins if file else {}, env.origins, tuple(env.variables))
    try:
        with _loading(*sources):
            settings = Settings()
    except ValidationError as error:
        raise config_error(error, origins, Settings) from None
    return LoadedSettings(settings, used_path, origins, unreadable)


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
