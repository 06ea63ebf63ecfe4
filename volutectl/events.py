"""The catalog of what the gate tells its operator: one frozen dataclass per kind of event.

Each event type has its level, its typed fields, and its English message built from
them. The journal (volutectl/systemd/journal.py) sends an event as one entry: MESSAGE is
`message()`, PRIORITY comes from `level`, and each field is VOLUTE_<NAME>, in the order
declared, followed by VOLUTE_EVENT and, for most events that carry one, a MESSAGE_ID
(docs/journal.md lists them all). A field declared with `NOT_SENT` metadata
is in the message only: the journal entries stay as they were before this catalog.

Tests record the events (tests/unit/gate_harness.py) and assert on their types and
fields; the sentences are free to change. Whatever emits takes an `Emit` (a callable)
or a `Sink` (an object with `emit`), so that the store, say, knows nothing of systemd.

`Latch` is the one "say a failure once, try again at a deadline, say the recovery".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Literal, Protocol, TypedDict

from volutectl.states import HoldReason, Outcome, QueueState

Level = Literal["error", "warning", "notice", "info", "debug"]
LEVELS: Mapping[str, Level] = {
    "error": "error",
    "warning": "warning",
    "notice": "notice",
    "info": "info",
    "debug": "debug",
}


class EventName(StrEnum):
    """VOLUTE_EVENT: the kind of an entry, for entries about a delivery or a turn, and
    for the launcher's, the slot watch's and the io pressure gate's."""

    HOLD = "hold"
    HOLD_END = "hold_end"
    START = "start"
    END = "end"
    TIMEOUT = "timeout"
    DEAD = "dead"
    STRANDED = "stranded"
    ADOPT = "adopt"
    EMPTY_SCOPE = "empty_scope"
    LEFTOVERS_STOPPED = "leftovers_stopped"
    NOT_OFFERED = "not_offered"
    NOT_STORED = "not_stored"
    NOT_SYNCED = "not_synced"
    IO_PRESSURE_ON = "io_pressure_on"
    IO_PRESSURE_OFF = "io_pressure_off"
    IO_PRESSURE_HIGH = "io_pressure_high"
    IO_PRESSURE_FELL = "io_pressure_fell"
    ADAPTIVE_LIMIT_CHANGED = "adaptive_limit_changed"
    ADAPTIVE_FALLBACK = "adaptive_fallback"
    ADAPTIVE_MEASURING = "adaptive_measuring"
    ADAPTIVE_DISK_HOLDS = "adaptive_disk_holds"
    CPU_LIMIT_CHANGED = "cpu_limit_changed"
    ADMIN_REFUSED = "admin_refused"
    REPOSITORY_FORGOTTEN = "repository_forgotten"
    REPOSITORY_REFUSED = "repository_refused"
    REPOSITORY_UNWATCHABLE = "repository_unwatchable"
    REPOSITORY_WATCHED_AGAIN = "repository_watched_again"
    SLOTS_PAST_CAP = "slots_past_cap"
    SLOT_EVENTS_UNREADABLE = "slot_events_unreadable"
    SLOT_LOCKS_UNREADABLE = "slot_locks_unreadable"
    REGISTRATIONS_FULL = "registrations_full"
    REGISTRY_UNREADABLE = "registry_unreadable"
    REGISTRY_NOT_SAVED = "registry_not_saved"
    CONFIG_RELOADED = "config_reloaded"
    CONFIG_KEPT = "config_kept"
    ORDER_ACCEPT_FAILED = "order_accept_failed"
    ORDER_CONNECTION_REFUSED = "order_connection_refused"
    BAD_ORDER = "bad_order"
    LAUNCHED = "launched"
    TURN_DIR_NOT_REMOVED = "turn_dir_not_removed"
    TURN_DIR_SET_ASIDE = "turn_dir_set_aside"
    SWEEP_FAILED = "sweep_failed"
    TRASH_LEFT = "trash_left"
    GATE_CONFIG_INVALID = "gate_config_invalid"
    GATE_CONFIG_RELOADED = "gate_config_reloaded"
    GATE_CONFIG_REFUSED = "gate_config_refused"
    INTERRUPT_REFUSED = "interrupt_refused"
    LEASE_HELD = "lease_held"
    LEASE_GRANTED = "lease_granted"
    LEASE_ENDED = "lease_ended"
    LEASE_CLAIMED = "lease_claimed"
    PID_MOVED_IN = "pid_moved_in"
    PID_MOVED_BACK = "pid_moved_back"
    PID_NOT_MOVED_BACK = "pid_not_moved_back"
    LEASE_PIDS_NOT_MOVED = "lease_pids_not_moved"


