"""The one systemd adapter: the only module that imports pystemd.

It owns one D-Bus connection to a manager (system or user) and offers typed calls:
start a transient scope and return only once it holds the given PIDs, list the live
units of a slice, stop or signal a unit, and report units that ended through an fd an
event loop can select on.

pystemd's traps, and what this module does about each:
- Its property-signature table lacks PIDs, CPUWeight, IOWeight, CollectMode, AddRef and
  more (KeyError). We never use that table: every property we send carries its D-Bus
  signature from `_SIGNATURES` below, and calls go through `DBus.call_method` directly,
  which also skips the slow XML introspection of the SDObject proxies.
- StartTransientUnit returns once the job is queued, before the scope holds the PID.
  `start_scope` waits for the job's JobRemoved and raises unless its result is "done".
- Signals only flow after Manager.Subscribe(); we subscribe on `watch_units()` and on
  the first `start_scope()`.
- A failed scope is never garbage-collected unless CollectMode=inactive-or-failed; we
  always set it.
- `DBus.process()` returns a message object that is always truthy, so "process until
  it returns false" never ends. `_drain()` stops when a call neither ran a callback nor
  returned an unhandled message, twice in a row.
- pystemd keeps a match's userdata on the callback object itself, so two matches that
  share one callback overwrite each other's; each match gets its own closure here. And
  it hands the callback to C without holding a reference, so a closure that nobody
  keeps is freed and the next signal crashes: the Manager keeps every one.
- The code runs on pystemd 0.13 (Debian trixie) and 0.15 (PyPI): it uses only
  `DBus`, `apply_signature`, `path_decode` and `journal.sendv`, present in both.
"""

from __future__ import annotations

import collections
import select
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from pystemd.dbuslib import DBus, apply_signature, path_decode

from volutectl.errors import PermissionDeniedError, SystemdError, SystemdNoAnswer, UnavailableError
from volutectl.systemd.port import (
    ENDED_STATES,
    LIVE_STATES,
    ScopeProperties,
    SocketUnit,
    UnitEnded,
    UnitInfo,
)

# The data types live in volutectl/systemd/port.py (the gate's port); they are re-exported
# here for the adapter's other callers.
__all__ = [
    "ENDED_STATES",
    "LIVE_STATES",
    "Manager",
    "ScopeProperties",
    "SocketUnit",
    "UnitEnded",
    "UnitInfo",
    "unit_name_from_path",
]

DESTINATION = b"org.freedesktop.systemd1"
MANAGER_PATH = b"/org/freedesktop/systemd1"
MANAGER_INTERFACE = b"org.freedesktop.systemd1.Manager"
UNIT_INTERFACE = b"org.freedesktop.systemd1.Unit"
PROPERTIES_INTERFACE = b"org.freedesktop.DBus.Properties"
SOCKET_INTERFACE = b"org.freedesktop.systemd1.Socket"
UNIT_PATH_PREFIX = b"/org/freedesktop/systemd1/unit"


# D-Bus signatures of the transient-unit properties we send.
_SIGNATURES: dict[str, bytes] = {
    "PIDs": b"au",
    "Slice": b"s",
    "Description": b"s",
    "CPUWeight": b"t",
    "IOWeight": b"t",
    "IOReadBandwidthMax": b"a(st)",
    "IOWriteBandwidthMax": b"a(st)",
    "CollectMode": b"s",
    "AddRef": b"b",
    "Delegate": b"b",
    "SendSIGKILL": b"b",
    "TimeoutStopUSec": b"t",
    "RuntimeMaxUSec": b"t",
}

