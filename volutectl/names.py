"""Names users give us (minds, sessions, request ids, repositories) and how they become unit names.

Pure: no I/O. A user-supplied name is first validated against a plain pattern, so that
errors can name the bad character; unit-name escaping (systemd-escape rules) then
guarantees that nothing can form an invalid unit name or reach outside its slice.
"""

from __future__ import annotations

import re

MIND_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SESSION_PATTERN = re.compile(r"[A-Za-z0-9$][A-Za-z0-9._:@$+-]{0,127}")
# A deliver request's id, chosen by the client (`deliver --request-id`) or made at random
# (32 hex digits). Kept unique per sender uid, so no charset beyond what a shell quotes
# easily: a script may build it from a date and a job name.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")

# systemd's unit names are at most 255 bytes, the ".scope" suffix included.
UNIT_NAME_MAX = 255
_UNIT_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:_.")


class NameError_(ValueError):
    """A name that is not allowed; the message says which and why."""


def check_mind(name: str) -> str:
    if not MIND_PATTERN.fullmatch(name):
        raise NameError_(
            f"invalid mind name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def check_session(name: str) -> str:
    if not SESSION_PATTERN.fullmatch(name):
        raise NameError_(
            f"invalid session name {name!r}: use 1-128 letters, digits or ._:@$+-, "
            "starting with a letter, digit or '$'"
        )
    return name


def check_request_id(request_id: str) -> str:
    if not REQUEST_ID_PATTERN.fullmatch(request_id):
        shown = request_id if len(request_id) <= 140 else f"{request_id[:140]}..."
        raise NameError_(
            f"invalid request id {shown!r}: use 1-128 letters, digits or ._:@+-, "
            "starting with a letter or digit"
        )
    return request_id


def escape_unit_part(text: str) -> str:
    """Escape `text` the way `systemd-escape` does, so it is one safe unit-name part.

    '/' becomes '-', every byte outside [A-Za-z0-9:_.] becomes \\xNN, and a leading
    '.' is escaped too. A '-' in the input is escaped (\\x2d), so an escaped part can
    never introduce slice nesting or a second name component.
    """
    if text == "":
        return ""
    out: list[str] = []
    for index, char in enumerate(text):
        if char == "/":
            out.append("-")
        elif char in _UNIT_SAFE and not (index == 0 and char == "."):
            out.append(char)
        else:
            out.extend(f"\\x{byte:02x}" for byte in char.encode())
    return "".join(out)


def unescape_unit_part(text: str) -> str:
    """Undo escape_unit_part. A '\\' not followed by two hex digits stays as it is."""
    raw = bytearray()
    index = 0
    while index < len(text):
        code = text[index + 2 : index + 4]
        if (
            text.startswith("\\x", index)
            and len(code) == 2
            and all(c in "0123456789abcdefABCDEF" for c in code)
        ):
            raw.append(int(code, 16))
            index += 4
        elif text[index] == "-":
            raw.extend(b"/")
            index += 1
        else:
            raw.extend(text[index].encode())
            index += 1
    return raw.decode(errors="replace")


def turn_scope_name(mind: str, turn_id: int) -> str:
    """`volute-turn-<escaped mind>-<turn id>.scope`; the id is the part after the last '-'.

    The mind name is checked first: escaping alone would make any name safe, but a
    name that check_mind refuses could never be parsed back by parse_turn_scope_name.
    """
    check_mind(mind)
    if turn_id < 0:
        raise NameError_(f"turn id {turn_id} is negative")
    name = f"volute-turn-{escape_unit_part(mind)}-{turn_id}.scope"
    if len(name.encode()) > UNIT_NAME_MAX:
        raise NameError_(f"mind name {mind!r} is too long for a unit name")
    return name


def parse_turn_scope_name(unit: str) -> tuple[str, int] | None:
    """(mind, turn id) from a turn scope's unit name, or None if it is not one of ours.

    Only a name that turn_scope_name could have made counts: a stranger's scope in
    the slice, or a hand-made name with a bad escape, is not a turn.
    """
    match = re.fullmatch(r"volute-turn-(.+)-([0-9]+)\.scope", unit)
    if match is None:
        return None
    mind, turn_id = unescape_unit_part(match.group(1)), int(match.group(2))
    if not MIND_PATTERN.fullmatch(mind) or turn_scope_name(mind, turn_id) != unit:
        return None
    return mind, turn_id


def check_slice_name(name: str) -> str:
    """A slice we may create units in. Dashes nest slices, so systemd refuses a slice
    name with a leading, trailing or doubled dash; "-.slice" (the root) is refused too."""
    stem = name.removesuffix(".slice")
    if (
        not re.fullmatch(r"[A-Za-z0-9:_.\\-]+\.slice", name)
        or len(name) > UNIT_NAME_MAX
        or stem.startswith("-")
        or stem.endswith("-")
        or "--" in stem
    ):
        raise NameError_(f"invalid slice name {name!r}: it must look like 'volute-turns.slice'")
    return name
