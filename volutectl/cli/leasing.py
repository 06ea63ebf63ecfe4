"""A lease's connection to the gate: acquire and wait for the grant, hear what the gate
tells the holder, claim the lease again after a gate restart, release it.

docs/protocol.md's `acquire`, `release`, `claim` and `end_lease`. A lease lives as long
as the connection that holds it (closing it is a release), so this keeps one open from
the acquire to the release. A gate restart closes it: the lease's scope outlives the
gate, and the holder has `gate.lease_reclaim_seconds` to `claim` it on a new
connection, by its id and token; a lease still waiting is asked for again, with the same
request id (the gate answers the same lease). `volutectl lease`
(volutectl/cli/lease.py) drives it. Every text the gate sends is shown through
volutectl/visible.py, never obeyed.
"""

from __future__ import annotations

import select
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from volutectl.errors import EX_DATAERR, EX_TEMPFAIL, EX_USAGE, UnavailableError, VoluteError
from volutectl.visible import visible
from volutectl.wire import protocol
from volutectl.wire.messages import (
    AcquireReply,
    AcquireRequest,
    ClaimReply,
    ClaimRequest,
    EndLeaseReply,
    EndLeaseRequest,
    ErrorReply,
    LeaseEnded,
    LeaseGranted,
    ReleaseReply,
    ReleaseRequest,
    Reply,
    StatusReply,
    StatusRequest,
)
from volutectl.wire.records import WireError

R = TypeVar("R", bound=Reply)
# While a lease waits: the first look at its hold reason (`status`: the acquire's reply
# comes before admission has looked), then a look this often; a change is said.
FIRST_LOOK_SECONDS = 0.5
LOOK_EVERY_SECONDS = 5.0

TOO_OLD = "the gate is too old for leases (upgrade volutectl on the host)"
TOO_OLD_HINT = "this gate answered the lease's request as an unknown operation"
# What each reason of `lease_ended` means, for people; the reason itself is shown too.
ENDED_WHY = {
    "timeout": "it reached the mind's max_runtime_seconds",
    "ended_by_admin": "an admin ended it (volutectl lease --end)",
    "pids_exited": "every process it held exited",
    "scope_gone": "its scope was stopped",
    "creator_released": "the lease whose turn it joined was released",
    "reclaim_expired": "it was not claimed in time after a gate restart",
    "start_failed": "its scope could not be started",
}


class LeaseGone(Exception):
    """The gate ended the lease (a `lease_ended` event, or a claim that came too late)."""

    def __init__(self, lease: int, reason: str) -> None:
        super().__init__(f"lease {lease} ended: {reason}")
        self.lease = lease
        self.reason = reason

    def words(self) -> str:
        """`lease 7 ended (timeout: it reached the mind's max_runtime_seconds)`."""
        why = ENDED_WHY.get(self.reason)
        reason = visible(self.reason)
        return (
            f"lease {self.lease} ended ({reason}: {why})"
            if why
            else f"lease {self.lease} ended ({reason})"
        )


def _refusal(obj: dict[str, Any], too_old: bool) -> VoluteError:
    """The gate's refusal as an error; 64 (an unknown op) from a gate before leases."""
    error = ErrorReply.from_wire(obj)
    if too_old and error.code == EX_USAGE:
        return VoluteError(TOO_OLD, hint=f"{TOO_OLD_HINT}: {error.error}", exit_code=EX_USAGE)
    try:
        error.raise_it()
    except VoluteError as raised:
        return raised
    raise AssertionError("raise_it raises")  # pragma: no cover


def answer(obj: dict[str, Any], cls: type[R], *, too_old: bool = True) -> R:
    """A reply line as `cls`, or the refusal it carries raised."""
    if obj.get("ok") is False:
        raise _refusal(obj, too_old)
    if obj.get("ok") is not True:
        raise WireError(f"the gate's reply has no ok field: {str(obj)[:200]}")
    return cls.from_wire(obj)


