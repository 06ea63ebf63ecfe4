"""Pressure-aware admission: learn from the kernel (PSI) when the storage is stalled.

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

No pystemd here: plain files, os and select.epoll. The decisions (`next_state`,
`trigger_line`, `coarse_trigger`, `stall_fraction`, `pace_admission`) are pure.
"""

from __future__ import annotations

import errno
import os
import select
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from volutectl import core
from volutectl.states import HoldReason

if TYPE_CHECKING:
    from volutectl.config import IoPressureSettings

SYSTEM_PRESSURE = Path("/proc/pressure/io")
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNPRIVILEGED_WINDOW_US = 2_000_000  # the kernel's granularity without CAP_SYS_RESOURCE
MIN_WINDOW_US = 500_000
MAX_WINDOW_US = 10_000_000

JournalLog = Callable[[str, str], None]


# -- pure parts ----------------------------------------------------------------------


@dataclass(frozen=True)
class Trigger:
    kind: str  # "some" or "full"
    threshold_us: int
    window_us: int

    def line(self) -> str:
        return trigger_line(self.kind, self.threshold_us, self.window_us)

    @property
    def fraction(self) -> float:
        return self.threshold_us / self.window_us


def trigger_line(kind: str, threshold_us: int, window_us: int) -> str:
    """The text written to an io.pressure file to register a trigger."""
    if kind not in ("some", "full"):
        raise ValueError(f"PSI trigger kind must be 'some' or 'full', not {kind!r}")
    if not MIN_WINDOW_US <= window_us <= MAX_WINDOW_US:
        raise ValueError(f"PSI window {window_us} µs is outside 500000..10000000")
    if not 0 < threshold_us < window_us:
        raise ValueError(f"PSI threshold {threshold_us} µs must be within (0, {window_us})")
    return f"{kind} {threshold_us} {window_us}"


def coarse_trigger(trigger: Trigger) -> Trigger | None:
    """The nearest trigger an unprivileged writer may register: a 2 s multiple window,
    the threshold scaled to keep the same stalled share. None if it is already one."""
    if trigger.window_us % UNPRIVILEGED_WINDOW_US == 0:
        return None
    steps = -(-trigger.window_us // UNPRIVILEGED_WINDOW_US)  # round up
    window = min(steps * UNPRIVILEGED_WINDOW_US, MAX_WINDOW_US - MAX_WINDOW_US % 2_000_000)
    threshold = max(1, round(trigger.threshold_us * window / trigger.window_us))
    return Trigger(trigger.kind, min(threshold, window - 1), window)


def parse_total(text: str, kind: str = "some") -> int:
    """The cumulative stall in µs (`total=`) of the `some` or `full` line of a PSI file."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == kind:
            for field in fields[1:]:
                if field.startswith("total="):
                    return int(field[len("total=") :])
    raise ValueError(f"no '{kind} ... total=' line in PSI text {text[:80]!r}")


def stall_fraction(total_before_us: int, total_after_us: int, elapsed_s: float) -> float:
    """The share of wall time (0..1) stalled between two readings of `total=`."""
    if elapsed_s <= 0:
        return 0.0
    delta = max(0, total_after_us - total_before_us)
    return min(1.0, delta / (elapsed_s * 1e6))


def next_state(high: bool, fraction: float, settings: IoPressureSettings) -> bool:
    """Hysteresis: become high at the trigger's ratio, stay high until below resume."""
    if high:
        return fraction * 100 >= settings.resume_below_percent
    return fraction >= settings.threshold_us / settings.window_us


def pace_admission(admission: core.Admission, may_start: int = 1) -> core.Admission:
    """Keep the first `may_start` starts (id order); hold the rest for io_pressure.

    A held start's deliveries stay pending with no attempt counted, and go out first
    once the next start is allowed, so FIFO order is kept."""
    if len(admission.starts) <= may_start:
        return admission
    kept, deferred = admission.starts[:may_start], admission.starts[may_start:]
    holds = list(admission.holds)
    holds += [
        core.Hold(delivery_id, HoldReason.IO_PRESSURE)
        for start in deferred
        for delivery_id in start.delivery_ids
    ]
    return core.Admission(starts=list(kept), folds=list(admission.folds), holds=holds)


def cgroup_v2_root(cgroup_root: Path = CGROUP_ROOT) -> Path | None:
    """The cgroup v2 hierarchy: the root itself (unified) or its `unified` (hybrid)."""
    for candidate in (cgroup_root, cgroup_root / "unified"):
        if (candidate / "cgroup.controllers").is_file():
            return candidate
    return None


def slice_cgroup(slice_name: str, cgroup_root: Path = CGROUP_ROOT) -> Path | None:
    """The v2 cgroup directory systemd gives a slice: volute-turns.slice ->
    ROOT/volute.slice/volute-turns.slice. None without a v2 hierarchy."""
    root = cgroup_v2_root(cgroup_root)
    if root is None:
        return None
    if not slice_name.endswith(".slice"):
        raise ValueError(f"{slice_name!r} is not a slice name")
    stem = slice_name[: -len(".slice")]
    if stem in ("", "-"):
        return root
    parts = stem.split("-")
    path = root
    for end in range(1, len(parts) + 1):
        path = path / ("-".join(parts[:end]) + ".slice")
    return path


# -- the watch ---------------------------------------------------------------------------


class PsiUnavailable(Exception):
    """No trigger could be registered on a PSI file."""


def _register(path: Path, trigger: Trigger) -> tuple[int, Trigger, str]:
    """Open `path` and register `trigger`, or the 2 s-window fallback on EINVAL.

    Returns (fd, the trigger in use, a note on why a fallback was used)."""
    attempts = [(trigger, "")]
    coarse = coarse_trigger(trigger)
    if coarse is not None:
        attempts.append(
            (coarse, f" (the kernel refused '{trigger.line()}': no CAP_SYS_RESOURCE, 2 s windows)")
        )
    last: OSError | None = None
    for candidate, note in attempts:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as error:
            raise PsiUnavailable(f"cannot open {path}: {error.strerror}") from None
        try:
            os.write(fd, candidate.line().encode() + b"\0")
        except OSError as error:
            os.close(fd)
            last = error
            if error.errno == errno.EINVAL:
                continue
            break
        return fd, candidate, note
    reason = last.strerror if last is not None else "refused"
    if last is not None and last.errno == errno.EOPNOTSUPP:
        reason = "PSI is disabled (boot with psi=1)"
    raise PsiUnavailable(f"cannot register a PSI trigger on {path}: {reason}")


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
        journal_log: JournalLog,
    ) -> None:
        self.settings = settings
        self.path = path
        self.trigger = trigger
        self.note = note
        self._log = journal_log
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
        journal_log: JournalLog,
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
                fd, trigger, note = _register(path, wanted)
            except PsiUnavailable as error:
                errors.append(str(error))
                continue
            try:
                watch = cls(settings, path, fd, trigger, note, journal_log)
            except OSError as error:  # e.g. not a PSI file: epoll refuses a regular file
                os.close(fd)
                errors.append(f"cannot watch {path}: {error.strerror}")
                continue
            if why_not_slice:
                watch.note += f" (not the turns slice: {why_not_slice})"
            elif errors:
                watch.note += f" (slice refused: {errors[0]})"
            journal_log("info", f"io pressure gate on: {watch.describe()}")
            return watch
        journal_log(
            "warning",
            "io pressure gate off: " + "; ".join(errors) + " (limits.io_pressure.enabled)",
        )
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
        self._log(
            "info",
            f"io pressure high: the trigger fired ({self.trigger.line()} on {self.path}); "
            "holding new turns",
        )
        return True

    def _become_pressure(self, why: str) -> None:
        """A settling hold turns out to be real pressure: say so once."""
        if self._reason != "pressure":
            self._reason = "pressure"
            self._log("info", f"io pressure high: {why}; holding new turns")

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
            self._log(
                "info",
                f"io pressure fell to {fraction * 100:.1f}% stalled (below "
                f"{self.settings.resume_below_percent:g}%): admitting turns again",
            )
        return True

    def note_started(self, now: float) -> bool:
        """A turn was just started: hold further starts until its stall is measured."""
        if self._high:
            return False
        self._enter("settling", now)
        return True

    def pace(self, admission: core.Admission, now: float) -> core.Admission:
        """At most one start per pass; a kept start puts the watch in `settling`."""
        paced = pace_admission(admission, 1)
        if paced.starts:
            self.note_started(now)
        return paced

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


