"""`volutectl gate`: the daemon's edge, between systemd and the gate's loop.

It takes the socket systemd may pass (socket activation), installs the signal handlers
(SIGTERM and SIGINT ask the loop to stop after the step it is in), raises the fd limit,
and speaks sd_notify. Everything else is volutectl/gate/loop.py, which tests drive directly.
"""

from __future__ import annotations

import contextlib
import os
import signal

import click

from volutectl.cli import options
from volutectl.config.settings import load_settings
from volutectl.gate.loop import Gate
from volutectl.launcher import fork
from volutectl.systemd import activation
from volutectl.systemd.journal import sd_notify


@click.command("gate")
@options.config_option
def gate_command(config_path: str | None) -> None:
    """Run the turn gate in the foreground (the daemon behind volute-gate.service)."""
    # First of all, before the gate can fork a turn: take the socket systemd may have
    # passed (made close-on-exec, its variables unset). Run by hand, there is none.
    listener = activation.inherited_listener()
    settings = load_settings(config_path).settings
    stop_read, stop_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def on_signal(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            os.write(stop_write, b"x")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    fork.raise_nofile_limit()  # a descriptor per client; turns get the old limit back
    gate = Gate(settings, listener=listener)

    def ready() -> None:
        sd_notify("READY=1\nSTATUS=accepting deliveries")

    gate.run(stop_read, ready=ready)
    sd_notify("STOPPING=1")
