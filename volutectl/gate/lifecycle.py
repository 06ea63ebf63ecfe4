"""A turn's lifecycle: its states, the events that move it, and what each move asks for.

Each state holds what is true in it, as pueue's task states do. The states say what the
gate knows of whether the turn still runs, for only systemd's word settles a turn:

- `Starting`: committed; its hands are starting it (turn directory, fork, scope,
  release). The gate waits for them, and holds no place for it yet. A start that never
  ran the command stays here while its deliveries are settled (`Ended` then, or
  `SettleFailed`: it is kept as `Unconfirmed`).
- `Recorded`: found open in the store at the gate's start; `Adopted` takes it back.
- `Unconfirmed`: the launcher was lost while it started the turn, which may run or may
  never have. Once the launcher has finished (or abandoned) that order, systemd can say.
- `Running`: its main process lives (the gate holds its pidfd), so its scope is not empty.
- `Lingering`: its main process has exited, or is not watched; systemd has seen its scope
  hold a process, and will say when it empties.
- `Unseen`: adopted at a restart, its main process not watched, and not yet seen holding
  a process (it is asked about at once).
- `Asking`: not watched, and a question to systemd failed (or a stop, or the commit of
  its settlement): ask again at `ask_at`.
- `Finished`: ended, with its outcome; the gate holds no place for it any more.

A turn ends with its main process. What that process left behind in the scope (a
`setsid sleep 600`, a daemon it forked) is given a grace: `MainExited` brings the
deadline (`stop_at`: when the main process exited, plus `turns.leftover_grace_seconds`),
which the states after `Running` carry (`Lingering`, `Unseen`, `Asking`) through
systemd's answers. At that deadline (`Due`) the scope is stopped (`StopLeftovers`), once;
a stop that failed (`LeftoversStopFailed`) is tried again a second later. The place is
freed when systemd says the scope ended, as for any turn. A turn adopted at a restart
whose recorded main process is gone gets the grace again from its adoption.

What the store records of a turn (released, interrupted, its time limit, when it was
stopped for running past it) stays on the `Turn` record (volutectl/gate/turns.py): the
outcome is computed from those facts, and an interrupted or timed-out turn is watched
as any other, in whichever state it is.

`step(state, event)` is the one place a turn changes state. It is pure (no I/O, no clock:
times come in the events) and returns the next state and the effects that
volutectl/gate/turns.py's `Turns.apply` carries out, in order, every one of them: for
`Ask` it takes systemd's answer, which volutectl/gate/liveness.py turns into the next
event. An event that cannot come in a state raises `IllegalStep` (a bug in the caller);
one that can but changes nothing returns the same state and no effects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from volutectl.states import Outcome

ASK_AGAIN_SECONDS = 1.0  # after a failed question to systemd, ask again this much later
PAUSE_STARTS_SECONDS = 1.0  # after systemd gave no answer to a start, start nothing this long


# -- states -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Starting:
    """Committed; its hands are starting it. No place is held for it yet."""


@dataclass(frozen=True)
class Recorded:
    """Open in the store when the gate started, not yet taken back. No place is held."""


@dataclass(frozen=True)
class Unconfirmed:
    """The launcher was lost mid-start: wait for it, then ask systemd (at `ask_at`)."""

    ask_at: float


@dataclass(frozen=True)
class Running:
    """Its main process lives: the gate watches its pidfd.

    `verified`: systemd has seen the scope hold a process (a turn the gate started: its
    hands moved it there), so from then on systemd reports when it empties. `ask_at`: a
    question about it failed (at adoption, or a stop after its time limit): ask again."""

    pidfd: int
    verified: bool
    ask_at: float | None = None


@dataclass(frozen=True)
class Lingering:
    """Not watched (its main process exited), seen holding a process: systemd will say.

    `stop_at`: when what its main process left behind is to be stopped (None: not owed)."""

    stop_at: float | None = None


@dataclass(frozen=True)
class Unseen:
    """Adopted, not watched, never seen holding a process: ask systemd now.

    `stop_at`: its main process is gone; stop what is left at that time."""

    stop_at: float | None = None


@dataclass(frozen=True)
class Asking:
    """Not watched, and a question to systemd failed: ask again at `ask_at`."""

    verified: bool
    ask_at: float
    stop_at: float | None = None  # as Lingering's


@dataclass(frozen=True)
class Finished:
    """Ended: its deliveries are settled, its place is free."""

    outcome: Outcome


State = Starting | Recorded | Unconfirmed | Running | Lingering | Unseen | Asking | Finished
Held = Unconfirmed | Running | Lingering | Unseen | Asking  # the gate holds a place


# -- events -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartReported:
    """Its hands released it into its scope; the gate holds its main process's pidfd."""

    pidfd: int


