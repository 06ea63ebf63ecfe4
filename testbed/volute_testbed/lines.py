"""Lines that a child process writes to a pipe, read with a timeout.

`select()` says whether the pipe's descriptor holds bytes. A buffered reader may hold
the next line while the descriptor is empty, and a `select()` then waits for nothing.
An acquire's reply and its grant, written together, left the grant unseen that way in
a buffered reader (tests/system/test_lease_moves.py, CI of 04e21ea). So the descriptor
is read raw here, and the lines are split here.
"""

from __future__ import annotations

import os
import select
import time


class PipeLines:
    """The lines read so far from the pipe `fd` (its writer's end elsewhere)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.closed = False  # the writer closed its end: no line comes after the buffer's

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether a whole line is here, waiting up to `timeout` seconds for one to
        arrive. Also True once the pipe has closed, when `take` may say so."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer and not self.closed:
            left = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self.fd], [], [], left)
            if not readable:
                return False
            chunk = os.read(self.fd, 65536)
            self.buffer += chunk
            self.closed = not chunk
        return True

    def take(self) -> bytes | None:
        """The next whole line, without its newline, if one is here; None if none is
        (after `ready`: the pipe closed first)."""
        if b"\n" not in self.buffer:
            return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line
