"""The gate split in two, on a real systemd with the real units and users: the gate that
faces clients runs as volute-gate with no capability, in a sandbox that
`systemd-analyze security` rates at 3.0 or less; the launcher (root) takes orders from
it alone; and either part dying or restarting loses nothing and runs nothing twice.
"""

from __future__ import annotations

import re

import pytest

from volute_testbed import chaos
from volute_testbed.faults import (
    assert_exactly_once,
    assert_no_live_turn_scopes,
    fast_restarts,
    gate_pid,
    launcher_pid,
)
from volute_testbed.gate import (
    DEFAULT_TURN_USER,
    VOLUTECTL,
    all_settled,
    deliver,
    gate_config,
    gate_events,
    install_probe,
    install_units,
    journal,
    live_turn_scopes,
    queue_rows,
    start_gate,
    turn_log,
    wait_for,
)
from volute_testbed.machine import Machine
from volute_testbed.paths import PYTHON

pytestmark = pytest.mark.system

LAUNCHER_SOCKET = "/run/volute-launcher/launcher.sock"
TARGET_EXPOSURE = 3.0
SCORE_LINE = re.compile(r"Overall exposure level for (\S+): (\d+\.\d+)")


def proc_status(machine: Machine, pid: int) -> dict[str, str]:
    text = machine.run(["cat", f"/proc/{pid}/status"]).stdout
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def test_the_gate_runs_unprivileged_and_only_the_launcher_as_root(machine: Machine) -> None:
    install_probe(machine)
    start_gate(machine, gate_config({"m": "turn-probe 0.1"}))
    delivery = deliver(machine, "m", "hello")
    wait_for(lambda: all_settled(machine))
    gate = proc_status(machine, gate_pid(machine))
    uid = machine.run(["id", "-u", "volute-gate"]).stdout.strip()
    assert gate["Uid"].split() == [uid] * 4  # real, effective, saved, filesystem
    assert int(gate["CapEff"], 16) == int(gate["CapPrm"], 16) == int(gate["CapBnd"], 16) == 0
    assert gate["NoNewPrivs"].strip() == "1" and gate["Seccomp"].strip() == "2"
    launcher = proc_status(machine, launcher_pid(machine))
    assert launcher["Uid"].split()[0] == "0"
    # The turn ran, as the mind's user, started by the launcher and not the gate.
    assert [f[:5] for f in turn_log(machine) if f[0] == "start"] == [
        ["start", "m", "main", "1", DEFAULT_TURN_USER]
    ]
    assert queue_rows(machine, "done")[0]["id"] == delivery
    # The store belongs to the gate's user alone.
    owner = machine.run(["stat", "-c", "%U %a", "/var/lib/volute/queue.sqlite3"]).stdout.split()
    assert owner == ["volute-gate", "600"]


def test_systemd_rates_the_gates_sandbox_at_3_or_less(machine: Machine) -> None:
    install_units(machine)
    scores = {}
    for unit in ("volute-gate.service", "volute-launcher.service", "volute-heartbeat@m.service"):
        out = machine.run(["systemd-analyze", "security", "--no-pager", unit]).stdout
        [(name, score)] = SCORE_LINE.findall(out)
        assert name == unit
        scores[unit] = float(score)
    print(f"systemd-analyze security: {scores}")  # recorded in docs/security.d/gate-split.md
    assert scores["volute-gate.service"] <= TARGET_EXPOSURE, scores


# A client of the launcher's socket that is not the gate: it asks the launcher to remove
# a turn's directory (any order would do); prints the reply, or the error.
HOSTILE = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except OSError as error:
    sys.exit(print(type(error).__name__))
try:
    s.sendall(b'{"v":1,"order":"sweep","open_ids":[]}\\n')
except BrokenPipeError:
    pass  # refused before it was read: the reply is still there to read
