"""Issue 29, item 6: the gate sees test runs in private homes.

The gate runs as `volute-gate`, and Debian makes homes 0700, so the gate cannot open a
member's checkout by its path. `volutectl test` sends the repository's common dir as a
descriptor with its registration (SCM_RIGHTS); the gate checks it and watches the slots
through it, with no ACL on the home, and systemd's fd store keeps it across restarts.

Each test boots its own systemd and runs the real volute-gate.service; bob is a member
of group `volute` whose home is 0700. Each fails on 4bb6e7b (the gate answered "permission
denied" and never counted bob's run; no descriptor came back after a restart).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from volute_testbed.gate import (
    VOLUTECTL,
    all_settled,
    deliver,
    gate_config,
    queue_rows,
    start_gate,
    status,
    unit_property,
    wait_for,
)
from volute_testbed.machine import Machine, open_interpreter_path
from volute_testbed.paths import PYTHON

pytestmark = pytest.mark.system

HOME = "/home/bob"
REPO = f"{HOME}/repo"
COMMON_DIR = f"{REPO}/.git"
# One place for turns, which a held test slot takes: a delivery then waits as test_run.
ALICES = f"{HOME}/alices"
ONE_PLACE = {"global_concurrent_turns": 1, "test_runs_count_as_turns": True}


def add_member(machine: Machine) -> None:
    """bob, in group volute, with a 0700 home (no ACL) holding a git repository."""
    machine.run(["groupadd", "-f", "-r", "volute"])
    machine.run(["useradd", "--create-home", "-G", "volute", "bob"])
    machine.run(["chmod", "0700", HOME])
    open_interpreter_path(machine)
    as_bob(
        machine,
        f"git init -q {REPO} && git -C {REPO} -c user.email=t@example.org -c user.name=t "
        f"commit -q --allow-empty -m i && git -C {REPO} config volute.testSlots 1",
    )
    assert machine.run(["stat", "-c", "%a", HOME]).stdout.strip() == "700"


def start_gate_outside(machine: Machine, config: str) -> None:
    """Start the gate, and check that its user may not enter bob's home, as on Debian."""
    start_gate(machine, config)
    probe = machine.run(["ls", REPO], user="volute-gate", check=False)
    assert probe.returncode != 0 and "Permission denied" in probe.stderr, probe


def as_bob(machine: Machine, script: str) -> str:
    env = {"HOME": HOME, "GIT_CONFIG_NOSYSTEM": "1"}
    return machine.run(["sh", "-c", script], user="bob", env=env).stdout