@dataclass(frozen=True)
class LostMidStart:
    """The launcher was lost during the start: it may or may not run."""

    now: float


@dataclass(frozen=True)
class NoAnswer:
    """systemd gave no answer about the scope (at `now`): its child exited unreleased."""

    error: str
    now: float


@dataclass(frozen=True)
class StartFailed:
    """Its hands say the command never ran (having removed what they made)."""

    error: str


@dataclass(frozen=True)
class Adopted:
    """The gate, restarted, takes the turn back: `pidfd` on its main process if that
    still lives in its scope; `stop_at`: its main process is known to be gone, so what
    it left behind is stopped then."""

    pidfd: int | None
    stop_at: float | None = None


@dataclass(frozen=True)
class MainExited:
    """Its main process's pidfd became readable, at `now`: what it left behind in the
    scope is stopped `grace` seconds later."""

    now: float
    grace: float


@dataclass(frozen=True)
class ScopeEnded:
    """systemd's news: the scope left the live states (or was removed)."""


@dataclass(frozen=True)
class Listed:
    """systemd listed the turns slice; `listed`: the scope was among the live units."""

    listed: bool


@dataclass(frozen=True)
class Due:
    """The gate's clock reached a deadline of some turn (maybe not this one's)."""

    now: float


@dataclass(frozen=True)
class LauncherBack:
    """The launcher answers again: the order of the lost start is done, or never will be."""


@dataclass(frozen=True)
class LauncherAway:
    """The launcher still cannot be reached."""

    now: float


@dataclass(frozen=True)
class ScopeHolds:
    """systemd's answer: the scope is live and holds a process."""


@dataclass(frozen=True)
class ScopeEmpty:
    """systemd's answer: the scope is live (`active_state`) but holds no process."""

    active_state: str


@dataclass(frozen=True)
class ScopeGone:
    """systemd's answer: the scope is not loaded, or is inactive or failed."""


@dataclass(frozen=True)
class QuestionFailed:
    """A question to systemd about the scope failed: it proves nothing."""

    error: str
    now: float


@dataclass(frozen=True)
class SettleFailed:
    """The settlement's commit (or the read of its directory) failed: nothing happened."""

    now: float


@dataclass(frozen=True)
class TimeLimit:
    """The gate decided: the turn ran past its time limit."""

    now: float


@dataclass(frozen=True)
class StopFailed:
    """Stopping the scope after its time limit failed."""

    now: float


@dataclass(frozen=True)
class LeftoversStopFailed:
    """Stopping what its main process left behind failed: try again."""

    now: float


@dataclass(frozen=True)
class CutShort:
    """The gate decided: an --interrupt delivery was folded into the turn."""


@dataclass(frozen=True)
class Ended:
    """Its deliveries are settled in the store."""

    outcome: Outcome


Happened = (
    StartReported
    | LostMidStart
    | NoAnswer
    | StartFailed
    | Adopted
    | MainExited
    | ScopeEnded
    | Listed
    | Due
    | LauncherBack
    | LauncherAway
    | ScopeHolds
    | ScopeEmpty
    | ScopeGone
    | QuestionFailed
    | SettleFailed
    | TimeLimit
    | StopFailed
    | LeftoversStopFailed
    | CutShort
    | Ended
)


