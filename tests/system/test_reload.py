"""A bad config never silences the gate, and `systemctl reload volute-gate` applies a
new one without a restart: the real volute-gate.service, in a booted container.

A gate started with a misspelt key serves its socket degraded: every request gets 78
at once, naming the key; nothing is stored; systemd sees it up (no restart loop).
A reload that finds the file fixed brings the whole gate up in the same process. A
reload of a running gate adds minds and limits with the same MainPID, leaving a running
turn alone; an invalid file at reload is refused, and the old config serves on. A
SIGKILL of the gate in the middle of a storm of reloads loses no acknowledged delivery.
"""

from __future__ import annotations

import time

import pytest

from volute_testbed.gate import (
    VOLUTECTL,
    all_settled,
    deliver,
    delivered_ids,
    delivery_states,
    gate_config,
    gate_events,
    install_probe,
    live_turn_scopes,
    start_gate,
    turn_log,
    unit_property,
    wait_for,
)
from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

GATE = "volute-gate.service"
CONFIG = "/etc/volute/volutectl.toml"
MESSAGE_IDS = {
    "gate_config_invalid": "677af27734f7478d8a64e701be14cc76",
    "gate_config_reloaded": "7a53a0c8111c46e1a178729271413029",
    "gate_config_refused": "78306785c64d4ed6ae6b1470f5d3779c",
}


def events_of(machine: Machine, kind: str) -> list[dict[str, object]]:
    found = gate_events(machine, f"VOLUTE_EVENT={kind}")
    assert all(event["MESSAGE_ID"] == MESSAGE_IDS[kind] for event in found)
    return found


def reload(machine: Machine, *, check: bool = True) -> int:
    return machine.run(["systemctl", "reload", GATE], check=check, timeout=60).returncode


@pytest.mark.serial
def test_a_misspelt_key_gets_78_at_once_and_a_fix_plus_reload_brings_the_gate_up(
    machine: Machine,
) -> None:
    install_probe(machine)
    good = gate_config({"m": "turn-probe 0.05"}, limits={"global_concurrent_turns": 2})
    start_gate(machine, good.replace("global_concurrent_turns", "global_concurent_turns"))
    pid = unit_property(machine, GATE, "MainPID")
    started = time.monotonic()
    proc = machine.run([VOLUTECTL, "deliver", "m", "--message", "hi"], check=False)
    took = time.monotonic() - started
    assert proc.returncode == 78, proc.stderr
    assert took < 2.0, took
    assert "limits.global_concurent_turns: unknown key" in proc.stderr
    assert "did you mean `global_concurrent_turns`?" in proc.stderr
    status = machine.run([VOLUTECTL, "status"], check=False)
    assert status.returncode == 78 and "global_concurent_turns" in status.stderr
    time.sleep(5)  # a crash loop would have restarted it twice by now (RestartSec=2s)
    assert unit_property(machine, GATE, "ActiveState") == "active"
    assert int(unit_property(machine, GATE, "NRestarts")) <= 1
    assert unit_property(machine, GATE, "MainPID") == pid
    assert "degraded" in unit_property(machine, GATE, "StatusText")
    [invalid] = events_of(machine, "gate_config_invalid")
    assert "global_concurent_turns" in str(invalid["VOLUTE_ERROR"])
    # Nothing was stored: the degraded gate never opened the queue.
    assert machine.run(["test", "-e", "/var/lib/volute/queue.sqlite3"], check=False).returncode
    # The same fault, as `config check` words it.
    check = machine.run([VOLUTECTL, "config", "check"], check=False)
    assert check.returncode == 78 and "did you mean `global_concurrent_turns`?" in check.stderr
    assert "no valid config" in check.stdout  # the running gate said so

    machine.write(CONFIG, good)
    assert reload(machine) == 0
    assert unit_property(machine, GATE, "MainPID") == pid
    delivery = deliver(machine, "m", "after the fix")
    assert delivery > 0
    wait_for(lambda: all_settled(machine), timeout=30)
    assert delivery_states(machine) == {delivery: "done"}
    assert int(unit_property(machine, GATE, "NRestarts")) <= 1


