"""Every message on the gate's socket, typed, and the one step that checks each on arrival.

The gate and every client (`volutectl deliver` included) import this module, so an op,
a field or a reply is defined here once. docs/protocol.md documents the same messages for
programs in other languages; tests/unit/test_protocol_schema.py holds its JSON Schemas
against these classes. Framing (one JSON object per line, the version, the connection)
is volutectl/wire/protocol.py.

Light on purpose: `volutectl deliver` imports it on its hot path, so a message is a
volutectl.wire.records.Record (a frozen record that needs neither `typing` nor `dataclasses`).

- Requests check their fields on the way in (`decode_request`, with volutectl/wire/fields.py),
  each refusal a DataError (65) that names the field: types, ranges, names, flags that
  are booleans.
  What needs the gate's settings (is the mind configured, is the message too long) is
  checked by the gate's handler, volutectl/gate/validate.py.
- Replies are decoded by the client from their declared field types; a reply that does
  not fit is a ProtocolError (76).
"""

from __future__ import annotations

from enum import StrEnum

from volutectl.errors import EX_PROTOCOL, EX_USAGE, DataError, VoluteError
from volutectl.states import AdaptiveMode, HoldReason, LeaseEnd, LeaseState, Outcome, QueueState
from volutectl.wire import fields
from volutectl.wire.fields import QUEUE_LIMIT as QUEUE_LIMIT
from volutectl.wire.fields import QUEUE_LIMIT_MAX as QUEUE_LIMIT_MAX
from volutectl.wire.fields import REQUEST_ID_LENGTH as REQUEST_ID_LENGTH
from volutectl.wire.fields import delivery_ids, flag, mind_names, queue_states, request_id, text
from volutectl.wire.records import Message, Record, WireError, kind_of, register_enum

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: no `typing` import at run time
if TYPE_CHECKING:
    from typing import Any, ClassVar, Self, TypeVar

    R = TypeVar("R", bound="Reply")
    ReplyT = TypeVar("ReplyT", bound="Reply", covariant=True)
else:
    ReplyT = None


class Op(StrEnum):
    DELIVER = "deliver"
    STATUS = "status"
    QUEUE = "queue"
    RETRY = "retry"
    DROP = "drop"
    REGISTER_REPO = "register_repo"
    PING = "ping"
    PAUSE = "pause"
    RESUME = "resume"
    WAIT = "wait"
    ACQUIRE = "acquire"
    RELEASE = "release"
    CLAIM = "claim"
    END_LEASE = "end_lease"


for _enum in (QueueState, HoldReason, Outcome, AdaptiveMode, Op, LeaseState, LeaseEnd):
    register_enum(_enum)


def op_of(obj: dict[str, Any]) -> Op:
    value = obj.get("op")
    if value is None:
        raise DataError("op: missing: the request names no operation")
    if not isinstance(value, str):
        raise DataError(f"op: must be a string, not {kind_of(value)}")
    try:
        return Op(value)
    except ValueError:
        raise VoluteError(
            f"op: unknown request {value[:40]!r}",
            hint=f"this gate knows: {', '.join(op.value for op in Op)}",
            exit_code=EX_USAGE,
        ) from None


# -- requests -----------------------------------------------------------------------------


class Request(Message[ReplyT]):
    """A request: its op is a class constant, sent as the "op" field. `Request[SomeReply]`
    declares the reply that answers it (a refusal, ErrorReply, may answer any request).
    Its handler is in volutectl/gate/handlers.py's table."""

    OP: ClassVar[Op]


class DeliverRequest(Request["DeliverAck"]):
    """Queue `message` for `mind`'s session; with `wait`, stay for the turn's outcome."""

    OP = Op.DELIVER
    WIRE = {"op": Op.DELIVER.value}
    mind: str
    message: str
    session: str = "main"
    interrupt: bool = False
    wait: bool = False
    request_id: str | None = None
    QUIET = frozenset({"progress"})
    # With wait: also tell each failed attempt that will be tried again (AttemptFailed).
    # Asked for, so that a client that knows no such event is never sent one.
    progress: bool = False

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        mind, session = text(obj, "mind"), text(obj, "session", "main")
        message = text(obj, "message")
        request = cls(
            mind,
            message,
            session,
            flag(obj, "interrupt"),
            flag(obj, "wait"),
            request_id(obj),
            flag(obj, "progress"),
        )
        fields.names(mind, session)
        return request


