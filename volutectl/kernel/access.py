"""Who may do what to a file, computed from its mode, owner and group, as the kernel would.

Preflight (volutectl/launcher/preflight.py) asks whether a mind's user may run its command and
enter its working directory, and `volutectl doctor` whether the caller may connect to
the gate's socket. The checker is often root, for whom every `os.access` says yes: so
the answer is computed for the other user from `stat` and that user's groups instead.

The rules are the kernel's for mode bits: the owner's bits apply to the owner (even
when the group's or others' would allow more), then the group's to members of the
file's group, then the others' bits. Root may read, write and search anything, and
execute a file that has any execute bit. POSIX ACLs and mount options such as noexec
are not read: a file that passes here may still be refused by those.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

READ, WRITE, EXECUTE = 4, 2, 1  # also SEARCH, for a directory


@dataclass(frozen=True)
class Who:
    """A user as permission checks see it: its uid, primary gid and every group."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def permits(st: os.stat_result, who: Who, want: int) -> bool:
    """May `who` read / write / execute (search) a file with this stat? `want` ORs bits."""
    mode = st.st_mode
    if who.uid == 0:
        if want & EXECUTE and not stat.S_ISDIR(mode):
            return bool(mode & 0o111)
        return True
    if st.st_uid == who.uid:
        bits = (mode >> 6) & 7
    elif st.st_gid == who.gid or st.st_gid in who.groups:
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & want == want


def describe(st: os.stat_result) -> str:
    """'mode 0750, owner root:staff', as an operator would check it with ls -l."""
    owner = f"{user_name(st.st_uid)}:{group_name(st.st_gid)}"
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner {owner}"


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


class Unknown(Exception):
    """This process may not look (stat said EACCES): only a more privileged checker can."""

    def __init__(self, path: str) -> None:
        super().__init__(f"cannot look at {path} as {user_name(os.geteuid())} (permission denied)")
        self.path = path


def stat_or_none(path: str) -> os.stat_result | None:
    """The file's stat (symlinks followed), None if it does not exist; Unknown if we may
    not look."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError:
        raise Unknown(path) from None


def blocking_directory(path: str, who: Who) -> tuple[str, os.stat_result] | None:
    """The first directory on the way to `path` (absolute) that `who` may not search, if
    any; the path as written and, when a symlink leads elsewhere, its target's way too.
    A directory that does not exist blocks nothing here: its absence is said elsewhere."""
    ways = [path]
    real = os.path.realpath(path)
    if real != path:
        ways.append(real)
    for way in ways:
        parents = reversed(PurePosixPath(way).parents)  # "/", "/srv", "/srv/mind", ...
        for parent in parents:
            st = stat_or_none(str(parent))
            if st is None:
                return None
            if stat.S_ISDIR(st.st_mode) and not permits(st, who, EXECUTE):
                return str(parent), st
    return None


def calling_user() -> tuple[Who, tuple[int, ...]]:
    """This process's user as permission checks see it, and the groups that the group
    database gives that user (what a new login would have)."""
    uid = os.geteuid()
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return Who(str(uid), uid, os.getegid(), tuple(os.getgroups())), ()
    login = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return Who(entry.pw_name, uid, os.getegid(), tuple(os.getgroups())), login


def socket_access(
    path: str, group: str, caller: Who, login_groups: tuple[int, ...]
) -> tuple[Literal["ok", "warn"], str, str]:
    """(status, found, change) for doctor: may `caller` connect to the gate's socket?

    Connecting takes write permission on the socket file. `group` is the group it is
    made for (gate.socket_group; volute-gate.socket's SocketGroup=), used while it does
    not exist. `login_groups` are the caller's groups in the group database, which a new
    login would get: a user added to the group is not in it until logging in again."""
    if caller.uid == 0:
        return "ok", f"{caller.name} is uid 0: it may connect whatever the socket's group", ""
    st = stat_or_none(path)
    if st is not None and permits(st, caller, WRITE):
        return "ok", f"{caller.name} may connect to {path} ({describe(st)})", ""
    if st is not None:
        gid, where = st.st_gid, f"{path} ({describe(st)})"
    else:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            found = f"{path} does not exist, and its group {group} (gate.socket_group) neither"
            return "warn", found, f"groupadd --system {group}, or set gate.socket_group"
        if gid == caller.gid or gid in caller.groups:
            found = f"{caller.name} is in group {group}, which {path} will belong to once it exists"
            return "ok", found, ""
        where = f"{path} (not there yet; it will belong to group {group})"
    name = group_name(gid)
    if st is not None and (gid == caller.gid or gid in caller.groups):
        found = f"{caller.name} is in group {name}, but the mode of {where} lets no member write"
        return "warn", found, f"chmod g+w {path} (volute-gate.socket sets SocketMode=0660)"
    if gid in login_groups:
        return (
            "warn",
            f"{caller.name} is in group {name} but this login is not yet, so it may not "
            f"connect to {where}",
            f"log in again (or run: newgrp {name})",
        )
    return (
        "warn",
        f"{caller.name} may not connect to {where}: it is neither root nor in group "
        f"{name}, so deliver, status and queue exit 77",
        f"usermod -aG {name} {caller.name}, then log in again",
    )
