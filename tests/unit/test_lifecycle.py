"""The turn lifecycle's transitions (volutectl/gate/lifecycle.py), walked as a table.

Each row: a state, an event, the next state, and the effects, in order. A row whose
next state is its state and whose effects are none is an event that is ignored in that
state. The pairs that cannot happen (a bug in the caller) are named below them: `step`
raises IllegalStep. Every sample state meets every sample event in exactly one of the
two tables.
"""

from __future__ import annotations

import pytest

from volutectl.gate.lifecycle import (
    Adopted,
    Ask,
    Asking,
    CloseMainFd,
    CutShort,
    Due,
    Effect,
    Ended,
    FailDeliveries,
    Finished,
    ForgetUnit,
    Free,
    Happened,
    IllegalStep,
    LauncherAway,
    LauncherBack,
    LeftoversStopFailed,
    Lingering,
    Listed,
    LogCannotTell,
    LostMidStart,
    MainExited,
    NoAnswer,
    PauseStarts,
    QuestionFailed,
    Recorded,
    RecordInterrupt,
    RecordTimeout,
    ReturnDeliveries,
    Running,
    ScopeEmpty,
    ScopeEnded,
    ScopeGone,
    ScopeHolds,
    Settle,
    SettleFailed,
    StartFailed,
    Starting,
    StartReported,
    State,
    StopEmptyScope,
    StopFailed,
    StopLeftovers,
    StopOverrun,
    TakePlace,
    TimeLimit,
    Unconfirmed,
    Unseen,
    Wake,
    WatchMainFd,
    adopted,
    holds_place,
    step,
)
from volutectl.states import Outcome

DUE = 5.0  # when a question owed is to be asked again
NOW = 10.0  # when the events below happen
AGAIN = 11.0  # NOW + ASK_AGAIN_SECONDS
GRACE = 2.0  # what a main process that exited at NOW leaves behind is stopped at LEFT_AT
LEFT_AT = NOW + GRACE

# -- sample states --------------------------------------------------------------------------
STARTING = Starting()
RECORDED = Recorded()  # open in the store at the gate's start
UNCONFIRMED = Unconfirmed(ask_at=DUE)
RUNNING = Running(pidfd=7, verified=True)
RUNNING_UNSEEN = Running(pidfd=7, verified=False)  # adopted, not yet asked
RUNNING_ASKING = Running(pidfd=7, verified=True, ask_at=DUE)
LINGERING = Lingering()
UNSEEN = Unseen()
ASKING = Asking(verified=True, ask_at=DUE)
ASKING_UNSEEN = Asking(verified=False, ask_at=DUE)
# Its main process exited: what it left behind is to be stopped at DUE.
LINGERING_LEFT = Lingering(stop_at=DUE)
UNSEEN_LEFT = Unseen(stop_at=DUE)  # adopted, its main process gone
ASKING_LEFT = Asking(verified=True, ask_at=DUE, stop_at=DUE)
SETTLED = Finished(outcome=Outcome.OK)

# -- sample events --------------------------------------------------------------------------
STARTED = StartReported(pidfd=9)
LAUNCHER_LOST = LostMidStart(now=NOW)
LISTED = Listed(listed=True)
UNLISTED = Listed(listed=False)
NOT_DUE = Due(now=DUE - 1)
DUE_NOW = Due(now=DUE)
LAUNCHER_AWAY = LauncherAway(now=NOW)
EMPTY = ScopeEmpty(active_state="active")
QUESTION_FAILED = QuestionFailed(error="timeout", now=NOW)
SETTLE_FAILED = SettleFailed(now=NOW)
TIME_LIMIT = TimeLimit(now=NOW)
STOP_FAILED = StopFailed(now=NOW)
EXITED = MainExited(now=NOW, grace=GRACE)
LEFTOVERS_FAILED = LeftoversStopFailed(now=NOW)
ENDED = Ended(outcome=Outcome.OK)
NO_ANSWER = NoAnswer(error="no answer", now=NOW)
START_FAILED = StartFailed(error="no such user")
ADOPTED = Adopted(pidfd=7)  # its main process still lives in its scope
ADOPTED_UNWATCHED = Adopted(pidfd=None)  # never released, or systemd could not list it
ADOPTED_MAIN_GONE = Adopted(pidfd=None, stop_at=DUE)

