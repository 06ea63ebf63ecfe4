"""Runs INSIDE the test container: drives volutectl.systemd.adapter against the real manager and
prints one JSON object of what it saw, for tests/system/test_systemd_adapter.py."""

from __future__ import annotations

import json
import os
import select
import sys
import time

from volutectl.errors import VoluteError
from volutectl.systemd.adapter import Manager, ScopeProperties


def launch(
    name: str, slice_: str, hold: float, cpu: int, io: int, write_bw: str
) -> dict[str, object]:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(write_fd)
        os.read(read_fd, 1)
        with open(f"/proc/{os.getpid()}/cgroup") as handle:
            seen = handle.read()
        os.execv(
            "/bin/sh", ["sh", "-c", f'echo "$1" > /var/tmp/child-cgroup; sleep {hold}', "sh", seen]
        )
    os.close(read_fd)
    manager = Manager.connect()
    manager.watch_units()
    bandwidth: tuple[tuple[str, int], ...] = ()
    if write_bw:
        device, amount = write_bw.split()
        bandwidth = ((device, int(amount)),)
    props = ScopeProperties(
        slice=slice_,
        description="adapter probe",
        cpu_weight=cpu,
        io_weight=io,
        io_write_bandwidth_max=bandwidth,
    )
    started = time.monotonic()
    error = None
    try:
        manager.start_scope(name, [pid], props)
    except VoluteError as exc:
        error = f"{type(exc).__name__}: {exc.message}"
    launch_ms = (time.monotonic() - started) * 1000
    with open(f"/proc/{pid}/cgroup") as handle:
        before_exec = handle.read()
    live = [u.name for u in manager.list_units(slice_)]
    os.write(write_fd, b"x")
    ended_ms = None
    ended = []
    deadline = time.monotonic() + hold + 10
    while time.monotonic() < deadline and error is None:
        select.select([manager.fileno()], [], [], 1.0)
        events = manager.process_events()
        ended += [(e.name, e.active_state) for e in events]
        if any(e.name == name for e in events):
            ended_ms = (time.monotonic() - started) * 1000
            break
    os.waitpid(pid, 0)
    return {
        "error": error,
        "launch_ms": launch_ms,
        "cgroup_before_exec": before_exec,
        "live_while_running": live,
        "ended": ended,
        "ended_ms": ended_ms,
    }


def main() -> None:
    command = sys.argv[1]
    if command == "launch":
        name, slice_, hold, cpu, io = sys.argv[2:7]
        write_bw = sys.argv[7] if len(sys.argv) > 7 else ""
        print(json.dumps(launch(name, slice_, float(hold), int(cpu), int(io), write_bw)))
    elif command == "launch-dead-pid":
        manager = Manager.connect()
        try:
            manager.start_scope(sys.argv[2], [999999], ScopeProperties(slice="volute-turns.slice"))
            print(json.dumps({"error": None}))
        except VoluteError as exc:
            print(
                json.dumps({"error": f"{type(exc).__name__}: {exc.message}", "code": exc.exit_code})
            )
    elif command == "kill-stop":
        manager = Manager.connect()
        name = sys.argv[2]
        manager.kill_unit(name, int(sys.argv[3]))
        time.sleep(0.2)
        manager.stop_unit(name)
        print(json.dumps({"ok": True}))


if __name__ == "__main__":
    main()
