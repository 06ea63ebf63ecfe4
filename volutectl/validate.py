"""Checks of the gate's requests at the edge: pure functions of settings and a request.

Each returns the request's values in the types the gate uses, or raises a VoluteError
whose exit code the client passes on (65 bad data, 67 unknown mind). A malformed
request must never reach the store, and must never take the gate down.
"""

from __future__ import annotations

from typing import Any

from volutectl import names
from volutectl.config import Settings
from volutectl.errors import EX_DATAERR, EX_NOUSER, DataError, VoluteError

QUEUE_STATES = ("pending", "running", "done", "dead", "dropped")
DEFAULT_QUEUE_STATES = ["pending", "running", "dead"]


def delivery(settings: Settings, request: dict[str, Any]) -> tuple[str, str, bytes, bool]:
    """(mind, session, message bytes, interrupt) of a deliver request."""
    mind = request.get("mind")
    session = request.get("session", "main")
    message = request.get("message")
    if not isinstance(mind, str) or not isinstance(session, str):
        raise DataError("mind and session must be strings")
    if not isinstance(message, str):
        raise DataError("the message must be text")
    try:
        names.check_mind(mind)
        names.check_session(session)
    except names.NameError_ as error:
        raise VoluteError(str(error), exit_code=EX_DATAERR) from None
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
        raise DataError(f"the message for {mind} is not valid UTF-8 text") from None
    limit = settings.gate.max_message_bytes
    if len(data) > limit:
        raise VoluteError(
            f"message for {mind} is {len(data)} bytes, over the limit of {limit}",
            hint="raise gate.max_message_bytes, or send a path instead of the content",
            exit_code=EX_DATAERR,
        )
    return mind, session, data, bool(request.get("interrupt"))


def queue_states(request: dict[str, Any]) -> list[str]:
    states = request.get("states") or DEFAULT_QUEUE_STATES
    if not isinstance(states, list) or any(state not in QUEUE_STATES for state in states):
        raise DataError(f"states must be a list of {', '.join(QUEUE_STATES)}")
    return list(states)


def delivery_ids(request: dict[str, Any]) -> list[int]:
    raw = request.get("ids")
    if not isinstance(raw, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in raw
    ):
        raise DataError("ids must be a list of delivery ids (integers)")
    return [int(i) for i in raw]


def repository_path(request: dict[str, Any]) -> str:
    path = request.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise DataError("register_repo needs the absolute path of a git common dir")
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
