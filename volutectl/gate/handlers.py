"""What the gate does with each request: one handler per request type, in one table.

A handler is a function of the gate's state and a typed request (and who sent it) to
that request's reply type (`Request[SomeReply]`, volutectl/wire/messages.py); the table
(`HANDLERS`) is built with `Request.answered_by`, so the type checker proves each entry.
It owns no socket: volutectl/gate/server.py reads the request, and
volutectl/gate/serving.py sends the reply. Refusals come back as ErrorReply with their
exit code; a failure that is not a refusal (a bug) is left to the caller, which ends
that one client.

A handler in `TOGETHER` answers the requests of its type that came in one pass at
once, in one list: deliveries, one item or many each (`accept_deliveries`), so that
every delivery of the pass shares one durable commit before any is acknowledged (and
volutectl/gate/serving.py's gather has the deliveries of a burst come in fewer passes).
`keeps` says which replies keep their client for the outcome (a wait, a deliver with
wait).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from volutectl import events, roles
from volutectl.core import admission
from volutectl.errors import DataError, PermissionDeniedError, TemporaryError, VoluteError
from volutectl.faults import crash_point
from volutectl.gate import leasepids, status, validate
from volutectl.gate.leases import Leases
from volutectl.gate.outcomes import Settled
from volutectl.gate.server import Client
from volutectl.gate.state import GateState
from volutectl.slots.watch import RepositoryLimit
from volutectl.states import DEFAULT_LISTED, QueueState
from volutectl.store.minds import EVERY_MIND
from volutectl.store.queue import AlreadyQueued, NewDelivery
from volutectl.store.quotas import Quota, QuotaExceeded
from volutectl.wire.messages import (
    AcquireReply,
    AcquireRequest,
    ChangedReply,
    ClaimReply,
    ClaimRequest,
    DeliverAck,
    DeliverManyRequest,
    DeliverRequest,
    DeliverResult,
    DeliverResults,
    DropRequest,
    EndLeaseReply,
    EndLeaseRequest,
    ErrorReply,
    PausedMind,
    PauseReply,
    PauseRequest,
    PingRequest,
    Pong,
    QueueReply,
    QueueRequest,
    QueueRow,
    RegisterReply,
    RegisterRepoRequest,
    ReleaseReply,
    ReleaseRequest,
    Reply,
    Request,
    ResumeRequest,
    RetryRequest,
    StatusReply,
    StatusRequest,
    Unchanged,
    WaitReply,
    WaitRequest,
)


@dataclass(frozen=True)
class Caller:
    uid: int  # SO_PEERCRED of the connection
    # The uid's groups (names); None: looked up in the user database when first needed,
    # once per request, so a change of membership counts from the next request on.
    groups: frozenset[str] | None = None
    # A descriptor that came with the request (SCM_RIGHTS; register_repo's directory),
    # open until the handler returns: what is kept of it is a dup.
    descriptor: int | None = None
    client: Client | None = None  # the connection it came on (a lease binds to it)
    # Every descriptor that came with it: an acquire's pidfds (closed as `descriptor`).
    descriptors: tuple[int, ...] = ()

    @cached_property
    def role(self) -> roles.Role:
        if self.uid == 0:
            return roles.Role.ADMIN  # no lookup: root is always an admin
        groups = roles.group_names(self.uid) if self.groups is None else self.groups
        return roles.role_of(self.uid, groups)

    def only_own(self) -> int | None:
        """The uid whose rows this caller may see (a client's own), or None: every row."""
        return None if self.role is roles.Role.ADMIN else self.uid


def status_handler(state: GateState, request: StatusRequest, caller: Caller) -> StatusReply:
    state.status_asks.refresh(state)  # systemd, at most every 0.25 s: settles what ended
    return StatusReply(status.seen_by(status.build(state), caller.role))


def queue_handler(state: GateState, request: QueueRequest, caller: Caller) -> QueueReply:
    """The newest rows in the states asked; a client's own deliveries only."""
    states = request.states or DEFAULT_LISTED
    uid = caller.only_own()
    rows = state.store.list_rows(states, request.limit, uid=uid)
    now = state.clock.wall()
    return QueueReply(
        rows=tuple(
            QueueRow(
                id=row.id,
                mind=row.mind,
                session=row.session,
                state=row.state,
                attempts=row.attempts,
                hold_reason=row.hold_reason,
                held_ms=row.held_ms,
                turn_id=row.turn_id,
                created_at=row.created_at,
                last_error=row.last_error,
                bytes=len(row.message),
                not_before=row.not_before if _backing_off(row.state, row.not_before, now) else None,
                uid=row.uid,
            )
            for row in rows
        ),
        not_shown=max(0, state.store.count_rows(states, uid=uid) - len(rows)),
    )


def _backing_off(row_state: QueueState, not_before: float | None, now: float) -> bool:
    """As the index counts a row backing off (status, STATUS=): pending, not before later."""
    return row_state is QueueState.PENDING and not_before is not None and not_before > now


def retry_handler(state: GateState, request: RetryRequest, caller: Caller) -> ChangedReply:
    changed = state.store.retry(request.ids)
    for delivery_id in changed:
        state.journal.emit(events.DeliveryRetried(delivery_id=delivery_id))
    state.dirty = True
    return _changed_reply(state, request.ids, changed)


def drop_handler(state: GateState, request: DropRequest, caller: Caller) -> ChangedReply:
    changed = state.store.drop(request.ids, state.clock.wall())
    for delivery_id in changed:
        state.journal.emit(events.DeliveryDropped(delivery_id=delivery_id))
        state.notify(Settled(delivery_id=delivery_id, state=QueueState.DROPPED))
    state.dirty = True
    return _changed_reply(state, request.ids, changed)


def _changed_reply(state: GateState, asked: Sequence[int], changed: list[int]) -> ChangedReply:
    """The reply to a retry or drop: what changed, and the state each other id is in, so
    the client can say per id why nothing happened to it."""
    left = [delivery_id for delivery_id in dict.fromkeys(asked) if delivery_id not in changed]
    states = {row.id: row.state for row in state.store.rows(left, with_message=False)}
    unchanged = tuple(Unchanged(delivery_id, states.get(delivery_id)) for delivery_id in left)
    return ChangedReply(tuple(changed), unchanged)


def register_repo_handler(
    state: GateState, request: RegisterRepoRequest, caller: Caller
) -> RegisterReply:
    """Watch the repository `volutectl test` runs in, if it is the caller's (or root's).

    What is checked is what the gate will watch: the common dir that the path's `.git`
    and `commondir` lead to (volutectl.gate.validate.git_common_dir), or, where the gate
    may not open the path (a private home), the directory whose descriptor came with the
    request; the watch checks it again, on the descriptor it watches. A repository the
    gate may not look into, sent with no descriptor, is refused with 77, and `status`
    lists it with that problem."""
    try:
        common = validate.git_common_dir(request.path, caller.uid, caller.descriptor)
    except PermissionError:
        with contextlib.suppress(RepositoryLimit):
            state.slots.register(Path(request.path), caller.uid)  # listed, with its problem
        raise PermissionDeniedError(
            f"path: the gate cannot watch {request.path}: permission denied",
            hint="docs/test-slots.md says what the gate needs to read a repository",
        ) from None
    try:
        new = state.slots.register(common, caller.uid, caller.descriptor)
    except RepositoryLimit as limit:
        raise TemporaryError(
            str(limit),
            hint="the gate forgets a registered repository once it is gone, when it starts",
        ) from None
    if new:
        state.journal.emit(events.RepositoryWatched(repository=str(common)))
        state.dirty = True
    return RegisterReply(new)


def ping_handler(state: GateState, request: PingRequest, caller: Caller) -> Pong:
    return Pong()


def load_pauses(state: GateState) -> dict[str, float]:
    """Read the pauses from the store into `state.paused`; mind -> since."""
    pauses = state.store.minds.pauses()
    state.paused = admission.EVERY_MIND if EVERY_MIND in pauses else frozenset(pauses)
    return pauses


def _pause_reply(changed: list[str], pauses: Mapping[str, float]) -> PauseReply:
    return PauseReply(tuple(changed), tuple(PausedMind(m, since) for m, since in pauses.items()))


def pause_handler(state: GateState, request: PauseRequest, caller: Caller) -> PauseReply:
    """Pause the minds named (none: every mind). One paused already is no error: it is
    left out of `changed`, and so is one that every mind's pause covers."""
    if request.minds is None:
        wanted = [EVERY_MIND]
    else:
        wanted = [
            validate.configured_mind(state.settings, mind, state.minds_on_disk)
            for mind in dict.fromkeys(request.minds)
        ]
        if isinstance(state.paused, admission.EveryMind):
            wanted = []  # each is paused already
    changed = state.store.minds.pause(wanted, state.clock.wall())
    for mind in changed:
        what = "every mind" if mind == EVERY_MIND else mind
        state.journal.emit(events.Paused(what=what, mind=mind))
    state.dirty = True  # its held deliveries now wait with reason `paused`
    return _pause_reply(changed, load_pauses(state))


def resume_handler(state: GateState, request: ResumeRequest, caller: Caller) -> PauseReply:
    """Lift the pauses named (none: every pause): the wake flush. Each held delivery goes
    through admission as any other, one batch per session."""
    pauses = state.store.minds.pauses()
    if request.minds is None:
        changed = state.store.minds.resume(None)
    else:
        names = list(dict.fromkeys(request.minds))
        for mind in names:
            if mind not in pauses:  # a paused mind since removed from the config may go
                validate.configured_mind(state.settings, mind, state.minds_on_disk)
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


def wait_handler(state: GateState, request: WaitRequest, caller: Caller) -> WaitReply:
    """Each delivery must exist (the gate then keeps the client for their events); an id
    that never did, or whose row retention removed, is refused with 65 naming it. A
    client may wait for its own deliveries only: another's is refused with 77."""
    ids = tuple(dict.fromkeys(request.ids))
    rows = state.store.rows(ids, with_message=False)
    found = {row.id for row in rows}
    missing = [delivery_id for delivery_id in ids if delivery_id not in found]
    own = caller.only_own()
    others = [row.id for row in rows if own is not None and row.uid != own]
    if others and not missing:
        raise roles.admin_refusal(
            f"ids: delivery {others[0]} is another user's; a client may wait for its own only"
        )
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise DataError(
            f"ids: no delivery {shown}",
            hint="none was queued with that id, or it ended long enough ago that retention "
            "removed it",
        )
    return WaitReply(ids)


def _leases(state: GateState, caller: Caller) -> tuple[Leases, Client]:
    if state.leases is None or caller.client is None:  # pragma: no cover - always set
        raise VoluteError("leases: this gate serves none")
    return state.leases, caller.client


def acquire_handler(state: GateState, request: AcquireRequest, caller: Caller) -> AcquireReply:
    """Wait for a place for (mind, session), then hold it as a lease bound to this
    connection (volutectl/gate/leases.py)."""
    leases, client = _leases(state, caller)
    validate.configured_mind(state.settings, request.mind, state.minds_on_disk)
    pidfds = caller.descriptors
    if request.pids or pidfds:  # docs/protocol.md, "A lease's processes"
        leasepids.may_move(state.settings, request.mind, caller.uid, caller.role)
        leasepids.check(pidfds, request.pids, state.settings, request.mind)
    return leases.acquire(
        request.mind, request.session, request.request_id, caller.uid, client, pidfds
    )


def release_handler(state: GateState, request: ReleaseRequest, caller: Caller) -> ReleaseReply:
    leases, _ = _leases(state, caller)
    return leases.release(request.lease, request.token, caller.uid)


def claim_handler(state: GateState, request: ClaimRequest, caller: Caller) -> ClaimReply:
    leases, client = _leases(state, caller)
    return leases.claim(request.lease, request.token, caller.uid, client)


def end_lease_handler(state: GateState, request: EndLeaseRequest, caller: Caller) -> EndLeaseReply:
    leases, _ = _leases(state, caller)
    return leases.end_by_admin(request.lease)


# Each request type's handler. `answered_by` proves (to mypy) that a handler takes that
# request and returns that request's reply type. Any client may deliver.
Handler = Callable[[GateState, Any, Caller], Reply]
HANDLERS: dict[type[Request[Reply]], Handler] = dict(
    [
        StatusRequest.answered_by(status_handler),
        QueueRequest.answered_by(queue_handler),
        RetryRequest.answered_by(retry_handler),
        DropRequest.answered_by(drop_handler),
        RegisterRepoRequest.answered_by(register_repo_handler),
        PingRequest.answered_by(ping_handler),
        PauseRequest.answered_by(pause_handler),
        ResumeRequest.answered_by(resume_handler),
        WaitRequest.answered_by(wait_handler),
        AcquireRequest.answered_by(acquire_handler),
        ReleaseRequest.answered_by(release_handler),
        ClaimRequest.answered_by(claim_handler),
        EndLeaseRequest.answered_by(end_lease_handler),
    ]
)


@dataclass(frozen=True)
class Keep:
    """A reply after which its client stays, for the events of deliveries `ids`."""

    ids: tuple[int, ...]
    look: bool  # some may have settled already: look in the store first
    progress: bool  # tell it each failed attempt too


def keeps(request: Request[Reply], reply: Reply) -> Keep | None:
    """Whether the client of `request`, answered `reply`, stays for an outcome."""
    if isinstance(request, DeliverRequest) and request.wait and isinstance(reply, DeliverAck):
        # A retried request's delivery may have run already: look, then.
        look = request.request_id is not None or reply.already_queued
        return Keep((reply.id,), look, request.progress)
    if isinstance(request, WaitRequest) and isinstance(reply, WaitReply):
        return Keep(reply.ids, True, request.progress)
    return None


REFUSED_SECONDS = 60.0  # at most one AdminRequestRefused entry per uid this often

# The requests that change others' work: an admin's alone (volutectl/roles.py). Every
# other request is a client's; those that show deliveries show a client its own.
ADMIN_ONLY: frozenset[type[Request[Reply]]] = frozenset(
    {PauseRequest, ResumeRequest, RetryRequest, DropRequest, EndLeaseRequest}
)


def needed_role(request: Request[Reply]) -> roles.Role:
    return roles.Role.ADMIN if type(request) in ADMIN_ONLY else roles.Role.CLIENT


def handle(state: GateState, request: Request[Reply], caller: Caller) -> Reply:
    """The reply to one request (one in TOGETHER: see handle_together): refused with 77
    if the caller's role does not allow it, else its handler's."""
    try:
        _check_role(state, request, caller)
        return HANDLERS[type(request)](state, request, caller)
    except VoluteError as error:
        return ErrorReply.of(error)
    except sqlite3.OperationalError as error:
        # The disk is full, or the database locked or unwritable: try again later.
        state.journal.emit(events.QueueFailed(op=request.OP, error=str(error)))
        return ErrorReply.of(TemporaryError(f"{request.OP}: the queue failed: {error}"))


def _check_role(state: GateState, request: Request[Reply], caller: Caller) -> None:
    if not roles.permits(caller.role, needed_role(request)):
        _say_refused(state, request.OP, caller.uid, state.clock.monotonic())
        raise roles.admin_refusal(f"{request.OP}: changes others' work, which only an admin may do")


def handle_together(
    state: GateState, batch: list[Request[Reply]], callers: Sequence[Caller]
) -> list[Reply]:
    """The replies to requests of TOGETHER's (each type's together), in order: each one
    its role does not allow refused with 77 alone. An error that is not a refusal is
    raised, for the caller to end those clients."""
    replies: list[Reply | None] = []
    allowed: dict[Together, list[int]] = {}
    for index, (request, caller) in enumerate(zip(batch, callers, strict=True)):
        try:
            if needed_role(request) is not roles.Role.CLIENT:  # any caller is a client:
                _check_role(state, request, caller)  # no group lookup for each delivery
        except VoluteError as error:
            replies.append(ErrorReply.of(error))
            continue
        replies.append(None)
        allowed.setdefault(TOGETHER[type(request)], []).append(index)
    for answer, indexes in allowed.items():
        got = answer(state, [batch[i] for i in indexes], [callers[i] for i in indexes])
        for index, reply in zip(indexes, got, strict=True):
            replies[index] = reply
    return [reply for reply in replies if reply is not None]


def _say_refused(state: GateState, op: str, uid: int, now: float) -> None:
    """An AdminRequestRefused entry, at most one per uid every REFUSED_SECONDS (the
    journal may live on a stalled card, and any local user may ask): the refusals in
    between are counted in the next. A uid's record is forgotten once it is older than
    that with nothing unsaid, so it holds only uids refused lately or with a count to say."""
    said = state.admin_refused
    last, unsaid = said.get(uid, (None, 0))
    if last is not None and now - last < REFUSED_SECONDS:
        said[uid] = (last, unsaid + 1)
        return
    for other, (when, pending) in list(said.items()):
        if now - when >= REFUSED_SECONDS and not pending:
            del said[other]
    said[uid] = (now, 0)
    state.journal.emit(events.AdminRequestRefused(op=op, uid=uid, unsaid=unsaid))


def accept_deliveries(
    state: GateState,
    batch: Sequence[DeliverRequest | DeliverManyRequest],
    callers: Sequence[Caller] | None = None,
) -> list[Reply]:
    """Queue the deliveries of a batch of deliver requests in ONE durable commit, then
    acknowledge: one reply per request, in order. A deliver of one gets a DeliverAck or
    an ErrorReply; a deliver with items gets DeliverResults, that reply for each item.
    `callers`, one per request, are who sent them (an item is its request's sender's)."""
    senders: Sequence[Caller | None] = callers if callers is not None else [None] * len(batch)
    flat: list[DeliverRequest] = []
    flat_senders: list[Caller | None] = []
    refused: dict[int, DeliverResults] = {}  # a batch with a bad item: queued not at all
    for index, (request, caller) in enumerate(zip(batch, senders, strict=True)):
        ones = (
            [item.request() for item in request.items]
            if isinstance(request, DeliverManyRequest)
            else [request]
        )
        if isinstance(request, DeliverManyRequest) and (whole := _bad_batch(state, ones)):
            refused[index] = whole
            continue
        flat += ones
        flat_senders += [caller] * len(ones)
    replies = iter(_accept(state, flat, flat_senders))
    done: list[Reply] = []
    for index, request in enumerate(batch):
        if index in refused:
            done.append(refused[index])
        elif isinstance(request, DeliverManyRequest):
            results = [DeliverResult.of(next(replies)) for _ in request.items]
            done.append(DeliverResults(tuple(results)))
        else:
            done.append(next(replies))
    return done


def _bad_batch(state: GateState, items: list[DeliverRequest]) -> DeliverResults | None:
    """None if every item of a batch is one the gate would queue (a configured mind with
    a command, a message within the limit); else the batch's refusal, every item refused
    and nothing queued: a bad item with its own error, the others naming the first bad
    one (item N is the client's line N). A uid's quota is not the batch's data: an item
    over it is refused alone (75), as a deliver of one is."""
    errors: list[VoluteError | None] = []
    for item in items:
        try:
            validate.delivery(state.settings, item, state.minds_on_disk)
            errors.append(None)
        except VoluteError as error:
            errors.append(error)
    bad = [(n, error) for n, error in enumerate(errors, 1) if error is not None]
    if not bad:
        return None
    first, cause = bad[0]
    why = f"item {first} of the batch was refused, and a batch is queued whole or not at all"
    return DeliverResults(
        tuple(
            DeliverResult.of(ErrorReply.of(error))
            if error is not None
            else DeliverResult(False, error=why, code=cause.exit_code)
            for error in errors
        )
    )


def _accept(
    state: GateState, batch: list[DeliverRequest], senders: Sequence[Caller | None]
) -> list[DeliverAck | ErrorReply]:
    """Queue deliveries in ONE commit, then acknowledge each: a DeliverAck or an
    ErrorReply, in order; `senders` are who sent each. The commit skips its fsync: the
    replies are sent once the pass's durable commit has made it durable
    (volutectl/gate/serving.py's `release`).

    A request id the store already holds is a client retrying after a gate died before
    its ack: it gets the original delivery id back, and nothing is queued twice. A new
    delivery that would take its sender past its uid's quota (volutectl/store/quotas.py) is
    refused with 75, and not stored. If the commit fails (a full disk), nothing is
    stored and every one is refused with 75; an error that is not the store's is
    raised, for the caller to end those clients.
    """
    replies: list[ErrorReply | None] = []
    rows: list[NewDelivery] = []
    uids = [caller.uid if caller is not None else None for caller in senders]
    for request, caller in zip(batch, senders, strict=True):
        try:
            row = validate.delivery(state.settings, request, state.minds_on_disk)
            admin = _interrupts_as_admin(request, caller)
            uid = caller.uid if caller is not None else None
            rows.append(dataclasses.replace(row, uid=uid, admin=admin))
            replies.append(None)
        except VoluteError as error:
            replies.append(ErrorReply.of(error))
    if not rows:
        return [reply for reply in replies if reply is not None]
    gate = state.settings.gate
    check = state.store.quota_check(Quota(gate.max_pending_per_uid, gate.max_pending_bytes_per_uid))
    try:
        results = iter(state.store.add_deliveries(rows, refuse=check, durable=False))
    except (sqlite3.Error, OSError) as error:
        refusal = _refusal(state, len(rows), error)
        return [reply or refusal for reply in replies]
    crash_point("request_committed")
    state.over_quota -= check.accepted  # a uid served again is told of its next refusal
    done: list[DeliverAck | ErrorReply] = []
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
        refused = request.interrupt and _interrupt_refused(state, result)
        if isinstance(result, AlreadyQueued):
            done.append(DeliverAck(result, already_queued=True, interrupt_refused=refused))
            continue  # its DeliveryQueued was told when it was stored
        done.append(DeliverAck(result, interrupt_refused=refused))
        state.journal.emit(
            events.DeliveryQueued(mind=request.mind, session=request.session, delivery_id=result)
        )
    state.dirty = True
    return done


def _interrupts_as_admin(request: DeliverRequest, caller: Caller | None) -> bool:
    """Whether `request` is an interrupt from an admin, who may cut short any turn: the
    fact its fold decides by, recorded as it is delivered. Only an interrupt pays for
    the group lookup."""
    return request.interrupt and caller is not None and caller.role is roles.Role.ADMIN


def _interrupt_refused(state: GateState, delivery_id: int) -> bool:
    """Whether the interrupt just stored as `delivery_id` will not cut short the turn it
    reaches (its ack says so). Not knowing says nothing: the fold decides anyway."""
    row = state.store.row(delivery_id)
    try:
        return row is not None and state.turns.interrupt_refused(row)
    except sqlite3.Error:
        return False


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


# The handlers that answer the requests of a pass together (their replies in order): a
# request of another type after them waits until they are answered, so that it sees
# what they did. The role each needs is checked as for any request.
Together = Callable[[GateState, list[Any], Sequence[Caller]], list[Reply]]
TOGETHER: dict[type[Request[Reply]], Together] = {
    DeliverRequest: accept_deliveries,
    DeliverManyRequest: accept_deliveries,
}
