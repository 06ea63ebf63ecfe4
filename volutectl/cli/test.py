"""`volutectl test -- CMD`: the command's options; volutectl/slots/testrun.py runs it."""

from __future__ import annotations

import os

import click

from volutectl.cli.options import config_option
from volutectl.slots.testrun import run_test


@click.command(
    name="test",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--slots",
    "slot_count",
    type=click.IntRange(min=0),
    default=None,
    help="The cap for this run (overrides git config volute.testSlots and "
    "tests.concurrent_runs); 0 runs without slots.",
)
@click.option(
    "--check",
    "check",
    metavar="CMD",
    default=None,
    help="A cheap check (sh -c CMD) to run first; if it fails, exit with its "
    "status without waiting for a slot.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the result as JSON on stdout (the command's stdout goes to stderr).",
)
@config_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def test_command(
    slot_count: int | None,
    check: str | None,
    as_json: bool,
    config_path: str | None,
    command: tuple[str, ...],
) -> int:
    """Run COMMAND under the test-run cap, in a scope in the tests slice.

    Use `--` before the command: volutectl test --slots 1 -- pytest -x
    """
    outcome = run_test(list(command), slot_count, check, as_json, config_path, os.environ)
    if as_json:
        print(outcome.as_json(), flush=True)
    return outcome.exit_status
