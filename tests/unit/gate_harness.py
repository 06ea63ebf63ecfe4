"""The real Gate, in this process, on real sockets and a real SQLite file, driven step by
step by the test: `Harness.pump()` calls gate.step() until what the test waits for has
happened. systemd is tests/unit/fake_systemd.py; turns are real forked processes.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pwd
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tests.unit.fake_clock import FakeClock
from tests.unit.fake_gate import remove_tree, short_socket_dir
from tests.unit.fake_systemd import FakeManager
from volutectl.clock import SYSTEM, Clock
from volutectl.config.reload import SettingsHolder
from volutectl.config.settings import Settings
from volutectl.events import BaseEvent
from volutectl.gate.adaptive import Sensor
from volutectl.gate.cpu import CpuSignal
from volutectl.gate.loop import Gate
from volutectl.launcher.hands import LocalHands
from volutectl.launcher.service import Launcher
from volutectl.states import QueueState
from volutectl.systemd.journal import Journal

E = TypeVar("E", bound=BaseEvent)

ME = pwd.getpwuid(os.getuid()).pw_name


class RecordingJournal(Journal):
    """The gate's journal, kept in lists for the test to read: the events emitted
    (`events`, `of`), and every entry as (level, message, fields) (`entries`)."""

    def __init__(self) -> None:
        super().__init__("volute-gate-test")
        self.sender = None  # never the real journal
        self.stdout_socket = None  # turns keep the test's stdout and stderr
        self.entries: list[tuple[str, str, dict[str, Any]]] = []
        self.events: list[BaseEvent] = []

    def emit(self, event: BaseEvent) -> None:
        self.events.append(event)
        super().emit(event)

    def log(self, level: str, message: str, **fields: Any) -> None:
        self.entries.append((level, message, fields))

    def of(self, kind: type[E]) -> list[E]:
        """The events of one type, in the order emitted."""
        return [event for event in self.events if isinstance(event, kind)]

    def messages(self, level: str | None = None) -> list[str]:
        return [text for lvl, text, _ in self.entries if level is None or lvl == level]


def gate_settings(
    state: Path,
    socket_path: Path,
    *,
    minds: dict[str, str] | None = None,
    limits: dict[str, Any] | None = None,
    turns: dict[str, Any] | None = None,
    **gate: Any,
) -> Settings:
    """Settings for a gate under `state`; minds map name -> shell command, run as us;
    `limits` and `turns` are those sections, the other keywords the [gate] section."""
    commands = minds if minds is not None else {"mimsy": "true"}
    return Settings(
        limits=limits or {},
        turns=turns or {},
        gate={
            "socket": socket_path,
            "socket_group": ME,
            "state_dir": state / "state",
            "runtime_dir": state / "run",
            "watchdog": False,
            **gate,
        },
        minds={name: {"command": command, "user": ME} for name, command in commands.items()},
    )


class Peer:
    """A client connection, non-blocking so that one thread can drive gate and client."""

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(harness.socket_path))
        self.sock.setblocking(False)
        self.buffer = b""
        self.eof = False

    def send(self, data: bytes, timeout: float = 10.0) -> None:
        """Send all of `data`, stepping the gate whenever the socket is full."""
        view = memoryview(data)
        deadline = time.monotonic() + timeout
        while view:
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the gate took no more after {timeout} s") from None
                self.harness.step(0.01)

    def request(self, message: dict[str, Any] | bytes, timeout: float = 10.0) -> dict[str, Any]:
        line = message if isinstance(message, bytes) else json.dumps({"v": 1, **message}).encode()
        self.send(line + b"\n")
        return self.reply(timeout)

    def _receive(self) -> None:
        while not self.eof:
            try:
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:
                return
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.eof = True
            self.buffer += chunk

    def has_line(self) -> bool:
        self._receive()
        return b"\n" in self.buffer

    def closed_by_gate(self) -> bool:
        self._receive()
        return self.eof

    def reply(self, timeout: float = 10.0) -> dict[str, Any]:
        self.harness.pump(lambda: self.has_line() or self.eof, timeout)
        if b"\n" not in self.buffer:
            raise AssertionError("the gate closed the connection without a reply")
        line, self.buffer = self.buffer.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        self.sock.close()


class LauncherThread:
    """volutectl/launcher/service.py's order loop in a thread of this process, on a real
    socket, carrying out orders with the harness's fake systemd.

    Not for tests of signals in turns: a child forked from a thread other than the main
    one cannot reset its signal dispositions in Python, so its stop signals stay
    ignored (the real launcher forks from its main thread)."""

    def __init__(self, settings: Settings, manager: FakeManager, path: Path) -> None:
        self.path = path
        self.journal = RecordingJournal()
        self.hands = LocalHands(SettingsHolder(settings), manager, self.journal)
        self.thread: threading.Thread | None = None
        self.start()

    def start(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.listener.bind(str(self.path))
        self.listener.listen(8)
        self.stop_read, self.stop_write = os.pipe()
        self.launcher = Launcher(self.hands, self.listener, self.journal, frozenset({os.getuid()}))
        self.thread = threading.Thread(target=self.launcher.serve, args=(self.stop_read,))
        self.thread.start()

    def stop(self) -> None:
        """Stop serving (after the order under way), as `systemctl stop` does."""
        if self.thread is None:
            return
        os.write(self.stop_write, b"x")
        self.thread.join(10)
        self.thread = None
        self.listener.close()
        os.close(self.stop_read)
        os.close(self.stop_write)


CPU_PSI = (
    "some avg10=0.00 avg60=0.00 avg300=0.00 total={}\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)


class Harness:
    """`clock`: the gate's clock. A FakeClock stands still but when the test moves it
    (`advance`), so deadlines, backoffs and readings come exactly then; turns, sockets
    and `pump`'s timeout stay on the real clock."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        start: bool = True,
        remote: bool = False,
        clock: Clock = SYSTEM,
        sensor: Sensor | None = None,
        cpus: int = 16,
        **options: Any,
    ) -> None:
        self.clock = clock
        self.sensor = sensor
        # The CPUs' PSI: a file of the test's, quiet unless a test writes to it (the
        # host's would hold turns back as the machine's other work stalls it), read with
        # `cpus` CPUs whatever the host has. A gate that starts bounds the turns at once
        # to one per CPU (volutectl/core/cpu.py) until calm readings double it: 16, the
        # default maximum, leaves the CPUs' bound out of every test but those of it
        # (tests/unit/test_cpu.py, with 2).
        self.cpus = cpus
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.cpu_file = tmp_path / "cpu.pressure"
        self.cpu_file.write_text(CPU_PSI.format(0))
        self.socket_dir = short_socket_dir()
        self.socket_path = self.socket_dir / "gate.sock"
        self.journal = RecordingJournal()
        self.manager = FakeManager()
        self.launcher: LauncherThread | None = None
        if remote:  # the gate gives its orders to a launcher, over its socket
            options["launcher_socket"] = self.socket_dir / "launcher.sock"
        self.settings = gate_settings(tmp_path, self.socket_path, **options)
        if remote:
            path = self.socket_dir / "launcher.sock"
            self.launcher = LauncherThread(self.settings, self.manager, path)
        self.peers: list[Peer] = []
        self.steps = 0
        if start:
            self.restart()

    def step(self, timeout: float | None) -> None:
        self.steps += 1
        self.gate.step(timeout)

    def pump(self, until: Callable[[], bool], timeout: float = 10.0, tick: float = 0.02) -> None:
        """Step the gate until `until()` holds; fail after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {until}")
            # As the real loop: the gate's own timeout (which also arms its backoff
            # wake-up), cut to `tick` so that `until` is asked often.
            wait = self.gate.timeout()
            self.step(tick if wait is None else min(wait, tick))

    def advance(self, seconds: float) -> None:
        """Move the fake clock on by `seconds`, as the real loop would live them: to each
        deadline of the gate's on the way, with a pass there, and a pass at the end."""
        clock = self.clock
        assert isinstance(clock, FakeClock), "advance() moves a FakeClock"
        # A hair more: a wall-clock deadline, turned into the monotonic clock, may land a
        # rounding error (1e-7 s near 2026's epoch seconds) after the moment it names.
        end = clock.monotonic() + seconds + 1e-6
        self.step(0)
        while (left := end - clock.monotonic()) > 0:
            timeout = self.gate.timeout()
            # A deadline that stays due until a pass takes it asks for no sleep: a tick.
            clock.advance(left if timeout is None else min(max(timeout, 0.001), left))
            self.step(0)

    def run_for(self, seconds: float) -> None:
        """Step as the real loop does (sleeping until the gate's own deadline), for a
        while of the real clock: for tests whose point is the real clock."""
        assert not isinstance(self.clock, FakeClock), "on a FakeClock: advance()"
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            timeout = self.gate.timeout()
            self.step(left if timeout is None else min(timeout, left))

    def connect(self) -> Peer:
        peer = Peer(self)
        self.peers.append(peer)
        return peer

    def deliver_ok(self, peer: Peer | None = None, mind: str = "mimsy") -> int:
        """A good request: deliver a message, get its id, and find its row in the store."""
        peer = peer or self.connect()
        reply = peer.request({"op": "deliver", "mind": mind, "message": "good"})
        assert reply.get("ok") is True and type(reply.get("id")) is int, reply
        assert self.gate.state.store.row(reply["id"]) is not None
        return int(reply["id"])

    def crash(self) -> None:
        """What the gate's death leaves: its descriptors closed, nothing tidied (the
        socket file, turn directories and systemd's scopes stay). systemd (the fake)
        lives on, and so do the turns' processes."""
        gate = self.gate
        # Shut down, not only closed: a turn forked from this process (the harness's
        # hands are in-process, where the real launcher is another process) and not yet
        # exec'd holds a copy of every descriptor: of a client's, whose peer would see no
        # end until that child execs (on a loaded machine, a while later), and of the
        # listener, which a new gate would find still served.
        for client in list(gate.server.clients.values()):
            with contextlib.suppress(OSError):
                client.sock.shutdown(socket.SHUT_RDWR)
            client.sock.close()
        with contextlib.suppress(OSError):
            gate.server.listener.shutdown(socket.SHUT_RDWR)
        gate.server.listener.close()
        for turn in gate.state.turns.all():
            if turn.pidfd >= 0:
                os.close(turn.pidfd)
        gate.state.slots.close()
        if gate.state.adaptive is not None:
            gate.state.adaptive.close()  # its worker thread: in this process, not the gate's
        gate.state.store.close()
        gate.state.turns.hands.close()
        gate.reactor.close()

    def restart(self) -> None:
        """A (new) gate on the state directory, socket and systemd of this harness."""
        self.gate = Gate(
            self.settings,
            manager=self.manager,
            journal=self.journal,
            clock=self.clock,
            sensor=self.sensor,
            cpu=CpuSignal(self.settings, True, given=self.cpu_file, cpus=self.cpus),
        )

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        children = [turn.pid for turn in self.gate.state.turns.all() if turn.pid is not None]
        self.gate.close()
        if self.launcher is not None:
            self.launcher.stop()
        for pid in children:  # turns outlive the gate; a test's turns must not
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        reap_children()
        remove_tree(self.socket_dir)


