"""Fair shares of the gate's time: whose requests one pass of the loop takes.

The gate takes at most a budget of requests in each pass, for all its clients together
(volutectl/gate/server.py), and shares it out here: in turns between parties (uids),
and within a party in turns between its connections. A party that sends a flood of
lines gets one request per turn like everyone else; the rest of its lines wait for the
next pass, so no party can make a pass long, however many connections it holds.

Pure: the members are opaque, and taking one request from a member is the caller's
`take_one`, which says whether the member had one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def take_turns(
    groups: Iterable[Sequence[T]], budget: int, take_one: Callable[[T], bool]
) -> list[T]:
    """Take up to `budget` requests in turns: one from each group in the order given,
    round and round, each group's one from its next member in turn.

    A member whose `take_one` returns False had nothing left: it is out, and the next
    member of its group is asked in its place; a group with no member left is out.
    Returns the members in the order they gave a request (one entry per request)."""
    rings = deque(deque(group) for group in groups if group)
    taken: list[T] = []
    while rings and len(taken) < budget:
        ring = rings.popleft()
        while ring:
            member = ring.popleft()
            if take_one(member):
                taken.append(member)
                ring.append(member)
                break
        if ring:
            rings.append(ring)
    return taken


def least_recent_first(keys: Iterable[T], served: Sequence[T]) -> list[T]:
    """`keys` in the order they should be served next: those never served first (in the
    order given), then the others, the one served longest ago first. `served` lists
    the keys served before, the most recent last."""
    wanted = list(dict.fromkeys(keys))
    rank = {key: index for index, key in enumerate(served)}
    return sorted(wanted, key=lambda key: rank.get(key, -1))


def served_order(previous: Iterable[T], now: Sequence[T]) -> list[T]:
    """The order of service after a pass that served `now` (in that order), from the
    order before it (`previous`, most recent last): each key served moves to the end."""
    latest = list(dict.fromkeys(reversed(now)))[::-1]  # each key at its last service
    moved = set(latest)
    return [key for key in previous if key not in moved] + latest
