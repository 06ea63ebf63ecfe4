"""A lease's processes, the gate's side (issue 31, item 2; docs/protocol.md, "A lease's
processes").

An acquire may bring pidfds of the runner's processes (SCM_RIGHTS, counted by its
`pids`). The gate:
- lets only the mind's own user, an admin or root pass them (`may_move`; any other
  member: 77 naming `pids`), and refuses at once, naming `pids[i]`, a process it can
  already tell will not move (`check`: not the mind's user's, pid 1, the gate, in a
  turn scope): the launcher checks all of it again, for itself, and alone decides;
- keeps its own copies of the pidfds for the lease's life (`LeasePids`): it gives them
  to the launcher (MoveIn) right after the lease's scope starts, and watches them: a
  pidfd becomes readable when its process exits, and when every one of a lease's has,
  the lease ends with `pids_exited`;
- has the launcher move them back (MoveBack) before any stop of a lease's scope
  (volutectl/gate/turns.py's `Turns.move_back`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import select
from collections.abc import Callable, Sequence

from volutectl import events, names, roles
from volutectl.config.settings import Settings
from volutectl.core import pidmoves
from volutectl.errors import DataError, VoluteError
from volutectl.kernel import pidfds
from volutectl.launcher.hands import TurnHands
from volutectl.systemd.journal import Journal
from volutectl.wire import orders


def mind_uid(settings: Settings, mind: str) -> int:
    """The uid the mind's turns run as, from the gate's config."""
    configured = settings.minds[mind].user or settings.turns.default_user
    try:
        return pwd.getpwnam(configured).pw_uid
    except KeyError:
        raise DataError(f"mind {mind!r}'s user {configured!r} does not exist") from None


def may_move(settings: Settings, mind: str, uid: int, role: roles.Role) -> None:
    """Only the mind's own user, an admin or root may move processes into its lease."""
    if role is roles.Role.ADMIN or uid == mind_uid(settings, mind):
        return
    raise roles.admin_refusal("pids: only the mind's user or an admin may move processes")


def check(passed: Sequence[int], count: int, settings: Settings, mind: str) -> None:
    """Refuse now what the launcher would refuse later: a count that is not the
    descriptors', a descriptor that is no live process, a process that is not the
    mind's own, pid 1, the gate, or in a turn's scope."""
    if len(passed) != count:
        raise DataError(f"pids: {count} announced, {len(passed)} descriptors came")
    rules = pidmoves.Rules(mind, 0, mind_uid(settings, mind), frozenset({1, os.getpid()}))
    for index, pidfd in enumerate(passed):
        try:
            seen = pidfds.read_process(pidfd)
        except pidfds.NotAProcess as error:
            raise DataError(f"pids[{index}]: {error}") from None
        why = pidmoves.refusal(seen, rules)
        if why is not None:
            raise DataError(f"pids[{index}]: {why}")


def exited(pidfd: int) -> bool:
    """A pidfd is readable once its process has exited."""
    return bool(select.select([pidfd], [], [], 0)[0])


class LeasePids:
    """The gate's copies of each lease's pidfds, watched until the lease ends."""

    def __init__(
        self,
        journal: Journal,
        watch: Callable[[int, Callable[[int], None]], None],
        unwatch: Callable[[int], None],
        on_all_exited: Callable[[int], None],
    ) -> None:
        self.journal = journal
        self.watch, self.unwatch = watch, unwatch
        self.on_all_exited = on_all_exited  # called with the lease's id
        self.held: dict[int, tuple[int, ...]] = {}
        self.moved: dict[int, int] = {}

    def keep(self, lease_id: int, passed: Sequence[int]) -> None:
        """Copies of the request's pidfds (the request's own are closed with it)."""
        if passed:
            self.held[lease_id] = tuple(os.dup(fd) for fd in passed)

    def count(self, lease_id: int) -> int:
        return len(self.held.get(lease_id, ()))

    def move_in(self, hands: TurnHands, lease_id: int, turn_id: int, mind: str) -> int:
        """Have the launcher move the lease's processes into its scope (just started);
        how many moved. A refusal is logged: the lease holds its place without them."""
        held = self.held.get(lease_id)
        if not held:
            return 0
        # Those that exited while the lease waited move nowhere (the launcher would
        # refuse the whole order for one of them); if none is left, the watch below
        # ends the lease at once (`pids_exited`).
        living = tuple(fd for fd in held if not exited(fd))
        order = orders.MoveIn(turn_id=turn_id, mind=mind, pids=len(living))
        try:
            moved = len(hands.move_in(order, living).moved) if living else 0
        except VoluteError as error:
            unit = names.turn_scope_name(mind, turn_id)
            self.journal.emit(
                events.LeasePidsNotMoved(unit=unit, direction="in", error=error.message)
            )
            moved = 0
        self.moved[lease_id] = moved
        for fd in held:
            self.watch(fd, functools.partial(self._check, lease_id))
        return moved

    def _check(self, lease_id: int, _mask: int = 0) -> None:
        held = self.held.get(lease_id)
        if held is not None and all(exited(fd) for fd in held):
            self.drop(lease_id)
            self.on_all_exited(lease_id)

    def drop(self, lease_id: int) -> None:
        for fd in self.held.pop(lease_id, ()):
            self.unwatch(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self.moved.pop(lease_id, None)
