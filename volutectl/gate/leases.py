"""Leases: places in the gate's admission held by a client's connection, for turns that
a daemon runs itself (issue 31; docs/protocol.md, "acquire, release, claim, end_lease").

A lease lives as long as the connection that holds or awaits it, as a flock does:

- An `acquire` waits (not a durable row) at its place in the FIFO among the pending
  deliveries (core/admission.py's `Acquire`), held with the same reasons; admission
  grants it (`grant`) as it would start a turn. A grant commits the lease and its turn
  row (kind 'lease'), then has the launcher start the lease's scope
  (volutectl/gate/turns.py's `Turns.start_lease`): a turn scope of the turns slice,
  which the gate counts, watches and adopts as any turn's. The holder is then sent its
  `lease_granted`, with a random token.
- An acquire of a (mind, session) that a turn or a lease already holds joins it
  (`created: false`): no new place.
- `release` (the holder's, with the token), `end_lease` (an admin's), the holder's
  connection closing, the time limit, or the scope going any other way end it. The
  scope is the truth: the place is free when systemd says the scope ended
  (`turn_freed`), and every lease still open on that turn ends then, its holder told.
- Across a gate restart the scope outlives the gate and is adopted; each open lease
  waits `gate.lease_reclaim_seconds` to be claimed again (`claim`), then ends.
"""

from __future__ import annotations

import secrets
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from volutectl import events, names
from volutectl.clock import SYSTEM, Clock
from volutectl.config.reload import SettingsHolder
from volutectl.config.settings import Settings
from volutectl.core.admission import Acquire
from volutectl.errors import DataError, PermissionDeniedError, TemporaryError, VoluteError
from volutectl.faults import crash_point
from volutectl.gate.leasepids import LeasePids
from volutectl.gate.server import Client
from volutectl.gate.turns import Turn, Turns
from volutectl.states import HoldReason, LeaseEnd, LeaseState
from volutectl.store.indexed import IndexedStore
from volutectl.store.leases import LeaseRow
from volutectl.systemd.journal import Journal
from volutectl.wire import fields
from volutectl.wire.messages import (
    AcquireReply,
    ClaimReply,
    EndLeaseReply,
    LeaseEnded,
    LeaseGranted,
    LeaseStatus,
    ReleaseReply,
    Reply,
)

STOP_RETRY_SECONDS = 1.0  # an ended lease's scope the launcher could not stop: again then


@dataclass(eq=False)
class Lease:
    """A lease the gate knows: waiting, held (by `client`), or waiting for its claim."""

    id: int
    mind: str
    session: str
    uid: int
    client: Client | None  # None: granted before a restart, not yet claimed
    state: LeaseState
    since: float  # wall clock: when it arrived, or was granted
    request_id: str | None = None
    after: int = 0  # waiting: the deliveries up to this id are ahead of it
    reason: HoldReason | None = None  # waiting: why, as admission last said
    token: str | None = None
    turn_id: int | None = None
    unit: str | None = None
    created: bool = True
    reclaim_until: float | None = None  # monotonic: when an unclaimed lease ends
    pids_moved: int = 0  # how many of its processes the launcher moved into its scope

    def status(self) -> LeaseStatus:
        return LeaseStatus(
            lease=self.id,
            mind=self.mind,
            session=self.session,
            uid=self.uid,
            state=self.state,
            reason=self.reason,
            turn_id=self.turn_id,
            unit=self.unit,
            created=self.created,
            pids=self.pids_moved,
            since=self.since,
        )


