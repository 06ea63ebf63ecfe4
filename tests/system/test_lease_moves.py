"""The launcher's side of a lease's processes (issue 31, item 2): MoveIn moves the
processes whose pidfds come with the order into the lease's scope, MoveBack returns them
to the units they came from (or the fallback), and a compromised gate's MoveIn moves
nothing that is not the mind's user's own.

The orders are sent as the gate's user, `volute-gate`, by a script of the test's own
(as docs/security.md's launcher-side tests do), so each test shows what the launcher
does whatever the gate asks. The target is a turn scope that the launcher started for
a delivery (StartTurn), its command sleeping: a lease's scope is one of the same name.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from volute_testbed.faults import CRASHED, fast_restarts, gate_pid, launcher_pid
from volute_testbed.gate import (
    deliver,
    gate_events,
    journal,
    live_turn_scopes,
    start_gate,
    unit_property,
    wait_for,
)
from volute_testbed.lines import PipeLines
from volute_testbed.machine import Machine
from volute_testbed.paths import PYTHON

pytestmark = pytest.mark.system

LAUNCHER_SOCKET = "/run/volute-launcher/launcher.sock"
RECORDS = "/run/volute-launcher/moved"
MIND_USER = "mindy"
CONFIG = f"""
[limits.adaptive]
enabled = false
[minds."m"]
command = "sleep 600"
user = "{MIND_USER}"
[minds."o"]
command = "sleep 600"
user = "{MIND_USER}"
"""

# Sends one order line (argv[2]) to the launcher with a pidfd of each pid in argv[3:]
# (pidfd_open needs no privilege: a gate taken over can open any process's), and prints
# the reply line, or EOF if the launcher hung up. A pid of "exited" is a child of the
# script's own that has exited and been reaped by the time the order goes.
HOSTILE_MOVE = """
import array, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect(sys.argv[1])
fds = []
for pid in sys.argv[3:]:
    if pid == "exited":
        child = os.fork()
        if child == 0:
            os._exit(0)
        fds.append(os.pidfd_open(child))
        os.waitpid(child, 0)
    else:
        fds.append(os.pidfd_open(int(pid)))
ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
s.sendmsg([sys.argv[2].encode() + b"\\n"], ancillary)
print(s.makefile("rb").readline().decode().strip() or "EOF")
"""


def order(machine: Machine, body: dict[str, object], *pids: int | str) -> dict[str, object]:
    """The launcher's reply to `body`, sent by the gate's user with pidfds of `pids`."""
    line = json.dumps({"v": 1, **body}, separators=(",", ":"))
    args = [PYTHON, "/var/tmp/hostile-move.py", LAUNCHER_SOCKET, line, *map(str, pids)]
    out = machine.run(["runuser", "-u", "volute-gate", "--", *args]).stdout.strip()
    reply: dict[str, object] = {"reply": "EOF"} if out == "EOF" else json.loads(out)
    return reply


def move_in(machine: Machine, turn_id: int, *pids: int | str, mind: str = "m") -> dict[str, object]:
    body = {"order": "move_in", "turn_id": turn_id, "mind": mind, "pids": len(pids)}
    return order(machine, body, *pids)


def move_back(machine: Machine, turn_id: int, mind: str = "m") -> dict[str, object]:
    return order(machine, {"order": "move_back", "turn_id": turn_id, "mind": mind})


def systemd_cgroup(machine: Machine, pid: int) -> str:
    """The systemd line of /proc/PID/cgroup: the unit systemd counts the process in."""
    text = machine.run(["cat", f"/proc/{pid}/cgroup"]).stdout
    lines = [line for line in text.splitlines() if ":name=systemd:" in line]
    lines = lines or [line for line in text.splitlines() if line.startswith("0::")]
    return lines[0].rsplit(":", 1)[1]


def alive(machine: Machine, pid: int) -> bool:
    return machine.run(["kill", "-0", str(pid)], check=False).returncode == 0


def runner(machine: Machine, unit: str, *properties: str, user: str = MIND_USER) -> int:
    """A resident process as `user`, the main process of service `unit`: its pid."""
    props = [arg for prop in properties for arg in ("-p", prop)]
    machine.run(["systemd-run", f"--unit={unit}", f"--uid={user}", *props, "sleep", "1000"])
    pid = int(unit_property(machine, f"{unit}.service", "MainPID"))
    assert pid > 0
    return pid


def scoped_runner(machine: Machine, unit: str) -> int:
    """A resident process as the mind's user, alone in scope `unit`: its pid."""
    machine.sh(
        f"setsid -f systemd-run --scope --unit={unit} --uid={MIND_USER} sleep 1001"
        " </dev/null >/dev/null 2>&1"
    )
    # The whole command line, anchored: before it execs `sleep`, systemd-run's own
    # command line holds "sleep 1001" too, in the cgroup it was started from, not yet
    # moved into the scope.
    found = ["pgrep", "-f", "^[^ ]*sleep 1001$"]  # sleep as exec'd: /usr/bin/sleep
    wait_for(lambda: machine.run(found, check=False).returncode == 0)
    return int(machine.run(found).stdout.split()[0])


