"""Logging to the journal with structured fields, and sd_notify, without pystemd.

Both are small datagram protocols; speaking them directly keeps pystemd inside the
one systemd adapter. Off systemd (tests, a terminal) lines go to stderr instead.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

JOURNAL_SOCKET = "/run/systemd/journal/socket"
PRIORITY = {"error": 3, "warning": 4, "notice": 5, "info": 6, "debug": 7}


class Journal:
    def __init__(self, identifier: str = "volutectl") -> None:
        self.identifier = identifier
        self.sock: socket.socket | None = None
        # Only when our stderr is the journal (a service) do we send native entries.
        if os.environ.get("JOURNAL_STREAM") and os.path.exists(JOURNAL_SOCKET):
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self.sock.connect(JOURNAL_SOCKET)
            except OSError:
                self.sock = None

    def log(self, level: str, message: str, **fields: Any) -> None:
        if self.sock is not None:
            lines = [
                f"MESSAGE={message}",
                f"PRIORITY={PRIORITY.get(level, 6)}",
                f"SYSLOG_IDENTIFIER={self.identifier}",
            ]
            for key, value in fields.items():
                if value is not None:
                    text = str(value).replace("\n", " ")
                    lines.append(f"VOLUTE_{key.upper()}={text}")
            try:
                self.sock.send("\n".join(lines).encode() + b"\n")
                return
            except OSError:
                pass
        extra = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        print(f"<{PRIORITY.get(level, 6)}>{message}" + (f" [{extra}]" if extra else ""),
              file=sys.stderr, flush=True)  # fmt: skip


def sd_notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1") to the service manager; False if not under one."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.send(state.encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Half the WatchdogSec= the manager asked for, in seconds, if it asked us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2_000_000
    except ValueError:
        return None
