"""Checks of the gate's requests at the edge: functions of settings and a request.

Each returns the request's values in the types the gate uses, or raises a VoluteError
whose exit code the client passes on (64 unknown op, 65 bad data, 67 unknown mind).
A refusal names the field. A malformed request must never reach the store, and must
never take the gate down. protocol.decode has already refused what no field may hold
(deep nesting, integers beyond 64 bits, NaN and infinities); these check each op's
fields for their types. Fields an op does not know are ignored, so that a newer client
can add an optional one; an incompatible change bumps the protocol version instead.

All are pure except `git_common_dir`, which has to look at the filesystem.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from volutectl import names, protocol
from volutectl.config import Settings
from volutectl.errors import EX_DATAERR, EX_NOUSER, EX_USAGE, DataError, VoluteError

QUEUE_STATES = ("pending", "running", "done", "dead", "dropped")
DEFAULT_QUEUE_STATES = ["pending", "running", "dead"]
# register_repo never watches below these, wherever a symlink points.
KERNEL_FILESYSTEMS = (Path("/proc"), Path("/sys"), Path("/dev"))


def _kind(value: object) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _text(request: dict[str, Any], field: str, default: str | None = None) -> str:
    value = request.get(field, default)
    if value is None:
        raise DataError(f"{field}: missing")
    if not isinstance(value, str):
        raise DataError(f"{field}: must be a string, not {_kind(value)}")
    return value


def flag(request: dict[str, Any], field: str) -> bool:
    """An optional true/false field. Nothing else is coerced: 1, "yes" and null are refused."""
    value = request.get(field, False)
    if type(value) is not bool:
        raise DataError(f"{field}: must be true or false, not {_kind(value)}")
    return value is True


def op(request: dict[str, Any]) -> str:
    value = request.get("op")
    if value is None:
        raise DataError("op: missing: the request names no operation")
    if not isinstance(value, str):
        raise DataError(f"op: must be a string, not {_kind(value)}")
    if value not in protocol.OPS:
        raise VoluteError(
            f"op: unknown request {value[:40]!r}",
            hint=f"this gate knows: {', '.join(protocol.OPS)}",
            exit_code=EX_USAGE,
        )
    return value


def delivery(settings: Settings, request: dict[str, Any]) -> tuple[str, str, bytes, bool]:
    """(mind, session, message bytes, interrupt) of a deliver request; checks `wait` too."""
    mind = _text(request, "mind")
    session = _text(request, "session", "main")
    message = _text(request, "message")
    interrupt = flag(request, "interrupt")
    flag(request, "wait")
    try:
        names.check_mind(mind)
        names.check_session(session)
    except names.NameError_ as error:
        # It quotes the name: keep a hostile one from making the reply as long as itself.
        text = str(error) if len(str(error)) <= 300 else f"{str(error)[:300]}..."
        raise VoluteError(text, exit_code=EX_DATAERR) from None
    if mind not in settings.minds:
        known = ", ".join(sorted(settings.minds)) or "none"
        raise VoluteError(
            f"unknown mind {mind!r}",
            hint=f"configured minds: {known} (add a [minds.{mind}] table)",
            exit_code=EX_NOUSER,
        )
    try:
        data = message.encode()
    except UnicodeEncodeError:
        raise DataError(f"message: the message for {mind} is not valid UTF-8 text") from None
    limit = settings.gate.max_message_bytes
    if len(data) > limit:
        raise VoluteError(
            f"message: the message for {mind} is {len(data)} bytes, over the limit of {limit}",
            hint="raise gate.max_message_bytes, or send a path instead of the content",
            exit_code=EX_DATAERR,
        )
    return mind, session, data, interrupt


def queue_states(request: dict[str, Any]) -> list[str]:
    """The states to list; absent, null (what `queue list` sends) or [] mean the default."""
    states = request.get("states")
    if states is None or states == []:
        return list(DEFAULT_QUEUE_STATES)
    if not isinstance(states, list):
        raise DataError(f"states: must be an array of state names, not {_kind(states)}")
    for index, state in enumerate(states):
        if not isinstance(state, str) or state not in QUEUE_STATES:
            shown = repr(state[:40]) if isinstance(state, str) else _kind(state)
            raise DataError(f"states[{index}]: {shown} is not one of {', '.join(QUEUE_STATES)}")
    return list(states)


def delivery_ids(request: dict[str, Any]) -> list[int]:
    raw = request.get("ids")
    if not isinstance(raw, list):
        raise DataError(f"ids: must be an array of delivery ids, not {_kind(raw)}")
    for index, value in enumerate(raw):
        if type(value) is not int:
            raise DataError(f"ids[{index}]: a delivery id is an integer, not {_kind(value)}")
        if value < 1:
            raise DataError(f"ids[{index}]: delivery ids start at 1, not {value}")
    return list(raw)


def repository_path(request: dict[str, Any]) -> str:
    """The path of a register_repo request: absolute text (what it names is checked by
    git_common_dir)."""
    path = _text(request, "path")
    if "\0" in path:
        raise DataError("path: contains a NUL byte")
    if not path.startswith("/"):
        raise DataError(f"path: {path[:80]!r} is relative; register_repo needs an absolute path")
    return path


REQUEST_ID_LENGTH = 32  # 128 bits, in lowercase hex


def request_id(request: dict[str, Any]) -> str | None:
    """A deliver request's client-made id (128 random bits, hex), or None if it has none.

    Clients older than request ids send none; their requests are never merged."""
    value = request.get("request_id")
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or len(value) != REQUEST_ID_LENGTH
        or any(ch not in "0123456789abcdef" for ch in value)
    ):
        raise DataError(f"request_id: must be {REQUEST_ID_LENGTH} lowercase hex digits (128 bits)")
    return value


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