# At most this many deliveries in one deliver request with items: each is a row the
# gate validates, counts against its sender's quota and stores in one commit before it
# answers (the line's own bounds, protocol.MAX_LINE and MAX_VALUES, apply as well).
MAX_DELIVER_ITEMS = 1000


class DeliverItem(Record):
    """One delivery of a deliver request with items: a deliver's fields, less wait."""

    mind: str
    message: str
    session: str = "main"
    interrupt: bool = False
    request_id: str | None = None
    QUIET = frozenset({"session", "interrupt", "request_id"})

    def request(self) -> DeliverRequest:
        """As the one delivery a deliver request carries (how the gate checks it)."""
        return DeliverRequest(
            self.mind, self.message, self.session, self.interrupt, False, self.request_id
        )


class DeliverManyRequest(Request["DeliverResults"]):
    """Queue each of `items` (op deliver, told apart by its items field): each gets its
    own result, in order, once every item that is stored is durably stored. Each item is
    checked, counted against its sender's quota and stored on its own: one refused
    leaves the others. An item that does not decode refuses the whole request (65,
    naming it), as it would refuse a deliver of one."""

    OP = Op.DELIVER
    WIRE = {"op": Op.DELIVER.value}
    items: tuple[DeliverItem, ...]

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        raw = obj.get("items")
        if not isinstance(raw, list):
            raise DataError(f"items: must be an array of deliveries, not {kind_of(raw)}")
        if len(raw) > MAX_DELIVER_ITEMS:
            raise DataError(
                f"items: at most {MAX_DELIVER_ITEMS} deliveries in one request, not {len(raw)}"
            )
        if flag(obj, "wait"):
            raise DataError(
                "wait: a deliver with items cannot wait; send a wait request with their ids"
            )
        return cls(tuple(_item(index, item) for index, item in enumerate(raw)))


def _item(index: int, obj: object) -> DeliverItem:
    if not isinstance(obj, dict):
        raise DataError(f"items[{index}]: a delivery is an object, not {kind_of(obj)}")
    try:
        one = DeliverRequest.decode(obj)
    except DataError as error:
        raise DataError(f"items[{index}]: {error.message}", hint=error.hint) from None
    return DeliverItem(one.mind, one.message, one.session, one.interrupt, one.request_id)


class StatusRequest(Request["StatusReply"]):
    OP = Op.STATUS
    WIRE = {"op": Op.STATUS.value}


class PingRequest(Request["Pong"]):
    OP = Op.PING
    WIRE = {"op": Op.PING.value}


class QueueRequest(Request["QueueReply"]):
    """List the newest `limit` deliveries in `states` (none given: pending, running and
    dead), newest first."""

    OP = Op.QUEUE
    WIRE = {"op": Op.QUEUE.value}
    states: tuple[QueueState, ...] = ()
    limit: int = QUEUE_LIMIT

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        return cls(queue_states(obj), fields.queue_limit(obj))


class RetryRequest(Request["ChangedReply"]):
    """Make dead deliveries pending again, with their attempts reset."""

    OP = Op.RETRY
    WIRE = {"op": Op.RETRY.value}
    ids: tuple[int, ...]

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        return cls(delivery_ids(obj))


class DropRequest(Request["ChangedReply"]):
    """Drop pending or dead deliveries."""

    OP = Op.DROP
    WIRE = {"op": Op.DROP.value}
    ids: tuple[int, ...]

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        return cls(delivery_ids(obj))


class RegisterRepoRequest(Request["RegisterReply"]):
    """Watch the test slots of the repository whose git common directory is `path`."""

    OP = Op.REGISTER_REPO
    WIRE = {"op": Op.REGISTER_REPO.value}
    path: str

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        path = text(obj, "path")
        if "\0" in path:
            raise DataError("path: contains a NUL byte")
        if not path.startswith("/"):
            raise DataError(
                f"path: {path[:80]!r} is relative; register_repo needs an absolute path"
            )
        return cls(path)


class PauseRequest(Request["PauseReply"]):
    """Hold new turns of `minds` (null: every mind, minds configured later included) until
    they are resumed; their running turns go on, and deliveries are still queued."""

    OP = Op.PAUSE
    WIRE = {"op": Op.PAUSE.value}
    minds: tuple[str, ...] | None = None

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        return cls(mind_names(obj))