def reap_children() -> None:
    """Reap the children that have ended (turns of a crashed gate, whose new gate adopts
    them by PID and cannot wait for them)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def settled(harness: Harness) -> bool:
    """Nothing pending or running any more."""
    store = harness.gate.state.store
    return not store.list_rows([QueueState.PENDING, QueueState.RUNNING])


@contextmanager
def effective_uid(uid: int) -> Iterator[None]:
    """Act as `uid` (the effective uid, which SO_PEERCRED reports) for a while: root's."""
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)


def connect_as(harness: Harness, uid: int) -> Peer:
    """A client of the harness's gate that connected as `uid`."""
    with effective_uid(uid):
        return harness.connect()


class Turns:
    """The turn probe's log (volute_testbed.turn_probe), read back."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[list[str]]:
        if not self.path.exists():
            return []
        return [line.split() for line in self.path.read_text().splitlines() if line]

    def runs(self) -> collections.Counter[int]:
        """How many turns that exited 0 each delivery id reached."""
        got: dict[str, list[int]] = collections.defaultdict(list)
        codes: dict[str, str] = {}
        for fields in self.lines():
            if fields[0] == "start":
                got[fields[3]] += [int(x) for x in fields[5:]]
            elif fields[0] == "took":
                got[fields[3]].append(int(fields[4]))
            elif fields[0] == "end":
                codes[fields[3]] = fields[4]
        return collections.Counter(i for turn, ids in got.items() if codes.get(turn) == "0"
                                   for i in ids)  # fmt: skip

    def started(self) -> int:
        return sum(1 for fields in self.lines() if fields[0] == "start")
