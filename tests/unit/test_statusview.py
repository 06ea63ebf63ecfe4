"""`volutectl status` for people (volutectl/cli/statusview.py): the aligned table of minds,
idle ones counted rather than listed, then the totals, in the one duration format."""

from __future__ import annotations

from volutectl.cli.statusview import format_status, table
from volutectl.states import AdaptiveMode, HoldReason, LeaseState, Outcome
from volutectl.wire.messages import (
    AdaptiveStatus,
    ConfigStatus,
    LeaseStatus,
    MindStatus,
    PausedMind,
    PressureStatus,
    RepositoryStatus,
    Status,
    TurnStatus,
)
from volutectl.wire.messages import (
    TestRunStatus as RunStatus,  # not a pytest class
)

NOW = 1_800_000_000.0


def status(**changes: object) -> Status:
    fields: dict[str, object] = {
        "active_turns": 2,
        "global_cap": 2,
        "turns_per_mind": 1,
        "turns": (
            TurnStatus(41, "mimsy", "chat", "volute-turn-mimsy-41.scope", 12.34),
            TurnStatus(42, "whorl", "main", "volute-turn-whorl-42.scope", 3725.0),
        ),
        "foreign_scopes": 0,
        "minds": {
            "idle1": MindStatus((), 0, last_turn_id=3, last_turn_s=9.0, last_outcome=Outcome.OK),
            "idle2": MindStatus((), 0),
            "mimsy": MindStatus(
                ("chat",), 12, last_turn_id=40, last_turn_s=185.0, last_outcome=Outcome.OK
            ),
            "pip": MindStatus((), 3, paused_since=NOW - 600),
            "whorl": MindStatus(
                ("main",),
                1,
                attempts=2,
                next_retry_s=45.2,
                dead=1,
                last_turn_id=39,
                last_turn_s=7300.0,
                last_outcome=Outcome.FAILED,
            ),
        },
        "queue_depth": 16,
        "holds": {"global_cap": 13, "paused": 3},
        "oldest_held_s": 65.0,
        "dead": 1,
        "slice": "volute-turns.slice",
        "test_runs": (),
        "io_pressure": PressureStatus(enabled=False, high=False, reason=None, trigger=None),
        "test_runs_count_as_turns": False,
        "paused": (PausedMind("pip", NOW - 600),),
    }
    fields.update(changes)
    return Status(**fields)  # type: ignore[arg-type]


def test_a_row_per_mind_with_news_aligned_then_the_idle_count_and_the_totals() -> None:
    text = format_status(status(), now=NOW)
    lines = text.splitlines()
    assert lines[0].split("  ")[0] == "MIND"
    rows = lines[1:4]
    assert [row.split()[0] for row in rows] == ["mimsy", "pip", "whorl"]  # idle ones left out
    # Aligned: every column starts at the same place on every line.
    for column in ("RUNNING", "PENDING", "LAST TURN", "PAUSED"):
        start = lines[0].index(column)
        assert all(row[start - 2 : start] == "  " for row in rows), (column, text)
    assert "chat 12.3s" in rows[0] and "40 ok, 3m05s ago" in rows[0]
    assert "main 1h02m" in rows[2] and "45.2s" in rows[2] and "39 failed, 2h01m ago" in rows[2]
    assert rows[1].rstrip().endswith("10m00s")  # paused this long
    assert lines[4] == "(2 idle minds not shown: --all shows them)"
    assert lines[5] == ""
    assert lines[6] == "turns: 2 running of 2 (1 per mind, in volute-turns.slice)"
    held = "(held: 13 global_cap, 3 paused)"
    assert lines[7] == f"queue: 16 pending {held}, oldest hold 1m05s; 1 dead"
    assert lines[8].startswith("paused: pip since ") and lines[8].endswith("(10m00s)")


def test_all_lists_idle_minds_too_and_an_idle_gate_says_so() -> None:
    every = format_status(status(), every_mind=True, now=NOW)
    assert [line.split()[0] for line in every.splitlines()[1:6]] == [
        "idle1",
        "idle2",
        "mimsy",
        "pip",
        "whorl",
    ]
    assert "not shown" not in every
    quiet = status(
        minds={"a": MindStatus((), 0)},
        turns=(),
        active_turns=0,
        queue_depth=0,
        holds={},
        oldest_held_s=None,
        dead=0,
        paused=(),
        global_cap=None,
    )
    lines = format_status(quiet, now=NOW).splitlines()
    assert lines[0] == "no mind runs, waits, has dead deliveries or is paused"
    assert lines[1] == "(1 idle mind not shown: --all shows them)"
    assert lines[3].startswith("turns: 0 running of no cap")
    assert "paused" not in "\n".join(lines[3:])


def test_every_mind_paused_is_said_once_with_named_pauses_before_it() -> None:
    paused = (PausedMind("pip", NOW - 3600), PausedMind("*", NOW - 60))
    text = format_status(status(paused=paused), now=NOW)
    line = [x for x in text.splitlines() if x.startswith("paused:")][0]
    assert line.startswith("paused: every mind, those configured later included, since ")
    assert "(1m00s)" in line and "by name before that: pip since" in line


def test_numbers_are_right_aligned_and_text_left() -> None:
    lines = table(
        [
            ["a", "-", "1", "0", "-", "-", "0", "-"],
            ["bbbb", "s 1.0s", "123", "10", "5.0s", "-", "7", "-"],
        ]
    )
    header, first, second = lines
    end = header.index("PENDING") + len("PENDING")
    assert first[:end].endswith("  1") and second[:end].endswith("123")
    assert first.startswith("a     ") and second.startswith("bbbb  ")