# Properties `unit_property` reads, with their signatures and interfaces.
_UNIT_PROPERTY_SIGNATURES: dict[str, bytes] = {
    "ActiveState": b"s",
    "ActiveEnterTimestamp": b"t",
    "Slice": b"s",
    "MainPID": b"u",
    "ControlGroup": b"s",
    "Delegate": b"b",
}
# Not the Unit interface's: the unit's own kind's (Scope, Service or Slice: see
# `_scope_or_unit`).
_UNIT_PROPERTY_INTERFACE: dict[str, bytes] = {
    "Slice": b"org.freedesktop.systemd1.Scope",
    "MainPID": b"org.freedesktop.systemd1.Service",
    "ControlGroup": b"org.freedesktop.systemd1.Scope",
    "Delegate": b"org.freedesktop.systemd1.Scope",
}


# pystemd's errors, classified into the port's (volutectl/systemd/port.py). They differ
# by release and share no base class but Exception, so each call catches Exception
# (`noqa: BLE001 - pystemd's errors`) and maps it here.
_GONE_ERRORS = ("NoSuchUnit", "UnknownObject")


def no_such_unit(error: BaseException) -> bool:
    """systemd's answer "no such unit (object) is loaded": an answer, not a failed call.

    pystemd 0.15 maps org.freedesktop.systemd1.NoSuchUnit and
    org.freedesktop.DBus.Error.UnknownObject to classes of their own (whose text then
    omits the D-Bus name); older releases keep the name in the text."""
    kind = type(error).__name__
    return any(f"DBus{name}Error" == kind or name in str(error) for name in _GONE_ERRORS)


# The bus's words for "systemd never answered": it disconnected (daemon-reexec drops
# its connection, and every call in flight with it) or did not reply in time.
_NO_ANSWER = ("without replying", "NoReply", "Timed out", "timed out", "ServiceUnknown")


def dbus_error(error: BaseException, what: str) -> Exception:
    """Map a pystemd/D-Bus error to ours, keeping D-Bus's own error name in the text."""
    text = str(error)
    if any(words in text for words in _NO_ANSWER):
        return SystemdNoAnswer(f"{what}: systemd gave no answer: {text}")
    if "AccessDenied" in text or "InteractiveAuthorizationRequired" in text or "EPERM" in text:
        return PermissionDeniedError(
            f"{what}: systemd refused: {text}",
            hint="run as root, or grant org.freedesktop.systemd1.manage-units with polkit",
        )
    return SystemdError(f"{what}: {text}")


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _property_array(properties: Iterable[tuple[str, Any]]) -> list[tuple[int, Any]]:
    args: list[tuple[int, Any]] = [(ord("a"), b"(sv)")]
    for name, value in properties:
        signature = _SIGNATURES.get(name)
        if signature is None:
            raise ValueError(f"no D-Bus signature registered for unit property {name}")
        args += [(ord("r"), b"sv"), (ord("s"), name.encode()), (ord("v"), signature)]
        args += apply_signature(signature, [value])
        args += [(-1, None), (-1, None)]
    args.append((-1, None))
    return args


def unit_name_from_path(path: bytes | str) -> str:
    raw = path.encode() if isinstance(path, str) else path
    return _text(path_decode(raw, UNIT_PATH_PREFIX))


