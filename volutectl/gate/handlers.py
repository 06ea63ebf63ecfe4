"""What the gate does with each request: one handler per op, in one dispatch table.

A handler is a function of the gate's state and a typed request (and who sent it) to a
typed reply. It owns no socket: volutectl/gate/server.py reads the request and sends the
reply. Refusals come back as ErrorReply with their exit code; a failure that is not a
refusal (a bug) is left to the caller, which ends that one client.

Deliveries are the exception that proves the rule: they arrive in batches, and every
delivery of a batch shares one durable commit before any of them is acknowledged
(`accept_deliveries`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from volutectl import events
from volutectl.config.settings import Settings
from volutectl.core import admission
from volutectl.errors import DataError, PermissionDeniedError, TemporaryError, VoluteError
from volutectl.faults import crash_point
from volutectl.gate import status, validate
from volutectl.gate.liveness import Liveness
from volutectl.gate.pressure import PressureWatch
from volutectl.gate.turns import Turns
from volutectl.slots.watch import RepositoryLimit, SlotWatch
from volutectl.states import DEFAULT_LISTED, Outcome, QueueState
from volutectl.store.indexed import IndexedStore
from volutectl.store.minds import EVERY_MIND
from volutectl.store.queue import NewDelivery
from volutectl.store.quotas import Quota, QuotaExceeded
from volutectl.systemd.journal import Journal
from volutectl.systemd.port import SystemdManager
from volutectl.wire.messages import (
    ChangedReply,
    DeliverAck,
    DeliverRequest,
    DeliveryDead,
    DeliveryDropped,
    DropRequest,
    ErrorReply,
    Op,
    PausedMind,
    PauseReply,
    PauseRequest,
    Pong,
    QueueReply,
    QueueRequest,
    QueueRow,
    RegisterReply,
    RegisterRepoRequest,
    Reply,
    Request,
    ResumeRequest,
    RetryRequest,
    StatusReply,
    TurnEnded,
    WaitReply,
    WaitRequest,
)


@dataclass
class GateState:
    """What the handlers act on: the gate's parts, none of its sockets."""

    settings: Settings
    store: IndexedStore
    manager: SystemdManager
    turns: Turns
    liveness: Liveness
    slots: SlotWatch
    pressure: PressureWatch | None
    journal: Journal
    limits: admission.Limits
    notify: Callable[[int, Reply], None]  # tell a delivery's waiters how it ended
    dirty: bool = True  # admission should run
    paused: frozenset[str] | admission.EveryMind = frozenset()  # the store's pauses
    foreign_live: int = 0  # other scopes holding a place in the turns slice, last counted
    over_quota: set[int | None] = field(default_factory=set)  # uids refused, as logged


@dataclass(frozen=True)
class Caller:
    uid: int  # SO_PEERCRED of the connection


def status_handler(state: GateState, request: Request, caller: Caller) -> Reply:
    state.liveness.recount(known_foreign=state.foreign_live)  # settles what ended
    return StatusReply(status.build(state))


def queue_handler(state: GateState, request: Request, caller: Caller) -> Reply:
    assert isinstance(request, QueueRequest)
    states = request.states or DEFAULT_LISTED
    rows = state.store.list_rows(states, request.limit)
    return QueueReply(
        tuple(
            QueueRow(row.id, row.mind, row.session, row.state, row.attempts, row.hold_reason,
                     row.held_ms, row.turn_id, row.created_at, row.last_error, len(row.message))
            for row in rows
        ),
        max(0, state.store.count_rows(states) - len(rows)),
    )  # fmt: skip


def retry_handler(state: GateState, request: Request, caller: Caller) -> Reply:
    assert isinstance(request, RetryRequest)
    changed = state.store.retry(request.ids)
    for delivery_id in changed:
        state.journal.emit(events.DeliveryRetried(delivery_id=delivery_id))
    state.dirty = True
    return ChangedReply(tuple(changed))


def drop_handler(state: GateState, request: Request, caller: Caller) -> Reply:
    assert isinstance(request, DropRequest)
    changed = state.store.drop(request.ids, time.time())
    for delivery_id in changed:
        state.journal.emit(events.DeliveryDropped(delivery_id=delivery_id))
        state.notify(delivery_id, DeliveryDropped(delivery_id))
    state.dirty = True
    return ChangedReply(tuple(changed))


