"""Each uid's quota of deliveries not yet done: the running sums, and the check that a
batch of deliveries makes before its commit.

Every member of the socket's group may deliver; without a quota one of them could fill
the state directory for everyone (300 deliveries of 1 MiB to a paused mind took 920 MB).
So each uid other than root may have at most `gate.max_pending_per_uid` deliveries, and
`gate.max_pending_bytes_per_uid` bytes of messages, that are not yet done. A delivery
counts from its commit until it is done or dropped: pending, running and dead. Dead
ones count because retention never removes them (they wait for an operator): a uid
whose turns fail, as a mind's own user can make them, would otherwise fill the disk at
the pace its deliveries die. Root has no quota: it is the operator, who can write to
the state directory anyway, and whose own tools must not be refused for a disk they
own. Rows from before the store knew the uid (schema 6) count against nobody.

Pure: no I/O. The store (volutectl/store/indexed.py) sums the rows once when it opens and
keeps the sums in step after each commit, so a check costs two dict lookups.
"""

from __future__ import annotations

from dataclasses import dataclass

from volutectl.errors import TemporaryError
from volutectl.states import QueueState
from volutectl.store.rows import NewDelivery

# The states whose rows count against their uid's quota.
COUNTED = (QueueState.PENDING, QueueState.RUNNING, QueueState.DEAD)
MiB = 1 << 20


@dataclass
class Usage:
    """One uid's deliveries not yet done: how many, and their messages' bytes."""

    deliveries: int = 0
    message_bytes: int = 0


@dataclass(frozen=True)
class Quota:
    max_deliveries: int  # gate.max_pending_per_uid
    max_bytes: int  # gate.max_pending_bytes_per_uid


class QuotaExceeded(TemporaryError):
    """A delivery that would take its uid past its quota: refused (75), nothing stored."""


class Usages:
    """The sums by uid, kept in step with the store's commits."""

    def __init__(self) -> None:
        self.by_uid: dict[int, Usage] = {}

    def add(self, uid: int, deliveries: int, message_bytes: int) -> None:
        usage = self.by_uid.setdefault(uid, Usage())
        usage.deliveries += deliveries
        usage.message_bytes += message_bytes
        if usage.deliveries <= 0:  # none left: forget the uid
            del self.by_uid[uid]

    def of(self, uid: int) -> Usage:
        return self.by_uid.get(uid, Usage())


class BatchCheck:
    """The check of one batch, item by item in commit order: the sums so far plus what
    the batch has taken already. Called only for items the store will insert (not for a
    retried request id it holds, which takes nothing more)."""

    def __init__(self, usages: Usages, quota: Quota) -> None:
        self.usages = usages
        self.quota = quota
        self.taken: dict[int, Usage] = {}
        self.accepted: set[int] = set()  # uids with an item that passed

    def __call__(self, item: NewDelivery) -> QuotaExceeded | None:
        if item.uid is None or item.uid == 0:
            return None
        before = self.usages.of(item.uid)
        taken = self.taken.setdefault(item.uid, Usage())
        deliveries = before.deliveries + taken.deliveries
        message_bytes = before.message_bytes + taken.message_bytes
        refusal = self._refusal(item, deliveries, message_bytes)
        if refusal is None:
            taken.deliveries += 1
            taken.message_bytes += len(item.message)
            self.accepted.add(item.uid)
        return refusal

    def _refusal(
        self, item: NewDelivery, deliveries: int, message_bytes: int
    ) -> QuotaExceeded | None:
        quota = self.quota
        has = (
            f"uid {item.uid} has {deliveries} deliveries not yet done "
            f"({message_bytes / MiB:.1f} MiB)"
        )
        hint = (
            "nothing was queued; deliver again once some of them have run (dead ones count "
            "until retried or dropped: volutectl queue list --state dead)"
        )
        if deliveries + 1 > quota.max_deliveries:
            return QuotaExceeded(
                f"{has}, its quota (gate.max_pending_per_uid = {quota.max_deliveries})",
                hint=hint,
            )
        if message_bytes + len(item.message) > quota.max_bytes:
            return QuotaExceeded(
                f"{has}: {len(item.message)} bytes more would pass its quota of "
                f"{quota.max_bytes} bytes (gate.max_pending_bytes_per_uid)",
                hint=hint,
            )
        return None
