"""A turn ends with its turn, even through its user's manager (issue 29, finding 5).

systemd lets any user make itself linger (`org.freedesktop.login1.set-self-linger`
defaults to yes): a turn ran `loginctl enable-linger $(id -un)`, then `systemd-run
--user sleep 600`, and the sleep ran on in user.slice after the turn was settled,
outside every scope, limit and pause, and would again after each boot. The package's
polkit rule (packaging/polkit/40-volutectl.rules, installed here by
volute_testbed.gate.install_units as the .deb installs it) refuses lingering to
volute-turn and to every member of group volute-turns; `doctor` names each mind's own
user that is not in it, with the line that puts it there.
"""

from __future__ import annotations

import json

import pytest

from volute_testbed.gate import (
    VOLUTECTL,
    all_settled,
    deliver,
    gate_config,
    start_gate,
    wait_for,
)
from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

LOG = "/var/tmp/linger-escape.log"
# The attack as it was reproduced: make the turn's own user linger, then start a
# service in its user manager (which lingering starts: retried for up to 5 s).
ESCAPE = f"""#!/bin/sh
cat > /dev/null
user=$(id -un)
said=$(loginctl enable-linger "$user" 2>&1)
echo "linger $user $? $said" >> {LOG}
export XDG_RUNTIME_DIR=/run/user/$(id -u)
started=no
for _ in $(seq 50); do
    systemd-run --user --unit=escape sleep 600 > /dev/null 2>&1 && started=yes && break
    sleep 0.1
done
echo "escape $user $started" >> {LOG}
echo "end $user" >> {LOG}
"""
MIND_USER = "mindone"  # a mind's own user (minds.NAME.user), made as an admin makes one


def install_escape(machine: Machine) -> None:
    machine.write("/usr/local/bin/linger-escape", ESCAPE, mode=0o755)
    machine.sh(f": > {LOG}; chmod 666 {LOG}")


def run_turn(machine: Machine, mind: str) -> str:
    """Deliver to `mind`, wait until its turn is settled, and return its linger line:
    `linger USER STATUS WHAT-LOGINCTL-SAID`."""
    deliver(machine, mind, "linger, please")
    wait_for(lambda: "end " in machine.sh(f"cat {LOG}").stdout, timeout=60)
    wait_for(lambda: all_settled(machine), timeout=60)
    lines = machine.sh(f"cat {LOG}").stdout.splitlines()
    [line] = [line for line in lines if line.startswith("linger ")]
    return line


def check_no_escape(machine: Machine, user: str, line: str) -> None:
    """The turn's `loginctl enable-linger` was refused, logind holds no linger for its
    user, and nothing of that user runs once the turn is settled."""
    log = machine.sh(f"cat {LOG}").stdout
    print(log)
    status = int(line.split()[2])
    assert status != 0 and "Access denied" in line, line
    assert f"escape {user} no" in log.splitlines(), log  # no user manager to start it in
    assert not machine.host_path(f"/var/lib/systemd/linger/{user}").exists()
    shown = machine.run(["loginctl", "show-user", user, "-p", "Linger"], check=False)
    assert shown.returncode != 0 or shown.stdout.strip() == "Linger=no", shown.stdout
    uid = machine.run(["id", "-u", user]).stdout.strip()
    manager = machine.run(["systemctl", "is-active", f"user@{uid}.service"], check=False)
    assert manager.stdout.strip() != "active"
    left = machine.run(["pgrep", "-a", "-u", user], check=False).stdout
    assert left == "", left


def linger_rule_check(machine: Machine) -> dict[str, str]:
    report = json.loads(machine.run([VOLUTECTL, "doctor", "--json"], check=False).stdout)
    [check] = [c for c in report["checks"] if c["check"] == "linger-rule"]
    return {key: str(value) for key, value in check.items()}


def test_a_turn_of_the_default_user_may_not_make_it_linger(machine: Machine) -> None:
    install_escape(machine)
    start_gate(machine, gate_config({"m": "/usr/local/bin/linger-escape"}))
    check_no_escape(machine, "volute-turn", run_turn(machine, "m"))
    assert linger_rule_check(machine)["status"] == "ok"


def test_doctor_names_a_minds_own_user_the_rule_misses_and_its_line_covers_it(
    machine: Machine,
) -> None:
    """A mind's own user is the admin's: no static rule can know it. Outside group
    volute-turns, doctor says so with the line; once run, the rule refuses it too."""
    machine.run(["useradd", "-m", MIND_USER])
    install_escape(machine)
    config = gate_config({"own": "/usr/local/bin/linger-escape"}) + f'user = "{MIND_USER}"\n'
    start_gate(machine, config)
    check = linger_rule_check(machine)
    assert check["status"] == "warn" and MIND_USER in check["found"], check
    assert check["change"] == f"as root: usermod -a -G volute-turns {MIND_USER}", check
    machine.run(["sh", "-c", check["change"].removeprefix("as root: ")])
    assert linger_rule_check(machine)["status"] == "ok"
    check_no_escape(machine, MIND_USER, run_turn(machine, "own"))
