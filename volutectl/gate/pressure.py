"""The pressure watch: the gate learns from the kernel (PSI) when the storage is stalled.

A PSI trigger (`some THRESHOLD WINDOW` written to an io.pressure file) makes the file's
fd report POLLPRI when tasks stalled on IO for THRESHOLD µs within WINDOW µs. The gate
selects on it (through an epoll wrapped around it, so a plain EVENT_READ works), and
holds new turns while pressure is high. PSI triggers never report that pressure fell,
so while high the watch re-reads the file's cumulative `some total=` stall every
`recheck_seconds` and resumes only when the stalled share of that interval drops
below `resume_below_percent` (hysteresis: the trigger ratio is higher).

A fan-out arrives in one burst and PSI is reactive: by the time the first stall shows,
every turn of the burst would already run. So `pace()` lets at most one turn start per
admission pass, and a turn that just started counts as pressure ("settling") until one
recheck interval shows its stall below the resume threshold. Turns that do no IO thus
start at one per recheck interval; turns that saturate the disk run one at a time.

Where the trigger goes:
- target "slice": the turns slice's `io.pressure` on cgroup v2 (or the v2 hierarchy
  of a hybrid host, /sys/fs/cgroup/unified), so only the turns' own stalls count;
- target "system", or no slice cgroup: /proc/pressure/io.
Without CAP_SYS_RESOURCE the kernel accepts only windows that are multiples of 2 s
(EINVAL otherwise); the watch then rounds the window up and scales the threshold to
keep the same ratio, and `describe()` says which trigger is in use.

No pystemd here: plain files, os and select.epoll. The decisions are pure, in
volutectl.core.psi; finding the files and registering a trigger are in
volutectl.kernel.probes, which `volutectl doctor` shares.
"""

from __future__ import annotations

import contextlib
import os
import select
from pathlib import Path
from typing import TYPE_CHECKING

from volutectl import events
from volutectl.core.psi import Trigger, next_state, parse_total, stall_fraction
from volutectl.errors import VoluteError
from volutectl.events import Emit
from volutectl.kernel.probes import SYSTEM_PRESSURE, PsiUnavailable, register_trigger, slice_cgroup

if TYPE_CHECKING:
    from volutectl.config.settings import IoPressureSettings, Settings
    from volutectl.systemd.port import SystemdManager


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace")


