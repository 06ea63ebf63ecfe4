"""The pure core of the test-run cap: cap resolution, slot choice, wait line, history."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from volutectl.core import slotmath
from volutectl.core.slotmath import InFlight, RunRecord
from volutectl.errors import ConfigError
from volutectl.names import UNIT_NAME_MAX


def test_cap_flag_wins_over_repository_and_config() -> None:
    assert slotmath.resolve_cap(3, "1", 2) == slotmath.Cap(3, "--slots")
    assert slotmath.resolve_cap(0, "1", 2).slots == 0


def test_cap_repository_setting_wins_over_config() -> None:
    cap = slotmath.resolve_cap(None, " 2\n", 5, "file /etc/volute/volutectl.toml")
    assert cap == slotmath.Cap(2, "git config volute.testSlots")


def test_cap_falls_back_to_config_and_names_its_source() -> None:
    cap = slotmath.resolve_cap(None, None, 4, "env VOLUTE_TESTS__CONCURRENT_RUNS")
    assert cap.slots == 4
    assert cap.source == "tests.concurrent_runs (env VOLUTE_TESTS__CONCURRENT_RUNS)"
    assert slotmath.resolve_cap(None, "", 0).slots == 0


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_cap_bad_repository_setting_is_a_config_error_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match="volute.testSlots"):
        slotmath.resolve_cap(None, value, 1)


def test_cap_negative_flag_is_refused() -> None:
    with pytest.raises(ConfigError, match="--slots"):
        slotmath.resolve_cap(-1, None, 1)


def test_slot_names_count_from_one() -> None:
    assert slotmath.slot_names(3) == ["slot-1", "slot-2", "slot-3"]
    assert slotmath.slot_names(0) == []


@given(st.lists(st.booleans(), max_size=12))
def test_choose_slot_takes_the_lowest_free_slot(free: list[bool]) -> None:
    chosen = slotmath.choose_slot(free)
    if True in free:
        assert chosen == free.index(True)
    else:
        assert chosen is None


@given(
    st.text(min_size=1).filter(lambda text: ": " not in text),
    st.lists(st.text(min_size=1), min_size=1, max_size=5),
)
def test_scope_description_round_trips(worktree: str, argv: list[str]) -> None:
    description = slotmath.scope_description(worktree, argv)
    assert slotmath.parse_scope_description(description) == (
        worktree,
        slotmath.join_command(argv),
    )


def test_foreign_descriptions_are_not_ours() -> None:
    assert slotmath.parse_scope_description("/usr/bin/foo") is None
    assert slotmath.parse_scope_description("volutectl test in /srv/wt") is None


def test_join_command_quotes_what_a_shell_would_split() -> None:
    assert slotmath.join_command(["pytest", "-x", "tests/unit"]) == "pytest -x tests/unit"
    assert slotmath.join_command(["sh", "-c", "echo it's"]) == "sh -c 'echo it'\"'\"'s'"


def test_wait_line_names_cap_in_flight_runs_and_typical_duration() -> None:
    runs = [InFlight("volute-test-wt1-7.scope", "/srv/wt1", "pytest -x", 125.0)]
    line = slotmath.wait_line(1, runs, 160_000, "/srv/repo/.git")
    assert "\n" not in line
    assert "1 run at a time in /srv/repo/.git" in line
    assert "in flight: /srv/wt1 `pytest -x` for 2m05s" in line
    assert "typically takes 2m40s" in line


def test_wait_line_without_history_or_scopes_still_says_why() -> None:
    line = slotmath.wait_line(2, [], None, "/r/.git")
    assert line == "volutectl test: waiting for a test slot (2 runs at a time in /r/.git)"


def test_wait_info_carries_the_same_facts() -> None:
    runs = [InFlight("u.scope", "/srv/wt1", "make check", 3.14159)]
    info = slotmath.wait_info(1, "--slots", runs, 900)
    assert info == {
        "cap": 1,
        "cap_source": "--slots",
        "in_flight": [
            {
                "unit": "u.scope",
                "worktree": "/srv/wt1",
                "command": "make check",
                "running_seconds": 3.142,
            }
        ],
        "typical_ms": 900,
    }


def test_typical_duration_prefers_same_command_and_ignores_failures() -> None:
    records = [
        RunRecord("/w", "make", 1000, 0),
        RunRecord("/w", "make", 3000, 0),
        RunRecord("/w", "make", 10, 1),
        RunRecord("/w", "pytest", 50_000, 0),
    ]
    assert slotmath.typical_duration_ms(records, "make") == 2000
    assert slotmath.typical_duration_ms(records, "pytest") == 50_000
    assert slotmath.typical_duration_ms(records, "other") == 3000
    assert slotmath.typical_duration_ms([RunRecord("/w", "x", 5, 2)], "x") is None
    assert slotmath.typical_duration_ms([], None) is None


def test_typical_duration_looks_at_recent_runs_only() -> None:
    old = [RunRecord("/w", "t", 100_000, 0)] * 50
    recent = [RunRecord("/w", "t", 1_000, 0)] * slotmath.HISTORY_WINDOW
    assert slotmath.typical_duration_ms(old + recent, "t") == 1_000


def test_history_round_trips_and_skips_torn_lines() -> None:
    record = RunRecord("/srv/wt1", "pytest -x", 1234, 0)
    line = slotmath.history_line(record, 1700000000.0)
    assert line.endswith("\n") and line.count("\n") == 1
    assert slotmath.parse_history([line, '{"worktree": "/x"', "junk", "[]", line]) == [
        record,
        record,
    ]


@given(st.text(min_size=0, max_size=300), st.integers(min_value=1, max_value=4_194_304))
def test_scope_name_is_a_valid_unit_name(worktree: str, pid: int) -> None:
    name = slotmath.test_scope_name(worktree, pid)
    assert len(name) <= UNIT_NAME_MAX
    assert name.startswith("volute-test-") and name.endswith(f"-{pid}.scope")
    assert re.fullmatch(r"[A-Za-z0-9:_.\\-]+", name)
    # No escape sequence is cut short.
    assert re.fullmatch(r"(?:[^\\]|\\x[0-9a-f]{2})*", name)


def test_scope_name_escapes_the_worktree() -> None:
    assert slotmath.test_scope_name("wt1", 42) == "volute-test-wt1-42.scope"
    assert slotmath.test_scope_name("my-wt", 42) == "volute-test-my\\x2dwt-42.scope"
