"""Answering the requests of one pass of the loop, each client's in the order it sent them.

Deliveries that came together share one durable commit (handlers.accept_deliveries);
a request after them waits for that commit first, so that it sees what came before it.
Every other request goes to its handler (volutectl/gate/handlers.py). A reply is then
sent (volutectl/gate/server.py), or, for a wait or a `deliver --wait`, sent and the
client kept for the outcome (volutectl/gate/outcomes.py). A failure that is a bug ends
the clients it met, never the loop.

A pass has its time (volutectl/gate/loop.py): past its deadline no further request is
begun, and those not begun wait in `left`, answered first in the next pass (each
client's still in its order), so that costly requests one after another (a `queue` of
10,000 rows takes most of a second) cannot hold the loop.
"""

from __future__ import annotations

import os

from volutectl.gate import handlers
from volutectl.gate.handlers import Caller
from volutectl.gate.outcomes import Waiters
from volutectl.gate.server import Client, Incoming, Server
from volutectl.gate.state import GateState
from volutectl.wire.messages import (
    DeliverAck,
    DeliverRequest,
    ErrorReply,
    Reply,
    Request,
    WaitReply,
    WaitRequest,
)


class Serving:
    def __init__(self, state: GateState, server: Server, waiters: Waiters) -> None:
        self.state = state
        self.server = server
        self.waiters = waiters
        self.left: list[Incoming] = []  # taken, not begun: the pass's time was up

    def serve(self, incoming: list[Incoming], deadline: float | None = None) -> int:
        """Answer the requests, each client's in its order: every one, or those begun
        before the (monotonic) deadline, the rest left in `left`. How many answered."""
        replies: list[Reply | None] = [None] * len(incoming)
        batch: list[int] = []  # indexes of deliveries not yet committed
        for index, (client, request) in enumerate(incoming):
            if index and deadline is not None and self.state.clock.monotonic() >= deadline:
                self.left, incoming, replies = incoming[index:], incoming[:index], replies[:index]
                break
            if isinstance(request, ErrorReply):
                replies[index] = request
            elif client.closed:
                continue
            elif isinstance(request, DeliverRequest):
                batch.append(index)
            else:
                self._commit(incoming, batch, replies)
                replies[index] = self._handle(client, request)
        self._commit(incoming, batch, replies)
        for (client, request), reply in zip(incoming, replies, strict=True):
            if reply is not None and not client.closed:
                self._send(client, request, reply)
        return len(incoming)

    def _send(self, client: Client, request: Request[Reply] | ErrorReply, reply: Reply) -> None:
        """Send the reply; a client that asked to wait is kept for the outcome."""
        if isinstance(request, DeliverRequest) and request.wait and isinstance(reply, DeliverAck):
            # A retried request's delivery may have run already: look, then.
            look = request.request_id is not None or reply.already_queued
            self.waiters.wait(client, (reply.id,), reply, look=look, progress=request.progress)
        elif isinstance(reply, WaitReply) and isinstance(request, WaitRequest):
            self.waiters.wait(client, reply.ids, reply, look=True, progress=request.progress)
        else:
            self.server.reply(client, reply)

    def _commit(
        self,
        incoming: list[Incoming],
        batch: list[int],
        replies: list[Reply | None],
    ) -> None:
        """Commit the pending deliveries (one commit for all), their replies in place."""
        if not batch:
            return
        requests = [incoming[index][1] for index in batch]
        acks = self._deliver(
            [incoming[index][0] for index in batch],
            [request for request in requests if isinstance(request, DeliverRequest)],
        )
        for index, ack in zip(batch, acks, strict=True):
            replies[index] = ack
        batch.clear()

    def _handle(self, client: Client, request: Request[Reply]) -> Reply | None:
        # A descriptor that came with the request (register_repo's): the handler dups
        # what it keeps, and it is closed here whatever happens.
        passed = self.server.take_passed(client, request)
        try:
            return handlers.handle(
                self.state, request, Caller(client.peer_uid(), descriptor=passed)
            )
        except Exception as error:  # noqa: BLE001 - a bug: it ends this client only
            self.server.client_failed(client, f"handling a {request.OP} request", error)
            return None
        finally:
            if passed is not None:
                os.close(passed)

    def _deliver(self, clients: list[Client], batch: list[DeliverRequest]) -> list[Reply | None]:
        try:
            callers = [Caller(client.peer_uid()) for client in clients]
            return list(handlers.accept_deliveries(self.state, batch, callers))
        except Exception as error:  # noqa: BLE001 - nothing was stored: end these clients
            for client in clients:
                self.server.client_failed(client, "storing deliveries", error)
            return [None] * len(batch)
