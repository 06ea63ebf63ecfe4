"""The names of states, outcomes and reasons, each defined once.

StrEnums, so each member is its own string: it goes into SQL parameters, JSON and the
journal as is, and a value read back from any of them compares equal to its member.
Light on purpose (`enum` only): `volutectl deliver` imports it through the protocol.
"""

from __future__ import annotations

from enum import StrEnum


class QueueState(StrEnum):
    """Where a delivery is. pending -> running -> done; failed turns send their rows back
    to pending with an attempt counted, or to dead after the last attempt."""

    PENDING = "pending"
    RUNNING = "running"  # handed to a live turn (its stdin, or its inbox)
    DONE = "done"
    DEAD = "dead"  # out of attempts; kept until retried or dropped
    DROPPED = "dropped"


class TurnKind(StrEnum):
    """What a row of the turns table is: a run of a mind's command, or a lease's scope
    (a place held by a client's connection for a turn a daemon runs itself)."""

    TURN = "turn"
    LEASE = "lease"


class LeaseState(StrEnum):
    """Where a lease is, as `status` shows it."""

    WAITING = "waiting"  # its acquire waits for a place, with a hold reason
    HELD = "held"  # granted, its connection open
    RECLAIM = "reclaim"  # granted before the gate restarted: waits for its claim


class LeaseEnd(StrEnum):
    """Why a lease ended."""

    RELEASED = "released"  # its holder's own release
    CLOSED = "closed"  # its connection closed
    TIMEOUT = "timeout"  # it ran past max_runtime_seconds
    ENDED_BY_ADMIN = "ended_by_admin"  # `volutectl lease --end`: a release by root
    PIDS_EXITED = "pids_exited"  # every process it moved in exited
    SCOPE_GONE = "scope_gone"  # its scope ended (stopped from outside, or its turn ended)
    CREATOR_RELEASED = "creator_released"  # a joined lease whose creator released
    RECLAIM_EXPIRED = "reclaim_expired"  # not claimed within gate.lease_reclaim_seconds
    START_FAILED = "start_failed"  # its scope could not be started


class TurnState(StrEnum):
    STARTING = "starting"  # committed; its command not yet released
    RUNNING = "running"  # its command was released
    ENDED = "ended"


class Outcome(StrEnum):
    """How a turn ended."""

    OK = "ok"  # exited 0
    # exited non-zero after an --interrupt cut it short: done for whoever cut it, one
    # attempt for every other sender's delivery (core/admission.py's `settle`)
    INTERRUPTED = "interrupted"
    FAILED = "failed"  # exited non-zero, or ended with no exit status: one attempt
    TIMEOUT = "timeout"  # stopped for running past its time limit: one attempt
    NEVER_RAN = "never_ran"  # its command never started: back to pending, no attempt
    START_FAILED = "start_failed"  # it could not be started (user, fork, scope): one attempt

    @property
    def carried(self) -> bool:
        """Its deliveries are done (an interrupted turn's: those of whoever cut it)."""
        return self in (Outcome.OK, Outcome.INTERRUPTED)

    @property
    def failed(self) -> bool:
        """Its deliveries count one attempt."""
        return self in (Outcome.FAILED, Outcome.TIMEOUT, Outcome.START_FAILED)


class HoldReason(StrEnum):
    """Why a pending delivery did not start. Logged, shown in `status`, never an attempt."""

    MIND_BUSY = "mind_busy"  # the mind already runs its limit of turns
    GLOBAL_CAP = "global_cap"  # limits.global_concurrent_turns reached
    ADAPTIVE_LIMIT = "adaptive_limit"  # the adaptive limit reached, under the ceiling
    BEHIND_BACKOFF = "behind_backoff"  # an earlier row of this session is backing off
    IO_PRESSURE = "io_pressure"  # PSI says the storage is stalled
    TEST_RUN = "test_run"  # test runs fill the shared budget
    PAUSED = "paused"  # `volutectl pause`: no new turn until resumed
    # Writers mixed with lighter turns go one at a time: a turn that may write a whole
    # place waits while another may be writing, or was seen so less than WRITER_PAUSE
    # ago (core/admission.py's `writer_hold`, core/iocost.py).
    WRITER_RUNNING = "writer_running"


class AdaptiveMode(StrEnum):
    """What sets the global cap: the adaptive limit, or the static ceiling alone."""

    ADAPTIVE = "adaptive"  # the limit moves with the storage's answers
    STATIC = "static"  # limits.adaptive is off: global_concurrent_turns alone
    FALLBACK = "fallback"  # a signal failed: limits.adaptive.start, until it works again


# What `volutectl queue list` shows when no state is asked for.
DEFAULT_LISTED = (QueueState.PENDING, QueueState.RUNNING, QueueState.DEAD)
