"""One gate for the whole host: the gate watches the test slots, and with
limits.test_runs_count_as_turns a held slot takes a place of the turn budget.

Each test boots its own systemd, runs the real volute-gate.service and real
`volutectl test` runs in git worktrees. Counts come from systemd, sampled every ~2 ms
by volute_testbed.scope_sampler in both slices, not from the gate's bookkeeping.
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import time

import pytest

from volute_testbed.gate import (
    VOLUTECTL,
    Sampler,
    all_settled,
    deliver,
    gate_config,
    gate_events,
    install_probe,
    journal,
    live_turn_scopes,
    queue_rows,
    start_gate,
    status,
    wait_for,
)
from volute_testbed.machine import Machine
from volute_testbed.paths import CHECKOUT, PYTHON
from volute_testbed.scope_sampler import Samples

pytestmark = [pytest.mark.system, pytest.mark.serial]

REPO = "/srv/repo"
COMMON_DIR = "/srv/repo/.git"
WORKTREE = "/srv/wt1"
# With adaptive=False: the static cap of 2 alone, so a test run takes one of exactly 2.
COUNTING = {"global_concurrent_turns": 2, "test_runs_count_as_turns": True}


def make_repository(machine: Machine, slots: int = 1) -> None:
    machine.sh(
        f"git init -q {REPO} && "
        f"git -C {REPO} -c user.email=t@example.org -c user.name=t commit -q --allow-empty -m i"
        f" && git -C {REPO} worktree add -q {WORKTREE}"
        f" && git -C {REPO} config volute.testSlots {slots}"
    )


def start_test_run(machine: Machine, seconds: float, name: str = "run") -> subprocess.Popen[str]:
    """`volutectl test` in the worktree; its command logs its own start and end (ns)."""
    log = f"/var/tmp/{name}.log"
    command = f"echo start $(date +%s%N) >> {log}; sleep {seconds}; echo end $(date +%s%N) >> {log}"
    line = f"cd {WORKTREE} && exec {VOLUTECTL} test --json -- sh -c {shlex.quote(command)}"
    return machine.popen(["sh", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def live_test_scopes(machine: Machine) -> list[str]:
    out = machine.run(
        ["systemctl", "list-units", "--plain", "--no-legend", "volute-test-*.scope"]
    ).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def gate_test_runs(machine: Machine) -> list[dict[str, object]]:
    runs = status(machine).get("test_runs", [])
    assert isinstance(runs, list)
    return runs


def repository_entry(machine: Machine, repository: str = COMMON_DIR) -> dict[str, object] | None:
    """`status`'s test_runs entry for `repository`, if it has one."""
    return next((e for e in gate_test_runs(machine) if e["repository"] == repository), None)


def slots_held(machine: Machine, repository: str = COMMON_DIR) -> int | None:
    entry = repository_entry(machine, repository)
    held = entry["slots_held"] if entry is not None else None
    return held if isinstance(held, int) else None


def one_run_registered(machine: Machine, repository: str = COMMON_DIR) -> bool:
    """One slot held and one run listed. A run takes its slot file, then starts its
    scope: the status counts the slot (inotify) a moment before it lists the run
    (systemd's scopes of the tests slice)."""
    entry = repository_entry(machine, repository)
    if entry is None:
        return False
    runs = entry["runs"]
    return entry["slots_held"] == 1 and isinstance(runs, list) and len(runs) == 1


def start_stream(
    machine: Machine, minds: list[str], interval: float = 0.1
) -> subprocess.Popen[str]:
    """A steady stream of deliveries, round-robin over the minds, until told to stop."""
    names = " ".join(minds)
    script = (
        "i=0; while [ ! -e /var/tmp/stream.stop ]; do "
        f"for m in {names}; do [ -e /var/tmp/stream.stop ] && break; "
        f"{VOLUTECTL} deliver $m -m tick-$i >/dev/null; i=$((i+1)); sleep {interval}; done; "
        "done"
    )
    return machine.popen(["sh", "-c", script], stdout=subprocess.DEVNULL)


def stop_stream(machine: Machine, stream: subprocess.Popen[str]) -> None:
    machine.write("/var/tmp/stream.stop", "")
    stream.wait(timeout=30)


def timeline(seen: Samples) -> list[tuple[float, int, int]]:
    raw = seen["timeline"]
    assert isinstance(raw, list)
    return [(float(t), int(turns), int(tests)) for t, turns, tests in raw]


def turns_while_tests_run(line: list[tuple[float, int, int]], settle: float = 0.0) -> int:
    """The most turns systemd listed while a test run was live, ignoring the first
    `settle` seconds of each run (turns already running when it started may finish)."""
    worst = 0
    run_started: float | None = None
    for when, turns, tests in line:
        if tests and run_started is None:
            run_started = when
        elif not tests:
            run_started = None
        if tests and run_started is not None and when - run_started >= settle:
            worst = max(worst, turns)
    return worst