class ResumeRequest(Request["PauseReply"]):
    """Lift the pauses of `minds` (null: every pause); their held deliveries go through."""

    OP = Op.RESUME
    WIRE = {"op": Op.RESUME.value}
    minds: tuple[str, ...] | None = None

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        return cls(mind_names(obj))


# At most this many deliveries in one wait: each is a waiter the gate keeps in memory.
MAX_WAIT_IDS = 1000


class WaitRequest(Request["WaitReply"]):
    """Stay until deliveries `ids` settle: WaitReply, then one Event for each."""

    OP = Op.WAIT
    WIRE = {"op": Op.WAIT.value}
    ids: tuple[int, ...]
    QUIET = frozenset({"progress"})
    progress: bool = False  # also tell each failed attempt (AttemptFailed), as deliver's

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        ids = delivery_ids(obj)
        if len(ids) > MAX_WAIT_IDS:
            raise DataError(f"ids: at most {MAX_WAIT_IDS} deliveries in one wait, not {len(ids)}")
        return cls(ids, flag(obj, "progress"))


class AcquireRequest(Request["AcquireReply"]):
    """Wait for a place for `mind`'s `session` in the gate's admission, then hold it as a
    lease bound to this connection: AcquireReply at once, then LeaseGranted (or
    LeaseEnded, if it ends first). `pids`: how many pidfds came with the line."""

    OP = Op.ACQUIRE
    WIRE = {"op": Op.ACQUIRE.value}
    mind: str
    session: str = "main"
    request_id: str | None = None
    pids: int = 0

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        mind, session = text(obj, "mind"), text(obj, "session", "main")
        request = cls(mind, session, request_id(obj), fields.pid_count(obj))
        fields.names(mind, session)
        return request


class ReleaseRequest(Request["ReleaseReply"]):
    """End lease `lease`, held with `token`."""

    OP = Op.RELEASE
    WIRE = {"op": Op.RELEASE.value}
    lease: int
    token: str

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        return cls(fields.lease_id(obj), fields.token(obj))


class ClaimRequest(Request["ClaimReply"]):
    """Bind lease `lease` (granted before the gate restarted) to this connection."""

    OP = Op.CLAIM
    WIRE = {"op": Op.CLAIM.value}
    lease: int
    token: str

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        return cls(fields.lease_id(obj), fields.token(obj))


class EndLeaseRequest(Request["EndLeaseReply"]):
    """An admin ends lease `lease`: a release by root; its holder is told."""

    OP = Op.END_LEASE
    WIRE = {"op": Op.END_LEASE.value}
    lease: int

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        return cls(fields.lease_id(obj))


REQUESTS: dict[Op, type[Request[Reply]]] = {
    cls.OP: cls
    for cls in (
        DeliverRequest,
        StatusRequest,
        PingRequest,
        QueueRequest,
        RetryRequest,
        DropRequest,
        RegisterRepoRequest,
        PauseRequest,
        ResumeRequest,
        WaitRequest,
        AcquireRequest,
        ReleaseRequest,
        ClaimRequest,
        EndLeaseRequest,
    )
}


# An op whose request has a second shape, told apart by an "items" field: many of it.
MANY: dict[Op, type[Request[Reply]]] = {Op.DELIVER: DeliverManyRequest}


def decode_request(obj: dict[str, Any]) -> Request[Reply]:
    """A decoded line (protocol.decode) as its typed request, or a refusal naming the field.
    Fields an op does not know are ignored, so that a newer client can add an optional
    one; an incompatible change bumps the protocol version instead."""
    op = op_of(obj)
    if "items" in obj and op in MANY:
        return MANY[op].decode(obj)
    return REQUESTS[op].decode(obj)


# -- replies ------------------------------------------------------------------------------


class Reply(Record):
    WIRE = {"ok": True}


class ErrorReply(Reply):
    """The request was refused: `code` is the exit code the client exits with."""

    WIRE = {"ok": False}
    error: str
    code: int
    hint: str | None = None

    @classmethod
    def of(cls, error: VoluteError) -> ErrorReply:
        return cls(error.message, error.exit_code, error.hint)

    def raise_it(self) -> None:
        raise VoluteError(
            self.error,
            hint=self.hint,
            # A code out of range must not turn a refusal into a traceback.
            exit_code=self.code if 1 <= self.code <= 255 else EX_PROTOCOL,
        )