def register_repo_handler(state: GateState, request: Request, caller: Caller) -> Reply:
    """Watch the repository `volutectl test` runs in, if it is the caller's (or root's).

    What is checked is what the gate will watch: the common dir that the path's `.git`
    and `commondir` lead to (volutectl.gate.validate.git_common_dir); the watch checks it
    again, on the descriptor it watches. A repository the gate may not look into (it
    runs unprivileged) is refused with 77, and `status` lists it with that problem."""
    assert isinstance(request, RegisterRepoRequest)
    try:
        common = validate.git_common_dir(request.path, caller.uid)
    except PermissionError:
        with contextlib.suppress(RepositoryLimit):
            state.slots.register(Path(request.path), caller.uid)  # listed, with its problem
        raise PermissionDeniedError(
            f"path: the gate cannot watch {request.path}: permission denied",
            hint="docs/test-slots.md says how to let the gate read a repository",
        ) from None
    try:
        new = state.slots.register(common, caller.uid)
    except RepositoryLimit as limit:
        raise TemporaryError(
            str(limit),
            hint="the gate forgets a registered repository once it is gone, when it starts",
        ) from None
    if new:
        state.journal.emit(events.RepositoryWatched(repository=str(common)))
        state.dirty = True
    return RegisterReply(new)


def ping_handler(state: GateState, request: Request, caller: Caller) -> Reply:
    return Pong()


def load_pauses(state: GateState) -> dict[str, float]:
    """Read the pauses from the store into `state.paused`; mind -> since."""
    pauses = state.store.minds.pauses()
    state.paused = admission.EVERY_MIND if EVERY_MIND in pauses else frozenset(pauses)
    return pauses


def _pause_reply(changed: list[str], pauses: Mapping[str, float]) -> PauseReply:
    return PauseReply(tuple(changed), tuple(PausedMind(m, since) for m, since in pauses.items()))


def pause_handler(state: GateState, request: Request, caller: Caller) -> Reply:
    """Pause the minds named (none: every mind). One paused already is no error: it is
    left out of `changed`, and so is one that every mind's pause covers."""
    assert isinstance(request, PauseRequest)
    if request.minds is None:
        wanted = [EVERY_MIND]
    else:
        wanted = [
            validate.configured_mind(state.settings, mind) for mind in dict.fromkeys(request.minds)
        ]
        if isinstance(state.paused, admission.EveryMind):
            wanted = []  # each is paused already
    changed = state.store.minds.pause(wanted, time.time())
    for mind in changed:
        what = "every mind" if mind == EVERY_MIND else mind
        state.journal.emit(events.Paused(what=what, mind=mind))
    state.dirty = True  # its held deliveries now wait with reason `paused`
    return _pause_reply(changed, load_pauses(state))


def resume_handler(state: GateState, request: Request, caller: Caller) -> Reply:
    """Lift the pauses named (none: every pause): the wake flush. Each held delivery goes
    through admission as any other, one batch per session."""
    assert isinstance(request, ResumeRequest)
    pauses = state.store.minds.pauses()
    if request.minds is None:
        changed = state.store.minds.resume(None)
    else:
        names = list(dict.fromkeys(request.minds))
        for mind in names:
            if mind not in pauses:  # a paused mind since removed from the config may go
                validate.configured_mind(state.settings, mind)
        if EVERY_MIND in pauses:
            raise DataError(
                f"every mind is paused (volutectl pause with no name), so {names[0]} cannot "
                "be resumed alone",
                hint="resume every mind with `volutectl resume`, then pause by name the "
                "ones to keep paused",
            )
        changed = state.store.minds.resume(names)
    before = state.paused
    after = load_pauses(state)
    index = state.store.index  # per mind from the index: no scan of a deep queue
    going = sum(
        index.pending_of(mind)
        for mind in index.minds
        if mind in before and mind not in state.paused
    )
    for mind in changed:
        what = "every mind" if mind == EVERY_MIND else mind
        state.journal.emit(events.Resumed(what=what, going=going, mind=mind))
    state.dirty = True
    return _pause_reply(changed, after)


def wait_handler(state: GateState, request: Request, caller: Caller) -> Reply:
    """Each delivery must exist (the gate then keeps the client for their events); an id
    that never did, or whose row retention removed, is refused with 65 naming it."""
    assert isinstance(request, WaitRequest)
    ids = tuple(dict.fromkeys(request.ids))
    found = {row.id for row in state.store.rows(ids, with_message=False)}
    missing = [delivery_id for delivery_id in ids if delivery_id not in found]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise DataError(
            f"ids: no delivery {shown}",
            hint="none was queued with that id, or it ended long enough ago that retention "
            "removed it",
        )
    return WaitReply(ids)


Handler = Callable[[GateState, Request, Caller], Reply]
HANDLERS: dict[Op, Handler] = {
    Op.STATUS: status_handler,
    Op.QUEUE: queue_handler,
    Op.RETRY: retry_handler,
    Op.DROP: drop_handler,
    Op.REGISTER_REPO: register_repo_handler,
    Op.PING: ping_handler,
    Op.PAUSE: pause_handler,
    Op.RESUME: resume_handler,
    Op.WAIT: wait_handler,
}


