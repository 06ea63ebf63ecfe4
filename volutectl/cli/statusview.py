"""`volutectl status` for people: one aligned table of minds, then the totals.

A row per mind that has something to show: a running turn, pending or dead deliveries,
or a pause. Idle minds are counted in one line instead (30 idle minds would bury the
few that matter); `--all` lists every mind. `volutectl status --json` carries every
configured mind either way. Durations are volutectl/durations.py's one format.

Much of it is others' text: repository paths and worktrees a member registered, test
runs' commands, a refused config's error. Each line goes out with its control
characters shown (volutectl/visible.py), so none can erase, retitle or forge a line of
root's terminal; `--json` carries them exact, in JSON's own escapes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from volutectl.core.slotmath import CONFIG_KEY, GIT_CONFIG_KEY
from volutectl.durations import format_duration
from volutectl.states import AdaptiveMode
from volutectl.visible import visible
from volutectl.wire.messages import (
    AdaptiveStatus,
    ConfigStatus,
    LeaseStatus,
    MindStatus,
    PausedMind,
    RepositoryStatus,
    Status,
)

COLUMNS = ("MIND", "RUNNING", "PENDING", "ATTEMPTS", "NEXT RETRY", "LAST TURN", "DEAD", "PAUSED")
NUMERIC = {"PENDING", "ATTEMPTS", "DEAD"}  # right-aligned


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else format_duration(seconds)


def has_news(mind: MindStatus) -> bool:
    """A row worth a line: it runs, waits, has dead deliveries, or is paused."""
    return bool(mind.running_sessions or mind.pending or mind.dead) or mind.paused_since is not None


def _row(name: str, mind: MindStatus, running: dict[str, list[str]], now: float) -> list[str]:
    last = "-"
    if mind.last_turn_id is not None:
        outcome = mind.last_outcome or "?"
        last = f"{mind.last_turn_id} {outcome}, {_age(mind.last_turn_s)} ago"
    paused = "-" if mind.paused_since is None else _age(now - mind.paused_since)
    return [
        visible(name),
        visible(", ".join(running.get(name, [])) or "-"),
        str(mind.pending),
        str(mind.attempts),
        _age(mind.next_retry_s),
        last,
        str(mind.dead),
        paused,
    ]


def table(rows: Sequence[Sequence[str]], header: Sequence[str] = COLUMNS) -> list[str]:
    """Aligned columns, two spaces apart; numbers to the right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.rjust(width) if name in NUMERIC else cell.ljust(width)
            for cell, width, name in zip(row, widths, header, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _pauses(paused: Sequence[PausedMind], now: float) -> str:
    def since(pause: PausedMind) -> str:
        clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(pause.since))
        return f"since {clock} ({format_duration(now - pause.since)})"

    every = [pause for pause in paused if pause.mind == "*"]
    named = [f"{pause.mind} {since(pause)}" for pause in paused if pause.mind != "*"]
    if every:
        return f"paused: every mind, those configured later included, {since(every[0])}" + (
            f"; by name before that: {', '.join(named)}" if named else ""
        )
    return f"paused: {', '.join(named)}"


def format_status(status: Status, *, every_mind: bool = False, now: float | None = None) -> str:
    now = time.time() if now is None else now
    running: dict[str, list[str]] = {}
    for turn in status.turns:
        running.setdefault(turn.mind, []).append(f"{turn.session} {_age(turn.running_s)}")
    shown = {name: m for name, m in status.minds.items() if every_mind or has_news(m)}
    lines = table([_row(name, mind, running, now) for name, mind in shown.items()])
    if not shown:
        lines = ["no mind runs, waits, has dead deliveries or is paused"]
    idle = len(status.minds) - len(shown)
    if idle:
        lines.append(f"({idle} idle mind{'s' if idle != 1 else ''} not shown: --all shows them)")
    return "\n".join(visible(line) for line in lines + [""] + _totals(status, now))


def _adaptive(adaptive: AdaptiveStatus) -> str:
    """The adaptive limit in one line: its mode, limit, bounds, ceiling and last move."""
    ceiling = f", ceiling {adaptive.ceiling}" if adaptive.ceiling is not None else ""
    if adaptive.mode == AdaptiveMode.STATIC:
        return "adaptive limit: off (static cap)"
    mode = "" if adaptive.mode == AdaptiveMode.ADAPTIVE else f" ({adaptive.mode.upper()})"
    reason = f"; {adaptive.reason}" if adaptive.reason else ""
    return (
        f"adaptive limit{mode}: {adaptive.limit} turns "
        f"({adaptive.minimum}..{adaptive.maximum}{ceiling}){reason}"
    )


def _costs(adaptive: AdaptiveStatus) -> list[str]:
    """What turns cost against the adaptive limit, in places: the running turns' now,
    and each known mind's next turn's (a mind not listed costs a whole place)."""
    parts = []
    if adaptive.running_costs:
        parts.append("running " + _places(adaptive.running_costs))
    if adaptive.costs:
        parts.append("next turn " + _places(adaptive.costs) + " (a mind not listed: 1)")
    return ["io cost per turn: " + "; ".join(parts)] if parts else []