def start_bobs_run(machine: Machine, seconds: float) -> subprocess.Popen[str]:
    """bob's `volutectl test` in his own checkout, as a plain child (no user manager)."""
    line = f"cd {REPO} && exec {VOLUTECTL} test --json -- sleep {seconds}"
    as_bob = ["setpriv", "--reuid", "bob", "--regid", "bob", "--init-groups", "--"]
    return machine.popen(
        [*as_bob, "sh", "-c", line],
        env={"HOME": HOME},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def repository_entry(machine: Machine) -> dict[str, object] | None:
    for entry in status(machine).get("test_runs", []):
        if entry["repository"] == COMMON_DIR:
            return dict(entry)
    return None


def slots_held(machine: Machine) -> object:
    entry = repository_entry(machine)
    return None if entry is None else entry["slots_held"]


def held_as_test_run(machine: Machine) -> bool:
    rows = queue_rows(machine, "pending", "running")
    return bool(rows) and all(row["hold_reason"] == "test_run" for row in rows)


def test_a_members_run_in_a_private_home_holds_turns(machine: Machine) -> None:
    add_member(machine)
    start_gate_outside(machine, gate_config({"a": "true"}, limits=ONE_PLACE))
    run = start_bobs_run(machine, 60)
    try:
        wait_for(lambda: slots_held(machine) == 1, timeout=20)
        entry = repository_entry(machine)
        assert entry is not None and entry["problem"] is None, entry
        deliver(machine, "a", "while bob's tests run")
        wait_for(lambda: held_as_test_run(machine), timeout=10)
        # Held, not merely slow: it stays held while the run holds its slot.
        assert not queue_rows(machine, "running")
    finally:
        run.kill()
        machine.run(["pkill", "-KILL", "-u", "bob", "-x", "sleep"], check=False)
    run.communicate(timeout=30)
    wait_for(lambda: all_settled(machine), timeout=30)  # the slot freed, the turn ran
    assert slots_held(machine) == 0


def test_a_restarted_gate_still_holds_turns_for_the_run(machine: Machine) -> None:
    """The descriptor comes back from systemd's fd store: no new registration needed."""
    add_member(machine)
    start_gate_outside(machine, gate_config({"a": "true"}, limits=ONE_PLACE))
    run = start_bobs_run(machine, 120)
    try:
        wait_for(lambda: slots_held(machine) == 1, timeout=20)
        assert unit_property(machine, "volute-gate.service", "NFileDescriptorStore") == "1"
        machine.run(["systemctl", "restart", "volute-gate.service"], timeout=60)
        assert slots_held(machine) == 1  # the first answer after the restart knows
        listed = [(e["repository"], e["problem"]) for e in status(machine)["test_runs"]]
        assert listed == [(COMMON_DIR, None)]  # once, not also as "permission denied"
        deliver(machine, "a", "after the restart")
        wait_for(lambda: held_as_test_run(machine), timeout=10)
        # A second restart, with the delivery waiting: it waits on.
        machine.run(["systemctl", "restart", "volute-gate.service"], timeout=60)
        assert slots_held(machine) == 1
        wait_for(lambda: held_as_test_run(machine), timeout=10)
        assert unit_property(machine, "volute-gate.service", "NFileDescriptorStore") == "1"
    finally:
        run.kill()
        machine.run(["pkill", "-KILL", "-u", "bob", "-x", "sleep"], check=False)
    run.communicate(timeout=30)
    wait_for(lambda: all_settled(machine), timeout=30)


# A member's own client: one request line with descriptors riding along (SCM_RIGHTS).
SEND_FDS = r"""
import array, json, os, socket, sys
op, path, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(path, os.O_PATH | os.O_DIRECTORY)
request = {"v": 1, "op": op} if op != "register_repo" else {"v": 1, "op": op, "path": path}
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(60)
sock.connect("/run/volute/gate.sock")
rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd] * count).tobytes())]
sock.sendmsg([json.dumps(request).encode() + b"\n"], rights)
print(sock.makefile("rb").readline().decode().strip())
"""


def gate_fds(machine: Machine) -> int:
    pid = unit_property(machine, "volute-gate.service", "MainPID")
    return len(machine.sh(f"ls /proc/{pid}/fd", check=False).stdout.split())


def test_descriptors_sent_with_other_requests_are_closed_and_anothers_refused(
    machine: Machine,
) -> None:
    """No descriptor a member sends stays in the gate but its own repository's; one of
    a directory it does not own is refused by the owner check."""
    add_member(machine)
    # alice's repository where bob may open it and the gate may not: in bob's home
    # (put there by root), a directory of hers, world-readable.
    machine.run(["useradd", "alice"])
    machine.run(["install", "-d", "-o", "alice", "-g", "alice", "-m", "755", ALICES])
    machine.run(["sh", "-c", f"git init -q {ALICES} && chown -R alice: {ALICES}"])
    machine.write("/var/tmp/send_fds.py", SEND_FDS)
    start_gate_outside(machine, gate_config({"a": "true"}))

    def send(op: str, path: str, count: int) -> dict[str, object]:
        command = [PYTHON, "/var/tmp/send_fds.py", op, path, str(count)]
        reply: dict[str, object] = json.loads(machine.run(command, user="bob", timeout=60).stdout)
        return reply

    assert send("ping", HOME, 1)["ok"] is True
    before = gate_fds(machine)
    for _ in range(50):
        send("ping", HOME, 1)
        send("status", "/tmp", 200)  # far more than one read takes: the kernel drops them
    assert gate_fds(machine) == before
    # Another user's repository, by descriptor: refused by the owner check, not kept.
    reply = send("register_repo", f"{ALICES}/.git", 1)
    assert (reply["ok"], reply["code"]) == (False, 65), reply
    assert "belongs to uid" in str(reply["error"]), reply
    assert gate_fds(machine) == before
    assert unit_property(machine, "volute-gate.service", "NFileDescriptorStore") == "0"
    # bob's own, by descriptor: kept once, however often it is registered again.
    for _ in range(5):
        send("register_repo", COMMON_DIR, 2)
    assert gate_fds(machine) == before + 1
    assert unit_property(machine, "volute-gate.service", "NFileDescriptorStore") == "1"
    assert repository_entry(machine) is not None
    # A git dir the gate may not search (made under umask 077): said as such (77).
    as_bob(machine, f"git init -q {HOME}/closed && chmod 700 {HOME}/closed/.git")
    reply = send("register_repo", f"{HOME}/closed/.git", 1)
    assert (reply["ok"], reply["code"]) == (False, 77), reply
    assert "permission denied" in str(reply["error"])
    assert gate_fds(machine) == before + 1
