"""volutectl/visible.py: what others wrote reaches a terminal as text, never as control.

The properties hold for any text (hypothesis draws every code point, surrogates
included); the examples are the attacks of issue 29 (findings 3 and 4).
"""

from __future__ import annotations

import unicodedata

from hypothesis import example, given
from hypothesis import strategies as st

from volutectl.visible import NAMED, visible

# What a terminal or an editor obeys, said independently of the module's own table: the
# Unicode categories of controls, surrogates and separators, and the bidi controls.
BIDI = {0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()))


def obeyed(char: str) -> bool:
    return unicodedata.category(char) in ("Cc", "Cs", "Zl", "Zp") or ord(char) in BIDI


def read_back(shown: str) -> str:
    """The reader's side: the text a form stands for (exact when the text held no
    backslash, as the module's docstring says)."""
    names = {form: char for char, form in NAMED.items()}
    out, index = [], 0
    while index < len(shown):
        two = shown[index : index + 2]
        if two in names:
            out.append(names[two])
            index += 2
        elif two == "\\x":
            out.append(chr(int(shown[index + 2 : index + 4], 16)))
            index += 4
        elif two == "\\u":
            out.append(chr(int(shown[index + 2 : index + 6], 16)))
            index += 6
        else:
            out.append(shown[index])
            index += 1
    return "".join(out)


@given(ANY_TEXT)
@example("x\r\033[2K2099-01-01 00:00:00 gate: turn 1 of m/main started")
@example("\033]0;TITLE\007\033]52;c;ZXZpbA==\007")
@example("\x9b2J\u202egnp.exe\u2028\udc9b")
def test_nothing_a_terminal_obeys_comes_out(text: str) -> None:
    shown = visible(text)
    assert not [char for char in shown if obeyed(char)]
    assert visible(shown) == shown  # escaping twice is escaping once


@given(ANY_TEXT)
def test_a_text_with_no_backslash_reads_back_exactly(text: str) -> None:
    text = text.replace("\\", "/")
    assert read_back(visible(text)) == text
    assert read_back(visible(text, newlines=True)) == text


@given(ANY_TEXT, ANY_TEXT)
def test_two_texts_with_no_backslash_stay_apart(one: str, two: str) -> None:
    one, two = one.replace("\\", ""), two.replace("\\", "")
    assert (visible(one) == visible(two)) == (one == two)


@given(ANY_TEXT)
def test_newlines_kept_when_asked_and_nothing_else(text: str) -> None:
    shown = visible(text, newlines=True)
    assert shown.count("\n") == text.count("\n")
    assert not [char for char in shown if obeyed(char) and char != "\n"]
    assert "\n" not in visible(text)


@given(st.text(st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp"))))
def test_printable_text_is_left_as_it_is(text: str) -> None:
    text = "".join(char for char in text if ord(char) not in BIDI)
    assert visible(text) == text


def test_the_forms_are_those_of_systemctl_and_ls() -> None:
    assert visible("x\r\033[2Kgate: \033]0;TITLE\007") == r"x\r\x1b[2Kgate: \x1b]0;TITLE\a"
    assert visible("\x00\x7f\x9b\t\v\f\b") == r"\x00\x7f\x9b\t\v\f\b"
    assert visible("\u202e\u2028\u2066\udc9b") == r"\u202e\u2028\u2066\udc9b"
    assert visible("a\nb") == r"a\nb" and visible("a\nb", newlines=True) == "a\nb"
    # A unit name's own escapes, a path, and any script pass as they are.
    for text in (r"volute-turn-m\x2d1-2.scope", "/home/zoë/repo", "日本語 ✓ 👩‍💻", "a\\b"):
        assert visible(text) == text
