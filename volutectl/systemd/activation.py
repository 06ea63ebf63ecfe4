"""Socket activation: the gate's listening socket, handed over by volute-gate.socket.

systemd, not one gate process, owns the socket, so while the gate restarts (an upgrade,
the watchdog, a crash) new connections wait in the socket's backlog and the next gate
accepts them: no client is refused (DESIGN invariant 9). The hand-over is the
sd_listen_fds(3) protocol: LISTEN_FDS descriptors from fd 3 on, meant for the process
whose pid is LISTEN_PID. Like sd_notify in journal.py it is spoken directly, with no
pystemd, which stays inside the one systemd adapter.

The same variables bring back what the gate put in its fd store (FDSTORE=1 with an
FDNAME; FileDescriptorStoreMax= on volute-gate.service): descriptors it keeps across
its own restarts, told from the socket by their names (LISTEN_FDNAMES). `keep` and
`forget` put one in the store and take it out.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

from volutectl.errors import ConfigError
from volutectl.systemd.journal import sd_notify

LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START
VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
UNIT_HINT = (
    "volute-gate.socket needs exactly one ListenStream=/path: see systemctl cat volute-gate.socket"
)


def listen_fds(
    environ: MutableMapping[str, str] | None = None, pid: int | None = None
) -> list[int]:
    return [fd for fd, _ in named_fds(environ, pid)]


def named_fds(
    environ: MutableMapping[str, str] | None = None, pid: int | None = None
) -> list[tuple[int, str]]:
    """The descriptors systemd passed to this process, now close-on-exec; [] if none.

    The variables are removed whatever they say, as sd_listen_fds(unset_environment=1)
    does, so nothing the gate starts later takes them for its own. Descriptors meant for
    another process (LISTEN_PID differs: we were started by one that got them) are not
    ours to touch.
    """
    environ = os.environ if environ is None else environ
    values = {name: environ.pop(name, None) for name in VARIABLES}
    listen_pid, count = values["LISTEN_PID"], values["LISTEN_FDS"]
    if listen_pid is None or count is None:
        return []
    try:
        if int(listen_pid) != (os.getpid() if pid is None else pid):
            return []
        number = int(count)
    except ValueError:
        raise ConfigError(
            f"socket activation: LISTEN_PID={listen_pid!r} LISTEN_FDS={count!r} are not numbers"
        ) from None
    fds = list(range(LISTEN_FDS_START, LISTEN_FDS_START + max(number, 0)))
    names = (values["LISTEN_FDNAMES"] or "").split(":")
    names += ["unknown"] * (len(fds) - len(names))  # sd_listen_fds_with_names' default
    for fd in fds:
        try:
            # Turns are forked from the gate: an inherited listener must not reach them.
            os.set_inheritable(fd, False)
        except OSError as error:
            raise ConfigError(
                f"socket activation: fd {fd} of LISTEN_FDS={count} is not open: {error.strerror}"
            ) from None
    return list(zip(fds, names, strict=False))


def listener_from_fd(fd: int) -> socket.socket:
    """The socket object for an inherited fd, checked to be what the gate can serve."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as error:
        raise ConfigError(
            f"socket activation: fd {fd} from systemd is not a socket: {error.strerror}",
            hint=UNIT_HINT,
        ) from None
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not listening:
        what = f"{sock.family.name} {sock.type.name}{'' if listening else ', not listening'}"
        sock.detach()  # leave the fd to its owner; we only refuse it
        raise ConfigError(
            f"socket activation: fd {fd} from systemd is {what}, "
            "not a listening AF_UNIX stream socket",
            hint=UNIT_HINT,
        )
    return sock


def inherited_listener(
    environ: MutableMapping[str, str] | None = None, pid: int | None = None
) -> socket.socket | None:
    """The listening socket systemd passed us, or None when we were started by hand."""
    return _listener([fd for fd, _ in named_fds(environ, pid)])


def inherited(
    stored_prefix: str,
    environ: MutableMapping[str, str] | None = None,
    pid: int | None = None,
) -> tuple[socket.socket | None, list[tuple[str, int]]]:
    """The listening socket, and the descriptors from the fd store (those whose names
    begin with `stored_prefix`), as (name, fd)."""
    passed = named_fds(environ, pid)
    stored = [(name, fd) for fd, name in passed if name.startswith(stored_prefix)]
    sockets = [fd for fd, name in passed if not name.startswith(stored_prefix)]
    return _listener(sockets), stored


def keep(name: str, fd: int) -> bool:
    """Put `fd` in our fd store as `name`: the next start of the service gets it back.

    FDPOLL=0: systemd would otherwise poll it to drop it on a hang-up, and epoll refuses
    an O_PATH descriptor (EBADF), which makes systemd refuse the descriptor."""
    return sd_notify(f"FDSTORE=1\nFDNAME={name}\nFDPOLL=0", [fd])


def forget(name: str) -> bool:
    """Take every descriptor named `name` out of our fd store."""
    return sd_notify(f"FDSTOREREMOVE=1\nFDNAME={name}")


def _listener(fds: list[int]) -> socket.socket | None:
    if not fds:
        return None
    if len(fds) != 1:
        raise ConfigError(
            f"socket activation: systemd passed {len(fds)} sockets; the gate serves one",
            hint=UNIT_HINT,
        )
    return listener_from_fd(fds[0])


def served_path(sock: socket.socket) -> str:
    """The path a unix socket is bound to; an abstract name is shown as @name."""
    name = sock.getsockname()
    if isinstance(name, bytes):
        return "@" + name[1:].decode(errors="replace")
    return str(name)
