"""An in-memory systemd for the gate's port (volutectl.systemd.port.SystemdManager), without root.

It keeps transient scopes in memory around real processes, and promises what systemd
promises the gate, no more; tests/contract.py holds those promises, and the same
assertions run against this fake (unit tier) and the real adapter (system tier):

- a scope holds the processes it was started with, while they live, and ends (a
  UnitEnded from process_events(), its fileno() turning readable) when they have all
  exited;
- a scope started around a process that had already died (a zombie) holds nothing and
  stays active for ever, as systemd 252 does, until it is stopped;
- stop_unit sends SIGTERM, then SIGKILL after the scope's TimeoutStopSec=; kill_unit
  sends a signal to every process of the scope;
- a unit that is not loaded answers None, not an error.

What it leaves out: cgroups and their controllers, weights, Slice= nesting,
RuntimeMaxSec= (the gate's own deadline stops a turn first), and descendants that
outlive the processes a scope was started with (the scope ends when those have
exited). A test may make any method fail as a D-Bus call cut short does (`failing`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import select
import signal as signals
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from volutectl.errors import SystemdError, SystemdNoAnswer
from volutectl.names import parse_turn_scope_name
from volutectl.systemd.port import (
    LIVE_STATES,
    ScopeProperties,
    SocketUnit,
    SystemdManager,
    UnitEnded,
    UnitInfo,
)


@dataclass
class FakeScope:
    name: str
    slice: str
    description: str
    pids: list[int]
    stop_timeout: float
    pidfds: list[int] = field(default_factory=list)
    state: str = "active"
    killer: threading.Timer | None = None


class FakeManager:
    def __init__(self) -> None:
        self.epoll = select.epoll()
        # Wakes the loop for news the fake makes itself (a stop, a dropped bus).
        self.news = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.epoll.register(self.news, select.EPOLLIN)
        self.lock = threading.Lock()
        self.scopes: dict[str, FakeScope] = {}
        self.pending: list[UnitEnded] = []
        self.started_units: list[str] = []
        self.signals: list[tuple[str, int]] = []
        self.watching = False
        self.most_live = 0  # the most scopes that held a process at once, for cap checks
        self.most_per_mind: dict[str, int] = {}  # the same, per mind of a turn scope
        # Methods that fail as a D-Bus call cut short does (EINTR, a timeout): a test
        # adds a name here, and every call of that method raises until it is removed.
        self.failing: set[str] = set()
        # Methods whose calls get no answer, as every call in flight during a
        # daemon-reexec does: their effect is unknown, and they may work a moment later.
        self.silent: set[str] = set()
        self.calls: dict[str, int] = {}

    def _call(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if method in self.failing:
            raise SystemdError(f"{method}: [err -4]: Interrupted system call (injected)")
        if method in self.silent:
            raise SystemdNoAnswer(
                f"{method}: [err -110]: Message recipient disconnected from message bus "
                "without replying (injected)"
            )

    # -- the port ----------------------------------------------------------------------

    def watch_units(self) -> None:
        self.watching = True

    def fileno(self) -> int:
        return self.epoll.fileno()

    def start_scope(
        self, name: str, pids: Sequence[int], props: ScopeProperties, timeout: float = 10.0
    ) -> None:
        self._call("start_scope")
        self._collect()
        if name in self.scopes and self.scopes[name].state in LIVE_STATES:
            raise SystemdError(f"scope {name} did not start: Unit {name} already exists")
        stop_timeout = props.stop_timeout_seconds if props.stop_timeout_seconds else 90.0
        scope = FakeScope(name, props.slice, props.description, [], stop_timeout)
        for pid in pids:
            pidfd = os.pidfd_open(pid)
            if _exited(pidfd):  # a zombie: systemd "moves" it, and the scope holds nothing
                os.close(pidfd)
                continue
            scope.pids.append(pid)
            scope.pidfds.append(pidfd)
            self.epoll.register(pidfd, select.EPOLLIN)
        self.scopes[name] = scope
        self._count()

    def _count(self) -> None:
        holding = [s.name for s in self.scopes.values() if s.state in LIVE_STATES and s.pidfds]
        self.most_live = max(self.most_live, len(holding))
        per_mind: dict[str, int] = {}
        for name in holding:
            parsed = parse_turn_scope_name(name)
            if parsed is not None:
                per_mind[parsed[0]] = per_mind.get(parsed[0], 0) + 1
        for mind, count in per_mind.items():
            self.most_per_mind[mind] = max(self.most_per_mind.get(mind, 0), count)

    def start_unit(self, name: str, timeout: float = 30.0) -> None:
        self._call("start_unit")
        self.started_units.append(name)

    def stop_unit(self, name: str, timeout: float = 30.0, wait: bool = True) -> None:
        """SIGTERM to every process now, SIGKILL after the scope's stop timeout."""
        self._call("stop_unit")
        scope = self.scopes.get(name)
        if scope is None or scope.state not in LIVE_STATES:
            return
        if not scope.pidfds:  # nothing to wait for: it stops at once
            self._end(scope, "inactive")
            return
        scope.state = "deactivating"
        self._signal(scope, signals.SIGTERM)
        scope.killer = threading.Timer(scope.stop_timeout, self._signal, (scope, signals.SIGKILL))
        scope.killer.daemon = True
        scope.killer.start()

    def kill_unit(self, name: str, signal: int, who: str = "all") -> None:
        self._call("kill_unit")
        self.signals.append((name, signal))
        scope = self.scopes.get(name)
        if scope is not None:
            self._signal(scope, signal)

    def list_units(
        self, slice: str, patterns: Sequence[str] = ("*.scope",), known: Collection[str] = ()
    ) -> list[UnitInfo]:
        self._call("list_units")
        self._collect()
        return [
            UnitInfo(scope.name, scope.description, scope.state, "running", f"/fake/{scope.name}")
            for scope in self.scopes.values()
            if scope.state in LIVE_STATES
            and scope.slice == slice
            and any(fnmatch.fnmatchcase(scope.name, pattern) for pattern in patterns)
        ]

    def attach_processes(self, name: str, pids: Sequence[int], subcgroup: str = "") -> None:
        """Into a live fake scope, out of any other; refused for a unit not live."""
        self._call("attach_processes")
        self._collect()
        scope = self.scopes.get(name)
        if scope is None or scope.state not in LIVE_STATES:
            raise SystemdError(f"moving pids {list(pids)} into {name}: Unit is not active")
        for pid in pids:
            for other in self.scopes.values():
                if pid in other.pids:
                    index = other.pids.index(pid)
                    del other.pids[index]
                    pidfd = other.pidfds.pop(index)
                    self.epoll.unregister(pidfd)
                    os.close(pidfd)
            pidfd = os.pidfd_open(pid)
            scope.pids.append(pid)
            scope.pidfds.append(pidfd)
            self.epoll.register(pidfd, select.EPOLLIN)

    def unit_property(self, name: str, prop: str) -> Any:
        if prop == "ActiveState":
            self._collect()
            scope = self.scopes.get(name)
            return scope.state if scope is not None else "inactive"
        if prop == "ActiveEnterTimestamp":
            return 0
        raise ValueError(f"the fake knows no property {prop}")

    def active_state(self, name: str) -> str | None:
        """None: no such unit is loaded (one that ended is collected, as CollectMode=
        inactive-or-failed has systemd do)."""
        self._call("active_state")
        self._collect()
        scope = self.scopes.get(name)
        return scope.state if scope is not None and scope.state in LIVE_STATES else None

    def unit_processes(self, name: str) -> list[int] | None:
        self._call("unit_processes")
        self._collect()
        scope = self.scopes.get(name)
        if scope is None or scope.state not in LIVE_STATES:
            return None
        return list(scope.pids)

    def socket_unit(self, name: str) -> SocketUnit:
        return SocketUnit(name, "not-found", "inactive", ())

    def process_events(self) -> list[UnitEnded]:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.news)
        self._collect()
        with self.lock:
            events, self.pending = self.pending, []
        return events

    def has_pending_events(self) -> bool:
        return False  # process_events() reports everything it finds at once

    def close(self) -> None:
        for scope in self.scopes.values():
            self._release(scope)
        self.epoll.close()
        os.close(self.news)

    # -- the model ------------------------------------------------------------------------

    def _signal(self, scope: FakeScope, signal: int) -> None:
        """Signal every process of the scope: those it was started with, and what they
        started (found through /proc, as systemd finds them in the cgroup)."""
        for pid in _tree(scope.pids):
            try:
                os.kill(pid, signal)
            except ProcessLookupError:
                pass

    def _collect(self) -> None:
        """Scopes whose processes have all exited become inactive, as systemd reports."""
        for scope in list(self.scopes.values()):
            if scope.state in LIVE_STATES and scope.pidfds and all(map(_exited, scope.pidfds)):
                self._end(scope, "inactive")

    def _end(self, scope: FakeScope, state: str) -> None:
        self._release(scope)
        scope.state = state
        if scope.killer is not None:
            scope.killer.cancel()
        with self.lock:
            self.pending.append(UnitEnded(scope.name, state))
        os.eventfd_write(self.news, 1)

    def _release(self, scope: FakeScope) -> None:
        for pidfd in scope.pidfds:
            try:
                self.epoll.unregister(pidfd)
            except (OSError, ValueError):
                pass
            os.close(pidfd)
        scope.pidfds = []


# The fake fits the port, checked by mypy: a method added to SystemdManager, or one whose
# signature changes there, fails the type check until the fake follows.
_FITS_THE_PORT: type[SystemdManager] = FakeManager


def _tree(pids: Sequence[int]) -> list[int]:
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children") as handle:
                    todo += [int(child) for child in handle.read().split()]
            except OSError:
                continue
    return found


def _exited(pidfd: int) -> bool:
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))
