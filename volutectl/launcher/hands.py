"""The gate's hands: everything it has done to a turn that needs root, behind one port.

The gate decides (admission, the store, liveness); what must be done as root is a
`TurnHands`: start a turn (its directory, the fork, its scope, the release), offer a
folded delivery into its inbox, interrupt or stop its scope, read from its directory how
it ran, and remove directories. Two implementations:

- `LocalHands` does it in this process: volutectl/launcher/fork.py and the systemd manager.
  It is what volute-launcher.service runs (volutectl/launcher/service.py), and what a gate
  uses when no launcher socket is configured (a root gate run by hand, the unit tests).
- `RemoteHands` gives the same orders to volute-launcher over its socket
  (volutectl/wire/orders.py): the gate itself then holds no privilege.

Failures, as the gate must read them:
- a VoluteError (e.g. a `Refused` reply): the order was not carried out; for a start,
  the turn never ran;
- `LauncherUnavailable`: the launcher could not be reached; nothing was sent;
- `LauncherLost`: the connection broke while an order was under way: it may or may not
  have been carried out. A start that ends so is a turn whose fate only systemd knows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from volutectl import events, names
from volutectl.config.reload import SettingsHolder
from volutectl.config.settings import Settings, parse_bandwidth
from volutectl.errors import DataError, SystemdNoAnswer, UnavailableError, VoluteError
from volutectl.faults import crash_point
from volutectl.kernel import dirfds, processes
from volutectl.kernel.written import Written
from volutectl.kernel.written import cgroup_written as written_now
from volutectl.launcher import fork, preflight, turndir
from volutectl.systemd.journal import Journal
from volutectl.systemd.port import ScopeProperties, SystemdManager
from volutectl.wire import orders

if TYPE_CHECKING:
    from volutectl.launcher.moves import Mover

R = TypeVar("R", bound=orders.OrderReply)

# systemd's RuntimeMaxSec= backstop fires this long after the gate's own deadline (plus
# the kill grace; less for limits shorter than this), so that with the gate up its own
# timer decides.
BACKSTOP_MARGIN_SECONDS = 30.0
# How long the gate waits for the launcher's reply: a start waits for systemd's job
# (the manager's own timeout is 10 s); anything else reads or writes one directory.
START_TIMEOUT_SECONDS = 20.0
ORDER_TIMEOUT_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 2.0
# A sample reads /proc and the cgroup files: the gate's loop waits for it, so not long.
SAMPLE_TIMEOUT_SECONDS = 1.0


class LauncherUnavailable(UnavailableError):
    """The launcher's socket could not be reached: no order was sent."""


class LauncherLost(UnavailableError):
    """The connection to the launcher broke mid-order: its outcome is unknown."""


@dataclass(frozen=True)
class Launched:
    """A started turn's main process; `pidfd` is the caller's to watch and close."""

    pid: int
    pidfd: int


class TurnHands(Protocol):
    def ensure(self) -> None:
        """Raise LauncherUnavailable unless orders can be given now."""

    def start(self, order: orders.StartTurn, stdin: bytes) -> Launched: ...

    def start_lease(self, order: orders.StartLease) -> Launched:
        """Start a lease's scope, held by a placeholder process as the mind's user."""
        ...

    def offer(self, order: orders.Offer, record: bytes) -> None: ...

    def interrupt(self, turn_id: int, mind: str) -> None: ...

    def stop(self, turn_id: int, mind: str) -> None: ...

    def inspect(self, turn_id: int, folded: Sequence[int]) -> orders.Report: ...

    def sample(self, turn_ids: Sequence[int]) -> dict[int, Written]:
        """What each running turn's processes have written so far, and whether one waits
        on the disk now, for those it can read (volutectl/kernel/written.py)."""
        ...

    def remove(self, turn_id: int) -> None: ...

    def sweep(self, open_ids: Sequence[int]) -> None: ...

    def move_in(self, order: orders.MoveIn, pidfds: Sequence[int]) -> orders.Moved:
        """Move a lease's processes (by pidfd, the caller's to close) into its scope,
        after the launcher's own checks (volutectl/launcher/moves.py)."""
        ...

    def move_back(self, turn_id: int, mind: str) -> None:
        """Move lease `turn_id`'s processes back where they came from (idempotent)."""
        ...

    def close(self) -> None: ...


