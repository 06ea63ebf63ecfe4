"""No refusals across a restart: the real volute-gate.service behind volute-gate.socket.

systemd holds the listening socket, so a connection made while the gate is stopped or
restarting waits in its backlog (and starts the gate if it is down); a connection the
old gate accepted but never acknowledged ends in EOF, and `deliver` sends the same
request again, with the same request id, which the store keeps unique. Each test boots
its own systemd and runs the units from this checkout; turns run the turn-probe, whose
log records the delivery ids every turn received.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from volute_testbed.faults import CRASHED
from volute_testbed.gate import (
    VOLUTECTL,
    all_settled,
    deliver,
    delivered_ids,
    delivery_states,
    gate_config,
    gate_events,
    gate_serves_systemds_socket,
    install_probe,
    journal,
    start_gate,
    turn_log,
    unit_property,
    wait_for,
)
from volute_testbed.machine import Machine
from volute_testbed.paths import PYTHON

pytestmark = pytest.mark.system

GATE = "volute-gate.service"
SOCKET = "volute-gate.socket"
RESTARTS = 15


def is_active(machine: Machine, unit: str) -> str:
    return machine.run(["systemctl", "is-active", unit], check=False).stdout.strip()


def test_a_delivery_while_the_service_is_stopped_is_acknowledged_and_runs(
    machine: Machine,
) -> None:
    install_probe(machine)
    start_gate(machine, gate_config({"m": "turn-probe 0.1"}))
    machine.run(["systemctl", "stop", GATE])
    assert is_active(machine, GATE) == "inactive"
    assert is_active(machine, SOCKET) == "active"  # still listening, held by systemd
    delivery = deliver(machine, "m", "while the gate was stopped")
    assert delivery > 0
    assert is_active(machine, GATE) == "active"  # the connection started it
    assert gate_serves_systemds_socket(machine)
    wait_for(lambda: all_settled(machine), timeout=30)
    assert delivered_ids(turn_log(machine)) == [delivery]
    assert delivery_states(machine) == {delivery: "done"}


CLIENT = """
# client N: deliver to mind cN in a loop until told to stop; one line per deliver:
# "<exit code> <delivery id or -> <milliseconds>"
n=$1
i=0
while [ ! -e /var/tmp/clients.stop ]; do
  i=$((i + 1))
  start=$(date +%s%3N)
  if id=$({volutectl} deliver c$n --session s$n --message "c$n-$i" 2>>/var/tmp/client$n.err); then
    code=0
  else
    code=$?; id=-
  fi
  echo "$code $id $(( $(date +%s%3N) - start ))" >> /var/tmp/client$n.log