def a_turn(machine: Machine, mind: str) -> int:
    """Start a turn of `mind` (its command sleeps) and return its turn id."""
    before = set(live_turn_scopes(machine))
    deliver(machine, mind, "a scope to move into")
    wait_for(lambda: len(set(live_turn_scopes(machine)) - before) == 1)
    (scope,) = set(live_turn_scopes(machine)) - before
    return int(scope.removesuffix(".scope").rsplit("-", 1)[1])


def setup(machine: Machine) -> None:
    machine.run(["useradd", "-r", "-M", "-d", "/nonexistent", "-s", "/bin/sh", MIND_USER])
    start_gate(machine, CONFIG)
    machine.write("/var/tmp/hostile-move.py", HOSTILE_MOVE)


def test_a_minds_processes_move_into_the_leases_scope_and_back_alive(machine: Machine) -> None:
    setup(machine)
    turn = a_turn(machine, "m")
    scope = f"volute-turn-m-{turn}.scope"
    plain = runner(machine, "runner-a")
    # A delegated unit (as user@.service is) takes its process back through systemd.
    delegated = runner(machine, "runner-d", "Delegate=yes")
    reply = move_in(machine, turn, plain, delegated)
    assert reply == {
        "v": 1,
        "reply": "moved",
        "moved": [plain, delegated],
        "origins": ["runner-a.service", "runner-d.service"],
    }
    for pid in (plain, delegated):
        assert systemd_cgroup(machine, pid).endswith(f"/volute-turns.slice/{scope}")
    shown = machine.run(["systemctl", "status", "--no-pager", "-l", scope], check=False).stdout
    assert f"{plain} /usr/bin/sleep 1000" in shown.replace("─", " ")
    # The launcher restarts between the two: its record on /run says where each came from.
    machine.run(["systemctl", "restart", "volute-launcher.service"])
    assert move_back(machine, turn) == {"v": 1, "reply": "done"}
    assert systemd_cgroup(machine, plain) == "/system.slice/runner-a.service"
    assert systemd_cgroup(machine, delegated) == "/system.slice/runner-d.service"
    assert alive(machine, plain) and alive(machine, delegated)
    assert unit_property(machine, "runner-a.service", "ActiveState") == "active"
    # A second MoveBack has nothing left to do.
    assert move_back(machine, turn) == {"v": 1, "reply": "done"}
    assert machine.run(["ls", "-A", RECORDS]).stdout.split() == []
    mode = machine.run(["stat", "-c", "%U %a", RECORDS]).stdout.split()
    assert mode == ["root", "700"]
    assert systemd_cgroup(machine, plain) == "/system.slice/runner-a.service"


