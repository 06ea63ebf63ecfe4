"""What this host's kernel offers volutectl, asked of its files: the cgroup v2 hierarchy,
the cgroup directory of a slice, the disk behind a path, and pressure stall information
(PSI): readable, and whether a trigger can be registered on it.

The gate uses these to place its pressure watch, and `volutectl doctor` to report what
works here. Each takes its root as a parameter, so tests point it at a fake tree.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from volutectl.core.psi import Trigger, coarse_trigger, parse_total

SYSTEM_PRESSURE = Path("/proc/pressure/io")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The kernel refuses PSI files with EOPNOTSUPP when booted with psi=0 (or built with
# CONFIG_PSI_DEFAULT_DISABLED): the one fix, said in one place.
PSI_ENABLE = "add psi=1 to the kernel command line and reboot"
PSI_DISABLED = f"PSI is disabled ({PSI_ENABLE})"


def psi_disabled(error: OSError) -> bool:
    return error.errno == errno.EOPNOTSUPP


# -- cgroups -----------------------------------------------------------------------------


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


def readable_pressure(
    slice_name: str, name: str, system: Path, cgroup_root: Path = CGROUP_ROOT
) -> Path | None:
    """The turns slice's pressure file `name` (io.pressure, cpu.pressure) when it reads
    as PSI, else `system`'s (/proc/pressure/...), else None."""
    found = slice_pressure(slice_name, name, cgroup_root)
    return found if found is not None else _reads_as_psi(system)


def preferring_slice(
    path: Path, slice_name: str, name: str, system: Path, cgroup_root: Path = CGROUP_ROOT
) -> Path:
    """The file to read next of a gate that reads `path`: the turns slice's `name` once
    it reads as PSI while `path` is the system's (a gate started before the first turn,
    which makes the slice's cgroup), else `path`."""
    if path != system:
        return path
    return slice_pressure(slice_name, name, cgroup_root) or path


def slice_pressure(slice_name: str, name: str, cgroup_root: Path = CGROUP_ROOT) -> Path | None:
    """The turns slice's pressure file `name` if it reads as PSI: not before the slice
    is started (systemd makes its cgroup then, with the first turn), nor without a v2
    hierarchy."""
    cgroup = slice_cgroup(slice_name, cgroup_root)
    return _reads_as_psi(cgroup / name) if cgroup is not None else None


def _reads_as_psi(path: Path) -> Path | None:
    try:
        parse_total(path.read_text())
    except (OSError, ValueError):
        return None
    return path


# -- block devices -----------------------------------------------------------------------


def existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def block_device_dir(major: int, minor: int, sys_root: Path = Path("/sys")) -> Path | None:
    """The sysfs directory of the whole disk behind a device number (a partition's parent)."""
    link = sys_root / "dev" / "block" / f"{major}:{minor}"
    if not link.exists():
        return None
    device = link.resolve()
    if (device / "partition").exists():
        device = device.parent
    return device


# -- PSI triggers ------------------------------------------------------------------------


class PsiUnavailable(Exception):
    """No trigger could be registered on a PSI file."""


def register_trigger(path: Path, trigger: Trigger) -> tuple[int, Trigger, str]:
    """Open `path` and register `trigger`, or the 2 s-window fallback on EINVAL.

    Without CAP_SYS_RESOURCE the kernel accepts only windows that are multiples of 2 s.
    Returns (fd, the trigger in use, a note on why a fallback was used); the trigger
    lives as long as the fd."""
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
    if last is not None and psi_disabled(last):
        reason = PSI_DISABLED
    raise PsiUnavailable(f"cannot register a PSI trigger on {path}: {reason}")


def probe_trigger(path: Path) -> str:
    """'ok', 'ok, 2 s windows only' or why not, for a trial trigger that is closed at once."""
    wanted = Trigger("some", 150_000, 1_000_000)
    try:
        fd, trigger, _note = register_trigger(path, wanted)
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
        status["system_trigger"] = probe_trigger(SYSTEM_PRESSURE)
    except OSError as error:
        status["system_readable"] = False
        status["system_error"] = (
            PSI_DISABLED if psi_disabled(error) else error.strerror or str(error)
        )
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
        probe_trigger(path) if path.exists() else "no: the slice has no cgroup yet"
    )
    return status