# MESSAGE_ID of each event an operator queries for (`journalctl MESSAGE_ID=...`); made
# once at random (uuid4), and never changed: scripts match on them. hold_end, adopt and
# empty_scope have none (they had none before the catalog grew ids for new events).
MESSAGE_IDS: Mapping[EventName, str] = {
    EventName.HOLD: "f026259c51dd4587b509f49f1bf70ad4",
    EventName.START: "7d39eb6579df482f9c349ceadc5a7dab",
    EventName.END: "3fa69a5f83114162ae608c873d89156c",
    EventName.TIMEOUT: "98f69cfd2dde4ff081cf73a80c7cbaa7",
    EventName.DEAD: "69b9ac8362694fa49b471479c58a75bf",
    EventName.STRANDED: "b3f463b249d9486aa4da49845f154797",
    EventName.LEFTOVERS_STOPPED: "2d205a995f8641a19a2a39c0bfb48530",
    EventName.NOT_OFFERED: "2d4a2e048a0a49818ddec92b327e95c8",
    EventName.NOT_STORED: "82e7dbea24134bdbaa0565787567d3d5",
    EventName.NOT_SYNCED: "4aefee7d7530424683653a2cd87095c1",
    EventName.IO_PRESSURE_ON: "9d11c5f578ba49e9a4cc7dee44bbd236",
    EventName.IO_PRESSURE_OFF: "4733b775a00d4429b48276a3f6f919c1",
    EventName.IO_PRESSURE_HIGH: "cca007b348a740a4998de8123dddc886",
    EventName.IO_PRESSURE_FELL: "dd495b5dcc9c4e0f8407b2c907b9d50b",
    EventName.ADAPTIVE_LIMIT_CHANGED: "78ac394cee0541889f41bad11b6f8d7c",
    EventName.ADAPTIVE_FALLBACK: "1016b81a25c94289a853e7e24964d033",
    EventName.ADAPTIVE_MEASURING: "d43b51852fe145e8ab3603e2679b8b46",
    EventName.ADAPTIVE_DISK_HOLDS: "1913589eed154e34b2a96394de4450a1",
    EventName.CPU_LIMIT_CHANGED: "a4e99e0692684b93b11f9e2bd8f6d7e5",
    EventName.ADMIN_REFUSED: "52e355d593474b93bd5cca066eca1f3f",
    EventName.REPOSITORY_FORGOTTEN: "193bf4dcbaaa417086d5751012703481",
    EventName.REPOSITORY_REFUSED: "c8807590b9ac43b5a39236ae3cb279e2",
    EventName.REPOSITORY_UNWATCHABLE: "03c602b4041d41cf971b151baebdcea0",
    EventName.REPOSITORY_WATCHED_AGAIN: "e3687302b99944ecb9a74cdf518c5a97",
    EventName.SLOTS_PAST_CAP: "3245cc8da1614f73922011a96c58a7ea",
    EventName.SLOT_EVENTS_UNREADABLE: "6609a7b53f9e43318960139c14b772a6",
    EventName.SLOT_LOCKS_UNREADABLE: "46c607692e0144c390df9db591ea9947",
    EventName.REGISTRATIONS_FULL: "838a035430a34d3aa93ae1821c565ffc",
    EventName.REGISTRY_UNREADABLE: "4965cd3beed347b7b97a6f974dab2a0e",
    EventName.REGISTRY_NOT_SAVED: "e9a7a5427e3d4cff9df4949d62962c51",
    EventName.CONFIG_RELOADED: "fad10e9531a04bdbb93289b96994fef4",
    EventName.CONFIG_KEPT: "e34843f8c6b54889817d0f716eb42ff6",
    EventName.ORDER_ACCEPT_FAILED: "66f3de75e5c143eaac897d2c565ea20b",
    EventName.ORDER_CONNECTION_REFUSED: "4543a30cc952487195c23035a42c7415",
    EventName.BAD_ORDER: "ae00572062c74aa19845a0474abc8b92",
    EventName.LAUNCHED: "85a4b4a3bc8942208296e62b27c13135",
    EventName.TURN_DIR_NOT_REMOVED: "a8b1d81057914f77a02f7d4c1377f400",
    EventName.TURN_DIR_SET_ASIDE: "8029684c93684483872e02ff2cb90db5",
    EventName.SWEEP_FAILED: "4e6e0f1703074ffabe2af3b7a2f156cc",
    EventName.TRASH_LEFT: "241a94c0e4094dd1827bf6881e4d84fe",
    EventName.GATE_CONFIG_INVALID: "677af27734f7478d8a64e701be14cc76",
    EventName.GATE_CONFIG_RELOADED: "7a53a0c8111c46e1a178729271413029",
    EventName.GATE_CONFIG_REFUSED: "78306785c64d4ed6ae6b1470f5d3779c",
    EventName.INTERRUPT_REFUSED: "6a72d6ba8e124c758585b89bb4872da1",
    EventName.LEASE_HELD: "379d0888d34446198d0447637d6625b6",
    EventName.LEASE_GRANTED: "856014ff32a74d7793a995d1c02368f2",
    EventName.LEASE_ENDED: "a143fea4f53a42869b51e853f959f011",
    EventName.LEASE_CLAIMED: "d72358b4d703489d91761465088c5681",
    EventName.PID_MOVED_IN: "725caf475f8245a6879e5c9778b7d5d5",
    EventName.PID_MOVED_BACK: "a3971642a7224353a4809ece7a5cd3e2",
    EventName.PID_NOT_MOVED_BACK: "2d2cf538c9fd40719a6a48b627802978",
    EventName.LEASE_PIDS_NOT_MOVED: "6fc253e4e325426c9b972044aaa5710f",
}

# The metadata of a field that is in the message only, not sent as a journal field.
NOT_SENT: Mapping[str, bool] = {"sent": False}


@dataclass(frozen=True, kw_only=True)
class BaseEvent:
    """One thing that happened. Subclasses set LEVEL (or `level`), EVENT if the entry
    carries a VOLUTE_EVENT, and `message()`."""

    LEVEL: ClassVar[Level] = "info"
    EVENT: ClassVar[EventName | None] = None

    @property
    def level(self) -> Level:
        return self.LEVEL

    @classmethod
    def message_id(cls) -> str | None:
        return MESSAGE_IDS.get(cls.EVENT) if cls.EVENT is not None else None

    def message(self) -> str:
        raise NotImplementedError

    def journal_fields(self) -> dict[str, object]:
        """The entry's VOLUTE_* fields by lower-case name (None: left out by the journal)."""
        sent: dict[str, object] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get("sent", True)
        }
        if self.EVENT is not None:
            sent["event"] = self.EVENT
        return sent

    @classmethod
    def sent_field_names(cls) -> list[str]:
        """The names `journal_fields` can carry (docs/journal.md lists each)."""
        names = [f.name for f in dataclasses.fields(cls) if f.metadata.get("sent", True)]
        return names + (["event"] if cls.EVENT is not None else [])


Emit = Callable[[BaseEvent], None]


class Sink(Protocol):
    """Where events go: the journal, or a test's recorder."""

    def emit(self, event: BaseEvent) -> None: ...


class Latch:
    """A failure that lasts: said once when it starts, tried again at a deadline, and
    its recovery said once when it ends."""

    def __init__(self, emit: Emit, retry_seconds: float) -> None:
        self._emit = emit
        self.retry_seconds = retry_seconds
        self.failing = False

    def failed(self, event: BaseEvent, now: float) -> float:
        """Emit `event` unless already failing; the deadline to try again at."""
        if not self.failing:
            self._emit(event)
            self.failing = True
        return now + self.retry_seconds

    def works(self, event: BaseEvent) -> None:
        """It worked: emit `event` if it was failing."""
        if self.failing:
            self.failing = False
            self._emit(event)


# -- about one delivery -------------------------------------------------------------------