# -- doctor ---------------------------------------------------------------------------


def _probe_trigger(path: Path) -> str:
    """'ok', 'ok, 2 s windows only' or why not, for a trial trigger that is closed at once."""
    wanted = Trigger("some", 150_000, 1_000_000)
    try:
        fd, trigger, _note = _register(path, wanted)
    except PsiUnavailable as error:
        return f"no: {error}"
    os.close(fd)
    if trigger != wanted:
        return f"ok, 2 s windows only ('{trigger.line()}')"
    return "ok, any window from 500 ms"


def psi_status(slice_cgroup: Path | None) -> dict[str, object]:
    """For `volutectl doctor`: is PSI readable, can triggers be registered, per-slice too?"""
    status: dict[str, object] = {"system_path": str(SYSTEM_PRESSURE)}
    try:
        text = SYSTEM_PRESSURE.read_text()
        status["system_readable"] = True
        status["system_some_total_us"] = parse_total(text)
        status["system_trigger"] = _probe_trigger(SYSTEM_PRESSURE)
    except OSError as error:
        status["system_readable"] = False
        status["system_error"] = (
            "PSI is disabled (boot with psi=1)" if error.errno == errno.EOPNOTSUPP
            else error.strerror or str(error)
        )  # fmt: skip
        status["system_trigger"] = "no"
    except ValueError as error:
        status["system_readable"] = False
        status["system_error"] = str(error)
        status["system_trigger"] = "no"
    if slice_cgroup is None:
        status["slice_path"] = None
        status["slice_present"] = False
        status["slice_trigger"] = "no: no cgroup v2 hierarchy"
        return status
    path = slice_cgroup / "io.pressure"
    status["slice_path"] = str(path)
    status["slice_present"] = path.exists()
    status["slice_trigger"] = (
        _probe_trigger(path) if path.exists() else "no: the slice has no cgroup yet"
    )
    return status
