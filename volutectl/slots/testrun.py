"""The work of `volutectl test` (volutectl/cli/test.py): run a test command under the
repository's test-run cap, in a scope.

The order of events: run --check (a failure exits at once, never queues); resolve the
cap (--slots, then git config volute.testSlots in the common config, then
tests.concurrent_runs); take a slot, saying once why we wait; spawn the command held at a
pipe, put it into a transient scope in the tests slice, then let it exec. The slot's
descriptor is inherited by the command, so the slot stays held while any process of
the run lives, whatever happens to this process. Ctrl-C or SIGTERM stops the scope.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from volutectl.config.settings import load_settings
from volutectl.core import slotmath
from volutectl.errors import PermissionDeniedError, SystemdError
from volutectl.kernel import pathwalk, processes
from volutectl.slots import slotfiles
from volutectl.slots.scopes import connect_manager, list_in_flight, one_line, scope_properties
from volutectl.visible import visible
from volutectl.wire.messages import RegisterRepoRequest

if TYPE_CHECKING:
    from volutectl.config.settings import Settings
    from volutectl.systemd.adapter import Manager

HISTORY_TAIL_BYTES = 64 * 1024
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def notice(text: str) -> None:
    """A line on stderr. It may name other users' test runs (their worktrees and
    commands, from their scopes' descriptions): shown, not obeyed (volutectl/visible.py)."""
    print(visible(text), file=sys.stderr, flush=True)


@dataclass
class RunReport:
    """What `--json` prints; the same facts the wait line and exit status carry."""

    exit_status: int = 0
    cap: int = 0
    cap_source: str = ""
    slot: str | None = None
    scope: str | None = None
    manager: str | None = None  # "system", "user", or None for a plain child
    nested: bool = False
    check_exit_status: int | None = None
    wait: dict[str, object] | None = None
    waited_ms: int = 0
    execution_ms: int = 0
    duration_ms: int = 0
    notices: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        """A notice on stderr, kept for --json too."""
        self.notices.append(text)
        notice(text)

    def as_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


def run_test(
    command: list[str],
    slot_count: int | None,
    check: str | None,
    as_json: bool,
    config_path: str | None,
    environ: Mapping[str, str],
) -> RunReport:
    """The order of events is in the module docstring; the RunReport says what happened."""
    started = time.monotonic()
    outcome = RunReport()
    # A client may not read the main config (it may name minds' secrets): its cap comes
    # from the flag, the repository or the default then.
    loaded = load_settings(config_path, environ, defaults_if_unreadable=True)
    nested = bool(environ.get(slotmath.NESTING_MARKER))
    repository = None if nested else slotfiles.find_repository(Path.cwd())
    cap = slotmath.resolve_cap(
        slot_count,
        repository.cap_setting if repository else None,
        loaded.settings.tests.concurrent_runs,
        loaded.source_of(slotmath.CONFIG_KEY),
    )
    outcome.cap, outcome.cap_source = (0, "nested") if nested else (cap.slots, cap.source)
    own_cap = slot_count is not None or (repository and repository.cap_setting is not None)
    if loaded.unreadable is not None and not own_cap and not nested:
        outcome.say(
            f"{loaded.unreadable} is an admin's to read, so its tests.concurrent_runs is not "
            "used here: git config volute.testSlots N sets the repository's own cap"
        )
    if check:
        outcome.check_exit_status = outcome.exit_status = run_check(check, as_json)
        if outcome.exit_status != 0:  # exit with the check's status, never queue
            outcome.duration_ms = elapsed_ms(started)
            return outcome
    if nested:
        # A slot (or a deliberate no-slot run) is held above us; so is a scope. Taking
        # another slot could deadlock a cap of 1, and a new scope would pull this
        # command out of the outer run's scope, beyond the reach of its stop.
        outcome.nested = True
        launch = launch_command(command, dict(environ), None, None, None, as_json)
        outcome.exit_status, outcome.execution_ms = launch
    else:
        run_capped(command, environ, loaded.settings, repository, cap, as_json, outcome)
    outcome.duration_ms = elapsed_ms(started)
    return outcome


