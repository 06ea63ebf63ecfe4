"""A fan-out's turns as the slow-disk runs see them: each turn command logs its own start
and end, so how many ran at once and when the last one ended come from the turns
themselves, not from the gate.

The log lives inside the machine on its tmpfs (not on the slow disk, which it would
load). Used by bench/replay_incident.py and bench/bench_adaptive.py.
"""

from __future__ import annotations

from pathlib import Path

from volute_testbed.machine import Machine

TURN_LOG = "/var/tmp/fanout-turns.log"  # inside the machine

Span = tuple[float, float]  # (start, end) in wall-clock seconds


def logged_turn(body: str, log: str = TURN_LOG) -> str:
    """A turn command (sh) that runs `body` between a start and an end line in `log`."""
    return (
        f'echo "start $VOLUTE_MIND $(date +%s.%N)" >> {log}; '
        f"{body}; "
        f'echo "end $VOLUTE_MIND $(date +%s.%N)" >> {log}'
    )


def synced_writes(mount: Path, count: int) -> str:
    """`count` 64 KiB writes, each synced (O_DSYNC), to a file of the turn's own, removed
    after: a fixed amount of work, so a turn that overlaps others takes longer."""
    target = f"{mount}/w.$VOLUTE_MIND.$$"
    return (
        f"dd if=/dev/zero of={target} bs=64k count={count} oflag=dsync status=none; rm -f {target}"
    )


def reset_turn_log(machine: Machine, log: str = TURN_LOG) -> None:
    """An empty log that the turns' users may append to."""
    machine.write(log, "", mode=0o666)


def turn_times(machine: Machine, log: str = TURN_LOG) -> tuple[dict[str, float], dict[str, float]]:
    """Each mind's turn start and end (wall clock) so far, from the log."""
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    path = machine.host_path(log)
    if not path.exists():
        return starts, ends
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) == 3:
            (starts if fields[0] == "start" else ends)[fields[1]] = float(fields[2])
    return starts, ends


def running_at_once(starts: dict[str, float], ends: dict[str, float]) -> list[tuple[float, int]]:
    """The number of turns running after each start or end, in time order."""
    events = sorted(
        [(t, 1) for t in starts.values()] + [(t, -1) for t in ends.values()],
        key=lambda event: (event[0], event[1]),
    )
    running = 0
    steps = []
    for when, step in events:
        running += step
        steps.append((when, running))
    return steps


def max_overlap(starts: dict[str, float], ends: dict[str, float]) -> int:
    """The most turns that ran at once."""
    return max((running for _, running in running_at_once(starts, ends)), default=0)