class Holder:
    """One lease, from its acquire to its release, over as many connections as gate
    restarts take. `say` hears what a person should be told (on stderr)."""

    def __init__(
        self,
        path: str,
        timeout: float,
        say: Callable[[str], object] | None = None,
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.say = say or _say
        self.connection: protocol.Connection | None = None
        self.lease: int | None = None
        self.grant: LeaseGranted | None = None
        self.shown_reason: str | None = None  # the hold reason said last

    # -- acquire --------------------------------------------------------------------------

    def acquire(
        self, mind: str, session: str, request_id: str, fds: Sequence[int] = ()
    ) -> LeaseGranted:
        """Ask for the lease and wait for its grant, asking again (same request id, same
        pidfds) each time the gate restarts meanwhile. A refusal is raised; a lease
        that ends before its grant is LeaseGone."""
        request = AcquireRequest(mind, session, request_id, len(fds)).to_wire()
        lost: protocol.ConnectionLost | None = None
        while True:
            self.connection = self._connect(request, fds, lost)
            try:
                return self._granted()
            except protocol.ConnectionLost as error:
                lost = error
                self.close()
                self.say(
                    f"lost the gate while waiting for the lease ({error.message}); asking again"
                )

    def _connect(
        self,
        request: dict[str, Any],
        fds: Sequence[int],
        lost: protocol.ConnectionLost | None,
    ) -> protocol.Connection:
        """A connection on which the gate has answered `request`: it is retried through a
        gate restart for `timeout` seconds, as a delivery is (the request id makes that
        safe)."""
        deadline = time.monotonic() + self.timeout
        delay = protocol.RETRY_FIRST_SECONDS
        while True:
            connection: protocol.Connection | None = None
            try:
                connection = protocol.Connection(self.path, timeout=_left(deadline, lost))
                connection.send(request, fds)
                self._first_answer(connection.receive(timeout=_left(deadline, lost)))
                return connection
            except protocol.ConnectionLost as error:
                lost = error
            except VoluteError as error:
                if lost is None or not isinstance(error, UnavailableError):
                    if connection is not None:
                        connection.close()
                    raise
            if connection is not None:
                connection.close()
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, protocol.RETRY_MAX_SECONDS)

    def _first_answer(self, obj: dict[str, Any]) -> None:
        ack: AcquireReply = answer(obj, AcquireReply)
        self.lease = ack.lease
        self.shown_reason = None
        if ack.state == "waiting" and ack.reason is not None:
            self._say_reason(str(ack.reason))

    def _say_reason(self, reason: str) -> None:
        if reason != self.shown_reason:
            self.shown_reason = reason
            self.say(f"lease {self.lease} waits for its place: {reason}")

    def _look(self) -> None:
        """Say why the lease still waits, from `status` on a connection of its own (the
        gate's admission gives the reason after the acquire's reply); what cannot be
        learnt now is left for the next look."""
        try:
            connection = protocol.Connection(self.path, timeout=self.timeout)
        except VoluteError:
            return
        try:
            connection.send(StatusRequest().to_wire())
            status = answer(connection.receive(timeout=self.timeout), StatusReply).status
        except VoluteError:
            return
        finally:
            connection.close()
        for lease in status.leases:
            if lease.lease == self.lease and lease.reason is not None:
                self._say_reason(str(lease.reason))

    def _next(self, wait: float | None) -> dict[str, Any] | None:
        """The next line on the connection, or None if none came within `wait` seconds."""
        assert self.connection is not None
        if b"\n" not in self.connection.buffer:
            ready, _, _ = select.select([self.connection.sock], [], [], wait)
            if not ready:
                return None
        return self.connection.receive(timeout=self.timeout)

    def _granted(self) -> LeaseGranted:
        """Wait on the connection for the grant (or the end) of the lease acquired."""
        wait = FIRST_LOOK_SECONDS
        while True:
            obj = self._next(wait)
            if obj is None:
                self._look()
                wait = LOOK_EVERY_SECONDS
                continue
            event = obj.get("event")
            if event == "lease_granted":
                grant: LeaseGranted = answer(obj, LeaseGranted)
                if grant.lease != self.lease:
                    continue  # not ours: a gate would not send it; ignore it, as wait does
                self.grant = grant
                return grant
            if event == "lease_ended":
                ended: LeaseEnded = answer(obj, LeaseEnded)
                if ended.lease == self.lease:
                    raise LeaseGone(ended.lease, str(ended.reason))
                continue
            answer(obj, AcquireReply)  # a refusal is raised; anything else is not ours
            raise WireError(f"unexpected line from the gate while waiting: {str(obj)[:200]}")

    # -- holding --------------------------------------------------------------------------

    def fileno(self) -> int:
        assert self.connection is not None
        return self.connection.sock.fileno()

    def pending(self) -> bool:
        """A whole line is buffered already: read it without waiting for the socket."""
        return self.connection is not None and b"\n" in self.connection.buffer

    def hear(self) -> None:
        """Read one line from the gate while the lease is held: LeaseEnded if it ended,
        a claim on a new connection if the gate restarted (the connection was lost)."""
        assert self.connection is not None and self.grant is not None
        try:
            obj = self.connection.receive(timeout=self.timeout)
        except protocol.ConnectionLost as lost:
            self.close()
            self.claim(lost)
            return
        if obj.get("event") == "lease_ended":
            ended: LeaseEnded = answer(obj, LeaseEnded)
            if ended.lease == self.grant.lease:
                self.grant = None
                raise LeaseGone(ended.lease, str(ended.reason))
        # Anything else is not for a holder: a newer gate may say more; it is ignored.

    def claim(self, lost: protocol.ConnectionLost) -> None:
        """After the gate restarted: claim the lease on a new connection, within the
        reclaim window. Too late (the gate ended it: 65) is LeaseGone."""
        assert self.grant is not None
        grant = self.grant
        self.say(f"lost the gate ({lost.message}); claiming lease {grant.lease} again")
        request = ClaimRequest(grant.lease, grant.token).to_wire()
        try:
            self.connection, _ = protocol.request_through_restarts(
                self.path,
                request,
                lambda obj: answer(obj, ClaimReply),
                self.timeout,
                lambda last: _claim_too_late(grant.lease, self.timeout, last),
                lost,
            )
        except VoluteError as error:
            if error.exit_code in (EX_DATAERR, EX_TEMPFAIL):
                self.grant = None
                raise LeaseGone(grant.lease, "reclaim_expired") from error
            raise
        self.say(f"claimed lease {grant.lease} again")

    # -- release --------------------------------------------------------------------------

    def release(self) -> bool:
        """Give the lease back (its pids go back before the gate answers); False if it had
        ended already. Through a gate restart: on a new connection, by its token."""
        grant = self.grant
        if grant is None:
            return False
        self.grant = None
        request = ReleaseRequest(grant.lease, grant.token).to_wire()
        lost: protocol.ConnectionLost | None = None
        if self.connection is not None:
            try:
                self.connection.send(request)
                return self._released(grant.lease)
            except protocol.ConnectionLost as error:
                lost = error
            except VoluteError as error:
                return _gone(error)
            finally:
                self.close()
        try:
            connection, released = protocol.request_through_restarts(
                self.path,
                request,
                lambda obj: answer(obj, ReleaseReply),
                self.timeout,
                lambda last: _release_lost(grant.lease, last),
                lost,
            )
        except VoluteError as error:
            return _gone(error)
        connection.close()
        return True

    def _released(self, lease: int) -> bool:
        """Read up to release's reply; events before it (the lease ended meanwhile) are
        skipped, and a release of a lease that ended is no error."""
        assert self.connection is not None
        while True:
            obj = self.connection.receive(timeout=self.timeout)
            if obj.get("event") is None:
                answer(obj, ReleaseReply, too_old=False)
                return True

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def end_lease(path: str, lease: int) -> None:
    """An admin's `end_lease`: the lease ends as if root released it."""
    connection = protocol.Connection(path)
    try:
        connection.send(EndLeaseRequest(lease).to_wire())
        answer(connection.receive(), EndLeaseReply)
    finally:
        connection.close()