def handoffs(line: list[tuple[float, int, int]], cap: int = 2) -> list[float]:
    """Seconds from each test run's end (its scope leaving systemd's list) to the turn
    count reaching the cap, if it does before the next run starts."""
    gaps = []
    for index, (when, _turns, tests) in enumerate(line):
        if index == 0 or tests or not line[index - 1][2]:
            continue  # not a tests 1 -> 0 edge
        for later, turns, more_tests in line[index:]:
            if more_tests:
                break
            if turns >= cap:
                gaps.append(later - when)
                break
    return gaps


def deliver_one_runs_one_waits(machine: Machine) -> None:
    """Deliver to minds a and b while a test run holds a slot: one turn, one test_run hold."""
    deliver(machine, "a", "one")
    deliver(machine, "b", "two")
    wait_for(lambda: len(live_turn_scopes(machine)) == 1)
    wait_for(
        lambda: [r["hold_reason"] for r in queue_rows(machine, "pending")] == ["test_run"],
        timeout=10,
    )


def test_a_test_run_takes_one_place_and_hands_it_back_at_once(machine: Machine) -> None:
    install_probe(machine)
    make_repository(machine)
    minds = [f"m{i}" for i in range(6)]
    start_gate(
        machine,
        gate_config(dict.fromkeys(minds, "turn-probe 0.5"), adaptive=False, limits=COUNTING),
    )
    sampler = Sampler(machine)

    # A run in flight before any delivery: the stream must then get one turn at a time.
    first = start_test_run(machine, 4, "run0")
    wait_for(lambda: one_run_registered(machine), timeout=20)
    entry = repository_entry(machine)
    assert entry is not None
    assert entry["slots"] == 1
    runs = entry["runs"]
    assert isinstance(runs, list) and len(runs) == 1
    assert runs[0]["worktree"] == WORKTREE
    assert "sleep 4" in str(runs[0]["command"])
    assert str(runs[0]["unit"]).startswith("volute-test-wt1-")
    assert float(runs[0]["running_s"]) >= 0
    stream = start_stream(machine, minds)
    wait_for(
        lambda: any(r["hold_reason"] == "test_run" for r in queue_rows(machine, "pending")),
        timeout=20,
    )
    first.communicate(timeout=60)
    assert first.returncode == 0
    # More runs, one after another, while the stream goes on: each hand-back is timed.
    for number in range(1, 5):
        time.sleep(1.0)  # let the freed place fill with a turn
        run = start_test_run(machine, 2, f"run{number}")
        run.communicate(timeout=60)
        assert run.returncode == 0
    time.sleep(1.0)
    stop_stream(machine, stream)
    wait_for(lambda: all_settled(machine), timeout=120, interval=0.3)
    seen = sampler.stop()
    line = timeline(seen)

    assert seen["max_tests"] == 1
    assert seen["max_turns"] == 2  # the budget was used in full between runs
    # The first run started before the stream: at most 1 turn for all of it.
    first_run = [point for point in line if point[2]][:1]
    assert first_run
    first_end = next(when for when, _, tests in line if when > first_run[0][0] and not tests)
    assert max(t for w, t, _ in line if first_run[0][0] <= w < first_end) <= 1
    # The later runs start while 2 turns may run (the gate never stops a turn); once
    # those have had time to end (0.5 s turns), never more than 1 beside a run.
    assert turns_while_tests_run(line, settle=0.8) <= 1
    gaps = handoffs(line)
    assert len(gaps) >= 3, line
    median_ms = statistics.median(gaps) * 1000
    print(f"\nhand-back after a test run ends: median {median_ms:.1f} ms, all {gaps}")
    assert max(gaps) < 1.0
    # Holds were holds: no delivery gained an attempt, and the reason said why.
    done = queue_rows(machine, "done")
    assert done and all(row["attempts"] == 0 for row in done)
    assert gate_events(machine, "VOLUTE_EVENT=hold", "VOLUTE_REASON=test_run")


def test_sigkill_of_a_test_run_frees_the_budget_at_once(machine: Machine) -> None:
    install_probe(machine)
    make_repository(machine)
    start_gate(
        machine,
        gate_config({"a": "turn-probe 6", "b": "turn-probe 6"}, adaptive=False, limits=COUNTING),
    )
    run = start_test_run(machine, 60)
    wait_for(lambda: one_run_registered(machine), timeout=20)
    sampler = Sampler(machine)
    deliver_one_runs_one_waits(machine)
    time.sleep(0.3)
    assert len(live_turn_scopes(machine)) == 1  # held, not started
    scope = live_test_scopes(machine)[0]
    killed_at = time.time()
    machine.run(["systemctl", "kill", "-s", "KILL", scope])
    wait_for(lambda: len(live_turn_scopes(machine)) == 2, timeout=10, interval=0.01)
    run.communicate(timeout=30)
    assert run.returncode == 137  # 128 + SIGKILL, the command's own status
    seen = sampler.stop()
    line = timeline(seen)
    gaps = handoffs(line)
    assert gaps, line
    print(
        f"\nafter SIGKILL: second turn {gaps[0] * 1000:.1f} ms after the test scope went, "
        f"{(line[-1][0] - killed_at) * 1000:.0f} ms after the kill command"
    )
    assert gaps[0] < 1.0
    assert slots_held(machine) == 0


