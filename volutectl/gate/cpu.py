"""The CPU signal, the gate's side: it reads PSI `cpu` and moves core/cpu.py's limit on
turns at once, which the adaptive limit (volutectl/gate/adaptive.py) gives admission as
a bound beside its own maximum.

The file is the turns slice's `cpu.pressure` when it reads as PSI, else the system's
/proc/pressure/cpu (a host whose slice has no cgroup v2 file, or none yet), read at the
start and end of each of the adaptive limit's intervals (plain reads: no trigger, no
write, no privilege). A gate that started before the slice did (systemd makes the
slice's cgroup with the first turn: a gate started at boot) reads the system's until
the slice's reads as PSI, then the slice's: the system's counts every stall on the
host, and the turns' own is the signal. An interval whose two ends were read from two
files is no reading. A file that read and then fails (the slice's cgroup went with the
slice, a file that reads as garbage) is looked for again, as the io.pressure file is:
the reading where it failed is a failure (the adaptive limit falls back to its static
start value, AdaptiveFallback), and the next that reads ends it. A host with no CPU PSI
at all has no CPU limit: the storage's signals alone hold the turns.

Beside it, the turns slice's `cpu.stat` `usage_usec` at the same moments: the CPU time
the turns used over the interval, which the limit grows no further than (core/cpu.py's
`room`), per second a turn ran in it: the turns running, as each admission pass leaves
them (`note_running`), summed over the interval's time (turn-seconds). A slice with no
such file (no cgroup v2, or no slice yet) gives no use, and the limit grows on PSI
alone; nothing falls back for it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from volutectl.core import cpu
from volutectl.core.cpu import CpuLimit, CpuReading
from volutectl.core.psi import parse_total, stall_fraction
from volutectl.kernel.probes import CGROUP_ROOT, preferring_slice, readable_pressure, slice_cgroup

if TYPE_CHECKING:
    from volutectl.config.settings import Settings

SYSTEM_CPU_PRESSURE = Path("/proc/pressure/cpu")


def cpu_stat_file(slice_name: str, cgroup_root: Path = CGROUP_ROOT) -> Path | None:
    """Where the slice's `cpu.stat` is (whether or not the slice exists yet); None
    without a cgroup v2 hierarchy."""
    cgroup = slice_cgroup(slice_name, cgroup_root)
    return cgroup / "cpu.stat" if cgroup is not None else None


def usage_usec(path: Path | None) -> int | None:
    """The CPU time (µs) a cgroup's processes have used, from its `cpu.stat` at `path`;
    None when it cannot be read."""
    if path is None:
        return None
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec" and value.strip().isdigit():
            return int(value)
    return None


def cpu_pressure_file(
    slice_name: str, cgroup_root: Path = CGROUP_ROOT, system: Path = SYSTEM_CPU_PRESSURE
) -> Path | None:
    """The turns slice's cpu.pressure when it reads as PSI, else the system's, else None."""
    return readable_pressure(slice_name, "cpu.pressure", system, cgroup_root)


class CpuSignal:
    """PSI cpu `some` over each interval, and the limit it moves. `given`: a test's file,
    the only one read; `cpus`: the CPUs the floor counts (the host's by default);
    `cgroup_root` and `system`: where the files are looked for (a test's tree)."""

    def __init__(
        self,
        settings: Settings,
        enabled: bool,
        given: Path | None = None,
        cpus: int | None = None,
        cgroup_root: Path = CGROUP_ROOT,
        system: Path = SYSTEM_CPU_PRESSURE,
    ) -> None:
        self.enabled = enabled
        self._roots = (cgroup_root, system)
        self._slice = settings.turns.slice
        self._given = given
        self.path = given if given is not None or not enabled else self._find()
        self.cpus = cpus or os.cpu_count() or 1
        adaptive = settings.limits.adaptive
        floor = self.floor(adaptive.minimum, adaptive.maximum)
        self.state: CpuLimit = cpu.initial(floor, adaptive.maximum)
        self._lost: str | None = None  # why the file that read failed, until one reads
        # (total µs, monotonic, the file read) at the start
        self._mark: tuple[int, float, Path] | None = None
        self._used_mark: int | None = None  # the slice's usage_usec at the start
        # A test's PSI file has no slice of its own to read.
        self._stat = cpu_stat_file(self._slice, cgroup_root) if given is None else None
        self._running = 0  # the most turns running since the mark
        self._turns = 0  # the turns running as the last pass left them
        self._since: float | None = None  # when: turn-seconds are summed from there
        self._turn_seconds = 0.0  # summed since the mark, up to `_since`
        self.last: CpuReading | None = None

    def _find(self) -> Path | None:
        return self._given or cpu_pressure_file(self._slice, *self._roots)

    def use_file(self, path: Path) -> None:
        """Read `path` alone (a test's file), from the next interval on."""
        self._given = self.path = path
        self._stat = None
        self._mark = None

    def bound(self, minimum: int, maximum: int) -> int | None:
        """The most turns at once the CPUs bear now; None: no CPU PSI (no bound)."""
        if not self.enabled or (self.path is None and self._lost is None):
            return None
        return max(self.floor(minimum, maximum), min(maximum, self.state.limit))

    def floor(self, minimum: int, maximum: int) -> int:
        return cpu.floor_of(minimum, maximum, self.cpus)

    def note_running(self, now: float, running: int) -> None:
        """An admission pass left `running` turns running at `now`."""
        self._running = max(self._running, running)
        self._turn_seconds = self._ran_until(now)
        self._turns, self._since = running, now

    def _ran_until(self, now: float) -> float:
        """Turn-seconds since the mark, up to `now`."""
        if self._since is None:
            return self._turn_seconds
        return self._turn_seconds + self._turns * max(0.0, now - self._since)

    def idle(self) -> None:
        """Nothing runs or waits: no interval is measured (the limit is kept)."""
        self._mark = None
        self._running = 0
        self._since = None
        self._turn_seconds = 0.0

    def mark(self, now: float, running: int) -> str | None:
        """An interval begins: read the total (or why it fails)."""
        self._running = running
        self._turns, self._since, self._turn_seconds = running, now, 0.0
        total = self._total()
        if isinstance(total, str):
            self._mark = None
            return total
        self._mark = (total, now, self.path) if total is not None and self.path else None
        self._used_mark = usage_usec(self._stat) if self._mark is not None else None
        return None

    def read(
        self, now: float, running: int, waiting: int, minimum: int, maximum: int
    ) -> tuple[str | None, str | None]:
        """An interval ends: (why the file failed, or None; why the limit moved, or None).
        The next interval is marked from here."""
        mark, seen, used_mark = self._mark, self._running, self._used_mark
        turn_seconds = self._ran_until(now)
        failure = self.mark(now, running)
        if failure is not None or mark is None or self._mark is None:
            return failure, None
        if mark[2] != self._mark[2]:  # the slice's file read from here: no reading
            return None, None
        stalled = stall_fraction(mark[0], self._mark[0], now - mark[1])
        used = None
        if used_mark is not None and self._used_mark is not None and now > mark[1]:
            used = max(0, self._used_mark - used_mark) / 1e6 / (now - mark[1])
        self.last = CpuReading(
            stalled=stalled,
            running=seen,
            waiting=waiting,
            used=used,
            cpus=self.cpus,
            seconds=now - mark[1],
            turn_seconds=turn_seconds,
        )
        self.state, why = cpu.step(self.state, self.last, self.floor(minimum, maximum), maximum)
        return None, why

    def reconfigure(self, minimum: int, maximum: int) -> None:
        self.state = cpu.clamp(self.state, self.floor(minimum, maximum), maximum)

    def _total(self) -> int | str | None:
        """`some total=` (µs), None with no file, or why the file cannot be read."""
        if not self.enabled:
            return None
        if self.path is None and self._lost is not None:
            self.path = self._find()  # the slice's cgroup may be back, or the system's
            if self.path is None:
                return self._lost
        if self.path is None:
            return None
        if self._given is None:
            cgroup_root, system = self._roots
            self.path = preferring_slice(
                self.path, self._slice, "cpu.pressure", system, cgroup_root
            )
        try:
            total = parse_total(self.path.read_text())
        except (OSError, ValueError) as error:
            why = error.strerror if isinstance(error, OSError) else "not PSI text"
            self._lost = f"{self.path} cannot be read ({why})"
            self.path = self._find()
            return self._lost
        self._lost = None
        return total
