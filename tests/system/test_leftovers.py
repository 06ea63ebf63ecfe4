"""A turn ends with its turn (issue 29, finding 5): what a turn's main process leaves
behind in its scope (`setsid sleep 600 &`) is stopped `turns.leftover_grace_seconds`
after that process exited, and the turn's place is freed: the mind's next delivery
starts then, not at `max_runtime_seconds` (an hour by default). Also across a gate
restart during the grace: the new gate adopts the turn and still stops it.
"""

from __future__ import annotations

import pytest

from volute_testbed.gate import (
    deliver,
    gate_config,
    gate_events,
    live_turn_scopes,
    queue_rows,
    start_gate,
    wait_for,
)
from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

LEFTOVERS_STOPPED = "2d205a995f8641a19a2a39c0bfb48530"  # docs/journal.md
LOG = "/var/tmp/leave-behind.log"
# A turn that leaves a process of its own session behind, then ends with status 0. It
# logs when it started and when it ended, on the container's clock (the host's), and
# the PID of what it left.
LEAVE_BEHIND = f"""#!/bin/sh
echo "start $VOLUTE_TURN_ID $VOLUTE_SESSION $(date +%s.%N)" >> {LOG}
cat > /dev/null
setsid sleep 600 < /dev/null > /dev/null 2>&1 &
echo "left $VOLUTE_TURN_ID $!" >> {LOG}
echo "end $VOLUTE_TURN_ID $(date +%s.%N)" >> {LOG}
exit 0
"""
# Slack for a loaded 2-core machine: the gate's pass, systemd's stop, the next start.
MARGIN_SECONDS = 10.0


def leave_behind_log(machine: Machine) -> list[list[str]]:
    text = machine.sh(f"cat {LOG} 2>/dev/null || true").stdout
    return [line.split() for line in text.splitlines() if line.strip()]


def logged(machine: Machine, kind: str) -> list[list[str]]:
    """The log's lines of one kind: `start ID SESSION TIME`, `left ID PID`, `end ID TIME`."""
    return [f for f in leave_behind_log(machine) if f[0] == kind]


def started_in(machine: Machine, session: str) -> list[list[str]]:
    return [f for f in logged(machine, "start") if f[2] == session]


def alive(machine: Machine, pid: int) -> bool:
    return machine.run(["kill", "-0", str(pid)], check=False).returncode == 0


def start_leave_behind_gate(machine: Machine, **turns: object) -> None:
    machine.write("/usr/local/bin/leave-behind", LEAVE_BEHIND, mode=0o755)
    machine.sh(f": > {LOG}; chmod 666 {LOG}")
    # One turn of the mind at a time (the default), and the default hour of max runtime.
    start_gate(machine, gate_config({"m": "leave-behind"}, turns=turns))


def deliver_two(machine: Machine) -> tuple[int, int]:
    """A turn that leaves a process behind; then the mind's next delivery, in another
    session (not folded in), held as mind_busy until the first turn's place is free."""
    first = deliver(machine, "m", "first", "--session", "a")
    wait_for(lambda: bool(logged(machine, "end")))
    second = deliver(machine, "m", "second", "--session", "b")
    return first, second


def check_leftover_stopped(machine: Machine, first: int, grace: float) -> float:
    """The first turn's leftover is gone, the journal said so, its delivery is done (its
    main process exited 0), and the second turn started a grace after the first ended:
    not before (the leftover had its grace), not much later. Returns that delay."""
    [(_, turn_id, ended)] = [tuple(f) for f in logged(machine, "end")[:1]]
    [(_, _, leftover)] = [tuple(f) for f in logged(machine, "left")[:1]]
    [start_b] = started_in(machine, "b")
    delay = float(start_b[3]) - float(ended)
    print(f"main exited -> next turn started: {delay:.2f} s (grace {grace:g} s)")
    assert grace - 0.5 <= delay < grace + MARGIN_SECONDS
    assert not alive(machine, int(leftover))
    [entry] = gate_events(machine, f"MESSAGE_ID={LEFTOVERS_STOPPED}")
    assert entry["VOLUTE_EVENT"] == "leftovers_stopped"
    assert entry["VOLUTE_TURN_ID"] == turn_id and entry["VOLUTE_PROCESSES"] == "1"
    assert entry["VOLUTE_PIDS"] == leftover
    assert entry["VOLUTE_UNIT"] == f"volute-turn-m-{turn_id}.scope"
    [row] = [r for r in queue_rows(machine, "done") if int(r["id"]) == first]
    assert row["attempts"] == 0  # exited 0: done, no failed attempt for the leftover
    return delay


def test_a_turn_that_leaves_a_process_behind_frees_its_place_after_its_grace(
    machine: Machine,
) -> None:
    start_leave_behind_gate(machine)  # the default grace, 5 s
    first, _ = deliver_two(machine)
    # The old gate waited for the scope to empty: an hour (max_runtime_seconds).
    wait_for(lambda: bool(started_in(machine, "b")), timeout=5 + MARGIN_SECONDS)
    check_leftover_stopped(machine, first, grace=5.0)
    wait_for(lambda: len(queue_rows(machine, "done")) == 2, timeout=30)


def test_a_gate_restarted_during_the_grace_still_stops_what_was_left(machine: Machine) -> None:
    grace = 12.0
    start_leave_behind_gate(machine, leftover_grace_seconds=grace)
    first, _ = deliver_two(machine)
    machine.run(["systemctl", "restart", "volute-gate.service"], timeout=60)
    assert len(live_turn_scopes(machine)) == 1  # the leftover keeps the first's scope
    wait_for(lambda: bool(gate_events(machine, "VOLUTE_EVENT=adopt")))
    # The new gate gives the grace again from its adoption: at most twice the grace.
    wait_for(lambda: bool(started_in(machine, "b")), timeout=2 * grace + MARGIN_SECONDS)
    [(_, _, leftover)] = [tuple(f) for f in logged(machine, "left")[:1]]
    [(_, _, ended)] = [tuple(f) for f in logged(machine, "end")[:1]]
    delay = float(started_in(machine, "b")[0][3]) - float(ended)
    print(f"main exited, gate restarted -> next turn started: {delay:.2f} s (grace {grace:g} s)")
    assert delay >= grace - 0.5  # the leftover had at least its grace
    assert not alive(machine, int(leftover))
    [entry] = gate_events(machine, f"MESSAGE_ID={LEFTOVERS_STOPPED}")
    assert entry["VOLUTE_PROCESSES"] == "1" and entry["VOLUTE_PIDS"] == leftover
    [row] = [r for r in queue_rows(machine, "done") if int(r["id"]) == first]
    assert row["attempts"] == 0