def _gone(error: VoluteError) -> bool:
    """A release refused as an unknown lease (65): it had ended already."""
    if error.exit_code == EX_DATAERR:
        return False
    raise error


def _left(deadline: float, lost: protocol.ConnectionLost | None) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        why = f" (last: {lost.message})" if lost is not None else ""
        raise VoluteError(
            f"the gate did not answer the lease's request in time{why}", exit_code=EX_TEMPFAIL
        )
    return remaining


def _claim_too_late(
    lease: int, timeout: float, lost: protocol.ConnectionLost | None
) -> VoluteError:
    why = f" (last: {lost.message})" if lost is not None else ""
    return VoluteError(
        f"the gate did not answer a claim of lease {lease} within {timeout:g} s{why}",
        exit_code=EX_TEMPFAIL,
    )


def _release_lost(lease: int, lost: protocol.ConnectionLost | None) -> VoluteError:
    why = f" (last: {lost.message})" if lost is not None else ""
    return VoluteError(
        f"could not release lease {lease}: the gate did not answer{why}",
        hint="a lease nobody claims ends within gate.lease_reclaim_seconds of the gate's start",
        exit_code=EX_TEMPFAIL,
    )


def _say(text: str) -> None:
    print(f"volutectl: {visible(text)}", file=sys.stderr, flush=True)