def _disks(adaptive: AdaptiveStatus) -> list[str]:
    """The disks the adaptive limit watches, each with its last interval, and the one
    that held the last reading down."""
    if not adaptive.disks:
        return []
    parts = []
    for disk in adaptive.disks:
        waited = f"await {disk.await_ms:g} ms" if disk.await_ms is not None else "no requests"
        held = " HOLDS THE LIMIT DOWN" if disk.device == adaptive.held_by else ""
        parts.append(
            f"{disk.device} ({', '.join(disk.holds)}): {waited}, "
            f"{disk.utilisation_percent:g}% busy{held}"
        )
    return ["disks watched: " + "; ".join(parts)]


def _places(costs: dict[str, float]) -> str:
    def place(cost: float) -> str:
        return "1" if cost >= 1 else f"1/{round(1 / cost)}"

    return ", ".join(f"{mind} {place(cost)}" for mind, cost in sorted(costs.items()))


def _config(config: ConfigStatus | None, now: float) -> list[str]:
    """A reload the gate refused, and keys that wait for a restart; else nothing."""
    if config is None:
        return []
    lines = []
    if config.refused is not None:
        ago = _age(now - config.refused_at) if config.refused_at is not None else "?"
        lines.append(
            f"config: reload REFUSED {ago} ago, still running the config read "
            f"{_age(now - config.loaded_at)} ago: {config.refused}"
        )
    if config.needs_restart:
        lines.append(
            "config: needs `systemctl restart volute-gate` to apply: "
            + ", ".join(config.needs_restart)
        )
    return lines


def _totals(status: Status, now: float) -> list[str]:
    cap: int | str = status.global_cap if status.global_cap is not None else "no cap"
    adaptive = status.adaptive
    if adaptive is not None and adaptive.limit is not None:
        cap = min(adaptive.limit, status.global_cap or adaptive.limit)
        cap = f"{cap} (adaptive limit)"
    other = f", {status.foreign_scopes} of them other scopes" if status.foreign_scopes else ""
    lines = [
        f"turns: {status.active_turns} running of {cap}{other} "
        f"({status.turns_per_mind} per mind, in {status.slice})"
    ]
    lines.append(_queue_line(status))
    lines += [_lease_line(lease, now) for lease in status.leases]
    if status.paused:
        lines.append(_pauses(status.paused, now))
    for mind, problems in sorted(status.preflight.items()):
        lines.append(f"preflight: mind {mind} cannot start turns: {'; '.join(problems)}")
    if status.adaptive is not None:
        lines.append(_adaptive(status.adaptive))
        lines += _costs(status.adaptive)
        lines += _disks(status.adaptive)
    lines += _config(status.config, now)
    pressure = status.io_pressure
    if pressure.enabled:
        state = f"HIGH ({pressure.reason}): holding new turns" if pressure.high else "ok"
        lines.append(f"io pressure: {state}; {pressure.trigger}")
    for repo in status.test_runs:
        lines.append(_slots_line(repo, status.test_runs_count_as_turns))
        for run in repo.runs:
            lines.append(
                f"  test run: {run.worktree} `{run.command}` "
                f"running {_age(run.running_s)}  ({run.unit})"
            )
    return lines


def _lease_line(lease: LeaseStatus, now: float) -> str:
    """`lease 7: pip/main held by uid 1001 for 12.0s in volute-turn-pip-12.scope`, or
    `lease 8: whorl/main waiting (global_cap) for 3.0s, uid 1001`."""
    age = _age(now - lease.since) if lease.since else "-"
    who = f"lease {lease.lease}: {lease.mind}/{lease.session}"
    if lease.state == "waiting":
        reason = f" ({lease.reason})" if lease.reason is not None else ""
        return f"{who} waiting{reason} for {age}, uid {lease.uid}"
    joined = "" if lease.created else ", joined"
    how = "held" if lease.state == "held" else "waiting for its claim after a restart,"
    return f"{who} {how} by uid {lease.uid} for {age} in {lease.unit}{joined}"


def _queue_line(status: Status) -> str:
    """`queue: 5 pending (2 backing off; held: 3 global_cap), oldest hold 4.0s; 1 dead`:
    backing off counted as the gate's STATUS= line counts it."""
    parts = [f"{status.backing_off} backing off"] if status.backing_off else []
    held = ", ".join(f"{n} {reason}" for reason, n in sorted(status.holds.items()))
    if held:
        parts.append(f"held: {held}")
    note = f" ({'; '.join(parts)})" if parts else ""
    return (
        f"queue: {status.queue_depth} pending{note}, "
        f"oldest hold {_age(status.oldest_held_s)}; {status.dead} dead"
    )


def _slots_line(repo: RepositoryStatus, count_as_turns: bool) -> str:
    """One repository's test slots. Runs beyond the slots held took none: their cap was
    0 (off), so "0 of 1 held" alone would hide them."""
    if repo.slots_held is None and repo.problem:
        return f"test slots: cannot watch {repo.repository}: {repo.problem}"
    held = repo.slots_held if repo.slots_held is not None else "?"
    slots = repo.slots if repo.slots is not None else "?"
    counted = " (count as turns)" if count_as_turns else ""
    problem = f" ({repo.problem})" if repo.problem else ""
    line = f"test slots: {held} of {slots} held in {repo.repository}{counted}{problem}"
    uncapped = len(repo.runs) - (repo.slots_held or 0)
    if repo.slots_held is not None and uncapped > 0:
        line += (
            f"; {uncapped} run{'s' if uncapped != 1 else ''} without a slot: no test cap set "
            f"(--slots 0, git config {GIT_CONFIG_KEY} 0 or {CONFIG_KEY} = 0)"
        )
    return line