def scope_properties(settings: Settings, mind: str, session: str, turn_id: int) -> ScopeProperties:
    """The turn scope's properties, with systemd's runtime backstop for its time limit."""
    turns = settings.turns
    max_runtime = settings.max_runtime(mind)
    backstop = None
    if max_runtime:
        grace = turns.timeout_grace_seconds
        backstop = max_runtime + grace + min(BACKSTOP_MARGIN_SECONDS, max_runtime)
    return ScopeProperties(
        slice=turns.slice,
        description=f"volute turn {turn_id} of {mind}/{session}",
        cpu_weight=turns.cpu_weight,
        io_weight=turns.io_weight,
        io_read_bandwidth_max=tuple(parse_bandwidth(v) for v in turns.io_read_bandwidth_max),
        io_write_bandwidth_max=tuple(parse_bandwidth(v) for v in turns.io_write_bandwidth_max),
        runtime_max_seconds=backstop,
        stop_timeout_seconds=turns.timeout_grace_seconds,
    )


class LocalHands:
    """The orders carried out in this process (root, or the test's own user)."""

    def __init__(
        self,
        held: SettingsHolder,
        manager: SystemdManager,
        journal: Journal,
    ) -> None:
        self.held = held  # the gate's holder, or the launcher's (which reads its file again)
        self.manager = manager
        self.journal = journal
        self.accounts: dict[str, fork.Account] = {}
        self.accounts_of: Settings | None = None
        # Turns forked here and not yet reaped, and how those reaped ended: the wrapper
        # records the command's status, this the wrapper's own (e.g. SIGKILLed).
        self.children: dict[int, int] = {}
        self.units: dict[int, str] = {}  # their scopes, for a sample of what they wrote
        self.statuses: dict[int, int] = {}
        # What each reaped turn wrote to storage, in bytes: the wrapper's rusage, which
        # holds the command's and every process it reaped (the adaptive limit's IO
        # cost per mind, volutectl/core/iocost.py); on any cgroup hierarchy.
        self.written: dict[int, int] = {}
        self.trash_waiting = False  # something was set aside in turns/.trash
        # Each turn's directory a tmpfs of these bounds (the launcher sets them; a test's
        # hands, not root, make plain directories).
        self.turn_dir_bounds: turndir.Bounds | None = None
        self._mover: Mover | None = None

    def ensure(self) -> None:
        pass

    @property
    def mover(self) -> Mover:
        """The leases' processes' mover (volutectl/launcher/moves.py), made on first use."""
        if self._mover is None:
            from volutectl.launcher.moves import Mover

            self._mover = Mover(self)
        return self._mover

    def move_in(self, order: orders.MoveIn, pidfds: Sequence[int]) -> orders.Moved:
        return self.mover.move_in(order, pidfds)

    def move_back(self, turn_id: int, mind: str) -> None:
        self.mover.move_back(turn_id, mind)

    def turn_dir(self, turn_id: int) -> fork.TurnDir:
        return fork.TurnDir(self.held.current.gate.runtime_dir / "turns" / str(turn_id))

    def account_of(self, settings: Settings, mind: str) -> fork.Account:
        """The mind's user, looked up once per configuration: NSS lookups would sit on
        every handoff."""
        if self.accounts_of is not settings:
            self.accounts, self.accounts_of = {}, settings
        account = self.accounts.get(mind)
        if account is None:
            if mind not in settings.minds:
                # An order naming a mind the launcher's config lacks (a gate taken over,
                # or one whose config was read before the mind went) is refused; it must
                # not end the launcher, with every other turn's order, on a KeyError.
                raise DataError(f"mind {mind!r} is not configured for the launcher")
            configured = settings.minds[mind].user
            account = fork.resolve_account(configured or settings.turns.default_user)
            self.accounts[mind] = account
        return account

    def start(self, order: orders.StartTurn, stdin: bytes) -> Launched:
        """Make the turn's directory, fork its child, have systemd put it in its scope,
        release it. On any failure the child (if forked) exits unreleased, the
        directory is removed, and the error is raised: the command never ran."""
        settings = self.held.current
        mind = settings.minds.get(order.mind)
        if mind is None:
            raise DataError(f"mind {order.mind!r} is not configured for the launcher")
        if mind.command is None:
            raise DataError(f"mind {order.mind} has no command: it takes leases only")
        command = mind.command
        unit = names.turn_scope_name(order.mind, order.turn_id)
        child = None
        try:
            account = self.account_of(settings, order.mind)
            cwd = preflight.turn_directory(order.mind, mind, account)  # before anything is made
            extra = fork.mind_environment(mind.environment, mind.environment_file)
            if preflight.uses_own_home(mind, account):
                extra = {"HOME": cwd, **extra}  # not the user's /nonexistent
            turn_dir = fork.make_turn_dir(
                settings.gate.runtime_dir, order.turn_id, account, self.turn_dir_bounds
            )
            env = fork.turn_environment(
                account,
                mind=order.mind,
                session=order.session,
                turn_id=order.turn_id,
                delivery_ids=order.delivery_ids,
                turn_dir=turn_dir,
                extra=extra,
            )
            stream = self.journal.turn_stream(order.mind, unit)
            argv = fork.command_argv(command)
            child = fork.fork_turn(argv, env, account, turn_dir, cwd, stream, stdin=stdin)
            crash_point("forked")
            props = scope_properties(settings, order.mind, order.session, order.turn_id)
            self.manager.start_scope(unit, [child.pid], props)
            crash_point("scope_started")
            child.release()
            crash_point("released")
        except (VoluteError, OSError, KeyError, ValueError) as error:
            self._abandon(child)
            self._remove_dir(self.turn_dir(order.turn_id))
            if isinstance(error, VoluteError):
                raise
            raise VoluteError(str(error)) from None
        except BaseException:
            # Going down mid-start: the child must not wait for us. Its pipe closes, and
            # it exits having run nothing, as it would if this process died.
            self._abandon(child)
            raise
        self.children[order.turn_id] = child.pid
        self.units[order.turn_id] = names.turn_scope_name(order.mind, order.turn_id)
        return Launched(child.pid, child.pidfd)

    def start_lease(self, order: orders.StartLease) -> Launched:
        """A lease's scope: its placeholder forked, put in the scope (the turns' weights,
        no RuntimeMaxSec=: systemd would kill the daemon's processes moved into it; the
        gate stops it at the time limit), then released to become the mind's user."""
        settings = self.held.current
        if order.mind not in settings.minds:
            raise DataError(f"mind {order.mind!r} is not configured for the launcher")
        unit = names.turn_scope_name(order.mind, order.turn_id)
        child = None
        try:
            account = self.account_of(settings, order.mind)
            child = fork.fork_placeholder(account)
            props = dataclasses.replace(
                scope_properties(settings, order.mind, order.session, order.turn_id),
                description=f"volute lease {order.turn_id} of {order.mind}/{order.session}",
                runtime_max_seconds=None,
            )
            self.manager.start_scope(unit, [child.pid], props)
            child.release()
        except (VoluteError, OSError, KeyError, ValueError) as error:
            self._abandon(child)
            if isinstance(error, VoluteError):
                raise
            raise VoluteError(str(error)) from None
        except BaseException:
            self._abandon(child)
            raise
        self.children[order.turn_id] = child.pid  # reaped as a turn's child is
        # A scope this launcher started: the one scope a MoveIn of this lease may target
        # (volutectl/launcher/moves.py); and sampled for what its processes write.
        self.units[order.turn_id] = unit
        return Launched(child.pid, child.pidfd)

    @staticmethod
    def _abandon(child: fork.Child | None) -> None:
        if child is None:
            return
        child.abandon()
        with contextlib.suppress(ChildProcessError):
            processes.wait(child.pid)
        os.close(child.pidfd)

    def offer(self, order: orders.Offer, record: bytes) -> None:
        settings = self.held.current
        account = self.account_of(settings, order.mind)
        try:
            fork.offer(self.turn_dir(order.turn_id), order.delivery_id, record, account)
        except OSError as error:
            # Not offered (no marker, or its staged file still there): the turn's
            # report says so when it ends, and the delivery goes to the next turn.
            raise VoluteError(f"its inbox refused it: {error.strerror or error}") from None

    def interrupt(self, turn_id: int, mind: str) -> None:
        self.manager.kill_unit(names.turn_scope_name(mind, turn_id), signal.SIGINT)

    def stop(self, turn_id: int, mind: str) -> None:
        self.manager.stop_unit(names.turn_scope_name(mind, turn_id), wait=False)

    def reap(self) -> None:
        """Collect the children that have exited (no wait), and what each wrote."""
        for turn_id, pid in list(self.children.items()):
            try:
                ended = processes.poll_written(pid)
            except ChildProcessError:
                ended = None
                del self.children[turn_id]
                self.units.pop(turn_id, None)
            if ended is not None:
                self.statuses[turn_id], self.written[turn_id] = ended
                del self.children[turn_id]
                self.units.pop(turn_id, None)

    def inspect(self, turn_id: int, folded: Sequence[int]) -> orders.Report:
        self.reap()
        turn_dir = self.turn_dir(turn_id)
        record = turn_dir.record()
        status = self.statuses.get(turn_id)
        return orders.Report(
            started=record.started,
            exit_status=status if status is not None else record.exit_status,
            ended_at=record.ended_at,
            not_taken=tuple(sorted(turn_dir.not_taken(list(folded)))),
            written_bytes=self.written.get(turn_id),
        )

    def sample(self, turn_ids: Sequence[int]) -> dict[int, Written]:
        found: dict[int, Written] = {}
        for turn_id in turn_ids:
            pid, unit = self.children.get(turn_id), self.units.get(turn_id)
            written = written_now(pid, unit) if pid is not None and unit is not None else None
            if written is not None:
                found[turn_id] = written
        return found

    def remove(self, turn_id: int) -> None:
        self.statuses.pop(turn_id, None)
        self.written.pop(turn_id, None)
        self._remove_dir(self.turn_dir(turn_id))

    def _remove_dir(self, turn_dir: fork.TurnDir) -> None:
        """Remove a turn's directory within its budget. What is left waits in
        turns/.trash, and is tried again, within the same budget, after each later
        removal, and at the next sweep. Never fails the order it serves."""
        try:
            left = turn_dir.remove()
        except OSError as error:
            self.journal.emit(
                events.TurnDirectoryNotRemoved(
                    path=str(turn_dir.path), error=str(error.strerror or error)
                )
            )
            return
        if left is not None:
            self.journal.emit(events.TurnDirectorySetAside(path=str(turn_dir.path), left=str(left)))
            self.trash_waiting = True
        elif self.trash_waiting:
            budget = dirfds.Budget(turndir.REMOVE_ENTRIES, turndir.REMOVE_SECONDS)
            swept = turndir.empty_trash(self.held.current.gate.runtime_dir, budget)
            self.trash_waiting = bool(swept.left or swept.errors)

    def sweep(self, open_ids: Sequence[int]) -> None:
        """Directories of turns already settled (a gate killed after settling a turn and
        before removing its directory leaves one behind), and those set aside before:
        within a budget, never failing."""
        keep = set(open_ids)
        for turn_id in [t for t in self.statuses if t not in keep]:
            del self.statuses[turn_id]
        runtime_dir = self.held.current.gate.runtime_dir
        sweep = turndir.sweep_turn_dirs(runtime_dir, keep)
        self.mover.sweep(open_ids)  # leases that ended while the gate was away
        self.trash_waiting = bool(sweep.left)
        for error in sweep.errors:
            self.journal.emit(events.SweepFailed(error=error))
        if sweep.left:
            trash = runtime_dir / "turns" / turndir.TRASH
            self.journal.emit(events.TrashLeft(trash=str(trash), left=tuple(sweep.left)))

    def close(self) -> None:
        pass


