"""The records of the queue database: what the store takes in and hands out.

`NewDelivery` (a delivery to add), `AlreadyQueued` (the id a request id sent again
gives back), `NewTurn` (a turn to start), `Row` (a delivery as stored), `TurnRow` (a turn as
stored) and `RequestIdReused` (the refusal of a reused request id): plain frozen
dataclasses with no SQL, so the store's callers and quotas (volutectl/store/quotas.py)
can name them without the store. The store (volutectl/store/queue.py) is the only module
that reads or writes them in SQL, and decodes its SELECTs into them by column name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from volutectl.core.admission import Delivery, Sent
from volutectl.errors import DataError
from volutectl.states import HoldReason, Outcome, QueueState, TurnKind, TurnState


class RequestIdReused(DataError):
    """A request id the store holds, sent again with another mind, session, message or
    interrupt flag: never a retry, so it is refused (65) rather than merged."""

    def __init__(self, request_id: str, delivery_id: int) -> None:
        super().__init__(
            f"request id {request_id} was already used for delivery {delivery_id}, "
            "with other content",
            hint="a client makes a new request id for each new message",
        )
        self.request_id = request_id
        self.delivery_id = delivery_id


class AlreadyQueued(int):
    """A delivery id that a request id the store held already gave back: nothing new was
    stored. An int, so a caller that only wants the id need not tell the two apart."""


@dataclass(frozen=True)
class NewDelivery:
    """A delivery to add. `request_id`, made by the client, makes a retry harmless (it is
    unique per `uid`); `uid` is who delivered it (None: not known), whose quota it counts
    against; `admin`, for an interrupt, that its sender was an admin then."""

    mind: str
    session: str
    message: bytes
    interrupt: bool = False
    request_id: str | None = None
    uid: int | None = None
    admin: bool = False  # an interrupt whose sender is an admin: it may cut any turn


@dataclass(frozen=True)
class NewTurn:
    """A turn to start: its pending deliveries move to it. `unit_for` makes its scope's
    name from the turn id the store gives it; `deadline` is when its max runtime runs
    out (None: never)."""

    mind: str
    session: str
    delivery_ids: Sequence[int]
    unit_for: Callable[[int], str]
    deadline: float | None = None


@dataclass(frozen=True)
class Row:
    id: int
    mind: str
    session: str
    message: bytes
    interrupt: bool
    state: QueueState
    attempts: int
    not_before: float | None
    created_at: float
    held_since: float | None
    hold_reason: HoldReason | None
    held_ms: int
    turn_id: int | None
    folded: bool
    last_error: str | None
    uid: int | None = None  # who delivered it (SO_PEERCRED); None: not known
    admin: bool = False  # an interrupt whose sender was an admin when it delivered
    cut: bool = False  # an interrupt that cut its turn short (decided at its fold)

    def as_delivery(self) -> Delivery:
        return Delivery(
            id=self.id,
            mind=self.mind,
            session=self.session,
            interrupt=self.interrupt,
            not_before=self.not_before,
        )

    def as_sent(self) -> Sent:
        """The row as the interrupt rules see it (core/admission.py)."""
        return Sent(self.id, self.uid, self.interrupt, self.admin, self.cut)


@dataclass(frozen=True)
class TurnRow:
    id: int
    mind: str
    session: str
    unit: str
    state: TurnState
    released: bool
    started_at: float
    ended_at: float | None
    outcome: Outcome | None
    exit_status: int | None
    detail: str | None
    pid: int | None = None  # the turn's main process (its wrapper), once released
    interrupted: bool = False  # the gate sent it SIGINT for an --interrupt delivery
    deadline: float | None = None  # when its max runtime runs out (None: no limit)
    timed_out_at: float | None = None  # when the gate stopped it for running past that
    kind: TurnKind = TurnKind.TURN  # a lease's scope, or a run of the mind's command
