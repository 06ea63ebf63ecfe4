"""Pressure-aware admission on a real systemd, with real IO pressure from a slow disk.

The slow disk is bench/replay_incident.py's (volute_testbed.slowdisk): a throttled ext4
loop device (cgroup-v1 blkio, 60 write IOPS, 2 MB/s) whose blkio cgroup this test
process joins before the container boots, so the container's systemd, the gate and
every turn inherit it. The mount is bound into the container at the same path. A "hog"
turn writes to it with O_DSYNC; its stall shows in volute-turns.slice's io.pressure, the
gate's PSI trigger fires, and deliveries that arrive then are held for io_pressure until
it falls.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from volute_testbed.gate import (
    deliver,
    gate_config,
    gate_events,
    install_probe,
    install_units,
    live_turn_scopes,
    queue_rows,
    status,
    turn_log,
    wait_for,
)
from volute_testbed.machine import Machine, dev_machine
from volute_testbed.slowdisk import SlowDisk, slow_disk

pytestmark = [pytest.mark.system, pytest.mark.serial]


@pytest.fixture
def slow() -> Iterator[tuple[Machine, SlowDisk]]:
    """The `machine` fixture's container, booted inside the slow disk's blkio cgroup."""
    with slow_disk(size_mib=256, name="pressure-test") as disk:
        with dev_machine(name="vt-pressure", binds=[disk.mount]) as machine:
            yield machine, disk


def hog_command(mount: Path, mib: int) -> str:
    return (
        f"dd if=/dev/zero of={mount}/hog.$$ bs=64k count={mib * 16} oflag=dsync status=none; "
        f"rm -f {mount}/hog.$$"
    )


def start_pressure_gate(machine: Machine, config: str) -> None:
    machine.write("/etc/volute/volutectl.toml", config)
    install_units(machine)
    # The slice's cgroup must exist when the gate registers its trigger there.
    machine.run(["systemctl", "start", "volute-turns.slice"])
    machine.run(["systemctl", "start", "volute-gate.service"], timeout=60)


def test_pressure_holds_new_turns_and_release_resumes_them_in_fifo_order(
    slow: tuple[Machine, SlowDisk],
) -> None:
    machine, disk = slow
    install_probe(machine)
    quick = [f"q{i}" for i in range(5)]
    minds = {"hog": hog_command(disk.mount, 10), **dict.fromkeys(quick, "turn-probe 0.1")}
    start_pressure_gate(
        machine,
        gate_config(
            minds,
            adaptive=False,  # today's PSI hold alone
            **{"limits.io_pressure": {"enabled": True, "recheck_seconds": 0.5}},
        ),
    )
    [gate_on] = gate_events(machine, "VOLUTE_EVENT=io_pressure_on")  # a PSI trigger
    # The turns slice's own file is the one looked at (per-slice, not system). The
    # unprivileged gate may be refused a trigger there: then it is on /proc/pressure/io.
    slice_file = str(gate_on["VOLUTE_SLICE_FILE"])
    assert slice_file.endswith("/volute.slice/volute-turns.slice/io.pressure"), gate_on
    assert gate_on["VOLUTE_PRESSURE_FILE"] in (slice_file, "/proc/pressure/io"), gate_on

    hog = deliver(machine, "hog", "write")
    # The hog's synced writes stall the slice; the kernel tells the gate (2 s windows here).
    wait_for(
        lambda: bool(gate_events(machine, "VOLUTE_EVENT=io_pressure_high")),
        timeout=20,
        interval=0.2,
    )
    assert len(live_turn_scopes(machine)) == 1
    held = [deliver(machine, mind, f"wake {mind}") for mind in quick]

    # (a) Held: no quick turn starts while the hog runs under pressure.
    wait_for(
        lambda: (
            all(r["hold_reason"] == "io_pressure" for r in queue_rows(machine, "pending"))
            and len(queue_rows(machine, "pending")) == len(held)
        ),
        timeout=10,
    )
    time.sleep(0.5)
    assert [live for live in live_turn_scopes(machine) if "-q" in live] == []
    assert turn_log(machine) == []
    now = status(machine)
    assert now["holds"] == {"io_pressure": len(held)}
    # (c) A held row has no attempt counted.
    assert all(r["attempts"] == 0 for r in queue_rows(machine, "pending"))

    # (b) Release: the hog ends, pressure falls, and the held turns go out in id order.
    wait_for(lambda: not queue_rows(machine, "pending", "running"), timeout=90, interval=0.3)
    starts = [fields for fields in turn_log(machine) if fields[0] == "start"]
    assert [int(fields[5]) for fields in starts] == held  # FIFO
    assert [fields[1] for fields in starts] == quick
    done = {int(r["id"]): r for r in queue_rows(machine, "done")}
    assert sorted(done) == sorted([hog, *held])
    assert all(done[i]["attempts"] == 0 for i in done)
    assert all(int(done[i]["held_ms"]) > 0 for i in held)
    assert gate_events(machine, "VOLUTE_EVENT=hold_end", "VOLUTE_REASON=io_pressure")
    # The fall is said at the next re-read below the resume threshold, which may come
    # after the queue drained: one turn may always run, so the held ones can finish first.
    wait_for(
        lambda: bool(gate_events(machine, "VOLUTE_EVENT=io_pressure_fell")),
        timeout=20,
        interval=0.3,
    )


def test_pressure_gate_off_by_default_starts_everything_at_once(
    slow: tuple[Machine, SlowDisk],
) -> None:
    machine, disk = slow
    install_probe(machine)
    quick = [f"q{i}" for i in range(4)]
    minds = {"hog": hog_command(disk.mount, 16), **dict.fromkeys(quick, "turn-probe 3")}
    # No global limit at all: the pressure gate off by default, the adaptive limit by name.
    start_pressure_gate(machine, gate_config(minds, adaptive=False))
    assert gate_events(machine, "VOLUTE_EVENT=io_pressure_on") == []
    deliver(machine, "hog", "write")
    time.sleep(2.5)  # long enough for a 2 s-window trigger to have fired, were one registered
    for mind in quick:
        deliver(machine, mind, "wake")
    wait_for(lambda: len(live_turn_scopes(machine)) == 1 + len(quick), timeout=10)
    assert gate_events(machine, "VOLUTE_REASON=io_pressure") == []
