"""The launcher (root) under a compromised gate: the gate's user, `volute-gate`, sends
it orders of its own making over the launcher's socket. Whatever it sends, the launcher
refuses what does not fit and keeps serving: it never ends on an order, and it never
gives a mind's file to another mind's user.

Each test boots its own systemd with the real units and users; the hostile orders are
sent by a Python script run as `volute-gate` (runuser), as a gate taken over would.
"""

from __future__ import annotations

import json

import pytest

from volute_testbed.faults import launcher_pid
from volute_testbed.gate import (
    deliver,
    gate_config,
    gate_events,
    install_probe,
    journal,
    live_turn_scopes,
    queue_rows,
    start_gate,
    unit_property,
    wait_for,
)
from volute_testbed.machine import Machine
from volute_testbed.paths import PYTHON

pytestmark = pytest.mark.system

LAUNCHER_SOCKET = "/run/volute-launcher/launcher.sock"
MIND_USER = "mindy"

# Sends one order line (argv[1]) to the launcher, with a sealed memfd payload holding
# argv[2] if given, and prints the reply line (or EOF if the launcher hung up).
HOSTILE_GATE = """
import array, fcntl, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
s.connect(sys.argv[1])
fds = []
if len(sys.argv) > 3:
    fd = os.memfd_create("payload", os.MFD_ALLOW_SEALING)
    os.write(fd, sys.argv[3].encode())
    fds = [fd]
ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
s.sendmsg([sys.argv[2].encode() + b"\\n"], ancillary)
print(s.makefile("rb").readline().decode().strip() or "EOF")
"""


def launched(machine: Machine, mind: str) -> list[dict[str, object]]:
    """The launcher's entries of the turns it forked for `mind` (the gate's start entries
    name the mind; the launcher's name the turn only)."""
    starts = gate_events(machine, "VOLUTE_EVENT=start", f"VOLUTE_MIND={mind}")
    turns = {entry["VOLUTE_TURN_ID"] for entry in starts}
    forks = gate_events(machine, "VOLUTE_EVENT=launched", unit="volute-launcher.service")
    return [entry for entry in forks if entry["VOLUTE_TURN_ID"] in turns]


def as_gate(machine: Machine, order: dict[str, object], payload: str | None = None) -> str:
    line = json.dumps({"v": 1, **order}, separators=(",", ":"))
    args = [PYTHON, "/var/tmp/hostile-gate.py", LAUNCHER_SOCKET, line]
    args += [payload] if payload is not None else []
    return machine.run(["runuser", "-u", "volute-gate", "--", *args]).stdout.strip()


def test_an_offer_for_another_or_no_mind_is_refused_and_the_launcher_lives(
    machine: Machine,
) -> None:
    install_probe(machine)
    machine.run(["useradd", "-r", "-M", "-d", "/nonexistent", "-s", "/bin/sh", MIND_USER])
    config = gate_config({"other": "true", "evil": "turn-probe 60"}) + f'user = "{MIND_USER}"\n'
    start_gate(machine, config)
    machine.write("/var/tmp/hostile-gate.py", HOSTILE_GATE)
    deliver(machine, "evil", "a running turn to offer into")
    wait_for(lambda: len(live_turn_scopes(machine)) == 1)
    pid = launcher_pid(machine)
    record = '{"id": 99, "session": "main", "message": "x", "interrupt": false}\n'
    # A mind the launcher does not know: on the merged code a KeyError ended the
    # launcher (exit 70), and with it whatever the gate had under way.
    reply = as_gate(
        machine, {"order": "offer", "turn_id": 1, "mind": "nosuch", "delivery_id": 98}, record
    )
    assert json.loads(reply) == {
        "v": 1,
        "reply": "refused",
        "error": "mind 'nosuch' is not configured for the launcher",
        "no_answer": False,  # a refusal, not systemd's silence: counted, not retried
    }
    # Another mind than the turn's: root would have made a file of the other mind's
    # user (volute-turn) in evil's inbox.
    reply = as_gate(
        machine, {"order": "offer", "turn_id": 1, "mind": "other", "delivery_id": 99}, record
    )
    assert json.loads(reply)["reply"] == "refused", reply
    assert "not the offering mind's user's" in reply
    inbox = machine.run(["ls", "-A", "/run/volute/turns/1/inbox"]).stdout.split()
    assert inbox == []
    # The launcher is the same process, never restarted, and still serves the gate.
    assert launcher_pid(machine) == pid
    assert unit_property(machine, "volute-launcher.service", "NRestarts") == "0"
    assert "internal error" not in journal(machine, "volute-launcher.service")
    deliver(machine, "other", "the launcher still starts turns")
    wait_for(lambda: bool(launched(machine, "other")))


# Sends argv[2] orders, one at a time, each with a descriptor it does not take (of
# /dev/null), reading each reply; prints how many were answered, and how.
FD_FLOOD = """
import array, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
s.connect(sys.argv[1])
replies = s.makefile("rb")
null = os.open("/dev/null", os.O_RDONLY)
line = b'{"v":1,"order":"inspect","turn_id":424242,"folded":[]}\\n'
rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [null]))]
answers = {}
try:
    for _ in range(int(sys.argv[2])):
        s.sendmsg([line], rights)
        kind = replies.readline().split(b'"reply":"')[1].split(b'"')[0].decode()
        answers[kind] = answers.get(kind, 0) + 1
except (OSError, IndexError):
    answers["gone"] = 1
print(" ".join(f"{kind}={count}" for kind, count in sorted(answers.items())))
"""


def test_descriptors_that_no_order_takes_do_not_fill_the_launchers_table(
    machine: Machine,
) -> None:
    install_probe(machine)
    start_gate(machine, gate_config({"m": "turn-probe 0.1"}))
    machine.write("/var/tmp/fd-flood.py", FD_FLOOD)
    pid = launcher_pid(machine)
    flood = [PYTHON, "/var/tmp/fd-flood.py", LAUNCHER_SOCKET, "1100"]
    out = machine.run(["runuser", "-u", "volute-gate", "--", *flood], timeout=120).stdout
    # The first such order is refused and its connection closed; on the merged code each
    # was answered and its descriptor kept, 1,100 past the launcher's 1,024.
    assert out.split() == ["gone=1", "refused=1"], out
    opened = int(machine.sh(f"ls /proc/{pid}/fd | wc -l").stdout)
    assert opened < 32, opened
    delivery = deliver(machine, "m", "the launcher still starts turns", "--wait")
    assert any(r["id"] == delivery for r in queue_rows(machine, "done"))
    assert launcher_pid(machine) == pid