done
"""


@pytest.mark.serial
def test_restarts_while_three_clients_deliver_refuse_nothing_and_run_each_delivery_once(
    machine: Machine,
) -> None:
    install_probe(machine)
    start_gate(machine, gate_config({f"c{n}": "turn-probe 0.05" for n in range(3)}))
    machine.write("/usr/local/bin/deliver-loop", CLIENT.format(volutectl=VOLUTECTL), mode=0o755)
    clients = [machine.popen(["sh", "/usr/local/bin/deliver-loop", str(n)]) for n in range(3)]
    invocations = [unit_property(machine, GATE, "InvocationID")]
    rng = random.Random(11)
    try:
        time.sleep(1)
        for _ in range(RESTARTS):
            # Back to back, far past systemd's default start limit (5 in 10 s), which the
            # unit lifts: tripped, it would fail the socket too. The jitter moves each
            # restart to a different point of the clients' requests.
            time.sleep(rng.uniform(0.3, 1.5))
            machine.run(["systemctl", "restart", GATE], timeout=60)
            invocations.append(unit_property(machine, GATE, "InvocationID"))
        time.sleep(1)
    finally:
        machine.write("/var/tmp/clients.stop", "")
        for client in clients:
            client.wait(timeout=60)
    assert len(set(invocations)) == RESTARTS + 1  # each restart, a new gate process
    assert is_active(machine, SOCKET) == "active"
    assert gate_serves_systemds_socket(machine)

    results = []
    for n in range(3):
        lines = machine.host_path(f"/var/tmp/client{n}.log").read_text().splitlines()
        results += [line.split() for line in lines]
    refused = [fields for fields in results if fields[0] != "0"]
    errors = "".join(machine.host_path(f"/var/tmp/client{n}.err").read_text() for n in range(3))
    assert not refused, (refused, errors)
    assert errors == ""
    acknowledged = [int(fields[1]) for fields in results]
    waits_ms = sorted(int(fields[2]) for fields in results)
    # The restarts did catch clients mid-request: some deliveries waited out a restart.
    slow = [ms for ms in waits_ms if ms >= 300]
    assert len(acknowledged) >= 90, len(acknowledged)
    assert len(slow) >= 3, waits_ms[-10:]
    assert len(set(acknowledged)) == len(acknowledged)

    wait_for(lambda: all_settled(machine), timeout=120, interval=0.5)
    # Every acknowledged delivery ran exactly once, and nothing else is in the store.
    ran = delivered_ids(turn_log(machine))
    twice = sorted({i for i in ran if ran.count(i) > 1})
    assert not twice, ran_twice_report(machine, twice)
    assert sorted(ran) == sorted(acknowledged)
    states = delivery_states(machine)
    assert sorted(states) == sorted(acknowledged)
    assert set(states.values()) == {"done"}
    print(
        f"\n{len(invocations) - 1} restarts, {len(acknowledged)} deliveries acknowledged, "
        f"0 refused; waits: median {waits_ms[len(waits_ms) // 2]} ms, "
        f"{len(slow)} >= 300 ms, max {waits_ms[-1]} ms"
    )


def ran_twice_report(machine: Machine, twice: list[int]) -> str:
    """What the turn log and the gate's journal say about deliveries that ran twice."""
    log = turn_log(machine)
    turns = {f[3] for f in log if f[0] == "start" and {str(i) for i in twice} & set(f[5:])}
    lines = [" ".join(f) for f in log if f[0] in ("start", "end") and f[3] in turns]
    entries = [
        line
        for line in journal(machine).splitlines()
        if any(f"turn {turn} " in line for turn in turns)
        or any(f"deliveries {i}" in line for i in twice)
    ]
    return f"ran twice: {twice}\nturns: {lines}\njournal:\n" + "\n".join(entries)


def test_a_crash_between_commit_and_ack_gives_the_retry_the_same_delivery(
    machine: Machine,
) -> None:
    """The worst case for request ids: the row is committed, the ack never sent."""
    install_probe(machine)
    machine.write(
        "/etc/systemd/system/volute-gate.service.d/crash.conf",
        "[Service]\n"
        "Environment=VOLUTE_CRASH_AT=request_committed\n"
        f"Environment=VOLUTE_CRASH_ONCE={CRASHED}\n",
    )
    start_gate(machine, gate_config({"m": "turn-probe 0.1"}))
    first_gate = unit_property(machine, GATE, "MainPID")
    delivery = deliver(machine, "m", "committed, then the gate died")
    assert delivery > 0  # deliver exited 0: its retry was acknowledged
    # The gate did crash at that point: after the commit, before any ack.
    assert machine.host_path(CRASHED).exists()
    assert unit_property(machine, GATE, "MainPID") != first_gate
    assert "status=9/KILL" in journal(machine)
    wait_for(lambda: all_settled(machine), timeout=30)
    # One row, the one committed before the crash; its id is what the retry got back.
    assert delivery_states(machine) == {delivery: "done"}
    assert delivered_ids(turn_log(machine)) == [delivery]


RAW_CLIENT = """
import json, socket, sys
request = json.loads(sys.argv[1])

def send(request):
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(20)
    sock.connect("/run/volute/gate.sock")
    sock.sendall(json.dumps({"v": 1, **request}).encode() + b"\\n")
    return sock.makefile()

replies = send(request)
out = [json.loads(replies.readline())]
if request.get("wait") and out[0].get("ok"):
    out.append(json.loads(replies.readline()))
print(json.dumps(out))
"""