class Manager:
    """One connection to a systemd manager. Not thread-safe; one per event loop."""

    def __init__(self, bus: Any, *, user: bool = False) -> None:
        self._bus = bus
        self.user = user
        self._subscribed = False
        self._watching = False
        self._jobs: dict[bytes, str] = {}  # job path -> result, from JobRemoved
        self._events: collections.deque[UnitEnded] = collections.deque()
        self._callbacks = 0
        # pystemd hands the callback to C without keeping a reference: we keep them.
        self._keep: list[Callable[..., None]] = []
        self._match(MANAGER_PATH, MANAGER_INTERFACE, b"JobRemoved", self._on_job_removed)

    # -- connection -------------------------------------------------------------

    @classmethod
    def connect(cls, *, user: bool = False) -> Manager:
        """Connect to the system manager, or to the calling user's manager."""
        bus = DBus(user_mode=user)
        try:
            bus.open()
            manager = cls(bus, user=user)
            # A cheap call proves the manager answers, not just the bus.
            manager._get(MANAGER_PATH, MANAGER_INTERFACE, "Version", b"s")
        except UnavailableError:
            raise
        except Exception as error:  # noqa: BLE001 - pystemd's errors
            which = "user" if user else "system"
            hint = (
                "is XDG_RUNTIME_DIR set and the user manager running (loginctl enable-linger)?"
                if user
                else "is systemd PID 1 here, and is dbus running?"
            )
            raise UnavailableError(
                f"cannot reach the {which} systemd manager over D-Bus: {error}", hint=hint
            ) from None
        return manager

    def close(self) -> None:
        if self._bus is not None:
            self._bus.close()
            self._bus = None

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fileno(self) -> int:
        fd: int = self._bus.get_fd()
        return fd

    # -- low level --------------------------------------------------------------

    def _call(self, method: bytes, args: list[tuple[int, Any]], what: str) -> Any:
        try:
            return self._bus.call_method(
                DESTINATION, MANAGER_PATH, MANAGER_INTERFACE, method, args
            ).body
        except Exception as error:  # noqa: BLE001 - pystemd's errors
            raise dbus_error(error, what) from None

    def _get(self, path: bytes, interface: bytes, prop: str, signature: bytes) -> Any:
        return self._bus.get_property(DESTINATION, path, interface, prop.encode(), signature)

    def _match(
        self, path: bytes | None, interface: bytes, member: bytes, handler: Callable[[Any], None]
    ) -> None:
        def callback(msg: Any, error: Any = None, userdata: Any = None) -> None:
            self._callbacks += 1
            try:
                msg.process_reply(True)
                handler(msg)
            except Exception:  # noqa: BLE001 - a bad signal must not kill the loop
                return

        self._keep.append(callback)
        self._bus.match_signal(DESTINATION, path, interface, member, callback)

    def _subscribe(self) -> None:
        if not self._subscribed:
            self._call(b"Subscribe", [], "subscribing to systemd signals")
            self._subscribed = True

    def _drain(self) -> None:
        """Run every queued message through the callbacks, without blocking."""
        idle = 0
        for _ in range(100_000):
            before = self._callbacks
            msg = self._bus.process()
            if self._callbacks == before and msg.is_empty():
                idle += 1
                if idle >= 2:
                    return
            else:
                idle = 0

    def _on_job_removed(self, msg: Any) -> None:
        _job_id, job_path, _unit, result = msg.body
        self._jobs[bytes(job_path)] = _text(result)

    def _on_properties_changed(self, msg: Any) -> None:
        interface, changed, _invalidated = msg.body
        if bytes(interface) != UNIT_INTERFACE or b"ActiveState" not in changed:
            return
        state = _text(changed[b"ActiveState"])
        if state in ENDED_STATES:
            path = msg.headers.get("Path") or msg.headers.get(b"Path")
            if path:
                self._events.append(UnitEnded(unit_name_from_path(path), state))

    def _on_unit_removed(self, msg: Any) -> None:
        name, _path = msg.body
        self._events.append(UnitEnded(_text(name), "removed"))

    # -- scopes -----------------------------------------------------------------

    def start_scope(
        self, name: str, pids: Sequence[int], props: ScopeProperties, timeout: float = 10.0
    ) -> None:
        """Start transient scope `name` holding `pids`; return once the job is done."""
        self._subscribe()
        args: list[tuple[int, Any]] = apply_signature(b"ss", [name.encode(), b"fail"])
        args += _property_array(props.as_dbus(pids))
        args += [(ord("a"), b"(sa(sv))"), (-1, None)]
        job = bytes(self._call(b"StartTransientUnit", args, f"starting scope {name}"))
        result = self._wait_job(job, timeout, f"scope {name}")
        if result != "done":
            raise SystemdError(
                f"scope {name} did not start: job result {result!r}",
                hint=f"see: journalctl -b -u {name}",
            )

    def _wait_job(self, job: bytes, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        fd = self.fileno()
        while True:
            self._drain()
            if job in self._jobs:
                return self._jobs.pop(job)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SystemdNoAnswer(f"{what}: no answer from systemd within {timeout:.0f} s")
            select.select([fd], [], [], remaining)

    def start_unit(self, name: str, timeout: float = 30.0) -> None:
        """Start a unit (e.g. a slice, so its cgroup exists); return once the job is done."""
        self._subscribe()
        job = bytes(
            self._call(
                b"StartUnit",
                apply_signature(b"ss", [name.encode(), b"replace"]),
                f"starting {name}",
            )
        )
        result = self._wait_job(job, timeout, f"starting {name}")
        if result != "done":
            raise SystemdError(f"{name} did not start: job result {result!r}")

    def stop_unit(self, name: str, timeout: float = 30.0, wait: bool = True) -> None:
        """Stop a unit. With `wait`, return once the stop job finished."""
        self._subscribe()
        job = bytes(
            self._call(
                b"StopUnit", apply_signature(b"ss", [name.encode(), b"replace"]), f"stopping {name}"
            )
        )
        if wait:
            self._wait_job(job, timeout, f"stopping {name}")

    def kill_unit(self, name: str, signal: int, who: str = "all") -> None:
        self._call(
            b"KillUnit",
            apply_signature(b"ssi", [name.encode(), who.encode(), int(signal)]),
            f"signalling {name}",
        )

    # -- listing and properties ---------------------------------------------------

    def list_units(
        self,
        slice: str,
        patterns: Sequence[str] = ("*.scope",),
        known: Collection[str] = (),
    ) -> list[UnitInfo]:
        """The live units (by default scopes) whose Slice= is `slice`.

        Units named in `known` are the caller's own, started in `slice`: their Slice= is
        not asked again (one D-Bus round trip each, on the gate's handoff path)."""
        states = [s.encode() for s in LIVE_STATES]
        rows = self._call(
            b"ListUnitsByPatterns",
            apply_signature(b"asas", [states, [p.encode() for p in patterns]]),
            f"listing units in {slice}",
        )
        units = []
        for row in rows:
            name, description, _load, active, sub = (_text(v) for v in row[:5])
            path = bytes(row[6])
            if name in known:
                units.append(UnitInfo(name, description, active, sub, _text(path)))
                continue
            try:
                unit_slice = _text(self._get(path, _scope_or_unit(name), "Slice", b"s"))
            except Exception as error:  # noqa: BLE001 - pystemd's errors
                if no_such_unit(error):
                    continue  # the unit vanished between the two calls
                # Any other failure says nothing about the unit: dropping it would
                # undercount the slice, so the whole listing fails instead.
                raise dbus_error(error, f"reading the slice of {name}") from None
            if unit_slice == slice:
                units.append(UnitInfo(name, description, active, sub, _text(path)))
        return units

    def unit_property(self, name: str, prop: str) -> Any:
        """One property of a unit (loaded or not); bytes come back as str."""
        path = self._unit_path(name)
        signature = _UNIT_PROPERTY_SIGNATURES.get(prop)
        if signature is None:
            raise ValueError(f"no signature registered for property {prop}")
        interface = _UNIT_PROPERTY_INTERFACE.get(prop, UNIT_INTERFACE)
        if interface != UNIT_INTERFACE:
            interface = _scope_or_unit(name)
        try:
            value = self._get(path, interface, prop, signature)
        except Exception as error:  # noqa: BLE001 - pystemd's errors
            raise dbus_error(error, f"reading {prop} of {name}") from None
        return _text(value) if isinstance(value, bytes) else value

    def socket_unit(self, name: str) -> SocketUnit:
        """A socket unit's load and active state and its Listen= addresses."""
        path = self._unit_path(name)
        try:
            load = _text(self._get(path, UNIT_INTERFACE, "LoadState", b"s"))
            active = _text(self._get(path, UNIT_INTERFACE, "ActiveState", b"s"))
            listen = (
                self._get(path, SOCKET_INTERFACE, "Listen", b"a(ss)") if load == "loaded" else []
            )
        except Exception as error:  # noqa: BLE001 - pystemd's errors
            raise dbus_error(error, f"reading {name}") from None
        pairs = tuple((_text(kind), _text(address)) for kind, address in listen)
        return SocketUnit(name, load, active, pairs)

    def active_state(self, name: str) -> str | None:
        """The unit's ActiveState, or None when systemd says no such unit is loaded.

        Both are answers from systemd: a unit that is not loaded does not run. A call that
        fails (EINTR while the caller is being signalled, a timeout, a dropped bus)
        raises SystemdError: that says nothing about the unit, and the caller must not
        conclude that it ended."""
        try:
            path = self._bus.call_method(
                DESTINATION,
                MANAGER_PATH,
                MANAGER_INTERFACE,
                b"GetUnit",
                apply_signature(b"s", [name.encode()]),
            ).body
            return _text(self._get(bytes(path), UNIT_INTERFACE, "ActiveState", b"s"))
        except Exception as error:  # noqa: BLE001 - pystemd's errors
            if no_such_unit(error):
                return None
            raise dbus_error(error, f"reading the state of {name}") from None

    def unit_processes(self, name: str) -> list[int] | None:
        """PIDs in the unit's cgroup (and below), as systemd reads them; None if the unit
        is not loaded. A scope can be active with no process at all: one started around
        a PID that died before systemd moved it never empties, so it never ends."""
        try:
            rows = self._bus.call_method(
                DESTINATION,
                MANAGER_PATH,
                MANAGER_INTERFACE,
                b"GetUnitProcesses",
                apply_signature(b"s", [name.encode()]),
            ).body
        except Exception as error:  # noqa: BLE001 - pystemd's errors
            if no_such_unit(error):
                return None
            raise dbus_error(error, f"listing the processes of {name}") from None
        return [int(row[1]) for row in rows]

    def attach_processes(self, name: str, pids: Sequence[int], subcgroup: str = "") -> None:
        """Move `pids` into unit `name`'s cgroup (`subcgroup` below it: a delegated
        unit's only) with AttachProcessesToUnit; systemd checks each pid is attachable
        (not pid 1, not a kernel thread) and the unit active. It returns once moved."""
        self._call(
            b"AttachProcessesToUnit",
            apply_signature(b"ssau", [name.encode(), subcgroup.encode(), [int(p) for p in pids]]),
            f"moving pids {list(pids)} into {name}",
        )

    def _unit_path(self, name: str) -> bytes:
        return bytes(
            self._call(
                b"LoadUnit", apply_signature(b"s", [name.encode()]), f"looking up unit {name}"
            )
        )

    # -- events -------------------------------------------------------------------

    def watch_units(self) -> None:
        """From now on, units that end are reported by `process_events()`."""
        if self._watching:
            return
        self._match(None, PROPERTIES_INTERFACE, b"PropertiesChanged", self._on_properties_changed)
        self._match(MANAGER_PATH, MANAGER_INTERFACE, b"UnitRemoved", self._on_unit_removed)
        self._watching = True
        self._subscribe()

    def process_events(self) -> list[UnitEnded]:
        """Drain the bus (never blocks) and return the units that ended since last time."""
        self._drain()
        events = list(self._events)
        self._events.clear()
        return events

    def has_pending_events(self) -> bool:
        return bool(self._events)


def _scope_or_unit(name: str) -> bytes:
    kind = name.rpartition(".")[2]
    if kind in ("scope", "service", "slice"):
        return b"org.freedesktop.systemd1." + kind.capitalize().encode()
    return UNIT_INTERFACE


def journal_sender() -> Callable[..., None]:
    """libsystemd's sd_journal_sendv: one b"FIELD=value" per argument, each framed whole."""
    from pystemd.journal import sendv

    send: Callable[..., None] = sendv  # pystemd is untyped
    return send
