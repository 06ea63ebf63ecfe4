"""What the gate relies on from systemd, as assertions over its port (SystemdManager).

The same checks run against tests/unit/fake_systemd.py in the unit tier
(tests/unit/test_contract.py) and against volutectl.systemd.adapter.Manager on a real systemd in
the system tier (tests/system/test_contract.py, which runs this module inside the
container). A fake that drifts from systemd fails here, not in a gate test that trusted
it.

Each check takes the manager and a slice, forks real processes, and raises
AssertionError with what it saw. `run_all` runs every check and returns the failures.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from collections.abc import Callable

from volutectl.systemd.port import ENDED_STATES, ScopeProperties, SystemdManager

_GONE = (None, *ENDED_STATES)


def _child() -> tuple[int, int]:
    """A process that waits until its pipe closes, then exits 0: (pid, write end)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        # Only its own read end: a write end of an earlier child's pipe, inherited across
        # the fork, would keep that child from ever seeing EOF.
        os.closerange(3, read_fd)
        os.closerange(read_fd + 1, 1 << 16)
        os.read(read_fd, 1)
        os._exit(0)
    os.close(read_fd)
    return pid, write_fd


def _zombie() -> int:
    """A process that has already exited, not yet reaped: what a SIGKILL of the gate's
    cgroup leaves between the fork and the scope."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as handle:
            if handle.read().rsplit(")", 1)[1].split()[0] == "Z":
                return pid
        time.sleep(0.005)
    raise AssertionError(f"{pid} did not exit")


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _ended_event(manager: SystemdManager, *names: str, timeout: float = 10.0) -> None:
    """Wait on the manager's fd until it has reported each of `names` ended, and the
    unit's own state agrees. A UnitEnded is news to check, not proof: systemd also
    announces a scope's initial "inactive" while it creates the scope."""
    deadline = time.monotonic() + timeout
    waiting = set(names)
    while True:
        reported = {event.name for event in manager.process_events()} & waiting
        waiting -= {name for name in reported if manager.active_state(name) in _GONE}
        if not waiting:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no UnitEnded for {sorted(waiting)} within {timeout} s")
        select.select([manager.fileno()], [], [], min(left, 0.2))


def _listed(manager: SystemdManager, slice_: str, name: str) -> bool:
    return name in {unit.name for unit in manager.list_units(slice_, ["volute-contract-*"])}


def _props(slice_: str) -> ScopeProperties:
    return ScopeProperties(slice=slice_, description="contract", stop_timeout_seconds=1.0)


def scope_holds_its_process_until_it_exits(manager: SystemdManager, slice_: str) -> None:
    name = f"volute-contract-hold-{os.getpid()}.scope"
    pid, release = _child()
    try:
        manager.start_scope(name, [pid], _props(slice_))
        assert manager.active_state(name) == "active", manager.active_state(name)
        assert pid in (manager.unit_processes(name) or []), manager.unit_processes(name)
        assert _listed(manager, slice_, name)
    finally:
        os.close(release)  # the child exits
        _reap(pid)
    _ended_event(manager, name)
    assert manager.active_state(name) in (None, *ENDED_STATES), manager.active_state(name)
    assert manager.unit_processes(name) in (None, []), manager.unit_processes(name)
    assert not _listed(manager, slice_, name)


def a_scope_around_a_dead_process_holds_nothing_and_stays_until_stopped(
    manager: SystemdManager, slice_: str
) -> None:
    name = f"volute-contract-wedge-{os.getpid()}.scope"
    pid = _zombie()
    try:
        manager.start_scope(name, [pid], _props(slice_))
    finally:
        _reap(pid)
    time.sleep(0.3)
    manager.process_events()
    assert manager.active_state(name) == "active", manager.active_state(name)
    assert manager.unit_processes(name) == [], manager.unit_processes(name)
    assert _listed(manager, slice_, name)  # it never ends by itself
    manager.stop_unit(name, wait=False)
    _ended_event(manager, name)
    assert not _listed(manager, slice_, name)


