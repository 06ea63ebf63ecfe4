"""What systemd knows about test runs: the manager a run uses, its scope's properties,
and the runs in flight, read from the scopes in the tests slice.

`volutectl test` asks for the wait line and starts its scope with these; the gate asks
for `status`. Through volutectl.systemd.adapter's Manager only, which is imported when a
manager is first wanted, so that a run without systemd never loads pystemd.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from volutectl.core import slotmath
from volutectl.errors import PermissionDeniedError, SystemdError, UnavailableError

if TYPE_CHECKING:
    from volutectl.config.settings import TestsSettings
    from volutectl.systemd.adapter import Manager, ScopeProperties
    from volutectl.systemd.port import SystemdManager


def one_line(text: str) -> str:
    """A notice is one line; D-Bus error texts are not always."""
    return text.strip().splitlines()[0] if text.strip() else text


def connect_manager(say: Callable[[str], None]) -> Manager | None:
    """The system manager as root, the user's own manager otherwise; None if unreachable."""
    try:
        from volutectl.systemd.adapter import Manager

        return Manager.connect(user=os.geteuid() != 0)
    except (UnavailableError, PermissionDeniedError, ImportError) as error:
        reason = one_line(getattr(error, "message", str(error)))
        say(
            f"volutectl test: no systemd manager reachable ({reason}); "
            "running the command as a plain child, outside the tests slice"
        )
        return None


def scope_properties(
    tests: TestsSettings, worktree: str, command: Sequence[str]
) -> ScopeProperties:
    from volutectl.systemd.adapter import ScopeProperties

    return ScopeProperties(
        slice=tests.slice,
        description=slotmath.scope_description(worktree, command),
        cpu_weight=tests.cpu_weight,
        io_weight=tests.io_weight,
    )


def list_in_flight(manager: SystemdManager | None, slice_name: str) -> list[slotmath.InFlight]:
    """The live test runs, from the scopes in the tests slice. Best effort: the wait line
    and the gate's status decorate with it, they never decide by it."""
    if manager is None:
        return []
    runs = []
    try:
        units = manager.list_units(slice_name)
    except (SystemdError, PermissionDeniedError):
        return []
    now = time.time()
    for unit in units:
        if not unit.name.startswith(slotmath.SCOPE_PREFIX):
            continue
        parsed = slotmath.parse_scope_description(unit.description)
        worktree, command = parsed if parsed else ("?", unit.description)
        running: float | None = None
        with contextlib.suppress(SystemdError, PermissionDeniedError, TypeError, ValueError):
            usec = int(manager.unit_property(unit.name, "ActiveEnterTimestamp"))
            if usec > 0:
                running = max(0.0, now - usec / 1_000_000)
        runs.append(slotmath.InFlight(unit.name, worktree, command, running))
    return runs