# -- effects ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TakePlace:
    """Take a place for the turn (admission counts it)."""


@dataclass(frozen=True)
class Free:
    """Free its place (admission counts it no more)."""


@dataclass(frozen=True)
class WatchMainFd:
    pidfd: int


@dataclass(frozen=True)
class CloseMainFd:
    pidfd: int


@dataclass(frozen=True)
class Ask:
    """Ask systemd whether the turn still runs (liveness's to do)."""


@dataclass(frozen=True)
class LogCannotTell:
    """Say once that a question failed and the turn keeps its place."""

    error: str


@dataclass(frozen=True)
class StopEmptyScope:
    """Say so, and stop the scope: started around a process that had died, it would
    stay `active_state` for ever."""

    active_state: str


@dataclass(frozen=True)
class ForgetUnit:
    """systemd may list the scope as live a moment longer: do not count it then."""


@dataclass(frozen=True)
class Settle:
    """Settle its deliveries in one commit, remove its directory, tell its waiters."""


@dataclass(frozen=True)
class ReturnDeliveries:
    """It never ran, through no fault of its deliveries: they go back, no attempt
    counted, in one commit (then `Ended`; a commit refused: `SettleFailed`)."""

    error: str


@dataclass(frozen=True)
class FailDeliveries:
    """It failed to start: each of its deliveries counts a failed attempt, in one
    commit (then `Ended`; a commit refused: `SettleFailed`)."""

    error: str


@dataclass(frozen=True)
class PauseStarts:
    """Start no turn before `until` (systemd is silent: a daemon-reexec)."""

    until: float


@dataclass(frozen=True)
class RecordTimeout:
    """Record when it was stopped for running past its limit, and say so."""

    now: float


@dataclass(frozen=True)
class StopOverrun:
    """Have systemd stop the scope (SIGTERM, then SIGKILL after the grace)."""

    now: float


@dataclass(frozen=True)
class StopLeftovers:
    """Its main process exited a grace ago and its scope still holds processes: say
    what is left, and have systemd stop the scope (SIGTERM, then SIGKILL after
    turns.timeout_grace_seconds)."""


@dataclass(frozen=True)
class RecordInterrupt:
    """Record the interrupt, and send SIGINT to its scope."""


@dataclass(frozen=True)
class Wake:
    """Admission should run again."""


Effect = (
    TakePlace
    | Free
    | WatchMainFd
    | CloseMainFd
    | Ask
    | LogCannotTell
    | StopEmptyScope
    | ForgetUnit
    | Settle
    | ReturnDeliveries
    | FailDeliveries
    | PauseStarts
    | RecordTimeout
    | StopOverrun
    | StopLeftovers
    | RecordInterrupt
    | Wake
)

Step = tuple[State, tuple[Effect, ...]]


class IllegalStep(Exception):
    """An event that cannot come in the turn's state: the caller has a bug."""

    def __init__(self, state: State, event: Happened) -> None:
        super().__init__(f"{type(event).__name__} cannot happen to a turn in {state}")
        self.state = state
        self.event = event


# -- what each state says -----------------------------------------------------------------------


def ask_at(state: State) -> float | None:
    """When to ask systemd again about the turn, if a question is owed."""
    if isinstance(state, Unconfirmed | Asking | Running):
        return state.ask_at
    return None


def stop_at(state: State) -> float | None:
    """When what its main process left behind is to be stopped, if that is owed."""
    if isinstance(state, Lingering | Unseen | Asking):
        return state.stop_at
    return None


def verified(state: State) -> bool:
    """Whether systemd has seen the turn's scope hold a process."""
    if isinstance(state, Running | Asking):
        return state.verified
    return isinstance(state, Lingering)


def holds_place(state: State, listed: bool) -> bool:
    """Whether the turn counts against the cap, given whether systemd listed its scope
    as live: listed, or its main process lives, or systemd could not say."""
    return listed or isinstance(state, Running) or ask_at(state) is not None


