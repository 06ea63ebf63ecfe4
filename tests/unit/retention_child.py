"""A process of its own for retention's crash tests, killed by a real SIGKILL at a crash
point (volutectl/faults.py) with its transaction or VACUUM open, as the kernel would.

    python -m tests.unit.retention_child vacuum DATABASE
    python -m tests.unit.retention_child gate CONFIG

`vacuum` opens the store and converts it to incremental vacuum; `gate` runs the real
Gate (fake_systemd for systemd) with retention due at once. VOLUTE_CRASH_AT names the
point. There it SIGKILLs itself alone: the service's way, the whole cgroup, would take
the test run with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from volutectl import faults

REPO = Path(__file__).resolve().parents[2]


def run_child(
    args: list[str], crash_at: str, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.unit.retention_child", *args],
        cwd=REPO,
        env={**os.environ, "VOLUTE_CRASH_AT": crash_at, "VOLUTE_CRASH_ONCE": ""},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_when_bigger(path: Path, size: int) -> None:
    """From now on, SIGKILL this process once `path` holds more than `size` bytes."""
    if any(thread.name == "killer" for thread in threading.enumerate()):
        return

    def watch() -> None:
        while not path.exists() or path.stat().st_size <= size:
            time.sleep(0.0005)
        kill_self()

    threading.Thread(target=watch, name="killer", daemon=True).start()


def main(argv: list[str]) -> None:
    faults.kill_own_cgroup = kill_self
    mode, target = argv
    if mode == "vacuum":
        from volutectl.store.queue import Store
        from volutectl.store.schema import enable_incremental_vacuum

        store = Store(Path(target))
        # The point is reached while the VACUUM copies the rows out; the kill waits until
        # it copies them back and has saved 1 MiB of the old pages to its rollback
        # journal (the VACUUM that changes the page size cannot go through the WAL; a
        # small cache makes it write as it goes): a VACUUM half done.
        store.db.execute("PRAGMA cache_size = 64")
        faults.kill_own_cgroup = lambda: kill_when_bigger(Path(f"{target}-journal"), 1 << 20)
        print(enable_incremental_vacuum(store.db, store.path))
        return
    from tests.unit.fake_systemd import FakeManager
    from volutectl.config.settings import load_settings
    from volutectl.gate.loop import Gate
    from volutectl.store import retention

    retention.PACING = retention.Pacing(start_delay=0.0, busy_gap=0.01)
    gate = Gate(load_settings(target).settings, manager=FakeManager())
    gate.run()


if __name__ == "__main__":
    main(sys.argv[1:])
