"""Every disk the turns use, as the adaptive limit's sensor sees it: the block devices
that hold each mind's working directory or home, the gate's state directory, the
journal, and those the config names (limits.adaptive.devices), read from
/sys/block/DEV/stat each interval (volutectl/kernel/blockdevs.py; the judging is
volutectl/core/disks.py's).

Why counters and not a probe on each disk: reading them needs no write and no
privilege, and the gate may write to none of the minds' directories (a private home
is its user's); a probe there would need the launcher (root) on every interval. The
counters see every request of every process on the device, the turns' included; the
probe on the state disk stays, as the one reading of what a small synced write costs
there (docs/disks.md says more).

Which device a directory is on: its st_dev, or its nearest ancestor's that the gate
may stat (a private home's parent): the same device unless a mount point lies under a
closed directory, when the config names the device. A directory on no block device
(tmpfs, overlayfs) has none to watch. Found at the gate's start, and again while one
is lost.

A device that was read and then cannot be (its /sys/block entry gone: a USB disk
pulled; or a stat that is not one) is a failed signal: `read` says why, and the
adaptive limit falls back as it does for a lost PSI file, until every directory that
was on a device is on a readable one again (the same disk back, or whatever now holds
the directory).
"""

from __future__ import annotations

import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from volutectl.core import disks
from volutectl.core.disks import DiskInterval, DiskStat
from volutectl.kernel import blockdevs
from volutectl.launcher.home import HOMES_DIR
from volutectl.launcher.preflight import NO_HOME

if TYPE_CHECKING:
    from volutectl.config.settings import Settings

JOURNALS = (Path("/var/log/journal"), Path("/run/log/journal"))
MIND_DIRECTORY = "'s working directory"  # "mind NAME's working directory"


@dataclass(frozen=True)
class Source:
    """A directory (or a device the config names) whose device is watched, and why."""

    what: str  # "the state directory", "mind w01's working directory"...
    place: str  # the path, or the config's name of a device


@dataclass(frozen=True)
class DiskSeen:
    """One device's last interval, for status."""

    device: str
    holds: tuple[str, ...]
    await_ms: float | None
    utilisation: float
    baseline_ms: float | None


def mind_directory(name: str, working_directory: Path | None, user: str) -> Path | None:
    """Where a mind's turns write: its working directory, else its user's home, else
    the home the launcher makes for it (volutectl/launcher/preflight.py's choice)."""
    if working_directory is not None:
        return working_directory
    try:
        home = pwd.getpwnam(user).pw_dir
    except KeyError:
        return None  # no such user: the launcher refuses its turns
    return HOMES_DIR / name if home in NO_HOME else Path(home)


def sources(settings: Settings) -> list[Source]:
    """What the gate watches: the state directory, each mind's directory, the journal,
    and the devices the config names."""
    found = [Source("the state directory", str(settings.gate.state_dir))]
    for name, mind in sorted(settings.minds.items()):
        user = mind.user or settings.turns.default_user
        place = mind_directory(name, mind.working_directory, user)
        if place is not None:
            found.append(Source(f"mind {name}{MIND_DIRECTORY}", str(place)))
    journal = next((path for path in JOURNALS if path.is_dir()), None)
    if journal is not None:
        found.append(Source("the journal", str(journal)))
    for device in settings.limits.adaptive.devices:
        found.append(Source("limits.adaptive.devices", device))
    return found


def resolve(source: Source, sys_root: Path) -> list[str]:
    """The device that holds a source, and those under it (nearest first); none if it
    is on no block device."""
    if source.what == "limits.adaptive.devices":
        device = blockdevs.named(source.place, sys_root)
    else:
        device = blockdevs.device_of(Path(source.place), sys_root)
    if device is None:
        return []
    return [device, *blockdevs.below(device, sys_root)]