def adopted(pidfd: int | None, stop_at: float | None = None) -> Running | Unseen:
    """The first state of a turn taken back at a restart: watched, if its main process
    still lives in its scope; asked about at once either way. `stop_at`: its main
    process is known to be gone, so what is left is stopped then."""
    if pidfd is None:
        return Unseen(stop_at=stop_at)
    return Running(pidfd=pidfd, verified=False)


def _asking_again(state: Held, at: float) -> Held:
    if isinstance(state, Running | Unconfirmed | Asking):
        return dataclasses.replace(state, ask_at=at)
    return Asking(verified=verified(state), ask_at=at, stop_at=stop_at(state))


def _answered(state: Held, *, holds: bool) -> Held:
    """systemd answered (the question owed, if any, is not owed any more)."""
    if isinstance(state, Running):
        return Running(pidfd=state.pidfd, verified=state.verified or holds)
    if holds or verified(state):
        return Lingering(stop_at=stop_at(state))
    return Unseen(stop_at=stop_at(state))


def _stopping_at(state: Held, at: float | None) -> Held:
    """The state with its stop of leftovers owed at `at` (None: not owed)."""
    if isinstance(state, Lingering | Unseen | Asking):
        return dataclasses.replace(state, stop_at=at)
    return state


# -- the transitions --------------------------------------------------------------------------


def step(state: State, event: Happened) -> Step:
    """The next state of a turn in `state` after `event`, and the effects to carry out."""
    if isinstance(state, Starting):
        return _from_starting(state, event)
    if isinstance(state, Recorded) and isinstance(event, Adopted):
        return _adopt(event)
    if isinstance(state, Finished | Recorded) or isinstance(
        event, StartReported | LostMidStart | NoAnswer | StartFailed | Adopted
    ):
        raise IllegalStep(state, event)
    if isinstance(state, Unconfirmed):
        return _from_unconfirmed(state, event)
    return _from_known(state, event)


def _from_starting(state: Starting, event: Happened) -> Step:
    """How its start went. A start that never ran the command is settled in the store
    first: `Ended` once that is committed; if the commit is refused, the turn keeps a
    place as one whose start is unknown (as a gate restarted then would find it), until
    systemd's word settles it."""
    if isinstance(event, StartReported):
        return Running(pidfd=event.pidfd, verified=True), (TakePlace(), WatchMainFd(event.pidfd))
    if isinstance(event, LostMidStart | SettleFailed):
        return Unconfirmed(ask_at=event.now), (TakePlace(), Wake())
    if isinstance(event, NoAnswer):
        pause = PauseStarts(until=event.now + PAUSE_STARTS_SECONDS)
        return state, (ReturnDeliveries(event.error), pause)
    if isinstance(event, StartFailed):
        return state, (FailDeliveries(event.error), Wake())
    if isinstance(event, Ended):
        return Finished(event.outcome), ()
    raise IllegalStep(state, event)


def _adopt(event: Adopted) -> Step:
    """Taken back at a restart: it holds its place, its main process is watched if it
    lives, and systemd is asked about it at once."""
    watch: tuple[Effect, ...] = () if event.pidfd is None else (WatchMainFd(event.pidfd),)
    return adopted(event.pidfd, event.stop_at), (TakePlace(), *watch, Ask())


def _from_unconfirmed(state: Unconfirmed, event: Happened) -> Step:
    """Nothing is asked of systemd before the launcher is back: its answer could come
    before the scope does."""
    if isinstance(event, LauncherBack):
        return Asking(verified=False, ask_at=state.ask_at), (Ask(),)
    if isinstance(event, LauncherAway):
        return Unconfirmed(ask_at=event.now + ASK_AGAIN_SECONDS), ()
    answers = ScopeHolds | ScopeEmpty | ScopeGone | QuestionFailed | SettleFailed | Ended
    if isinstance(event, answers):
        raise IllegalStep(state, event)
    return _from_held(state, event)