class Pong(Reply):
    pass


class DeliverAck(Reply):
    """The delivery is durably queued as `id` (or was already: a retried request id)."""

    id: int
    QUIET = frozenset({"already_queued", "interrupt_refused"})
    # True: the request id was the sender's already, for this same delivery; nothing new
    # was stored (false from a gate before this field).
    already_queued: bool = False
    # True: an interrupt that may not cut short the session's running turn (it runs
    # another user's delivery, and the sender is no admin): the message folds in as a
    # plain delivery, and the turn is not signalled (false from a gate before this field).
    interrupt_refused: bool = False


class DeliverResult(Record):
    """One item's result in a DeliverResults: the DeliverAck (ok true) or the ErrorReply
    (ok false) a deliver of that item alone would have had, field for field."""

    ok: bool
    id: int | None = None
    already_queued: bool = False
    interrupt_refused: bool = False
    error: str | None = None
    code: int | None = None
    hint: str | None = None
    QUIET = frozenset({"id", "already_queued", "interrupt_refused", "error", "code", "hint"})

    @classmethod
    def of(cls, reply: DeliverAck | ErrorReply) -> DeliverResult:
        if isinstance(reply, ErrorReply):
            return cls(False, error=reply.error, code=reply.code, hint=reply.hint)
        return cls(True, reply.id, reply.already_queued, reply.interrupt_refused)

    def reply(self) -> DeliverAck | ErrorReply:
        """As the reply to a deliver of this item alone; a result that is neither is a
        WireError."""
        if self.ok and self.id is not None:
            return DeliverAck(self.id, self.already_queued, self.interrupt_refused)
        if not self.ok and self.error is not None and self.code is not None:
            return ErrorReply(self.error, self.code, self.hint)
        raise WireError(f"a deliver result that is neither an ack nor a refusal: {self!r:.200}")


class DeliverResults(Reply):
    """The reply to a deliver with items: one result per item, in the items' order."""

    results: tuple[DeliverResult, ...]


class Unchanged(Record):
    """An id a retry or drop left as it was, and why: the state it is in, or None when the
    queue holds no such delivery (never queued, or removed by retention)."""

    id: int
    state: QueueState | None


class ChangedReply(Reply):
    """The ids a retry or drop changed; the others were in no state to change, and
    `unchanged` says which state each is in (empty from a gate before it)."""

    changed: tuple[int, ...]
    unchanged: tuple[Unchanged, ...] = ()
    QUIET = frozenset({"unchanged"})


class RegisterReply(Reply):
    new: bool  # false: the gate already watched it


class QueueRow(Record):
    id: int
    mind: str
    session: str
    state: QueueState
    attempts: int
    hold_reason: HoldReason | None
    held_ms: int
    turn_id: int | None
    created_at: float
    last_error: str | None
    bytes: int
    # A pending row backing off after a failed attempt: when its next try may start
    # (seconds since the epoch); sent only then.
    not_before: float | None = None
    # Who delivered it (SO_PEERCRED); None: not known (from a gate before it was sent).
    uid: int | None = None
    QUIET = frozenset({"not_before"})


class QueueReply(Reply):
    rows: tuple[QueueRow, ...]
    not_shown: int = 0  # rows in those states beyond the limit (0 from a gate before it)


class PausedMind(Record):
    mind: str  # "*": every mind, minds configured later included
    since: float  # seconds since the epoch


class PauseReply(Reply):
    """After a pause or resume: the minds it paused or resumed ("*": every mind), and
    every pause now."""

    changed: tuple[str, ...]
    paused: tuple[PausedMind, ...]


class WaitReply(Reply):
    """The deliveries a wait stays for, each once. One Event for each follows, at once
    for one that has already settled."""

    ids: tuple[int, ...]


class AcquireReply(Reply):
    """The acquire is taken: `state` waiting (with its `reason`) or granted (the grant
    follows at once). `already`: a request id seen before answered its lease again."""

    lease: int
    state: str  # "waiting" or "granted"
    reason: HoldReason | None = None
    already: bool = False
    QUIET = frozenset({"reason", "already"})


class ReleaseReply(Reply):
    lease: int
    released: bool = True


class ClaimReply(Reply):
    lease: int
    unit: str
    turn_id: int


class EndLeaseReply(Reply):
    lease: int
    ended: bool = True


