"""A kill storm: clients deliver while the gate's whole cgroup is SIGKILLed at random.

Used by tests/system/test_faults.py (30 kills) and by bench/gate_kills.py (50, by hand).
Inside a booted container with the gate installed (volute_testbed.gate):

- N minds run the turn probe (volute_testbed.turn_probe): each turn holds a while,
  takes its inbox, and exits 1 once in `fail_one_in` turns, so failures are retried;
- C clients deliver in closed loops (`volutectl deliver`, its default --timeout),
  logging each exit code and acknowledged id;
- the gate is killed as `systemctl kill --signal=SIGKILL` does (every process of its
  cgroup, a turn's child forked a moment ago included) `kills` times, at random moments,
  each once the restarted gate answers again;
- a sampler lists the turn scopes that hold a process, every ~2 ms, from systemd.

`run()` returns the raw record; `verdict()` turns it into the figures asserted and
reported: acknowledged, refused, lost, run twice, dead, drain time, caps, empty scopes.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TypedDict

from volute_testbed.faults import (
    fast_restarts,
    successful_runs,
    unit_pid,
)
from volute_testbed.gate import (
    VOLUTECTL,
    Sampler,
    gate_config,
    gate_events,
    install_probe,
    live_turn_scopes,
    queue_rows,
    start_gate,
    turn_log,
)
from volute_testbed.machine import Machine
from volute_testbed.scope_sampler import Samples

CLIENT = """#!/bin/sh
# chaos-client K N: deliver to mind m(i % N), session cK, until /var/tmp/chaos.stop exists.
k=$1 n=$2 i=0
while [ ! -e /var/tmp/chaos.stop ]; do
  out=$({volutectl} deliver "m$((i % n))" --session "c$k" -m "c$k-$i" 2>>/var/tmp/chaos-$k.err)
  echo "$i $? $out" >> /var/tmp/chaos-$k.log
  i=$((i + 1))
  sleep 0.05
done
"""


class Record(TypedDict):
    """What run() saw: the raw figures, for verdict() and for bench/gate_kills.py."""

    kills: int
    pids: int  # distinct PIDs of the unit killed: kills + 1 if each kill took it down
    storm_seconds: float
    drain_seconds: float | None  # None: the queue did not drain in time
    client_results: list[tuple[int, int | None]]
    samples: Samples
    turn_log: list[list[str]]
    dead: list[dict[str, object]]
    live_scopes_after: list[str]
    empty_scopes_stopped: int


class Verdict(TypedDict):
    kills: int
    acknowledged: int
    refused: int
    refusal_codes: list[int]
    lost: list[int]
    ran_twice: list[int]
    dead: int
    drain_seconds: float | None
    max_turns: int
    max_per_mind: int
    samples: int
    empty_scopes_seen: int
    longest_empty_seconds: float
    empty_scopes_stopped_by_gate: int
    live_scopes_after: list[str]


@dataclass
class Storm:
    kills: int
    minds: int = 12
    clients: int = 3
    cap: int = 2
    hold: float = 0.3
    fail_one_in: int = 7
    pause: tuple[float, float] = (0.1, 0.8)  # between a gate answering and the next kill
    seed: int | None = None
    # And the storm goes on, a kill at a time, until the clients have had this many
    # deliveries acknowledged: a loaded machine delivers more slowly between two kills.
    # At most three times `kills` kills in all.
    acknowledged: int = 0
    # Whose death: the gate's (volute-gate.service) or the launcher's; `restart`: by
    # `systemctl restart` (SIGTERM, the order under way finished) instead of SIGKILL.
    unit: str = "volute-gate.service"
    restart: bool = False
    record: Record | None = None  # run()'s, once it returned


def run(machine: Machine, storm: Storm, drain_timeout: float = 120.0) -> Record:
    rng = random.Random(storm.seed)
    install_probe(machine)
    machine.write("/usr/local/bin/chaos-client", CLIENT.format(volutectl=VOLUTECTL), mode=0o755)
    fast_restarts(machine)
    command = f"turn-probe {storm.hold} take 1/{storm.fail_one_in}"
    minds = {f"m{i}": command for i in range(storm.minds)}
    start_gate(
        machine,
        gate_config(
            minds,
            adaptive=False,  # the storm's static cap alone
            limits={"global_concurrent_turns": storm.cap},
            gate={
                "backoff_initial_seconds": 0.1,
                "backoff_max_seconds": 1.0,
                "max_attempts": 100,
            },
        ),
    )
    sampler = Sampler(machine)
    clients = [
        machine.popen(["/usr/local/bin/chaos-client", str(k), str(storm.minds)])
        for k in range(storm.clients)
    ]
    pids = [_wait_restarted(machine, storm.unit, 0)]
    started = time.monotonic()
    kills = 0
    while kills < storm.kills or (
        kills < 3 * storm.kills and _acknowledged(machine, storm.clients) < storm.acknowledged
    ):
        kills += 1
        time.sleep(rng.uniform(*storm.pause))
        if storm.restart:
            machine.run(["systemctl", "restart", storm.unit], timeout=60)
        else:
            machine.run(["systemctl", "kill", "--signal=SIGKILL", storm.unit])
        pids.append(_wait_restarted(machine, storm.unit, pids[-1]))
    last_kill = time.monotonic()
    machine.write("/var/tmp/chaos.stop", "")
    for client in clients:
        client.wait(timeout=120)
    drained = _wait_drained(machine, drain_timeout)
    seen = sampler.stop()
    storm.record = {
        "kills": kills,
        "pids": len(set(pids)),
        "storm_seconds": round(last_kill - started, 1),
        "drain_seconds": round(drained - last_kill, 1) if drained else None,
        "client_results": _client_results(machine, storm.clients),
        "samples": seen,
        "turn_log": turn_log(machine),
        "dead": queue_rows(machine, "dead"),
        "live_scopes_after": live_turn_scopes(machine),
        "empty_scopes_stopped": len(gate_events(machine, "VOLUTE_EVENT=empty_scope")),
    }
    return storm.record


def _wait_restarted(machine: Machine, unit: str, old: int, timeout: float = 30.0) -> int:
    """The unit's new PID, once it runs again and the gate answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = unit_pid(machine, unit)
        if pid not in (0, old):
            answer = machine.run([VOLUTECTL, "status", "--json"], check=False)
            if answer.returncode == 0:
                return pid
        time.sleep(0.02)
    raise AssertionError(f"{unit} did not come back within {timeout} s of a kill")


