"""Leases (issue 31) against a real systemd: the real volute-gate.service and
volute-launcher behind their sockets, and a small lease client written here (no
volutectl code: the protocol's own lines over the socket).

- The cap is shared: leases and command turns together never exceed the limit in any
  ~2 ms sample of systemd's live turn scopes (volute_testbed.scope_sampler).
- Joining: a second acquire of the same (mind, session) joins the first's scope.
- A closed connection releases: its scope is stopped, the next waiter gets the place.
- A held lease outlives a quiet connection (gate.client_idle_seconds set low).
- A delivery to a leased session waits `mind_busy` and runs after the release.
- A mind with no command takes leases; a delivery to it is refused with 65.
- Across a gate restart the scope outlives the gate and is claimed again; one nobody
  claims ends after gate.lease_reclaim_seconds, its scope stopped.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest

from volute_testbed.faults import CRASHED, fast_restarts, gate_pid, wait_gate_up
from volute_testbed.gate import (
    DEFAULT_SOCKET,
    VOLUTECTL,
    Sampler,
    deliver,
    gate_config,
    gate_events,
    install_probe,
    journal,
    live_turn_scopes,
    queue_rows,
    start_gate,
    status,
    unit_property,
    wait_for,
)
from volute_testbed.lines import PipeLines
from volute_testbed.machine import Machine
from volute_testbed.paths import PYTHON
from volutectl.faults import LEASE_POINTS

pytestmark = pytest.mark.system

GATE = "volute-gate.service"

# The lease client: acquire, print every line the gate sends, and obey the test's
# commands on stdin: "release", "claim LEASE TOKEN", "acquire MIND SESSION",
# "close" (close the socket cleanly) and "die" (exit at once, the socket with it).
HOLDER = r"""
import json, os, select, socket, sys
path, first = sys.argv[1], sys.argv[2:]
s = socket.socket(socket.AF_UNIX)
s.connect(path)
def send(**obj):
    s.sendall((json.dumps({"v": 1, **obj}) + "\n").encode())
if first:
    send(op="acquire", mind=first[0], session=first[1])
buf, held = b"", {}
while True:
    ready, _, _ = select.select([s, sys.stdin], [], [])
    if s in ready:
        chunk = s.recv(65536)
        if not chunk:
            print("EOF", flush=True)
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            print(line.decode(), flush=True)
            obj = json.loads(line)
            if obj.get("event") == "lease_granted":
                held = obj
    if sys.stdin in ready:
        words = sys.stdin.readline().split()
        if not words or words[0] == "close":
            s.close()
            break
        if words[0] == "die":
            os._exit(0)
        if words[0] == "release":
            send(op="release", lease=held["lease"], token=held["token"])
        if words[0] == "claim":
            held = {"lease": int(words[1]), "token": words[2]}
            send(op="claim", **held)
        if words[0] == "acquire":
            send(op="acquire", mind=words[1], session=words[2])
