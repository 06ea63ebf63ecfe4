"""The checks of `volutectl doctor` (volutectl/cli/doctor.py): which of volutectl's
protections take effect on this host.

A unit file or config key that sets a weight proves nothing by itself: IOWeight= is a
no-op under mq-deadline (the SD card scheduler on a Raspberry Pi), MemoryHigh= is a
no-op with the memory controller off (a stock Pi), and pressure holds need PSI. Each
check here reads the kernel's own answer and says what to change. It also runs the
minds' preflight (volutectl/launcher/preflight.py), and says whether the caller may use
the socket.

The probes are small functions over paths (a /sys, /proc or cgroup root, a device
number), so tests point them at fake trees. Only the manager and socket checks reach
out. A broken config or a mind that fails preflight (exit 78), or an unreachable
systemd manager (exit 69) is a failure; everything else is advice and exits 0.
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from volutectl.config.settings import Settings, load_settings
from volutectl.errors import EX_CONFIG, EX_OK, EX_UNAVAILABLE, VoluteError
from volutectl.kernel.access import calling_user, socket_access
from volutectl.kernel.probes import (
    CGROUP_ROOT,
    PSI_ENABLE,
    block_device_dir,
    cgroup_v2_root,
    existing_ancestor,
    psi_disabled,
    psi_status,
    slice_cgroup,
)
from volutectl.launcher import preflight
from volutectl.states import AdaptiveMode
from volutectl.wire import messages, protocol
from volutectl.wire.messages import AdaptiveStatus, StatusReply, StatusRequest

Status = Literal["ok", "warn", "fail"]

# Controllers a volute setting relies on: what has no effect without each.
CONTROLLER_USES = {
    "cpu": "CPUWeight=",
    "io": "IOWeight=, IO*BandwidthMax=",
    "memory": "MemoryHigh=, MemoryMax=",
    "pids": "TasksMax=",
}


@dataclass(frozen=True)
class Check:
    """One line of the report: what was found, and what to change if it falls short."""

    check: str
    status: Status
    found: str
    change: str = ""
    exit_code: int = EX_OK  # non-zero only for failures that break volutectl itself

    def line(self) -> str:
        text = f"{self.status:<4} {self.check:<12} {self.found}"
        return f"{text}; change: {self.change}" if self.change else text


# -- cgroups -----------------------------------------------------------------------


def check_cgroup_version(cgroup_root: Path = CGROUP_ROOT) -> Check:
    v2 = cgroup_v2_root(cgroup_root)
    if v2 == cgroup_root:
        return Check("cgroup", "ok", f"cgroup v2, unified hierarchy at {cgroup_root}")
    change = "boot with systemd.unified_cgroup_hierarchy=1 on the kernel command line"
    if v2 is not None:
        return Check(
            "cgroup",
            "warn",
            f"hybrid hierarchy: controllers are on cgroup v1, so weights set on scopes "
            f"and slices are accepted but not enforced ({v2} holds no controllers)",
            change,
        )
    return Check("cgroup", "warn", f"no cgroup v2 hierarchy under {cgroup_root}", change)


def read_words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def check_controllers(cgroup_root: Path = CGROUP_ROOT) -> Check:
    v2 = cgroup_v2_root(cgroup_root)
    if v2 is None:
        return Check("controllers", "warn", "no cgroup v2 hierarchy, so no v2 controllers")
    available = read_words(v2 / "cgroup.controllers")
    enabled = read_words(v2 / "cgroup.subtree_control")
    found = f"available: {' '.join(available) or '(none)'}"
    found += f"; enabled below the root: {' '.join(enabled) or '(none)'}"
    missing = [name for name in CONTROLLER_USES if name not in available]
    if not missing:
        return Check("controllers", "ok", found)
    lost = ", ".join(f"{name} ({CONTROLLER_USES[name]})" for name in missing)
    found += f"; missing, so without effect: {lost}"
    if v2 != cgroup_root:
        change = "see the cgroup line: on a hybrid hierarchy v2 gets no controllers"
    elif "memory" in missing:
        change = (
            "add cgroup_enable=memory to the kernel command line "
            "(/boot/firmware/cmdline.txt on Raspberry Pi OS) and reboot"
        )
    else:
        change = "use a kernel with these controllers (CONFIG_CGROUP_*, CONFIG_BLK_CGROUP)"
    return Check("controllers", "warn", found, change)


# -- the IO scheduler of the state directory's disk ----------------------------------


def parse_scheduler(text: str) -> tuple[str, list[str]]:
    """'none [mq-deadline] bfq' -> ('mq-deadline', ['none', 'mq-deadline', 'bfq'])."""
    words = text.split()
    current = next((w.strip("[]") for w in words if w.startswith("[")), "none")
    return current, [w.strip("[]") for w in words]


def iocost_enabled(major: int, minor: int, cgroup_root: Path = CGROUP_ROOT) -> bool:
    qos = (cgroup_v2_root(cgroup_root) or cgroup_root) / "io.cost.qos"
    try:
        lines = qos.read_text().splitlines()
    except OSError:
        return False
    return any(line.startswith(f"{major}:{minor} ") and "enable=1" in line for line in lines)


def check_io_scheduler(
    state_dir: Path,
    *,
    device: tuple[int, int] | None = None,
    sys_root: Path = Path("/sys"),
    cgroup_root: Path = CGROUP_ROOT,
    io_controller: bool = True,
) -> Check:
    if device is None:
        st_dev = existing_ancestor(state_dir).stat().st_dev
        device = (os.major(st_dev), os.minor(st_dev))
    major, minor = device
    disk = block_device_dir(major, minor, sys_root)
    if disk is None:
        return Check(
            "io-scheduler",
            "warn",
            f"{state_dir} is on device {major}:{minor}, which is no block device "
            "(tmpfs, overlay or a network filesystem); IO weights and caps cannot be checked",
        )
    name = disk.name
    try:
        current, available = parse_scheduler((disk / "queue" / "scheduler").read_text())
    except OSError:
        current, available = "unknown", []
    disk_major_minor = (disk / "dev").read_text().strip() if (disk / "dev").exists() else ""
    whole = tuple(int(part) for part in disk_major_minor.split(":")) if disk_major_minor else ()
    iocost = iocost_enabled(*whole, cgroup_root) if len(whole) == 2 else False
    where = f"{state_dir} is on {name} (scheduler {current})"
    if not io_controller:
        found = f"{where}, but the io controller is off: neither IOWeight= nor io.max caps apply"
        return Check("io-scheduler", "warn", found, "see the controllers line")
    if current == "bfq":
        return Check("io-scheduler", "ok", f"{where}: IOWeight= is enforced by BFQ")
    if iocost:
        return Check("io-scheduler", "ok", f"{where}: IOWeight= is enforced by iocost")
    found = (
        f"{where}: IOWeight= has no effect (it needs BFQ or iocost); "
        "IOReadBandwidthMax=/IOWriteBandwidthMax= caps (io.max) work"
    )
    cap = f'set turns.io_write_bandwidth_max = ["/dev/{name} 8M"] to cap each turn'
    if "bfq" in available:
        change = (
            f"{cap}, or switch to BFQ with a udev rule: "
            f'ACTION=="add|change", KERNEL=="{name}", ATTR{{queue/scheduler}}="bfq"'
        )
    else:
        change = f"{cap} (this kernel offers no BFQ: {' '.join(available) or 'none'})"
    return Check("io-scheduler", "warn", found, change)


# -- pressure stall information ------------------------------------------------------


def check_psi(proc_root: Path = Path("/proc")) -> Check:
    path = proc_root / "pressure" / "io"
    try:
        first = path.read_text().splitlines()[0]
    except FileNotFoundError:
        return Check(
            "psi",
            "warn",
            f"{path} is missing: the kernel has no PSI, so turns cannot be held under IO pressure",
            "use a kernel built with CONFIG_PSI=y",
        )
    except OSError as error:
        if psi_disabled(error):
            return Check(
                "psi",
                "warn",
                f"{path} exists but PSI is disabled (psi=0), so no pressure holds",
                PSI_ENABLE,
            )
        return Check("psi", "warn", f"{path}: {error.strerror}")
    except IndexError:
        first = ""
    return Check("psi", "ok", f"{path}: {first}")


def check_psi_triggers(status: dict[str, object], enabled: bool) -> Check:
    """Can the gate arm a PSI trigger, on the turns slice or system-wide?

    `status` is volutectl.kernel.probes.psi_status(); kept pure so tests can feed it."""
    slice_trigger = str(status.get("slice_trigger", "no"))
    system_trigger = str(status.get("system_trigger", "no"))
    state = "on" if enabled else "off (limits.io_pressure.enabled = false)"
    what = (
        f"pressure gate {state}; trigger on the turns slice ({status.get('slice_path')}): "
        f"{slice_trigger}; on {status.get('system_path')}: {system_trigger}"
    )
    if slice_trigger.startswith("no") and system_trigger.startswith("no"):
        return Check(
            "psi-trigger",
            "warn" if enabled else "ok",
            what,
            "run the gate as root with CAP_SYS_RESOURCE for any window; without it only "
            "2 s windows are accepted, on cgroup v2 io.pressure files",
        )
    if "2 s" in slice_trigger or "2 s" in system_trigger:
        return Check("psi-trigger", "ok", what, "windows round up to 2 s without CAP_SYS_RESOURCE")
    return Check("psi-trigger", "ok", what)


# -- reachability ---------------------------------------------------------------------


def check_manager(probe: Callable[[], str | None], which: str) -> Check:
    problem = probe()
    if problem is None:
        return Check("manager", "ok", f"the {which} systemd manager answers over D-Bus")
    change = (
        "run on a host booted with systemd, with dbus running"
        if which == "system"
        else "start the user manager (loginctl enable-linger USER) and set XDG_RUNTIME_DIR"
    )
    return Check("manager", "fail", problem, change, EX_UNAVAILABLE)


def check_socket(path: Path, timeout: float = 2.0) -> Check:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except FileNotFoundError:
        return Check(
            "socket",
            "warn",
            f"{path} does not exist: the gate is not running, so deliveries cannot be queued",
            "systemctl enable --now volute-gate.socket volute-gate.service",
        )
    except PermissionError:
        return Check(
            "socket",
            "warn",
            f"{path}: permission denied",
            "add this user to group volute (usermod -aG volute USER) and log in again",
        )
    except ConnectionRefusedError:
        return Check(
            "socket",
            "warn",
            f"{path} exists but nothing accepts on it (a stale socket)",
            "systemctl restart volute-gate.service",
        )
    except OSError as error:
        return Check("socket", "warn", f"{path}: {error.strerror or error}")
    finally:
        sock.close()
    return Check("socket", "ok", f"the gate accepts connections on {path}")


SOCKET_UNIT = "volute-gate.socket"


def check_socket_unit(
    configured: Path, load_state: str, active_state: str, listen: list[tuple[str, str]]
) -> Check:
    """Does systemd hold the gate's socket, at the path that clients read from the config?

    The gate serves the socket systemd passes it, wherever that is (see Gate._listen),
    while `deliver` and the other clients connect to gate.socket: the two must agree."""
    enable = f"systemctl enable --now {SOCKET_UNIT}"
    if load_state != "loaded":
        return Check(
            "socket-unit",
            "warn",
            f"{SOCKET_UNIT} is {load_state}: the gate binds {configured} itself, so "
            "deliveries are refused while it restarts",
            f"install {SOCKET_UNIT} (units/ of volutectl), then {enable}",
        )
    paths = [address for kind, address in listen if kind == "Stream"]
    if len(listen) != 1 or len(paths) != 1:
        shown = ", ".join(f"{address} ({kind})" for kind, address in listen) or "nothing"
        return Check(
            "socket-unit",
            "warn",
            f"{SOCKET_UNIT} listens on {shown}; the gate serves exactly one ListenStream=",
            f"systemctl edit {SOCKET_UNIT}: one ListenStream={configured}",
        )
    [path] = paths
    if path != str(configured):
        return Check(
            "socket-unit",
            "warn",
            f"gate.socket is {configured} but {SOCKET_UNIT} listens on {path}: the gate "
            f"serves {path}, the socket systemd passes it, while clients that read the "
            f"config connect to {configured}",
            f'set gate.socket = "{path}" in the config, or move the socket with '
            f"systemctl edit {SOCKET_UNIT} ([Socket] ListenStream= then "
            f"ListenStream={configured})",
        )
    if active_state != "active":
        return Check(
            "socket-unit",
            "warn",
            f"{SOCKET_UNIT} is {active_state}: nothing holds {path} while the gate restarts",
            enable,
        )
    return Check(
        "socket-unit",
        "ok",
        f"{SOCKET_UNIT} listens on {path}: deliveries wait there while the gate restarts",
    )


def _socket_unit_check(configured: Path, user: bool) -> Check:
    try:
        from volutectl.systemd.adapter import Manager

        with Manager.connect(user=user) as manager:
            unit = manager.socket_unit(SOCKET_UNIT)
    except ImportError as error:
        return Check("socket-unit", "warn", f"cannot load the systemd adapter: {error}")
    except VoluteError as error:
        return Check("socket-unit", "warn", f"cannot ask systemd about {SOCKET_UNIT}: {error}")
    return check_socket_unit(configured, unit.load_state, unit.active_state, list(unit.listen))


# -- the adaptive limit, as the running gate has it -----------------------------------------

ADAPTIVE_FALLBACK_CHANGE = (
    "the gate measures again by itself once the signal named works (the psi check above "
    "says whether PSI reads; a disk named is back once /sys/block shows it again); until "
    "then it admits at most limits.adaptive.start turns"
)


def check_adaptive(adaptive: AdaptiveStatus | None, problem: str | None = None) -> Check:
    """The limit in force, from the running gate: a fallback to the start value (a PSI
    file or the probe that failed) is a warning; the config alone cannot say so."""
    if problem is not None:
        return Check("adaptive", "warn", f"cannot ask the gate for its limit: {problem}")
    if adaptive is None:
        return Check("adaptive", "ok", "the gate reports no adaptive limit (it predates it)")
    ceiling = f", under the ceiling {adaptive.ceiling}" if adaptive.ceiling is not None else ""
    if adaptive.mode == AdaptiveMode.STATIC:
        cap = f"the ceiling {adaptive.ceiling}" if adaptive.ceiling is not None else "no cap"
        return Check("adaptive", "ok", f"the adaptive limit is off: {cap} bounds the turns")
    if adaptive.mode == AdaptiveMode.FALLBACK:
        found = (
            f"the adaptive limit fell back to a static {adaptive.limit} turns at once"
            f"{ceiling}: {adaptive.reason}"
        )
        return Check("adaptive", "warn", found, ADAPTIVE_FALLBACK_CHANGE)
    why = f"; last move: {adaptive.reason}" if adaptive.reason else ""
    found = (
        f"the gate's adaptive limit is {adaptive.limit} turns at once (between "
        f"{adaptive.minimum} and {adaptive.maximum}{ceiling}){why}{_watched(adaptive)}"
    )
    return Check("adaptive", "ok", found)


def _watched(adaptive: AdaptiveStatus) -> str:
    """The disks the gate watches, and the one that holds its limit down, if one does."""
    if not adaptive.disks:
        return "; it watches no disk but its state directory's (by its probe)"
    names = ", ".join(f"{disk.device} ({', '.join(disk.holds)})" for disk in adaptive.disks)
    held = f"; held down by the disk {adaptive.held_by}" if adaptive.held_by else ""
    return f"; disks watched: {names}{held}"


def gate_adaptive(path: Path, timeout: float = 2.0) -> tuple[AdaptiveStatus | None, str | None]:
    """(the gate's adaptive status, or why it could not be read)."""
    try:
        connection = protocol.Connection(str(path), timeout=timeout)
    except VoluteError as error:
        return None, error.message
    try:
        connection.send(StatusRequest().to_wire())
        return messages.expect(StatusReply, connection.receive()).status.adaptive, None
    except (VoluteError, OSError) as error:
        return None, error.message if isinstance(error, VoluteError) else str(error)
    finally:
        connection.close()


# -- cron and at ----------------------------------------------------------------------


@dataclass(frozen=True)
class Scheduler:
    """A program that runs a user's jobs later, outside any turn, scope or limit; and the
    files that say whom it takes jobs from (docs/packaging.md, "Cron and at")."""

    name: str
    program: str  # what a user runs to leave a job: setgid crontab, setuid at
    allow: str
    deny: str
    # With neither file: Debian's cron takes every user's jobs; at takes root's alone.
    neither_takes: bool


SCHEDULERS = (
    Scheduler("cron", "crontab", "cron.allow", "cron.deny", neither_takes=True),
    Scheduler("at", "at", "at.allow", "at.deny", neither_takes=False),
)
PROGRAM_DIRS = (Path("/usr/bin"), Path("/bin"))


def _lines(path: Path) -> list[str] | None:
    """An allow or deny file's lines, None if it does not exist. As cron and at read
    one: each whole line is a user name, its newline taken off, nothing else (no
    comments; blanks are part of the name)."""
    try:
        return path.read_text(errors="surrogateescape").split("\n")
    except FileNotFoundError:
        return None


def scheduler_takes(
    scheduler: Scheduler, users: Sequence[str], etc: Path
) -> tuple[list[str], Path | None]:
    """The users whose jobs the scheduler would take, and the file that decides (None:
    neither exists). The allow file, if it exists, names the only users taken; else the
    deny file, if it exists, names the users refused. Raises OSError if one cannot be
    read."""
    allow = _lines(etc / scheduler.allow)
    if allow is not None:
        return [user for user in users if user in allow], etc / scheduler.allow
    deny = _lines(etc / scheduler.deny)
    if deny is not None:
        return [user for user in users if user not in deny], etc / scheduler.deny
    return (list(users) if scheduler.neither_takes else []), None


def _bre(text: str) -> str:
    """`text` as a sed basic regular expression that matches it alone."""
    return "".join("\\" + char if char in ".[]*^$\\/" else char for char in text)


def keep_out_line(
    scheduler: Scheduler, users: Sequence[str], decides: Path | None, etc: Path
) -> str:
    """The one shell line, for root, that keeps `users` out of the scheduler: out of its
    allow file, or into its deny file (made, when neither exists)."""
    if decides is not None and decides.name == scheduler.allow:
        patterns = " ".join(f"-e {shlex.quote('/^' + _bre(user) + '$/d')}" for user in users)
        return f"sed -i {patterns} {decides}"
    deny = etc / scheduler.deny
    text = deny.read_text(errors="surrogateescape") if decides is not None else ""
    newline = "\\n" if text and not text.endswith("\n") else ""  # a last line left open
    names = " ".join(shlex.quote(user) for user in users)
    return f"printf '{newline}%s\\n' {names} >> {deny}"


def check_scheduler(
    scheduler: Scheduler,
    users: Sequence[str],
    etc: Path = Path("/etc"),
    bins: Sequence[Path] = PROGRAM_DIRS,
) -> Check:
    """Whether `scheduler` would take jobs from the minds' `users` (root aside: cron and
    at always take root's), and the line that keeps them out."""
    if not any((where / scheduler.program).exists() for where in bins):
        return Check(scheduler.name, "ok", f"not installed (no {scheduler.program})")
    users = sorted({user for user in users if user != "root"})
    try:
        taken, decides = scheduler_takes(scheduler, users, etc)
    except OSError as error:
        found = f"cannot read {error.filename}: {error.strerror}"
        return Check(scheduler.name, "warn", found, "run `volutectl doctor` as root")
    why = f"by {decides}" if decides is not None else f"no {scheduler.allow} or {scheduler.deny}"
    if not taken:
        return Check(scheduler.name, "ok", f"takes no job from the minds' users ({why})")
    found = (
        f"{scheduler.program} would take jobs from the minds' user(s) {', '.join(taken)} "
        f"({why}): a turn could leave a job that runs later, outside any turn, scope or limit"
    )
    change = "as root: " + keep_out_line(scheduler, taken, decides, etc)
    return Check(scheduler.name, "warn", found, change)


LINGER_DIR = Path("/var/lib/systemd/linger")  # logind's: one empty file per lingering user


def check_linger(users: Sequence[str], linger_dir: Path = LINGER_DIR) -> Check:
    """Whether a mind's user lingers: its user manager then runs at boot and outlives
    every turn, and a turn can start services there (`systemd-run --user`) that no
    turn's scope, limit or pause holds. Where polkit allows it, a turn can turn
    lingering on for its own user (`loginctl enable-linger`): this sees it afterwards."""
    lingering = [user for user in sorted(set(users)) if (linger_dir / user).exists()]
    if not lingering:
        return Check("linger", "ok", "no mind's user lingers (no user manager outlives turns)")
    found = (
        f"the minds' user(s) {', '.join(lingering)} linger: their user managers run "
        "outside any turn, and so does what a turn started there"
    )
    names = " ".join(shlex.quote(user) for user in lingering)
    return Check("linger", "warn", found, f"as root: loginctl disable-linger {names}")


TURNS_GROUP = "volute-turns"  # debian/volutectl.sysusers: the turns' users
# The package's rule (packaging/polkit/): polkit refuses lingering to TURNS_GROUP.
POLKIT_RULE = Path("/usr/share/polkit-1/rules.d/40-volutectl.rules")


def in_group(user: str, group: str) -> bool | None:
    """Whether `user` is in `group` as polkit's `subject.isInGroup` sees it (getgrouplist:
    its primary group and /etc/group's lists); None if there is no such user."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        return False
    return gid in os.getgrouplist(user, entry.pw_gid)


def _group_exists(group: str) -> bool:
    try:
        grp.getgrnam(group)
    except KeyError:
        return False
    return True


def check_linger_rule(
    users: Sequence[str],
    covered: Callable[[str], bool | None] = lambda user: in_group(user, TURNS_GROUP),
    rule: Path = POLKIT_RULE,
    group_exists: Callable[[str], bool] = _group_exists,
) -> Check:
    """Whether the package's polkit rule refuses lingering to every mind's user: it
    refuses members of group volute-turns, which the admin adds a mind's own user to
    (docs/packaging.md, "Lingering"). Users that do not exist are the mind check's."""
    users = sorted({user for user in users if user != "root"})
    if not rule.exists():
        found = f"{rule} is missing: where polkitd runs, a turn may make its user linger"
        return Check("linger-rule", "warn", found, "install the volutectl package, which ships it")
    outside = [user for user in users if covered(user) is False]
    if not outside:
        return Check("linger-rule", "ok", f"{rule.name} refuses the minds' users lingering")
    found = (
        f"the minds' user(s) {', '.join(outside)} are not in group {TURNS_GROUP}: "
        f"{rule.name} does not refuse them lingering, and a turn could then leave "
        "services running in its user manager (loginctl enable-linger; systemd-run --user)"
    )
    lines = [f"usermod -a -G {TURNS_GROUP} {shlex.quote(user)}" for user in outside]
    if not group_exists(TURNS_GROUP):
        lines.insert(0, f"groupadd -r {TURNS_GROUP}")
    return Check("linger-rule", "warn", found, "as root: " + "; ".join(lines))


def mind_users(settings: Settings) -> list[str]:
    """The users the minds' turns run as."""
    default = settings.turns.default_user
    return sorted({mind.user or default for mind in settings.minds.values()})


# -- the report ------------------------------------------------------------------------


def run_checks(config_path: str | None) -> list[Check]:
    checks: list[Check] = []
    try:
        loaded = load_settings(config_path)
    except VoluteError as error:
        settings = Settings()
        change = error.hint or "fix the key named, then `volutectl config check`"
        checks.append(Check("config", "fail", error.message, change, EX_CONFIG))
    else:
        settings = loaded.settings
        source = str(loaded.path) if loaded.path else "defaults (no config file)"
        checks.append(Check("config", "ok", f"valid: {source}"))
    checks.append(check_cgroup_version())
    checks.append(check_controllers())
    # On a hybrid or legacy hierarchy systemd maps IO*= onto blkio: the scheduler still decides.
    cgroup_root = CGROUP_ROOT
    unified = cgroup_v2_root(cgroup_root) == cgroup_root
    io_controller = not unified or "io" in read_words(cgroup_root / "cgroup.controllers")
    checks.append(check_io_scheduler(settings.gate.state_dir, io_controller=io_controller))
    checks.append(check_psi())
    status = psi_status(slice_cgroup(settings.turns.slice))
    checks.append(check_psi_triggers(status, settings.limits.io_pressure.enabled))
    which = settings.gate.manager
    checks.append(check_manager(lambda: _manager_problem(which == "user"), which))
    checks.append(check_socket(settings.gate.socket))
    checks.append(_socket_unit_check(settings.gate.socket, which == "user"))
    checks.append(check_socket_access(settings))
    checks.append(Check("turn-cap", *preflight.check_cap(settings)))
    checks.append(check_adaptive(*gate_adaptive(settings.gate.socket)))
    checks.extend(check_mind(report) for report in preflight.check_minds(settings))
    if settings.minds:
        checks.extend(check_scheduler(s, mind_users(settings)) for s in SCHEDULERS)
        checks.append(check_linger(mind_users(settings)))
        checks.append(check_linger_rule(mind_users(settings)))
    return checks


def check_socket_access(settings: Settings) -> Check:
    """May the calling user connect to the gate's socket (root, or in its group)?"""
    path, group = str(settings.gate.socket), settings.gate.socket_group
    return Check("socket-access", *socket_access(path, group, *calling_user()))


def check_mind(report: preflight.MindReport) -> Check:
    """One mind: its user, its command and its working directory, as its turns need them;
    a warning where it is not kept apart from other minds or from the socket."""
    notes = "".join(f"; {note}" for note in report.notes)
    if not report.problems:
        found = f"runs as {report.user}: user, command and working directory pass{notes}"
        if report.warnings:
            found = "; ".join(report.warnings) + f"; {found}"
            return Check(f"mind {report.mind}", "warn", found, preflight.APART_HINT)
        return Check(f"mind {report.mind}", "ok", found)
    change = (
        "fix it (a config change needs a restart of the gate); "
        "until then every turn of this mind fails"
    )
    found = "; ".join((*report.problems, *report.warnings)) + notes
    return Check(f"mind {report.mind}", "fail", found, change, EX_CONFIG)


def _manager_problem(user: bool) -> str | None:
    try:
        from volutectl.systemd.adapter import Manager
    except ImportError as error:  # pystemd missing: the manager is out of reach too
        return f"cannot load the systemd adapter: {error}"
    try:
        Manager.connect(user=user).close()
    except VoluteError as error:  # unreachable, refused, or failing: each says why
        return error.message
    return None


def exit_code(checks: list[Check]) -> int:
    """The first required failure's code, config before manager; else 0."""
    codes = [check.exit_code for check in checks if check.status == "fail" and check.exit_code]
    if EX_CONFIG in codes:
        return EX_CONFIG
    return codes[0] if codes else EX_OK
