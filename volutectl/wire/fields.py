"""A request's fields as the gate decodes them: each refusal a DataError (65) that names
its field.

volutectl/wire/messages.py builds every request from these. They check types, ranges and
names only; what needs the gate's settings (is the mind configured) is
volutectl/gate/validate.py's. Light on purpose, like messages.py: `volutectl deliver` loads
it on its hot path.
"""

from __future__ import annotations

from volutectl.errors import DataError
from volutectl.names import NameError_, check_mind, check_request_id, check_session
from volutectl.states import QueueState
from volutectl.wire.records import kind_of

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: no `typing` import at run time
if TYPE_CHECKING:
    from typing import Any

REQUEST_ID_LENGTH = 32  # what a client makes at random: 128 bits, lowercase hex
QUEUE_LIMIT = 50  # rows a queue request lists unless it asks for another number
QUEUE_LIMIT_MAX = 10_000  # about 2.5 MB of reply


def text(obj: dict[str, Any], field: str, default: str | None = None) -> str:
    value = obj.get(field, default)
    if value is None:
        raise DataError(f"{field}: missing")
    if not isinstance(value, str):
        raise DataError(f"{field}: must be a string, not {kind_of(value)}")
    return value


def flag(obj: dict[str, Any], field: str) -> bool:
    """An optional true/false field. Nothing else is coerced: 1, "yes" and null are refused."""
    value = obj.get(field, False)
    if type(value) is not bool:
        raise DataError(f"{field}: must be true or false, not {kind_of(value)}")
    return value is True


def delivery_ids(obj: dict[str, Any]) -> tuple[int, ...]:
    raw = obj.get("ids")
    if not isinstance(raw, list):
        raise DataError(f"ids: must be an array of delivery ids, not {kind_of(raw)}")
    for index, value in enumerate(raw):
        if type(value) is not int:
            raise DataError(f"ids[{index}]: a delivery id is an integer, not {kind_of(value)}")
        if value < 1:
            raise DataError(f"ids[{index}]: delivery ids start at 1, not {value}")
    return tuple(raw)


def queue_states(obj: dict[str, Any]) -> tuple[QueueState, ...]:
    """The states to list; absent, null or [] mean the default (states.DEFAULT_LISTED)."""
    states = obj.get("states")
    if states is None or states == []:
        return ()
    if not isinstance(states, list):
        raise DataError(f"states: must be an array of state names, not {kind_of(states)}")
    known = [state.value for state in QueueState]
    for index, state in enumerate(states):
        if not isinstance(state, str) or state not in known:
            shown = repr(state[:40]) if isinstance(state, str) else kind_of(state)
            raise DataError(f"states[{index}]: {shown} is not one of {', '.join(known)}")
    return tuple(QueueState(state) for state in states)


def queue_limit(obj: dict[str, Any]) -> int:
    value = obj.get("limit", QUEUE_LIMIT)
    if type(value) is not int:
        raise DataError(f"limit: must be an integer, not {kind_of(value)}")
    if not 1 <= value <= QUEUE_LIMIT_MAX:
        raise DataError(f"limit: {value} is not between 1 and {QUEUE_LIMIT_MAX}")
    return value


def request_id(obj: dict[str, Any]) -> str | None:
    """A deliver request's client-made id, or None if it has none. Clients older than
    request ids send none; their requests are never merged. volutectl makes 32 random
    hex digits, or takes the user's (`deliver --request-id`): any names.REQUEST_ID_PATTERN."""
    value = obj.get("request_id")
    if value is None:
        return None
    if not isinstance(value, str):
        raise DataError(f"request_id: must be a string, not {kind_of(value)}")
    try:
        return check_request_id(value)
    except NameError_ as error:
        raise DataError(f"request_id: {_shorter(str(error))}") from None


def names(mind: str, session: str) -> None:
    try:
        check_mind(mind)
        check_session(session)
    except NameError_ as error:
        raise DataError(_shorter(str(error))) from None


def mind_names(obj: dict[str, Any]) -> tuple[str, ...] | None:
    """The minds a pause or resume names, as given; absent or null: every mind. An empty
    array is refused: a program whose list of minds came out empty must not pause all."""
    raw = obj.get("minds")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise DataError(f"minds: must be an array of mind names, not {kind_of(raw)}")
    if not raw:
        raise DataError("minds: empty: name at least one mind, or leave minds out for every mind")
    for index, name in enumerate(raw):
        if not isinstance(name, str):
            raise DataError(f"minds[{index}]: a mind name is a string, not {kind_of(name)}")
        try:
            check_mind(name)
        except NameError_ as error:
            raise DataError(f"minds[{index}]: {_shorter(str(error))}") from None
    return tuple(raw)


def _shorter(text: str) -> str:
    # A refusal quotes the name: keep a hostile one from making the reply as long as itself.
    return text if len(text) <= 300 else f"{text[:300]}..."


MAX_LEASE_PIDS = 64  # pidfds one acquire may pass (SCM_RIGHTS)
TOKEN_LENGTH = 32  # a lease's token: 128 bits, lowercase hex


def lease_id(obj: dict[str, Any]) -> int:
    value = obj.get("lease")
    if type(value) is not int:
        raise DataError(f"lease: must be a lease id (an integer), not {kind_of(value)}")
    if value < 1:
        raise DataError(f"lease: lease ids start at 1, not {value}")
    return value


def token(obj: dict[str, Any]) -> str:
    value = text(obj, "token")
    if len(value) != TOKEN_LENGTH or any(c not in "0123456789abcdef" for c in value):
        raise DataError(f"token: must be {TOKEN_LENGTH} lowercase hex digits")
    return value


def pid_count(obj: dict[str, Any]) -> int:
    value = obj.get("pids", 0)
    if type(value) is not int:
        raise DataError(f"pids: must be a count of pidfds (an integer), not {kind_of(value)}")
    if not 0 <= value <= MAX_LEASE_PIDS:
        raise DataError(f"pids: {value} is not between 0 and {MAX_LEASE_PIDS} (MAX_LEASE_PIDS)")
    return value