# -- effects that recur ---------------------------------------------------------------------
SETTLE_EMPTY = (ForgetUnit(), Settle())
STOP_AND_SETTLE_EMPTY = (StopEmptyScope(active_state="active"), ForgetUnit(), Settle())
TIME_OUT = (RecordTimeout(now=NOW), StopOverrun(now=NOW))
TELL_ONCE = (LogCannotTell(error="timeout"),)
# Its deliveries are settled: its place is freed (its pidfd closed, if it is watched).
END = (Free(), Wake())
END_WATCHED = (Free(), CloseMainFd(pidfd=7), Wake())

Row = tuple[State, Happened, State, tuple[Effect, ...]]

ROWS: list[Row] = [
    # Starting: how its start went.
    (STARTING, STARTED, Running(pidfd=9, verified=True), (TakePlace(), WatchMainFd(pidfd=9))),
    (STARTING, LAUNCHER_LOST, Unconfirmed(ask_at=NOW), (TakePlace(), Wake())),
    # It never ran: its deliveries are settled first; systemd silent, no turn starts
    # for a second.
    (STARTING, NO_ANSWER, STARTING, (ReturnDeliveries("no answer"), PauseStarts(until=NOW + 1))),
    (STARTING, START_FAILED, STARTING, (FailDeliveries("no such user"), Wake())),
    (STARTING, ENDED, SETTLED, ()),  # settled: it held no place to free
    # Their settlement's commit refused: kept as a turn whose start is unknown.
    (STARTING, SETTLE_FAILED, Unconfirmed(ask_at=NOW), (TakePlace(), Wake())),
    # Recorded: taken back at a restart, it holds its place and systemd is asked at once.
    (RECORDED, ADOPTED, RUNNING_UNSEEN, (TakePlace(), WatchMainFd(pidfd=7), Ask())),
    (RECORDED, ADOPTED_UNWATCHED, UNSEEN, (TakePlace(), Ask())),
    (RECORDED, ADOPTED_MAIN_GONE, UNSEEN_LEFT, (TakePlace(), Ask())),
    # Unconfirmed: nothing is asked of systemd before the launcher is back.
    (UNCONFIRMED, EXITED, UNCONFIRMED, (Ask(),)),
    (UNCONFIRMED, ScopeEnded(), UNCONFIRMED, (Ask(),)),
    (UNCONFIRMED, LISTED, UNCONFIRMED, ()),
    (UNCONFIRMED, UNLISTED, UNCONFIRMED, (Ask(),)),
    (UNCONFIRMED, NOT_DUE, UNCONFIRMED, ()),
    (UNCONFIRMED, DUE_NOW, UNCONFIRMED, (Ask(),)),
    (UNCONFIRMED, LauncherBack(), ASKING_UNSEEN, (Ask(),)),
    (UNCONFIRMED, LAUNCHER_AWAY, Unconfirmed(ask_at=AGAIN), ()),
    (UNCONFIRMED, TIME_LIMIT, UNCONFIRMED, TIME_OUT),
    (UNCONFIRMED, STOP_FAILED, Unconfirmed(ask_at=AGAIN), ()),
    (UNCONFIRMED, CutShort(), UNCONFIRMED, (RecordInterrupt(),)),
    # Running, seen holding a process (a turn this gate started).
    # Its main process exited: what it left behind is stopped a grace later.
    (RUNNING, EXITED, Lingering(stop_at=LEFT_AT), (CloseMainFd(pidfd=7), Ask())),
    (RUNNING, ScopeEnded(), RUNNING, ()),  # systemd's initial "inactive": its pidfd says
    (RUNNING, LISTED, RUNNING, ()),
    (RUNNING, UNLISTED, RUNNING, ()),
    (RUNNING, NOT_DUE, RUNNING, ()),
    (RUNNING, DUE_NOW, RUNNING, ()),
    (RUNNING, ScopeHolds(), RUNNING, ()),
    (RUNNING, EMPTY, RUNNING, SETTLE_EMPTY),
    (RUNNING, ScopeGone(), RUNNING, (Settle(),)),
    (RUNNING, QUESTION_FAILED, Running(pidfd=7, verified=True, ask_at=AGAIN), TELL_ONCE),
    (RUNNING, SETTLE_FAILED, Running(pidfd=7, verified=True, ask_at=AGAIN), ()),
    (RUNNING, TIME_LIMIT, RUNNING, TIME_OUT),
    (RUNNING, STOP_FAILED, Running(pidfd=7, verified=True, ask_at=AGAIN), ()),
    (RUNNING, CutShort(), RUNNING, (RecordInterrupt(),)),
    (RUNNING, ENDED, SETTLED, END_WATCHED),
    # Running, adopted and not yet seen holding a process.
    (RUNNING_UNSEEN, EXITED, Unseen(stop_at=LEFT_AT), (CloseMainFd(pidfd=7), Ask())),
    (RUNNING_UNSEEN, ScopeEnded(), RUNNING_UNSEEN, ()),
    (RUNNING_UNSEEN, LISTED, RUNNING_UNSEEN, ()),
    (RUNNING_UNSEEN, UNLISTED, RUNNING_UNSEEN, ()),
    (RUNNING_UNSEEN, NOT_DUE, RUNNING_UNSEEN, ()),
    (RUNNING_UNSEEN, DUE_NOW, RUNNING_UNSEEN, ()),
    (RUNNING_UNSEEN, ScopeHolds(), RUNNING, ()),
    (RUNNING_UNSEEN, EMPTY, RUNNING_UNSEEN, STOP_AND_SETTLE_EMPTY),
    (RUNNING_UNSEEN, ScopeGone(), RUNNING_UNSEEN, (Settle(),)),
    (RUNNING_UNSEEN, QUESTION_FAILED, Running(pidfd=7, verified=False, ask_at=AGAIN), TELL_ONCE),
    (RUNNING_UNSEEN, SETTLE_FAILED, Running(pidfd=7, verified=False, ask_at=AGAIN), ()),
    (RUNNING_UNSEEN, TIME_LIMIT, RUNNING_UNSEEN, TIME_OUT),
    (RUNNING_UNSEEN, STOP_FAILED, Running(pidfd=7, verified=False, ask_at=AGAIN), ()),
    (RUNNING_UNSEEN, CutShort(), RUNNING_UNSEEN, (RecordInterrupt(),)),
    (RUNNING_UNSEEN, ENDED, SETTLED, END_WATCHED),
    # Running, a question about it owed (a stop after its time limit failed).
    (
        RUNNING_ASKING,
        EXITED,
        Asking(verified=True, ask_at=DUE, stop_at=LEFT_AT),
        (CloseMainFd(pidfd=7), Ask()),
    ),
    (RUNNING_ASKING, ScopeEnded(), RUNNING_ASKING, ()),
    (RUNNING_ASKING, LISTED, RUNNING_ASKING, ()),
    (RUNNING_ASKING, UNLISTED, RUNNING_ASKING, ()),
    (RUNNING_ASKING, NOT_DUE, RUNNING_ASKING, ()),
    (RUNNING_ASKING, DUE_NOW, RUNNING_ASKING, (Ask(),)),
    (RUNNING_ASKING, ScopeHolds(), RUNNING, ()),
    (RUNNING_ASKING, EMPTY, RUNNING, SETTLE_EMPTY),
    (RUNNING_ASKING, ScopeGone(), RUNNING, (Settle(),)),
    (RUNNING_ASKING, QUESTION_FAILED, Running(pidfd=7, verified=True, ask_at=AGAIN), ()),
    (RUNNING_ASKING, SETTLE_FAILED, Running(pidfd=7, verified=True, ask_at=AGAIN), ()),
    (RUNNING_ASKING, TIME_LIMIT, RUNNING_ASKING, TIME_OUT),
    (RUNNING_ASKING, STOP_FAILED, Running(pidfd=7, verified=True, ask_at=AGAIN), ()),
    (RUNNING_ASKING, CutShort(), RUNNING_ASKING, (RecordInterrupt(),)),
    (RUNNING_ASKING, ENDED, SETTLED, END_WATCHED),
    # Lingering: systemd reports when its scope empties.
    (LINGERING, EXITED, LINGERING, (Ask(),)),
    (LINGERING, ScopeEnded(), LINGERING, (Ask(),)),
    (LINGERING, LISTED, LINGERING, ()),
    (LINGERING, UNLISTED, LINGERING, (Ask(),)),
    (LINGERING, NOT_DUE, LINGERING, ()),
    (LINGERING, DUE_NOW, LINGERING, ()),
    (LINGERING, ScopeHolds(), LINGERING, ()),
    (LINGERING, EMPTY, LINGERING, SETTLE_EMPTY),  # its last process just left
    (LINGERING, ScopeGone(), LINGERING, (Settle(),)),
    (LINGERING, QUESTION_FAILED, Asking(verified=True, ask_at=AGAIN), TELL_ONCE),
    (LINGERING, SETTLE_FAILED, Asking(verified=True, ask_at=AGAIN), ()),
    (LINGERING, TIME_LIMIT, LINGERING, TIME_OUT),
    (LINGERING, STOP_FAILED, Asking(verified=True, ask_at=AGAIN), ()),
    (LINGERING, CutShort(), LINGERING, (RecordInterrupt(),)),
    (LINGERING, LEFTOVERS_FAILED, Lingering(stop_at=AGAIN), ()),
    (LINGERING, ENDED, SETTLED, END),
    # Unseen: adopted, not watched; a listing that shows it has it asked about.
    (UNSEEN, EXITED, UNSEEN, (Ask(),)),
    (UNSEEN, ScopeEnded(), UNSEEN, (Ask(),)),
    (UNSEEN, LISTED, UNSEEN, (Ask(),)),
    (UNSEEN, UNLISTED, UNSEEN, (Ask(),)),
    (UNSEEN, NOT_DUE, UNSEEN, ()),
    (UNSEEN, DUE_NOW, UNSEEN, ()),
    (UNSEEN, ScopeHolds(), LINGERING, ()),
    (UNSEEN, EMPTY, UNSEEN, STOP_AND_SETTLE_EMPTY),  # it would stay active for ever
    (UNSEEN, ScopeGone(), UNSEEN, (Settle(),)),
    (UNSEEN, QUESTION_FAILED, Asking(verified=False, ask_at=AGAIN), TELL_ONCE),
    (UNSEEN, SETTLE_FAILED, Asking(verified=False, ask_at=AGAIN), ()),
    (UNSEEN, TIME_LIMIT, UNSEEN, TIME_OUT),
    (UNSEEN, STOP_FAILED, Asking(verified=False, ask_at=AGAIN), ()),
    (UNSEEN, CutShort(), UNSEEN, (RecordInterrupt(),)),
    (UNSEEN, LEFTOVERS_FAILED, Unseen(stop_at=AGAIN), ()),
    (UNSEEN, ENDED, SETTLED, END),
    # Asking, seen holding a process before: a failed question is told of only once.
    (ASKING, EXITED, ASKING, (Ask(),)),
    (ASKING, ScopeEnded(), ASKING, (Ask(),)),
    (ASKING, LISTED, ASKING, ()),
    (ASKING, UNLISTED, ASKING, (Ask(),)),
    (ASKING, NOT_DUE, ASKING, ()),
    (ASKING, DUE_NOW, ASKING, (Ask(),)),
    (ASKING, ScopeHolds(), LINGERING, ()),
    (ASKING, EMPTY, LINGERING, SETTLE_EMPTY),
    (ASKING, ScopeGone(), LINGERING, (Settle(),)),
    (ASKING, QUESTION_FAILED, Asking(verified=True, ask_at=AGAIN), ()),
    (ASKING, SETTLE_FAILED, Asking(verified=True, ask_at=AGAIN), ()),
    (ASKING, TIME_LIMIT, ASKING, TIME_OUT),
    (ASKING, STOP_FAILED, Asking(verified=True, ask_at=AGAIN), ()),
    (ASKING, CutShort(), ASKING, (RecordInterrupt(),)),
    (ASKING, LEFTOVERS_FAILED, Asking(verified=True, ask_at=DUE, stop_at=AGAIN), ()),
    (ASKING, ENDED, SETTLED, END),
    # Asking, never seen holding a process.
    (ASKING_UNSEEN, EXITED, ASKING_UNSEEN, (Ask(),)),
    (ASKING_UNSEEN, ScopeEnded(), ASKING_UNSEEN, (Ask(),)),
    (ASKING_UNSEEN, LISTED, ASKING_UNSEEN, ()),
    (ASKING_UNSEEN, UNLISTED, ASKING_UNSEEN, (Ask(),)),
    (ASKING_UNSEEN, NOT_DUE, ASKING_UNSEEN, ()),
    (ASKING_UNSEEN, DUE_NOW, ASKING_UNSEEN, (Ask(),)),
    (ASKING_UNSEEN, ScopeHolds(), LINGERING, ()),
    (ASKING_UNSEEN, EMPTY, UNSEEN, STOP_AND_SETTLE_EMPTY),
    (ASKING_UNSEEN, ScopeGone(), UNSEEN, (Settle(),)),
    (ASKING_UNSEEN, QUESTION_FAILED, Asking(verified=False, ask_at=AGAIN), ()),
    (ASKING_UNSEEN, SETTLE_FAILED, Asking(verified=False, ask_at=AGAIN), ()),
    (ASKING_UNSEEN, TIME_LIMIT, ASKING_UNSEEN, TIME_OUT),
    (ASKING_UNSEEN, STOP_FAILED, Asking(verified=False, ask_at=AGAIN), ()),
    (ASKING_UNSEEN, CutShort(), ASKING_UNSEEN, (RecordInterrupt(),)),
    (
        ASKING_UNSEEN,
        LEFTOVERS_FAILED,
        Asking(verified=False, ask_at=DUE, stop_at=AGAIN),
        (),
    ),
    (ASKING_UNSEEN, ENDED, SETTLED, END),
    # Lingering, what its main process left behind to be stopped at DUE: once.
    (LINGERING_LEFT, EXITED, LINGERING_LEFT, (Ask(),)),
    (LINGERING_LEFT, ScopeEnded(), LINGERING_LEFT, (Ask(),)),
    (LINGERING_LEFT, LISTED, LINGERING_LEFT, ()),
    (LINGERING_LEFT, UNLISTED, LINGERING_LEFT, (Ask(),)),
    (LINGERING_LEFT, NOT_DUE, LINGERING_LEFT, ()),
    (LINGERING_LEFT, DUE_NOW, LINGERING, (StopLeftovers(),)),
    (LINGERING_LEFT, ScopeHolds(), LINGERING_LEFT, ()),
    (LINGERING_LEFT, EMPTY, LINGERING_LEFT, SETTLE_EMPTY),
    (LINGERING_LEFT, ScopeGone(), LINGERING_LEFT, (Settle(),)),
    (LINGERING_LEFT, QUESTION_FAILED, Asking(verified=True, ask_at=AGAIN, stop_at=DUE), TELL_ONCE),
    (LINGERING_LEFT, SETTLE_FAILED, Asking(verified=True, ask_at=AGAIN, stop_at=DUE), ()),
    (LINGERING_LEFT, TIME_LIMIT, LINGERING_LEFT, TIME_OUT),
    (LINGERING_LEFT, STOP_FAILED, Asking(verified=True, ask_at=AGAIN, stop_at=DUE), ()),
    (LINGERING_LEFT, LEFTOVERS_FAILED, Lingering(stop_at=AGAIN), ()),  # stop again then
    (LINGERING_LEFT, CutShort(), LINGERING_LEFT, (RecordInterrupt(),)),
    (LINGERING_LEFT, ENDED, SETTLED, END),
    # Unseen, adopted with its main process gone: the grace runs from its adoption.
    (UNSEEN_LEFT, EXITED, UNSEEN_LEFT, (Ask(),)),
    (UNSEEN_LEFT, ScopeEnded(), UNSEEN_LEFT, (Ask(),)),
    (UNSEEN_LEFT, LISTED, UNSEEN_LEFT, (Ask(),)),
    (UNSEEN_LEFT, UNLISTED, UNSEEN_LEFT, (Ask(),)),
    (UNSEEN_LEFT, NOT_DUE, UNSEEN_LEFT, ()),
    (UNSEEN_LEFT, DUE_NOW, UNSEEN, (StopLeftovers(),)),
    (UNSEEN_LEFT, ScopeHolds(), LINGERING_LEFT, ()),
    (UNSEEN_LEFT, EMPTY, UNSEEN_LEFT, STOP_AND_SETTLE_EMPTY),
    (UNSEEN_LEFT, ScopeGone(), UNSEEN_LEFT, (Settle(),)),
    (UNSEEN_LEFT, QUESTION_FAILED, Asking(verified=False, ask_at=AGAIN, stop_at=DUE), TELL_ONCE),
    (UNSEEN_LEFT, SETTLE_FAILED, Asking(verified=False, ask_at=AGAIN, stop_at=DUE), ()),
    (UNSEEN_LEFT, TIME_LIMIT, UNSEEN_LEFT, TIME_OUT),
    (UNSEEN_LEFT, STOP_FAILED, Asking(verified=False, ask_at=AGAIN, stop_at=DUE), ()),
    (UNSEEN_LEFT, LEFTOVERS_FAILED, Unseen(stop_at=AGAIN), ()),
    (UNSEEN_LEFT, CutShort(), UNSEEN_LEFT, (RecordInterrupt(),)),
    (UNSEEN_LEFT, ENDED, SETTLED, END),
    # Asking, with the stop of its leftovers owed too: both, at their times.
    (ASKING_LEFT, EXITED, ASKING_LEFT, (Ask(),)),
    (ASKING_LEFT, ScopeEnded(), ASKING_LEFT, (Ask(),)),
    (ASKING_LEFT, LISTED, ASKING_LEFT, ()),
    (ASKING_LEFT, UNLISTED, ASKING_LEFT, (Ask(),)),
    (ASKING_LEFT, NOT_DUE, ASKING_LEFT, ()),
    (ASKING_LEFT, DUE_NOW, ASKING, (StopLeftovers(), Ask())),
    (ASKING_LEFT, ScopeHolds(), LINGERING_LEFT, ()),
    (ASKING_LEFT, EMPTY, LINGERING_LEFT, SETTLE_EMPTY),
    (ASKING_LEFT, ScopeGone(), LINGERING_LEFT, (Settle(),)),
    (ASKING_LEFT, QUESTION_FAILED, Asking(verified=True, ask_at=AGAIN, stop_at=DUE), ()),
    (ASKING_LEFT, SETTLE_FAILED, Asking(verified=True, ask_at=AGAIN, stop_at=DUE), ()),
    (ASKING_LEFT, TIME_LIMIT, ASKING_LEFT, TIME_OUT),
    (ASKING_LEFT, STOP_FAILED, Asking(verified=True, ask_at=AGAIN, stop_at=DUE), ()),
    (ASKING_LEFT, LEFTOVERS_FAILED, Asking(verified=True, ask_at=DUE, stop_at=AGAIN), ()),
    (ASKING_LEFT, CutShort(), ASKING_LEFT, (RecordInterrupt(),)),
    (ASKING_LEFT, ENDED, SETTLED, END),
]

