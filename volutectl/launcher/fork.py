"""Turn processes: the turn directory, the fork, and the release into exec.

A turn's child is forked by the gate and blocks on a pipe. The gate has systemd put it
into its scope (and waits until the scope holds it); only then does it write the
release byte, and the child opens its journal stream (its stdout and stderr), drops to
the mind's user and execs. If the gate dies before that, the pipe closes and the child
exits without running anything.

The stream is opened in the scope, and while still root: journald reads a stream's
unit from its writer's cgroup, which it cannot once that process has exited, and then
falls back to the unit named in the stream's header, a field it takes only from a root
peer. Without it, the output of a turn shorter than journald's lag had no unit at all
(6 of 20 one-line turns in a test). The writer's credentials, which journald reads with
every message, still name the mind's user.

The scope's main process is /bin/sh running a few builtins around the command: it
marks that the command started, runs it, and writes its exit status into the turn
directory, so a gate that restarted can still learn how an adopted turn ended. A
Python wrapper would cost 100+ ms on the handoff path; sh costs about 1 ms.

The turn's directory (turndir.py) belongs to root, and nothing in it is reached through
a path the turn can change. Its stdin is a sealed memfd made from the batch: no path at
all. The wrapper records that the command started, and its exit status, through a
descriptor (fd 9) on the directory's status file, which the child inherits from the
gate and the command does not.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import resource
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from volutectl.errors import DataError, VoluteError
from volutectl.kernel.dirfds import write_all
from volutectl.launcher import envfile
from volutectl.launcher.turndir import TurnDir as TurnDir
from volutectl.launcher.turndir import make_turn_dir as make_turn_dir
from volutectl.launcher.turndir import offer as offer
from volutectl.systemd.journal import TurnStream

# The scope's main process: /bin/sh running turn-wrapper.sh (beside this module) with
# the command as its arguments. A file rather than `sh -c SCRIPT` so that
# `systemctl status volute-turns.slice` shows a readable command line.
WRAPPER = str(Path(__file__).with_name("turn-wrapper.sh"))
RELEASE = b"1"
# The descriptor on which the wrapper finds the turn directory's status file.
STATUS_FD = 9
# The PATH a turn's command is looked up in, unless the mind's environment sets one.
TURN_PATH = "/usr/local/bin:/usr/bin:/bin"

# RLIMIT_NOFILE as the gate found it, before raise_nofile_limit(): what turns get back.
_inherited_nofile: tuple[int, int] | None = None


def raise_nofile_limit() -> tuple[int, int]:
    """Raise our soft RLIMIT_NOFILE to the hard limit: each client holds a descriptor,
    and systemd's default soft limit (1024) is far below its hard one. Returns the
    (soft, hard) found first, which every turn's child restores before it execs: a turn
    must not inherit limits the gate raised for itself."""
    global _inherited_nofile
    found = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _inherited_nofile is None:
        _inherited_nofile = found
    soft, hard = found
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # then we make do with the soft limit
    return _inherited_nofile


# Signals that stop the gate's unit: a restart, a stop, an upgrade (SIGTERM to every
# process of the gate's cgroup), ^C, a hang-up. A turn's child ignores them until it is
# released, so that they cannot kill it between the fork and its scope: the gate, which
# handles them by finishing the step it is in, then either releases the child into its
# scope or closes its pipe. Only a SIGKILL can still land in that window.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# Above any descriptor the gate opens (os.closerange uses close_range(2): no cost per fd).
_MAX_FD = 1 << 30


def _reset_inherited_state() -> None:
    """In a turn's child: what exec would pass on from the gate goes back to the defaults.

    Python ignores SIGPIPE and SIGXFSZ, and the gate handles SIGTERM and SIGINT: an
    ignored signal stays ignored across exec, and until exec a handled one would run the
    gate's Python handler in the child. The blocked-signal mask also survives exec; the
    parent blocked everything around the fork, so nothing arrived before this ran. The
    stop signals stay ignored until the release (`_ready_to_exec`). The file limit goes
    back first, the mask last: a child whose mask is empty has nothing of the gate's."""
    if _inherited_nofile is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, _inherited_nofile)
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(signum, signal.SIG_IGN if signum in STOP_SIGNALS else signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # signals the C library reserves for itself
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _log_to(stream: TurnStream) -> None:
    """In a turn's child, released into its scope: stdout and stderr become the turn's
    own journal stream. Without one they stay the gate's, so that nothing a turn prints
    is lost: no journald at all (a hand-run gate on a terminal shows it), or journald
    refusing the stream (it is then in the gate's own log, after a line that says so)."""
    try:
        fd = stream.connect()
    except OSError as error:
        if not isinstance(error, FileNotFoundError):
            note = f"volutectl: {stream.unit}: journald refused the turn's output stream "
            note += f"({error.strerror or error}); its output follows in the gate's own\n"
            os.write(2, note.encode())
        return
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if fd > 2:
        os.close(fd)


def _enter_as(cwd: str, account: Account) -> None:
    """Enter the turn's working directory as the mind's user, so that it enters only
    what that user may, never elsewhere; only the effective ids and the groups change,
    and go back, so that the turn's stream is still opened as root."""
    if os.geteuid() != 0 or account.uid == 0:
        os.chdir(cwd)
        return
    gid, groups = os.getegid(), os.getgroups()
    os.setgroups(list(account.groups))
    os.setegid(account.gid)
    os.seteuid(account.uid)
    try:
        os.chdir(cwd)
    finally:
        os.seteuid(0)
        os.setegid(gid)
        os.setgroups(groups)


def _become(account: Account) -> None:
    """Drop to the mind's user for good, before exec."""
    if os.geteuid() == 0 and account.uid != 0:
        os.setgroups(list(account.groups))
        os.setgid(account.gid)
        os.setuid(account.uid)


def _ready_to_exec() -> None:
    """Released into its scope: the command gets default dispositions for every signal."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


def resolve_account(user: str) -> Account:
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise DataError(
            f"user {user!r} does not exist",
            hint="create it, or set minds.NAME.user / turns.default_user to an existing user",
        ) from None
    groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)


def delivery_record(delivery_id: int, session: str, message: bytes, interrupt: bool) -> bytes:
    return (
        json.dumps(
            {
                "id": delivery_id,
                "session": session,
                "message": message.decode("utf-8", errors="replace"),
                "interrupt": interrupt,
            },
            ensure_ascii=False,
        ).encode()
        + b"\n"
    )


@dataclass
class Child:
    pid: int
    pidfd: int
    release_fd: int

    def release(self) -> None:
        os.write(self.release_fd, RELEASE)
        os.close(self.release_fd)
        self.release_fd = -1

    def abandon(self) -> None:
        """Close the pipe unreleased: the child exits without running the command."""
        if self.release_fd >= 0:
            os.close(self.release_fd)
            self.release_fd = -1


def command_argv(command: Sequence[str] | str) -> list[str]:
    if isinstance(command, str):
        return ["/bin/sh", "-c", command]
    return list(command)


def mind_environment(
    configured: Mapping[str, str], environment_file: Path | None
) -> dict[str, str]:
    """A mind's own variables for one turn: its `environment` from the config, then its
    environment file over it. The file is read here, as root, at every turn's start (a
    change needs no restart); a ConfigError naming it if it is not root's alone or does
    not parse, and then the turn does not start."""
    variables = dict(configured)
    if environment_file is not None:
        variables.update(envfile.read_environment_file(environment_file))
    return variables


def turn_environment(
    account: Account,
    *,
    mind: str,
    session: str,
    turn_id: int,
    delivery_ids: Sequence[int],
    turn_dir: TurnDir,
    extra: Mapping[str, str],
) -> dict[str, str]:
    env = {
        "PATH": TURN_PATH,
        "HOME": account.home,
        "USER": account.name,
        "LOGNAME": account.name,
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "VOLUTE_MIND": mind,
        "VOLUTE_SESSION": session,
        "VOLUTE_TURN_ID": str(turn_id),
        "VOLUTE_DELIVERY_IDS": " ".join(str(i) for i in delivery_ids),
        "VOLUTE_TURN_DIR": str(turn_dir.path),
        "VOLUTE_INBOX": str(turn_dir.inbox),
    }
    env.update(extra)
    return env


def sealed_stdin(data: bytes) -> int:
    """A memfd holding `data`, sealed against any change, positioned at its start: the
    turn's stdin. It has no path, so nothing of the turn's can stand in for it."""
    fd = os.memfd_create("volute-turn-stdin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        write_all(fd, data)
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fork_turn(
    argv: Sequence[str],
    env: Mapping[str, str],
    account: Account,
    turn_dir: TurnDir,
    cwd: str,
    stream: TurnStream | None = None,
    *,
    stdin: bytes,
) -> Child:
    """Fork the turn's child, blocked until released; then, in its scope, it opens
    `stream` for its stdout and stderr, becomes `account` and execs the command.

    Its stdin (`stdin`, in a sealed memfd) and the wrapper's status descriptor are
    opened here, by the gate, before the fork: the child opens nothing by a path. A fork,
    not volutectl/kernel/processes.py's posix_spawn: the child waits for its release, in
    its scope, before it execs."""
    fds = _open_child_fds(turn_dir, stdin)
    wrapper = ["/bin/sh", WRAPPER, *argv]
    environment = dict(env)
    # Every signal blocked across the fork: none may run the gate's handlers in the child
    # before it has reset them.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = os.fork()
    except OSError as error:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        fds.close_all()
        raise VoluteError(f"cannot fork a turn: {error}") from None
    if pid == 0:  # pragma: no cover - the child; its effects are tested end to end
        try:
            _wait_then_exec(fds, cwd, account, stream, wrapper, environment)
        finally:
            os._exit(127)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    fds.close_child_ends()
    return Child(pid=pid, pidfd=os.pidfd_open(pid), release_fd=fds.release_write)


@dataclass(frozen=True)
class _ChildFds:
    """What the child inherits: its stdin, the wrapper's status file, and the release
    pipe (the child reads it; the gate keeps the write end)."""

    stdin: int
    status: int
    release_read: int
    release_write: int

    def close_child_ends(self) -> None:
        for fd in (self.release_read, self.stdin, self.status):
            os.close(fd)

    def close_all(self) -> None:
        self.close_child_ends()
        os.close(self.release_write)


def _open_child_fds(turn_dir: TurnDir, stdin: bytes) -> _ChildFds:
    """Open the child's descriptors before the fork; on failure, none stays open."""
    stdin_fd = sealed_stdin(stdin)
    try:
        status_fd = turn_dir.open_status()
        try:
            read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            os.close(status_fd)
            raise
    except BaseException:
        os.close(stdin_fd)
        raise
    return _ChildFds(stdin=stdin_fd, status=status_fd, release_read=read_fd, release_write=write_fd)