def test_a_retried_request_whose_delivery_already_ran_gets_its_id_and_outcome(
    machine: Machine,
) -> None:
    install_probe(machine)
    start_gate(machine, gate_config({"m": "turn-probe 0.05"}))
    request = {
        "op": "deliver",
        "mind": "m",
        "session": "main",
        "message": "once",
        "interrupt": False,
        "wait": True,
        "request_id": "ab" * 16,
    }

    def send(message: dict[str, object]) -> list[dict[str, object]]:
        out = machine.run([PYTHON, "-c", RAW_CLIENT, json.dumps(message)])
        replies: list[dict[str, object]] = json.loads(out.stdout)
        return replies

    [ack, ended] = send(request)
    assert ack["ok"] is True and isinstance(ack["id"], int)
    assert (ended["event"], ended["id"], ended["exit_code"]) == ("turn_ended", ack["id"], 0)
    # The same request again, after its turn ended: the same id, and the outcome at
    # once (nobody will send that turn's end again).
    [again, again_ended] = send(request)
    assert again["id"] == ack["id"]
    assert again_ended == ended
    # The same request id with another message is not a retry.
    [refused] = send({**request, "message": "something else"})
    assert (refused["ok"], refused["code"]) == (False, 65)
    assert "request id" in str(refused["error"])
    assert delivery_states(machine) == {ack["id"]: "done"}
    assert delivered_ids(turn_log(machine)) == [ack["id"]]


def test_when_the_socket_unit_and_the_config_disagree_the_units_socket_is_served(
    machine: Machine,
) -> None:
    install_probe(machine)
    other = "/run/volute/other.sock"
    config = gate_config({"m": "turn-probe 0.05"}, gate={"socket": other})
    start_gate(machine, config, move_socket=False)
    assert gate_serves_systemds_socket(machine, "/run/volute/gate.sock")
    assert not machine.host_path(other).exists()  # no second socket, stranded
    [mismatch] = gate_events(machine, f"VOLUTE_CONFIGURED_SOCKET={other}")
    assert mismatch["VOLUTE_SOCKET"] == "/run/volute/gate.sock", journal(machine)
    # Clients must be told where the gate really is (the config sends them elsewhere).
    delivery = deliver(machine, "m", "via the unit's path", "--socket", "/run/volute/gate.sock")
    wait_for(lambda: delivery_states(machine).get(delivery) == "done", timeout=30)
    assert delivered_ids(turn_log(machine)) == [delivery]
    report = json.loads(machine.run([VOLUTECTL, "doctor", "--json"], check=False).stdout)
    checks = {check["check"]: check for check in report["checks"]}
    assert checks["socket-unit"]["status"] == "warn"
    assert f"gate.socket is {other}" in checks["socket-unit"]["found"]
    assert "the gate serves /run/volute/gate.sock" in checks["socket-unit"]["found"]


def test_moving_gate_socket_and_the_socket_unit_together_is_clean(machine: Machine) -> None:
    """What the socket unit's comment tells an admin to do: a drop-in with the new path."""
    install_probe(machine)
    moved = "/run/volute-moved/gate.sock"
    start_gate(machine, gate_config({"m": "turn-probe 0.05"}, gate={"socket": moved}))
    assert unit_property(machine, SOCKET, "Listen") == f"{moved} (Stream)"
    assert gate_serves_systemds_socket(machine, moved)
    delivery = deliver(machine, "m", "at the new path")  # found through the config
    wait_for(lambda: all_settled(machine), timeout=30)
    assert delivered_ids(turn_log(machine)) == [delivery]
    assert not [e for e in gate_events(machine) if "VOLUTE_CONFIGURED_SOCKET" in e]  # no mismatch
    report = json.loads(machine.run([VOLUTECTL, "doctor", "--json"], check=False).stdout)
    checks = {check["check"]: check for check in report["checks"]}
    assert checks["socket-unit"]["status"] == "ok", checks["socket-unit"]
    assert checks["socket"]["status"] == "ok", checks["socket"]