HELD: list[State] = [UNCONFIRMED, RUNNING, RUNNING_UNSEEN, RUNNING_ASKING, LINGERING, UNSEEN]
HELD += [ASKING, ASKING_UNSEEN, LINGERING_LEFT, UNSEEN_LEFT, ASKING_LEFT]
START_RESULTS: list[Happened] = [STARTED, LAUNCHER_LOST, NO_ANSWER, START_FAILED]
ADOPTIONS: list[Happened] = [ADOPTED, ADOPTED_UNWATCHED, ADOPTED_MAIN_GONE]
LAUNCHER: list[Happened] = [LauncherBack(), LAUNCHER_AWAY]
ANSWERS: list[Happened] = [ScopeHolds(), EMPTY, ScopeGone(), QUESTION_FAILED, SETTLE_FAILED]
LATER: list[Happened] = [EXITED, ScopeEnded(), LISTED, UNLISTED, NOT_DUE, DUE_NOW]
LATER += [*LAUNCHER, *ANSWERS, TIME_LIMIT, STOP_FAILED, LEFTOVERS_FAILED, CutShort(), ENDED]
EVENTS = START_RESULTS + ADOPTIONS + LATER

RUNNING_STATES: list[State] = [UNCONFIRMED, RUNNING, RUNNING_UNSEEN, RUNNING_ASKING]
ILLEGAL: list[tuple[State, Happened]] = [
    # A starting turn is with its hands: the gate holds no place for it, and only how
    # its start went can come (and then whether what it carried is settled).
    *((STARTING, event) for event in LATER if event not in (SETTLE_FAILED, ENDED)),
    # A recorded turn is only taken back, and only once, at the gate's start.
    *((RECORDED, event) for event in START_RESULTS + LATER),
    *((state, event) for state in [STARTING, *HELD] for event in ADOPTIONS),
    # A settled turn has left the gate: nothing more comes to it.
    *((SETTLED, event) for event in EVENTS),
    # A start's result comes once, to a starting turn.
    *((state, event) for state in HELD for event in START_RESULTS),
    # Nothing is asked of systemd about an unconfirmed turn before the launcher is
    # back, so no answer comes (and nothing is settled).
    *((UNCONFIRMED, event) for event in [*ANSWERS, ENDED]),
    # The launcher is waited for only by an unconfirmed turn.
    *((state, event) for state in HELD if state != UNCONFIRMED for event in LAUNCHER),
    # What a main process left behind is stopped only once it has exited.
    *((state, LEFTOVERS_FAILED) for state in RUNNING_STATES),
]


