"""Text that others wrote, made safe to show on a terminal: every character that could
move the cursor, erase, retitle the window or reorder a line is shown as an escape.

A turn's output, a repository path a member registered, a test run's command, an error
the gate sent: volutectl prints them, and a terminal would obey the control sequences in
them (`\\r\\033[2K` erases the line so far, `\\033]0;TITLE\\007` retitles the window, OSC 52
writes the clipboard). `visible` shows them instead, as `systemctl` and `ls -b` do:

- the C0 controls (U+0000-U+001F), DEL and the C1 controls (U+0080-U+009F, CSI and OSC
  among them): `\\a \\b \\t \\n \\v \\f \\r` by name, any other as `\\xNN` (ESC is `\\x1b`);
- the Unicode characters that reorder or break a line in a terminal or an editor: the
  bidirectional marks, embeddings, overrides and isolates (U+061C, U+200E, U+200F,
  U+202A-U+202E, U+2066-U+2069) and the line and paragraph separators (U+2028, U+2029),
  as `\\uNNNN`;
- lone surrogates (U+D800-U+DFFF: a path's bytes that are not UTF-8, as Python decodes
  them, or a `\\udcNN` in JSON) as `\\uNNNN`: written out they would be those raw bytes
  (0x9b is CSI to a terminal in 8-bit mode), or an encoding error. (A journal field that
  is not UTF-8 never gets here raw: `volutectl logs` decodes it with U+FFFD in place of
  each invalid byte.)

Left as they are: printable text of any script, and the format characters that neither
move nor hide a line (zero-width joiners, soft hyphens). A backslash is left alone too,
as systemd leaves it (unit names hold `\\x2d`): so the form cannot be read back when the
text itself holds a backslash sequence, and two texts differ in their forms whenever
they differ and hold no backslash. The form holds nothing `visible` would change, so
escaping twice is escaping once. `--json` and `-o json` never go through it: JSON's own
escapes are exact, and safe.
"""

from __future__ import annotations

import re

# Shown by name, as C, systemd's cescape and `ls -b` do.
NAMED = {"\a": "\\a", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v", "\f": "\\f", "\r": "\\r"}
SHOWN = (
    "\x00-\x1f"  # the C0 controls
    "\x7f-\x9f"  # DEL and the C1 controls
    "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"  # bidirectional controls
    "\u2028\u2029"  # line and paragraph separators
    "\ud800-\udfff"  # lone surrogates
)
# Compiled when first used, not on import: compiling costs about 1 ms, and `volutectl
# deliver` (whose errors come through here) prints nothing of others' unless it fails.
_pattern: re.Pattern[str] | None = None


def _form(match: re.Match[str]) -> str:
    char = match.group()
    named = NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _keep_newline(match: re.Match[str]) -> str:
    return "\n" if match.group() == "\n" else _form(match)


def visible(text: str, *, newlines: bool = False) -> str:
    """`text` with every control character shown as an escape (this module's docstring
    lists them). `newlines`: keep the newline as it is, for a caller that shows a text
    of several lines and marks each one itself (`volutectl logs` indents them)."""
    global _pattern  # compiled once, on first use
    if _pattern is None:
        _pattern = re.compile(f"[{SHOWN}]")
    return _pattern.sub(_keep_newline if newlines else _form, text)