def stop_sends_sigterm_then_sigkill_after_the_stop_timeout(
    manager: SystemdManager, slice_: str
) -> None:
    name = f"volute-contract-stop-{os.getpid()}.scope"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: deaf to SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
        os._exit(0)
    try:
        time.sleep(0.05)  # let the child ignore SIGTERM first
        manager.start_scope(name, [pid], _props(slice_))
        started = time.monotonic()
        manager.stop_unit(name, wait=False)
        _ended_event(manager, name)
        took = time.monotonic() - started
        assert 0.8 <= took < 5, f"SIGKILL came after {took:.2f} s, not the 1 s stop timeout"
    finally:
        os.kill(pid, signal.SIGKILL) if _alive(pid) else None
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def kill_unit_signals_every_process_of_the_scope(manager: SystemdManager, slice_: str) -> None:
    """The process the scope was started with, and the ones it started since."""
    name = f"volute-contract-kill-{os.getpid()}.scope"
    read_fd, write_fd = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - once in its scope, a shell starts a grandchild
        os.read(go_read, 1)
        os.dup2(write_fd, 1)
        os.execv("/bin/sh", ["sh", "-c", "sleep 60 & echo $!; wait"])
    os.close(write_fd)
    os.close(go_read)
    try:
        manager.start_scope(name, [pid], _props(slice_))
        os.write(go_write, b"1")  # the grandchild starts inside the scope
        grandchild = int(os.read(read_fd, 64).split()[0])
        manager.kill_unit(name, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
        deadline = time.monotonic() + 5
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _alive(grandchild), "the grandchild got no signal"
        _ended_event(manager, name)
    finally:
        os.close(read_fd)
        os.close(go_write)


def a_unit_that_is_not_loaded_is_an_answer_not_an_error(
    manager: SystemdManager, slice_: str
) -> None:
    assert manager.active_state("volute-contract-never-1.scope") is None
    assert manager.unit_processes("volute-contract-never-1.scope") is None


def listing_is_by_slice_and_pattern(manager: SystemdManager, slice_: str) -> None:
    here = f"volute-contract-here-{os.getpid()}.scope"
    elsewhere = f"volute-contract-elsewhere-{os.getpid()}.scope"
    children = [_child(), _child()]
    try:
        manager.start_scope(here, [children[0][0]], _props(slice_))
        manager.start_scope(elsewhere, [children[1][0]], _props("volute-contract-other.slice"))
        assert _listed(manager, slice_, here)
        assert not _listed(manager, slice_, elsewhere)
        assert here not in {u.name for u in manager.list_units(slice_, ["nothing-*"])}
    finally:
        for pid, release in children:
            os.close(release)
            _reap(pid)
    _ended_event(manager, here, elsewhere)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


CHECKS: list[Callable[[SystemdManager, str], None]] = [
    scope_holds_its_process_until_it_exits,
    a_scope_around_a_dead_process_holds_nothing_and_stays_until_stopped,
    stop_sends_sigterm_then_sigkill_after_the_stop_timeout,
    kill_unit_signals_every_process_of_the_scope,
    a_unit_that_is_not_loaded_is_an_answer_not_an_error,
    listing_is_by_slice_and_pattern,
]


def run_all(manager: SystemdManager, slice_: str = "volute-contract.slice") -> dict[str, str]:
    """Every check's name -> "ok" or what failed."""
    manager.watch_units()
    results = {}
    for check in CHECKS:
        try:
            check(manager, slice_)
            results[check.__name__] = "ok"
        except Exception as error:  # noqa: BLE001 - reported, one check at a time
            results[check.__name__] = f"{type(error).__name__}: {error}"
    return results


if __name__ == "__main__":  # inside a test container, against the real systemd
    import json

    from volutectl.systemd.adapter import Manager

    print(json.dumps(run_all(Manager.connect())))
    sys.exit(0)
