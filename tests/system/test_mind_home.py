"""Issue 22, "a mind's home": a mind whose config names no working directory, run as a
user with no home (the package's volute-turn, /nonexistent), runs its turns in a home
of its own that the launcher makes, /var/lib/volute-minds/NAME: its user's, 0700, and
HOME. Never in `/`, where they ran before. And what stands in a home's place (a link, a
file) is refused with its reason, never followed.

Each test boots its own systemd with the real units (the launcher's StateDirectory=
makes /var/lib/volute-minds) and the package's users.
"""

from __future__ import annotations

import pytest

from volute_testbed.gate import (
    VOLUTECTL,
    deliver,
    gate_config,
    gate_events,
    queue_rows,
    start_gate,
    wait_for,
)
from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

HOMES = "/var/lib/volute-minds"
OUT = "/var/tmp/homes"
# Where the turn runs, its HOME, and the owner and mode of the directory it is in; then
# it writes a file there (a home the mind cannot write is no home).
WHERE = (
    'printf "%s\\n%s\\n%s\\n" "$(pwd)" "$HOME" "$(stat -c "%U %a" .)" > ' + OUT + "/$VOLUTE_MIND"
    " && echo kept > ./note"
)


def facts(machine: Machine, mind: str) -> list[str]:
    path = machine.host_path(f"{OUT}/{mind}")
    wait_for(lambda: path.exists() and path.read_text().count("\n") == 3, timeout=30)
    return path.read_text().splitlines()


def test_a_mind_with_no_working_directory_runs_in_a_home_of_its_own(machine: Machine) -> None:
    machine.run(["install", "-d", "-m", "1777", OUT])
    start_gate(machine, gate_config({"alpha": WHERE, "beta": WHERE}))
    check = machine.run([VOLUTECTL, "config", "check"], check=False)
    assert f"turns run in {HOMES}/alpha" in check.stdout, check.stdout + check.stderr
    for mind in ("alpha", "beta"):
        deliver(machine, mind, "where am I?")
    for mind in ("alpha", "beta"):
        home = f"{HOMES}/{mind}"
        assert facts(machine, mind) == [home, home, "volute-turn 700"]
        assert machine.run(["cat", f"{home}/note"]).stdout == "kept\n"
    assert machine.run(["stat", "-c", "%U %a", HOMES]).stdout.strip() == "root 755"
    # The next turn finds its home as it left it.
    machine.run(["rm", f"{OUT}/alpha"])
    deliver(machine, "alpha", "again")
    assert facts(machine, "alpha")[0] == f"{HOMES}/alpha"
    assert machine.run(["cat", f"{HOMES}/alpha/note"]).stdout == "kept\n"


def refused_start(machine: Machine, mind: str) -> str:
    wait_for(
        lambda: bool(
            gate_events(
                machine, "VOLUTE_EVENT=end", "VOLUTE_OUTCOME=start_failed", f"VOLUTE_MIND={mind}"
            )
        ),
        timeout=30,
    )
    [row] = [row for row in queue_rows(machine) if row["mind"] == mind]
    return str(row["last_error"])


def test_a_link_or_a_file_in_a_homes_place_is_refused_not_followed(machine: Machine) -> None:
    """Only root can put them there (the homes' directory is root's, 0755): an admin's
    mistake, or a restored backup. On a root that followed the link, /etc would be
    volute-turn's, 0700, and the turn would run in it."""
    machine.run(["install", "-d", "-m", "1777", OUT])
    machine.run(["install", "-d", "-m", "0755", HOMES])
    machine.run(["ln", "-s", "/etc", f"{HOMES}/linked"])
    machine.write(f"{HOMES}/filed", "not a directory\n")
    etc_before = machine.run(["stat", "-c", "%U:%G %a", "/etc"]).stdout
    start_gate(machine, gate_config({"linked": WHERE, "filed": WHERE, "fine": WHERE}))
    check = machine.run([VOLUTECTL, "config", "check"], check=False)
    assert check.returncode == 78, check.stdout + check.stderr
    assert f"its home {HOMES}/linked is a symbolic link" in check.stdout
    for mind in ("linked", "filed", "fine"):
        deliver(machine, mind, "where am I?")
    assert f"its home {HOMES}/linked is a symbolic link" in refused_start(machine, "linked")
    assert f"its home {HOMES}/filed is not a directory" in refused_start(machine, "filed")
    assert machine.run(["stat", "-c", "%U:%G %a", "/etc"]).stdout == etc_before
    assert not machine.host_path(f"{OUT}/linked").exists()
    assert not machine.host_path(f"{OUT}/filed").exists()
    # Another mind's home is made as ever.
    assert facts(machine, "fine")[0] == f"{HOMES}/fine"
