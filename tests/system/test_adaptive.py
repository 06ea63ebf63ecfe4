"""The adaptive limit (limits.adaptive, on by default) on a real systemd: it moves, and
`status --json`, STATUS= and the journal say so; a gate restarted or SIGKILLed while it is
raised starts again at `start` and loses and repeats nothing; a PSI file that turns to
garbage under the running gate holds it to `start`, and status, the journal and
`volutectl doctor` say so.

The slow-disk test (a fan-out of synced writers under the default config keeps a probe
of the same disk within cap 2's bound) is tests/system/test_adaptive_disk.py.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from volute_testbed.faults import assert_exactly_once, fast_restarts, first_status, gate_pid
from volute_testbed.gate import (
    VOLUTECTL,
    all_settled,
    gate_config,
    gate_events,
    install_probe,
    queue_rows,
    start_gate,
    status,
    turn_log,
    unit_property,
    wait_for,
)
from volute_testbed.machine import Machine, dev_machine

pytestmark = [pytest.mark.system, pytest.mark.serial]

START = 2  # limits.adaptive.start's default
# STATUS= with the adaptive limit as the cap: "3/4 turns (adaptive limit), 9 held ..."
STATUS_LINE = re.compile(r"^(\d+)/(\d+) turns \(adaptive limit\)")
CHANGED = "VOLUTE_EVENT=adaptive_limit_changed"
CHANGED_ID = "78ac394cee0541889f41bad11b6f8d7c"  # docs/journal.md
FALLBACK_ID = "1016b81a25c94289a853e7e24964d033"


def network_bound(count: int, seconds: float) -> dict[str, str]:
    """Minds whose turns wait (on "the model's API") and write next to nothing."""
    return {f"n{i:02d}": f"turn-probe {seconds}" for i in range(count)}


def fan_out(machine: Machine, minds: dict[str, str]) -> list[int]:
    """One delivery to each mind, all at once (one shell, the clients in parallel)."""
    script = " ".join(
        f"{VOLUTECTL} deliver {mind} --message wake > /var/tmp/id.{mind} &" for mind in minds
    )
    machine.sh(f"{script} wait")
    return [int(machine.host_path(f"/var/tmp/id.{mind}").read_text()) for mind in minds]


def adaptive_status(machine: Machine) -> dict[str, Any]:
    result: dict[str, Any] = status(machine)["adaptive"]
    return result


def status_line_limit(machine: Machine) -> int | None:
    """The limit STATUS= shows (systemctl show -p StatusText), None without one."""
    match = STATUS_LINE.match(unit_property(machine, "volute-gate.service", "StatusText"))
    return int(match.group(2)) if match else None


def writers_that_wait(count: int, seconds: float, disk: Path) -> dict[str, str]:
    """Minds whose turns write 256 KiB, synced, to `disk` (a writer: a whole place),
    and then wait."""
    write = f"dd if=/dev/zero of={disk}/w.$VOLUTE_MIND.$$ bs=64k count=4 oflag=dsync status=none"
    return {f"w{i:02d}": f"{write}; turn-probe {seconds}" for i in range(count)}


def test_status_the_status_line_and_the_journal_show_the_limit_rising_while_writers_wait(
    disk_machine: tuple[Machine, Path],
) -> None:
    """Sixteen turns that write 256 KiB to the host's own (quick) disk and wait 3 s:
    each costs a whole place (a writer), so deliveries wait at the limit while the disk
    stays healthy, and it grows past `start` within a few intervals; each of the three
    views shows it. (Turns that write nothing cost a sixteenth once sampled: 16 of them
    fit the start value, and it need not grow.) The gate starts before the turns slice
    does, as at boot: it must read the slice's PSI files once the first turn makes
    them, not the host's for good (a CPU burner beside it held the limit at `start`)."""
    machine, disk = disk_machine
    install_probe(machine)
    minds = writers_that_wait(16, 3.0, disk)
    start_gate(machine, gate_config(minds, adaptive=True))  # the default: no cap, adaptive
    at_rest = adaptive_status(machine)
    assert (at_rest["mode"], at_rest["limit"], at_rest["ceiling"]) == ("adaptive", START, None)
    assert status_line_limit(machine) == START  # STATUS=: 0/2 turns (adaptive limit)

    acked = fan_out(machine, minds)
    seen_status: list[int] = []
    seen_line: list[int] = []

    def raised_in_both() -> bool:
        seen_status.append(int(adaptive_status(machine)["limit"]))
        line = status_line_limit(machine)
        if line is not None:
            seen_line.append(line)
        return max(seen_status) > START and max(seen_line, default=0) > START

    wait_for(raised_in_both, timeout=30, interval=0.1)
    wait_for(lambda: all_settled(machine), timeout=90, interval=0.3)

    assert_exactly_once(turn_log(machine), acked)
    assert sorted(int(r["id"]) for r in queue_rows(machine, "done")) == sorted(acked)
    changes = gate_events(machine, CHANGED)
    assert changes, "no adaptive_limit_changed entry in the journal"
    assert {str(entry["MESSAGE_ID"]) for entry in changes} == {CHANGED_ID}
    first = changes[0]
    assert int(str(first["VOLUTE_OLD_LIMIT"])) == START
    assert int(str(first["VOLUTE_NEW_LIMIT"])) > START  # it grew, from the start value
    assert "VOLUTE_PROBE_MS" in first and "VOLUTE_BASELINE_MS" in first  # the measurement
    # Rate-limited: at most one entry every 5 s (docs/journal.md), however often it moved.
    stamps = [int(str(entry["__MONOTONIC_TIMESTAMP"])) / 1e6 for entry in changes]
    gaps = [later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False)]
    assert all(gap >= 4.9 for gap in gaps), stamps


