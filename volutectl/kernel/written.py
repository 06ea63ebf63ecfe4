"""What a running turn has written to storage so far: the evidence a cold gate's
adaptive limit needs before a turn ends (volutectl/core/iocost.py's `Running`).

A turn's rusage (`ru_oublock`, read when the launcher reaps its wrapper:
volutectl/kernel/processes.py's `poll_written`) says what it wrote only once it has
ended. While it runs, each process's `/proc/PID/io` `write_bytes` says what that process
has caused to be written to storage, its reaped children's included; the turn is every
process of its scope's cgroup. So `cgroup_written` sums `write_bytes` over the processes
listed in the cgroup of the turn's main process (the wrapper, the launcher's own unreaped
child, so its PID cannot be reused meanwhile), once that cgroup is the turn's scope;
else over the main process and those below it.

It works on every hierarchy: the scope's cgroup is read from the `name=systemd` line of
`/proc/PID/cgroup` (legacy and hybrid, as in the test containers, where the blkio
controller gives a scope no numbers), else its unified line. Reading another user's
`/proc/PID/io` needs root (ptrace's read check): the root launcher does it, never the gate.

The sum is an estimate, not an account: a process that exits between the listing and its
read is missed until its parent reaps it (then its bytes are the parent's), and one
reaped by a process outside the scope is missed for good (a daemonized grandchild).
It is read only to pace admission; systemd's IOWeight= and the limits of the turn's
scope are what bound a turn's IO.

Every path here is the kernel's: /proc and the cgroup file system, which no turn can
put a link into.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from volutectl.core.pidmoves import parse_systemd_cgroup
from volutectl.kernel.dirfds import Budget

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
MAX_PROCESSES = 4096  # read at most this many of a scope's processes
SAMPLE_READS = 8192  # and at most this many files of one turn's, in all...
SAMPLE_SECONDS = 0.05  # ...within this long


def sample_budget() -> Budget:
    """What one turn's sample may read."""
    return Budget(SAMPLE_READS, SAMPLE_SECONDS)


def cgroup_of(pid: int, proc: Path = PROC) -> str | None:
    """The path of `pid`'s systemd cgroup, relative to its hierarchy's root."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    return parse_systemd_cgroup(text)


def procs_file(cgroup: str, root: Path = CGROUP_ROOT) -> Path | None:
    """The cgroup.procs of `cgroup`: in the name=systemd hierarchy if mounted (legacy and
    hybrid), else in the unified one at the root."""
    relative = cgroup.lstrip("/")
    if ".." in Path(relative).parts:
        return None
    for base in (root / "systemd", root / "unified", root):
        candidate = base / relative / "cgroup.procs"
        if candidate.is_file():
            return candidate
    return None


def write_bytes(pid: int, proc: Path = PROC) -> int | None:
    """`write_bytes` of /proc/PID/io (the process and its reaped children); None if gone."""
    try:
        text = (proc / str(pid) / "io").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "write_bytes":
            with contextlib.suppress(ValueError):
                return int(value)
    return None


def _tasks(pid: int, proc: Path, budget: Budget) -> list[Path]:
    """The task directories of `pid`, as many as `budget` lets read."""
    found: list[Path] = []
    try:
        for task in (proc / str(pid) / "task").iterdir():
            if not budget.spend():
                break
            found.append(task)
    except OSError:
        pass
    return found


def descendants(pid: int, proc: Path = PROC, budget: Budget | None = None) -> list[int]:
    """`pid` and the processes below it, from each task's `children` file (at most
    MAX_PROCESSES of them, within `budget`)."""
    budget = budget if budget is not None else sample_budget()
    found = [pid]
    index = 0
    while index < len(found) and len(found) < MAX_PROCESSES:
        parent = found[index]
        index += 1
        for task in _tasks(parent, proc, budget):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            found.extend(int(child) for child in children if child.isdigit())
    return found[:MAX_PROCESSES]


def scope_processes(
    pid: int,
    unit: str,
    proc: Path = PROC,
    root: Path = CGROUP_ROOT,
    budget: Budget | None = None,
) -> list[int]:
    """The processes of the scope `unit` that `pid` runs in: its cgroup's, when that is
    `unit`'s; else `pid` and the processes below it (a process not in a scope of its
    own, as a turn started without systemd, would be charged its whole cgroup's)."""
    cgroup = cgroup_of(pid, proc)
    procs = None
    if cgroup is not None and cgroup.rstrip("/").rpartition("/")[2] == unit:
        procs = procs_file(cgroup, root)
    if procs is None:
        return descendants(pid, proc, budget)
    try:
        listed = procs.read_text().split()
    except OSError:
        return descendants(pid, proc, budget)
    return [int(text) for text in listed[:MAX_PROCESSES] if text.isdigit()]


# The task states in which a turn is busy, not quiet: D, asleep uninterruptibly (waiting
# on the disk: a write, an fsync, an open that waits for the file system's journal), and
# R, running or waiting for a CPU (a program still starting: a shell about to exec its
# writer, an interpreter importing). A quiet turn's tasks all sleep (S), waiting on
# something that is not the disk: the network, a timer, a child.
BUSY_STATES = ("D", "R")


def busy(pid: int, proc: Path = PROC, budget: Budget | None = None) -> bool:
    """Whether a thread of `pid` is busy now (BUSY_STATES): waiting on the disk, or
    running. A sample that finds a turn so before it has shown anything does not judge
    it quiet: on the SD card a heavy writer still starting, or queued for the cores, had
    written nothing at its first sample, was priced at a sixteenth of a place for an
    interval, and let more writers in (issue 32: four at once, the probe at 300 ms)."""
    budget = budget if budget is not None else sample_budget()
    for task in _tasks(pid, proc, budget):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        # "TID (COMM) STATE ...": COMM may hold spaces and parentheses; the last ")" ends it.
        fields = stat[stat.rfind(")") + 1 :].split()
        if fields and fields[0] in BUSY_STATES:
            return True
    return False


@dataclass(frozen=True)
class Written:
    """What a scope's processes have written so far, and whether one of them is busy
    right now (`busy`: a turn that has written nothing yet, but is blocked on
    its first write or the open before it, or still running its way to it, is no quiet
    turn)."""

    bytes: int
    blocked: bool


def cgroup_written(
    pid: int,
    unit: str,
    proc: Path = PROC,
    root: Path = CGROUP_ROOT,
    budget: Budget | None = None,
) -> Written | None:
    """What the processes of the scope `unit`, which `pid` runs in, have written to
    storage so far; None if none could be read (gone, or not ours to look at). Within
    a budget of reads and time (`sample_budget`): the launcher answers the gate's
    sample in its one loop, and a mind decides how many processes its scope holds."""
    budget = budget if budget is not None else sample_budget()
    total = 0
    seen = blocked = False
    for process in scope_processes(pid, unit, proc, root, budget):
        if not budget.spend():
            break
        written = write_bytes(process, proc)
        if written is not None:
            total += written
            seen = True
            blocked = blocked or busy(process, proc, budget)
    if budget.spent():
        # Not every process was read (a scope of thousands of processes or threads, or
        # a slow read): what was read may be short, so the turn is not shown quiet.
        blocked = True
    return Written(total, blocked) if seen else None
