"""Named crash points, for fault-injection tests: SQLite's crash tests, FoundationDB's buggify.

Each risky step of the gate calls `crash_point("name")`. Unarmed (always, in production)
that is one comparison against None. A test arms one point:

- in a real service, with the environment: VOLUTE_CRASH_AT=NAME and
  VOLUTE_CRASH_ONCE=PATH. The first time the gate reaches NAME it creates PATH and then
  SIGKILLs every process in its own cgroup, itself last, as `systemctl kill
  --signal=SIGKILL` and the OOM killer do (KillMode=control-group). A gate restarted
  with the same environment finds PATH and carries on, so one test sees one crash.
- in-process, with `arm(NAME)`: reaching NAME raises SimulatedCrash, which no code of
  the gate catches; the test then drops that Gate object and opens a new one.

The points, in the order a turn meets them, are listed in POINTS; the one of a turn
whose start failed in FAILED_START_POINTS; the one of a turn past its time limit in
TIMEOUT_POINTS; those of the queue's upkeep (retention, the VACUUM of schema 4) in
STORAGE_POINTS.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

POINTS = (
    "request_committed",  # deliveries committed, acknowledgements not yet sent
    "start_committed",  # a turn's row and its deliveries committed as running
    "forked",  # the turn's child forked, not yet in its scope
    "scope_started",  # systemd holds the child in the turn's scope; not yet released
    "released",  # the child was told to exec the command; not yet recorded
    "release_recorded",  # the release recorded in the store
    "fold_committed",  # a fold committed; the inbox file not yet written
    "inbox_written",  # the inbox file written (offered)
    "settled",  # a turn's outcome committed; its directory not yet removed
)
# A turn whose start failed (its hands say the command never ran): a path of its own,
# which a turn that starts never meets.
FAILED_START_POINTS = (
    "start_failure_recorded",  # the failed start recorded in the store; no waiter told yet
)
# A turn past its time limit: its timeout noted (its own commit), its scope not yet
# stopped and its outcome not yet settled (a second commit).
TIMEOUT_POINTS = (
    "timeout_recorded",  # the timeout noted in the store; the scope not yet stopped
)
# The queue's upkeep, outside any turn (volutectl/store/retention.py,
# volutectl/store/schema.py).
STORAGE_POINTS = (
    "retention_deleted",  # a retention batch's rows deleted, not yet committed
    "vacuuming",  # inside the VACUUM that makes the database incremental
)

EVERY_POINT = POINTS + FAILED_START_POINTS + TIMEOUT_POINTS + STORAGE_POINTS

CGROUP_ROOT = Path("/sys/fs/cgroup")


class SimulatedCrash(BaseException):
    """Raised at an armed point in-process. A BaseException: the gate's handlers of
    ordinary errors must not swallow it, as they could not swallow a SIGKILL."""


_armed: str | None = os.environ.get("VOLUTE_CRASH_AT") or None
_once: str | None = os.environ.get("VOLUTE_CRASH_ONCE") or None
_in_process = False


def arm(point: str | None) -> None:
    """Arm one point in-process (None disarms): reaching it raises SimulatedCrash."""
    global _armed, _in_process
    known = EVERY_POINT
    if point is not None and point not in known:
        raise ValueError(f"unknown crash point {point!r}; known: {', '.join(known)}")
    _armed, _in_process = point, point is not None


def crash_point(name: str) -> None:
    if _armed is None or name != _armed:
        return
    if _in_process:
        arm(None)
        raise SimulatedCrash(name)
    if _once is not None:
        try:
            os.close(os.open(_once, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return  # crashed here once already
    kill_own_cgroup()


def kill_own_cgroup() -> None:
    """SIGKILL every process in our cgroup, ourselves last (or just us, if it is unknown)."""
    me = os.getpid()
    for pid in _cgroup_pids():
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.kill(me, signal.SIGKILL)


def _cgroup_pids() -> list[int]:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            candidates = [CGROUP_ROOT, CGROUP_ROOT / "unified"]
        elif controllers == "name=systemd":
            candidates = [CGROUP_ROOT / "systemd"]
        else:
            continue
        for root in candidates:
            procs = root / path.lstrip("/") / "cgroup.procs"
            try:
                return [int(pid) for pid in procs.read_text().split()]
            except (OSError, ValueError):
                continue
    return []