def _wait_then_exec(
    fds: _ChildFds,
    cwd: str,
    account: Account,
    stream: TurnStream | None,
    wrapper: list[str],
    environment: dict[str, str],
) -> None:  # pragma: no cover - the child; its effects are tested end to end
    """The child's side: keep only its own descriptors, enter `cwd`, wait for the gate's
    release byte (exit unreleased without it), then log, drop to `account` and exec."""
    _reset_inherited_state()
    # Out of the way of 0 and STATUS_FD first, then into place.
    release = fcntl.fcntl(fds.release_read, fcntl.F_DUPFD_CLOEXEC, STATUS_FD + 1)
    stdin_fd = fcntl.fcntl(fds.stdin, fcntl.F_DUPFD_CLOEXEC, STATUS_FD + 1)
    status_fd = fcntl.fcntl(fds.status, fcntl.F_DUPFD_CLOEXEC, STATUS_FD + 1)
    os.dup2(stdin_fd, 0)
    os.dup2(status_fd, STATUS_FD)
    # Nothing of the gate's but these and the release pipe: not its listening
    # socket, its clients, its database or its bus, not even until exec closes them.
    os.closerange(3, STATUS_FD)
    os.closerange(STATUS_FD + 1, release)
    os.closerange(release + 1, _MAX_FD)  # the pipe's write end among them
    os.setsid()
    # The gate checked the working directory before the fork (preflight): entering
    # it fails only if it changed since, and the child then exits unreleased.
    _enter_as(cwd, account)
    if os.read(release, 1) != RELEASE:
        os._exit(0)
    if stream is not None:
        _log_to(stream)  # as root: see the module's docstring
    _become(account)
    _ready_to_exec()
    os.execve("/bin/sh", wrapper, environment)