class LeaseStatus(Record):
    """A lease, as status shows it (never its token)."""

    lease: int
    mind: str
    session: str
    uid: int
    state: LeaseState
    reason: HoldReason | None = None
    turn_id: int | None = None
    unit: str | None = None
    created: bool = True
    pids: int = 0
    since: float = 0.0


class TurnStatus(Record):
    turn_id: int
    mind: str
    session: str
    unit: str
    running_s: float


class MindStatus(Record):
    running_sessions: tuple[str, ...]
    pending: int
    paused_since: float | None = None  # seconds since the epoch: its pause, or every mind's
    attempts: int = 0  # the most failed attempts of one of its pending deliveries
    next_retry_s: float | None = None  # until the earliest backoff of its deliveries ends
    last_turn_id: int | None = None  # its latest turn that ended
    last_turn_s: float | None = None  # since that turn ended
    last_outcome: Outcome | None = None
    dead: int = 0


class TestRunStatus(Record):
    unit: str
    worktree: str
    command: str
    running_s: float | None


class RepositoryStatus(Record):
    repository: str
    slots_held: int | None  # None: a repository the gate does not watch
    slots: int | None
    runs: tuple[TestRunStatus, ...]
    # Why the gate does not watch it ("permission denied"), or what of it it does not
    # count (slot files past tests.max_slot_files); None when all is well.
    problem: str | None = None


class PressureStatus(Record):
    enabled: bool
    high: bool
    reason: str | None
    trigger: str | None


class DiskStatus(Record):
    """A block device the adaptive limit watches (volutectl/gate/disks.py): what it holds,
    and its last interval as iostat has it."""

    device: str  # as /sys/block names it
    holds: tuple[str, ...]  # what the gate watches it for
    await_ms: float | None  # its requests' mean time over the last interval; None: none
    utilisation_percent: float  # the share of that interval it had a request in flight
    baseline_ms: float | None  # its lowest await, as learnt


class AdaptiveStatus(Record):
    """The adaptive limit (limits.adaptive): "adaptive", "static" (off: the ceiling
    alone), or "fallback" (a signal failed: the start value, until it works again)."""

    mode: AdaptiveMode
    limit: int | None  # the adaptive cap in force; None when static
    minimum: int
    maximum: int
    ceiling: int | None  # limits.global_concurrent_turns, over the adaptive limit
    reason: str | None  # why it last moved, or why it falls back
    rule: str = "gradient"
    probe_ms: float | None = None  # the last reading of the gate's synced probe
    # Each known mind's IO cost for its next turn, learnt from what its turns wrote (a
    # mind not listed costs 1), and what each mind's running turns cost now, from what
    # they have written so far (volutectl/core/iocost.py).
    costs: dict[str, float] = {}  # a frozen record's default: never mutated
    running_costs: dict[str, float] = {}
    # The watched disks (each mind's working directory or home, the state directory,
    # the journal, limits.adaptive.devices), and the one whose reading decided the last
    # interval when a disk's did (None: the probe's, or no reading yet).
    disks: tuple[DiskStatus, ...] = ()
    held_by: str | None = None


class ConfigStatus(Record):
    """The gate's configuration: when the one it runs was read, and the last reload that
    was refused (an invalid file: the running one stayed) or that kept keys needing a
    restart. Times are seconds since the epoch."""

    loaded_at: float
    refused: str | None = None  # the error of the last reload, if it was refused
    refused_at: float | None = None
    needs_restart: tuple[str, ...] = ()  # keys changed in the file, kept until a restart


class Status(Record):
    active_turns: int  # turn scopes that hold a process, ours and others in the slice
    global_cap: int | None
    turns_per_mind: int
    turns: tuple[TurnStatus, ...]
    foreign_scopes: int
    minds: dict[str, MindStatus]
    queue_depth: int
    holds: dict[str, int]
    oldest_held_s: float | None
    dead: int
    slice: str
    test_runs: tuple[RepositoryStatus, ...]
    io_pressure: PressureStatus
    test_runs_count_as_turns: bool
    # Minds whose turns cannot start (volutectl/launcher/preflight.py): mind -> what is wrong.
    preflight: dict[str, tuple[str, ...]] = {}
    paused: tuple[PausedMind, ...] = ()
    adaptive: AdaptiveStatus | None = None  # None from a gate before it
    # Pending deliveries whose backoff after a failed attempt has not ended: of
    # queue_depth, counted as the STATUS= line counts them (0 from a gate before it).
    backing_off: int = 0
    config: ConfigStatus | None = None  # None from a gate before it
    leases: tuple[LeaseStatus, ...] = ()  # waiting, held and to reclaim (none before it)