def test_a_process_whose_unit_is_gone_goes_to_the_fallback_scope(machine: Machine) -> None:
    setup(machine)
    turn = a_turn(machine, "m")
    pid = scoped_runner(machine, "runner-s")
    assert systemd_cgroup(machine, pid) == "/system.slice/runner-s.scope"
    assert move_in(machine, turn, pid)["moved"] == [pid]
    # Its scope, empty now, ends.
    wait_for(lambda: unit_property(machine, "runner-s.scope", "ActiveState") != "active")
    assert move_back(machine, turn) == {"v": 1, "reply": "done"}
    assert systemd_cgroup(machine, pid) == f"/system.slice/volute-returned-m-{turn}.scope"
    assert alive(machine, pid)


def test_a_compromised_gates_move_orders_move_nothing_but_the_minds_own(
    machine: Machine,
) -> None:
    setup(machine)
    turn = a_turn(machine, "m")
    other_turn = a_turn(machine, "o")  # mind o runs as the same user
    mine = runner(machine, "runner-a")
    roots = runner(machine, "roots-own", user="root")
    in_other_pid = next(
        int(pid)
        for pid in machine.run(["pgrep", "-u", MIND_USER, "-x", "sleep"]).stdout.split()
        if f"volute-turn-o-{other_turn}" in systemd_cgroup(machine, int(pid))
    )
    pid = launcher_pid(machine)
    refusals: dict[str, tuple[int | str, str]] = {
        "another user's": (roots, "runs as uid 0/0"),
        "pid 1": (1, "pid 1"),
        "the gate's": (gate_pid(machine), "pids[1]"),
        "the launcher's": (pid, "pids[1]"),
        "another mind's scope": (in_other_pid, f"volute-turn-o-{other_turn}.scope"),
        "an exited one": ("exited", "the process has exited"),
    }
    for what, (target, words) in refusals.items():
        reply = move_in(machine, turn, mine, target)
        assert reply["reply"] == "refused", (what, reply)
        assert str(reply["error"]).startswith("pids[1]: "), (what, reply)
        assert words in str(reply["error"]), (what, reply)
        # Nothing moved: not even the mind's own process that came first.
        assert systemd_cgroup(machine, mine) == "/system.slice/runner-a.service", what
        assert machine.run(["ls", "-A", RECORDS], check=False).stdout.split() == [], what
    # A scope the launcher did not start for that mind.
    reply = move_in(machine, turn, mine, mind="o")
    assert reply["reply"] == "refused" and str(reply["error"]).startswith("turn_id: "), reply
    # More pids than a lease may have: refused, the connection closed, every descriptor
    # with it.
    reply = move_in(machine, turn, *([mine] * 65))
    assert reply["reply"] == "refused" and "at most 64" in str(reply["error"]), reply
    # Fewer descriptors than announced.
    body = {"order": "move_in", "turn_id": turn, "mind": "m", "pids": 2}
    reply = order(machine, body, mine)
    assert reply["reply"] == "refused" and "announced" in str(reply["error"]), reply
    assert systemd_cgroup(machine, mine) == "/system.slice/runner-a.service"
    assert systemd_cgroup(machine, roots) == "/system.slice/roots-own.service"
    # The launcher is the same process, holding no descriptor of those orders, and still
    # moves the mind's own.
    assert launcher_pid(machine) == pid
    assert unit_property(machine, "volute-launcher.service", "NRestarts") == "0"
    assert "internal error" not in journal(machine, "volute-launcher.service")
    opened = int(machine.sh(f"ls /proc/{pid}/fd | wc -l").stdout)
    assert opened < 32, opened
    assert move_in(machine, turn, mine)["moved"] == [mine]


# -- through the gate: an acquire with pids (phase 2) ------------------------------------

