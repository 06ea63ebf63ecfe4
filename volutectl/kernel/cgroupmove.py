"""Moving a process into a cgroup as root, in every hierarchy, as systemd itself does.

systemd moves a process into a unit over D-Bus only in two cases: when it starts a
transient scope around it (StartTransientUnit's PIDs), and into a unit with Delegate=yes
(AttachProcessesToUnit: "Process migration not available on non-delegated units", asked
of systemd 252 here). A lease's turn scope and the units the runner's processes come
from (a service, a login session's scope) are not delegated, so the launcher (root)
writes the pid into the unit's cgroup.procs itself, in the same order as systemd's
`cg_attach_everywhere`: the systemd hierarchy first (the one systemd reads to know a
process's unit), then every other mounted one, each at the deepest existing cgroup on
the unit's path (a v1 controller hierarchy holds only the cgroups systemd realized
there). On a pure cgroup v2 host that is one write.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


class ProcessGone(Exception):
    """The process exited before it could be moved."""


def hierarchies(root: Path = CGROUP_ROOT) -> list[Path]:
    """The mounted hierarchies to write, the systemd one first: the root itself on a
    unified host; else root/systemd, root/unified, then each v1 controller's."""
    if (root / "cgroup.procs").is_file():
        return [root]
    found = [root / "systemd"] if (root / "systemd" / "cgroup.procs").is_file() else []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    for name in names:
        path = root / name
        if name != "systemd" and not path.is_symlink() and (path / "cgroup.procs").is_file():
            found.append(path)
    return found


def _deepest(hierarchy: Path, parts: list[str]) -> Path:
    path = hierarchy
    for part in parts:
        if not (path / part).is_dir() or (path / part).is_symlink():
            break
        path = path / part
    return path


def attach(cgroup: str, pid: int, root: Path = CGROUP_ROOT) -> None:
    """Write `pid` into `cgroup` (a path of the systemd hierarchy, as systemd's
    ControlGroup= or /proc/PID/cgroup give it) in every hierarchy. The systemd
    hierarchy's write must succeed (its cgroup must exist); the others are the closest
    systemd realized, and a failure there is not one of the move."""
    parts = [part for part in cgroup.split("/") if part]
    if any(part in (".", "..") for part in parts):
        raise ValueError(f"not a cgroup path: {cgroup!r}")
    found = hierarchies(root)
    if not found:
        raise OSError(errno.ENOENT, "no cgroup hierarchy is mounted")
    for index, hierarchy in enumerate(found):
        target = hierarchy.joinpath(*parts) if index == 0 else _deepest(hierarchy, parts)
        try:
            fd = os.open(target / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            if index == 0:
                raise
            continue
        try:
            os.write(fd, f"{pid}\n".encode())
        except OSError as error:
            if error.errno == errno.ESRCH:
                raise ProcessGone(f"pid {pid} exited") from None
            if index == 0:
                raise
        finally:
            os.close(fd)
