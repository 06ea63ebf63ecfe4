"""The rows of the queue database, as the store hands them out and takes them in.

Plain frozen dataclasses, and the parsing of a SELECT's tuple into one. The store
(volutectl/store/queue.py) is the only module that reads or writes them in SQL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from volutectl.core.admission import Delivery
from volutectl.errors import DataError
from volutectl.states import HoldReason, Outcome, QueueState, TurnState


class RequestIdReused(DataError):
    """A request id the store holds, sent again with another mind, session, message or
    interrupt flag: never a retry, so it is refused (65) rather than merged."""

    def __init__(self, request_id: str, delivery_id: int) -> None:
        super().__init__(
            f"request id {request_id} was already used for delivery {delivery_id}, "
            "with other content",
            hint="a client makes a new random request id for each new message",
        )
        self.request_id = request_id
        self.delivery_id = delivery_id


@dataclass(frozen=True)
class NewDelivery:
    """A delivery to add. `request_id`, made by the client, makes a retry harmless;
    `uid` is who delivered it (None: not known), whose quota it counts against."""

    mind: str
    session: str
    message: bytes
    interrupt: bool = False
    request_id: str | None = None
    uid: int | None = None


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

    def as_delivery(self) -> Delivery:
        return Delivery(self.id, self.mind, self.session, self.interrupt, self.not_before)


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


ROW_COLUMNS = (
    "id, mind, session, message, interrupt, state, attempts, not_before, created_at, "
    "held_since, hold_reason, held_ms, turn_id, folded, last_error"
)
TURN_COLUMNS = (
    "id, mind, session, unit, state, released, started_at, ended_at, outcome, exit_status, "
    "detail, pid, interrupted, deadline, timed_out_at"
)


def row_of(v: Sequence[Any]) -> Row:
    return Row(
        int(v[0]), str(v[1]), str(v[2]), bytes(v[3]), bool(v[4]), QueueState(v[5]), int(v[6]),
        v[7], float(v[8]), v[9], HoldReason(v[10]) if v[10] else None, int(v[11]), v[12],
        bool(v[13]), v[14],
    )  # fmt: skip


def turn_of(v: Sequence[Any]) -> TurnRow:
    return TurnRow(
        int(v[0]), str(v[1]), str(v[2]), str(v[3]), TurnState(v[4]), bool(v[5]), float(v[6]),
        v[7], Outcome(v[8]) if v[8] else None, v[9], v[10], v[11], bool(v[12]), v[13], v[14],
    )  # fmt: skip