@pytest.mark.parametrize(("state", "event", "after", "effects"), ROWS)
def test_each_state_and_event_gives_the_next_state_and_effects(
    state: State, event: Happened, after: State, effects: tuple[Effect, ...]
) -> None:
    assert step(state, event) == (after, effects)


@pytest.mark.parametrize(("state", "event"), ILLEGAL)
def test_an_event_that_cannot_come_in_a_state_raises(state: State, event: Happened) -> None:
    with pytest.raises(IllegalStep):
        step(state, event)


def test_every_state_meets_every_event_in_exactly_one_table() -> None:
    legal = [(state, event) for state, event, _, _ in ROWS]
    assert len(legal) == len(set(legal)) and len(ILLEGAL) == len(set(ILLEGAL))
    every = {(state, event) for state in [STARTING, RECORDED, *HELD, SETTLED] for event in EVENTS}
    assert set(legal) | set(ILLEGAL) == every
    assert not set(legal) & set(ILLEGAL)


def test_an_adopted_turn_starts_watched_if_its_main_process_lives() -> None:
    assert adopted(7) == RUNNING_UNSEEN
    assert adopted(None) == UNSEEN
    assert adopted(None, stop_at=DUE) == UNSEEN_LEFT  # its main process is gone


@pytest.mark.parametrize(
    ("state", "listed", "holds"),
    [
        (RUNNING, False, True),  # its main process lives
        (LINGERING, True, True),
        (LINGERING, False, False),  # systemd no longer lists it
        (UNSEEN, False, False),
        (ASKING, False, True),  # systemd could not say: it keeps its place
        (UNCONFIRMED, False, True),
    ],
)
def test_a_turn_holds_a_place_if_listed_running_or_in_doubt(
    state: State, listed: bool, holds: bool
) -> None:
    assert holds_place(state, listed) is holds
