"""Client commands that talk to the gate: status, queue, pause, resume, wait, and
deliver's click face.

The real `deliver` lives in volutectl.cli.deliver, which the CLI calls directly without
loading click; the click command here only exists for `volutectl --help`.
"""

from __future__ import annotations

import time

import click

from volutectl.cli import waiting
from volutectl.cli.completion import (
    DeliverCommand,
    complete_deliver,
    complete_minds,
    complete_states,
)
from volutectl.cli.deliver import call, deliver_main, socket_path
from volutectl.cli.options import config_option
from volutectl.cli.statusview import format_status
from volutectl.durations import format_duration
from volutectl.errors import EX_DATAERR, EX_USAGE, UsageError, VoluteError
from volutectl.states import QueueState
from volutectl.visible import visible
from volutectl.wire.messages import (
    MAX_WAIT_IDS,
    QUEUE_LIMIT,
    QUEUE_LIMIT_MAX,
    ChangedReply,
    DropRequest,
    PausedMind,
    PauseReply,
    PauseRequest,
    QueueReply,
    QueueRequest,
    ResumeRequest,
    RetryRequest,
    StatusReply,
    StatusRequest,
)


@click.command(
    "deliver",
    cls=DeliverCommand,
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED, shell_complete=complete_deliver)
def deliver_command(args: tuple[str, ...]) -> int:
    """Queue a message for a mind's turn (see: volutectl deliver --help)."""
    return deliver_main(list(args))


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--all", "every_mind", is_flag=True, help="A row for every mind, idle ones too.")
@click.option("--socket", help="Gate socket.")
@config_option
def status_command(
    as_json: bool, every_mind: bool, socket: str | None, config_path: str | None
) -> None:
    """Show each mind's turns, queue and pause, then the totals against the cap."""
    status = call(StatusRequest(), StatusReply, socket, config_path).status
    if as_json:
        import json

        click.echo(json.dumps(status.to_wire(), indent=2, sort_keys=True))
    else:
        click.echo(format_status(status, every_mind=every_mind))


def _since(mind: str, paused: tuple[PausedMind, ...]) -> str:
    """How long `mind` ("*": every mind) has been paused, by its own pause or all's."""
    import time

    found = [pause for pause in paused if pause.mind in (mind, "*")]
    if not found:
        return ""
    pause = min(found, key=lambda p: p.since)
    whose = ", with every mind" if pause.mind == "*" and mind != "*" else ""
    return f" ({format_duration(time.time() - pause.since)} ago{whose})"


@click.command("pause")
@click.argument("minds", nargs=-1, shell_complete=complete_minds)
@click.option("--socket", help="Gate socket.")
@config_option
def pause_command(minds: tuple[str, ...], socket: str | None, config_path: str | None) -> None:
    """Hold new turns of MINDS (none: every mind, minds added later too) until resumed.

    Their running turns go on, and deliveries to them are still queued."""
    reply = call(PauseRequest(minds or None), PauseReply, socket, config_path)
    for mind in minds or ("*",):
        name = "every mind" if mind == "*" else mind
        if mind in reply.changed:
            click.echo(f"paused {name}")
        else:
            click.echo(f"{name} was already paused{_since(mind, reply.paused)}")


@click.command("resume")
@click.argument("minds", nargs=-1, shell_complete=complete_minds)
@click.option("--socket", help="Gate socket.")
@config_option
def resume_command(minds: tuple[str, ...], socket: str | None, config_path: str | None) -> None:
    """Resume MINDS (none: every pause): their held deliveries go through the gate."""
    reply = call(ResumeRequest(minds or None), PauseReply, socket, config_path)
    if not minds:
        names = ["every mind" if mind == "*" else mind for mind in reply.changed]
        click.echo(visible(f"resumed {', '.join(names)}") if names else "nothing was paused")
    for mind in minds:
        click.echo(f"resumed {mind}" if mind in reply.changed else f"{mind} was not paused")


