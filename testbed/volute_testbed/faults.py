"""Helpers for the fault tests: drop-ins that arm crash points and speed up restarts, and
the exactly-once check over the turn probe's log (volute_testbed.turn_probe)."""

from __future__ import annotations

import collections
import json
import time
from typing import Any

from volute_testbed.gate import VOLUTECTL, live_turn_scopes, wait_for
from volute_testbed.machine import Machine

DROPINS = (
    "/etc/systemd/system/volute-gate.service.d/faults.conf",
    "/etc/systemd/system/volute-launcher.service.d/faults.conf",
)
# Where a crash point armed with VOLUTE_CRASH_ONCE leaves its mark: a path both the gate
# (whose sandbox writes its state directory alone) and the launcher can create.
CRASHED = "/var/lib/volute/crashed"


def fast_restarts(machine: Machine, **environment: str) -> None:
    """Drop-ins: restart the gate and the launcher 100 ms after either dies, with no
    start limit, and with the given environment (e.g. VOLUTE_CRASH_AT) in both."""
    lines = ["[Unit]", "StartLimitIntervalSec=0", "[Service]", "RestartSec=100ms"]
    lines += [f"Environment={name}={value}" for name, value in environment.items()]
    for dropin in DROPINS:
        machine.write(dropin, "\n".join(lines) + "\n")
    machine.run(["systemctl", "daemon-reload"])


def unit_pid(machine: Machine, unit: str) -> int:
    out = machine.run(["systemctl", "show", "-p", "MainPID", "--value", unit])
    return int(out.stdout.strip() or 0)


def gate_pid(machine: Machine) -> int:
    return unit_pid(machine, "volute-gate.service")


def launcher_pid(machine: Machine) -> int:
    return unit_pid(machine, "volute-launcher.service")


def wait_gate_up(machine: Machine, timeout: float = 30) -> int:
    """Wait until the gate answers on its socket; return its PID."""

    def answers() -> bool:
        return machine.run([VOLUTECTL, "status", "--json"], check=False).returncode == 0

    wait_for(answers, timeout=timeout, interval=0.1)
    return gate_pid(machine)


def first_status(machine: Machine, timeout: float = 30) -> dict[str, Any]:
    """The first `status --json` the gate answers (after a restart: the new gate's, as
    early as a client can have it, before its first interval can move anything)."""
    answers: list[dict[str, Any]] = []

    def answered() -> bool:
        proc = machine.run([VOLUTECTL, "status", "--json"], check=False)
        if proc.returncode == 0:
            answers.append(json.loads(proc.stdout))
        return bool(answers)

    wait_for(answered, timeout=timeout, interval=0.05)
    return answers[0]


def turns_by_outcome(log: list[list[str]]) -> dict[int, tuple[list[int], int | None]]:
    """turn id -> (delivery ids it received, its exit code or None if it logged no end)."""
    received: dict[int, list[int]] = collections.defaultdict(list)
    ended: dict[int, int] = {}
    for fields in log:
        if fields[0] == "start":
            received[int(fields[3])] += [int(x) for x in fields[5:]]
        elif fields[0] == "took":
            received[int(fields[3])].append(int(fields[4]))
        elif fields[0] == "end":
            ended[int(fields[3])] = int(fields[4])
    return {turn: (ids, ended.get(turn)) for turn, ids in received.items()}


def successful_runs(log: list[list[str]]) -> collections.Counter[int]:
    """How many turns that exited 0 each delivery id reached."""
    counts: collections.Counter[int] = collections.Counter()
    for ids, rc in turns_by_outcome(log).values():
        if rc == 0:
            counts.update(ids)
    return counts


def assert_exactly_once(log: list[list[str]], acknowledged: list[int]) -> None:
    counts = successful_runs(log)
    missing = [i for i in acknowledged if counts[i] == 0]
    twice = {i: n for i, n in counts.items() if n > 1}
    assert not missing, f"acknowledged but never ran successfully: {missing}"
    assert not twice, f"ran successfully more than once: {twice}"


def assert_no_live_turn_scopes(machine: Machine, timeout: float = 15) -> None:
    """Once everything settled, no turn scope is left active (empty or not)."""
    deadline = time.monotonic() + timeout
    while live_turn_scopes(machine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_turn_scopes(machine) == []