CPU_CHANGED = "VOLUTE_EVENT=cpu_limit_changed"


def test_the_cpus_bound_grows_for_turns_that_leave_the_cpus_idle_as_the_slice_shows(
    machine: Machine,
) -> None:
    """The CPUs' bound grows no further than the CPUs hold at what each turn uses, read
    from the real turns slice's cpu.stat: turns that only wait use next to none of it,
    so the bound grows past one per CPU, straight to what the CPUs hold at that use,
    and the journal says what they used."""
    install_probe(machine)
    minds = network_bound(12, 3.0)
    start_gate(machine, gate_config(minds, adaptive=True))
    acked = fan_out(machine, minds)
    wait_for(lambda: bool(gate_events(machine, CPU_CHANGED)), timeout=30, interval=0.2)
    wait_for(lambda: all_settled(machine), timeout=90, interval=0.3)
    assert_exactly_once(turn_log(machine), acked)
    first = gate_events(machine, CPU_CHANGED)[0]
    cpus = int(machine.run(["nproc"]).stdout)
    assert int(str(first["VOLUTE_OLD_LIMIT"])) == min(16, max(1, cpus))  # one per CPU
    assert int(str(first["VOLUTE_NEW_LIMIT"])) > int(str(first["VOLUTE_OLD_LIMIT"]))
    # Read from the slice (absent if its cpu.stat was not), and next to nothing.
    assert "VOLUTE_CPUS_USED" in first, first
    used = float(str(first["VOLUTE_CPUS_USED"]))  # rounded to 0.1
    assert used < 0.5 * cpus
    # Before any stall it grows straight to the room those turns leave, not by doubling:
    # the room is the CPUs over what each turn used per second it ran, and the turns
    # that filled the old bound ran for half the interval at least (core/cpu.py), so it
    # is at least cpus x old / (2 x used): at next to no use the maximum (16), where
    # doubling would give 2 x old.
    old, new = int(str(first["VOLUTE_OLD_LIMIT"])), int(str(first["VOLUTE_NEW_LIMIT"]))
    assert new >= min(16, int(cpus * old / (2 * used + 0.05))), first


@pytest.fixture
def disk_machine(request: pytest.FixtureRequest) -> Iterator[tuple[Machine, Path]]:
    """A machine with a directory of the host's disk bound in: the machine's own files
    sit on an overlay whose upper layer is a tmpfs, where writes reach no storage and
    `write_bytes` stays 0."""
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="vt-disk-") as directory:
        os.chmod(directory, 0o1777)
        with dev_machine(name="vt-adaptive-costs", binds=[directory]) as booted:
            yield booted, Path(directory)


