"""Starting programs and reading how they ended: volutectl's spawn path.

`spawn` is posix_spawn (vfork + exec): about 0.7 ms, where a fork of this Python process
costs 2-5 ms copying its page tables. Every child volutectl starts goes through it, but
for two, each for a reason of its own:
- A turn's child (volutectl/launcher/fork.py, `fork_turn`) is a plain os.fork. The child
  must do work between fork and exec that posix_spawn cannot: block on the release pipe
  until systemd has put it into its scope, open its journal stream there while still
  root, then drop to the mind's user and exec the wrapper.
- journalctl under `volutectl logs` (volutectl/cli/logs.py) runs through subprocess: its
  queries need journalctl's stdout and stderr both captured (subprocess reads them
  together, so a full pipe cannot stall it), and the printed history and --follow read
  its stdout as a stream of lines while it runs; `run` offers neither, and the few
  journalctl runs of one command are no cost worth saving.

The child of `spawn` gets this process's descriptors that are inheritable (0, 1 and 2,
and those named in `inherit` or `redirect`; Python opens everything else
close-on-exec), and SIGPIPE and SIGXFSZ back at their defaults, as subprocess does:
Python ignores SIGPIPE, and an ignored signal stays ignored across exec, so a writer to
a closed pipe in the child would fail with EPIPE ("Broken pipe" on stderr) where in a
shell it ends quietly.

Every wait status becomes one exit code, the way a shell reports it: the program's code,
or 128+N when signal N ended it (`exit_code`). `run` is spawn plus wait, optionally
capturing stdout.

No program runs through a shell unless the caller's argv says so.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# What subprocess restores too: Python sets SIGPIPE to SIG_IGN, and SIGXFSZ likewise.
DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)

# A redirection's source: a descriptor of ours, or a path the child opens read-write.
Source = int | str


@dataclass(frozen=True)
class Finished:
    """How a program run with `run` ended."""

    exit_code: int  # 128+N if signal N ended it
    output: str  # its stdout, when captured; else ""


def exit_code(wait_status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128+N for signal N."""
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    redirect: Mapping[int, Source] | None = None,
    inherit: Iterable[int] = (),
    search_path: bool = False,
) -> int:
    """Start `argv` and return its pid; OSError if it cannot start (e.g. not found).

    `env`: the child's whole environment (default: this process's). `redirect` maps a
    descriptor number in the child to one of ours, or to a path it opens read-write
    ({1: 2} sends stdout to our stderr, {2: os.devnull} discards stderr); they apply in
    order. `inherit`: descriptors of ours that the child keeps at the same number.
    `search_path`: look argv[0] up in PATH, else it is a path."""
    inherited = list(inherit)
    actions: list[tuple[Any, ...]] = []
    moved: list[int] = []
    try:
        for target, source in (redirect or {}).items():
            if isinstance(source, str):
                actions.append((os.POSIX_SPAWN_OPEN, target, source, os.O_RDWR, 0))
                continue
            if source == target:
                # dup2 onto itself is a no-op that would leave close-on-exec set.
                source = os.dup(source)
                moved.append(source)
            actions.append((os.POSIX_SPAWN_DUP2, source, target))
        for fd in inherited:
            os.set_inheritable(fd, True)
        start = os.posix_spawnp if search_path else os.posix_spawn
        return start(
            argv[0],
            list(argv),
            os.environ if env is None else dict(env),
            file_actions=actions,
            setsigdef=DEFAULT_SIGNALS,
        )
    finally:
        for fd in inherited:
            os.set_inheritable(fd, False)
        for fd in moved:
            os.close(fd)


def wait(pid: int) -> int:
    """Wait for our child `pid` to end; its exit code (128+N for signal N)."""
    _, status = os.waitpid(pid, 0)
    return exit_code(status)


def poll(pid: int) -> int | None:
    """Our child's exit code if it has ended (reaping it), else None."""
    done, status = os.waitpid(pid, os.WNOHANG)
    return exit_code(status) if done == pid else None


BLOCK_BYTES = 512  # getrusage's ru_oublock counts these (the task's write_bytes / 512)


def poll_written(pid: int) -> tuple[int, int] | None:
    """Our child's exit code and the bytes it and the children it reaped wrote to
    storage (its rusage's ru_oublock), if it has ended (reaping it), else None."""
    done, status, usage = os.wait4(pid, os.WNOHANG)
    if done != pid:
        return None
    return exit_code(status), usage.ru_oublock * BLOCK_BYTES


def run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    redirect: Mapping[int, Source] | None = None,
    capture: bool = False,
    search_path: bool = False,
) -> Finished:
    """Run `argv` to its end. With `capture`, its stdout is returned (decoded, errors
    replaced) instead of going to ours. OSError if it cannot start."""
    if not capture:
        return Finished(wait(spawn(argv, env=env, redirect=redirect, search_path=search_path)), "")
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    try:
        redirected = {**(redirect or {}), 1: write_fd}
        pid = spawn(argv, env=env, redirect=redirected, search_path=search_path)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    chunks = []
    try:
        while chunk := os.read(read_fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        code = wait(pid)
    return Finished(code, b"".join(chunks).decode(errors="replace"))
