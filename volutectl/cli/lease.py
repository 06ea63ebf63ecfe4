"""`volutectl lease MIND [-- CMD...]`: hold a place in the gate's admission while a
command runs, or until stdin closes; `volutectl lease --end ID`: an admin ends a lease.

The connection is volutectl/cli/leasing.py's. Here: what runs under the lease.
- With CMD and no --pid, CMD runs in the lease's scope: it is forked first and held
  (blocked on a pipe) before its exec; its pidfd goes with the acquire, so the gate's
  launcher moves it into the scope; it execs once granted. If the gate will not move it
  (77: only the mind's user or an admin may move processes) CMD never runs.
- With --pid, the named processes move (their pidfds go with the acquire, SCM_RIGHTS),
  and CMD, if any, runs where it is once granted.
- Without CMD: the lease's id and unit on stdout, then hold until stdin closes.

CMD's exit status is the command's (128+N after signal N). If the lease ends under CMD
(`lease_ended`: its time limit, an admin, its scope gone), CMD is told with SIGTERM,
killed LEASE_END_GRACE seconds later if it is still there, and volutectl exits
LEASE_ENDED_EXIT (75): a command that runs on without its place would defeat the limit.
SIGTERM and SIGHUP are passed on to CMD (SIGINT too, unless the terminal sent it to CMD
itself); volutectl releases the lease when CMD exits. Without CMD they release at once.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

import click

from volutectl.cli.completion import complete_minds, complete_pids
from volutectl.cli.deliver import socket_path
from volutectl.cli.leasing import Holder, LeaseGone, end_lease
from volutectl.cli.options import config_option
from volutectl.errors import (
    EX_DATAERR,
    EX_NOPERM,
    EX_TEMPFAIL,
    LEASE_ENDED_EXIT,
    UsageError,
    VoluteError,
)
from volutectl.names import NameError_, check_mind, check_request_id, check_session
from volutectl.visible import visible
from volutectl.wire.fields import MAX_LEASE_PIDS
from volutectl.wire.messages import LeaseGranted

# After the lease ended under CMD: SIGTERM, then SIGKILL this many seconds later.
LEASE_END_GRACE = 10.0
# The signals passed on to CMD (without CMD: they release the lease, and exit 128+N).
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The exit status of a CMD that could not be run, as a shell's.
EXIT_CANNOT_RUN, EXIT_NOT_FOUND = 126, 127


@click.command("lease")
@click.argument("mind", required=False, shell_complete=complete_minds)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--session", "-s", default="main", show_default=True, help="The mind's session.")
@click.option(
    "--pid",
    "pids",
    multiple=True,
    type=click.IntRange(min=1),
    metavar="PID",
    shell_complete=complete_pids,
    help="A process of the mind's user to move into the lease's scope while it is held "
    f"(repeat it, at most {MAX_LEASE_PIDS}); CMD then runs where it is.",
)
@click.option(
    "--end",
    "end",
    type=click.IntRange(min=1),
    metavar="ID",
    help="End lease ID, whoever holds it (an admin's).",
)
@click.option("--request-id", metavar="ID", help="A name for this request, unique per user.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds the gate may take to answer, and to answer again after a restart.",
)
@click.option("--socket", help="Gate socket.")
@config_option
def lease_command(
    mind: str | None,
    command: tuple[str, ...],
    session: str,
    pids: tuple[int, ...],
    end: int | None,
    request_id: str | None,
    timeout: float,
    socket: str | None,
    config_path: str | None,
) -> int:
    """Hold a lease of MIND's turn (a place under the gate's limits) while COMMAND runs,
    in the lease's scope; without COMMAND, print the lease's id and unit and hold it
    until stdin closes.

    Use `--` before the command: volutectl lease pip -- ./turn.sh. Exits with COMMAND's
    status; 75 if the lease ended under it (COMMAND is stopped); 64 if the gate is too
    old for leases."""
    path = socket_path(socket, config_path)
    if end is not None:
        if mind is not None or command or pids:
            raise UsageError("--end ID takes no MIND, command or --pid")
        end_lease(path, end)
        click.echo(f"ended lease {end}")
        return 0
    if mind is None:
        raise UsageError("give a MIND (or --end ID)", hint="see: volutectl lease --help")
    _check(mind, session, pids, request_id)
    return run_lease(path, mind, session, pids, command, request_id, timeout)


def _check(mind: str, session: str, pids: Sequence[int], request_id: str | None) -> None:
    if len(pids) > MAX_LEASE_PIDS:
        raise UsageError(f"--pid: at most {MAX_LEASE_PIDS} processes per lease, not {len(pids)}")
    try:
        check_mind(mind)
        check_session(session)
        if request_id is not None:
            check_request_id(request_id)
    except NameError_ as error:
        raise VoluteError(str(error), exit_code=EX_DATAERR) from None


def run_lease(
    path: str,
    mind: str,
    session: str,
    pids: Sequence[int],
    command: Sequence[str],
    request_id: str | None,
    timeout: float,
) -> int:
    """Acquire, run or hold, release; the exit status (this module's docstring)."""
    pidfds = open_pidfds(pids)
    child = Held(command) if command else None
    holder = Holder(path, timeout)
    try:
        if child is not None and not pids:
            pidfds.append(child.pidfd)
        try:
            grant = holder.acquire(mind, session, request_id or os.urandom(16).hex(), pidfds)
        except LeaseGone as ended:
            say(f"{ended.words()} before it was granted")
            return LEASE_ENDED_EXIT
        except VoluteError as error:
            if child is not None and not pids:
                raise _not_moved(error, mind) from None
            raise
        finally:
            for fd in pidfds:
                if child is None or fd != child.pidfd:
                    os.close(fd)
        # The signals are caught before the grant is told: whoever acts on the grant's
        # line may signal at once, and a SIGINT this process inherited as ignored (a
        # background job's) would otherwise be lost, leaving the lease held.
        relay = Relay()
        try:
            _tell(grant, mind, session, child is not None, len(pids) or (child is not None))
            return _hold(holder, child, relay)
        finally:
            relay.restore()
    finally:
        if child is not None:
            child.end()
        _release(holder)


def _release(holder: Holder) -> None:
    """Give the lease back. A release that fails is said, not raised: CMD's status is
    the exit's, and a lease whose connection closed ends anyway (at once, or after the
    reclaim window when the gate was away)."""
    try:
        holder.release()
    except VoluteError as error:
        hint = f" ({error.hint})" if error.hint else ""
        say(f"{error.message}{hint}")
    finally:
        holder.close()


def open_pidfds(pids: Sequence[int]) -> list[int]:
    """A pidfd for each pid (what the gate is given: no pid number, no reuse)."""
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                raise VoluteError(f"--pid {pid}: no such process", exit_code=EX_DATAERR) from None
            except OSError as error:
                raise VoluteError(
                    f"--pid {pid}: cannot open it: {error.strerror}", exit_code=EX_DATAERR
                ) from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _not_moved(error: VoluteError, mind: str) -> VoluteError:
    """The gate's refusal to move CMD into the scope, said plainly: CMD did not run. 77:
    not the mind's user; 65 naming `pids[0]`: the process itself does not qualify (in no
    systemd unit, so there is nowhere to return it to)."""
    if error.exit_code == EX_NOPERM:
        hint = (
            f"run it as {mind}'s user (sudo -u USER volutectl lease ...), or hold the "
            "lease with --pid of that user's processes"
        )
    elif error.exit_code == EX_DATAERR and error.message.startswith("pids[0]"):
        hint = (
            "run it from a login session or a service (a systemd unit, where it goes back "
            "when the lease ends), or hold the lease with --pid"
        )
    else:
        return error
    return VoluteError(
        f"the gate will not move the command into {mind}'s lease scope, so it did not "
        f"run: {error.message}",
        hint=hint,
        exit_code=error.exit_code,
    )


def _tell(grant: LeaseGranted, mind: str, session: str, command: bool, moving: int) -> None:
    """Say what was granted: on stdout without CMD (the id and unit, for a script), and
    on stderr when it joined a running turn or moved fewer processes than asked."""
    if not grant.created:
        moved = ", and no process moved" if moving else ""
        say(
            f"lease {grant.lease} joined the running turn {grant.turn_id} of {mind}/{session}: "
            f"no place of its own{moved}"
        )
    elif grant.pids_moved < moving:
        say(
            f"lease {grant.lease}: the gate moved {grant.pids_moved} of the {moving} "
            "processes into its scope"
        )
    if not command:
        print(f"{grant.lease} {visible(grant.unit)}", flush=True)


def say(text: str) -> None:
    print(f"volutectl: {visible(text)}", file=sys.stderr, flush=True)


def _hold(holder: Holder, child: Held | None, relay: Relay) -> int:
    """Hold the lease until CMD exits (its status) or stdin closes (0), or a signal
    (without CMD: 128+N); if the gate ends the lease first, stop CMD: 75. `relay` was
    set before CMD starts: a signal for it from then on is passed on."""
    try:
        if child is not None:
            child.start(holder.grant)
        while True:
            if holder.pending():
                holder.hear()
                continue
            watched = [holder.fileno(), relay.fd, child.pidfd if child else _stdin()]
            ready, _, _ = select.select([fd for fd in watched if fd >= 0], [], [])
            if relay.fd in ready:
                code = _signalled(relay, child)
                if code is not None:
                    return code
            if child is not None and child.pidfd in ready:
                return child.wait()
            if child is None and 0 in ready and _stdin_closed():
                return 0
            if holder.fileno() in ready:
                holder.hear()
    except LeaseGone as ended:
        if child is not None and ended.reason == "pids_exited":
            return child.wait()  # CMD was the lease's process, and it exited
        say(ended.words() + ("; stopping the command" if child else ""))
        if child is not None:
            child.stop(LEASE_END_GRACE)
        return LEASE_ENDED_EXIT


def _signalled(relay: Relay, child: Held | None) -> int | None:
    """Pass on the signals that came; without CMD, the exit status of the first."""
    for number in relay.take():
        if child is None:
            return 128 + number
        if not (number == signal.SIGINT and _terminal_sent()):
            child.signal(number)
    return None


def _terminal_sent() -> bool:
    """Is this process in its terminal's foreground group? Then a SIGINT came from the
    terminal (Ctrl-C), to the whole group: CMD had it too."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return True
        except OSError:
            continue
    return False


def _stdin() -> int:
    try:
        os.fstat(0)
    except OSError:
        return -1  # no stdin at all: hold until a signal or the lease's end
    return 0


def _stdin_closed() -> bool:
    try:
        return not os.read(0, 65536)
    except OSError:
        return True


class Relay:
    """RELAYED signals, caught and counted, with a descriptor that wakes a select()."""

    def __init__(self) -> None:
        read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.fd, self._write = read, write
        self._caught: list[int] = []
        self._old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._old = {number: signal.signal(number, self._catch) for number in RELAYED}

    def _catch(self, number: int, frame: object) -> None:
        self._caught.append(number)

    def take(self) -> list[int]:
        try:
            os.read(self.fd, 4096)
        except BlockingIOError:
            pass
        caught, self._caught = self._caught, []
        return caught

    def restore(self) -> None:
        for number, handler in self._old.items():
            signal.signal(number, handler)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self.fd)
        os.close(self._write)


class Held:
    """CMD, forked and held before its exec until the lease is granted (so that its
    pidfd can go with the acquire, and it runs in the lease's scope from its first
    instruction). If the lease is never granted, it exits without running."""

    def __init__(self, command: Sequence[str]) -> None:
        read, self._go = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child; its exit status is tested
            os.close(self._go)
            _held_child(read, list(command))
        os.close(read)
        self.pidfd = os.pidfd_open(self.pid)
        self.status: int | None = None

    def start(self, grant: LeaseGranted | None) -> None:
        """Let CMD exec, with the lease's id and unit in its environment."""
        assert grant is not None
        os.write(self._go, f"{grant.lease} {grant.unit}\n".encode())
        self._close_go()

    def _close_go(self) -> None:
        if self._go >= 0:
            os.close(self._go)
            self._go = -1

    def signal(self, number: int) -> None:
        if self.status is None:
            signal.pidfd_send_signal(self.pidfd, number)

    def wait(self) -> int:
        """Reap CMD: its exit status, 128+N after signal N."""
        if self.status is None:
            _, status = os.waitpid(self.pid, 0)
            code = os.waitstatus_to_exitcode(status)
            self.status = 128 - code if code < 0 else code
        return self.status

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; reaped."""
        if self.status is not None:
            return
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while not select.select([self.pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            if time.monotonic() >= deadline:
                self.signal(signal.SIGKILL)
                break
        self.wait()

    def end(self) -> None:
        """Whatever happened, leave no child behind: one never started exits (its pipe
        closes); one started is reaped (it has exited, or been stopped, by now)."""
        self._close_go()
        if self.status is None:
            self.stop(LEASE_END_GRACE)
        os.close(self.pidfd)


def _held_child(read: int, command: list[str]) -> NoReturn:  # pragma: no cover - child
    """In the forked child: wait for the grant, then exec CMD; never return."""
    try:
        for number in RELAYED:
            signal.signal(number, signal.SIG_DFL)
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(read, 256)
            if not chunk:
                os._exit(EX_TEMPFAIL)  # no grant: CMD never runs
            line += chunk
        lease, unit = line.decode().split(" ", 1)
        os.close(read)
        env = dict(os.environ, VOLUTE_LEASE=lease, VOLUTE_LEASE_UNIT=unit.strip())
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        _child_fails(f"{command[0]}: command not found", EXIT_NOT_FOUND)
    except OSError as error:
        _child_fails(f"{command[0]}: {error.strerror}", EXIT_CANNOT_RUN)
    except BaseException:  # noqa: BLE001 - a forked child must never return
        os._exit(70)


def _child_fails(text: str, code: int) -> NoReturn:  # pragma: no cover - child
    try:
        os.write(2, f"volutectl: {visible(text)}\n".encode(errors="replace"))
    finally:
        os._exit(code)
