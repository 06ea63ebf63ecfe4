"""The gate's state directory on a full filesystem, against a real systemd and service.

A tiny tmpfs is mounted over /var/lib/volute before the gate starts, so the queue lives
on it; then fallocate takes every free block. A delivery must then be refused with 75
and leave no row, the gate must keep running (same PID), and once the space is back a
delivery must be acknowledged and run.
"""

from __future__ import annotations

import pytest

from volute_testbed.gate import (
    VOLUTECTL,
    all_settled,
    deliver,
    delivered_ids,
    gate_config,
    gate_events,
    install_probe,
    queue_rows,
    start_gate,
    turn_log,
    wait_for,
)
from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

STATE = "/var/lib/volute"
ALL_STATES = ("pending", "running", "done", "dead", "dropped")


def gate_pid(machine: Machine) -> int:
    show = ["systemctl", "show", "-p", "MainPID", "--value", "volute-gate"]
    return int(machine.run(show).stdout.strip())


def free_bytes(machine: Machine) -> int:
    available, block = machine.run(["stat", "-f", "-c", "%a %S", STATE]).stdout.split()
    return int(available) * int(block)


def test_a_full_state_filesystem_refuses_deliveries_with_75_and_the_gate_recovers(
    machine: Machine,
) -> None:
    install_probe(machine)
    machine.run(["mkdir", "-p", STATE])
    machine.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", STATE])
    start_gate(machine, gate_config({"sink": "turn-probe 0.05"}))
    before = deliver(machine, "sink", "before the disk fills")
    wait_for(lambda: all_settled(machine), timeout=30)
    pid = gate_pid(machine)
    assert machine.run(["findmnt", "-n", "-o", "FSTYPE", STATE]).stdout.strip() == "tmpfs"
    assert (machine.host_path(STATE) / "queue.sqlite3").exists() is False  # inside only
    assert "queue.sqlite3" in machine.run(["ls", STATE]).stdout

    machine.run(["fallocate", "-l", str(free_bytes(machine)), f"{STATE}/filler"])
    assert free_bytes(machine) == 0
    # Three at once, as a fan-out sends them: one batch or several, each is refused.
    fan_out = "\n".join(
        f"({VOLUTECTL} deliver sink --message full-{n} 2>/var/tmp/err-{n}; "
        f"echo $? > /var/tmp/rc-{n}) &"
        for n in range(3)
    )
    machine.run(["sh", "-c", f"{fan_out}\nwait"], timeout=60)
    for n in range(3):
        assert machine.run(["cat", f"/var/tmp/rc-{n}"]).stdout.strip() == "75"
        error = machine.run(["cat", f"/var/tmp/err-{n}"]).stdout
        assert "the queue could not store the delivery: database or disk is full" in error
        assert "Traceback" not in error
    # Nothing was acknowledged, so no row appeared; the gate still answers, same process.
    assert [row["id"] for row in queue_rows(machine, *ALL_STATES)] == [before]
    assert gate_pid(machine) == pid
    assert machine.run(["systemctl", "is-active", "volute-gate"]).stdout.strip() == "active"
    refusals = gate_events(machine, "VOLUTE_EVENT=not_stored")
    assert 1 <= len(refusals) <= 3
    assert {entry["VOLUTE_EXCEPTION"] for entry in refusals} == {"OperationalError"}
    assert {entry["VOLUTE_STATE_DIR"] for entry in refusals} == {STATE}

    machine.run(["rm", f"{STATE}/filler"])
    after = deliver(machine, "sink", "after the space came back")
    assert after > before
    wait_for(lambda: all_settled(machine), timeout=30)
    assert delivered_ids(turn_log(machine)) == [before, after]
    done = queue_rows(machine, "done")
    assert [row["id"] for row in done] == [before, after]
    assert gate_pid(machine) == pid
    restarts = ["systemctl", "show", "-p", "NRestarts", "--value", "volute-gate"]
    assert machine.run(restarts).stdout.strip() == "0"
