"""volutectl/core/shares.py: the round-robin that shares one pass's budget of requests
between parties, and between one party's connections."""

from __future__ import annotations

from collections.abc import Callable

from volutectl.core import shares


def taker(lines: dict[str, int]) -> tuple[list[str], Callable[[str], bool]]:
    """A `take_one` over members holding `lines[member]` requests each; the log of takes."""
    log: list[str] = []

    def take_one(member: str) -> bool:
        if lines[member] == 0:
            return False
        lines[member] -= 1
        log.append(member)
        return True

    return log, take_one


def test_groups_take_turns_and_members_of_a_group_take_turns_within_its_turns() -> None:
    lines = {"a1": 100, "a2": 100, "a3": 100, "b1": 2, "c1": 100}
    log, take_one = taker(lines)
    taken = shares.take_turns([["a1", "a2", "a3"], ["b1"], ["c1"]], 10, take_one)
    assert taken == log
    # One of each party in turn; a's connections in turn within a's turns; b is out
    # once its two lines are taken, and the others share what is left.
    assert taken == ["a1", "b1", "c1", "a2", "b1", "c1", "a3", "c1", "a1", "c1"]


def test_a_flood_of_one_party_takes_no_more_than_its_share_of_the_budget() -> None:
    flood = {f"m{i}": 1024 for i in range(64)}
    lines = {**flood, "root": 1}
    log, take_one = taker(lines)
    taken = shares.take_turns([list(flood), ["root"]], 256, take_one)
    assert len(taken) == 256  # the budget, not 64 x 1,024
    assert taken.count("root") == 1 and taken.index("root") == 1  # its turn came second
    assert max(taken.count(member) for member in flood) == 4  # spread over its connections


def test_a_member_with_nothing_left_gives_its_turn_to_the_next_of_its_group() -> None:
    lines = {"a1": 0, "a2": 1, "b1": 0}
    log, take_one = taker(lines)
    assert shares.take_turns([["a1", "a2"], ["b1"]], 5, take_one) == ["a2"]
    assert shares.take_turns([], 5, take_one) == []
    assert shares.take_turns([["a2"]], 0, take_one) == []


def test_the_party_served_longest_ago_goes_first_and_new_parties_before_it() -> None:
    served = shares.served_order([], [1, 2, 1, 3])
    assert served == [2, 1, 3]  # each at its last service, the most recent last
    assert shares.least_recent_first([3, 1, 2, 9], served) == [9, 2, 1, 3]
    assert shares.served_order(served, [2]) == [1, 3, 2]