class PressureWatch:
    """One PSI trigger, selectable; `high` means: hold new turns beyond those running."""

    def __init__(
        self,
        settings: IoPressureSettings,
        path: Path,
        trigger_fd: int,
        trigger: Trigger,
        note: str,
        emit: Emit,
    ) -> None:
        self.settings = settings
        self.path = path
        self.trigger = trigger
        self.note = note
        self._emit = emit
        self._trigger_fd = trigger_fd
        self._epoll = select.epoll()
        try:
            self._epoll.register(trigger_fd, select.EPOLLPRI)
            self._read_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._epoll.close()
            raise
        self._high = False
        self._reason = ""  # "pressure" (the trigger fired) or "settling" (a turn just started)
        self._deadline: float | None = None
        self._mark_total = 0
        self._mark_time = 0.0
        self.events = 0  # triggers fired, for status and tests

    @classmethod
    def open(
        cls,
        settings: IoPressureSettings,
        *,
        slice_cgroup: Path | None,
        emit: Emit,
    ) -> PressureWatch | None:
        """A watch per `settings`, or None when disabled or PSI is unavailable (logged)."""
        if not settings.enabled:
            return None
        wanted = Trigger("some", settings.threshold_us, settings.window_us)
        candidates: list[Path] = []
        why_not_slice = ""
        if settings.target == "slice":
            if slice_cgroup is None:
                why_not_slice = "no cgroup v2 hierarchy"
            elif not (slice_cgroup / "io.pressure").exists():
                why_not_slice = f"{slice_cgroup / 'io.pressure'} does not exist"
            else:
                candidates.append(slice_cgroup / "io.pressure")
        candidates.append(SYSTEM_PRESSURE)
        errors = []
        for path in candidates:
            try:
                fd, trigger, note = register_trigger(path, wanted)
            except PsiUnavailable as error:
                errors.append(str(error))
                continue
            try:
                watch = cls(settings, path, fd, trigger, note, emit)
            except OSError as error:  # e.g. not a PSI file: epoll refuses a regular file
                os.close(fd)
                errors.append(f"cannot watch {path}: {error.strerror}")
                continue
            if why_not_slice:
                watch.note += f" (not the turns slice: {why_not_slice})"
            elif errors:
                watch.note += f" (slice refused: {errors[0]})"
            tried = (
                slice_cgroup / "io.pressure"
                if settings.target == "slice" and slice_cgroup
                else None
            )
            emit(
                events.PressureGateOn(
                    description=watch.describe(),
                    pressure_file=str(path),
                    slice_file=str(tried) if tried else None,
                )
            )
            return watch
        emit(events.PressureGateOff(errors="; ".join(errors)))
        return None

    # -- the selectable -------------------------------------------------------------------

    def fileno(self) -> int:
        return self._epoll.fileno()

    @property
    def high(self) -> bool:
        return self._high

    @property
    def reason(self) -> str:
        return self._reason

    def deadline(self) -> float | None:
        return self._deadline if self._high else None

    def on_ready(self, now: float) -> bool:
        """fileno() was readable: the trigger fired. Consume it; True if `high` changed.

        The readiness is the event: PSI clears a trigger's flag on every poll of its fd,
        and the caller's select() on our epoll already polled it through the epoll, so
        the epoll.poll(0) below (which drains the ready list) usually finds nothing."""
        self._epoll.poll(0)
        self.events += 1
        if self._high:
            self._become_pressure(f"the trigger fired ({self.trigger.line()} on {self.path})")
            return False
        self._enter("pressure", now)
        self._emit(
            events.PressureHigh(why=f"the trigger fired ({self.trigger.line()} on {self.path})")
        )
        return True

    def _become_pressure(self, why: str) -> None:
        """A settling hold turns out to be real pressure: say so once."""
        if self._reason != "pressure":
            self._reason = "pressure"
            self._emit(events.PressureHigh(why=why))

    def on_deadline(self, now: float) -> bool:
        """Re-read the stall; True if `high` changed (released below the resume threshold)."""
        if not self._high or self._deadline is None or now < self._deadline:
            return False
        total = self._total()
        fraction = stall_fraction(self._mark_total, total, now - self._mark_time)
        self._mark_total, self._mark_time = total, now
        if next_state(True, fraction, self.settings):
            if fraction >= self.trigger.fraction:
                self._become_pressure(
                    f"{fraction * 100:.1f}% stalled over the last "
                    f"{self.settings.recheck_seconds:g} s on {self.path}"
                )
            self._deadline = now + self.settings.recheck_seconds
            return False
        was = self._reason
        self._high = False
        self._reason = ""
        self._deadline = None
        if was == "pressure":
            self._emit(
                events.PressureFell(
                    stalled_percent=fraction * 100,
                    resume_below_percent=self.settings.resume_below_percent,
                )
            )
        return True

    def note_started(self, now: float) -> bool:
        """A turn was just started: hold further starts until its stall is measured."""
        if self._high:
            return False
        self._enter("settling", now)
        return True

    def may_start(self) -> int:
        """How many turns admission may start in one pass: one, since PSI reacts late (a
        burst would all be running before the first stall shows); after it,
        `note_started` holds further starts until that turn's stall is measured."""
        return 1

    def _enter(self, reason: str, now: float) -> None:
        self._high = True
        self._reason = reason
        self._mark_total = self._total()
        self._mark_time = now
        self._deadline = now + self.settings.recheck_seconds

    def _total(self) -> int:
        try:
            return parse_total(_read(self._read_fd))
        except (OSError, ValueError):
            return self._mark_total  # unreadable now: count no stall, keep the last figure

    def describe(self) -> str:
        return (
            f"PSI trigger '{self.trigger.line()}' on {self.path}{self.note}, "
            f"resume below {self.settings.resume_below_percent:g}% stalled over "
            f"{self.settings.recheck_seconds:g} s"
        )

    def close(self) -> None:
        self._epoll.close()
        for fd in (self._trigger_fd, self._read_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._trigger_fd = self._read_fd = -1


def open_for_turns(settings: Settings, manager: SystemdManager, emit: Emit) -> PressureWatch | None:
    """The gate's watch on its turns' slice, or None (disabled, or PSI unavailable)."""
    if not settings.limits.io_pressure.enabled:
        return None
    # The slice's cgroup (and its io.pressure) exists only while the slice is active.
    with contextlib.suppress(VoluteError):
        manager.start_unit(settings.turns.slice)
    return PressureWatch.open(
        settings.limits.io_pressure,
        slice_cgroup=slice_cgroup(settings.turns.slice),
        emit=emit,
    )
