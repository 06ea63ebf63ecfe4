"""The `volutectl` entry point: one top-level handler, and commands loaded on demand.

Every click command lives in this package, one module per command (`client` holds the
gate's small client commands). Each calls the library packages that do the work (gate,
slots, host, launcher) and is imported only when it runs, so `volutectl deliver` (run by
timers and chat fan-outs) pays for no more than a socket round trip. Every VoluteError
becomes one line plus a hint and its sysexits code; a traceback appears only under
`--debug` (or VOLUTE_DEBUG=1).
"""

from __future__ import annotations

import os
import sys

# Not `import typing`: this module is on deliver's hot path (~6 ms).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

    from click.shell_completion import CompletionItem

# name -> (module, attribute, one-line help) of a click command, imported when it runs.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "deliver": ("volutectl.cli.client", "deliver_command", "Queue a message for a mind's turn."),
    "gate": ("volutectl.cli.gate", "gate_command", "Run the turn gate daemon (foreground)."),
    "status": (
        "volutectl.cli.client",
        "status_command",
        "Show each mind's turns, queue and pause.",
    ),
    "queue": ("volutectl.cli.client", "queue_command", "List, retry or drop queued deliveries."),
    "pause": ("volutectl.cli.client", "pause_command", "Hold new turns of minds (none: all)."),
    "resume": ("volutectl.cli.client", "resume_command", "Resume paused minds (none: all)."),
    "wait": ("volutectl.cli.client", "wait_command", "Wait until deliveries settle."),
    "config": ("volutectl.cli.config", "config_command", "Show or check the configuration."),
    "test": (
        "volutectl.cli.test",
        "test_command",
        "Run a test command under the test-run cap.",
    ),
    "doctor": (
        "volutectl.cli.doctor",
        "doctor_command",
        "Say which protections work on this host.",
    ),
    "lease": (
        "volutectl.cli.lease",
        "lease_command",
        "Hold a place among a mind's turns while a command runs.",
    ),
    "logs": (
        "volutectl.cli.logs",
        "logs_command",
        "Show a mind's turns' output, from the journal.",
    ),
}
# Internal commands, run by units only: not listed, not completed.
HIDDEN_COMMANDS: dict[str, tuple[str, str, str]] = {
    "launcher": ("volutectl.cli.launcher", "launcher_command", "Run the gate's root part."),
    "reload-gate": (
        "volutectl.cli.reloadgate",
        "reload_gate_command",
        "Have the gate read its config again (ExecReload=).",
    ),
}


def split_debug(argv: list[str]) -> tuple[bool, list[str]]:
    """Take --debug from the options before the command name; the rest is untouched.

    After the command name a --debug belongs to the command: `volutectl test -- pytest
    --debug` passes it to pytest. Also on with VOLUTE_DEBUG=1."""
    # volutectl's own options (--debug, --help, --version) take no values: the first
    # word that is no option is the command's name.
    command = next((i for i, arg in enumerate(argv) if arg == "--" or arg[:1] != "-"), len(argv))
    leading = argv[:command]
    debug = "--debug" in leading or os.environ.get("VOLUTE_DEBUG", "") not in ("", "0")
    return debug, [arg for arg in leading if arg != "--debug"] + argv[command:]


def _fail(error: BaseException, debug: bool) -> NoReturn:
    from volutectl.errors import VoluteError, format_error

    if debug:
        import traceback

        traceback.print_exception(error)
    if isinstance(error, VoluteError):
        print(format_error(error), file=sys.stderr)
        sys.exit(error.exit_code)
    print(
        f"volutectl: internal error: {error!r} (run with --debug for a traceback)", file=sys.stderr
    )
    sys.exit(70)


def main(argv: list[str] | None = None) -> None:
    debug, args = split_debug(list(sys.argv[1:] if argv is None else argv))
    try:
        if args[:1] == ["deliver"]:
            # The hot path: no click, no pydantic; see volutectl.cli.deliver.
            from volutectl.cli.deliver import deliver_main

            sys.exit(deliver_main(args[1:]))
        _run_click(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - the one top-level handler
        _fail(error, debug)


def _run_click(args: list[str]) -> None:
    import click

    class LazyGroup(click.Group):
        def list_commands(self, ctx: click.Context) -> list[str]:
            return sorted(COMMANDS)

        def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
            entry = COMMANDS.get(cmd_name) or HIDDEN_COMMANDS.get(cmd_name)
            if entry is None:
                return None
            import importlib

            module = importlib.import_module(entry[0])
            command: click.Command = getattr(module, entry[1])
            return command

        def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
            # Command names from the table: click's own would import every command.
            from click.shell_completion import CompletionItem

            names = [
                CompletionItem(name, help=entry[2])
                for name, entry in sorted(COMMANDS.items())
                if name.startswith(incomplete)
            ]
            if incomplete.startswith("-") and "--debug".startswith(incomplete):
                names.append(CompletionItem("--debug", help="a traceback on errors"))
            return names + click.Command.shell_complete(self, ctx, incomplete)

        def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
            rows = [(name, entry[2]) for name, entry in sorted(COMMANDS.items())]
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    @click.group(
        cls=LazyGroup,
        context_settings={"help_option_names": ["-h", "--help"]},
        epilog="Add --debug before the command name for a traceback on errors.",
    )
    @click.version_option(package_name="volutectl")
    def app() -> None:
        """Bound concurrent agent turns and test runs on a small host, with systemd."""

    # Not click's standalone mode: it maps usage errors to exit 2, sysexits says 64.
    try:
        result = app.main(args=args, prog_name="volutectl", standalone_mode=False)
    except click.exceptions.UsageError as error:
        error.show()
        sys.exit(64)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.exceptions.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
