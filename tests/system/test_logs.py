"""Each turn's own log, against a real systemd and journald: the scope's stream, the gate's
MESSAGE_IDs, one entry per multi-line message, and `volutectl logs`.

Each test boots its own systemd and runs the real volute-gate.service from this checkout;
what it checks comes from journalctl, not from the gate.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from volute_testbed.gate import VOLUTECTL, all_settled, deliver, start_gate, wait_for
from volute_testbed.machine import Machine
from volute_testbed.paths import PYTHON
from volutectl.journal import MESSAGE_IDS, Event

pytestmark = pytest.mark.system

# Two minds: one runs as the packaged system user (volute, a system uid: the system
# journal), one with a dash in its name (escaped in its unit name) as a regular user
# (uid 1500: journald keeps its entries in a journal file of that user's).
CONFIG = """
[minds.mimsy]
command = 'echo "out of turn $VOLUTE_TURN_ID"; echo "err of turn $VOLUTE_TURN_ID" >&2'

[minds.m-1]
command = 'echo "m-1 says $VOLUTE_TURN_ID"'
user = "mindone"
"""


def entries(machine: Machine, *args: str) -> list[dict[str, Any]]:
    out = machine.run(["journalctl", "--no-pager", "-o", "json", *args], check=False).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def messages(machine: Machine, *args: str) -> list[str]:
    return [str(entry.get("MESSAGE")) for entry in entries(machine, *args)]


def logs(machine: Machine, *args: str, check: bool = True) -> Any:
    return machine.run([VOLUTECTL, "logs", *args], check=check)


def without_time(text: str) -> list[str]:
    """`volutectl logs` lines without their 'YYYY-MM-DD HH:MM:SS ' stamps."""
    return [line[20:] if line[:1].isdigit() else line for line in text.splitlines()]


def test_a_turns_output_is_its_scopes_own_journal_stream(machine: Machine) -> None:
    machine.run(["useradd", "-u", "1500", "-m", "mindone"])
    start_gate(machine, CONFIG)
    assert deliver(machine, "mimsy", "one", "--session", "chat", "--wait") > 0
    assert deliver(machine, "m-1", "two", "--wait") > 0
    scope = "volute-turn-mimsy-1.scope"
    wait_for(lambda: len(messages(machine, "-u", scope)) >= 2, timeout=10)

    # journalctl -u shows exactly the turn's output (stdout and stderr, in order), and
    # the entries say whose they are: the scope, the mind's identifier, its user.
    output = [e for e in entries(machine, "-u", scope) if e.get("_TRANSPORT") == "stdout"]
    assert [e["MESSAGE"] for e in output] == ["out of turn 1", "err of turn 1"]
    for entry in output:
        assert entry["_SYSTEMD_UNIT"] == scope
        assert entry["SYSLOG_IDENTIFIER"] == "volute-mimsy"
        # The slice only when journald could still read the writer's cgroup: a turn this
        # short may have exited first, and then only the header's unit is there
        # (launcher.py's docstring); journald then sends no _SYSTEMD_CGROUP either.
        if "_SYSTEMD_CGROUP" in entry:
            assert entry["_SYSTEMD_SLICE"] == "volute-turns.slice"
        assert entry["_UID"] == machine.run(["id", "-u", "volute-turn"]).stdout.strip()
    other = r"volute-turn-m\x2d1-2.scope"
    wait_for(lambda: messages(machine, f"_SYSTEMD_UNIT={other}") == ["m-1 says 2"], timeout=10)
    [entry] = entries(machine, "-t", "volute-m-1")
    assert (entry["_SYSTEMD_UNIT"], entry["_UID"]) == (other, "1500")
    # None of it in the gate's own journal any more.
    gate = messages(machine, "-u", "volute-gate.service")
    assert any("turn 1 of mimsy/chat started" in m for m in gate)
    assert not [m for m in gate if "of turn" in m or "says" in m]

    # volutectl logs: the mind's turns, each line with its turn and session.
    shown = without_time(logs(machine, "mimsy").stdout)
    assert "mimsy/chat turn 1: out of turn 1" in shown
    assert "mimsy/chat turn 1: err of turn 1" in shown
    assert any(line.startswith("gate: turn 1 of mimsy/chat started") for line in shown)
    assert not [line for line in shown if "m-1 says" in line]
    # --since: a second turn, in another session, after a point in time.
    time.sleep(1.1)
    since = f"@{int(time.time())}"
    time.sleep(1.1)
    assert deliver(machine, "mimsy", "three", "--session", "dm", "--wait") > 0
    wait_for(lambda: "out of turn 3" in logs(machine, "mimsy").stdout, timeout=10)
    later = without_time(logs(machine, "mimsy", "--since", since).stdout)
    assert "mimsy/dm turn 3: out of turn 3" in later
    assert not [line for line in later if "turn 1" in line]
    # One turn, with its session; and m-1's, found under its escaped scope name.
    one = without_time(logs(machine, "mimsy", "--turn", "3").stdout)
    assert one[0] == "-- turn 3 of mimsy, session dm (volute-turn-mimsy-3.scope)"
    assert "mimsy/dm turn 3: err of turn 3" in one
    assert not [line for line in one if "turn 1" in line]
    assert "m-1/main turn 2: m-1 says 2" in without_time(logs(machine, "m-1", "--turn", "2").stdout)
    # Errors: a turn that never ran, a turn of another mind, a mind that is not configured.
    never = logs(machine, "mimsy", "--turn", "99", check=False)
    assert never.returncode == 65 and "turn 99 of mimsy never ran" in never.stderr
    theirs = logs(machine, "mimsy", "--turn", "2", check=False)
    assert theirs.returncode == 65 and "turn 2 was m-1's" in theirs.stderr
    assert logs(machine, "nobody", check=False).returncode == 67


def test_a_turns_stream_outlives_a_sigkill_of_the_gate(machine: Machine) -> None:
    command = "echo before; while [ ! -e /run/volute/go ]; do sleep 0.05; done; echo after-the-kill"
    start_gate(machine, f"[minds.m]\ncommand = '{command}'\n")
    deliver(machine, "m", "x")
    scope = "volute-turn-m-1.scope"
    wait_for(lambda: messages(machine, "-u", scope, "_TRANSPORT=stdout") == ["before"])
    old = machine.run(["systemctl", "show", "-P", "MainPID", "volute-gate.service"]).stdout
    machine.run(["systemctl", "kill", "--signal=SIGKILL", "volute-gate.service"])
    wait_for(lambda: machine.run(["systemctl", "show", "-P", "MainPID", "volute-gate.service"])
             .stdout not in (old, "0\n"), timeout=30)  # fmt: skip
    machine.run(["touch", "/run/volute/go"])
    wait_for(lambda: all_settled(machine), timeout=30)
    wait_for(lambda: len(messages(machine, "-u", scope, "_TRANSPORT=stdout")) == 2, timeout=10)
    assert messages(machine, "-u", scope, "_TRANSPORT=stdout") == ["before", "after-the-kill"]
    assert "after-the-kill" not in "\n".join(messages(machine, "-u", "volute-gate.service"))
    shown = without_time(logs(machine, "m", "--turn", "1").stdout)
    assert shown[0] == "-- turn 1 of m, session main (volute-turn-m-1.scope)"
    assert "m/main turn 1: after-the-kill" in shown


def test_a_turns_stream_outlives_a_restart_of_journald(machine: Machine) -> None:
    # journald keeps its streams' fds in its fd store across a restart: the turn goes on
    # writing to the same stream, under its own unit, and is not killed by a broken pipe.
    command = "echo before; while [ ! -e /run/volute/go ]; do sleep 0.05; done; echo after"
    start_gate(machine, f"[minds.m]\ncommand = '{command}'\n")
    deliver(machine, "m", "x")
    scope = "volute-turn-m-1.scope"
    wait_for(lambda: messages(machine, "-u", scope, "_TRANSPORT=stdout") == ["before"])
    old = machine.run(["systemctl", "show", "-P", "MainPID", "systemd-journald"]).stdout
    machine.run(["systemctl", "restart", "systemd-journald"])
    assert machine.run(["systemctl", "show", "-P", "MainPID", "systemd-journald"]).stdout != old
    machine.run(["touch", "/run/volute/go"])
    wait_for(lambda: all_settled(machine), timeout=30)
    wait_for(lambda: len(messages(machine, "-u", scope, "_TRANSPORT=stdout")) == 2, timeout=10)
    assert messages(machine, "-u", scope, "_TRANSPORT=stdout") == ["before", "after"]
    [ended] = entries(machine, f"MESSAGE_ID={MESSAGE_IDS[Event.END]}", "VOLUTE_MIND=m")
    assert (ended["VOLUTE_OUTCOME"], ended["VOLUTE_EXIT_STATUS"]) == ("ok", "0")


TIMEOUT_CONFIG = """
[limits]
global_concurrent_turns = 1
[turns]
timeout_grace_seconds = 1
[gate]
max_attempts = 1
[minds.slow]
command = "sleep 60"
max_runtime_seconds = 1
[minds.quick]
command = "true"
"""

PROBE = """
from volutectl.journal import Event, Journal
Journal("volute-probe").log(
    "warning", "first line\\nMESSAGE_ID=00000000000000000000000000000000\\nVOLUTE_MIND=forged",
    event=Event.DEAD, mind="real",
)
"""


def test_the_gates_entries_carry_message_ids_and_a_multi_line_message_is_one_entry(
    machine: Machine,
) -> None:
    start_gate(machine, TIMEOUT_CONFIG)
    deliver(machine, "slow", "x")
    wait_for(lambda: bool(entries(machine, f"MESSAGE_ID={MESSAGE_IDS[Event.START]}")))
    deliver(machine, "quick", "held behind the cap of 1")
    wait_for(lambda: all_settled(machine), timeout=30)
    for event, mind in [(Event.HOLD, "quick"), (Event.START, "slow"), (Event.END, "quick"),
                        (Event.TIMEOUT, "slow"), (Event.DEAD, "slow")]:  # fmt: skip
        found = entries(machine, f"MESSAGE_ID={MESSAGE_IDS[event]}", f"VOLUTE_MIND={mind}")
        assert found, event
        assert {e["VOLUTE_EVENT"] for e in found} == {event.value}
        assert {e["SYSLOG_IDENTIFIER"] for e in found} == {"volute-gate"}
    [ended] = entries(machine, f"MESSAGE_ID={MESSAGE_IDS[Event.END]}", "VOLUTE_MIND=slow")
    assert (ended["VOLUTE_OUTCOME"], ended["VOLUTE_SESSION"]) == ("timeout", "main")

    # The journal module itself, in a service (stderr is the journal): a message with
    # newlines is one entry, and none of its lines becomes a field.
    machine.run(["systemd-run", "--wait", "--quiet", "--unit=volute-probe", PYTHON, "-c", PROBE])
    wait_for(lambda: bool(entries(machine, "-t", "volute-probe")), timeout=10)
    [entry] = entries(machine, "-t", "volute-probe")
    assert entry["MESSAGE"] == (
        "first line\nMESSAGE_ID=00000000000000000000000000000000\nVOLUTE_MIND=forged"
    )
    assert (entry["MESSAGE_ID"], entry["VOLUTE_MIND"]) == (MESSAGE_IDS[Event.DEAD], "real")
    assert entry["PRIORITY"] == "4" and entry["_SYSTEMD_UNIT"] == "volute-probe.service"


def read_until(stream: Any, wanted: str, timeout: float = 20) -> list[str]:
    """Lines from a pipe until one contains `wanted` (select: no blocking past timeout)."""
    import select

    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while not any(wanted in line for line in seen):
        left = deadline - time.monotonic()
        assert left > 0, f"{wanted!r} never came; saw {seen}"
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            line = stream.readline()
            assert line, f"the follower ended before {wanted!r}; saw {seen}"
            seen.append(line.rstrip("\n"))
    return seen


def test_logs_follow_shows_each_new_turn_as_it_runs(machine: Machine) -> None:
    # `volutectl logs MIND --follow` against a real journald: started before any turn,
    # it prints each turn's output as it comes, turn after turn, and only that mind's.
    import subprocess

    machine.run(["useradd", "-u", "1500", "-m", "mindone"])
    start_gate(machine, CONFIG)
    follower = machine.popen(
        [VOLUTECTL, "logs", "mimsy", "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=1,
    )
    try:
        time.sleep(1.0)  # journalctl is reading the journal's tail
        assert follower.poll() is None, follower.communicate()
        assert deliver(machine, "mimsy", "one", "--session", "chat", "--wait") > 0
        first = without_time("\n".join(read_until(follower.stdout, "out of turn 1")))
        assert "mimsy/chat turn 1: out of turn 1" in first
        assert deliver(machine, "m-1", "two", "--wait") > 0  # another mind's: not shown
        assert deliver(machine, "mimsy", "three", "--session", "dm", "--wait") > 0
        later = without_time("\n".join(read_until(follower.stdout, "err of turn 3")))
        assert "mimsy/dm turn 3: out of turn 3" in later
        assert not [line for line in first + later if "m-1 says" in line]
        assert follower.poll() is None  # still following
    finally:
        follower.terminate()
        follower.wait(timeout=10)
