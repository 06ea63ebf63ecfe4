"""`volutectl launcher` (hidden): volute-launcher.service's process, the gate's root part.

Takes the socket systemd passes (or binds one), installs the stop signals, and serves
the gate's orders with volutectl/launcher/service.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import click

from volutectl.cli import options
from volutectl.errors import ConfigError
from volutectl.launcher.service import ReloadingSettings, bind_listener, run
from volutectl.systemd import activation
from volutectl.systemd.journal import Journal, sd_notify
from volutectl.wire import orders


@click.command("launcher", hidden=True)
@options.config_option
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(),
    default=orders.DEFAULT_SOCKET,
    help="Where to listen when systemd passes no socket.",
)
def launcher_command(config_path: str | None, socket_path: str) -> None:
    """Run the gate's root part (volute-launcher.service): it carries out the gate's
    orders. Internal: only volute-gate.service talks to it."""
    listener = activation.inherited_listener()
    if os.geteuid() != 0:
        raise ConfigError(
            "the launcher must run as root: it forks turns as their minds' users",
            hint="it is volute-launcher.service; the gate itself runs unprivileged",
        )
    journal = Journal("volute-launcher")
    settings = ReloadingSettings(config_path, journal.emit)
    stop_read, stop_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def on_signal(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            os.write(stop_write, b"x")

    # A stop lets the order under way finish: a turn's child is released into its scope,
    # or exits unreleased, never killed half-way (launcher.STOP_SIGNALS).
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    if listener is None:
        listener = bind_listener(Path(socket_path))
    from volutectl.systemd.adapter import Manager

    def ready() -> None:
        sd_notify("READY=1\nSTATUS=taking the gate's orders")

    manager = Manager.connect(user=settings().gate.manager == "user")
    try:
        run(settings, manager, listener, journal, stop_read, ready=ready)
    finally:
        manager.close()
    sd_notify("STOPPING=1")