def run_capped(
    command: list[str],
    environ: Mapping[str, str],
    settings: Settings,
    repository: slotfiles.Repository | None,
    cap: slotmath.Cap,
    as_json: bool,
    outcome: RunReport,
) -> None:
    """Take a slot (waiting if all are held), then run the command in a scope."""
    worktree = str(repository.worktree if repository else Path.cwd())
    manager = connect_manager(outcome.say)
    if manager is not None:
        outcome.manager = "user" if manager.user else "system"
    try:
        slot = take_slot(command, settings, repository, cap, manager, outcome)
        child_env = dict(environ)
        child_env[slotmath.NESTING_MARKER] = str(slot.path) if slot else "-"
        outcome.slot = str(slot.path) if slot else None
        scope = slotmath.test_scope_name(Path(worktree).name, os.getpid())
        props = scope_properties(settings.tests, worktree, command)
        try:
            outcome.exit_status, outcome.execution_ms = launch_command(
                command,
                env=child_env,
                slot=slot,
                manager=manager,
                scope=(scope, props),
                as_json=as_json,
                on_scope=lambda started_scope: setattr(outcome, "scope", started_scope),
                say=outcome.say,
            )
        finally:
            if slot is not None:
                # History first, while the slot is ours: the next run's estimate sees it.
                if repository is not None:
                    record_history(repository.common_dir, worktree, command, outcome)
                slot.release()
    finally:
        if manager is not None:
            manager.close()


def take_slot(
    command: list[str],
    settings: Settings,
    repository: slotfiles.Repository | None,
    cap: slotmath.Cap,
    manager: Manager | None,
    outcome: RunReport,
) -> slotfiles.Slot | None:
    """One of the repository's slots, saying once why we wait; None to run uncapped."""
    if cap.slots <= 0:
        return None
    if repository is None:
        outcome.say(
            f"volutectl test: {Path.cwd()} is not in a git repository; running without the cap"
        )
        return None
    common_dir = repository.common_dir

    def on_wait() -> None:
        in_flight = list_in_flight(manager, settings.tests.slice)
        typical = slotmath.typical_duration_ms(
            read_history(common_dir), slotmath.join_command(command)
        )
        notice(slotmath.wait_line(cap.slots, in_flight, typical, str(common_dir)))
        outcome.wait = slotmath.wait_info(cap.slots, cap.source, in_flight, typical)

    register_with_gate(str(settings.gate.socket), common_dir)
    wait_started = time.monotonic()
    slot = slotfiles.acquire_slot(common_dir, cap.slots, on_wait=on_wait, notice=outcome.say)
    outcome.waited_ms = elapsed_ms(wait_started)
    return slot


def elapsed_ms(since: float) -> int:
    return int(round((time.monotonic() - since) * 1000))


def run_check(check: str, as_json: bool) -> int:
    return processes.run(["/bin/sh", "-c", check], redirect={1: 2} if as_json else None).exit_code


# -- the gate -----------------------------------------------------------------------------

REGISTER_TIMEOUT = 0.2


def register_with_gate(socket_path: str, common_dir: Path) -> None:
    """Ask the gate to watch this repository's slots; best effort, fire and forget.

    Sent on every capped run rather than once: it costs one connect and one write (tens
    of microseconds when no gate listens), and a gate that lost its registry, or a
    repository that was re-cloned, is picked up again without a marker file to go stale.
    The common dir goes with it as a descriptor (SCM_RIGHTS), so that a gate that may
    not enter the user's private home still watches it. The reply is not awaited, so a
    busy or absent gate never delays or fails a run."""
    from volutectl.errors import VoluteError
    from volutectl.wire.protocol import Connection

    try:
        connection = Connection(socket_path, timeout=REGISTER_TIMEOUT)
    except (VoluteError, OSError):
        return
    try:
        directory = slotfiles.open_common_dir(common_dir)
    except OSError:
        directory = None
    try:
        fds = () if directory is None else (directory,)
        connection.send(RegisterRepoRequest(str(common_dir)).to_wire(), fds)
    except (VoluteError, OSError):
        pass
    finally:
        connection.close()
        if directory is not None:
            os.close(directory)


# -- the command itself -------------------------------------------------------------------


def launch_command(
    command: Sequence[str],
    env: dict[str, str],
    slot: slotfiles.Slot | None,
    manager: Manager | None,
    scope: tuple[str, Any] | None,
    as_json: bool,
    on_scope: Any = None,
    say: Any = notice,
) -> tuple[int, int]:
    """Run the command (in the scope, when given a manager); (exit status, execution ms)."""
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    previous_wakeup = signal.set_wakeup_fd(wake_write)
    previous = {signum: signal.signal(signum, _ignore_signal) for signum in STOP_SIGNALS}
    try:
        pid, gate = spawn_held(command, env, slot.fd if slot else None, as_json)
        scope_name: str | None = None
        if manager is not None and scope is not None:
            name, props = scope
            try:
                manager.start_scope(name, [pid], props)
                scope_name = name
                if on_scope is not None:
                    on_scope(name)
            except (SystemdError, PermissionDeniedError) as error:
                say(
                    f"volutectl test: could not start scope {name} ({one_line(str(error))}); "
                    "running the command as a plain child"
                )
        started = time.monotonic()
        os.write(gate, b"go\n")
        os.close(gate)
        status = wait_for_child(pid, wake_read, manager, scope_name)
        return status, elapsed_ms(started)
    finally:
        signal.set_wakeup_fd(previous_wakeup)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        os.close(wake_read)
        os.close(wake_write)


