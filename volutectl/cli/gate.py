"""`volutectl gate`: the daemon's edge, between systemd and the gate's loop.

It takes the socket systemd may pass (socket activation), installs the signal handlers
(SIGTERM and SIGINT ask the loop to stop after the step it is in; SIGHUP, sent by
`systemctl reload volute-gate`, asks it to read its config again), raises the fd limit,
and speaks sd_notify. A handler only writes a byte to a pipe: the work is done in the
loop. Everything else is volutectl/gate/loop.py, which tests drive directly.

A config that does not load does not stop the gate under systemd: it serves its socket
degraded (volutectl/gate/degraded.py), refusing every request with the error, until a
reload finds the file fixed; then the whole gate starts in this process. Run by hand,
outside systemd, it exits 78 with the error, as every command does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket

import click

from volutectl.cli import options
from volutectl.config.reload import ConfigFile
from volutectl.config.settings import Settings
from volutectl.errors import VoluteError
from volutectl.launcher import fork
from volutectl.systemd import activation
from volutectl.systemd.journal import Journal, sd_notify


def signal_pipe(*signums: int) -> int:
    """A pipe that each of `signums` writes a byte into; its read end, for the loop."""
    read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def on_signal(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            os.write(write, b"x")

    for signum in signums:
        signal.signal(signum, on_signal)
    return read


@click.command("gate")
@options.config_option
def gate_command(config_path: str | None) -> None:
    """Run the turn gate in the foreground (the daemon behind volute-gate.service)."""
    # First of all, before the gate can fork a turn: take the socket systemd may have
    # passed (made close-on-exec, its variables unset), and the repositories' descriptors
    # it kept for us across a restart (its fd store). Run by hand, there are none.
    from volutectl.slots.watch import ANCHOR_PREFIX

    listener, anchors = activation.inherited(ANCHOR_PREFIX)
    # Before anything slow: a SIGHUP's default action would end the gate.
    stop_fd = signal_pipe(signal.SIGTERM, signal.SIGINT)
    reload_fd = signal_pipe(signal.SIGHUP)
    config = ConfigFile(config_path)
    journal = Journal("volute-gate")
    try:
        settings = config.load().settings
    except VoluteError as error:
        if listener is None and not os.environ.get("NOTIFY_SOCKET"):
            raise  # by hand: say it and exit 78
        reloaded = serve_degraded(error, journal, listener, stop_fd, reload_fd, config)
        if reloaded is None:
            sd_notify("STOPPING=1")
            return
        settings = reloaded
    run_gate(settings, journal, listener, stop_fd, reload_fd, config, anchors)


def serve_degraded(
    error: VoluteError,
    journal: Journal,
    listener: socket.socket | None,
    stop_fd: int,
    reload_fd: int,
    config: ConfigFile,
) -> Settings | None:
    from volutectl.gate.degraded import Degraded

    try:
        degraded = Degraded(error, journal, listener)
    except Exception:  # noqa: BLE001 - no socket to serve: the config error is the news
        raise error from None
    return degraded.serve(stop_fd, reload_fd, lambda: config.load().settings)


def run_gate(
    settings: Settings,
    journal: Journal,
    listener: socket.socket | None,
    stop_fd: int,
    reload_fd: int,
    config: ConfigFile,
    anchors: list[tuple[str, int]],
) -> None:
    from volutectl.gate.loop import Gate

    fork.raise_nofile_limit()  # a descriptor per client; turns get the old limit back
    gate = Gate(settings, listener=listener, journal=journal, config=config, anchors=anchors)

    def ready() -> None:
        sd_notify("READY=1\nSTATUS=accepting deliveries")

    gate.run(stop_fd, ready=ready, reload_fd=reload_fd)
    sd_notify("STOPPING=1")