class Leases:
    def __init__(
        self,
        held: SettingsHolder,
        store: IndexedStore,
        turns: Turns,
        journal: Journal,
        *,
        send: Callable[[Client, Reply], None],
        wake: Callable[[], None],
        clock: Clock = SYSTEM,
        watch_fd: Callable[[int, Callable[[int], None]], None] = lambda fd, call: None,
        unwatch_fd: Callable[[int], None] = lambda fd: None,
    ) -> None:
        self.held = held
        self.store = store
        self.turns = turns
        self.journal = journal
        self._send = send  # a reply or event to a client (the server's)
        # Events not yet sent: the loop sends them once the pass's replies are out
        # (`flush`), so that an acquire's reply always comes before its grant.
        self.outbox: list[tuple[Client, Reply]] = []
        self.wake = wake  # admission should run
        self.clock = clock
        self.leases: dict[int, Lease] = {}
        self.stopping = False  # the gate is going: its clients close, its leases stay
        self.unstopped: set[int] = set()  # scopes of ended leases whose stop failed
        self.stop_retry: float | None = None  # monotonic: when to try those again
        self.next_id = store.leases.last_id() + 1
        turns.on_freed = self.turn_freed
        # The pidfds of leases that move processes (volutectl/gate/leasepids.py).
        self.pids = LeasePids(journal, watch_fd, unwatch_fd, self._pids_exited)

    @property
    def settings(self) -> Settings:
        return self.held.current

    def send(self, client: Client, event: Reply) -> None:
        self.outbox.append((client, event))

    def flush(self) -> None:
        """Send the events of the pass, in order, to the clients still there."""
        out, self.outbox = self.outbox, []
        for client, event in out:
            if not client.closed:
                self._send(client, event)
                if isinstance(event, LeaseGranted):
                    crash_point("lease_replied")

    # -- what admission sees -------------------------------------------------------------

    def waiting(self) -> list[Acquire]:
        return [
            Acquire(lease.id, lease.mind, lease.session, lease.after)
            for lease in self.leases.values()
            if lease.state is LeaseState.WAITING
        ]

    def held_by(self, reasons: list[tuple[int, HoldReason]]) -> None:
        """Admission's reasons for the acquires that still wait."""
        for lease_id, reason in reasons:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.state is LeaseState.WAITING:
                if lease.reason is None or lease.reason != reason:
                    self.journal.emit(
                        events.LeaseHeld(
                            lease=lease.id,
                            mind=lease.mind,
                            session=lease.session,
                            uid=lease.uid,
                            reason=reason,
                        )
                    )
                lease.reason = reason

    def status(self) -> tuple[LeaseStatus, ...]:
        return tuple(lease.status() for lease in sorted(self.leases.values(), key=lambda x: x.id))

    # -- acquire ----------------------------------------------------------------------------

    def acquire(
        self,
        mind: str,
        session: str,
        request_id: str | None,
        uid: int,
        client: Client,
        pidfds: tuple[int, ...] = (),
    ) -> AcquireReply:
        """Take an acquire: the same lease again for a request id seen before, a joined
        grant for a (mind, session) a turn or lease holds, else a wait for admission.
        `pidfds` (checked by the handler, the request's: copies are kept) move into a
        lease that creates its scope; a repeated or joined acquire moves none."""
        if request_id is not None:
            again = self._by_request_id(uid, request_id)
            if again is not None:
                return self._again(again, client)
        bound = self.settings.gate.max_leases_per_uid
        if uid != 0 and sum(1 for x in self.leases.values() if x.uid == uid) >= bound:
            raise TemporaryError(
                f"uid {uid} holds or awaits {bound} leases, its most (gate.max_leases_per_uid)",
                hint="release a lease first",
            )
        lease = Lease(
            id=self.next_id,
            mind=mind,
            session=session,
            uid=uid,
            client=client,
            state=LeaseState.WAITING,
            since=self.clock.wall(),
            request_id=request_id,
            after=self.store.leases.next_delivery_id() - 1,
        )
        self.next_id += 1
        self.leases[lease.id] = lease
        client.leases.add(lease.id)
        running = self._running(mind, session)
        if running is not None:
            self._join(lease, running)
            return AcquireReply(lease.id, "granted")
        self.pids.keep(lease.id, pidfds)
        self.wake()
        return AcquireReply(lease.id, "waiting")

    def _by_request_id(self, uid: int, request_id: str) -> Lease | None:
        for lease in self.leases.values():
            if lease.uid == uid and lease.request_id == request_id:
                return lease
        return None

    def _again(self, lease: Lease, client: Client) -> AcquireReply:
        """A repeated acquire (the same uid and request id): the same lease, bound to this
        connection if its own has gone; a granted one's grant is sent again."""
        if lease.client is not None and not lease.client.closed and lease.client is not client:
            raise DataError(
                f"request_id: lease {lease.id} of this request id is held by a live connection"
            )
        self._bind(lease, client)
        if lease.state is LeaseState.WAITING:
            return AcquireReply(lease.id, "waiting", lease.reason, already=True)
        lease.state = LeaseState.HELD
        lease.reclaim_until = None
        self._tell_granted(lease)
        return AcquireReply(lease.id, "granted", already=True)

    def _bind(self, lease: Lease, client: Client) -> None:
        if lease.client is not None:
            lease.client.leases.discard(lease.id)
        lease.client = client
        client.leases.add(lease.id)

    def _running(self, mind: str, session: str) -> Turn | None:
        """The oldest turn or lease's scope the gate holds for (mind, session) that is not
        being stopped, if any: one whose lease ended waits to be freed, and an acquire
        then waits for it (`mind_busy`) rather than join what is going."""
        for turn in self.turns.all():
            going = turn.lease_end is not None or turn.timed_out_at is not None
            if (turn.mind, turn.session) == (mind, session) and not going:
                return turn
        return None

    # -- grants ---------------------------------------------------------------------------

    def grant(self, lease_id: int, now: float) -> None:
        """Admission let waiting acquire `lease_id` take a place: join a turn of its
        session if one started meanwhile, else commit it and start its scope."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is not LeaseState.WAITING:
            return
        running = self._running(lease.mind, lease.session)
        if running is not None:
            self.pids.drop(lease.id)  # a join moves nothing
            self._join(lease, running)
            return
        lease.token = secrets.token_hex(fields.TOKEN_LENGTH // 2)
        max_runtime = self.settings.max_runtime(lease.mind)
        turn_id = self.store.leases.grant(
            self._row(lease, turn_id=0, created=True, now=now),
            unit_for=lambda tid: names.turn_scope_name(lease.mind, tid),
            deadline=now + max_runtime if max_runtime else None,
        )
        crash_point("lease_committed")
        lease.turn_id, lease.created, lease.since = turn_id, True, now
        lease.unit = names.turn_scope_name(lease.mind, turn_id)
        lease.state, lease.reason = LeaseState.HELD, None
        turn = self.turns.start_lease(turn_id, lease.mind, lease.session, now)
        if not self.turns.holds(turn):
            return  # its start failed: turn_freed has ended it and told its holder
        lease.pids_moved = self.pids.move_in(self.turns.hands, lease.id, turn_id, lease.mind)
        crash_point("lease_pids_moved")
        self._tell_granted(lease)  # sent by `flush`, after the pass's replies

    def _row(self, lease: Lease, *, turn_id: int, created: bool, now: float) -> LeaseRow:
        assert lease.token is not None
        return LeaseRow(
            id=lease.id,
            turn_id=turn_id,
            mind=lease.mind,
            session=lease.session,
            uid=lease.uid,
            token=lease.token,
            request_id=lease.request_id,
            created=created,
            granted_at=now,
        )

    def _join(self, lease: Lease, turn: Turn) -> None:
        """Grant `lease` on a running turn of its session: no new place, nothing moved."""
        now = self.clock.wall()
        lease.token = secrets.token_hex(fields.TOKEN_LENGTH // 2)
        self.store.leases.grant(
            self._row(lease, turn_id=turn.id, created=False, now=now), unit_for=None
        )
        lease.turn_id, lease.unit, lease.created = turn.id, turn.unit, False
        lease.state, lease.reason, lease.since = LeaseState.HELD, None, now
        self._tell_granted(lease)

    def _tell_granted(self, lease: Lease) -> None:
        assert lease.token is not None and lease.turn_id is not None and lease.unit is not None
        if lease.client is not None:
            self.send(
                lease.client,
                LeaseGranted(
                    lease.id,
                    lease.token,
                    lease.unit,
                    lease.turn_id,
                    lease.created,
                    lease.pids_moved,
                ),
            )
        self.journal.emit(
            events.LeaseGranted(
                lease=lease.id,
                mind=lease.mind,
                session=lease.session,
                uid=lease.uid,
                turn_id=lease.turn_id,
                unit=lease.unit,
                created=lease.created,
            )
        )

    # -- ends ---------------------------------------------------------------------------

    def release(self, lease_id: int, token: str, uid: int) -> ReleaseReply:
        lease = self._checked(lease_id, token, uid)
        self._end(lease, LeaseEnd.RELEASED, tell=False)
        return ReleaseReply(lease_id)

    def end_by_admin(self, lease_id: int) -> EndLeaseReply:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise DataError(f"lease: no lease {lease_id} is waiting or held")
        self._end(lease, LeaseEnd.ENDED_BY_ADMIN, tell=True)
        return EndLeaseReply(lease_id)

    def claim(self, lease_id: int, token: str, uid: int, client: Client) -> ClaimReply:
        lease = self._checked(lease_id, token, uid)
        if lease.client is not None and not lease.client.closed and lease.client is not client:
            raise DataError(f"lease: lease {lease_id} is held by a live connection")
        if lease.state is LeaseState.WAITING:
            raise DataError(f"lease: lease {lease_id} is not granted yet")
        self._bind(lease, client)
        lease.state, lease.reclaim_until = LeaseState.HELD, None
        assert lease.unit is not None and lease.turn_id is not None
        self.journal.emit(
            events.LeaseClaimed(lease=lease.id, mind=lease.mind, session=lease.session, uid=uid)
        )
        return ClaimReply(lease.id, lease.unit, lease.turn_id)

    def _checked(self, lease_id: int, token: str, uid: int) -> Lease:
        """The lease, if `uid` (or root) holds it with `token`; else the refusal."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.token is None:
            raise DataError(f"lease: no lease {lease_id} is held (it ended, or never was)")
        if uid != 0 and uid != lease.uid:
            raise PermissionDeniedError(
                f"lease: lease {lease_id} is another user's",
                hint="only the uid it was granted to, or root, may release or claim it",
            )
        if not secrets.compare_digest(token, lease.token):
            raise PermissionDeniedError(
                f"token: not lease {lease_id}'s token",
                hint="the token is the one its lease_granted event gave",
            )
        return lease

    def client_closed(self, client: Client) -> None:
        """A connection closed: its waiting acquires go, its held leases end (unless the
        gate is stopping: then they wait for their claim in the next gate)."""
        if self.stopping:
            return
        for lease_id in sorted(client.leases):
            lease = self.leases.get(lease_id)
            if lease is not None and lease.client is client:
                self._end(lease, LeaseEnd.CLOSED, tell=False)
        client.leases.clear()

    def _end(self, lease: Lease, reason: LeaseEnd, *, tell: bool) -> None:
        """End one lease now: forget it, record it, and, if it created its turn, stop the
        scope (its place is free once systemd says the scope ended), its processes moved
        back first."""
        self._forget(lease, reason, tell=tell)
        if lease.state is LeaseState.WAITING or lease.turn_id is None:
            self.wake()
            return
        try:
            self.store.leases.end([lease.id], reason, self.clock.wall())
        except sqlite3.Error as error:
            self.journal.emit(
                events.HandlingFailed(what=f"ending lease {lease.id}", error=str(error))
            )
        turn = self.turns.get(lease.turn_id)
        if lease.created and turn is not None and turn.lease:
            turn.lease_end = turn.lease_end or reason
            self._stop(turn)

    def _stop(self, turn: Turn) -> None:
        """Stop an ended lease's scope; one the launcher could not stop now is tried
        again at each admission pass (`stop_owed`) until it stops or is gone."""
        self.turns.move_back(turn.id, turn.mind)  # its processes live on: never stopped
        try:
            self.turns.hands.stop(turn.id, turn.mind)
        except VoluteError as error:
            if turn.id not in self.unstopped:
                self.journal.emit(events.ScopeStopFailed(unit=turn.unit, error=error.message))
            self.unstopped.add(turn.id)
            self.stop_retry = self.clock.monotonic() + STOP_RETRY_SECONDS
        else:
            self.unstopped.discard(turn.id)

    def stop_owed(self) -> None:
        """Try again the stops that failed (the launcher was away)."""
        self.stop_retry = None
        for turn_id in sorted(self.unstopped):
            turn = self.turns.get(turn_id)
            if turn is None:
                self.unstopped.discard(turn_id)
            else:
                self._stop(turn)

    def _pids_exited(self, lease_id: int) -> None:
        """Every process the lease moved in has exited: the lease ends (its holder told)."""
        lease = self.leases.get(lease_id)
        if lease is not None and lease.state is not LeaseState.WAITING:
            self._end(lease, LeaseEnd.PIDS_EXITED, tell=True)

    def turn_freed(self, turn: Turn) -> None:
        """A turn's scope freed its place (`Turns.on_freed`): every lease still open on it
        (its creator's, the joined ones) ends, its holder told why."""
        if not turn.lease and not any(x.turn_id == turn.id for x in self.leases.values()):
            return  # a command turn no lease joined: nothing of ours
        if turn.lease_end is LeaseEnd.START_FAILED:
            reason = LeaseEnd.START_FAILED
        elif turn.timed_out_at is not None:
            reason = LeaseEnd.TIMEOUT
        elif turn.lease_end is not None:
            reason = LeaseEnd.CREATOR_RELEASED
        else:
            reason = LeaseEnd.SCOPE_GONE
        now = self.clock.wall()
        try:
            self.store.leases.end_turn(turn.id, reason, now)
        except sqlite3.Error as error:
            self.journal.emit(
                events.HandlingFailed(what=f"ending turn {turn.id}'s leases", error=str(error))
            )
        for lease in [x for x in self.leases.values() if x.turn_id == turn.id]:
            own = (
                LeaseEnd.SCOPE_GONE
                if reason is LeaseEnd.CREATOR_RELEASED and lease.created
                else reason
            )
            self._end_quietly(lease, own)
        self.wake()

    def _end_quietly(self, lease: Lease, reason: LeaseEnd) -> None:
        """Its turn ended: forget it, tell its holder (the store knows already)."""
        self._forget(lease, reason, tell=True)

    def _forget(self, lease: Lease, reason: LeaseEnd, *, tell: bool) -> None:
        """Drop an ended lease from memory and its pids' watch, tell its holder if
        `tell`, and journal its end (the one LeaseEnded of either way a lease ends)."""
        del self.leases[lease.id]
        self.pids.drop(lease.id)
        if lease.client is not None:
            lease.client.leases.discard(lease.id)
            if tell:
                self.send(lease.client, LeaseEnded(lease.id, reason))
        self.journal.emit(
            events.LeaseEnded(
                lease=lease.id,
                mind=lease.mind,
                session=lease.session,
                uid=lease.uid,
                turn_id=lease.turn_id,
                reason=reason,
            )
        )

    # -- across a restart -----------------------------------------------------------------

    def recover(self) -> None:
        """At the gate's start, after the turns were taken back: each open lease whose
        turn the gate holds waits for its claim; any other ends now."""
        until = self.clock.monotonic() + self.settings.gate.lease_reclaim_seconds
        for row in self.store.leases.open():
            turn = self.turns.get(row.turn_id)
            if turn is None:
                self.store.leases.end([row.id], LeaseEnd.SCOPE_GONE, self.clock.wall())
                continue
            self.leases[row.id] = Lease(
                id=row.id,
                mind=row.mind,
                session=row.session,
                uid=row.uid,
                client=None,
                state=LeaseState.RECLAIM,
                since=row.granted_at,
                request_id=row.request_id,
                token=row.token,
                turn_id=row.turn_id,
                unit=turn.unit,
                created=row.created,
                reclaim_until=until,
            )
            self.next_id = max(self.next_id, row.id + 1)
        for turn in self.turns.all():
            if turn.lease and not any(x.turn_id == turn.id for x in self.leases.values()):
                turn.lease_end = LeaseEnd.RECLAIM_EXPIRED  # no lease holds it: stop it
                self._stop(turn)

    def deadline(self) -> float | None:
        """The next reclaim window's end, or a failed stop's retry (monotonic)."""
        times = [x.reclaim_until for x in self.leases.values() if x.reclaim_until is not None]
        if self.stop_retry is not None:
            times.append(self.stop_retry)
        return min(times, default=None)

    def on_deadline(self, now: float) -> None:
        if self.stop_retry is not None and now >= self.stop_retry:
            self.stop_owed()
        for lease in list(self.leases.values()):
            if lease.reclaim_until is not None and now >= lease.reclaim_until:
                self._end(lease, LeaseEnd.RECLAIM_EXPIRED, tell=False)