def test_a_mind_failing_preflight_is_flagged_in_the_totals_idle_or_not() -> None:
    failing = {"idle2": ("user nobody2 does not exist",), "pip": ("a", "b")}
    lines = format_status(status(preflight=failing), now=NOW).splitlines()
    assert "preflight: mind idle2 cannot start turns: user nobody2 does not exist" in lines
    assert "preflight: mind pip cannot start turns: a; b" in lines
    assert not any(
        line.startswith("preflight:") for line in format_status(status(), now=NOW).splitlines()
    )


def test_the_adaptive_limit_shows_its_mode_limit_bounds_and_last_move() -> None:
    adaptive = AdaptiveStatus(
        mode=AdaptiveMode.ADAPTIVE,
        limit=3,
        minimum=1,
        maximum=16,
        ceiling=8,
        reason="probe 4 ms with 2 running, baseline 2 ms: healthy, 5 waiting",
    )
    text = format_status(status(global_cap=8, adaptive=adaptive), now=NOW)
    assert "turns: 2 running of 3 (adaptive limit)" in text
    assert "adaptive limit: 3 turns (1..16, ceiling 8); probe 4 ms" in text
    assert "io cost" not in text  # nothing learnt or shown yet: no line
    costs = AdaptiveStatus(
        mode=AdaptiveMode.ADAPTIVE,
        limit=3,
        minimum=1,
        maximum=16,
        ceiling=8,
        reason=None,
        costs={"heavy": 1.0, "light": 0.0625},
        running_costs={"writer": 1.0, "quiet": 0.0625},
    )
    text = format_status(status(global_cap=8, adaptive=costs), now=NOW)
    assert (
        "io cost per turn: running quiet 1/16, writer 1; "
        "next turn heavy 1, light 1/16 (a mind not listed: 1)"
    ) in text
    fallback = AdaptiveStatus(
        mode=AdaptiveMode.FALLBACK,
        limit=2,
        minimum=1,
        maximum=16,
        ceiling=None,
        reason="/proc/pressure/io cannot be read (not PSI text)",
    )
    text = format_status(status(global_cap=None, adaptive=fallback), now=NOW)
    assert "adaptive limit (FALLBACK): 2 turns (1..16); /proc/pressure/io cannot" in text
    static = AdaptiveStatus(
        mode=AdaptiveMode.STATIC, limit=None, minimum=1, maximum=16, ceiling=2, reason=None
    )
    text = format_status(status(adaptive=static), now=NOW)
    assert "turns: 2 running of 2 (" in text and "adaptive limit: off" in text


# What a member controls and root's `status` prints (issue 29, finding 4): a registered
# path that erases the line and forges another, a worktree, a test run's command.
HOSTILE = "/srv/x\r\033[2Kpreflight: all minds ok\033]0;owned\007\nqueue: 0 pending\x9b"


def test_others_control_characters_reach_no_line_of_the_status() -> None:
    run = RunStatus("volute-test-1.scope", HOSTILE, f"make {HOSTILE}", 3.0)
    shown = format_status(
        status(
            test_runs=(
                RepositoryStatus(HOSTILE, None, None, (), "no such file or directory"),
                RepositoryStatus(HOSTILE, 1, 2, (run,), f"slot files past {HOSTILE}"),
            ),
            preflight={"whorl": (f"working directory {HOSTILE} is missing",)},
            config=ConfigStatus(NOW - 60, refused=HOSTILE, refused_at=NOW - 5),
        ),
        now=NOW,
    )
    controls = [ch for ch in shown if (ord(ch) < 32 and ch != "\n") or 0x7F <= ord(ch) < 0xA0]
    assert controls == [], shown
    lines = shown.splitlines()
    forged = r"/srv/x\r\x1b[2Kpreflight: all minds ok\x1b]0;owned\a\nqueue: 0 pending\x9b"
    assert f"test slots: cannot watch {forged}: no such file or directory" in lines
    assert f"  test run: {forged} `make {forged}` running 3.0s  (volute-test-1.scope)" in lines
    assert (
        f"preflight: mind whorl cannot start turns: working directory {forged} is missing" in lines
    )
    # The newline in the path made no line of its own: every line is one the view wrote.
    assert not [line for line in lines if line.startswith("queue: 0 pending")]


def test_leases_are_listed_with_their_state_and_reason() -> None:
    """Issue 31: each lease, waiting with its reason, held, joined, or to be claimed."""
    leases = (
        LeaseStatus(7, "pip", "main", 1001, LeaseState.HELD, None, 12, "volute-turn-pip-12.scope",
                    True, 0, NOW - 12.0),
        LeaseStatus(8, "pip", "main", 1002, LeaseState.HELD, None, 12, "volute-turn-pip-12.scope",
                    False, 0, NOW - 2.0),
        LeaseStatus(9, "whorl", "main", 1001, LeaseState.WAITING, HoldReason.GLOBAL_CAP,
                    since=NOW - 3.0),
        LeaseStatus(10, "pip", "s2", 0, LeaseState.RECLAIM, None, 13, "volute-turn-pip-13.scope",
                    True, 0, NOW - 60.0),
    )  # fmt: skip
    lines = format_status(status(leases=leases), now=NOW).splitlines()
    assert "lease 7: pip/main held by uid 1001 for 12.0s in volute-turn-pip-12.scope" in lines
    assert (
        "lease 8: pip/main held by uid 1002 for 2.0s in volute-turn-pip-12.scope, joined" in lines
    )
    assert "lease 9: whorl/main waiting (global_cap) for 3.0s, uid 1001" in lines
    assert any(line.startswith("lease 10: pip/s2 waiting for its claim") for line in lines)
