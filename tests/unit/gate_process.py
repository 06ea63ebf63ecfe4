"""Run `volutectl gate` (the real click command: its signal handlers, its fd limit) in a
process of its own, against tests/unit/fake_systemd.py instead of a systemd manager.

    python -m tests.unit.gate_process CONFIG [SOFT:HARD]

SOFT:HARD sets RLIMIT_NOFILE before the gate starts, as systemd's LimitNOFILE= would.
The gate says READY=1 on $NOTIFY_SOCKET, and stops on SIGTERM like the service. With
VOLUTE_CRASH_AT (volutectl/faults.py) it SIGKILLs itself alone at that point: the
service's way, its whole cgroup, would take the test run with it.
"""

from __future__ import annotations

import os
import resource
import signal
import sys

from tests.unit.fake_systemd import FakeManager
from volutectl import faults
from volutectl.cli import gate as service
from volutectl.systemd import adapter


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    faults.kill_own_cgroup = kill_self
    config = argv[0]
    if len(argv) > 1:
        soft, hard = (int(part) for part in argv[1].split(":"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    adapter.Manager.connect = lambda user=False: FakeManager()  # type: ignore[assignment,method-assign,misc]
    service.gate_command.main(["--config", config], prog_name="volutectl gate")


if __name__ == "__main__":
    main(sys.argv[1:])
