"""The gate's checks of a request against its own settings and the filesystem.

volutectl/messages.py has already checked each field's type, range and name when the
request was decoded; what is left needs the gate's configuration (is the mind
configured, is the message within the limit) or a look at the disk (register_repo).
Each refusal names the field and carries its exit code (65 bad data, 67 unknown mind).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from volutectl.config import Settings
from volutectl.errors import EX_NOUSER, DataError, VoluteError
from volutectl.messages import DeliverRequest
from volutectl.store import NewDelivery

# register_repo never watches below these, wherever a symlink points.
KERNEL_FILESYSTEMS = (Path("/proc"), Path("/sys"), Path("/dev"))


def configured_mind(settings: Settings, name: str) -> str:
    """`name`, if it is a configured mind; else the refusal (67) that lists them."""
    if name not in settings.minds:
        known = ", ".join(sorted(settings.minds)) or "none"
        raise VoluteError(
            f"unknown mind {name!r}",
            hint=f"configured minds: {known} (add a [minds.{name}] table)",
            exit_code=EX_NOUSER,
        )
    return name


def delivery(settings: Settings, request: DeliverRequest) -> NewDelivery:
    """The row to add for a deliver request: its mind is configured, its message fits."""
    mind = configured_mind(settings, request.mind)
    try:
        data = request.message.encode()
    except UnicodeEncodeError:
        raise DataError(f"message: the message for {mind} is not valid UTF-8 text") from None
    limit = settings.gate.max_message_bytes
    if len(data) > limit:
        raise DataError(
            f"message: the message for {mind} is {len(data)} bytes, over the limit of {limit}",
            hint="raise gate.max_message_bytes, or send a path instead of the content",
        )
    return NewDelivery(mind, request.session, data, request.interrupt, request.request_id)


def git_common_dir(path: str, uid: int) -> Path:
    """The resolved git common directory at `path`, if the user `uid` may register it.

    It must be a directory with HEAD, objects/ and refs/ (what `volutectl test` sends:
    its repository's common dir), owned by `uid` or by root (root may register any
    repository), and not under /proc, /sys or /dev once symlinks are resolved. The gate
    watches what it registers and persists it, so a group member must not make it watch
    anyone else's tree, or the kernel's.
    """
    resolved = Path(os.path.realpath(path))
    for root in KERNEL_FILESYSTEMS:
        if resolved == root or root in resolved.parents:
            raise DataError(f"path: {path} is under {root}, not a git repository")
    try:
        info = os.stat(resolved)
    except OSError as error:
        raise DataError(f"path: {path}: {error.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise DataError(f"path: {path} is not a directory")
    if not (
        (resolved / "HEAD").is_file()
        and (resolved / "objects").is_dir()
        and (resolved / "refs").is_dir()
    ):
        raise DataError(
            f"path: {path} is not a git common directory (it needs HEAD, objects/ and refs/)",
            hint="register the repository's .git directory (git rev-parse --git-common-dir)",
        )
    if uid != 0 and info.st_uid not in (uid, 0):
        raise DataError(
            f"path: {path} belongs to uid {info.st_uid}; a user may register only a "
            "repository of their own (or root's)"
        )
    return resolved