def test_a_mind_added_and_reloaded_takes_deliveries_while_another_minds_turn_runs_on(
    machine: Machine,
) -> None:
    install_probe(machine)
    minds = {"slow": "turn-probe 8"}
    start_gate(machine, gate_config(minds))
    pid = unit_property(machine, GATE, "MainPID")
    running = deliver(machine, "slow", "a long turn")
    wait_for(lambda: bool(live_turn_scopes(machine)), timeout=30)
    [scope] = live_turn_scopes(machine)

    machine.write(CONFIG, gate_config({**minds, "mimsy": "turn-probe 0.05"}))
    proc = machine.run([VOLUTECTL, "deliver", "mimsy", "--message", "x"], check=False)
    assert proc.returncode == 67 and "systemctl reload volute-gate" in proc.stderr
    assert reload(machine) == 0
    assert unit_property(machine, GATE, "MainPID") == pid
    [reloaded] = events_of(machine, "gate_config_reloaded")
    assert reloaded["VOLUTE_CHANGED"] == "minds.mimsy"
    added = deliver(machine, "mimsy", "to the new mind")
    assert added > 0
    wait_for(lambda: delivery_states(machine).get(added) == "done", timeout=30)
    assert scope in live_turn_scopes(machine)  # the slow turn runs on, in its scope
    assert delivery_states(machine)[running] == "running"
    wait_for(lambda: all_settled(machine), timeout=60)
    assert delivery_states(machine) == {running: "done", added: "done"}
    assert sorted(delivered_ids(turn_log(machine))) == [running, added]
    assert unit_property(machine, GATE, "MainPID") == pid


def test_an_invalid_config_at_reload_is_refused_and_the_old_one_serves(
    machine: Machine,
) -> None:
    install_probe(machine)
    good = gate_config({"m": "turn-probe 0.05"})
    start_gate(machine, good)
    pid = unit_property(machine, GATE, "MainPID")
    machine.write(CONFIG, good + "[gate]\nmax_atempts = 3\n")
    failed = machine.run(["systemctl", "reload", GATE], check=False, timeout=60)
    assert failed.returncode != 0
    assert unit_property(machine, GATE, "MainPID") == pid
    assert unit_property(machine, GATE, "ActiveState") == "active"
    [refused] = events_of(machine, "gate_config_refused")
    assert "gate.max_atempts: unknown key (did you mean `max_attempts`?)" in str(
        refused["VOLUTE_ERROR"]
    )
    shown = machine.run([VOLUTECTL, "status"]).stdout
    assert "config: reload REFUSED" in shown and "gate.max_atempts" in shown
    check = machine.run([VOLUTECTL, "config", "check"], check=False)
    assert check.returncode == 78 and "refused this file" in check.stdout
    delivery = deliver(machine, "m", "served by the old config")
    wait_for(lambda: all_settled(machine), timeout=30)
    assert delivery_states(machine) == {delivery: "done"}


CLIENT = f"""
i=0
while [ ! -e /var/tmp/client.stop ]; do
  i=$((i + 1))
  if id=$({VOLUTECTL} deliver m --message "m-$i" 2>>/var/tmp/client.err); then
    echo "$id" >> /var/tmp/client.log
  fi
done
"""


@pytest.mark.serial
def test_a_sigkill_in_a_storm_of_reloads_loses_no_acknowledged_delivery(
    machine: Machine,
) -> None:
    install_probe(machine)
    start_gate(machine, gate_config({"m": "turn-probe 0.02"}, gate={"max_attempts": 10}))
    machine.write("/usr/local/bin/deliver-loop", CLIENT, mode=0o755)
    client = machine.popen(["sh", "/usr/local/bin/deliver-loop"])
    try:
        time.sleep(1)
        for round_ in range(3):
            # Up, and past its start: a SIGHUP before its handler is set would end it.
            wait_for(lambda: unit_property(machine, GATE, "ActiveState") == "active", 30)
            pid = unit_property(machine, GATE, "MainPID")
            for _ in range(10):  # a storm of SIGHUPs, each a reload
                machine.run(["kill", "-HUP", pid], check=False)
            if round_ == 1:  # and one SIGKILL among them
                machine.run(["kill", "-HUP", pid], check=False)
                machine.run(["kill", "-KILL", pid], check=False)
            time.sleep(1)
        time.sleep(1)
    finally:
        machine.write("/var/tmp/client.stop", "")
        client.wait(timeout=60)
    acknowledged = [int(x) for x in machine.host_path("/var/tmp/client.log").read_text().split()]
    assert len(acknowledged) >= 10
    assert len(set(acknowledged)) == len(acknowledged)
    wait_for(lambda: all_settled(machine), timeout=120, interval=0.5)
    ran = delivered_ids(turn_log(machine))
    assert sorted(ran) == sorted(acknowledged)  # each acknowledged delivery ran, once
    states = delivery_states(machine)
    assert sorted(states) == sorted(acknowledged) and set(states.values()) == {"done"}
    assert unit_property(machine, GATE, "ActiveState") == "active"
