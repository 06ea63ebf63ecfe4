"""volutectl/kernel/written.py: what a running turn's processes have written so far, from
the kernel's own files: real processes writing to this machine's disk, and a made-up
/proc and cgroup tree for the hierarchies this machine does not have."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from volutectl.kernel import written
from volutectl.kernel.dirfds import Budget
from volutectl.kernel.written import cgroup_of, cgroup_written, descendants, scope_processes

UNIT = "volute-turn-m-7.scope"


def fake_process(proc: Path, pid: int, cgroup: str, write_bytes: int, children: str = "") -> None:
    (proc / str(pid) / "task" / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "task" / str(pid) / "children").write_text(children)
    (proc / str(pid) / "cgroup").write_text(cgroup)
    (proc / str(pid) / "io").write_text(
        f"rchar: 1\nwchar: 2\nread_bytes: 0\nwrite_bytes: {write_bytes}\ncancelled_write_bytes: 0\n"
    )


HYBRID = (
    "12:cpu,cpuacct:/volute.slice/volute-turns.slice\n"
    f"1:name=systemd:/volute.slice/volute-turns.slice/{UNIT}\n"
    f"0::/volute.slice/volute-turns.slice/{UNIT}\n"
)
UNIFIED = f"0::/volute.slice/volute-turns.slice/{UNIT}\n"


def test_the_cgroup_is_the_systemd_hierarchys_on_hybrid_and_the_unified_one_else(
    tmp_path: Path,
) -> None:
    fake_process(tmp_path, 10, HYBRID, 0)
    fake_process(tmp_path, 11, UNIFIED, 0)
    assert (
        cgroup_of(10, tmp_path)
        == cgroup_of(11, tmp_path)
        == f"/volute.slice/volute-turns.slice/{UNIT}"
    )
    assert cgroup_of(12, tmp_path) is None  # gone


def test_a_scope_is_every_process_of_its_cgroup_on_either_hierarchy(tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    for pid, amount in ((10, 1000), (20, 30_000), (21, 500)):
        fake_process(proc, pid, HYBRID, amount)
    scope = root / "systemd" / "volute.slice" / "volute-turns.slice" / UNIT
    scope.mkdir(parents=True)
    (scope / "cgroup.procs").write_text("10\n20\n21\n")
    assert scope_processes(10, UNIT, proc, root) == [10, 20, 21]
    assert cgroup_written(10, UNIT, proc, root) == written.Written(31_500, False)
    # A listed process gone before its read is missed; the rest still count.
    (scope / "cgroup.procs").write_text("10\n20\n21\n99\n")
    assert cgroup_written(10, UNIT, proc, root) == written.Written(31_500, False)


def test_a_process_not_in_its_scope_is_read_with_what_runs_below_it(tmp_path: Path) -> None:
    # No scope of its own (a turn started without systemd): its cgroup is somebody
    # else's too, so only it and its descendants count, never the whole cgroup's.
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    other = "1:name=systemd:/user.slice/session-1.scope\n"
    fake_process(proc, 10, other, 100, children="11 12")
    fake_process(proc, 11, other, 200, children="13")
    fake_process(proc, 12, other, 300)
    fake_process(proc, 13, other, 400)
    fake_process(proc, 14, other, 1 << 30)  # in the same cgroup, not below it
    session = root / "systemd" / "user.slice" / "session-1.scope"
    session.mkdir(parents=True)
    (session / "cgroup.procs").write_text("10\n11\n12\n13\n14\n")
    assert sorted(descendants(10, proc)) == [10, 11, 12, 13]
    assert cgroup_written(10, UNIT, proc, root) == written.Written(1000, False)


def test_a_scope_is_busy_when_a_thread_of_one_of_its_processes_waits_on_the_disk_or_runs(
    tmp_path: Path,
) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    fake_process(proc, 10, HYBRID, 0)
    fake_process(proc, 11, HYBRID, 0)
    scope = root / "systemd" / "volute.slice" / "volute-turns.slice" / UNIT
    scope.mkdir(parents=True)
    (scope / "cgroup.procs").write_text("10\n11\n")
    (proc / "10" / "task" / "10" / "stat").write_text("10 (sh) S 1 10 10 0\n")
    # A command name with spaces and a ")" of its own: the state follows the last ")".
    (proc / "11" / "task" / "11" / "stat").write_text("11 (my (odd) writer) S 10 10 10 0\n")
    (proc / "11" / "task" / "12").mkdir()
    (proc / "11" / "task" / "12" / "stat").write_text("12 (fsync D) S 10 10 10 0\n")
    assert cgroup_written(10, UNIT, proc, root) == written.Written(0, False)  # all asleep
    (proc / "11" / "task" / "12" / "stat").write_text("12 (fsync D) D 10 10 10 0\n")
    assert cgroup_written(10, UNIT, proc, root) == written.Written(0, True)  # on the disk
    # Running, or queued for a CPU: a writer still on its way to its first write.
    (proc / "11" / "task" / "12" / "stat").write_text("12 (fsync D) R 10 10 10 0\n")
    assert cgroup_written(10, UNIT, proc, root) == written.Written(0, True)


def test_a_cgroup_path_that_climbs_is_not_followed(tmp_path: Path) -> None:
    assert written.procs_file(f"/../../etc/{UNIT}", tmp_path) is None


def test_nothing_readable_is_none_not_zero(tmp_path: Path) -> None:
    assert cgroup_written(4_000_000, UNIT, tmp_path, tmp_path) is None


def test_a_real_process_and_its_children_as_they_write(tmp_path: Path) -> None:
    # The test's own disk (write_bytes counts what goes to storage; ext4 here). The shell
    # runs a child that writes 1 MiB and ends (reaped: its bytes become the shell's),
    # then another that writes and stays: both count while the shell runs.
    go = tmp_path / "go"
    script = (
        f"head -c 1048576 /dev/zero > {tmp_path}/a; "
        f"(head -c 524288 /dev/zero > {tmp_path}/b; while [ ! -e {go} ]; do sleep 0.05; done) & "
        f"while [ ! -e {go} ]; do sleep 0.05; done; wait"
    )
    shell = subprocess.Popen(["sh", "-c", script])
    try:
        deadline = time.monotonic() + 10
        amount = 0
        while time.monotonic() < deadline:
            seen = cgroup_written(shell.pid, UNIT)
            amount = seen.bytes if seen is not None else 0
            if amount >= (1 << 20) + (1 << 19):
                break
            time.sleep(0.05)
        assert amount >= (1 << 20) + (1 << 19)
        assert len(descendants(shell.pid)) >= 2  # the shell, and its child that waits
    finally:
        go.touch()
        shell.wait(timeout=10)
    assert cgroup_written(shell.pid, UNIT) is None  # reaped: gone
    assert os.path.getsize(tmp_path / "a") == 1 << 20


def test_a_scope_too_big_to_read_within_the_budget_is_not_shown_quiet(tmp_path: Path) -> None:
    # A mind decides how many processes and threads its scope holds; the launcher reads
    # within a budget, and what it could not read may have written: not quiet.
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    scope = root / "systemd" / "volute.slice" / "volute-turns.slice" / UNIT
    scope.mkdir(parents=True)
    for pid in range(10, 30):
        fake_process(proc, pid, HYBRID, 100)
    (scope / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in range(10, 30)))
    # All of it, in the entries a sample may read: the time is not what this reads, and
    # the sample's 50 ms ran out once under CI's load (two burners beside four workers).
    enough = Budget(entries=written.SAMPLE_READS, seconds=60)
    whole = cgroup_written(10, UNIT, proc, root, budget=enough)
    assert whole == written.Written(2000, False)
    short = cgroup_written(10, UNIT, proc, root, budget=Budget(entries=15, seconds=10))
    assert short is not None and short.blocked and short.bytes < 2000
    late = cgroup_written(10, UNIT, proc, root, budget=Budget(entries=10_000, seconds=0))
    assert late is None or late.blocked  # no time at all: nothing shown quiet


def test_a_real_process_asleep_is_quiet_and_one_that_spins_is_busy(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    spinner = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        deadline = time.monotonic() + 10
        seen = cgroup_written(sleeper.pid, UNIT)
        while (seen is None or seen.blocked) and time.monotonic() < deadline:
            time.sleep(0.05)  # until it has exec'd and gone to sleep
            seen = cgroup_written(sleeper.pid, UNIT)
        assert seen is not None and not seen.blocked
        busy = cgroup_written(spinner.pid, UNIT)
        assert busy is not None and busy.blocked
    finally:
        for process in (sleeper, spinner):
            process.kill()
            process.wait(timeout=10)
