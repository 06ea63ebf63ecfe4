"""The gate with no valid configuration: it serves its socket and refuses every request.

A typo in /etc/volute/volutectl.toml must not silence the gate: a gate that exited
would be restarted by systemd again and again, and every client would wait in the
socket's backlog until its own timeout, with no word of why. Instead, the gate that
cannot load its config takes the socket all the same (systemd's, else the default
path), answers every request at once with the config error (78, naming the key, as
`volutectl config check` words it), and stores nothing, so nothing it was sent can run
twice. It opens no queue, no systemd connection, no launcher. It tells systemd it is up
but degraded (READY=1, STATUS=), logs gate_config_invalid, and keeps the watchdog fed.

SIGHUP (`systemctl reload volute-gate`) reads the file again: still invalid, it goes on
refusing, with the new error; valid, `serve` returns the settings and the caller
(volutectl/cli/gate.py) builds the whole gate in this same process, on the same socket.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable

from volutectl import events
from volutectl.config.reload import SettingsHolder
from volutectl.config.settings import Settings
from volutectl.config.sources import FIX_HINT
from volutectl.errors import ConfigError, VoluteError
from volutectl.gate.reactor import Reactor
from volutectl.gate.server import Server
from volutectl.systemd.journal import Journal, sd_notify, watchdog_interval
from volutectl.wire.messages import ErrorReply

RELOAD_HINT = "fix it (`volutectl config check` rechecks it), then: systemctl reload volute-gate"


def refusal(error: VoluteError) -> ErrorReply:
    """What every request gets: the config error (78), and how to recover."""
    others = error.hint if error.hint and error.hint != FIX_HINT else None
    hint = f"{others}; then: systemctl reload volute-gate" if others else RELOAD_HINT
    message = f"the gate has no valid config, so it takes nothing: {error.message}"
    return ErrorReply.of(ConfigError(message, hint=hint))


def status_text(error: VoluteError) -> str:
    return f"degraded: invalid config, refusing every request (78): {error.message}"


class Degraded:
    """The socket, served with one answer. Built whole, or not at all."""

    def __init__(
        self, error: VoluteError, journal: Journal, listener: socket.socket | None
    ) -> None:
        self.error = error
        self.journal = journal
        self.reactor = Reactor()
        self.stopping = False
        self.reloaded: Settings | None = None
        self.watchdog = watchdog_interval()
        self.next_ping: float | None = None
        # A copy of systemd's socket: closing the server leaves the original to the gate
        # that takes over. No settings were read: the defaults size the server.
        self.server = Server(
            SettingsHolder(Settings()),
            self.reactor,
            journal,
            inherited=listener.dup() if listener is not None else None,
        )
        self.reactor.at(lambda: self.next_ping, self._ping_watchdog)

    def serve(self, stop_fd: int, reload_fd: int, read: Callable[[], Settings]) -> Settings | None:
        """Refuse every request until stopped (None) or a reload reads a valid config
        (its settings); the socket is closed either way."""
        self.reactor.watch(stop_fd, self._on_stop)
        self.reactor.watch(reload_fd, lambda mask: self._on_reload(reload_fd, read))
        self._say_degraded()
        self.next_ping = self.reactor.clock.monotonic() if self.watchdog else None
        try:
            while not self.stopping and self.reloaded is None:
                # Lines beyond one pass's share wait in the server: no sleep then.
                self.reactor.wait(0.0 if self.server.backlog else self.reactor.timeout())
                if self.reloaded is not None:
                    break  # what came with the reload is not refused: its clients try again
                for client, _ in self.server.take_requests():
                    self.server.reply(client, refusal(self.error))
                self.reactor.run_due()
        finally:
            self.server.close()
            self.reactor.close()
        return self.reloaded

    def _say_degraded(self) -> None:
        self.journal.emit(events.GateConfigInvalid(error=self.error.message))
        sd_notify(f"READY=1\nSTATUS={status_text(self.error)}")

    def _ping_watchdog(self, now: float) -> None:
        sd_notify("WATCHDOG=1")
        self.next_ping = now + self.watchdog if self.watchdog else None

    def _on_stop(self, mask: int) -> None:
        self.stopping = True

    def _on_reload(self, fd: int, read: Callable[[], Settings]) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(fd, 512):
                pass
        sd_notify(
            f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}\n"
            "STATUS=reloading the config"
        )
        try:
            self.reloaded = read()
        except VoluteError as error:
            self.error = error
            self._say_degraded()
