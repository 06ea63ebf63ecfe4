"""Who may interrupt (issue 29, finding 2), in a real systemd with the real units, as
real users.

Alice's `deliver --wait` runs in a turn of m/chat. Bob, another member of `volute`,
sends `deliver m --session chat --interrupt`: it folds in as a plain delivery, his
client says so on stderr, Alice's turn gets no SIGINT and runs its course, and Alice's
wait ends with that turn's exit status 0. Root (an admin) then interrupts a turn of
Alice's: that does cut it short, but Alice's delivery is not marked done by it: it
counts a failed attempt, her wait goes on, and a later turn carries it.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from volute_testbed.gate import VOLUTECTL, gate_config, gate_events, journal, start_gate, wait_for
from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

LOG = "/var/tmp/interrupts.log"
RELEASE = "/var/tmp/release"  # the turns run until it exists (60 s at most)
# A turn of m: logs its start, then waits for the release; a SIGINT ends it with 130.
TURN = rf"""#!/bin/sh
ids=$(sed -n 's/.*"id": *\([0-9][0-9]*\).*/\1/p' | tr '\n' ' ')
echo "start $VOLUTE_TURN_ID $ids" >> {LOG}
trap 'echo "sigint $VOLUTE_TURN_ID" >> {LOG}; exit 130' INT
i=0
while [ ! -e {RELEASE} ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
for f in "$VOLUTE_INBOX"/*.json; do [ -e "$f" ] && rm -f "$f"; done
echo "end $VOLUTE_TURN_ID 0" >> {LOG}
"""
ALICE, BOB = "alice", "bob"


def lines(machine: Machine) -> list[list[str]]:
    text = machine.host_path(LOG).read_text()
    return [line.split() for line in text.splitlines() if line.strip()]


def starts(machine: Machine) -> list[list[int]]:
    return [[int(i) for i in f[2:]] for f in lines(machine) if f[0] == "start"]


def rows(machine: Machine) -> dict[int, dict[str, object]]:
    """Every delivery as `queue list --json` shows it to root."""
    args = [VOLUTECTL, "queue", "list", "--json", "--limit", "1000"]
    for state in ("pending", "running", "done", "dead"):
        args += ["--state", state]
    return {row["id"]: row for row in json.loads(machine.run(args).stdout)}


def wait_as(machine: Machine, user: str, message: str) -> subprocess.Popen[str]:
    """`deliver m --session chat --wait` as `user`, left running."""
    argv = ["runuser", "-u", user, "--", VOLUTECTL, "deliver", "m", "-s", "chat"]
    return machine.popen(
        [*argv, "-m", message, "--wait"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def deliver_as(machine: Machine, user: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = ["runuser", "-u", user, "--", VOLUTECTL, "deliver", "m", "-s", "chat", *args]
    return machine.run(argv, timeout=90)


def sigint(machine: Machine) -> bool:
    """A turn logged a SIGINT."""
    return any(f[0] == "sigint" for f in lines(machine))


def setup(machine: Machine) -> None:
    """The gate, with mind m's turns of TURN, and two members: Alice and Bob."""
    machine.write("/usr/local/bin/interrupt-turn", TURN, mode=0o755)
    machine.run(["sh", "-c", f": > {LOG}; chmod 666 {LOG}; rm -f {RELEASE}"])
    config = gate_config({"m": "interrupt-turn"}, gate={"backoff_initial_seconds": 0.5})
    start_gate(machine, config)  # makes the groups, as the package's sysusers does
    for user in (ALICE, BOB):
        machine.run(["useradd", "-M", "-G", "volute", user])


def test_a_members_interrupt_does_not_cut_another_members_turn_short(machine: Machine) -> None:
    """Bob interrupts Alice's turn: refused, folded in as a plain delivery."""
    setup(machine)
    alice_waits = wait_as(machine, ALICE, "hers")
    wait_for(lambda: len(starts(machine)) == 1, timeout=60)
    [[hers]] = starts(machine)
    bobs = deliver_as(machine, BOB, "-m", "stop that", "--interrupt")
    bob = int(bobs.stdout.split()[0])
    wait_for(lambda: rows(machine)[bob]["state"] != "pending", timeout=30)
    # Folded: the gate has decided (a SIGINT would have been sent in that same pass).
    # Whichever comes first: the journal's refusal, or the turn's word of a SIGINT.
    wait_for(lambda: sigint(machine) or gate_events(machine, "VOLUTE_EVENT=interrupt_refused"))
    assert not sigint(machine), lines(machine)
    assert rows(machine)[hers]["state"] == "running"  # her turn goes on
    assert alice_waits.poll() is None
    assert "interrupt refused" in bobs.stderr, bobs.stderr
    [entry] = gate_events(machine, "VOLUTE_EVENT=interrupt_refused")
    assert entry["VOLUTE_DELIVERY_ID"] == str(bob)
    assert entry["MESSAGE_ID"] == "6a72d6ba8e124c758585b89bb4872da1"
    machine.run(["touch", RELEASE])
    out, err = alice_waits.communicate(timeout=60)
    assert alice_waits.returncode == 0, (out, err, journal(machine))
    done = rows(machine)
    assert (done[hers]["state"], done[hers]["attempts"]) == ("done", 0)
    assert (done[bob]["state"], done[bob]["attempts"]) == ("done", 0)
    assert not sigint(machine)


def test_an_admins_interrupt_cuts_a_members_turn_short_but_marks_her_delivery_not_done(
    machine: Machine,
) -> None:
    """Root, an admin, interrupts Alice's turn: cut short, but her delivery is not marked
    done by it: one failed attempt, her wait goes on, a later turn carries it."""
    setup(machine)
    alice_waits = wait_as(machine, ALICE, "hers")
    wait_for(lambda: len(starts(machine)) == 1, timeout=60)
    [[hers]] = starts(machine)
    roots = machine.run([VOLUTECTL, "deliver", "m", "-s", "chat", "-m", "stop", "--interrupt"])
    root = int(roots.stdout.split()[0])
    assert "interrupt refused" not in roots.stderr
    wait_for(lambda: sigint(machine), timeout=30)
    # Settled by that turn: done (as it was), or one failed attempt (tried again later,
    # in a turn that waits for the release, so never done meanwhile).
    wait_for(lambda: rows(machine)[hers]["state"] == "done" or rows(machine)[hers]["attempts"])
    assert rows(machine)[hers]["state"] != "done"
    assert rows(machine)[hers]["attempts"] == 1
    assert alice_waits.poll() is None  # not told of an end: tried again
    machine.run(["touch", RELEASE])
    out, err = alice_waits.communicate(timeout=90)
    assert alice_waits.returncode == 0, (out, err, journal(machine))
    assert "another user's interrupt" in err, err  # the failed attempt, said on stderr
    settled = rows(machine)
    assert (settled[hers]["state"], settled[hers]["attempts"]) == ("done", 1)
    assert settled[root]["state"] == "done"
    # The admin's delivery, not taken before the SIGINT, went with hers to that turn.
    assert starts(machine)[1] == [hers, root]