@click.command("wait")
@click.argument("ids", nargs=-1, type=click.IntRange(min=1), required=True)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds the gate may take to answer, and to answer again after a restart; "
    "the wait for the turns themselves is --max-wait's.",
)
@click.option(
    "--max-wait",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Stop waiting after SECONDS and exit 75; the deliveries go on.  [default: no limit]",
)
@click.option("--socket", help="Gate socket.")
@config_option
def wait_command(
    ids: tuple[int, ...],
    timeout: float,
    max_wait: float | None,
    socket: str | None,
    config_path: str | None,
) -> int:
    """Wait until the deliveries IDS settle, through gate restarts, saying on stderr
    each attempt that failed and when the next comes.

    Exits 0 if a turn that exited 0 did each one; else with the code of the first, in
    the order given, that was not: its last turn's exit status (124 for a time limit),
    or 1 if it was dropped or never started. An id the gate does not know is 65; 75
    after --max-wait."""
    if len(ids) > MAX_WAIT_IDS:
        raise UsageError(f"at most {MAX_WAIT_IDS} deliveries in one wait, not {len(ids)}")
    path = socket_path(socket, config_path)
    events = waiting.settle(
        path,
        ids,
        timeout,
        on_event=waiting.report,
        max_wait=max_wait,
        on_attempt=waiting.report_attempt,
    )
    return waiting.exit_code(ids, events)


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
        if row.not_before is not None:  # as status and STATUS= count it
            extra += f" backing off (next try in {format_duration(row.not_before - time.time())})"
        error = f" last error: {row.last_error}" if row.last_error else ""
        sender = f" uid={row.uid}" if row.uid is not None else ""
        # The mind, session and last error are others' text (the error may be a turn's):
        # shown, not obeyed (volutectl/visible.py). --json carries them exact.
        click.echo(
            visible(
                f"{row.id:>6} {row.state:<8} {row.mind}/{row.session}{sender} "
                f"attempts={row.attempts} {row.bytes}B{extra}{error}"
            )
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
    report_changed("retried", ids, call(RetryRequest(ids), ChangedReply, socket, config_path))


@queue_command.command("drop")
@click.argument("ids", nargs=-1, type=int, required=True)
@click.pass_context
def queue_drop(ctx: click.Context, ids: tuple[int, ...]) -> None:
    """Drop pending or dead deliveries (never a running one)."""
    socket, config_path = ctx.obj
    report_changed("dropped", ids, call(DropRequest(ids), ChangedReply, socket, config_path))


def report_changed(verb: str, asked: tuple[int, ...], reply: ChangedReply) -> None:
    """Print what a retry or drop changed; raise (65) naming, per id, why the others
    were left alone."""
    for delivery_id in reply.changed:
        click.echo(f"{verb} {delivery_id}")
    missed = sorted(set(asked) - set(reply.changed))
    if not missed:
        return
    states = {row.id: row.state for row in reply.unchanged}
    if not states:  # a gate before `unchanged`: it cannot say which
        why = [f"{' '.join(map(str, missed))} (no such delivery, or in the wrong state)"]
    else:
        why = [
            f"{delivery_id} ({_why_unchanged(verb, states.get(delivery_id))})"
            for delivery_id in missed
        ]
    raise VoluteError(
        f"not {verb}: {', '.join(why)}",
        hint="retry takes dead deliveries; drop takes pending or dead ones: "
        "volutectl queue list --state STATE",
        exit_code=EX_DATAERR,
    )


def _why_unchanged(verb: str, state: QueueState | str | None) -> str:
    """Why a retry or drop left a delivery as it was, from the state it is in."""
    if state is None:
        return "no such delivery: never queued, or removed by retention"
    if state == QueueState.DONE:
        return "already done"
    if state == QueueState.RUNNING:
        return "running now: a turn carries it"
    if state == QueueState.DROPPED:
        return "already dropped"
    if state == QueueState.PENDING:
        return "pending already: retry takes dead deliveries" if verb == "retried" else "pending"
    return f"{state}: not a state that {verb.removesuffix('ed')} takes"