@pytest.mark.parametrize("how", ["restart", "sigkill"])
def test_a_gate_restarted_while_the_limit_is_raised_starts_at_start_and_loses_nothing(
    disk_machine: tuple[Machine, Path], how: str
) -> None:
    """The limit is not kept: the gate that comes back after `systemctl restart` (SIGTERM)
    or a SIGKILL of its whole cgroup answers `start` at once, adopts the turns running
    over it (none is stopped), and every delivery settles exactly once.

    The turns write 256 KiB first, to the host's own (quick) disk bound in, then wait:
    writers, each a whole place of the limit, so deliveries wait at it while the disk
    stays healthy, and it grows (turns that only wait cost a sixteenth once sampled, and
    would never fill the limit for it to grow). interval_seconds = 2 (the default is
    0.5) so that the new gate's first reading, the earliest it may move, comes well
    after the first `status` it answers, even on a loaded machine."""
    machine, disk = disk_machine
    install_probe(machine)
    fast_restarts(machine)
    write = f"dd if=/dev/zero of={disk}/w.$$ bs=64k count=4 oflag=dsync status=none"
    minds = {mind: f"{write}; {command}" for mind, command in network_bound(14, 6.0).items()}
    sections: dict[str, Mapping[str, object]] = {
        "limits.adaptive": {"start": START, "interval_seconds": 2.0}
    }
    start_gate(machine, gate_config(minds, adaptive=True, **sections))
    acked = fan_out(machine, minds)
    wait_for(lambda: adaptive_status(machine)["limit"] > START, timeout=30, interval=0.1)
    raised = int(adaptive_status(machine)["limit"])
    first = gate_pid(machine)
    if how == "restart":
        machine.run(["systemctl", "restart", "volute-gate.service"], timeout=60)
    else:
        machine.run(["systemctl", "kill", "--signal=SIGKILL", "volute-gate.service"])
    wait_for(lambda: gate_pid(machine) not in (0, first), timeout=30, interval=0.05)
    again = first_status(machine)["adaptive"]
    assert (again["mode"], again["limit"]) == ("adaptive", START), (raised, again)
    # What the new gate says first in the journal moves from the start value, too.
    later = gate_events(machine, CHANGED, f"_PID={gate_pid(machine)}")
    assert all(int(str(e["VOLUTE_OLD_LIMIT"])) <= raised for e in later)
    if later:
        assert int(str(later[0]["VOLUTE_OLD_LIMIT"])) == START, later[0]

    wait_for(lambda: all_settled(machine), timeout=120, interval=0.3)
    assert_exactly_once(turn_log(machine), acked)
    rows = queue_rows(machine, "done")
    assert sorted(int(r["id"]) for r in rows) == sorted(acked)
    assert all(r["attempts"] == 0 for r in rows), rows  # a restart is never a turn's failure


# Visible in the gate's own mount namespace (its /tmp and /var/tmp are private).
GARBAGE = "/etc/volute/psi-garbage"


def psi_files(machine: Machine) -> list[str]:
    """The PSI files the gate may read (gate/adaptive.py's pressure_file): the turns
    slice's io.pressure where a cgroup v2 hierarchy has one, and /proc/pressure/io."""
    found = machine.sh(
        "ls -d /sys/fs/cgroup/volute.slice/volute-turns.slice/io.pressure "
        "/sys/fs/cgroup/unified/volute.slice/volute-turns.slice/io.pressure "
        "/proc/pressure/io 2>/dev/null",
        check=False,
    ).stdout.split()
    return [path for path in found if machine.run(["cat", path], check=False).returncode == 0]


