"""Waiting for a delivery's outcome: who waits for what, and what each is told.

A client waits for deliveries (`deliver --wait`, or a `wait` request): `Waiters` keeps
it for them, and tells it of each once it settles (done, dead or dropped). What it is
told is built in one place, `Settled.event` (and `Settled.progress`, for a client that
asked to hear of each failed attempt too): live, as a turn settles its deliveries
(volutectl/gate/turns.py) or a drop removes one (volutectl/gate/handlers.py), and on
replay, from the store (`stored`), for a wait that comes after its delivery settled
(a retried `deliver --wait` whose delivery ran before the retry arrived, or a `wait`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from volutectl.core import admission
from volutectl.states import Outcome, QueueState
from volutectl.wire.messages import (
    AttemptFailed,
    DeliveryDead,
    DeliveryDropped,
    Event,
    Reply,
    TurnEnded,
)

if TYPE_CHECKING:
    from volutectl.gate.server import Client, Server
    from volutectl.store.queue import Store


@dataclass(frozen=True, kw_only=True)
class Settled:
    """Where a delivery is now, with what its waiters are told of it."""

    delivery_id: int
    state: QueueState  # done, dead or dropped: settled; pending or running: not yet
    error: str | None = None  # why it is dead
    turn_id: int | None = None  # the turn that carried it, or ran its last attempt
    outcome: Outcome | None = None  # that turn's
    exit_status: int | None = None  # that turn's
    # A failed attempt that will be tried again (state pending): what it counted.
    attempts: int = 0
    max_attempts: int = 0
    not_before: float | None = None

    def progress(self) -> AttemptFailed | None:
        """What a client that asked for progress is told of a failed attempt that will be
        tried again; None for anything else."""
        if self.state is not QueueState.PENDING or self.not_before is None:
            return None
        ran = self.outcome is not None and self.outcome is not Outcome.START_FAILED
        return AttemptFailed(
            id=self.delivery_id,
            error=self.error or "failed",
            attempt=self.attempts,
            max_attempts=self.max_attempts,
            next_try_at=self.not_before,
            turn_id=self.turn_id if ran else None,
            outcome=self.outcome,
            exit_status=self.exit_status if ran else None,
        )

    def event(self) -> Event | None:
        """What a waiting client is told of it; None while it has not settled (a failed
        attempt that will be tried again tells nothing yet)."""
        if self.state is QueueState.DROPPED:
            return DeliveryDropped(self.delivery_id)
        code = admission.wait_exit_code(self.exit_status, self.outcome or Outcome.FAILED)
        if self.state is QueueState.DONE:
            return TurnEnded(
                id=self.delivery_id,
                turn_id=self.turn_id or 0,
                outcome=self.outcome or Outcome.OK,
                exit_status=self.exit_status,
                exit_code=code,
            )
        if self.state is not QueueState.DEAD:
            return None
        # Its last attempt ran a turn (one that failed to start ran nothing).
        ran = self.outcome is not None and self.outcome is not Outcome.START_FAILED
        return DeliveryDead(
            id=self.delivery_id,
            error=self.error or "dead",
            exit_code=code if ran else 1,
            turn_id=self.turn_id if ran else None,
            outcome=self.outcome if ran else None,
        )


def stored(store: Store, delivery_id: int) -> Settled | None:
    """Where the delivery is, as the store has it (None: no such delivery)."""
    found = store.rows([delivery_id], with_message=False)
    if not found:
        return None
    row = found[0]
    turn = store.turn(row.turn_id) if row.turn_id is not None else None
    return Settled(
        delivery_id=row.id,
        state=row.state,
        error=row.last_error,
        turn_id=row.turn_id,
        outcome=turn.outcome if turn is not None else None,
        exit_status=turn.exit_status if turn is not None else None,
    )


class Waiters:
    """The clients that wait for deliveries' outcomes, by delivery id. A client that
    waits has no idle clock, and one that has sent its last request stays until it has
    been told (volutectl/gate/server.py); once the server drops it, it is forgotten."""

    def __init__(self, server: Server, store: Store) -> None:
        self.server = server
        self.store = store
        self.by_delivery: dict[int, list[Client]] = {}
        server.on_drop = self.forget

    def wait(
        self,
        client: Client,
        ids: tuple[int, ...],
        reply: Reply,
        *,
        look: bool,
        progress: bool = False,
    ) -> None:
        """Keep `client` for the events of `ids`, after `reply`; with `look`, tell at
        once of those that have settled already; with `progress`, tell it of each failed
        attempt too (a wait asked with progress on the connection keeps it)."""
        client.progress = client.progress or progress
        for delivery_id in ids:
            client.waiting.add(delivery_id)
            self.by_delivery.setdefault(delivery_id, []).append(client)
        self.server.stop_idle_clock(client)
        self.server.reply(client, reply)
        for delivery_id in ids if look else ():
            settled = stored(self.store, delivery_id)
            if settled is not None:
                self.tell(settled)

    def tell(self, settled: Settled) -> None:
        """Tell the delivery's waiters how it settled, if it has; they wait no more. A
        failed attempt that will be tried again is told to those that asked for progress,
        and they wait on."""
        event = settled.event()
        if event is None:
            attempt = settled.progress()
            if attempt is None:
                return
            for client in self.by_delivery.get(settled.delivery_id, []):
                if client.progress:
                    self.server.reply(client, attempt)
            return
        for client in self.by_delivery.pop(settled.delivery_id, []):
            client.waiting.discard(settled.delivery_id)
            self.server.reply(client, event)
            if client.eof and not client.waiting and not client.outbox:
                self.server.drop(client)

    def forget(self, client: Client) -> None:
        """A client the server dropped waits no more."""
        for delivery_id in client.waiting:
            waiting = self.by_delivery.get(delivery_id, [])
            if client in waiting:
                waiting.remove(client)
            if not waiting:
                self.by_delivery.pop(delivery_id, None)
