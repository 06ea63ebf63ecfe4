"""Answering the requests of one pass of the loop, each client's in the order it sent them.

Each request goes to its handler (volutectl/gate/handlers.py). Those whose handler
answers a pass's requests together (handlers.TOGETHER: deliveries, which share one
durable commit) are gathered, and answered before the next request of another kind, so
that it sees what came before it. A reply is then sent (volutectl/gate/server.py), or,
where handlers.keeps says so (a wait, a `deliver --wait`), sent and the client kept for
the outcome (volutectl/gate/outcomes.py). A failure that is a bug ends the clients it
met, never the loop.

A pass has its time (volutectl/gate/loop.py): past its deadline no further request is
begun, and those not begun wait in `left`, answered first in the next pass (each
client's still in its order), so that costly requests one after another (a `queue` of
10,000 rows takes most of a second) cannot hold the loop.

The deliveries' commit has no fsync of its own: their replies, and whatever their
clients are answered after them, are held (`held`) until the pass's first durable
commit, the turns it starts (volutectl/gate/turns.py calls `release`) or the loop's
sync before it sleeps, so that a pass pays one fsync, not two. A sync that fails
acknowledges none: their clients are dropped, to send their request ids again.

Each durable commit of deliveries is remembered (`last_commit`): when it ended, how
long its fsync took, and whose deliveries it held, from which the loop decides how long
the next deliveries gather before theirs (`gather_until`).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

from volutectl import events
from volutectl.gate import handlers
from volutectl.gate.handlers import Caller
from volutectl.gate.outcomes import Waiters
from volutectl.gate.server import Client, Incoming, Server
from volutectl.gate.state import GateState
from volutectl.wire.messages import (
    DeliverManyRequest,
    DeliverRequest,
    ErrorReply,
    Reply,
    Request,
)

# Deliveries that keep coming from other clients gather after a commit of deliveries
# before the next one: GATHER_SHARE times as long as such a commit takes (the slowest
# of the last GATHER_SEEN: on the SD card's throttle one commit waits 25-35 ms for the
# card and the next may find it free and take 1 ms), at most GATHER_MAX seconds. So in
# a burst the deliveries' fsyncs hold the disk a quarter of the time at most, and the
# rest is the turns' and the host's; each fsync is shared by what came meanwhile
# (PostgreSQL's commit_delay, which waits only while commit_siblings other
# transactions are active). A disk whose commit takes a millisecond waits 3 ms; the SD
# card 0.1 s. There, a fan-out of 33 `deliver` at once no longer makes the probe wait
# as its turns start (docs/benchmarks.md, "Deliveries that keep coming share
# commits"). A client whose own delivery was in the last commit, alone, does not wait:
# one delivering one after another has nothing to share a commit with.
GATHER_SHARE = 3.0
GATHER_MAX = 0.25
GATHER_SEEN = 4


@dataclass(frozen=True)
class Commit:
    """A commit of deliveries: when it ended (monotonic), how long such a commit takes
    (the slowest of the last GATHER_SEEN), and the clients (by fd) whose deliveries
    it held."""

    ended: float
    seconds: float
    clients: frozenset[int]

    def gather_until(self, waiting: set[int] | frozenset[int]) -> float | None:
        """Until when the requests of the clients `waiting` (by fd) gather before they
        are served; None: serve them now (nobody but this commit's clients waits)."""
        if not waiting or waiting <= self.clients:
            return None
        return self.ended + min(GATHER_MAX, GATHER_SHARE * self.seconds)


class Serving:
    def __init__(self, state: GateState, server: Server, waiters: Waiters) -> None:
        self.state = state
        self.server = server
        self.waiters = waiters
        self.left: list[Incoming] = []  # taken, not begun: the pass's time was up
        self.last_commit: Commit | None = None  # the last commit of deliveries
        # How long the last GATHER_SEEN commits of deliveries took.
        self.commit_seconds: deque[float] = deque(maxlen=GATHER_SEEN)
        # Replies that wait for the pass's durable commit (`release`), in the order they
        # would have been sent: a delivery's acknowledgement, and whatever its client was
        # answered after it in the pass. `delivering`: the clients whose deliveries they
        # are, by id() (`held` keeps each alive, so no id is reused meanwhile).
        self.held: list[tuple[Client, Request[Reply] | ErrorReply, Reply]] = []
        self.delivering: dict[int, Client] = {}

    def serve(self, incoming: list[Incoming], deadline: float | None = None) -> int:
        """Answer the requests, each client's in its order: every one, or those begun
        before the (monotonic) deadline, the rest left in `left`. How many answered."""
        replies: list[Reply | None] = [None] * len(incoming)
        batch: list[int] = []  # indexes of requests answered together, not yet answered
        for index, (client, request) in enumerate(incoming):
            if index and deadline is not None and self.state.clock.monotonic() >= deadline:
                self.left, incoming, replies = incoming[index:], incoming[:index], replies[:index]
                break
            if isinstance(request, ErrorReply):
                replies[index] = request
            elif client.closed:
                continue
            elif type(request) in handlers.TOGETHER:
                batch.append(index)
            else:
                self._commit(incoming, batch, replies)
                replies[index] = self._handle(client, request)
        self._commit(incoming, batch, replies)
        for (client, request), reply in zip(incoming, replies, strict=True):
            if reply is None or client.closed:
                continue
            if id(client) in self.delivering:
                self.held.append((client, request, reply))
            else:
                self._send(client, request, reply)
        return len(incoming)

    def release(self) -> None:
        """Send the replies held for the pass's durable commit, each client's in order,
        once the store has synced (the commit of the turns the pass started, or the
        loop's `sync`): one fsync for a pass's deliveries and starts, where each paid its
        own (issue 32: on the SD card the pairs were most of a fan-out's first writes).

        If the store could not sync (the disk failed it), no delivery of theirs is
        acknowledged: their clients are dropped unanswered, as if the gate had died
        after the commit. Each retries with its request id, and gets the same delivery
        back once a sync succeeds (the row is in the WAL: the gate runs it either way)."""
        if not self.held:
            return
        held, delivering = self.held, self.delivering
        self.held, self.delivering = [], {}
        if self.state.store.sync_pending():
            clients = {id(client): client for client, _, _ in held}
            self.state.journal.emit(
                events.DeliveriesNotSynced(
                    count=sum(_deliveries(request) for _, request, _ in held),
                    clients=len(clients),
                )
            )
            for client in clients.values():
                self.server.drop(client)
            return
        self.commit_seconds.append(self.state.store.sync_seconds)
        self.last_commit = Commit(
            self.state.clock.monotonic(),
            max(self.commit_seconds),
            frozenset(client.fd for client in delivering.values()),
        )
        for client, request, reply in held:
            if not client.closed:
                self._send(client, request, reply)

    def _send(self, client: Client, request: Request[Reply] | ErrorReply, reply: Reply) -> None:
        """Send the reply; a client that asked to wait is kept for the outcome."""
        keep = None if isinstance(request, ErrorReply) else handlers.keeps(request, reply)
        if keep is not None:
            self.waiters.wait(client, keep.ids, reply, look=keep.look, progress=keep.progress)
        else:
            self.server.reply(client, reply)

    def _commit(
        self,
        incoming: list[Incoming],
        batch: list[int],
        replies: list[Reply | None],
    ) -> None:
        """Answer the requests gathered (deliveries: one commit for all), in place."""
        if not batch:
            return
        clients = [incoming[index][0] for index in batch]
        began = self.state.clock.monotonic()
        answered = self._together(
            clients,
            [request for index in batch if isinstance(request := incoming[index][1], Request)],
        )
        if self.state.store.sync_pending():
            # Not durable yet: acknowledged after the pass's fsync (`release`).
            self.delivering |= {id(client): client for client in clients}
        else:  # nothing new was stored (refusals, retries of what is durable already)
            ended = self.state.clock.monotonic()
            self.commit_seconds.append(ended - began)
            slowest = max(self.commit_seconds)
            self.last_commit = Commit(ended, slowest, frozenset(c.fd for c in clients))
        for index, reply in zip(batch, answered, strict=True):
            replies[index] = reply
        batch.clear()

    def _handle(self, client: Client, request: Request[Reply]) -> Reply | None:
        # Descriptors that came with the request (register_repo's one, an acquire's
        # pidfds): the handler dups what it keeps, and they are closed here whatever
        # happens.
        passed = self.server.take_passed(client, request)
        caller = Caller(
            client.peer_uid(),
            descriptor=passed[0] if passed else None,
            client=client,
            descriptors=passed,
        )
        try:
            return handlers.handle(self.state, request, caller)
        except Exception as error:  # noqa: BLE001 - a bug: it ends this client only
            self.server.client_failed(client, f"handling a {request.OP} request", error)
            return None
        finally:
            for fd in passed:
                os.close(fd)

    def _together(self, clients: list[Client], batch: list[Request[Reply]]) -> list[Reply | None]:
        try:
            callers = [Caller(client.peer_uid()) for client in clients]
            return list(handlers.handle_together(self.state, batch, callers))
        except Exception as error:  # noqa: BLE001 - nothing was stored: end these clients
            for client in clients:
                self.server.client_failed(client, "storing deliveries", error)
            return [None] * len(batch)


def _deliveries(request: Request[Reply] | ErrorReply) -> int:
    """How many deliveries a request asked for (a deliver of one, or of items)."""
    if isinstance(request, DeliverManyRequest):
        return len(request.items)
    return 1 if isinstance(request, DeliverRequest) else 0
