"""`volutectl lease` against the real gate and launcher, in a booted systemd (issue 31,
item 5): CMD runs in the lease's scope (read from its own /proc/self/cgroup), exits with
its status and releases; another user's CMD is refused (77) and never runs; a lease
that ends under CMD stops it (75); an admin's `--end`; without CMD, the id and unit
until stdin closes; a gate restart under CMD is claimed back."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from volute_testbed.gate import VOLUTECTL, gate_config, live_turn_scopes, start_gate, wait_for
from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

SCOPE = re.compile(r"volute-turn-pip-[0-9]+\.scope")


def setup(machine: Machine, **mind: object) -> None:
    """Mind pip, run as user pip (in group volute, to use the socket itself); agent, a
    member; boss, an admin."""
    machine.run(["groupadd", "-f", "-r", "volute"])
    machine.run(["groupadd", "-f", "-r", "volute-admin"])
    machine.run(["useradd", "-M", "-G", "volute", "pip"])
    machine.run(["useradd", "-M", "-G", "volute", "agent"])
    machine.run(["useradd", "-M", "-G", "volute,volute-admin", "boss"])
    config = gate_config({}, limits={"global_concurrent_turns": 2})
    extra = "".join(f"{key} = {value!r}\n".replace("'", '"') for key, value in mind.items())
    start_gate(machine, config + f'[minds.pip]\ncommand = "true"\nuser = "pip"\n{extra}')


def in_a_scope(user: str, *args: str) -> list[str]:
    """`volutectl lease ARGS` as `user`, in a scope of its own, as a login shell's
    commands run in its session's scope: the launcher moves only processes that are in
    a systemd unit (where they go back to), and nsenter's are in none."""
    drop = ["setpriv", "--reuid", user, "--regid", user, "--init-groups", "--"]
    return ["systemd-run", "--scope", "--quiet", "--", *drop, VOLUTECTL, "lease", *args]


