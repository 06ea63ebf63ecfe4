"""`volutectl reload-gate PID` (hidden): volute-gate.service's ExecReload=.

It sends the gate SIGHUP, then asks it for its status on its socket, and returns once
the gate has answered: the gate reads its config again in the same pass of its loop in
which it reads that request, before it answers, so `systemctl reload volute-gate`
returns only once the new config is in force (systemd 252, which the tests' containers
boot, has no Type=notify-reload to wait for it). A reload the gate refused (an invalid
file), or a gate still without a valid config, exits 78 with the error: `systemctl
reload` then fails, and says to look at the journal.
"""

from __future__ import annotations

import os
import signal
import time

import click

from volutectl.cli.deliver import socket_path
from volutectl.errors import EX_TEMPFAIL, ConfigError, VoluteError
from volutectl.visible import visible
from volutectl.wire import messages, protocol
from volutectl.wire.messages import StatusReply, StatusRequest

ANSWER_SECONDS = 25.0  # under the unit's TimeoutStartSec=, which bounds ExecReload=


@click.command("reload-gate")
@click.argument("pid", type=int)
def reload_gate_command(pid: int) -> None:
    """Have the gate at PID read its config again, and wait until it has."""
    asked = time.time()
    os.kill(pid, signal.SIGHUP)
    _, reply = protocol.request_through_restarts(
        socket_path(None, None),
        StatusRequest().to_wire(),
        lambda wire: messages.expect(StatusReply, wire),
        ANSWER_SECONDS,
        out_of_time,
    )
    config = reply.status.config
    if config is not None and config.refused is not None and (config.refused_at or 0) >= asked:
        raise ConfigError(
            f"the gate refused the config and keeps the one it runs: {config.refused}",
            hint="journalctl -u volute-gate -n 20",
        )
    if config is not None and config.needs_restart:
        click.echo(
            "volutectl: warning: these keys need `systemctl restart volute-gate` to apply: "
            + visible(", ".join(config.needs_restart)),
            err=True,
        )


def out_of_time(lost: protocol.ConnectionLost | None) -> VoluteError:
    return VoluteError(
        f"the gate did not answer within {ANSWER_SECONDS:g} s of its reload signal",
        hint="journalctl -u volute-gate -n 20",
        exit_code=EX_TEMPFAIL,
    )
