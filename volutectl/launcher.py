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

Turn directory (under gate.runtime_dir/turns/<id>, owned by the mind's user):
  stdin.jsonl  the batch of deliveries, one JSON object per line (root-owned, 0600;
               opened before the privilege drop)
  inbox/       deliveries folded in while the turn runs, one <id>.json file each; the
               turn takes one by deleting (or moving away) its file
  .offered/    the gate's own record of what it offered (root-owned, 0700): <id> is
               created after inbox/.<id>.tmp is written and before that is renamed to
               inbox/<id>.json, so a gate killed half-way through a fold can still tell
               "never offered" (no marker, or the .tmp still there) from "taken"
               (marker, and neither file)
  started      created by the wrapper just before the command runs
  status       the command's exit status, written by the wrapper when it returns
"""

from __future__ import annotations

import json
import os
import pwd
import resource
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from volutectl import envfile
from volutectl.errors import DataError, VoluteError
from volutectl.journal import TurnStream

# The scope's main process: /bin/sh running turn-wrapper.sh (beside this module) with
# the command as its arguments. A file rather than `sh -c SCRIPT` so that
# `systemctl status volute-turns.slice` shows a readable command line.
WRAPPER = str(Path(__file__).with_name("turn-wrapper.sh"))
RELEASE = b"1"
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
    stop signals stay ignored until the release (`_ready_to_exec`)."""
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(signum, signal.SIG_IGN if signum in STOP_SIGNALS else signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # signals the C library reserves for itself
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    if _inherited_nofile is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, _inherited_nofile)


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


@dataclass(frozen=True)
class TurnDir:
    path: Path

    @property
    def inbox(self) -> Path:
        return self.path / "inbox"

    @property
    def stdin(self) -> Path:
        return self.path / "stdin.jsonl"

    @property
    def offered(self) -> Path:
        return self.path / ".offered"

    def started(self) -> bool:
        return (self.path / "started").exists()

    def exit_status(self) -> int | None:
        try:
            return int((self.path / "status").read_text().strip())
        except (OSError, ValueError):
            return None

    def ended_at(self) -> float | None:
        """When the wrapper recorded the exit status (the status file's mtime)."""
        try:
            return (self.path / "status").stat().st_mtime
        except OSError:
            return None

    def not_taken(self, folded: Sequence[int]) -> set[int]:
        """Of the folded delivery ids, those the turn did not take: still in the inbox, or
        never offered there (the gate died between the fold's commit and the rename)."""
        if not self.offered.is_dir():
            # A turn directory from volutectl 0.1.0, which kept no offer record: only
            # what is still in the inbox is known to be untaken.
            return {i for i in folded if (self.inbox / f"{i}.json").exists()}
        left = set()
        for delivery_id in folded:
            if (
                not (self.offered / str(delivery_id)).exists()
                or (self.inbox / f".{delivery_id}.tmp").exists()
                or (self.inbox / f"{delivery_id}.json").exists()
            ):
                left.add(delivery_id)
        return left

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


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


def make_turn_dir(root: Path, turn_id: int, account: Account, stdin: bytes) -> TurnDir:
    turns = root / "turns"
    turns.mkdir(parents=True, exist_ok=True)
    os.chmod(turns, 0o711)  # others may traverse to their own turn, not list
    path = turns / str(turn_id)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(mode=0o700)
    (path / "inbox").mkdir(mode=0o700)
    (path / ".offered").mkdir(mode=0o700)  # stays the gate's: not chowned below
    stdin_path = path / "stdin.jsonl"
    fd = os.open(stdin_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(stdin)
    if os.geteuid() == 0:
        os.chown(path, account.uid, account.gid)
        os.chown(path / "inbox", account.uid, account.gid)
    return TurnDir(path)


def offer(turn_dir: TurnDir, delivery_id: int, record: bytes, account: Account) -> None:
    """Put a folded delivery into a running turn's inbox, atomically, leaving the record
    that `TurnDir.not_taken` reads: the .tmp first, then the marker, then the rename."""
    tmp = turn_dir.inbox / f".{delivery_id}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(record)
    if os.geteuid() == 0:
        os.chown(tmp, account.uid, account.gid)
    os.close(os.open(turn_dir.offered / str(delivery_id), os.O_WRONLY | os.O_CREAT, 0o600))
    os.rename(tmp, turn_dir.inbox / f"{delivery_id}.json")


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


def fork_turn(
    argv: Sequence[str],
    env: Mapping[str, str],
    account: Account,
    turn_dir: TurnDir,
    cwd: str,
    stream: TurnStream | None = None,
) -> Child:
    """Fork the turn's child, blocked until released; then, in its scope, it opens
    `stream` for its stdout and stderr, becomes `account` and execs the command."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    wrapper = ["/bin/sh", WRAPPER, *argv]
    environment = dict(env)
    stdin_path = str(turn_dir.stdin)
    # Every signal blocked across the fork: none may run the gate's handlers in the child
    # before it has reset them.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = os.fork()
    except OSError as error:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read_fd)
        os.close(write_fd)
        raise VoluteError(f"cannot fork a turn: {error}") from None
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    else:  # pragma: no cover - the child; its effects are tested end to end
        try:
            _reset_inherited_state()
            # Nothing of the gate's but the release pipe: not its listening socket, its
            # clients, its database or its bus, not even until exec closes them.
            os.closerange(3, read_fd)
            os.closerange(read_fd + 1, _MAX_FD)  # the pipe's write end among them
            os.setsid()
            stdin_fd = os.open(stdin_path, os.O_RDONLY)
            os.dup2(stdin_fd, 0)
            os.close(stdin_fd)
            # The gate checked the working directory before the fork (preflight): entering
            # it fails only if it changed since, and the child then exits unreleased.
            _enter_as(cwd, account)
            if os.read(read_fd, 1) != RELEASE:
                os._exit(0)
            if stream is not None:
                _log_to(stream)  # as root: see the module's docstring
            _become(account)
            _ready_to_exec()
            os.execve("/bin/sh", wrapper, environment)
        finally:
            os._exit(127)
    os.close(read_fd)
    return Child(pid=pid, pidfd=os.pidfd_open(pid), release_fd=write_fd)