def _from_known(state: Running | Lingering | Unseen | Asking, event: Happened) -> Step:
    """systemd's answers, to a turn it may be asked about."""
    if isinstance(event, ScopeHolds):
        return _answered(state, holds=True), ()
    if isinstance(event, ScopeEmpty):
        effects: tuple[Effect, ...] = (ForgetUnit(), Settle())
        if not verified(state):  # never seen holding a process: it will never end
            effects = (StopEmptyScope(event.active_state), *effects)
        # Otherwise its last process just left, and systemd is about to say so.
        return _answered(state, holds=False), effects
    if isinstance(event, ScopeGone):
        return _answered(state, holds=False), (Settle(),)
    if isinstance(event, QuestionFailed):
        told: tuple[Effect, ...] = (
            () if ask_at(state) is not None else (LogCannotTell(event.error),)
        )
        return _asking_again(state, event.now + ASK_AGAIN_SECONDS), told
    if isinstance(event, SettleFailed):
        return _asking_again(state, event.now + ASK_AGAIN_SECONDS), ()
    if isinstance(event, LauncherBack | LauncherAway):
        raise IllegalStep(state, event)
    return _from_held(state, event)


def _from_held(state: Held, event: Happened) -> Step:
    """The events that can come to any turn the gate holds a place for."""
    if isinstance(event, MainExited):
        if not isinstance(state, Running):
            return state, (Ask(),)  # its pidfd was closed already: ask all the same
        at = event.now + event.grace  # then what it left behind is stopped
        left: Held = Lingering(stop_at=at) if state.verified else Unseen(stop_at=at)
        if state.ask_at is not None:
            left = Asking(verified=state.verified, ask_at=state.ask_at, stop_at=at)
        return left, (CloseMainFd(state.pidfd), Ask())
    if isinstance(event, ScopeEnded):
        # systemd also announces a scope's initial "inactive" while creating it; and a
        # scope cannot have ended while its main process lives. Its pidfd will say.
        return state, () if isinstance(state, Running) else (Ask(),)
    if isinstance(event, Listed):
        return state, (Ask(),) if _listing_asks(state, event.listed) else ()
    if isinstance(event, Due):
        return _on_due(state, event.now)
    if isinstance(event, TimeLimit):
        return state, (RecordTimeout(event.now), StopOverrun(event.now))
    if isinstance(event, StopFailed):
        # Stopping it is still owed: systemd's RuntimeMaxSec= backstop will.
        return _asking_again(state, event.now + ASK_AGAIN_SECONDS), ()
    if isinstance(event, LeftoversStopFailed):
        if isinstance(state, Running | Unconfirmed):
            raise IllegalStep(state, event)  # no stop of leftovers comes before its exit
        return _stopping_at(state, event.now + ASK_AGAIN_SECONDS), ()
    if isinstance(event, CutShort):
        return state, (RecordInterrupt(),)
    if isinstance(event, Ended):
        close: tuple[Effect, ...] = (
            (CloseMainFd(state.pidfd),) if isinstance(state, Running) else ()
        )
        return Finished(event.outcome), (Free(), *close, Wake())
    raise IllegalStep(state, event)


def _on_due(state: Held, now: float) -> Step:
    """The clock reached a deadline: stop what the main process left behind, once, if
    its grace is over; ask systemd, if a question is owed."""
    effects: tuple[Effect, ...] = ()
    stop = stop_at(state)
    if stop is not None and now >= stop:
        state, effects = _stopping_at(state, None), (StopLeftovers(),)
    due = ask_at(state)
    if due is not None and now >= due:
        effects = (*effects, Ask())
    return state, effects


def _listing_asks(state: Held, listed: bool) -> bool:
    """Not listed as live, and not known to run: confirm, then settle. Listed, but never
    seen holding a process (nor known to run, nor asked about): find out."""
    if isinstance(state, Running):
        return False
    if not listed:
        return True
    return not verified(state) and ask_at(state) is None
