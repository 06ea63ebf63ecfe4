"""`volutectl deliver --batch` against the real volute-gate.service behind its socket
(issue 31, item 6): a fan-out to 33 minds in one request, waited for; a bad line that
queues nothing; and a SIGKILL of the gate right after the batch's commit, before its
answer, with the client sending the batch again: nothing queued twice, nothing lost.
"""

from __future__ import annotations

import collections
import json

import pytest

from volute_testbed.faults import CRASHED
from volute_testbed.gate import (
    VOLUTECTL,
    all_settled,
    delivered_ids,
    delivery_states,
    gate_config,
    install_probe,
    journal,
    start_gate,
    turn_log,
    unit_property,
    wait_for,
)
from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

GATE = "volute-gate.service"
MINDS = [f"m{n:02}" for n in range(1, 34)]  # 33 minds


def fan_out(minds: list[str], text: str = "news") -> str:
    return "".join(json.dumps({"mind": m, "message": f"{text} for {m}"}) + "\n" for m in minds)


def ran_once_each(machine: Machine, ids: list[int], minds: list[str]) -> None:
    """Each delivery is done, ran in exactly one turn, and that turn was its line's mind's."""
    log = turn_log(machine)
    assert collections.Counter(delivered_ids(log)) == collections.Counter(ids), log
    mind_of = {int(i): f[1] for f in log if f[0] == "start" for i in f[5:]}
    assert [mind_of[i] for i in ids] == minds
    assert delivery_states(machine) == dict.fromkeys(ids, "done")


def test_a_fan_out_to_33_minds_is_one_batch_and_wait_exits_as_its_first_failure(
    machine: Machine,
) -> None:
    install_probe(machine)
    minds = {m: "turn-probe 0.1" for m in MINDS} | {"bad": "TURN_EXIT=3 turn-probe 0"}
    start_gate(machine, gate_config(minds, gate={"max_attempts": 1}))
    done = machine.run([VOLUTECTL, "deliver", "--batch", "--wait"], input=fan_out(MINDS))
    ids = [int(line) for line in done.stdout.splitlines()]
    assert len(set(ids)) == 33 and done.stderr == ""
    ran_once_each(machine, ids, MINDS)
    # With a failing mind among them, --wait exits with the first failure's code (3).
    failing = machine.run(
        [VOLUTECTL, "deliver", "--batch", "--wait"],
        input=fan_out(["m01", "bad", "m02"], "again"),
        check=False,
    )
    assert failing.returncode == 3, failing.stderr
    three = [int(line) for line in failing.stdout.splitlines()]
    assert len(three) == 3 and f"delivery {three[1]} is dead" in failing.stderr
    states = delivery_states(machine)
    assert [states[i] for i in three] == ["done", "dead", "done"]


def test_a_bad_line_queues_nothing_nor_does_a_line_the_gate_refuses(
    machine: Machine,
) -> None:
    install_probe(machine)
    start_gate(machine, gate_config({m: "turn-probe 0.1" for m in MINDS}))
    lines = fan_out(MINDS).splitlines()
    lines[16] = '{"mind": "m17", "message": "hi", "sesion": "typo"}'
    bad = machine.run([VOLUTECTL, "deliver", "--batch"], input="\n".join(lines) + "\n", check=False)
    assert bad.returncode == 65, bad.stderr
    assert bad.stdout == ""
    assert bad.stderr.startswith("volutectl: line 17: 'sesion': not a field of a delivery")
    assert delivery_states(machine) == {}  # the queue, read afterwards: nothing
    # A mind the gate does not know is the gate's refusal, of the whole batch: 67, an
    # empty line for each line, and nothing queued.
    lines[16] = json.dumps({"mind": "nosuch", "message": "hi"})
    none = machine.run(
        [VOLUTECTL, "deliver", "--batch", "--wait"], input="\n".join(lines) + "\n", check=False
    )
    assert none.returncode == 67, none.stderr
    assert none.stdout == "\n" * 33
    assert "line 17 (nosuch/main): not queued: unknown mind 'nosuch'" in none.stderr
    assert "33 of 33 deliveries not queued (first: line 1, exit 67); none was queued" in (
        none.stderr
    )
    assert delivery_states(machine) == {}


def test_a_sigkill_of_the_gate_after_the_batchs_commit_queues_nothing_twice(
    machine: Machine,
) -> None:
    """The gate commits the 33 rows and dies (its cgroup SIGKILLed) before it answers;
    the client sends the same request, with the same request ids, to the next gate: it
    gets the 33 ids of the first commit, and each runs once."""
    install_probe(machine)
    machine.write(
        "/etc/systemd/system/volute-gate.service.d/crash.conf",
        "[Service]\n"
        "Environment=VOLUTE_CRASH_AT=request_committed\n"
        f"Environment=VOLUTE_CRASH_ONCE={CRASHED}\n",
    )
    start_gate(machine, gate_config({m: "turn-probe 0.1" for m in MINDS}))
    first_gate = unit_property(machine, GATE, "MainPID")
    done = machine.run(
        [VOLUTECTL, "deliver", "--batch", "--wait"], input=fan_out(MINDS), timeout=120
    )
    assert machine.host_path(CRASHED).exists()  # it died after the commit, before the answer
    assert unit_property(machine, GATE, "MainPID") != first_gate
    assert "status=9/KILL" in journal(machine)
    ids = [int(line) for line in done.stdout.splitlines()]
    assert len(set(ids)) == 33, done.stdout
    wait_for(lambda: all_settled(machine), timeout=30)
    ran_once_each(machine, ids, MINDS)  # 33 rows in all: the retry stored none
