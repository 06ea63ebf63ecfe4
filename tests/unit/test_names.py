"""Names users give us, and the unit names made from them.

escape_unit_part is checked against the real `systemd-escape` binary (a pure string
tool from the systemd package; it talks to no manager).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from volutectl import names
from volutectl.names import (
    NameError_,
    check_mind,
    check_session,
    check_slice_name,
    escape_unit_part,
    parse_turn_scope_name,
    turn_scope_name,
    unescape_unit_part,
)

ODD_STRINGS = [
    "plain",
    "with space",
    "a-b",
    "-leading-dash",
    "trailing-",
    ".hidden",
    "..",
    "...",
    "a.b",
    "/",
    "/a/b/",
    "a//b",
    "back\\slash",
    "\\x2d",
    "colon:under_score",
    "tab\there",
    "new\nline",
    "ünïcödé",
    "日本語",
    "emoji 💡",
    "$HOME;rm -rf *",
    "quote'\"`",
    "percent%s",
    "@at+plus",
    "x" * 200,
]


def systemd_escape(texts: list[str]) -> list[str]:
    binary = shutil.which("systemd-escape") or "/usr/bin/systemd-escape"
    # One call for all: systemd-escape prints the escaped arguments on one line, separated
    # by spaces (a space in an argument comes out as \x20, so the split is safe).
    result = subprocess.run(
        [binary, "--", *texts], capture_output=True, text=True, check=True, timeout=30
    )
    return result.stdout.removesuffix("\n").split(" ")


def test_escape_matches_systemd_escape() -> None:
    expected = systemd_escape(ODD_STRINGS)
    assert [escape_unit_part(text) for text in ODD_STRINGS] == expected


@given(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=20))
def test_escape_matches_systemd_escape_for_any_text(texts: list[str]) -> None:
    # systemd-escape takes argv, which cannot hold NUL.
    texts = [text.replace("\0", "") or "x" for text in texts]
    assert [escape_unit_part(text) for text in texts] == systemd_escape(texts)


@pytest.mark.parametrize("text", ODD_STRINGS)
def test_unescape_round_trip(text: str) -> None:
    assert unescape_unit_part(escape_unit_part(text)) == text


def test_unescape_keeps_a_broken_escape() -> None:
    assert unescape_unit_part("a\\xzz") == "a\\xzz"
    assert unescape_unit_part("a\\x2") == "a\\x2"
    assert unescape_unit_part("a\\x2db") == "a-b"


@given(st.text())
def test_escape_output_alphabet(text: str) -> None:
    escaped = escape_unit_part(text)
    assert re.fullmatch(r"[A-Za-z0-9:_.\\-]*", escaped)
    # '-' appears exactly where the input had '/': never from a '-' or anything else.
    assert escaped.count("-") == text.count("/")
    assert not escaped.startswith(".")
    assert unescape_unit_part(escaped) == text


MINDS = ["alice", "Bob2", "a", "a-b", "a.b", "a_b", "x" * 64, "9lives"]


@pytest.mark.parametrize("mind", MINDS)
@pytest.mark.parametrize("turn_id", [0, 1, 42, 10**12])
def test_turn_scope_name_round_trip(mind: str, turn_id: int) -> None:
    unit = turn_scope_name(mind, turn_id)
    assert unit.startswith("volute-turn-") and unit.endswith(f"-{turn_id}.scope")
    assert parse_turn_scope_name(unit) == (mind, turn_id)


def test_turn_scope_name_escapes_dashes() -> None:
    # A '-' in a unit name would nest it in a slice of that prefix; it must be escaped.
    assert turn_scope_name("a-b", 7) == "volute-turn-a\\x2db-7.scope"


@given(st.from_regex(names.MIND_PATTERN, fullmatch=True), st.integers(min_value=0))
def test_turn_scope_name_round_trip_any_mind(mind: str, turn_id: int) -> None:
    unit = turn_scope_name(mind, turn_id)
    assert len(unit.encode()) <= names.UNIT_NAME_MAX
    assert parse_turn_scope_name(unit) == (mind, turn_id)


BAD_MINDS = ["", "a/b", "/", "..", ".", ".hidden", "a b", " a", "-a", "x" * 65, "a\n", "ü"]


@pytest.mark.parametrize("mind", BAD_MINDS)
def test_bad_mind_names_are_rejected(mind: str) -> None:
    with pytest.raises(NameError_, match="invalid mind name"):
        check_mind(mind)
    with pytest.raises(NameError_):
        turn_scope_name(mind, 1)


def test_negative_turn_id_is_rejected() -> None:
    with pytest.raises(NameError_):
        turn_scope_name("alice", -1)


@pytest.mark.parametrize(
    "unit",
    [
        "volute-turn-alice.scope",  # no id
        "volute-turn--1.scope",  # no mind
        "volute-turn-alice-1.service",
        "other-alice-1.scope",
        "volute-turn-a-b-1.scope",  # a raw '-' is a '/' after unescaping
        "volute-turn-a\\x20b-1.scope",  # a space: no mind name has one
        "volute-turn-alice-01.scope",  # not what turn_scope_name makes
        "volute-turn-\\x61lice-1.scope",  # over-escaped
        "volute-turn-a\\xzz-1.scope",  # broken escape
    ],
)
def test_parse_rejects_foreign_units(unit: str) -> None:
    assert parse_turn_scope_name(unit) is None


@pytest.mark.parametrize("session", ["s1", "$main", "chat:42@home+x", "a" * 128])
def test_good_sessions(session: str) -> None:
    assert check_session(session) == session


@pytest.mark.parametrize("session", ["", "a/b", "a b", ".x", "a" * 129])
def test_bad_sessions(session: str) -> None:
    with pytest.raises(NameError_, match="invalid session name"):
        check_session(session)


@pytest.mark.parametrize(
    "name", ["volute-turns.slice", "volute.slice", "a:b_c.slice", "system-volute.slice"]
)
def test_good_slices(name: str) -> None:
    assert check_slice_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["volute-turns", "-.slice", "-a.slice", "a-.slice", "a--b.slice", "a b.slice", ".slice"],
)
def test_bad_slices(name: str) -> None:
    with pytest.raises(NameError_, match="invalid slice name"):
        check_slice_name(name)
