"""Pause and wait against a real systemd: the real volute-gate.service behind its socket.

A pause is a row in the store, so it outlives the gate: a SIGKILL of the gate's whole
cgroup and a `systemctl restart` leave the paused mind's deliveries held (reason
`paused`, no attempt), new ones are still acknowledged, and the gate's STATUS= (what
`systemctl status` shows) says so. `volutectl wait` and `deliver --wait` lose their
connection when the gate restarts, and connect again to the next gate: they exit with
the turn's own status. Each test boots its own systemd; turns run the turn-probe.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from volute_testbed.gate import (
    DEFAULT_SOCKET,
    VOLUTECTL,
    all_settled,
    deliver,
    delivery_states,
    gate_config,
    gate_serves_systemds_socket,
    install_probe,
    queue_rows,
    start_gate,
    turn_log,
    unit_property,
    wait_for,
)
from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

GATE = "volute-gate.service"


def status_text(machine: Machine) -> str:
    """The gate's sd_notify STATUS=, as `systemctl status` shows it."""
    return unit_property(machine, GATE, "StatusText")


def volutectl(machine: Machine, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return machine.run([VOLUTECTL, *args], check=check)


def held_for_pause(machine: Machine, *ids: int) -> bool:
    rows = {int(str(row["id"])): row for row in queue_rows(machine, "pending")}
    return all(i in rows and rows[i]["hold_reason"] == "paused" for i in ids)


def gate_up_again(machine: Machine, before: str) -> None:
    """A new gate process serves systemd's socket (its invocation differs from `before`)."""
    wait_for(
        lambda: (
            unit_property(machine, GATE, "InvocationID") not in ("", before)
            and unit_property(machine, GATE, "ActiveState") == "active"
            and gate_serves_systemds_socket(machine)
        ),
        timeout=30,
        interval=0.1,
    )


def gate_clients(machine: Machine) -> int:
    """How many client connections the gate holds open now (by its fds' inodes)."""
    pid = unit_property(machine, GATE, "MainPID")
    links = machine.sh(f"for fd in /proc/{pid}/fd/*; do readlink $fd; done", check=False)
    inodes = {link[len("socket:[") : -1] for link in links.stdout.split() if "socket:[" in link}
    table = machine.run(["cat", "/proc/net/unix"]).stdout.splitlines()[1:]
    # Num RefCount Protocol Flags Type St Inode Path; Flags 00010000: listening
    return sum(
        1
        for fields in map(str.split, table)
        if fields[6] in inodes and fields[3] != "00010000" and fields[7:] == [DEFAULT_SOCKET]
    )


def starts_of(machine: Machine, mind: str) -> list[list[int]]:
    """The delivery ids each of `mind`'s turns got on stdin, in order."""
    return [
        [int(x) for x in fields[5:]]
        for fields in turn_log(machine)
        if fields[0] == "start" and fields[1] == mind
    ]


def test_a_pause_outlives_a_sigkill_and_a_restart_of_the_gate_and_resume_flushes_it(
    machine: Machine,
) -> None:
    install_probe(machine)
    start_gate(machine, gate_config({"m": "turn-probe 0.1", "n": "turn-probe 0.1"}))
    assert volutectl(machine, "pause", "m").stdout == "paused m\n"
    first = deliver(machine, "m", "held one")
    other = deliver(machine, "n", "not paused")
    wait_for(lambda: held_for_pause(machine, first) and delivery_states(machine)[other] == "done")
    wait_for(lambda: "1 held (paused)" in status_text(machine))
    assert status_text(machine).endswith(", 1 paused"), status_text(machine)
    since = json.loads(volutectl(machine, "status", "--json").stdout)["paused"]

    # SIGKILL of the gate's whole cgroup: nothing is tidied; Restart= brings it back.
    invocation = unit_property(machine, GATE, "InvocationID")
    machine.run(["systemctl", "kill", "--signal=KILL", GATE])
    gate_up_again(machine, invocation)
    second = deliver(machine, "m", "acknowledged while paused")
    invocation = unit_property(machine, GATE, "InvocationID")
    machine.run(["systemctl", "restart", GATE], timeout=60)
    gate_up_again(machine, invocation)
    wait_for(lambda: held_for_pause(machine, first, second))
    wait_for(lambda: status_text(machine).endswith(", 1 paused"))
    assert "2 held (paused)" in status_text(machine), status_text(machine)

    status = json.loads(volutectl(machine, "status", "--json").stdout)
    assert status["paused"] == since  # the same pause, since the same moment
    assert status["minds"]["m"]["paused_since"] == since[0]["since"]
    table = volutectl(machine, "status").stdout
    [row] = [line for line in table.splitlines() if line.startswith("m ")]
    assert row.split()[:3] == ["m", "-", "2"], table  # not running, 2 pending
    assert "paused: m since" in table, table
    assert volutectl(machine, "pause", "m").stdout.startswith("m was already paused (")
    assert starts_of(machine, "m") == []  # nothing of m ran through two gates

    assert volutectl(machine, "resume", "m").stdout == "resumed m\n"
    wait_for(lambda: all_settled(machine), timeout=30)
    assert starts_of(machine, "m") == [[first, second]]  # the wake flush: one batch
    assert all(row["attempts"] == 0 for row in queue_rows(machine, "done"))
    wait_for(lambda: status_text(machine).endswith(", 0 paused"))
    assert volutectl(machine, "resume", "ghost", check=False).returncode == 67


def test_wait_and_deliver_wait_reconnect_across_a_gate_restart(machine: Machine) -> None:
    install_probe(machine)
    config = gate_config(
        {"fails": "TURN_EXIT=3 turn-probe 2", "works": "turn-probe 2"},
        gate={"max_attempts": 1},
    )
    start_gate(machine, config)
    failing = deliver(machine, "fails", "exits 3")
    waiter = machine.popen(
        [VOLUTECTL, "wait", str(failing)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    submitter = machine.popen(
        [VOLUTECTL, "deliver", "works", "--message", "ok", "--wait"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for(lambda: len([f for f in turn_log(machine) if f[0] == "start"]) == 2)
    wait_for(lambda: gate_clients(machine) == 2)  # both wait on the gate that goes
    invocation = unit_property(machine, GATE, "InvocationID")
    machine.run(["systemctl", "restart", GATE], timeout=60)  # both turns go on
    gate_up_again(machine, invocation)
    out, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 3, err  # the turn's own exit status, across the restart
    assert f"delivery {failing} is dead" in err
    out, err = submitter.communicate(timeout=30)
    assert submitter.returncode == 0, err
    delivered = int(out.strip())
    assert delivery_states(machine) == {failing: "dead", delivered: "done"}
    assert [f[1] for f in turn_log(machine) if f[0] == "end"].count("works") == 1  # once

    # Later waits: a settled delivery is told at once; an unknown id is 65, named.
    assert volutectl(machine, "wait", str(delivered)).returncode == 0
    assert volutectl(machine, "wait", str(delivered), str(failing), check=False).returncode == 3
    unknown = volutectl(machine, "wait", str(delivered), "9999", check=False)
    assert unknown.returncode == 65, unknown.stderr
    assert "no delivery 9999" in unknown.stderr
