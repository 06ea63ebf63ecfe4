"""The gate's checks of a request against its own settings and the filesystem.

volutectl/wire/messages.py has already checked each field's type, range and name when the
request was decoded; what is left needs the gate's configuration (is the mind
configured, is the message within the limit) or a look at the disk (register_repo).
Each refusal names the field and carries its exit code (65 bad data, 67 unknown mind).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Collection
from pathlib import Path

from volutectl.config.settings import Settings
from volutectl.errors import EX_NOUSER, DataError, VoluteError
from volutectl.kernel import pathwalk
from volutectl.slots import gitdirs
from volutectl.store.queue import NewDelivery
from volutectl.wire.messages import DeliverRequest

RELOAD_COMMAND = "systemctl reload volute-gate"


def configured_mind(
    settings: Settings, name: str, on_disk: Callable[[], Collection[str]] | None = None
) -> str:
    """`name`, if it is a configured mind; else the refusal (67). Its hint says to
    reload when the config file on disk (`on_disk`) has the mind but this gate has not
    read it yet; else it lists the minds configured."""
    if name not in settings.minds:
        if on_disk is not None and name in on_disk():
            hint = (
                f"the config file has [minds.{name}], but the running gate has not "
                f"loaded it: run `{RELOAD_COMMAND}`"
            )
        else:
            known = ", ".join(sorted(settings.minds)) or "none"
            hint = f"configured minds: {known} (add a [minds.{name}] table)"
        raise VoluteError(f"unknown mind {name!r}", hint=hint, exit_code=EX_NOUSER)
    return name


def delivery(
    settings: Settings,
    request: DeliverRequest,
    on_disk: Callable[[], Collection[str]] | None = None,
) -> NewDelivery:
    """The row to add for a deliver request: its mind is configured, its message fits."""
    mind = configured_mind(settings, request.mind, on_disk)
    if settings.minds[mind].command is None:
        raise DataError(
            f"mind {mind} has no command: it takes leases only",
            hint="give it a command in the config, or acquire a lease for it",
        )
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


def git_common_dir(path: str, uid: int, descriptor: int | None = None) -> Path:
    """The git common directory that registering `path` would have the gate watch, if
    the user `uid` may have it watched; its path as the kernel names it.

    `path` is opened one component at a time, through no symlink a user controls; then
    its `.git` (directory or file) and its `commondir` are followed, each read bounded
    (volutectl.slots.gitdirs), and what they lead to is checked on its descriptor: a git common
    dir (HEAD, objects/ and refs/), on none of the kernel's filesystems (/proc, /sys,
    /dev), owned by `uid` or by root (root may register any repository). The gate
    watches what it registers and persists it, so a group member must not make it
    watch anyone else's tree, or the kernel's. Raises PermissionError when the gate may
    not look there (run unprivileged, it cannot enter a private home), DataError else.

    `descriptor`, a directory the client opened and passed with the request: when the
    path can be opened, it must be the very directory that the path leads to; when the
    gate may not open the path, it is the descriptor that is checked, as above."""
    try:
        top = pathwalk.open_directory(path)
    except NotADirectoryError:
        raise DataError(f"path: {path} is not a directory") from None
    except PermissionError:
        if descriptor is None:
            raise
        return _passed_common_dir(path, uid, descriptor)
    except OSError as error:
        raise DataError(f"path: {path}: {error.strerror}") from None
    except pathwalk.KernelPath as error:
        raise DataError(f"path: {path} is under {error.root}, not a git repository") from None
    except pathwalk.UntrustedPath as error:
        raise DataError(f"path: {path} is reached through {error}") from None
    common, given = _common_dir_below(path, top)
    try:
        resolved = pathwalk.descriptor_path(common)
        via = "" if resolved == given else f" leads to {resolved}, which"
        _check_common_dir(path, via, common, uid)
        if descriptor is not None and not same_inode(common, descriptor):
            raise DataError(f"path: {path}{via} is not the directory whose descriptor came with it")
    finally:
        os.close(common)
    return resolved


def _common_dir_below(path: str, top: int) -> tuple[int, Path]:
    """The common dir of the directory open at `top` (which this closes), opened, and
    the path the kernel has for `top`; DataError or PermissionError as git_common_dir."""
    try:
        where = pathwalk.kernel_filesystem(top)
        if where is not None:
            raise DataError(f"path: {path} is under {where}, not a git repository")
        given = pathwalk.descriptor_path(top)
        return gitdirs.common_dir_of(top), given
    except gitdirs.NotARepository:
        raise DataError(
            f"path: {path} is not a git common directory (it needs HEAD, objects/ and refs/)",
            hint="register the repository's .git directory (git rev-parse --git-common-dir)",
        ) from None
    except gitdirs.RepositoryRefused as refusal:
        raise DataError(f"path: {path} {refusal}") from None
    except PermissionError:
        raise
    except OSError as error:
        raise DataError(f"path: {path}: {error.strerror}") from None
    finally:
        os.close(top)


def _check_common_dir(path: str, via: str, common: int, uid: int) -> None:
    try:
        gitdirs.check_common_dir(common, uid)
    except gitdirs.NotARepository:
        raise DataError(
            f"path: {path}{via} is not a git common directory (it needs HEAD, objects/ and refs/)",
            hint="register the repository's .git directory (git rev-parse --git-common-dir)",
        ) from None
    except gitdirs.RepositoryRefused as refusal:
        raise DataError(f"path: {path}{via} {refusal}") from None


def _passed_common_dir(path: str, uid: int, descriptor: int) -> Path:
    """The common dir passed as `descriptor` with a request whose `path` the gate may not
    open: a directory, checked as git_common_dir checks what a path leads to; its path
    as the kernel names it. PermissionError if even it may not be looked into."""
    try:
        if not stat.S_ISDIR(os.fstat(descriptor).st_mode):
            raise DataError(f"path: the descriptor sent for {path} is not a directory")
        resolved = pathwalk.descriptor_path(descriptor)
        via = f" (its descriptor, {resolved})" if str(resolved) != path else ""
        with contextlib.suppress(FileNotFoundError):  # no HEAD: the check says so
            # A git dir the gate may not search (umask 077) is "permission denied",
            # not "no git directory", which is all the check below could tell.
            os.stat("HEAD", dir_fd=descriptor, follow_symlinks=False)
        _check_common_dir(path, via, descriptor, uid)
    except PermissionError:
        raise
    except OSError as error:
        raise DataError(f"path: {path}: {error.strerror}") from None
    return resolved


def same_inode(one: int, other: int) -> bool:
    """Do two descriptors refer to the same inode?"""
    first, second = os.fstat(one), os.fstat(other)
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)
