"""`GateState`: what the request handlers and the status act on.

The gate's parts (its store, its systemd, its turns, its watches), none of its sockets,
and the little the loop learns between passes. volutectl/gate/loop.py builds it once;
volutectl/gate/handlers.py and volutectl/gate/status.py read and change it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from volutectl.clock import SYSTEM, Clock
from volutectl.config.reload import SettingsHolder
from volutectl.config.settings import Settings
from volutectl.core import admission
from volutectl.gate.adaptive import AdaptiveLimit
from volutectl.gate.leases import Leases
from volutectl.gate.liveness import Liveness
from volutectl.gate.outcomes import Settled
from volutectl.gate.pressure import PressureWatch
from volutectl.gate.status import SystemdAsks
from volutectl.gate.turns import Turns
from volutectl.slots.watch import SlotWatch
from volutectl.store.indexed import IndexedStore
from volutectl.systemd.journal import Journal
from volutectl.systemd.port import SystemdManager
from volutectl.wire.messages import ConfigStatus


@dataclass(kw_only=True)
class GateState:
    """What the handlers act on: the gate's parts, none of its sockets."""

    held: SettingsHolder  # the settings, as a reload swaps them: read `settings`
    store: IndexedStore
    manager: SystemdManager
    turns: Turns
    liveness: Liveness
    slots: SlotWatch
    pressure: PressureWatch | None
    journal: Journal
    notify: Callable[[Settled], None]  # tell a delivery's waiters how it settled
    clock: Clock = SYSTEM  # the gate's one clock (volutectl/clock.py)
    dirty: bool = True  # admission should run
    paused: frozenset[str] | admission.EveryMind = frozenset()  # the store's pauses
    foreign_live: int = 0  # other scopes holding a place in the turns slice, last counted
    over_quota: set[int | None] = field(default_factory=set)  # uids refused, as logged
    # uids refused an admin's request: when that was last said, and how many since unsaid
    admin_refused: dict[int, tuple[float, int]] = field(default_factory=dict)
    adaptive: AdaptiveLimit | None = None  # the adaptive limit; set once the rest is up
    leases: Leases | None = None  # the leases (gate/leases.py); set once the socket is up
    # The minds the config file on disk names (read again when it changes): an unknown
    # mind's refusal says to reload when the file has it. None: not asked.
    minds_on_disk: Callable[[], Collection[str]] | None = None
    config: ConfigStatus | None = None  # when the config was read; a refused reload
    # What status last asked systemd: every status within its window shares it.
    status_asks: SystemdAsks = field(default_factory=SystemdAsks)
    _limits: tuple[Settings, admission.Limits] | None = None  # limits_of, and of what

    @property
    def settings(self) -> Settings:
        return self.held.current

    @property
    def limits(self) -> admission.Limits:
        """Admission's caps, as the settings held now say (worked out once per settings)."""
        settings = self.held.current
        if self._limits is None or self._limits[0] is not settings:
            self._limits = (settings, limits_of(settings))
        return self._limits[1]


def limits_of(settings: Settings) -> admission.Limits:
    return admission.Limits(
        global_cap=settings.limits.global_concurrent_turns,
        turns_per_mind=settings.limits.turns_per_mind,
        per_mind={
            name: mind.turns_per_mind
            for name, mind in settings.minds.items()
            if mind.turns_per_mind is not None
        },
    )