print(s.makefile("rb").readline().decode().strip() or "EOF")
"""


def test_the_launcher_takes_no_order_from_anyone_but_the_gate(machine: Machine) -> None:
    install_probe(machine)
    start_gate(machine, gate_config({"m": "turn-probe 30"}))
    deliver(machine, "m", "a running turn, whose directory a sweep would remove")
    wait_for(lambda: len(live_turn_scopes(machine)) == 1)
    machine.write("/var/tmp/hostile.py", HOSTILE)
    # A mind's user, and a member of group volute (every client of the gate): the
    # socket is closed to both.
    machine.run(["useradd", "-M", "-G", "volute", "client"])
    for user in (DEFAULT_TURN_USER, "client"):
        refused = machine.run(
            ["runuser", "-u", user, "--", PYTHON, "/var/tmp/hostile.py", LAUNCHER_SOCKET]
        )
        assert refused.stdout.strip() == "PermissionError"
    # A user that got into group volute-gate but is not the gate's user: the launcher
    # checks the peer's uid, refuses and hangs up.
    machine.run(["useradd", "-M", "-G", "volute-gate", "intruder"])
    as_member = machine.run(
        ["runuser", "-u", "intruder", "--", PYTHON, "/var/tmp/hostile.py", LAUNCHER_SOCKET]
    )
    assert '"reply":"refused"' in as_member.stdout, as_member.stdout
    intruder = machine.run(["id", "-u", "intruder"]).stdout.strip()
    refusals = gate_events(
        machine,
        "VOLUTE_EVENT=order_connection_refused",
        f"VOLUTE_UID={intruder}",
        unit="volute-launcher.service",
    )
    assert refusals, journal(machine, "volute-launcher.service")
    # Nothing was swept: the running turn keeps its directory.
    assert machine.run(["ls", "/run/volute/turns"]).stdout.split() == ["1"]


def test_the_gates_sandbox_cannot_write_outside_its_state(machine: Machine) -> None:
    # What the gate's process could do if a request took it over: no root files, no
    # turn directories, no scopes of its own.
    start_gate(machine, gate_config({"m": "true"}))
    script = (
        "import os, sys\n"
        "for path in ('/etc/volute/x', '/run/volute/turns/x', '/var/lib/volute/ok'):\n"
        "    try:\n"
        "        open(path, 'w').close(); print(path, 'written')\n"
        "    except OSError as e:\n"
        "        print(path, type(e).__name__)\n"
    )
    pid = gate_pid(machine)
    uid, gid = (machine.run(["id", flag, "volute-gate"]).stdout.strip() for flag in ("-u", "-g"))
    out = machine.run(
        ["nsenter", "-t", str(pid), "-m", "-S", uid, "-G", gid, PYTHON, "-c", script]
    ).stdout
    assert "/etc/volute/x written" not in out and "/run/volute/turns/x written" not in out
    assert "/var/lib/volute/ok written" in out, out
    busctl = machine.run(
        [
            "runuser", "-u", "volute-gate", "--", "busctl", "call", "org.freedesktop.systemd1",
            "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager", "StartTransientUnit",
            "ssa(sv)a(sa(sv))", "volute-turn-x-1.scope", "fail", "1", "PIDs", "au", "1", "1",
            "0",
        ],
        check=False,
    )  # fmt: skip
    assert busctl.returncode != 0  # only the launcher (root) may start scopes


@pytest.mark.parametrize("restart", [False, True], ids=["sigkill", "restart"])
def test_the_launcher_dying_during_a_fan_out_loses_and_repeats_nothing(
    machine: Machine, restart: bool
) -> None:
    # 3 clients deliver to 12 minds while the launcher is SIGKILLed (its whole cgroup,
    # a turn's child not yet in its scope included) or restarted 10 times at random.
    storm = chaos.Storm(
        kills=10, seed=5, unit="volute-launcher.service", restart=restart, acknowledged=30
    )
    result = chaos.verdict(chaos.run(machine, storm))
    assert result["kills"] >= 10 and result["acknowledged"] >= 30, result
    assert result["refused"] == 0, result
    assert result["lost"] == [], result
    assert result["ran_twice"] == [], result
    assert result["dead"] == 0, result
    assert result["drain_seconds"] is not None and result["drain_seconds"] < 60, result
    assert result["max_turns"] <= 2 and result["max_per_mind"] <= 1, result
    assert result["live_scopes_after"] == [], result
    # Each kill really took it down.
    assert storm.record is not None and storm.record["pids"] == storm.record["kills"] + 1


@pytest.mark.serial
def test_a_gate_restart_adopts_the_turns_the_launcher_started(machine: Machine) -> None:
    install_probe(machine)
    fast_restarts(machine)
    # 3 turns at once: no global limit.
    start_gate(machine, gate_config({f"m{i}": "turn-probe 3" for i in range(3)}, adaptive=False))
    acked = [deliver(machine, f"m{i}", "hold") for i in range(3)]
    wait_for(lambda: len(live_turn_scopes(machine)) == 3)
    first_gate, first_launcher = gate_pid(machine), launcher_pid(machine)
    machine.run(["systemctl", "restart", "volute-gate.service"], timeout=60)
    assert gate_pid(machine) != first_gate
    assert len(live_turn_scopes(machine)) == 3  # the turns ran on
    assert len(gate_events(machine, "VOLUTE_EVENT=adopt")) >= 3
    wait_for(lambda: all_settled(machine), timeout=30)
    assert_exactly_once(turn_log(machine), acked)
    assert all(r["attempts"] == 0 for r in queue_rows(machine, "done"))
    assert launcher_pid(machine) == first_launcher
    assert_no_live_turn_scopes(machine)
    status = machine.run([VOLUTECTL, "status", "--json"]).stdout
    assert '"active_turns": 0' in status