def test_a_restarted_gate_finds_the_runs_in_flight(machine: Machine) -> None:
    install_probe(machine)
    make_repository(machine)
    start_gate(
        machine,
        gate_config({"a": "turn-probe 3", "b": "turn-probe 3"}, adaptive=False, limits=COUNTING),
    )
    run = start_test_run(machine, 60)
    wait_for(lambda: one_run_registered(machine), timeout=20)
    registry = machine.host_path("/var/lib/volute/repositories.json").read_text()
    assert {"path": COMMON_DIR, "uid": 0} in json.loads(registry)["repositories"]
    machine.run(["systemctl", "restart", "volute-gate.service"])
    assert slots_held(machine) == 1  # the first answer after the restart already knows
    sampler = Sampler(machine)
    deliver_one_runs_one_waits(machine)
    machine.run(["systemctl", "kill", "-s", "TERM", live_test_scopes(machine)[0]])
    run.communicate(timeout=30)
    wait_for(lambda: all_settled(machine), timeout=30)
    seen = sampler.stop()
    assert seen["max_turns"] == 2
    assert turns_while_tests_run(timeline(seen)) <= 1


def test_a_missing_repository_is_logged_once_and_the_gate_works(machine: Machine) -> None:
    install_probe(machine)
    make_repository(machine)
    config = gate_config(
        {"a": "turn-probe 0.2"},
        adaptive=False,
        limits=COUNTING,
        tests={"repositories": ["/srv/nowhere", WORKTREE]},
    )
    start_gate(machine, config)
    # The configured worktree is watched from the start, before any run registers it.
    wait_for(lambda: slots_held(machine) == 0, timeout=10)
    for number in range(3):  # slot events wake the gate; the log stays at one line
        run = start_test_run(machine, 0.2, f"r{number}")
        run.communicate(timeout=30)
        assert run.returncode == 0
    first = deliver(machine, "a", "hello")
    wait_for(lambda: all_settled(machine), timeout=30)
    assert [int(r["id"]) for r in queue_rows(machine, "done")] == [first]
    log = journal(machine)
    assert len(gate_events(machine, "VOLUTE_REPOSITORY=/srv/nowhere")) == 1, log
    assert "Traceback" not in log


WATCH_SCRIPT = r"""
import json, select, sys, time
from pathlib import Path
from volutectl.slots.watch import SlotWatch

watch = SlotWatch([Path(sys.argv[1])], Path("/var/tmp/registry.json"), lambda event: None)
open("/var/tmp/watch.ready", "w").close()
events = []
deadline = time.monotonic() + 60
while time.monotonic() < deadline and len(events) < 2:
    if select.select([watch.fileno()], [], [], 1)[0] and watch.on_ready():
        events.append((time.time(), [str(h.slot) for h in watch.held()]))
print(json.dumps(events))
"""


def test_the_watch_sees_a_real_run_in_a_container(machine: Machine) -> None:
    """SlotWatch alone, no gate: a `volutectl test` run in a scope, on the container's
    overlayfs (lock device != st_dev) and in its own PID namespace."""
    make_repository(machine)
    machine.write("/var/tmp/watch.py", WATCH_SCRIPT)
    watcher = machine.popen(
        [PYTHON, "/var/tmp/watch.py", WORKTREE],
        stdout=subprocess.PIPE,
        env={"PYTHONPATH": str(CHECKOUT)},
    )
    wait_for(lambda: machine.host_path("/var/tmp/watch.ready").exists(), timeout=20)
    run = start_test_run(machine, 1.0)
    run.communicate(timeout=30)
    out, _ = watcher.communicate(timeout=30)
    events = json.loads(out)
    assert [held for _, held in events] == [[f"{COMMON_DIR}/volute/test-slots/slot-1"], []]
    stamps = dict(
        line.split() for line in machine.host_path("/var/tmp/run.log").read_text().splitlines()
    )
    started, ended = int(stamps["start"]) / 1e9, int(stamps["end"]) / 1e9
    assert events[0][0] <= started + 0.5  # seen held by the time its command began
    print(f"\nslot seen free {1000 * (events[1][0] - ended):.1f} ms after the command ended")
    assert 0 <= events[1][0] - ended < 1.0
