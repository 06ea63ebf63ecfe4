"""A tiny gate peer for client tests: a real unix socket, served from a thread.

It speaks the wire protocol (it is the other end of the socket, not a stand-in for
systemd): for each connection it reads one request line, records it, and writes the
scripted reply lines.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import Any


def short_socket_dir() -> Path:
    """A directory for sockets: sun_path holds only 108 bytes, pytest's tmp_path may not."""
    path = Path(tempfile.mkdtemp(prefix="vg-", dir="/tmp"))
    os.chmod(path, 0o755)
    return path


class FakeGate:
    def __init__(self, path: Path, replies: list[dict[str, Any] | bytes]) -> None:
        self.path = path
        self.replies = replies
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
            self.connections += 1
            with conn:
                conn.settimeout(10)
                buffer = b""
                while b"\n" not in buffer:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    buffer += chunk
                if b"\n" not in buffer:
                    continue
                self.requests.append(json.loads(buffer.split(b"\n", 1)[0]))
                for reply in self.replies:
                    if isinstance(reply, bytes):
                        conn.sendall(reply)
                    else:
                        conn.sendall(json.dumps({"v": 1, **reply}).encode() + b"\n")

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