class RemoteHands:
    """The orders given to volute-launcher over its socket, one at a time.

    Connected on first use and again after a failure; each new connection first sends a
    sweep of the turns the gate does not hold open (`open_ids`), so that directories a
    lost order or a dead gate left behind go."""

    def __init__(self, path: Path, open_ids: Callable[[], Sequence[int]]) -> None:
        self.path = path
        self.open_ids = open_ids
        self.sock: socket.socket | None = None
        self.reader = orders.LineReader()

    def ensure(self) -> None:
        if self.sock is not None and orders.peer_gone(self.sock):
            self._drop()  # a launcher restarted between two orders: a new connection
        if self.sock is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(CONNECT_TIMEOUT_SECONDS)
        try:
            sock.connect(str(self.path))
        except OSError as error:
            sock.close()
            raise LauncherUnavailable(
                f"the launcher does not answer at {self.path}: {error.strerror or error}",
                hint="systemctl status volute-launcher.socket volute-launcher.service",
            ) from None
        self.sock, self.reader = sock, orders.LineReader()
        try:
            self._exchange(orders.Sweep(tuple(self.open_ids())))
        except LauncherLost as error:
            raise LauncherUnavailable(error.message, hint=error.hint) from None
        except VoluteError as error:
            if self.sock is None or orders.peer_gone(self.sock):  # refused us altogether
                self._drop()
                raise LauncherUnavailable(
                    f"the launcher refused the gate: {error.message}"
                ) from None
            # else refused the sweep only: the directories wait for the next one

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.reader.close()

    def ask(
        self,
        order: orders.Order[R],
        payload: bytes | None = None,
        timeout: float = ORDER_TIMEOUT_SECONDS,
        passed: Sequence[int] = (),
    ) -> R:
        """Give one order and read its reply: the reply the order declares
        (`Order[ThatReply]`), with the descriptor that came beside it if it has one. A
        `Refused` is raised; any other reply is a launcher lost. `passed`: descriptors
        of the caller's that go with the line (a MoveIn's pidfds; the caller closes
        them)."""
        self.ensure()
        return self._exchange(order, payload, timeout, passed)

    def _exchange(
        self,
        order: orders.Order[R],
        payload: bytes | None = None,
        timeout: float = ORDER_TIMEOUT_SECONDS,
        passed: Sequence[int] = (),
    ) -> R:
        assert self.sock is not None
        sock, reader = self.sock, self.reader
        fd = orders.payload_fd(payload, order.ORDER) if payload is not None else None
        try:
            sock.settimeout(timeout)
            fds = (*passed, *(() if fd is None else (fd,)))
            orders.send_line(sock, orders.encode(order), fds)
            deadline = time.monotonic() + timeout
            while (line := reader.line()) is None:
                if reader.eof:
                    raise ConnectionResetError("the launcher closed the connection")
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                reader.receive(sock)
            reply = orders.decode_reply(line)
            if reply.FDS:
                reply = reply.with_fd(reader.take_fd())
        except (OSError, orders.OrderError) as error:
            self._drop()
            text = error.message if isinstance(error, VoluteError) else str(error)
            raise LauncherLost(f"the launcher was lost during a {order.ORDER}: {text}") from None
        finally:
            if fd is not None:
                os.close(fd)
        if isinstance(reply, orders.Refused):
            raise SystemdNoAnswer(reply.error) if reply.no_answer else VoluteError(reply.error)
        expected = order.answer()
        if not isinstance(reply, expected):
            for kept in reply.descriptors():
                os.close(kept)
            self._drop()
            raise LauncherLost(f"the launcher answered a {order.ORDER} with a {reply.REPLY}")
        return reply

    def start(self, order: orders.StartTurn, stdin: bytes) -> Launched:
        reply = self.ask(order, stdin, START_TIMEOUT_SECONDS)
        if reply.pidfd is None:  # pragma: no cover - with_fd gave it one
            raise LauncherLost("the launcher's start came with no descriptor")
        return Launched(reply.pid, reply.pidfd)

    def start_lease(self, order: orders.StartLease) -> Launched:
        reply = self.ask(order, None, START_TIMEOUT_SECONDS)
        if reply.pidfd is None:  # pragma: no cover - with_fd gave it one
            raise LauncherLost("the launcher's start came with no descriptor")
        return Launched(reply.pid, reply.pidfd)

    def offer(self, order: orders.Offer, record: bytes) -> None:
        self.ask(order, record)

    def interrupt(self, turn_id: int, mind: str) -> None:
        self.ask(orders.Interrupt(turn_id, mind))

    def stop(self, turn_id: int, mind: str) -> None:
        self.ask(orders.Stop(turn_id, mind))

    def inspect(self, turn_id: int, folded: Sequence[int]) -> orders.Report:
        return self.ask(orders.Inspect(turn_id, tuple(folded)))

    def sample(self, turn_ids: Sequence[int]) -> dict[int, Written]:
        reply = self.ask(orders.Sample(tuple(turn_ids)), timeout=SAMPLE_TIMEOUT_SECONDS)
        if len(reply.turn_ids) != len(reply.written):
            self._drop()
            raise LauncherLost("the launcher answered a sample with lists of two lengths")
        blocked = set(reply.blocked)
        return {
            turn_id: Written(count, turn_id in blocked)
            for turn_id, count in zip(reply.turn_ids, reply.written, strict=True)
        }

    def remove(self, turn_id: int) -> None:
        self.ask(orders.Remove(turn_id))

    def sweep(self, open_ids: Sequence[int]) -> None:
        self.ask(orders.Sweep(tuple(open_ids)))

    def move_in(self, order: orders.MoveIn, pidfds: Sequence[int]) -> orders.Moved:
        reply = self.ask(order, passed=pidfds)
        if len(reply.moved) != len(reply.origins):
            self._drop()
            raise LauncherLost("the launcher answered a move_in with lists of two lengths")
        return reply

    def move_back(self, turn_id: int, mind: str) -> None:
        self.ask(orders.MoveBack(turn_id, mind))

    def close(self) -> None:
        self._drop()
