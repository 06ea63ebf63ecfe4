"""Issue 31's second-language check: a lease client in Node (tests/node/lease_client.mjs,
no volutectl code in it) drives the real gate as an agent daemon would.

Twelve minds, each with a resident process running as the mind's own user (a small
server on a unix socket: a turn is one request to it, as volute's daemon POSTs one).
The Node client, a member of group volute, holds a lease per turn of each mind: acquire,
wait for the grant, ask the resident, release. Deliveries to four other minds run
meanwhile. Under limits.global_concurrent_turns = 2, systemd's count of live turn
scopes, sampled every ~2 ms (volute_testbed/scope_sampler.py), never passes 2; every
lease is granted once; the residents never moved (Node's net cannot pass pidfds, so the
client holds its leases without pids) and are alive where they started.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from volute_testbed.gate import (
    DEFAULT_SOCKET,
    Sampler,
    all_settled,
    deliver,
    gate_config,
    queue_rows,
    start_gate,
    wait_for,
)
from volute_testbed.machine import Machine
from volute_testbed.paths import CHECKOUT, PYTHON

pytestmark = pytest.mark.system

NODE_CLIENT = str(CHECKOUT / "tests" / "node" / "lease_client.mjs")
LEASE_MINDS = [f"m{index:02d}" for index in range(12)]
DELIVERY_MINDS = [f"d{index}" for index in range(4)]
ROUNDS = 2
CAP = 2
DAEMON = "voluted"  # the Node client's user: a member of volute, as a daemon would be

# The resident process of a mind: a turn is one line on its socket; it does a little IO
# as the mind's user and answers `done PID MS`.
RESIDENT = r"""
import os, socket, sys, time
path = sys.argv[1]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
os.chmod(path, 0o666)
server.listen(16)
print("ready", os.getpid(), flush=True)
log = open(sys.argv[2], "ab")
while True:
    conn, _ = server.accept()
    with conn:
        words = conn.makefile().readline().split()
        started = time.monotonic()
        log.write(os.urandom(65536))
        log.flush()
        os.fsync(log.fileno())
        time.sleep(max(0.0, int(words[2]) / 1000 - (time.monotonic() - started)))
        conn.sendall(f"done {os.getpid()} {words[1]}\n".encode())
"""


def config() -> str:
    text = gate_config(
        {mind: "sleep 0.3" for mind in DELIVERY_MINDS},
        limits={"global_concurrent_turns": CAP},
    )
    for mind in LEASE_MINDS:
        text += f'[minds."{mind}"]\nuser = "{mind}"\n'  # leases only: no command
    return text


def systemd_line(machine: Machine, pid: int) -> str:
    """The systemd hierarchy's line of /proc/PID/cgroup: the unit the process is in."""
    text = machine.run(["cat", f"/proc/{pid}/cgroup"]).stdout
    lines = [line for line in text.splitlines() if ":name=systemd:" in line or line[:3] == "0::"]
    assert lines, text
    return lines[0]


def start_residents(machine: Machine) -> tuple[list[subprocess.Popen[str]], dict[str, int]]:
    machine.run(["install", "-d", "-m", "1777", "/run/residents", "/var/tmp/residents"])
    procs, pids = [], {}
    for mind in LEASE_MINDS:
        argv = [PYTHON, "-I", "-S", "-c", RESIDENT, f"/run/residents/{mind}.sock",
                f"/var/tmp/residents/{mind}.log"]  # fmt: skip
        proc = subprocess.Popen(machine.command(argv, user=mind), stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        ready, pid = proc.stdout.readline().split()
        assert ready == "ready"
        pids[mind] = int(pid)
    return procs, pids


def most_at_once(leases: list[dict[str, Any]]) -> int:
    """The most leases held at once, as the client saw them held (from its grant to the
    answer to its release: within the gate's own holding)."""
    edges = sorted(
        [(lease["granted_at"], 1) for lease in leases]
        + [(lease["released_at"], -1) for lease in leases]
    )
    held = peak = 0
    for _, step in edges:
        held += step
        peak = max(peak, held)
    return peak


def test_a_node_client_holds_leases_for_12_minds_under_a_limit_of_2(machine: Machine) -> None:
    machine.run(["groupadd", "-f", "-r", "volute"])
    machine.run(["useradd", "-M", "-G", "volute", DAEMON])
    for mind in LEASE_MINDS:
        machine.run(["useradd", "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", mind])
    start_gate(machine, config())
    residents, pids = start_residents(machine)
    try:
        check_leases(machine, pids)
    finally:
        for proc in residents:
            proc.kill()


def check_leases(machine: Machine, pids: dict[str, int]) -> None:
    before = {mind: systemd_line(machine, pid) for mind, pid in pids.items()}
    plan = {
        "socket": DEFAULT_SOCKET,
        "rounds": ROUNDS,
        "turn_ms": 200,
        "minds": [
            {"mind": m, "session": "main", "resident": f"/run/residents/{m}.sock"}
            for m in LEASE_MINDS
        ],
    }
    machine.write("/var/tmp/plan.json", json.dumps(plan))
    sampler = Sampler(machine)
    try:
        client = subprocess.Popen(
            machine.command(["node", NODE_CLIENT, "/var/tmp/plan.json"], user=DAEMON),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        delivered = [deliver(machine, DELIVERY_MINDS[i % 4], f"fan-out {i}") for i in range(8)]
        out, err = client.communicate(timeout=300)
        wait_for(lambda: all_settled(machine), timeout=120)
    finally:
        samples = sampler.stop()
    assert client.returncode == 0, err
    print(
        f"node leases: {len(out.splitlines())} granted; {samples['samples']} samples, "
        f"peak {samples['max_turns']} live turn scopes"
    )
    leases = [json.loads(line) for line in out.splitlines()]
    check_granted_once(leases, pids)
    # systemd's count, leases and delivery turns together, never over the limit; and the
    # leases' scopes were counted (seen by the sampler) among them.
    assert samples["gaps"] == 0 and samples["samples"] > 100, samples["samples"]
    assert samples["max_turns"] <= CAP, samples["worst"]
    # (The sampler's first listing may come after the first grants: those are left out.)
    sampling_from = samples["timeline"][0][0]
    sampled = [lease for lease in leases if lease["granted_at"] > sampling_from]
    assert len(sampled) >= len(leases) - 4, (sampling_from, leases)
    assert {lease["unit"] for lease in sampled} <= set(samples["seen"])
    assert most_at_once(leases) <= CAP
    # The deliveries ran too.
    done = {row["id"] for row in queue_rows(machine, "done")}
    assert set(delivered) <= done
    # The residents were never moved: alive, in the unit they started in.
    after = {mind: systemd_line(machine, pid) for mind, pid in pids.items()}
    assert after == before


def check_granted_once(leases: list[dict[str, Any]], pids: dict[str, int]) -> None:
    """Every lease granted once, each a place of its own, its turn run by the resident."""
    assert sorted((lease["mind"], lease["round"]) for lease in leases) == sorted(
        (mind, r) for mind in LEASE_MINDS for r in range(ROUNDS)
    )
    assert all(lease["grants"] == 1 and lease["created"] is True for lease in leases), leases
    assert len({lease["lease"] for lease in leases}) == len(leases)
    assert all(
        lease["resident"].split()[:2] == ["done", str(pids[lease["mind"]])] for lease in leases
    )
    # Some leases had to wait for their place (12 minds, 2 places).
    assert any(lease["waited"] is True for lease in leases)