def _wait_drained(machine: Machine, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not queue_rows(machine, "pending", "running"):
            return time.monotonic()
        time.sleep(0.2)
    return None


def _acknowledged(machine: Machine, clients: int) -> int:
    """How many deliveries the clients have had acknowledged so far."""
    return sum(1 for code, delivery in _client_results(machine, clients) if delivery is not None)


def _client_results(machine: Machine, clients: int) -> list[tuple[int, int | None]]:
    """(exit code, acknowledged id or None) of every deliver the clients ran (so far:
    a line a client is still writing is left out)."""
    results = []
    for k in range(clients):
        path = machine.host_path(f"/var/tmp/chaos-{k}.log")
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue  # a client that has not ended a deliver yet
        for line in text[: text.rfind("\n") + 1].splitlines():
            fields = line.split()
            code = int(fields[1])
            results.append((code, int(fields[2]) if code == 0 and len(fields) > 2 else None))
    return results


def verdict(record: Record) -> Verdict:
    results = record["client_results"]
    acked = [delivery for code, delivery in results if code == 0 and delivery is not None]
    refused = [code for code, _ in results if code != 0]
    counts = successful_runs(record["turn_log"])
    samples = record["samples"]
    per_mind = samples["max_per_mind"]
    empty = samples["empty_seen"]
    return {
        "kills": record["kills"],
        "acknowledged": len(acked),
        "refused": len(refused),
        "refusal_codes": sorted(set(refused)),
        "lost": sorted(i for i in acked if counts[i] == 0),
        "ran_twice": sorted(i for i in acked if counts[i] > 1),
        "dead": len(record["dead"]),
        "drain_seconds": record["drain_seconds"],
        "max_turns": samples["max_turns"],
        "max_per_mind": max(per_mind.values(), default=0),
        "samples": samples["samples"],
        "empty_scopes_seen": len(empty),
        "longest_empty_seconds": round(
            max((last - first for first, last in empty.values()), default=0.0), 3
        ),
        "empty_scopes_stopped_by_gate": record["empty_scopes_stopped"],
        "live_scopes_after": record["live_scopes_after"],
    }