def test_a_psi_file_that_turns_to_garbage_under_the_gate_holds_it_to_start_and_says_so(
    machine: Machine,
) -> None:
    """The kernel's PSI files cannot be made to vanish in a container, but a file bound
    over each of them inside the running gate's own mount namespace (nsenter -m; a bind
    in the machine's namespace does not reach the gate's private one) reads as garbage
    to the gate exactly as a broken one would: the gate falls back to `start` and holds
    there reading after reading, `status` says mode "fallback", the journal has one
    adaptive_fallback entry, and `volutectl doctor` warns. Unbound, the files read
    again: the gate measures again (adaptive_measuring) and the queue drains, each
    delivery once."""
    install_probe(machine)
    minds = network_bound(10, 2.0)
    machine.run(["systemctl", "start", "volute-turns.slice"])  # its cgroup, and io.pressure
    start_gate(machine, gate_config(minds, adaptive=True))
    files = psi_files(machine)
    assert "/proc/pressure/io" in files, "no readable PSI in this machine: nothing to break"
    machine.write(GARBAGE, "this is not PSI\n")
    in_gate = ["nsenter", "-t", str(gate_pid(machine)), "-m"]
    for path in files:
        machine.run([*in_gate, "mount", "--bind", GARBAGE, path])
    try:
        seen = [machine.run([*in_gate, "cat", path]).stdout for path in files]
        assert seen == ["this is not PSI\n"] * len(files)
        acked = fan_out(machine, minds)
        wait_for(lambda: adaptive_status(machine)["mode"] == "fallback", timeout=20)
        held: list[dict[str, Any]] = []
        for _ in range(10):  # about 3 s, several intervals: it stays at the start value
            held.append(adaptive_status(machine))
            time.sleep(0.2)
        assert all((s["mode"], s["limit"]) == ("fallback", START) for s in held), held
        assert all(int(status(machine)["active_turns"]) <= START for _ in range(3))
        [fallback] = gate_events(machine, "VOLUTE_EVENT=adaptive_fallback")
        assert fallback["MESSAGE_ID"] == FALLBACK_ID
        assert int(str(fallback["VOLUTE_LIMIT"])) == START
        assert gate_events(machine, "VOLUTE_EVENT=adaptive_measuring") == []
        doctor = json.loads(machine.run([VOLUTECTL, "doctor", "--json"], check=False).stdout)
        [check] = [c for c in doctor["checks"] if c["check"] == "adaptive"]
        assert check["status"] == "warn", check
        assert f"fell back to a static {START}" in check["found"], check
    finally:
        for path in files:
            machine.run([*in_gate, "umount", path], check=False)
    wait_for(
        lambda: bool(gate_events(machine, "VOLUTE_EVENT=adaptive_measuring")),
        timeout=20,
        interval=0.2,
    )
    wait_for(lambda: all_settled(machine), timeout=90, interval=0.3)
    assert_exactly_once(turn_log(machine), acked)


def test_status_shows_what_running_turns_write_as_the_launcher_reads_their_scopes(
    disk_machine: tuple[Machine, Path],
) -> None:
    """The evidence a cold gate ramps on, end to end: the root launcher reads what each
    running turn's processes have written (/proc/PID/io over its real scope's cgroup),
    and `status` shows the costs the gate charges them. A turn that writes 1 MiB with
    O_DSYNC (from a child of its wrapper, in its scope) costs a whole place; turns that
    only wait cost the floor (1/16) once their probation has passed; and no mind has a
    learnt cost until a turn of it ends. All wait on a file, so they run while looked at."""
    machine, disk = disk_machine
    install_probe(machine)
    wait = "while [ ! -e /var/tmp/go ]; do sleep 0.1; done; turn-probe 0"
    minds = {
        "writer": f"dd if=/dev/zero of={disk}/w.$$ bs=64k count=16 oflag=dsync; {wait}",
        **{f"quiet{i}": wait for i in range(3)},
    }
    machine.run(["rm", "-f", "/var/tmp/go"])
    start_gate(machine, gate_config(minds, adaptive=True))
    acked = fan_out(machine, minds)
    expected = {"writer": 1.0} | {f"quiet{i}": 1 / 16 for i in range(3)}
    shown: list[dict[str, float]] = []

    def all_judged() -> bool:
        shown.append(adaptive_status(machine)["running_costs"])
        return shown[-1] == expected

    wait_for(all_judged, timeout=30, interval=0.2)
    assert adaptive_status(machine)["costs"] == {}  # no turn has ended: nothing learnt
    machine.run(["touch", "/var/tmp/go"])
    wait_for(lambda: all_settled(machine), timeout=60, interval=0.3)
    assert_exactly_once(turn_log(machine), acked)
    learnt = adaptive_status(machine)
    assert learnt["running_costs"] == {}
    assert learnt["costs"]["writer"] == 1.0  # its rusage at the end says the same
    assert all(learnt["costs"][f"quiet{i}"] == 1 / 16 for i in range(3)), learnt