def lease(
    machine: Machine, *args: str, user: str = "pip", stdin: str = "", timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return machine.run(in_a_scope(user, *args), check=False, input=stdin, timeout=timeout)


def popen(machine: Machine, *args: str, user: str = "pip") -> subprocess.Popen[str]:
    return subprocess.Popen(
        machine.command(in_a_scope(user, *args)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_command_runs_in_the_leases_scope_and_its_status_is_the_exit(
    machine: Machine,
) -> None:
    setup(machine)
    done = lease(
        machine, "pip", "--", "sh", "-c", 'cat /proc/self/cgroup; echo "$VOLUTE_LEASE_UNIT"; exit 3'
    )
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    unit = lines[-1]
    assert SCOPE.fullmatch(unit), done.stdout
    assert any(line.endswith(f"/{unit}") and ("name=systemd" in line or line.startswith("0::"))
               for line in lines), done.stdout  # fmt: skip
    wait_for(lambda: unit not in live_turn_scopes(machine))  # released: the scope stopped


def test_with_pid_the_resident_moves_in_for_the_command_and_back_alive(machine: Machine) -> None:
    setup(machine)
    machine.run(["systemd-run", "--unit=resident", "--uid=pip", "sleep", "1000"])
    pid = machine.run(["systemctl", "show", "-P", "MainPID", "resident.service"]).stdout.strip()
    origin = systemd_cgroup(machine, pid)
    assert origin.endswith("/resident.service")
    done = lease(machine, "pip", "--pid", pid, "--", "cat", f"/proc/{pid}/cgroup")
    assert done.returncode == 0, done.stderr
    inside = [line for line in done.stdout.splitlines() if SCOPE.search(line)]
    assert inside, done.stdout  # the resident was in the lease's scope while CMD ran
    # Back, alive, before the release's answer (volutectl exits after it).
    assert systemd_cgroup(machine, pid) == origin
    wait_for(lambda: live_turn_scopes(machine) == [])


def systemd_cgroup(machine: Machine, pid: str) -> str:
    """The systemd line of /proc/PID/cgroup: the unit systemd counts the process in."""
    text = machine.run(["cat", f"/proc/{pid}/cgroup"]).stdout
    lines = [line for line in text.splitlines() if ":name=systemd:" in line]
    lines = lines or [line for line in text.splitlines() if line.startswith("0::")]
    return lines[0].rsplit(":", 1)[1]


def test_a_command_of_another_user_is_refused_77_and_never_runs(machine: Machine) -> None:
    setup(machine)
    done = lease(machine, "pip", "--", "touch", "/var/tmp/ran", user="agent")
    assert done.returncode == 77, done.stderr
    assert "did not run" in done.stderr
    assert not machine.host_path("/var/tmp/ran").exists()
    assert live_turn_scopes(machine) == []


def test_without_a_command_it_holds_until_stdin_closes(machine: Machine) -> None:
    setup(machine)
    holder = popen(machine, "pip", "--session", "chat", user="agent")
    assert holder.stdout is not None and holder.stdin is not None
    lease_id, unit = holder.stdout.readline().split()
    assert SCOPE.fullmatch(unit)
    assert unit in live_turn_scopes(machine)
    time.sleep(1)
    assert holder.poll() is None and unit in live_turn_scopes(machine)
    holder.stdin.close()
    assert holder.wait(timeout=30) == 0, holder.stderr.read() if holder.stderr else ""
    wait_for(lambda: unit not in live_turn_scopes(machine))


def test_a_waiting_lease_says_why_then_is_granted_when_the_place_frees(
    machine: Machine,
) -> None:
    setup(machine)
    first = popen(machine, "pip", user="agent")
    assert first.stdout is not None and first.stdin is not None
    first.stdout.readline()
    second = popen(machine, "pip", "--session", "other", user="agent")
    assert second.stdout is not None and second.stderr is not None and second.stdin is not None
    # Its wait is said on stderr while it waits: one mind, one turn at a time.
    assert "waits for its place: mind_busy" in second.stderr.readline()
    assert second.poll() is None
    first.stdin.close()
    assert first.wait(timeout=30) == 0
    lease_id, unit = second.stdout.readline().split()
    assert SCOPE.fullmatch(unit)
    second.stdin.close()
    assert second.wait(timeout=30) == 0


def test_a_lease_that_ends_under_the_command_stops_it_75(machine: Machine) -> None:
    setup(machine, max_runtime_seconds=2)
    started = time.monotonic()
    done = lease(machine, "pip", "--", "sh", "-c", "echo $$ > /var/tmp/pid; exec sleep 120")
    assert done.returncode == 75, done.stderr
    assert "timeout" in done.stderr and "stopping the command" in done.stderr
    assert time.monotonic() - started < 60
    pid = machine.host_path("/var/tmp/pid").read_text().strip()
    assert machine.run(["test", "-e", f"/proc/{pid}"], check=False).returncode != 0


def test_an_admin_ends_a_lease_and_a_member_may_not(machine: Machine) -> None:
    setup(machine)
    holder = popen(machine, "pip", user="agent")
    assert holder.stdout is not None
    lease_id, _ = holder.stdout.readline().split()
    refused = lease(machine, "--end", lease_id, user="agent")
    assert refused.returncode == 77 and "volute-admin" in refused.stderr
    assert holder.poll() is None
    ended = lease(machine, "--end", lease_id, user="boss")
    assert (ended.returncode, ended.stdout) == (0, f"ended lease {lease_id}\n"), ended.stderr
    assert holder.wait(timeout=30) == 75
    assert holder.stderr is not None and "ended_by_admin" in holder.stderr.read()


def test_a_gate_restart_under_the_command_is_claimed_back(machine: Machine) -> None:
    setup(machine)
    holder = popen(machine, "pip", "--", "sh", "-c", "touch /var/tmp/go; sleep 4; exit 5")
    wait_for(lambda: machine.host_path("/var/tmp/go").exists())
    machine.run(["systemctl", "restart", "volute-gate.service"], timeout=60)
    out, err = holder.communicate(timeout=60)
    assert holder.returncode == 5, err
    assert "claimed lease" in err
    wait_for(lambda: live_turn_scopes(machine) == [])
