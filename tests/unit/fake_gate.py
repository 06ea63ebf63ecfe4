"""A tiny gate peer for client tests: a real unix socket, served from a thread.

It speaks the wire protocol (it is the other end of the socket, not a stand-in for
systemd): for each connection it reads one request line, records it, and writes the
scripted reply lines.

`scripts` plays a gate that dies mid-request: the n-th connection follows scripts[n]
(later ones get `replies`). A script is a list of replies, or one of
- "eof": read the request, then close without a reply (the client reads EOF);
- "reset": peek at the request, then close with it unread (the client reads ECONNRESET).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

Reply = dict[str, Any] | bytes
Script = Sequence[Reply] | Literal["eof", "reset"]


def short_socket_dir() -> Path:
    """A directory for sockets: sun_path holds only 108 bytes, pytest's tmp_path may not."""
    path = Path(tempfile.mkdtemp(prefix="vg-", dir="/tmp"))
    os.chmod(path, 0o755)
    return path


class FakeGate:
    def __init__(
        self, path: Path, replies: Sequence[Reply], *, scripts: list[Script] | None = None
    ) -> None:
        self.path = path
        self.replies = replies
        self.scripts = list(scripts or [])
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.listener.settimeout(0.2)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            script: Script = (
                self.scripts[self.connections]
                if self.connections < len(self.scripts)
                else self.replies
            )
            self.connections += 1
            with conn:
                conn.settimeout(10)
                line = self._read_line(conn, consume=script != "reset")
                if line is None:
                    continue
                self.requests.append(json.loads(line))
                if isinstance(script, str):
                    continue  # close now: unread data makes the client's read ECONNRESET
                for reply in script:
                    if isinstance(reply, bytes):
                        conn.sendall(reply)
                    else:
                        conn.sendall(json.dumps({"v": 1, **reply}).encode() + b"\n")

    @staticmethod
    def _read_line(conn: socket.socket, *, consume: bool) -> bytes | None:
        buffer = b""
        while b"\n" not in buffer:
            if consume:
                chunk = conn.recv(65536)
                if not chunk:
                    return None
                buffer += chunk
            else:
                # Peeked data stays readable, so select() cannot wait for more of it.
                if buffer:
                    time.sleep(0.01)
                select.select([conn], [], [], 10)
                buffer = conn.recv(1 << 20, socket.MSG_PEEK)
                if not buffer:
                    return None
        return buffer.split(b"\n", 1)[0]

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        self.listener.close()

    def __enter__(self) -> FakeGate:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
