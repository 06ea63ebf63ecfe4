"""An in-memory stand-in for volutectl.systemd.Manager, for running the gate without root.

Only the methods the gate calls, and only what they promise: a scope is live while its
processes run and ends when they have all exited, which the gate learns the way it
does from systemd, by its fd turning readable and process_events() reporting the unit.
Here that fd is an epoll over one pidfd per process; systemd's Slice=, weights and
cgroups are not modelled. The system tier proves the real adapter.
"""

from __future__ import annotations

import fnmatch
import os
import select
import signal as signals
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from volutectl.errors import SystemdError
from volutectl.systemd import LIVE_STATES, ScopeProperties, UnitEnded, UnitInfo


@dataclass
class FakeScope:
    name: str
    slice: str
    pids: list[int]
    pidfds: list[int] = field(default_factory=list)
    state: str = "active"


class FakeManager:
    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.scopes: dict[str, FakeScope] = {}
        self.started_units: list[str] = []
        self.signals: list[tuple[str, int]] = []
        self.watching = False
        # Methods that fail as a D-Bus call cut short does (EINTR, a timeout): a test
        # adds a name here, and every call of that method raises until it is removed.
        self.failing: set[str] = set()
        self.calls: dict[str, int] = {}

    def _call(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if method in self.failing:
            raise SystemdError(f"{method}: [err -4]: Interrupted system call (injected)")

    # -- what the gate calls ------------------------------------------------------------

    def watch_units(self) -> None:
        self.watching = True

    def fileno(self) -> int:
        return self.epoll.fileno()

    def start_scope(
        self, name: str, pids: Sequence[int], props: ScopeProperties, timeout: float = 10.0
    ) -> None:
        self._call("start_scope")
        if name in self.scopes and self.scopes[name].state in LIVE_STATES:
            raise SystemdError(f"scope {name} did not start: Unit {name} already exists")
        scope = FakeScope(name, props.slice, list(pids))
        for pid in pids:
            pidfd = os.pidfd_open(pid)
            scope.pidfds.append(pidfd)
            self.epoll.register(pidfd, select.EPOLLIN)
        self.scopes[name] = scope

    def start_unit(self, name: str, timeout: float = 30.0) -> None:
        self.started_units.append(name)

    def stop_unit(self, name: str, timeout: float = 30.0, wait: bool = True) -> None:
        self._call("stop_unit")
        self.kill_unit(name, signals.SIGKILL)

    def kill_unit(self, name: str, signal: int, who: str = "all") -> None:
        self.signals.append((name, signal))
        scope = self.scopes.get(name)
        for pid in scope.pids if scope is not None else []:
            try:
                os.kill(pid, signal)
            except ProcessLookupError:
                pass

    def list_units(
        self, slice: str, patterns: Sequence[str] = ("*.scope",), known: Collection[str] = ()
    ) -> list[UnitInfo]:
        self._call("list_units")
        self._collect()
        return [
            UnitInfo(scope.name, "", scope.state, "running", f"/fake/{scope.name}")
            for scope in self.scopes.values()
            if scope.state in LIVE_STATES
            and scope.slice == slice
            and any(fnmatch.fnmatchcase(scope.name, pattern) for pattern in patterns)
        ]

    def unit_property(self, name: str, prop: str) -> object:
        if prop != "ActiveState":
            raise ValueError(f"the fake knows no property {prop}")
        self._collect()
        scope = self.scopes.get(name)
        return scope.state if scope is not None else "inactive"

    def active_state(self, name: str) -> str | None:
        """None: no such unit is loaded (a scope that ended stays loaded here, inactive)."""
        self._call("active_state")
        self._collect()
        scope = self.scopes.get(name)
        return scope.state if scope is not None else None

    def unit_processes(self, name: str) -> list[int] | None:
        self._call("unit_processes")
        self._collect()
        scope = self.scopes.get(name)
        if scope is None:
            return None
        return list(scope.pids) if scope.state in LIVE_STATES else []

    def process_events(self) -> list[UnitEnded]:
        return self._collect()

    def has_pending_events(self) -> bool:
        return False  # process_events() reports everything it finds at once

    def close(self) -> None:
        for scope in self.scopes.values():
            self._release(scope)
        self.epoll.close()

    # -- the model ------------------------------------------------------------------------

    def _collect(self) -> list[UnitEnded]:
        """Scopes whose processes have all exited become inactive, as systemd reports."""
        ended = []
        for scope in self.scopes.values():
            if scope.state in LIVE_STATES and scope.pidfds and all(map(_exited, scope.pidfds)):
                self._release(scope)
                scope.state = "inactive"
                ended.append(UnitEnded(scope.name, "inactive"))
        return ended

    def _release(self, scope: FakeScope) -> None:
        for pidfd in scope.pidfds:
            self.epoll.unregister(pidfd)
            os.close(pidfd)
        scope.pidfds = []


def _exited(pidfd: int) -> bool:
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))
