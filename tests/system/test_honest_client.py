"""What a client is told, against the real volute-gate.service behind its socket: a
script's own retry loop on 75 with `deliver --request-id` across a gate killed between
storing and acknowledging, `deliver --wait` on a failing mind saying each attempt,
`--max-wait`, and `logs` as a member of group volute (issue 22).
"""

from __future__ import annotations

import json
import re

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
    wait_for,
)
from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

MEMBER = "op"

# The README's loop: send again on 75 with the same request id, stop on anything else.
RETRY_LOOP = """
codes=""
for try in $(seq 1 30); do
    "$2" deliver m --request-id "$1" --timeout 1 -m "nightly report" \
        >>/tmp/out 2>>/tmp/err && { codes="$codes 0"; break; }
    code=$?
    codes="$codes $code"
    [ "$code" -eq 75 ] || break
    sleep 1
done
echo $codes
"""


def test_a_scripts_retry_loop_with_a_request_id_queues_once_across_a_kill_before_the_ack(
    machine: Machine,
) -> None:
    """SIGKILL of the gate's cgroup after the commit, before the ack, and a restart slower
    than the client's --timeout: the client gets 75 ("may have been queued"); the script
    sends again with its request id, and gets the first delivery back."""
    install_probe(machine)
    machine.write(
        "/etc/systemd/system/volute-gate.service.d/crash.conf",
        "[Unit]\nStartLimitIntervalSec=0\n[Service]\nRestartSec=4s\n"
        "Environment=VOLUTE_CRASH_AT=request_committed\n"
        f"Environment=VOLUTE_CRASH_ONCE={CRASHED}\n",
    )
    start_gate(machine, gate_config({"m": "turn-probe 0.1"}))
    codes = machine.run(
        ["sh", "-c", RETRY_LOOP, "sh", "nightly-2026-12-01", VOLUTECTL], timeout=120
    )
    seen = codes.stdout.split()
    err = machine.run(["cat", "/tmp/err"]).stdout
    assert machine.host_path(CRASHED).exists()  # the gate died after the commit
    assert "75" in seen and seen[-1] == "0", (seen, err)
    ids = {int(line) for line in machine.run(["cat", "/tmp/out"]).stdout.split()}
    assert len(ids) == 1, ids
    [delivery] = ids
    assert "nightly-2026-12-01 was queued already" in err
    wait_for(lambda: all_settled(machine), timeout=30)
    assert delivery_states(machine) == {delivery: "done"}  # one row
    assert delivered_ids(turn_log(machine)) == [delivery]  # one turn
    # The same id with another message is the script's bug: 65, naming the id.
    other = machine.run(
        [VOLUTECTL, "deliver", "m", "--request-id", "nightly-2026-12-01", "-m", "other"],
        check=False,
    )
    assert other.returncode == 65 and "nightly-2026-12-01" in other.stderr


def test_deliver_wait_on_a_failing_mind_says_each_attempt_and_max_wait_gives_up(
    machine: Machine,
) -> None:
    gate = {"max_attempts": 3, "backoff_initial_seconds": 0.5, "backoff_max_seconds": 0.5}
    start_gate(machine, gate_config({"bad": "exit 3", "slow": "sleep 4"}, gate=gate))
    waited = machine.run([VOLUTECTL, "deliver", "bad", "-m", "x", "--wait"], check=False)
    assert waited.returncode == 3, waited.stderr
    delivery = int(waited.stdout)
    said = re.findall(r"delivery (\d+): attempt (\d) of 3 failed: turn \d+ exited 3", waited.stderr)
    assert said == [(str(delivery), "1"), (str(delivery), "2")], waited.stderr
    assert waited.stderr.count("next try at") == 2
    assert f"delivery {delivery} is dead" in waited.stderr
    # --max-wait: 75, the line to wait later, and the delivery goes on regardless.
    gave_up = machine.run(
        [VOLUTECTL, "deliver", "slow", "-m", "x", "--wait", "--max-wait", "1"], check=False
    )
    assert gave_up.returncode == 75, gave_up.stderr
    slow = int(gave_up.stdout)
    assert f"volutectl wait {slow}" in gave_up.stderr
    assert delivery_states(machine)[slow] == "running"
    # `volutectl wait --max-wait` gives up the same way, and leaves it running too.
    short = machine.run([VOLUTECTL, "wait", str(slow), "--max-wait", "0.5"], check=False)
    assert short.returncode == 75, short.stderr
    assert f"stopped waiting for {slow} after" in short.stderr, short.stderr
    assert f"volutectl wait {slow}" in short.stderr and "Traceback" not in short.stderr
    assert delivery_states(machine)[slow] == "running"
    later = machine.run([VOLUTECTL, "wait", str(slow)], check=False, timeout=30)
    assert later.returncode == 0, later.stderr
    assert json.loads(machine.run([VOLUTECTL, "status", "--json"]).stdout)["backing_off"] == 0


def test_logs_as_a_member_of_volute_is_77_naming_the_journals_group(machine: Machine) -> None:
    start_gate(machine, gate_config({"m": "true"}))
    machine.run(["useradd", "-M", "-G", "volute", MEMBER])
    result = machine.run(["runuser", "-u", MEMBER, "--", VOLUTECTL, "logs", "m"], check=False)
    assert result.returncode == 77, (result.returncode, result.stderr)
    assert "systemd-journal" in result.stderr
    assert f"usermod -aG systemd-journal {MEMBER}" in result.stderr
    assert "Traceback" not in result.stderr + journal(machine)
