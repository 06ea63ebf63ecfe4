"""The gate's journal: its structured entries, each turn's output stream, and sd_notify.

- Entries are the events of volutectl/events.py, one each (`Journal.emit`): the gate's,
  the slot watch's and the launcher's. They go through
  libsystemd's sd_journal_sendv, as pystemd exposes it (reached through
  volutectl/systemd/adapter.py, the one module that imports pystemd). libsystemd frames
  every field, a multi-line MESSAGE too, and hands an oversized entry over in a memfd.
  This module only builds the fields (`entry_fields`, pure). Off systemd (tests, a
  terminal) entries go to stderr instead. docs/journal.md lists every field.
- A turn's stdout and stderr are one stream to journald (`TurnStream`), opened by the
  turn's own process once it is in its scope (volutectl/launcher/fork.py says why there, and
  as root). The stream's header is the few lines of text that sd_journal_stream_fd and
  systemd's own services write; pystemd does not expose that call.
- sd_notify is one datagram, spoken directly.
"""

from __future__ import annotations

import array
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from volutectl.events import MESSAGE_IDS, BaseEvent, EventName

JOURNAL_SOCKET = "/run/systemd/journal/socket"
STDOUT_SOCKET = "/run/systemd/journal/stdout"
PRIORITY = {"error": 3, "warning": 4, "notice": 5, "info": 6, "debug": 7}
# A turn's output: info; and no "<N>" prefix parsing, so that no line a turn prints (a
# message it echoes, say) can raise itself to an emergency that journald walls to ttys.
TURN_PRIORITY = 6
_FIELD_NAME = re.compile(r"[A-Z0-9][A-Z0-9_]{0,63}")

Sender = Callable[..., None]


def entry_fields(
    identifier: str, level: str, message: str, fields: Mapping[str, Any]
) -> list[bytes]:
    """One journal entry as FIELD=value items, for sd_journal_sendv.

    Each keyword becomes VOLUTE_<KEY> (None: left out); an `event` with a MESSAGE_ID
    adds it. Values are sent whole, newlines included: libsystemd frames them. A NUL,
    which pystemd would cut the value at, becomes U+FFFD."""
    items = [
        ("MESSAGE", message),
        ("PRIORITY", str(PRIORITY.get(level, 6))),
        ("SYSLOG_IDENTIFIER", identifier),
    ]
    event = fields.get("event")
    if event is not None and event in MESSAGE_IDS:
        items.append(("MESSAGE_ID", MESSAGE_IDS[EventName(event)]))
    for key, value in fields.items():
        if value is None:
            continue
        name = f"VOLUTE_{key.upper()}"
        if not _FIELD_NAME.fullmatch(name):
            raise ValueError(f"{key!r} cannot name a journal field")
        items.append((name, str(value)))
    return [
        f"{name}={text.replace(chr(0), chr(0xFFFD))}".encode(errors="backslashreplace")
        for name, text in items
    ]


def stderr_is_journal() -> bool:
    """Whether our stderr is the journal stream the service manager gave us: it set
    JOURNAL_STREAM to that stream's device:inode (systemd.exec(5) says to compare)."""
    device, _, inode = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        found = os.fstat(2)
        return (found.st_dev, found.st_ino) == (int(device), int(inode))
    except (OSError, ValueError):
        return False


class Journal:
    """Where the gate logs, and where its turns' output goes: both to the journal when
    the gate's own stderr is the journal (a service), else both to its stderr (a
    terminal, a test). `stdout_socket` is journald's stream socket, or None."""

    def __init__(self, identifier: str = "volutectl") -> None:
        self.identifier = identifier
        self.stdout_socket: str | None = None
        self.sender: Sender | None = None
        if not stderr_is_journal():
            return
        self.stdout_socket = STDOUT_SOCKET
        if os.path.exists(JOURNAL_SOCKET):
            try:
                from volutectl.systemd.adapter import journal_sender

                self.sender = journal_sender()
            except ImportError:
                self.sender = None  # a pystemd without its journal module: stderr

    def emit(self, event: BaseEvent) -> None:
        """Send one event as one entry (volutectl/events.py builds its message and fields)."""
        self.log(event.level, event.message(), **event.journal_fields())

    def log(self, level: str, message: str, **fields: Any) -> None:
        """Send one entry from its parts: `emit` does, for each event of the catalog."""
        if self.sender is not None:
            self.sender(*entry_fields(self.identifier, level, message, fields))
            return
        extra = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        suffix = f" [{extra}]" if extra else ""
        print(f"<{PRIORITY.get(level, 6)}>{message}{suffix}", file=sys.stderr, flush=True)

    def turn_stream(self, mind: str, unit: str) -> TurnStream | None:
        if self.stdout_socket is None:
            return None
        return TurnStream(self.stdout_socket, f"volute-{mind}", unit)


@dataclass(frozen=True)
class TurnStream:
    """A turn's stdout and stderr as one journal stream.

    `unit` (the turn's scope) goes in the header's unit field: journald takes
    _SYSTEMD_UNIT from the writer's cgroup, and from this field when it reads a line
    after the writer has exited (it accepts the field from a root peer only)."""

    path: str
    identifier: str
    unit: str

    def header(self) -> bytes:
        # identifier, unit, priority, level prefix, forward to syslog, kmsg, console
        # (0: as journald is configured).
        return f"{self.identifier}\n{self.unit}\n{TURN_PRIORITY}\n0\n0\n0\n0\n".encode()

    def connect(self) -> int:
        """A connected stream's fd, header sent; OSError if journald cannot take it."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
            sock.shutdown(socket.SHUT_RD)
            sock.sendall(self.header())
        except OSError:
            sock.close()
            raise
        return sock.detach()


def sd_notify(state: str, fds: Sequence[int] = ()) -> bool:
    """Send `state` (e.g. "READY=1") to the service manager, with `fds` (SCM_RIGHTS, for
    FDSTORE=1); False if not under one."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            if fds:
                sock.sendmsg(
                    [state.encode()],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(array.array("i", fds)))],
                )
            else:
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
