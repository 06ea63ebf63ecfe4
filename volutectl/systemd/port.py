"""What the gate knows of systemd, and what it asks of it: the adapter's port.

The data that crosses the boundary (ScopeProperties, UnitInfo, UnitEnded, SocketUnit),
and `SystemdManager`, the surface of volutectl.systemd.adapter.Manager that the gate
uses. The gate depends on this Protocol, not on the adapter, so a test can run the real gate
in-process against tests/unit/fake_systemd.py; tests/contract.py holds the assertions
that both the fake and the real adapter must pass.

The errors its calls raise are volutectl/errors.py's, and the gate programs against
those: SystemdNoAnswer (systemd never answered: the call may or may not have happened),
PermissionDeniedError (systemd refused), SystemdError (any other failure).

No pystemd here: ScopeProperties.as_dbus() gives (name, value) pairs, and the adapter
alone attaches D-Bus signatures to them and maps D-Bus's errors to ours.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# States in which a unit still has (or may have) processes: it counts as live.
LIVE_STATES = ("active", "activating", "deactivating", "reloading")
ENDED_STATES = ("inactive", "failed")


@dataclass(frozen=True)
class ScopeProperties:
    """What a transient scope is started with. CollectMode is always inactive-or-failed."""

    slice: str
    description: str = ""
    cpu_weight: int | None = None
    io_weight: int | None = None
    io_read_bandwidth_max: tuple[tuple[str, int], ...] = ()
    io_write_bandwidth_max: tuple[tuple[str, int], ...] = ()
    # RuntimeMaxSec=: systemd stops the scope after this long (SIGTERM, then SIGKILL after
    # the stop timeout), whether or not anyone else is watching. None: no limit.
    runtime_max_seconds: float | None = None
    stop_timeout_seconds: float | None = None  # TimeoutStopSec=: SIGTERM to SIGKILL
    extra: tuple[tuple[str, Any], ...] = field(default=())

    def as_dbus(self, pids: Sequence[int]) -> list[tuple[str, Any]]:
        props: list[tuple[str, Any]] = [
            ("PIDs", [int(pid) for pid in pids]),
            ("Slice", self.slice.encode()),
            ("CollectMode", b"inactive-or-failed"),
        ]
        if self.description:
            props.append(("Description", self.description.encode()))
        if self.cpu_weight is not None:
            props.append(("CPUWeight", int(self.cpu_weight)))
        if self.io_weight is not None:
            props.append(("IOWeight", int(self.io_weight)))
        if self.io_read_bandwidth_max:
            props.append(
                ("IOReadBandwidthMax", [(dev.encode(), n) for dev, n in self.io_read_bandwidth_max])
            )
        if self.io_write_bandwidth_max:
            props.append(
                (
                    "IOWriteBandwidthMax",
                    [(dev.encode(), n) for dev, n in self.io_write_bandwidth_max],
                )
            )
        if self.runtime_max_seconds is not None:
            props.append(("RuntimeMaxUSec", int(self.runtime_max_seconds * 1_000_000)))
        if self.stop_timeout_seconds is not None:
            props.append(("TimeoutStopUSec", int(self.stop_timeout_seconds * 1_000_000)))
        props.extend(self.extra)
        return props


@dataclass(frozen=True)
class UnitInfo:
    name: str
    description: str
    active_state: str
    sub_state: str
    object_path: str


@dataclass(frozen=True)
class SocketUnit:
    """A .socket unit: whether it is installed and listening, and on what."""

    name: str
    load_state: str  # loaded, not-found, masked, ...
    active_state: str
    listen: tuple[tuple[str, str], ...]  # (type, address), e.g. ("Stream", "/run/x.sock")


@dataclass(frozen=True)
class UnitEnded:
    """A unit left the live states (its last process exited, or it failed)."""

    name: str
    active_state: str


class SystemdManager(Protocol):
    """The calls the gate makes to its systemd manager (volutectl.systemd.adapter.Manager)."""

    def fileno(self) -> int:
        """An fd that becomes readable when systemd has news (`process_events`)."""

    def watch_units(self) -> None:
        """From now on, units that end are reported by `process_events()`."""

    def process_events(self) -> list[UnitEnded]:
        """Units that left the live states since the last call. Never blocks."""

    def has_pending_events(self) -> bool: ...

    def start_scope(
        self, name: str, pids: Sequence[int], props: ScopeProperties, timeout: float = 10.0
    ) -> None:
        """Start transient scope `name` holding `pids`; return once it holds them."""

    def start_unit(self, name: str, timeout: float = 30.0) -> None: ...

    def stop_unit(self, name: str, timeout: float = 30.0, wait: bool = True) -> None: ...

    def kill_unit(self, name: str, signal: int, who: str = "all") -> None: ...

    def list_units(
        self, slice: str, patterns: Sequence[str] = ("*.scope",), known: Collection[str] = ()
    ) -> list[UnitInfo]:
        """The live units matching `patterns` whose Slice= is `slice`."""

    def active_state(self, name: str) -> str | None:
        """The unit's ActiveState; None when no such unit is loaded. Raises SystemdError
        when the question fails: that says nothing about the unit."""

    def unit_processes(self, name: str) -> list[int] | None:
        """PIDs in the unit's cgroup; None when no such unit is loaded."""

    def unit_property(self, name: str, prop: str) -> Any:
        """One property of a unit (e.g. ActiveEnterTimestamp); bytes come back as str."""

    def attach_processes(self, name: str, pids: Sequence[int], subcgroup: str = "") -> None:
        """Move `pids` into unit `name`'s cgroup (AttachProcessesToUnit); raises the
        port's errors when systemd refuses (a pid gone, the unit inactive)."""

    def socket_unit(self, name: str) -> SocketUnit: ...

    def close(self) -> None: ...
