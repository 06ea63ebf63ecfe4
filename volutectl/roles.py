"""Who may do what: the two roles, their groups, and the one refusal.

Anyone who can connect to the gate's socket (group `volute`, or root) is a client: a
client may deliver, wait for its own deliveries, read the status, and list its own
queue entries. Changing others' work (pause, resume, retry, drop) and reading the
configuration are an admin's: root, or a member of group `volute-admin`. The gate asks
`role_of` for each request's peer (SO_PEERCRED), with the groups of that uid looked up
per request (`group_names`), so a change of membership takes effect at once.
"""

from __future__ import annotations

import enum
import grp
import os
import pwd
from collections.abc import Collection

from volutectl.errors import PermissionDeniedError

CLIENT_GROUP = "volute"  # may use the gate's socket (volute-gate.socket's SocketGroup=)
ADMIN_GROUP = "volute-admin"  # may also change others' work, and read the config


class Role(enum.Enum):
    CLIENT = "client"
    ADMIN = "admin"


def role_of(uid: int, groups: Collection[str]) -> Role:
    """The role of `uid`, a member of `groups` (names): root and ADMIN_GROUP's members
    are admins; anyone else who got this far (the socket let them connect) a client."""
    if uid == 0 or ADMIN_GROUP in groups:
        return Role.ADMIN
    return Role.CLIENT


def permits(role: Role, needed: Role) -> bool:
    """Does `role` carry what `needed` asks? An admin may do all a client may."""
    return role is Role.ADMIN or needed is Role.CLIENT


def group_names(uid: int) -> frozenset[str]:
    """The names of the groups `uid` is in, from the user database: its primary group and
    its supplementary ones. A uid with no passwd entry is in no group."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return frozenset()
    names = set()
    for gid in os.getgrouplist(entry.pw_name, entry.pw_gid):
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue  # a gid with no name
    return frozenset(names)


def current_role() -> Role:
    """This process's role, by its effective uid (what the gate would decide for it)."""
    uid = os.geteuid()
    return role_of(uid, group_names(uid))


ADMIN_HINT = (
    f"needs root or membership of group {ADMIN_GROUP} (adduser USER {ADMIN_GROUP}, "
    "then log in again)"
)


def admin_refusal(message: str) -> PermissionDeniedError:
    """The one refusal (77) of what an admin alone may do; `message` says what it was."""
    return PermissionDeniedError(message, hint=ADMIN_HINT)