def _ignore_signal(signum: int, frame: object) -> None:
    """Installed so that the signal reaches the wakeup fd instead of killing us."""


# The held child: /bin/sh waits at the gate pipe, then becomes the command. posix_spawn
# (vfork+exec) costs about 0.7 ms where a fork of this Python process costs 2-5 ms, and
# sh starts up while systemd is still setting up the scope, off the handoff path.
GATE_SCRIPT = 'read -r _ <&{fd} || exit 1; exec {fd}<&-; exec "$@"'


def spawn_held(
    command: Sequence[str], env: Mapping[str, str], slot_fd: int | None, as_json: bool
) -> tuple[int, int]:
    """Start a child that waits at a pipe, then execs the command; (pid, gate fd).

    The child must not exec before systemd has moved it into the scope: a fast command
    would exit first and fail the scope. Closing the gate without writing aborts it.
    The slot's descriptor is inherited, so the command holds the slot too."""
    gate_read, gate_write = os.pipe2(os.O_CLOEXEC)
    gate_fd = 8 if slot_fd == 9 else 9  # dash takes single-digit descriptors only
    redirect: dict[int, processes.Source] = {gate_fd: gate_read}
    if as_json:
        redirect[1] = 2
    argv = ["/bin/sh", "-c", GATE_SCRIPT.format(fd=gate_fd), "volutectl test", *command]
    try:
        pid = processes.spawn(
            argv, env=env, redirect=redirect, inherit=[] if slot_fd is None else [slot_fd]
        )
    except BaseException:
        os.close(gate_write)
        raise
    finally:
        os.close(gate_read)
    return pid, gate_write


def wait_for_child(pid: int, wake_read: int, manager: Manager | None, scope: str | None) -> int:
    """Wait for the command; a stop signal stops the scope (or is passed to a plain child)."""
    pidfd = os.pidfd_open(pid)
    stopping = False
    try:
        while True:
            ready, _, _ = select.select([pidfd, wake_read], [], [])
            if pidfd in ready:
                return processes.wait(pid)
            with contextlib.suppress(BlockingIOError):
                received = os.read(wake_read, 64)
                for signum in received:
                    if signum not in STOP_SIGNALS:
                        continue
                    if manager is not None and scope is not None:
                        if not stopping:
                            with contextlib.suppress(SystemdError, PermissionDeniedError):
                                manager.stop_unit(scope, wait=False)
                    else:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signum)
                    stopping = True
    finally:
        os.close(pidfd)


# -- history ------------------------------------------------------------------------------


def history_path(common_dir: Path) -> Path:
    return common_dir.joinpath(*slotmath.HISTORY_PARTS)


def read_history(common_dir: Path) -> list[slotmath.RunRecord]:
    """The runs in the last HISTORY_TAIL_BYTES of the history. A read that starts inside
    the file reads the byte before too: unless that ends a line, its first line is cut
    and dropped. A read from the start drops nothing."""
    try:
        fd = open_history(common_dir, os.O_RDONLY)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as handle:
        try:
            handle.seek(0, os.SEEK_END)
            start = max(0, handle.tell() - HISTORY_TAIL_BYTES - 1)
            handle.seek(start)
            data = handle.read(HISTORY_TAIL_BYTES + 1)
        except OSError:
            return []
    if start > 0:
        data = data.split(b"\n", 1)[1] if b"\n" in data else b""
    return slotmath.parse_history(data.decode(errors="replace").splitlines())


def record_history(common_dir: Path, worktree: str, command: Sequence[str], run: RunReport) -> None:
    """Append the execution time (not the queue time) for future estimates; best effort."""
    record = slotmath.RunRecord(
        worktree, slotmath.join_command(command), run.execution_ms, run.exit_status
    )
    line = slotmath.history_line(record, time.time()).encode()
    with contextlib.suppress(OSError):
        fd = open_history(common_dir, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def open_history(common_dir: Path, flags: int) -> int:
    """The history file, opened through the slot code's directory walk (no symlink that
    the checkout's owner controls when we are root) and only if it is a regular file;
    never blocks (a FIFO in its place is refused, not waited on)."""
    common = slotfiles.open_common_dir(common_dir)
    try:
        volute = os.open(slotmath.HISTORY_PARTS[0], pathwalk.DIRECTORY_FLAGS, dir_fd=common)
    finally:
        os.close(common)
    try:
        fd = os.open(
            slotmath.HISTORY_PARTS[1],
            flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY,
            slotfiles.SLOT_FILE_MODE,
            dir_fd=volute,
        )
    finally:
        os.close(volute)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(history_path(common_dir)))
    return fd