class StatusReply(Reply):
    status: Status


# Events: what a waiting client is told once its delivery settles (done, dead or
# dropped); a failed turn whose delivery will be tried again tells it nothing, unless
# it asked for progress (AttemptFailed).


class TurnEnded(Reply):
    """Delivery `id` is done: the turn that carried it ended (ok, or interrupted as asked);
    `exit_code` is what `--wait` exits with."""

    WIRE = {"ok": True, "event": "turn_ended"}
    id: int
    turn_id: int
    outcome: Outcome
    exit_status: int | None
    exit_code: int


class DeliveryDead(Reply):
    """Delivery `id` ran out of attempts; `exit_code` is its last turn's, for `--wait`."""

    WIRE = {"ok": True, "event": "dead"}
    id: int
    error: str
    exit_code: int = 1
    turn_id: int | None = None  # the turn of its last attempt (None: none started)
    outcome: Outcome | None = None


class DeliveryDropped(Reply):
    WIRE = {"ok": True, "event": "dropped"}
    id: int


class AttemptFailed(Reply):
    """An attempt at delivery `id` failed, and it will be tried again: not a settlement,
    so the wait goes on. Sent only to a client that asked (`progress`)."""

    WIRE = {"ok": True, "event": "attempt_failed"}
    id: int
    error: str  # why the attempt failed: "turn 7 exited 3"
    attempt: int  # the attempts counted so far, this one included
    max_attempts: int  # gate.max_attempts when it failed: the last attempt's number
    next_try_at: float  # seconds since the epoch: its backoff ends
    turn_id: int | None = None  # the turn of the attempt (None: none started)
    outcome: Outcome | None = None
    exit_status: int | None = None  # 128+N after signal N


class LeaseGranted(Reply):
    """Lease `lease` is granted: its `token` (for release and claim), its turn's scope.
    `created`: false when it joined a running turn of the same (mind, session), which
    takes no new place and moves no processes."""

    WIRE = {"ok": True, "event": "lease_granted"}
    lease: int
    token: str
    unit: str
    turn_id: int
    created: bool
    pids_moved: int = 0


class LeaseEnded(Reply):
    """Lease `lease` ended other than by its holder's own release: `reason` says why."""

    WIRE = {"ok": True, "event": "lease_ended"}
    lease: int
    reason: LeaseEnd


Event = TurnEnded | DeliveryDead | DeliveryDropped
LeaseEvent = LeaseGranted | LeaseEnded
LEASE_EVENTS: dict[object, type[LeaseEvent]] = {
    "lease_granted": LeaseGranted,
    "lease_ended": LeaseEnded,
}
EVENTS: dict[object, type[Event | AttemptFailed]] = {
    "turn_ended": TurnEnded,
    "dead": DeliveryDead,
    "dropped": DeliveryDropped,
    "attempt_failed": AttemptFailed,
}


def expect(cls: type[R], obj: dict[str, Any]) -> R:
    """The reply `obj` as `cls`, or the refusal it is raised; a WireError if it is neither."""
    if obj.get("ok") is False:
        ErrorReply.from_wire(obj).raise_it()
    if obj.get("ok") is not True:
        raise WireError(f"the gate's reply has no ok field: {str(obj)[:200]}")
    return cls.from_wire(obj)


def decode_event(obj: dict[str, Any]) -> Event | AttemptFailed:
    if obj.get("ok") is False:
        ErrorReply.from_wire(obj).raise_it()
    cls = EVENTS.get(obj.get("event"))
    if cls is None:
        raise WireError(f"unexpected reply from the gate: {str(obj)[:200]}")
    return cls.from_wire(obj)


def decode_lease_event(obj: dict[str, Any]) -> LeaseEvent:
    """A lease's event as the client reads it after its AcquireReply."""
    if obj.get("ok") is False:
        ErrorReply.from_wire(obj).raise_it()
    cls = LEASE_EVENTS.get(obj.get("event"))
    if cls is None:
        raise WireError(f"unexpected reply from the gate: {str(obj)[:200]}")
    return cls.from_wire(obj)