# A lease's placeholder: the scope's main process while a daemon runs the turn itself
# (issue 31). It sleeps, as the mind's user, until the scope is stopped; its name in
# `ps` and `systemctl status` says what it is.
PLACEHOLDER = ["volute-lease-placeholder", "infinity"]
SLEEP = "/bin/sleep"


def fork_placeholder(account: Account) -> Child:
    """Fork a lease scope's placeholder, blocked until released (as a turn's child is):
    then it becomes `account` and sleeps until its scope is stopped. It inherits
    nothing of the gate's but its release pipe, and runs in / with no environment."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = os.fork()
    except OSError as error:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read_fd)
        os.close(write_fd)
        raise VoluteError(f"cannot fork a lease's placeholder: {error}") from None
    if pid == 0:  # pragma: no cover - the child; its effects are tested end to end
        try:
            _placeholder(read_fd, account)
        finally:
            os._exit(127)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(read_fd)
    return Child(pid=pid, pidfd=os.pidfd_open(pid), release_fd=write_fd)


def _placeholder(release_fd: int, account: Account) -> None:  # pragma: no cover - the child
    """The placeholder's side. Unlike a turn's child, its stop signals are held, not
    ignored, from here on: a stop of its scope that comes between the release and the
    exec (the holder released at once) is kept, and ends it as it unblocks them, rather
    than lost with the scope left holding it until systemd's SIGKILL."""
    _reset_inherited_state()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    _ready_to_exec()  # default dispositions, still blocked: a stop waits, pending
    release = fcntl.fcntl(release_fd, fcntl.F_DUPFD_CLOEXEC, STATUS_FD + 1)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, release)
    os.closerange(release + 1, _MAX_FD)
    os.setsid()
    os.chdir("/")
    if os.read(release, 1) != RELEASE:
        os._exit(0)
    _become(account)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a stop pending ends it here
    os.execve(SLEEP, PLACEHOLDER, {"PATH": TURN_PATH})