# A lease holder, as the user it runs as: connects to the gate, acquires a lease of
# argv[1] with a pidfd of each pid in argv[2:] (SCM_RIGHTS with the line), then prints
# each line the gate sends, and does what stdin says: "release" releases the lease.
HOLDER = """
import array, json, os, select, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("/run/volute/gate.sock")
fds = [os.pidfd_open(int(pid)) for pid in sys.argv[2:]]
line = json.dumps({"v": 1, "op": "acquire", "mind": sys.argv[1], "pids": len(fds)})
rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
s.sendmsg([line.encode() + b"\\n"], rights)
for fd in fds:
    os.close(fd)
buffer, token, lease = b"", None, None
while True:
    ready, _, _ = select.select([s, sys.stdin], [], [])
    if s in ready:
        chunk = s.recv(65536)  # raw: a reply and its grant may come in one read
        if not chunk:
            break
        buffer += chunk
        while b"\\n" in buffer:
            got, buffer = buffer.split(b"\\n", 1)
            reply = json.loads(got)
            token, lease = reply.get("token", token), reply.get("lease", lease)
            print(got.decode().strip(), flush=True)
    if sys.stdin in ready:
        if sys.stdin.readline().strip() == "release":
            request = {"v": 1, "op": "release", "lease": lease, "token": token}
            s.sendall(json.dumps(request).encode() + b"\\n")
"""