"""


class Holder:
    """One lease client in the container: a connection to the gate."""

    def __init__(self, machine: Machine, *args: str) -> None:
        self.proc = machine.popen(
            [PYTHON, "-c", HOLDER, DEFAULT_SOCKET, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        self.lines = PipeLines(self.proc.stdout.fileno())

    def has_line(self, timeout: float = 0.0) -> bool:
        return self.lines.ready(timeout)

    def line(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.lines.ready(timeout), f"no line from the gate in {timeout} s"
        raw = self.lines.take()
        text = "EOF" if raw is None else raw.decode().strip()  # the holder's, or the pipe's
        assert text and text != "EOF", f"the gate closed the connection ({text!r})"
        result: dict[str, Any] = json.loads(text)
        return result

    def event(self, name: str, timeout: float = 30.0) -> dict[str, Any]:
        """Read lines until the event `name` (replies on the way are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.line(max(0.1, deadline - time.monotonic()))
            if line.get("event") == name:
                return line
            assert "event" not in line, line

    def tell(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def quiet(self, seconds: float) -> bool:
        """Nothing came for `seconds`."""
        return not self.has_line(seconds)

    def end(self) -> None:
        if self.proc.poll() is None:
            self.tell("die")
            self.proc.wait(timeout=30)


def lease_mind(name: str, user: str = "volute-turn") -> str:
    """A mind with no command: it takes leases only."""
    return f'[minds."{name}"]\nuser = "{user}"\n'


def scope_pids(machine: Machine, unit: str) -> list[int]:
    """The lease placeholders in `unit`, read from their /proc/PID/cgroup."""
    script = (
        "for p in $(pgrep -f volute-lease-placeholder); do "
        f"grep -q '/{unit}$' /proc/$p/cgroup 2>/dev/null && echo $p; done"
    )
    return [int(pid) for pid in machine.sh(script, check=False).stdout.split()]


def test_leases_and_command_turns_share_the_cap(machine: Machine) -> None:
    """Six lease holders and twelve deliveries, under a limit of 2: systemd never lists
    more than 2 live turn scopes, and every lease is granted once."""
    install_probe(machine)
    config = gate_config(
        {"cmd": "turn-probe 0.3"},
        limits={"global_concurrent_turns": 2, "turns_per_mind": 2},
    ) + "".join(lease_mind(f"l{i}") for i in range(6))
    start_gate(machine, config)
    sampler = Sampler(machine)
    holders = [Holder(machine, f"l{i}", "main") for i in range(6)]
    ids = [deliver(machine, "cmd", f"m{i}", "--session", f"s{i % 4}") for i in range(12)]
    granted = 0
    pending = list(holders)
    deadline = time.monotonic() + 120
    while pending and time.monotonic() < deadline:
        for holder in list(pending):
            if not holder.has_line(0.02):
                continue
            line = holder.line()
            if line.get("event") == "lease_granted":
                assert line["created"] is True
                granted += 1
                time.sleep(0.2)  # the daemon's turn
                holder.tell("release")
                pending.remove(holder)
    assert granted == 6, f"{granted} leases granted"
    wait_for(lambda: not queue_rows(machine, "pending", "running"), timeout=120)
    seen = sampler.stop()
    for holder in holders:
        holder.end()
    print("sampled:", json.dumps({k: seen[k] for k in ("samples", "gaps", "max_turns")}))
    assert seen["samples"] > 100
    assert seen["max_turns"] <= 2, seen["worst"]
    assert {row["state"] for row in queue_rows(machine, "done")} == {"done"}
    assert len(queue_rows(machine, "done")) == len(ids)
    lease_scopes = [name for name in seen["seen"] if name.startswith("volute-turn-l")]
    assert len(lease_scopes) == 6


def test_joining_a_closed_connection_and_a_quiet_holder(machine: Machine) -> None:
    """A second acquire of the same session joins; a held lease outlives several idle
    timeouts of quiet; closing the connection releases, and the waiter gets the place."""
    config = (
        gate_config({}, limits={"global_concurrent_turns": 1}, gate={"client_idle_seconds": 1})
        + lease_mind("pip")
        + lease_mind("whorl")
    )
    start_gate(machine, config)
    first = Holder(machine, "pip", "main")
    grant = first.event("lease_granted")
    unit = grant["unit"]
    assert unit in live_turn_scopes(machine)
    assert unit_property(machine, unit, "RuntimeMaxUSec") == "infinity"
    assert unit_property(machine, unit, "Slice") == "volute-turns.slice"
    joiner = Holder(machine, "pip", "main")
    joined = joiner.event("lease_granted")
    assert joined["created"] is False and joined["unit"] == unit
    waiter = Holder(machine, "whorl", "main")
    reply = waiter.line()
    assert reply["state"] == "waiting"
    wait_for(
        lambda: any(
            x["lease"] == reply["lease"] and x["reason"] == "global_cap"
            for x in status(machine)["leases"]
        )
    )
    # Quiet for 4 idle timeouts: the holders are not closed.
    assert first.quiet(4.0) and joiner.quiet(0.1)
    assert unit in live_turn_scopes(machine)
    first.tell("die")  # the runner crashed: its connection closes
    ended = joiner.event("lease_ended")
    assert ended["reason"] == "creator_released"
    other = waiter.event("lease_granted", timeout=30)
    wait_for(lambda: unit not in live_turn_scopes(machine))
    assert other["unit"] in live_turn_scopes(machine)
    events = gate_events(machine, "VOLUTE_EVENT=lease_ended")
    reasons = {str(e.get("VOLUTE_REASON")) for e in events}
    assert "closed" in reasons and all(e.get("MESSAGE_ID") for e in events)
    for holder in (first, joiner, waiter):
        holder.end()


def test_a_delivery_to_a_leased_session_waits_and_a_lease_only_mind_refuses_deliveries(
    machine: Machine,
) -> None:
    install_probe(machine)
    config = gate_config(
        {"pip": "turn-probe 0"}, limits={"global_concurrent_turns": 4, "turns_per_mind": 2}
    ) + lease_mind("whorl")
    start_gate(machine, config)
    holder = Holder(machine, "pip", "main")
    holder.event("lease_granted")
    delivery = deliver(machine, "pip", "hello")
    wait_for(
        lambda: any(
            row["id"] == delivery and row["hold_reason"] == "mind_busy"
            for row in queue_rows(machine, "pending")
        )
    )
    time.sleep(1.0)
    assert [row["id"] for row in queue_rows(machine, "pending")] == [delivery]
    holder.tell("release")
    assert holder.line()["released"] is True
    wait_for(lambda: not queue_rows(machine, "pending", "running"), timeout=30)
    refused = machine.run([VOLUTECTL, "deliver", "whorl", "-m", "x"], check=False)
    assert refused.returncode == 65 and "takes leases only" in refused.stderr
    holder.end()


def test_a_lease_survives_a_gate_restart_and_one_unclaimed_ends(machine: Machine) -> None:
    config = gate_config(
        {}, limits={"global_concurrent_turns": 4, "turns_per_mind": 2},
        gate={"lease_reclaim_seconds": 5},
    ) + lease_mind("pip")  # fmt: skip
    start_gate(machine, config)
    kept, lost = Holder(machine, "pip", "kept"), Holder(machine, "pip", "lost")
    kept_grant, lost_grant = kept.event("lease_granted"), lost.event("lease_granted")
    # The grant comes once the placeholder's process is in its scope and released; its
    # exec as the mind's user, which names it, may still be on the way (CI's parallel
    # phase once read the scope before it).
    wait_for(lambda: scope_pids(machine, kept_grant["unit"]), timeout=30, interval=0.1)
    pids = scope_pids(machine, kept_grant["unit"])
    assert len(pids) == 1
    user = machine.run(["ps", "-o", "user=", "-p", str(pids[0])]).stdout.strip()
    assert user == "volute-turn"  # the placeholder runs as the mind's user
    machine.run(["systemctl", "restart", GATE], timeout=60)
    claimer = Holder(machine)
    claimer.tell(f"claim {kept_grant['lease']} {kept_grant['token']}")
    try:
        reply = claimer.line()
    except AssertionError:
        print(journal(machine))
        raise
    assert reply["ok"] is True and reply["unit"] == kept_grant["unit"], reply
    assert scope_pids(machine, kept_grant["unit"]) == pids  # the same scope, adopted
    wait_for(lambda: lost_grant["unit"] not in live_turn_scopes(machine), timeout=30)
    assert kept_grant["unit"] in live_turn_scopes(machine)
    leases = {x["lease"]: x for x in status(machine)["leases"]}
    assert leases[kept_grant["lease"]]["state"] == "held"
    assert lost_grant["lease"] not in leases
    claimer.tell("release")
    assert claimer.line()["released"] is True
    wait_for(lambda: kept_grant["unit"] not in live_turn_scopes(machine), timeout=30)
    for holder in (kept, lost, claimer):
        holder.end()


@pytest.mark.parametrize("point", LEASE_POINTS)
def test_a_sigkill_of_the_gate_at_each_step_of_a_grant(machine: Machine, point: str) -> None:
    """The gate's cgroup SIGKILLed after the grant's commit, after its scope started, and
    after the holder was told: the next gate counts the lease once at most, a scope that
    nobody claims is stopped once gate.lease_reclaim_seconds are over, a holder with its
    token claims it again, and the next acquire gets the place."""
    fast_restarts(machine, VOLUTE_CRASH_AT=point, VOLUTE_CRASH_ONCE=CRASHED)
    config = gate_config(
        {}, limits={"global_concurrent_turns": 1}, gate={"lease_reclaim_seconds": 3}
    ) + lease_mind("pip")
    start_gate(machine, config)
    first = gate_pid(machine)
    holder = Holder(machine, "pip", "main")
    assert holder.line()["state"] == "waiting"
    grant: dict[str, Any] | None = None
    try:
        grant = holder.event("lease_granted", timeout=15)
    except AssertionError:
        pass  # the gate died before telling it
    wait_for(lambda: machine.host_path(CRASHED).exists(), timeout=30)
    wait_for(lambda: gate_pid(machine) not in (0, first), timeout=30)
    wait_gate_up(machine)
    leases = status(machine)["leases"]
    assert len({x["lease"] for x in leases}) == len(leases) <= 1, leases
    assert len(live_turn_scopes(machine)) <= 1
    if point == "lease_replied":
        assert grant is not None
        claimer = Holder(machine)
        claimer.tell(f"claim {grant['lease']} {grant['token']}")
        assert claimer.line()["unit"] == grant["unit"]
        claimer.tell("release")
        assert claimer.line()["released"] is True
        claimer.end()
    # Unclaimed (or released): no lease scope outlives the reclaim window for long.
    wait_for(lambda: not live_turn_scopes(machine), timeout=3 + 15)
    assert status(machine)["leases"] == []
    after = Holder(machine, "pip", "main")
    assert after.event("lease_granted", timeout=30)["created"] is True
    assert len(live_turn_scopes(machine)) == 1
    rows = machine.run([PYTHON, "-c", OPEN_LEASES_SQL], check=True).stdout.split()
    assert len(rows) == 1, rows  # the store holds one open lease: the new one
    for each in (holder, after):
        each.end()


# The leases the store holds open (the gate's own database, read as root).
OPEN_LEASES_SQL = (
    "import sqlite3; db = sqlite3.connect('file:/var/lib/volute/queue.sqlite3?mode=ro', uri=True);"
    "print(' '.join(str(r[0]) for r in db.execute('SELECT id FROM leases WHERE ended_at IS NULL')))"
)