def handle(state: GateState, request: Request, caller: Caller) -> Reply:
    """The reply to one request (not a delivery: see accept_deliveries)."""
    try:
        return HANDLERS[request.OP](state, request, caller)
    except VoluteError as error:
        return ErrorReply.of(error)
    except sqlite3.OperationalError as error:
        # The disk is full, or the database locked or unwritable: try again later.
        state.journal.emit(events.QueueFailed(op=request.OP, error=str(error)))
        return ErrorReply.of(TemporaryError(f"{request.OP}: the queue failed: {error}"))


def accept_deliveries(
    state: GateState, batch: list[DeliverRequest], callers: Sequence[Caller] | None = None
) -> list[Reply]:
    """Queue a batch in ONE durable commit, then acknowledge: a DeliverAck or an
    ErrorReply per request, in order. `callers`, one per request, are who sent them.

    A request id the store already holds is a client retrying after a gate died before
    its ack: it gets the original delivery id back, and nothing is queued twice. A new
    delivery that would take its sender past its uid's quota (volutectl/store/quotas.py) is
    refused with 75, and not stored. If the commit fails (a full disk), nothing is
    stored and every one is refused with 75; an error that is not the store's is
    raised, for the caller to end those clients.
    """
    replies: list[Reply | None] = []
    rows: list[NewDelivery] = []
    uids = [caller.uid for caller in callers] if callers is not None else [None] * len(batch)
    for request, uid in zip(batch, uids, strict=True):
        try:
            rows.append(dataclasses.replace(validate.delivery(state.settings, request), uid=uid))
            replies.append(None)
        except VoluteError as error:
            replies.append(ErrorReply.of(error))
    if not rows:
        return [reply for reply in replies if reply is not None]
    gate = state.settings.gate
    check = state.store.quota_check(Quota(gate.max_pending_per_uid, gate.max_pending_bytes_per_uid))
    try:
        results = iter(state.store.add_deliveries(rows, refuse=check))
    except (sqlite3.Error, OSError) as error:
        refusal = _refusal(state, len(rows), error)
        return [reply or refusal for reply in replies]
    crash_point("request_committed")
    state.over_quota -= check.accepted  # a uid served again is told of its next refusal
    done: list[Reply] = []
    for reply, request, uid in zip(replies, batch, uids, strict=True):
        if reply is not None:
            done.append(reply)
            continue
        result = next(results)
        if isinstance(result, QuotaExceeded) and uid not in state.over_quota:
            state.over_quota.add(uid)  # said once, until this uid is served again
            state.journal.emit(events.DeliveriesRefused(refusal=result.message, uid=uid))
        if isinstance(result, VoluteError):
            done.append(ErrorReply.of(result))
            continue
        done.append(DeliverAck(result))
        state.journal.emit(
            events.DeliveryQueued(mind=request.mind, session=request.session, delivery_id=result)
        )
    state.dirty = True
    return done


def _refusal(state: GateState, count: int, error: Exception) -> ErrorReply:
    state_dir: Path = state.settings.gate.state_dir
    state.journal.emit(
        events.DeliveriesNotStored(
            count=count, error=str(error), exception=type(error).__name__, state_dir=str(state_dir)
        )
    )
    return ErrorReply.of(
        TemporaryError(
            f"the queue could not store the delivery: {error}",
            hint=f"nothing was queued; free space in {state_dir} and deliver again",
        )
    )


def finished_event(state: GateState, delivery_id: int) -> Reply | None:
    """What a waiting client would have been told, for a delivery that already ended (a
    retried `--wait` request whose delivery ran before the retry arrived)."""
    found = state.store.rows([delivery_id], with_message=False)
    row = found[0] if found else None
    if row is None or row.state in (QueueState.PENDING, QueueState.RUNNING):
        return None
    if row.state is QueueState.DROPPED:
        return DeliveryDropped(row.id)
    turn = state.store.turn(row.turn_id) if row.turn_id is not None else None
    outcome = turn.outcome if turn is not None else None
    exit_status = turn.exit_status if turn is not None else None
    code = admission.wait_exit_code(exit_status, outcome or Outcome.FAILED)
    if row.state is QueueState.DEAD:
        ran = turn is not None and outcome is not Outcome.START_FAILED
        return DeliveryDead(row.id, row.last_error or "dead", code if ran else 1,
                            row.turn_id if ran else None, outcome if ran else None)  # fmt: skip
    return TurnEnded(row.id, row.turn_id or 0, outcome or Outcome.OK, exit_status, code)