class Holder:
    """A lease holder run in the machine as `user`: what the gate sent it, line by line."""

    def __init__(self, machine: Machine, mind: str, *pids: int, user: str = MIND_USER) -> None:
        argv = [PYTHON, "/var/tmp/holder.py", mind, *map(str, pids)]
        self.proc = machine.popen(
            ["runuser", "-u", user, "--", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        self.lines = PipeLines(self.proc.stdout.fileno())
        self.seen: list[dict[str, object]] = []  # every line the gate sent, for a failure

    def next(self, timeout: float = 30.0) -> dict[str, object]:
        ready = self.lines.ready(timeout)
        assert ready, f"the gate sent nothing more in {timeout:.0f} s; it had sent {self.seen}"
        line = self.lines.take()
        assert line is not None, f"the holder's connection ended; the gate had sent {self.seen}"
        reply: dict[str, object] = json.loads(line)
        self.seen.append(reply)
        return reply

    def until(self, key: str, value: object) -> dict[str, object]:
        """The next line whose `key` is `value`. Another event on the way (a lease ended
        before its grant) fails at once, with what was sent, instead of waiting on."""
        while (reply := self.next()).get(key) != value:
            unexpected = f"{reply.get('event')} while waiting for {key}={value}"
            assert "event" not in reply, f"{unexpected}; the gate had sent {self.seen}"
        return reply

    def say(self, what: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()


def lease_setup(machine: Machine, limits: str = "") -> None:
    machine.run(["useradd", "-r", "-M", "-d", "/nonexistent", "-s", "/bin/sh", MIND_USER])
    start_gate(machine, limits + CONFIG)
    machine.run(["usermod", "-a", "-G", "volute", MIND_USER])  # the group the gate made
    machine.write("/var/tmp/holder.py", HOLDER)


def test_a_leases_pids_move_into_its_scope_and_back_alive_after_release(
    machine: Machine,
) -> None:
    lease_setup(machine)
    pid = runner(machine, "runner-a")
    holder = Holder(machine, "m", pid)
    granted = holder.until("event", "lease_granted")
    assert granted["created"] is True and granted["pids_moved"] == 1, granted
    scope = str(granted["unit"])
    assert systemd_cgroup(machine, pid).endswith(f"/volute-turns.slice/{scope}")
    holder.say("release")
    assert holder.until("released", True)["lease"] == granted["lease"]
    assert systemd_cgroup(machine, pid) == "/system.slice/runner-a.service"
    assert alive(machine, pid)
    wait_for(lambda: scope not in live_turn_scopes(machine))
    assert alive(machine, pid)


def test_a_holder_killed_while_holding_returns_its_pids_and_the_next_waiter_gets_the_place(
    machine: Machine,
) -> None:
    lease_setup(machine, "[limits]\nglobal_concurrent_turns = 1\n")
    pid = runner(machine, "runner-a")
    first = Holder(machine, "m", pid)
    granted = first.until("event", "lease_granted")
    assert granted["pids_moved"] == 1
    second = Holder(machine, "o")
    assert second.next()["state"] == "waiting"
    first.proc.kill()  # SIGKILL of runuser: the holder's connection closes with it
    machine.run(["pkill", "-KILL", "-f", "holder.py m"], check=False)
    next_grant = second.until("event", "lease_granted")
    assert next_grant["created"] is True
    assert systemd_cgroup(machine, pid) == "/system.slice/runner-a.service"
    assert alive(machine, pid)


def test_a_lease_whose_pids_all_exit_ends_and_foreign_pids_are_refused(
    machine: Machine,
) -> None:
    lease_setup(machine)
    machine.run(["useradd", "-r", "-M", "-G", "volute", "-s", "/bin/sh", "member"])
    mine = runner(machine, "runner-a")
    roots = runner(machine, "roots-own", user="root")
    # Another member may not move the mind's processes; the mind's user may not move
    # root's: each refused at once, naming the field.
    other = Holder(machine, "m", mine, user="member")
    refused = other.next()
    assert (refused["ok"], refused["code"]) == (False, 77) and "pids" in str(refused["error"])
    foreign = Holder(machine, "m", mine, roots)
    refused = foreign.next()
    assert (refused["ok"], refused["code"]) == (False, 65), refused
    assert str(refused["error"]).startswith("pids[1]: "), refused
    assert systemd_cgroup(machine, roots) == "/system.slice/roots-own.service"
    holder = Holder(machine, "m", mine)
    assert holder.until("event", "lease_granted")["pids_moved"] == 1
    machine.run(["kill", "-KILL", str(mine)])
    ended = holder.until("event", "lease_ended")
    assert ended["reason"] == "pids_exited", ended


def test_a_gate_killed_after_the_move_and_a_lease_never_claimed_returns_its_pids(
    machine: Machine,
) -> None:
    lease_setup(machine, "[gate]\nlease_reclaim_seconds = 2\n")
    fast_restarts(machine, VOLUTE_CRASH_AT="lease_pids_moved", VOLUTE_CRASH_ONCE=CRASHED)
    machine.run(["systemctl", "restart", "volute-gate.service"])
    pid = runner(machine, "runner-a")
    holder = Holder(machine, "m", pid)
    assert holder.next()["state"] == "waiting"
    # The gate is SIGKILLed with the process in the lease's scope, before its holder
    # hears of the grant; the holder is gone too, and never claims it.
    wait_for(lambda: machine.run(["test", "-e", CRASHED], check=False).returncode == 0)
    holder.proc.kill()
    machine.run(["pkill", "-KILL", "-f", "holder.py m"], check=False)
    # The restarted gate waits for the claim, then ends the lease: the process goes
    # back to its own unit, alive, and the lease's scope is stopped.
    wait_for(lambda: systemd_cgroup(machine, pid) == "/system.slice/runner-a.service", 60)
    assert alive(machine, pid)
    wait_for(lambda: not live_turn_scopes(machine), 30)
    assert alive(machine, pid)
    # It had moved in before the kill, and came back after: the launcher says so.
    for kind in ("pid_moved_in", "pid_moved_back"):
        entries = gate_events(machine, f"VOLUTE_EVENT={kind}", unit="volute-launcher.service")
        assert [entry["VOLUTE_PID"] for entry in entries] == [str(pid)], kind


def test_at_its_time_limit_a_lease_returns_its_pids_alive_then_ends_timeout(
    machine: Machine,
) -> None:
    """No RuntimeMaxSec= on a lease's scope (systemd would kill the daemon's processes):
    at max_runtime_seconds the gate moves them back, stops the scope, tells the holder."""
    lease_setup(machine, "[turns]\nmax_runtime_seconds = 3\n")
    pid = runner(machine, "runner-a")
    holder = Holder(machine, "m", pid)
    granted = holder.until("event", "lease_granted")
    assert granted["pids_moved"] == 1
    assert unit_property(machine, str(granted["unit"]), "RuntimeMaxUSec") == "infinity"
    ended = holder.until("event", "lease_ended")
    assert ended["reason"] == "timeout", ended
    assert systemd_cgroup(machine, pid) == "/system.slice/runner-a.service"
    assert alive(machine, pid)