class DiskWatch:
    """The watched devices and their readings: `read` takes one interval's, `on_probe_scale`
    puts each on the probe's scale, `shown` says them."""

    def __init__(self, settings: Settings, sys_root: Path = blockdevs.SYS) -> None:
        self.sys_root = sys_root
        self.sources = sources(settings)
        self.devices: dict[str, tuple[str, ...]] = {}  # device: what it holds
        self.baselines: dict[str, float] = {}
        self.seen: dict[str, DiskInterval] = {}
        self.lost: str | None = None  # why a device that was read cannot be
        self._ever: set[Source] = set()  # sources found on a device at least once
        self._last: dict[str, DiskStat] = {}
        self._last_at: float | None = None
        self._find()

    def _find(self) -> list[Source]:
        """Which device holds each source, now; the sources that were on a device and
        are on none now."""
        devices: dict[str, list[str]] = {}
        gone = []
        for source in self.sources:
            found = resolve(source, self.sys_root)
            if found:
                self._ever.add(source)
            elif source in self._ever:
                gone.append(source)
            for device in found:
                devices.setdefault(device, []).append(source.what)
        self.devices = {device: tuple(dict.fromkeys(what)) for device, what in devices.items()}
        return gone

    def read(self, now: float) -> str | None:
        """One interval's readings, from the last `read` to `now` (the first of a run of
        readings only marks). None, or why a device that was read cannot be now."""
        if self.lost is not None:
            gone = self._find()
            if gone:
                return self.lost
        stats: dict[str, DiskStat] = {}
        for device in self.devices:
            try:
                stats[device] = blockdevs.read_stat(device, self.sys_root)
            except (OSError, ValueError) as error:
                why = error.strerror if isinstance(error, OSError) else "not a stat"
                self.lost = f"the disk {describe(self.devices, device)} cannot be read ({why})"
                self._last, self._last_at, self.seen = {}, None, {}
                return self.lost
        self.lost = None
        for device, stat in stats.items():
            if device not in self.baselines:
                first = disks.lifetime_await(stat)
                if first is not None:
                    self.baselines[device] = first
        before, at = self._last, self._last_at
        self._last, self._last_at = stats, now
        self.seen = {}
        if at is None:
            return None
        self.seen = {
            device: disks.interval(before[device], stat, now - at)
            for device, stat in stats.items()
            if device in before
        }
        for device, seen in self.seen.items():
            learnt = disks.learn(self.baselines.get(device), seen)
            if learnt is not None:
                self.baselines[device] = learnt
        return None

    def mark_idle(self) -> None:
        """Nothing runs or waits: the next `read` only marks."""
        self._last, self._last_at = {}, None

    def on_probe_scale(self, probe_baseline_ms: float) -> dict[str, float]:
        """This interval's await of each device that completed a request or stalled,
        on the probe's scale (core/disks.py's as_probe_ms)."""
        scaled: dict[str, float] = {}
        for device, seen in self.seen.items():
            baseline = self.baselines.get(device)
            if seen.await_ms is not None and baseline is not None:
                scaled[device] = disks.as_probe_ms(seen.await_ms, baseline, probe_baseline_ms)
        return scaled

    def shown(self) -> list[DiskSeen]:
        return [
            DiskSeen(
                device=device,
                holds=holds,
                await_ms=self.seen[device].await_ms if device in self.seen else None,
                utilisation=self.seen[device].utilisation if device in self.seen else 0.0,
                baseline_ms=self.baselines.get(device),
            )
            for device, holds in sorted(self.devices.items())
        ]


def holdings(holds: tuple[str, ...]) -> str:
    """What a device holds, in a few words: more than two minds' directories are
    counted, not listed."""
    minds = [what for what in holds if what.startswith("mind ") and what.endswith(MIND_DIRECTORY)]
    if len(minds) <= 2:
        return ", ".join(holds)
    rest = [what for what in holds if what not in minds]
    return ", ".join([f"the working directories of {len(minds)} minds", *rest])


def describe(devices: Mapping[str, tuple[str, ...]], device: str) -> str:
    """A device and what it holds, for a message."""
    return f"{device} ({holdings(devices.get(device, ()))})"