class DeliveryLike(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def mind(self) -> str: ...
    @property
    def session(self) -> str: ...


class DeliveryFields(TypedDict):
    mind: str
    session: str
    delivery_id: int


def delivery_fields(row: DeliveryLike) -> DeliveryFields:
    """The fields that find a delivery again, for `DeliveryEvent(**delivery_fields(row))`."""
    return {"mind": row.mind, "session": row.session, "delivery_id": row.id}


@dataclass(frozen=True, kw_only=True)
class DeliveryEvent(BaseEvent):
    """About one delivery: "delivery <id> for <mind>/<session> <text>"."""

    mind: str
    session: str
    delivery_id: int

    def text(self) -> str:
        raise NotImplementedError

    def message(self) -> str:
        return f"delivery {self.delivery_id} for {self.mind}/{self.session} {self.text()}"


@dataclass(frozen=True, kw_only=True)
class DeliveryHeld(DeliveryEvent):
    """A delivery starts waiting, or its hold reason changes."""

    EVENT = EventName.HOLD
    reason: HoldReason | None

    def text(self) -> str:
        return f"held: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class HoldEnded(DeliveryEvent):
    """A held delivery goes into a turn (`how`: starting one, or folded into one)."""

    EVENT = EventName.HOLD_END
    reason: HoldReason | None
    held_ms: int
    how: str = field(metadata=NOT_SENT)

    def text(self) -> str:
        return f"was held {self.held_ms} ms ({self.reason}); {self.how}"


@dataclass(frozen=True, kw_only=True)
class DeliveryNotOffered(DeliveryEvent):
    """A delivery could not be put in a live turn's inbox: the session's next turn gets it."""

    LEVEL = "warning"
    EVENT = EventName.NOT_OFFERED
    turn_id: int = field(metadata=NOT_SENT)
    error: str = field(metadata=NOT_SENT)

    def text(self) -> str:
        return (
            f"could not be offered into turn {self.turn_id}'s inbox ({self.error}): "
            "it goes to the session's next turn"
        )


@dataclass(frozen=True, kw_only=True)
class DeliveryDied(DeliveryEvent):
    """A delivery used its last attempt."""

    LEVEL = "warning"
    EVENT = EventName.DEAD
    attempts: int = field(metadata=NOT_SENT)
    error: str = field(metadata=NOT_SENT)

    def text(self) -> str:
        return f"is dead after {self.attempts} attempts: {self.error}"


@dataclass(frozen=True, kw_only=True)
class StrandedDeliverySettled(DeliveryEvent):
    """At the gate's start, a delivery found `running` under a turn that is not open (a
    gate died between its turn's end and its settlement, two commits before issue 29):
    settled now by that turn's recorded outcome."""

    LEVEL = "warning"
    EVENT = EventName.STRANDED
    turn_id: int | None
    outcome: Outcome
    state: QueueState = field(metadata=NOT_SENT)
    attempts: int = field(metadata=NOT_SENT)

    def text(self) -> str:
        turn = "no turn on record" if self.turn_id is None else f"turn {self.turn_id}, ended"
        return (
            f"was left running under {turn}; settled as {self.outcome}: "
            f"now {self.state} after {self.attempts} attempts"
        )


@dataclass(frozen=True, kw_only=True)
class DeliveryQueued(BaseEvent):
    """A delivery was stored (acknowledged to its client)."""

    LEVEL = "debug"
    mind: str
    session: str
    delivery_id: int

    def message(self) -> str:
        return f"queued delivery {self.delivery_id} for {self.mind}/{self.session}"


@dataclass(frozen=True, kw_only=True)
class DeliveryRetried(BaseEvent):
    """A dead delivery is pending again (`volutectl retry`)."""

    delivery_id: int

    def message(self) -> str:
        return f"retry delivery {self.delivery_id}"


@dataclass(frozen=True, kw_only=True)
class DeliveryDropped(BaseEvent):
    """A delivery was dropped (`volutectl drop`)."""

    delivery_id: int

    def message(self) -> str:
        return f"drop delivery {self.delivery_id}"


@dataclass(frozen=True, kw_only=True)
class DeliveriesRefused(BaseEvent):
    """A uid is past its quota of pending deliveries: said once, until it is served."""

    LEVEL = "warning"
    refusal: str = field(metadata=NOT_SENT)
    uid: int | None

    def message(self) -> str:
        return f"refusing deliveries: {self.refusal}"


@dataclass(frozen=True, kw_only=True)
class DeliveriesNotStored(BaseEvent):
    """The queue could not store a batch of deliveries: none was acknowledged."""

    LEVEL = "error"
    EVENT = EventName.NOT_STORED
    count: int = field(metadata=NOT_SENT)
    error: str = field(metadata=NOT_SENT)
    exception: str
    state_dir: str

    def message(self) -> str:
        return (
            f"could not store {self.count} deliveries, refused them (nothing acknowledged): "
            f"{self.exception}: {self.error}"
        )


@dataclass(frozen=True, kw_only=True)
class DeliveriesNotSynced(BaseEvent):
    """Deliveries were stored, but the queue could not sync them before the gate would
    acknowledge them: their clients were dropped unanswered, to send again with the same
    request ids (each gets its delivery back, durable, once a sync succeeds)."""

    LEVEL = "error"
    EVENT = EventName.NOT_SYNCED
    count: int = field(metadata=NOT_SENT)
    clients: int

    def message(self) -> str:
        return (
            f"could not sync {self.count} deliveries to disk, acknowledged none: dropped "
            f"their {self.clients} clients, which retry with the same request ids"
        )


@dataclass(frozen=True, kw_only=True)
class AdminRequestRefused(BaseEvent):
    """A client asked for what only an admin may do (volutectl/roles.py): said at most
    once a minute per uid, with how many more that uid was refused unsaid before it."""

    LEVEL = "warning"
    EVENT = EventName.ADMIN_REFUSED
    op: str
    uid: int
    unsaid: int = 0

    def message(self) -> str:
        more = f" ({self.unsaid} more refused since the last entry)" if self.unsaid else ""
        return f"refused uid {self.uid} a {self.op} request, which only an admin may make{more}"


@dataclass(frozen=True, kw_only=True)
class QueueFailed(BaseEvent):
    """The queue failed a request (a full disk, a locked database): the client may retry."""

    LEVEL = "warning"
    op: str = field(metadata=NOT_SENT)
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"the queue failed a {self.op} request: {self.error}"


# -- about one turn -----------------------------------------------------------------------


class TurnLike(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def mind(self) -> str: ...
    @property
    def session(self) -> str: ...
    @property
    def unit(self) -> str: ...


class TurnFields(TypedDict):
    mind: str
    session: str
    unit: str | None
    turn_id: int


def turn_fields(turn: TurnLike) -> TurnFields:
    """The fields that find a turn again, for `TurnEvent(**turn_fields(turn))`."""
    return {"mind": turn.mind, "session": turn.session, "unit": turn.unit, "turn_id": turn.id}


@dataclass(frozen=True, kw_only=True)
class TurnEvent(BaseEvent):
    """About one turn: "turn <id> of <mind>/<session> <text>"."""

    mind: str
    session: str
    unit: str | None
    turn_id: int

    def text(self) -> str:
        raise NotImplementedError

    def message(self) -> str:
        return f"turn {self.turn_id} of {self.mind}/{self.session} {self.text()}"


@dataclass(frozen=True, kw_only=True)
class TurnStarted(TurnEvent):
    """A turn's scope runs its command, with these deliveries."""

    EVENT = EventName.START
    delivery_ids: str

    def text(self) -> str:
        return f"started with deliveries {self.delivery_ids}"


@dataclass(frozen=True, kw_only=True)
class TurnFolded(TurnEvent):
    """A live turn took more deliveries of its session into its inbox."""

    delivery_ids: str

    def text(self) -> str:
        return f"took deliveries {self.delivery_ids} in its inbox"


@dataclass(frozen=True, kw_only=True)
class TurnInterrupted(TurnEvent):
    """A delivery with --interrupt reached a live turn: SIGINT to its scope."""

    def text(self) -> str:
        return "interrupted (SIGINT to its scope)"


@dataclass(frozen=True, kw_only=True)
class InterruptRefused(TurnEvent):
    """A delivery with --interrupt reached a live turn that runs another user's delivery,
    from a sender who was no admin: it folded in as a plain delivery, and no SIGINT."""

    LEVEL = "notice"
    EVENT = EventName.INTERRUPT_REFUSED
    delivery_id: int
    uid: int | None

    def text(self) -> str:
        return (
            f"was not interrupted by delivery {self.delivery_id} of uid {self.uid}: it runs "
            "another user's delivery, so that folded in as a plain one"
        )


@dataclass(frozen=True, kw_only=True)
class TurnStartUnknown(TurnEvent):
    """Starting the turn's scope failed in a way that may have started it: ask systemd."""

    LEVEL = "warning"
    error: str = field(metadata=NOT_SENT)

    def text(self) -> str:
        return f"may or may not have started ({self.error}): asking systemd"


@dataclass(frozen=True, kw_only=True)
class TurnNeverStarted(TurnEvent):
    """systemd gave no answer about the scope: the command never ran, the deliveries
    wait for the next pass with no attempt counted."""

    LEVEL = "warning"
    EVENT = EventName.END
    error: str = field(metadata=NOT_SENT)
    outcome: Outcome = Outcome.NEVER_RAN

    def message(self) -> str:
        return (
            f"turn {self.turn_id} of {self.mind}/{self.session} did not start, systemd gave "
            f"no answer ({self.error}); its deliveries wait for the next pass"
        )


@dataclass(frozen=True, kw_only=True)
class TurnStartFailed(TurnEvent):
    """A turn could not be started (user, fork, scope): its deliveries count an attempt."""

    LEVEL = "error"
    EVENT = EventName.END
    error: str = field(metadata=NOT_SENT)
    outcome: Outcome = Outcome.START_FAILED

    def text(self) -> str:
        return f"failed to start: {self.error}"


@dataclass(frozen=True, kw_only=True)
class TurnEnded(TurnEvent):
    """A turn settled: `outcome`, the command's exit status if it had one."""

    EVENT = EventName.END
    outcome: Outcome
    exit_status: int | None
    detail: str = field(metadata=NOT_SENT)

    @property
    def level(self) -> Level:
        return "warning" if self.outcome.failed else "info"

    def text(self) -> str:
        return f"ended: {self.detail}"


@dataclass(frozen=True, kw_only=True)
class TurnDirectoryKept(TurnEvent):
    """A settled turn's directory could not be removed yet: the next sweep removes it."""

    LEVEL = "warning"
    error: str = field(metadata=NOT_SENT)

    def text(self) -> str:
        return f"its directory stays for now: {self.error}"


@dataclass(frozen=True, kw_only=True)
class TurnTimedOut(TurnEvent):
    """A turn ran past its limit and is being stopped."""

    LEVEL = "warning"
    EVENT = EventName.TIMEOUT
    limit_seconds: float = field(metadata=NOT_SENT)
    grace_seconds: float = field(metadata=NOT_SENT)

    def text(self) -> str:
        return (
            f"ran past its limit of {self.limit_seconds:.0f} s: stopping it (SIGTERM, then "
            f"SIGKILL after {self.grace_seconds:g} s)"
        )


@dataclass(frozen=True, kw_only=True)
class TurnLeftoversStopped(TurnEvent):
    """A turn's main process exited a grace ago, and its scope still holds processes
    (`processes`, None if systemd could not say; `pids`, the first of them): the scope
    is stopped, and the place freed once it ends."""

    LEVEL = "notice"
    EVENT = EventName.LEFTOVERS_STOPPED
    processes: int | None
    pids: str | None
    grace_seconds: float = field(metadata=NOT_SENT)
    stop_seconds: float = field(metadata=NOT_SENT)

    def text(self) -> str:
        left = "processes"
        if self.processes is not None:
            left = f"{self.processes} process" + ("" if self.processes == 1 else "es")
        return (
            f"ended {self.grace_seconds:g} s ago, and {self.unit} still holds {left}: "
            f"stopping it (SIGTERM, then SIGKILL after {self.stop_seconds:g} s)"
        )


@dataclass(frozen=True, kw_only=True)
class TurnStopFailed(TurnEvent):
    """systemd did not stop a turn past its limit: asked again later."""

    LEVEL = "warning"
    error: str = field(metadata=NOT_SENT)

    def text(self) -> str:
        return f"could not stop it: {self.error}"


@dataclass(frozen=True, kw_only=True)
class TurnAdopted(TurnEvent):
    """A new gate found a turn of the store still running, and took it back."""

    EVENT = EventName.ADOPT

    def text(self) -> str:
        return "is still running: adopted"


@dataclass(frozen=True, kw_only=True)
class TurnUnanswered(TurnEvent):
    """systemd could not say whether a turn still runs: it keeps its place."""

    LEVEL = "warning"
    error: str = field(metadata=NOT_SENT)
    recheck_seconds: float = field(metadata=NOT_SENT)

    def text(self) -> str:
        return (
            f"cannot tell whether it still runs ({self.error}): it keeps its "
            f"place; asking again in {self.recheck_seconds:.0f} s"
        )


@dataclass(frozen=True, kw_only=True)
class TurnScopeEmpty(TurnEvent):
    """A turn's scope is still there but holds no process: it is stopped."""

    LEVEL = "warning"
    EVENT = EventName.EMPTY_SCOPE
    state: str = field(metadata=NOT_SENT)

    def text(self) -> str:
        return f"{self.unit} is {self.state} but holds no process: stopping it"


@dataclass(frozen=True, kw_only=True)
class TurnNotSettled(TurnEvent):
    """Settling a turn failed (the store, its hands): tried again."""

    LEVEL = "error"
    error: str = field(metadata=NOT_SENT)

    def text(self) -> str:
        return f"could not be settled: {self.error}; retrying"


@dataclass(frozen=True, kw_only=True)
class EmptyScopeFound(BaseEvent):
    """At start, an active scope of no known turn holds no process: it is stopped."""

    LEVEL = "warning"
    EVENT = EventName.EMPTY_SCOPE
    unit: str

    def message(self) -> str:
        return (
            f"{self.unit} is active but holds no process: stopping it (a turn started around "
            "a process that had died)"
        )


@dataclass(frozen=True, kw_only=True)
class ScopeStopFailed(BaseEvent):
    """A turn scope the gate asked to stop could not be stopped."""

    LEVEL = "warning"
    unit: str
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"could not stop {self.unit}: {self.error}"


@dataclass(frozen=True, kw_only=True)
class TurnDirectoriesNotSwept(BaseEvent):
    """The launcher could not sweep the directories of settled turns yet."""

    LEVEL = "warning"
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"turn directories not swept yet: {self.error}"


# -- the gate -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GateReady(BaseEvent):
    """The gate serves its socket and admits, with these limits."""

    socket: str
    global_cap: int | None = field(metadata=NOT_SENT)
    turns_per_mind: int = field(metadata=NOT_SENT)

    def message(self) -> str:
        return (
            f"gate ready on {self.socket}: cap "
            f"{self.global_cap or 'unlimited'}, {self.turns_per_mind} per mind"
        )


@dataclass(frozen=True, kw_only=True)
class HandlingFailed(BaseEvent):
    """Handling one event of the loop failed; its state stays as it was."""

    LEVEL = "error"
    what: str = field(metadata=NOT_SENT)
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"handling {self.what} failed: {self.error}"


@dataclass(frozen=True, kw_only=True)
class AdmissionFailing(BaseEvent):
    """Admission failed (systemd, the store): no turn starts until it works."""

    LEVEL = "error"
    error: str = field(metadata=NOT_SENT)
    retry_seconds: float = field(metadata=NOT_SENT)

    def message(self) -> str:
        return (
            f"admission failed, no turn starts until it works: {self.error}; retrying "
            f"every {self.retry_seconds:.0f} s"
        )


@dataclass(frozen=True, kw_only=True)
class AdmissionWorks(BaseEvent):
    """Admission runs again, after an `AdmissionFailing`."""

    def message(self) -> str:
        return "admission works again"


@dataclass(frozen=True, kw_only=True)
class RepositoryWatched(BaseEvent):
    """A repository's test slots are watched from now on (`volutectl test` registered it)."""

    repository: str

    def message(self) -> str:
        return f"watching test slots of {self.repository}"


@dataclass(frozen=True, kw_only=True)
class Paused(BaseEvent):
    """New turns of one mind (`mind`), or of all (None), are held until resumed."""

    what: str = field(metadata=NOT_SENT)
    mind: str | None

    def message(self) -> str:
        return f"paused {self.what}: new turns are held until resumed"


@dataclass(frozen=True, kw_only=True)
class Resumed(BaseEvent):
    """A pause was lifted: `going` held deliveries go through the gate."""

    what: str = field(metadata=NOT_SENT)
    going: int = field(metadata=NOT_SENT)
    mind: str | None

    def message(self) -> str:
        return f"resumed {self.what}: {self.going} held deliveries go through the gate"


@dataclass(frozen=True, kw_only=True)
class SocketMismatch(BaseEvent):
    """The socket systemd passed is not the one gate.socket names."""

    LEVEL = "warning"
    socket: str
    configured_socket: str

    def message(self) -> str:
        return (
            f"serving {self.socket}, the socket systemd passed (volute-gate.socket), not "
            f"gate.socket = {self.configured_socket}: clients that read the config connect "
            f"to {self.configured_socket}"
        )


@dataclass(frozen=True, kw_only=True)
class SocketGroupMissing(BaseEvent):
    """The group to own the gate's socket does not exist: only root can use it."""

    LEVEL = "warning"
    group: str = field(metadata=NOT_SENT)
    path: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"socket group {self.group!r} does not exist: only root can use {self.path}"


@dataclass(frozen=True, kw_only=True)
class ConnectionsRefused(BaseEvent):
    """A uid is past its share of connections: said once, until one is taken again."""

    LEVEL = "warning"
    refusal: str = field(metadata=NOT_SENT)
    uid: int
    clients: int

    def message(self) -> str:
        return f"refusing connections: {self.refusal}"


@dataclass(frozen=True, kw_only=True)
class NotAccepting(BaseEvent):
    """The listener is out of the loop for now (at the cap of clients, or out of fds)."""

    LEVEL = "warning"
    reason: str = field(metadata=NOT_SENT)
    clients: int

    def message(self) -> str:
        return f"not accepting for now: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class InternalError(BaseEvent):
    """A bug met while serving a client; the gate goes on."""

    LEVEL = "error"
    what: str = field(metadata=NOT_SENT)
    error: str = field(metadata=NOT_SENT)
    exception: str
    where: str | None

    def message(self) -> str:
        return f"internal error while {self.what}: {self.exception}: {self.error}"


@dataclass(frozen=True, kw_only=True)
class PreflightFailed(BaseEvent):
    """The preflight of the minds could not run at all."""

    LEVEL = "warning"
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"preflight of the minds failed: {self.error}"


@dataclass(frozen=True, kw_only=True)
class MindFailsPreflight(BaseEvent):
    """A mind's turns cannot start on this host, as its preflight says."""

    LEVEL = "warning"
    mind: str
    problems: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"mind {self.mind} fails preflight: {self.problems}"


# -- io pressure --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PressureGateOn(BaseEvent):
    """The gate holds new turns while the io.pressure file `pressure_file` says the
    storage stalls; `slice_file` is the turns slice's, when the gate looked there first
    (target "slice": a gate that may not register a trigger there falls back to the
    system's file, and its description says why)."""

    EVENT = EventName.IO_PRESSURE_ON
    description: str = field(metadata=NOT_SENT)
    pressure_file: str
    slice_file: str | None = None

    def message(self) -> str:
        return f"io pressure gate on: {self.description}"


@dataclass(frozen=True, kw_only=True)
class PressureGateOff(BaseEvent):
    """No PSI trigger could be registered: the gate does not hold for io pressure."""

    LEVEL = "warning"
    EVENT = EventName.IO_PRESSURE_OFF
    errors: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"io pressure gate off: {self.errors} (limits.io_pressure.enabled)"


@dataclass(frozen=True, kw_only=True)
class PressureHigh(BaseEvent):
    """The storage stalls: new turns are held."""

    EVENT = EventName.IO_PRESSURE_HIGH
    why: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"io pressure high: {self.why}; holding new turns"


@dataclass(frozen=True, kw_only=True)
class PressureFell(BaseEvent):
    """The stall fell below the resume threshold: turns are admitted again."""

    EVENT = EventName.IO_PRESSURE_FELL
    stalled_percent: float = field(metadata=NOT_SENT)
    resume_below_percent: float = field(metadata=NOT_SENT)

    def message(self) -> str:
        return (
            f"io pressure fell to {self.stalled_percent:.1f}% stalled (below "
            f"{self.resume_below_percent:g}%): admitting turns again"
        )


# -- the adaptive limit -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AdaptiveLimitChanged(BaseEvent):
    """The adaptive limit moved from `old_limit` to `new_limit`. Rate-limited (the journal
    may live on the stalled disk): `changes` moves since the last entry are said in one,
    with the measurement of the latest."""

    EVENT = EventName.ADAPTIVE_LIMIT_CHANGED
    old_limit: int
    new_limit: int
    changes: int = 1
    probe_ms: float | None = None  # the gate's synced probe of its state disk
    baseline_ms: float | None = None  # the probe's latency on a quiet disk, as learnt
    stalled_percent: float | None = None  # PSI io `some` over the interval
    why: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        moves = f" ({self.changes} moves)" if self.changes > 1 else ""
        return f"adaptive limit {self.old_limit} -> {self.new_limit} turns{moves}: {self.why}"


@dataclass(frozen=True, kw_only=True)
class CpuLimitChanged(AdaptiveLimitChanged):
    """The CPUs' bound on turns at once (volutectl/core/cpu.py) moved from `old_limit` to
    `new_limit`: PSI cpu `some` over the interval (`stalled_percent`), and the CPUs the
    turns' slice used over it (`cpus_used`; None: its cpu.stat was not read).
    Rate-limited as adaptive_limit_changed is."""

    EVENT = EventName.CPU_LIMIT_CHANGED
    cpus_used: float | None = None

    def message(self) -> str:
        moves = f" ({self.changes} moves)" if self.changes > 1 else ""
        return f"cpu limit {self.old_limit} -> {self.new_limit} turns at once{moves}: {self.why}"


@dataclass(frozen=True, kw_only=True)
class AdaptiveFallback(BaseEvent):
    """A signal of the adaptive limit failed (the probe, or a PSI file that vanished or
    reads as garbage): the gate holds to the static `limit` (limits.adaptive.start)."""

    LEVEL = "warning"
    EVENT = EventName.ADAPTIVE_FALLBACK
    limit: int
    why: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"adaptive limit: {self.why}; holding to {self.limit} turns at once until it works"


@dataclass(frozen=True, kw_only=True)
class AdaptiveMeasuring(BaseEvent):
    """The adaptive limit's signals work again: it moves from `limit` again."""

    EVENT = EventName.ADAPTIVE_MEASURING
    limit: int

    def message(self) -> str:
        return f"adaptive limit: measuring again, from {self.limit} turns at once"


@dataclass(frozen=True, kw_only=True)
class AdaptiveDiskHolds(BaseEvent):
    """A watched disk other than the probe's holds the adaptive limit down: its await,
    on the probe's scale, was the worst reading when the limit was lowered to `limit`.
    Said when the disk that holds it down changes, not at every move."""

    EVENT = EventName.ADAPTIVE_DISK_HOLDS
    device: str  # the block device, as /sys/block names it
    holds: str = field(metadata=NOT_SENT)  # what the gate watches it for
    await_ms: float | None = None  # its requests' mean time over the interval
    baseline_ms: float | None = None  # its lowest await, as learnt
    utilisation_percent: float | None = None
    limit: int

    def message(self) -> str:
        waited = f"await {self.await_ms:.0f} ms" if self.await_ms is not None else "stalled"
        base = f" (baseline {self.baseline_ms:.1f} ms)" if self.baseline_ms is not None else ""
        busy = (
            f", {self.utilisation_percent:.0f}% busy"
            if self.utilisation_percent is not None
            else ""
        )
        return (
            f"adaptive limit {self.limit} turns: held down by the disk {self.device} "
            f"({self.holds}): {waited}{base}{busy}"
        )


# -- retention ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RetentionFailing(BaseEvent):
    """The queue refused a batch of retention: said once, tried again every retry_seconds."""

    LEVEL = "warning"
    error: str = field(metadata=NOT_SENT)
    retry_seconds: float = field(metadata=NOT_SENT)

    def message(self) -> str:
        return (
            f"retention: the queue refused a batch, trying again every "
            f"{self.retry_seconds:.0f} s: {self.error}"
        )


@dataclass(frozen=True, kw_only=True)
class RetentionWorks(BaseEvent):
    """Retention's batches are taken again, after a `RetentionFailing`."""

    def message(self) -> str:
        return "retention: the queue takes batches again"


@dataclass(frozen=True, kw_only=True)
class RetentionDeleted(BaseEvent):
    """One batch of expired rows left the queue, and pages left the file."""

    LEVEL = "debug"
    deliveries: int = field(metadata=NOT_SENT)
    turns: int = field(metadata=NOT_SENT)
    days: float = field(metadata=NOT_SENT)
    pages: int = field(metadata=NOT_SENT)

    def message(self) -> str:
        return (
            f"retention: deleted {self.deliveries} deliveries and {self.turns} "
            f"turns over {self.days:g} days old; {self.pages} pages given back"
        )


@dataclass(frozen=True, kw_only=True)
class RetentionDeletedAtStart(BaseEvent):
    """Before converting the database: the expired deliveries, all at once."""

    deliveries: int = field(metadata=NOT_SENT)
    days: float = field(metadata=NOT_SENT)

    def message(self) -> str:
        return (
            f"retention: deleted {self.deliveries} deliveries that finished over "
            f"{self.days:g} days ago"
        )


@dataclass(frozen=True, kw_only=True)
class RetentionDeleteFailed(BaseEvent):
    """At the gate's start, deleting expired rows before the VACUUM failed; it goes on."""

    LEVEL = "warning"
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"retention: deleting expired rows failed: {self.error}"


@dataclass(frozen=True, kw_only=True)
class VacuumConversion(BaseEvent):
    """What converting the database to incremental vacuum did (store/schema.py's Vacuum)."""

    done: bool = field(metadata=NOT_SENT)
    outcome_level: str = field(metadata=NOT_SENT)
    text: str = field(metadata=NOT_SENT)

    @property
    def level(self) -> Level:
        return LEVELS.get(self.outcome_level, "info")

    def message(self) -> str:
        return self.text


# -- the slot watch (volutectl/slots/watch.py) ------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RepositoryForgotten(BaseEvent):
    """A registered repository that is gone, or no longer its user's, leaves the registry."""

    EVENT = EventName.REPOSITORY_FORGOTTEN
    repository: str
    reason: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"forgetting registered repository {self.repository}: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class RepositoryRefused(BaseEvent):
    """A repository `volutectl test` registered is not watched: not absolute, not a git
    repository, or not one its user may have watched."""

    LEVEL = "warning"
    EVENT = EventName.REPOSITORY_REFUSED
    repository: str
    reason: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"{self.repository}: {self.reason}; not watched"


@dataclass(frozen=True, kw_only=True)
class RepositoryUnwatchable(BaseEvent):
    """A known repository cannot be watched now (`problem`, as `status` says it); with
    `user`, the one the gate runs as, when it may not look."""

    LEVEL = "warning"
    EVENT = EventName.REPOSITORY_UNWATCHABLE
    repository: str
    problem: str
    user: str | None = None

    def message(self) -> str:
        if self.problem == "gone":
            return f"repository {self.repository} is gone; ignored"
        if self.problem == "missing or not a git repository":
            return f"repository {self.repository} is missing or not a git repository; ignored"
        said = f"cannot watch {self.repository}: {self.problem}"
        if self.user is not None:
            said += f" (the gate runs as {self.user}; see docs/test-slots.md)"
        return said


@dataclass(frozen=True, kw_only=True)
class RepositoryWatchedAgain(BaseEvent):
    """A repository whose slots could not be watched is watched again."""

    EVENT = EventName.REPOSITORY_WATCHED_AGAIN
    repository: str

    def message(self) -> str:
        return f"watching the test slots of {self.repository} again"


@dataclass(frozen=True, kw_only=True)
class SlotsPastCap(BaseEvent):
    """A repository has slot files past tests.max_slot_files: those are not counted."""

    LEVEL = "warning"
    EVENT = EventName.SLOTS_PAST_CAP
    repository: str
    max_slot_files: int

    def message(self) -> str:
        return (
            f"repository {self.repository}: slot files past slot-{self.max_slot_files} are "
            "not counted (tests.max_slot_files)"
        )


@dataclass(frozen=True, kw_only=True)
class SlotEventsUnreadable(BaseEvent):
    """The slot watch's inotify descriptor could not be read."""

    LEVEL = "warning"
    EVENT = EventName.SLOT_EVENTS_UNREADABLE
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"cannot read slot events: {self.error}"


@dataclass(frozen=True, kw_only=True)
class SlotLocksUnreadable(BaseEvent):
    """The file of locks could not be read: every slot looks free."""

    LEVEL = "warning"
    EVENT = EventName.SLOT_LOCKS_UNREADABLE
    path: str = field(metadata=NOT_SENT)
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"cannot read {self.path} ({self.error}); slots look free"


@dataclass(frozen=True, kw_only=True)
class RegistrationsFull(BaseEvent):
    """A registration past the bound of all (`uid` None) or of one user's: refused."""

    LEVEL = "warning"
    EVENT = EventName.REGISTRATIONS_FULL
    repository: str
    uid: int | None
    registered: int = field(metadata=NOT_SENT)

    def message(self) -> str:
        if self.uid is None:
            return f"{self.registered} repositories registered: not adding {self.repository}"
        return (
            f"uid {self.uid} has {self.registered} repositories registered, the most one "
            f"user may: not adding {self.repository}"
        )


@dataclass(frozen=True, kw_only=True)
class RegistryUnreadable(BaseEvent):
    """The registry of watched repositories could not be read: the gate starts without it."""

    LEVEL = "warning"
    EVENT = EventName.REGISTRY_UNREADABLE
    path: str = field(metadata=NOT_SENT)
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"ignoring unreadable {self.path}: {self.error}"


@dataclass(frozen=True, kw_only=True)
class RegistryNotSaved(BaseEvent):
    """The registry of watched repositories could not be written: it is kept in memory."""

    LEVEL = "warning"
    EVENT = EventName.REGISTRY_NOT_SAVED
    path: str = field(metadata=NOT_SENT)
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"cannot save {self.path}: {self.error}"


# -- the gate's own configuration: a bad one at start, and `systemctl reload` ------------------


@dataclass(frozen=True, kw_only=True)
class GateConfigInvalid(BaseEvent):
    """The gate has no valid configuration (at start, or a reload of a degraded gate):
    it serves its socket, refusing every request with 78, and stores nothing."""

    LEVEL = "error"
    EVENT = EventName.GATE_CONFIG_INVALID
    error: str

    def message(self) -> str:
        return f"degraded, refusing every request until the config is fixed: {self.error}"


@dataclass(frozen=True, kw_only=True)
class GateConfigReloaded(BaseEvent):
    """`systemctl reload` (SIGHUP): the file was read again and applied. Keys that only a
    restart can change keep their old values, and are named."""

    LEVEL = "notice"
    EVENT = EventName.GATE_CONFIG_RELOADED
    changed: str  # the dotted keys that changed, space-separated ("" for none)
    needs_restart: str  # of those, the ones kept at their old values until a restart

    def message(self) -> str:
        text = f"config reloaded: {self.changed or 'nothing changed'}"
        if self.needs_restart:
            text += f"; needs a restart, kept as before: {self.needs_restart}"
        return text


@dataclass(frozen=True, kw_only=True)
class GateConfigRefused(BaseEvent):
    """A reload found the file invalid: the gate keeps the configuration it runs."""

    LEVEL = "error"
    EVENT = EventName.GATE_CONFIG_REFUSED
    error: str

    def message(self) -> str:
        return f"config reload refused, the running config stays: {self.error}"


# -- the launcher (volute-launcher.service) ---------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ConfigurationReloaded(BaseEvent):
    """The launcher read its configuration file again: it changed."""

    EVENT = EventName.CONFIG_RELOADED
    file: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"configuration {self.file} read again"


@dataclass(frozen=True, kw_only=True)
class ConfigurationKept(BaseEvent):
    """The changed configuration does not load: the launcher keeps the last good one."""

    LEVEL = "warning"
    EVENT = EventName.CONFIG_KEPT
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"configuration not read again, keeping the last: {self.error}"


@dataclass(frozen=True, kw_only=True)
class OrderAcceptFailed(BaseEvent):
    """The launcher could not accept a connection on its order socket."""

    LEVEL = "warning"
    EVENT = EventName.ORDER_ACCEPT_FAILED
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"accepting an order connection failed: {self.error}"


@dataclass(frozen=True, kw_only=True)
class OrderConnectionRefused(BaseEvent):
    """A connection to the launcher from a uid that is not root's or the gate's user's,
    or past the bound on connections: refused and hung up."""

    LEVEL = "warning"
    EVENT = EventName.ORDER_CONNECTION_REFUSED
    uid: int
    why: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"refused an order connection from uid {self.uid}: {self.why}"


@dataclass(frozen=True, kw_only=True)
class BadOrder(BaseEvent):
    """An order the launcher cannot take: refused, and its connection hung up."""

    LEVEL = "warning"
    EVENT = EventName.BAD_ORDER
    uid: int
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"a bad order from uid {self.uid}: {self.error}"


@dataclass(frozen=True, kw_only=True)
class TurnLaunched(BaseEvent):
    """The launcher forked a turn's process (`pid`). Its mind and session are in the
    message only: `volutectl logs` shows the launcher's entries that name a mind."""

    EVENT = EventName.LAUNCHED
    mind: str = field(metadata=NOT_SENT)
    session: str = field(metadata=NOT_SENT)
    turn_id: int
    pid: int

    def message(self) -> str:
        return f"started turn {self.turn_id} of {self.mind}/{self.session}: pid {self.pid}"


@dataclass(frozen=True, kw_only=True)
class TurnDirectoryNotRemoved(BaseEvent):
    """A turn's directory could not be removed; the next sweep tries it again."""

    LEVEL = "warning"
    EVENT = EventName.TURN_DIR_NOT_REMOVED
    path: str = field(metadata=NOT_SENT)
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return f"could not remove {self.path}: {self.error}"


@dataclass(frozen=True, kw_only=True)
class TurnDirectorySetAside(BaseEvent):
    """A turn's directory too large to remove within one budget: moved to the trash."""

    LEVEL = "warning"
    EVENT = EventName.TURN_DIR_SET_ASIDE
    path: str = field(metadata=NOT_SENT)
    left: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return (
            f"{self.path} was too large to remove at once: set aside as {self.left}, to "
            "be removed a part at a time"
        )


@dataclass(frozen=True, kw_only=True)
class SweepFailed(BaseEvent):
    """A sweep of settled turns' directories could not open or move one (`error` says)."""

    LEVEL = "warning"
    EVENT = EventName.SWEEP_FAILED
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        return self.error


@dataclass(frozen=True, kw_only=True)
class TrashLeft(BaseEvent):
    """Directories set aside were too large to remove in this sweep: the next tries again."""

    LEVEL = "warning"
    EVENT = EventName.TRASH_LEFT
    trash: str = field(metadata=NOT_SENT)
    left: tuple[str, ...] = field(metadata=NOT_SENT)

    def message(self) -> str:
        return (
            f"{len(self.left)} turn directories set aside in {self.trash} were too large to "
            f"remove now ({', '.join(self.left[:5])}); the next sweep tries again"
        )


@dataclass(frozen=True, kw_only=True)
class PidMovedIn(BaseEvent):
    """The launcher moved a lease's process (`pid`) from `unit` into the lease's scope."""

    EVENT = EventName.PID_MOVED_IN
    mind: str = field(metadata=NOT_SENT)
    turn_id: int
    pid: int
    unit: str

    def message(self) -> str:
        return f"moved pid {self.pid} of {self.mind} from {self.unit} into lease {self.turn_id}"


@dataclass(frozen=True, kw_only=True)
class PidMovedBack(BaseEvent):
    """A lease's process went back: to the unit it came from, or the fallback scope."""

    EVENT = EventName.PID_MOVED_BACK
    mind: str = field(metadata=NOT_SENT)
    turn_id: int
    pid: int
    unit: str

    def message(self) -> str:
        return f"moved pid {self.pid} of {self.mind} back from lease {self.turn_id} to {self.unit}"


@dataclass(frozen=True, kw_only=True)
class PidNotMovedBack(BaseEvent):
    """A lease's process could go neither to its unit nor to the fallback: it is still
    in the lease's scope, and its record is kept for the next MoveBack."""

    LEVEL = "error"
    EVENT = EventName.PID_NOT_MOVED_BACK
    mind: str = field(metadata=NOT_SENT)
    turn_id: int
    pid: int
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        where = f"lease {self.turn_id} of {self.mind}"
        return f"could not move pid {self.pid} out of {where}: {self.error}"


@dataclass(frozen=True, kw_only=True)
class LeasePidsNotMoved(BaseEvent):
    """The gate's MoveIn or MoveBack of a lease's processes failed (`error` says why,
    `direction` which): in, the lease holds its place without them; back, its scope is
    stopped all the same (the launcher's record keeps them for the next try)."""

    LEVEL = "warning"
    EVENT = EventName.LEASE_PIDS_NOT_MOVED
    unit: str
    direction: str = field(metadata=NOT_SENT)
    error: str = field(metadata=NOT_SENT)

    def message(self) -> str:
        moved = f"moved {self.direction}"
        return f"the processes of lease scope {self.unit} were not {moved}: {self.error}"


def catalog() -> list[type[BaseEvent]]:
    """Every concrete event type (the ones with a message of their own)."""
    found: list[type[BaseEvent]] = []
    pending: list[type[BaseEvent]] = [BaseEvent]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls not in (BaseEvent, DeliveryEvent, TurnEvent):
            found.append(cls)
    return found


# -- leases (issue 31) -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LeaseEvent(BaseEvent):
    """About one lease: "lease <id> of <mind>/<session> (uid <uid>) <text>"."""

    lease: int
    mind: str
    session: str
    uid: int

    def text(self) -> str:
        raise NotImplementedError

    def message(self) -> str:
        return f"lease {self.lease} of {self.mind}/{self.session} (uid {self.uid}) {self.text()}"


@dataclass(frozen=True, kw_only=True)
class LeaseHeld(LeaseEvent):
    """An acquire waits for a place, or its hold reason changes."""

    EVENT = EventName.LEASE_HELD
    reason: HoldReason

    def text(self) -> str:
        return f"waits: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class LeaseGranted(LeaseEvent):
    """A lease is granted: it created its turn's scope, or joined a running turn."""

    EVENT = EventName.LEASE_GRANTED
    turn_id: int
    unit: str
    created: bool

    def text(self) -> str:
        how = "in a new scope" if self.created else "joining a running turn"
        return f"granted {how}: {self.unit}"


@dataclass(frozen=True, kw_only=True)
class LeaseEnded(LeaseEvent):
    """A lease ended (or a waiting acquire went), and why (`states.LeaseEnd`)."""

    EVENT = EventName.LEASE_ENDED
    turn_id: int | None
    reason: str

    def text(self) -> str:
        return f"ended: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class LeaseClaimed(LeaseEvent):
    """A lease granted before the gate restarted was claimed again by its holder."""

    EVENT = EventName.LEASE_CLAIMED

    def text(self) -> str:
        return "claimed again after the gate restarted"
