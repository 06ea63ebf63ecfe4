"""Processes known by pidfd: what one is, read from /proc without a pid race.

A pidfd names one process for as long as it is open, whatever its pid number becomes
after it exits. /proc is read by pid number, so each reading here is made safe the same
way:
1. the pid is the pidfd's own (the `Pid:` line of /proc/self/fdinfo/FD; -1 once the
   process has exited, 0 if it is in another pid namespace: both refused);
2. /proc/PID/status, cgroup and stat are read;
3. the pidfd is signalled with 0 afterwards: if that succeeds, the process was alive
   through the reading, so PID was still its pid and nothing read was another's.

A descriptor that is not a pidfd has no `Pid:` line and is refused.
"""

from __future__ import annotations

import os
import signal

from volutectl.core.pidmoves import Seen, parse_start_time, parse_status_uids
from volutectl.core.pidmoves import parse_systemd_cgroup as systemd_cgroup

MAX_PROC_FILE = 64 * 1024  # /proc/PID/status is about 1.5 KiB; cgroup and stat less


class NotAProcess(Exception):
    """The descriptor names no live process of ours: `str(error)` says why."""


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        return os.read(fd, MAX_PROC_FILE).decode(errors="replace")
    finally:
        os.close(fd)


def pid_of(pidfd: int) -> int:
    """The pid a pidfd refers to, from the kernel's own fdinfo."""
    try:
        info = _read(f"/proc/self/fdinfo/{pidfd}")
    except OSError as error:
        raise NotAProcess(f"not an open descriptor ({error.strerror})") from None
    for line in info.splitlines():
        if line.startswith("Pid:"):
            value = line[4:].strip()
            pid = int(value) if value.lstrip("-").isdigit() else 0
            if pid == -1:
                raise NotAProcess("the process has exited")
            if pid <= 0:
                raise NotAProcess("a process outside the launcher's pid namespace")
            return pid
    raise NotAProcess("not a pidfd")


def alive(pidfd: int) -> bool:
    """The pidfd's process has not exited (a zombie still holds its pid: alive here)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's (the unprivileged gate asks): it exists to refuse us
    return True


def read_process(pidfd: int) -> Seen:
    """What the pidfd's process is, read from /proc and checked to be its own."""
    pid = pid_of(pidfd)
    try:
        uids = parse_status_uids(_read(f"/proc/{pid}/status"))
        cgroup = systemd_cgroup(_read(f"/proc/{pid}/cgroup"))
        start = parse_start_time(_read(f"/proc/{pid}/stat"))
    except OSError:
        uids = cgroup = start = None
    if not alive(pidfd):
        raise NotAProcess("the process has exited")
    if uids is None or cgroup is None or start is None:
        raise NotAProcess(f"/proc/{pid} could not be read")
    return Seen(pid, uids[0], uids[1], cgroup, start)


def open_recorded(pid: int, start_time: int) -> int | None:
    """A pidfd of the process recorded as (pid, start time), or None if that process
    is gone (the pid free, or another's now)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        stat = _read(f"/proc/{pid}/stat")
    except OSError:
        os.close(pidfd)
        return None
    if parse_start_time(stat) != start_time or not alive(pidfd):
        os.close(pidfd)
        return None
    return pidfd


def current_cgroup(pidfd: int) -> str | None:
    """The pidfd's process's systemd cgroup now; None once it has exited."""
    try:
        pid = pid_of(pidfd)
        text = _read(f"/proc/{pid}/cgroup")
    except (NotAProcess, OSError):
        return None
    return systemd_cgroup(text) if alive(pidfd) else None
