"""Client commands that talk to the gate: status, queue, and deliver's click face.

The real `deliver` lives in volutectl.deliver, which the CLI calls directly without
loading click; the click command here only exists for `volutectl --help`.
"""

from __future__ import annotations

import click

from volutectl.completion import DeliverCommand, complete_deliver, complete_states
from volutectl.deliver import call, deliver_main
from volutectl.errors import EX_DATAERR, EX_USAGE, VoluteError
from volutectl.messages import (
    QUEUE_LIMIT,
    QUEUE_LIMIT_MAX,
    ChangedReply,
    DropRequest,
    QueueReply,
    QueueRequest,
    RetryRequest,
    Status,
    StatusReply,
    StatusRequest,
)
from volutectl.options import config_option
from volutectl.states import QueueState


@click.command(
    "deliver",
    cls=DeliverCommand,
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED, shell_complete=complete_deliver)
def deliver_command(args: tuple[str, ...]) -> int:
    """Queue a message for a mind's turn (see: volutectl deliver --help)."""
    return deliver_main(list(args))


def _format_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m"


def format_status(status: Status) -> str:
    cap = status.global_cap if status.global_cap is not None else "unlimited"
    lines = [
        f"active turns: {status.active_turns} of {cap} "
        f"(per mind: {status.turns_per_mind}; slice {status.slice})",
        f"queue: {status.queue_depth} pending, "
        f"oldest hold {_format_age(status.oldest_held_s)}, {status.dead} dead",
    ]
    if status.holds:
        lines.append(
            "holds: " + ", ".join(f"{n} {reason}" for reason, n in sorted(status.holds.items()))
        )
    for mind, problems in sorted(status.preflight.items()):
        lines.append(f"preflight: mind {mind} cannot start turns: {'; '.join(problems)}")
    if status.foreign_scopes:
        lines.append(f"other scopes in the slice: {status.foreign_scopes}")
    for turn in status.turns:
        lines.append(
            f"  turn {turn.turn_id}: {turn.mind}/{turn.session} "
            f"running {_format_age(turn.running_s)}  ({turn.unit})"
        )
    pressure = status.io_pressure
    if pressure.enabled:
        state = f"HIGH ({pressure.reason}): holding new turns" if pressure.high else "ok"
        lines.append(f"io pressure: {state}; {pressure.trigger}")
    for repo in status.test_runs:
        held = repo.slots_held if repo.slots_held is not None else "?"
        slots = repo.slots if repo.slots is not None else "?"
        counted = " (count as turns)" if status.test_runs_count_as_turns else ""
        lines.append(f"test slots: {held} of {slots} held in {repo.repository}{counted}")
        for run in repo.runs:
            lines.append(
                f"  test run: {run.worktree} `{run.command}` "
                f"running {_format_age(run.running_s)}  ({run.unit})"
            )
    for mind, info in sorted(status.minds.items()):
        sessions = ",".join(info.running_sessions) or "-"
        lines.append(f"  mind {mind}: running {sessions}; {info.pending} pending")
    return "\n".join(lines)


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--socket", help="Gate socket.")
@config_option
def status_command(as_json: bool, socket: str | None, config_path: str | None) -> None:
    """Show active turns against the cap, holds, and the queue."""
    status = call(StatusRequest(), StatusReply, socket, config_path).status
    if as_json:
        import json

        click.echo(json.dumps(status.to_wire(), indent=2, sort_keys=True))
    else:
        click.echo(format_status(status))


@click.group("queue", invoke_without_command=True)
@click.option("--socket", help="Gate socket.")
@config_option
@click.pass_context
def queue_command(ctx: click.Context, socket: str | None, config_path: str | None) -> None:
    """List, retry or drop queued deliveries (default: list)."""
    ctx.obj = (socket, config_path)
    if ctx.invoked_subcommand is None:
        ctx.invoke(queue_list)


@queue_command.command("list")
@click.option(
    "--state",
    "states",
    multiple=True,
    help="pending, running, dead, done, dropped",
    shell_complete=complete_states,
)
@click.option(
    "--limit",
    type=click.IntRange(1, QUEUE_LIMIT_MAX),
    default=QUEUE_LIMIT,
    show_default=True,
    help="Show the newest N rows.",
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def queue_list(
    ctx: click.Context,
    states: tuple[str, ...] = (),
    limit: int = QUEUE_LIMIT,
    as_json: bool = False,
) -> None:
    """List rows, newest first (default: pending, running and dead)."""
    socket, config_path = ctx.obj
    wanted = tuple(QueueState(state) for state in _states(states))
    reply = call(QueueRequest(wanted, limit), QueueReply, socket, config_path)
    rows = reply.rows
    # On stderr with --json, so that stdout stays one JSON array.
    more = f"{reply.not_shown} older rows not shown (--limit)" if reply.not_shown else None
    if as_json:
        import json

        click.echo(json.dumps([row.to_wire() for row in rows], indent=2))
        if more:
            click.echo(more, err=True)
        return
    if not rows:
        click.echo("the queue is empty")
    for row in rows:
        extra = f" held:{row.hold_reason}" if row.hold_reason else ""
        error = f" last error: {row.last_error}" if row.last_error else ""
        click.echo(
            f"{row.id:>6} {row.state:<8} {row.mind}/{row.session} "
            f"attempts={row.attempts} {row.bytes}B{extra}{error}"
        )
    if more:
        click.echo(more)


def _states(states: tuple[str, ...]) -> tuple[str, ...]:
    known = [state.value for state in QueueState]
    for state in states:
        if state not in known:
            raise VoluteError(
                f"--state {state!r} is not one of {', '.join(known)}", exit_code=EX_USAGE
            )
    return states


@queue_command.command("retry")
@click.argument("ids", nargs=-1, type=int, required=True)
@click.pass_context
def queue_retry(ctx: click.Context, ids: tuple[int, ...]) -> None:
    """Send dead deliveries back to the queue, attempts reset."""
    socket, config_path = ctx.obj
    changed = call(RetryRequest(ids), ChangedReply, socket, config_path).changed
    _report_changed("retried", ids, changed)


@queue_command.command("drop")
@click.argument("ids", nargs=-1, type=int, required=True)
@click.pass_context
def queue_drop(ctx: click.Context, ids: tuple[int, ...]) -> None:
    """Drop pending or dead deliveries (never a running one)."""
    socket, config_path = ctx.obj
    changed = call(DropRequest(ids), ChangedReply, socket, config_path).changed
    _report_changed("dropped", ids, changed)


def _report_changed(verb: str, asked: tuple[int, ...], changed: tuple[int, ...]) -> None:
    for delivery_id in changed:
        click.echo(f"{verb} {delivery_id}")
    missed = sorted(set(asked) - set(changed))
    if missed:
        raise VoluteError(
            f"not {verb}: {' '.join(map(str, missed))} (no such row, or in the wrong state)",
            exit_code=EX_DATAERR,
        )
