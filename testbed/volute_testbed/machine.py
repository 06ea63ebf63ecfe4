"""A throwaway systemd, booted with systemd-nspawn over an overlay of this machine's root.

Used by the system tests (the `machine` fixture), the benchmarks and the README demo,
through `dev_machine()`; the install tiers `boot()` a debootstrapped root instead.
Every write the container makes lands in a tmpfs upper layer; nothing reaches the
host's root. systemd is never started on the host's own root: `boot()` refuses any root
that is not the overlay it just built.

The checkout (and anything else listed in `binds`) is bind-mounted at the same path
inside, so a virtualenv made on the host works unchanged in the container, and files
that change while the container runs are not served stale from the overlay's lower
layer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from volute_testbed.paths import CHECKOUT, SCRIPTS

# Units that slow the boot or fail in a container; masked in the overlay only.
MASKED_UNITS = (
    "postgresql.service",
    "getty@.service",
    "console-getty.service",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "man-db.timer",
    "e2scrub_all.timer",
    "dpkg-db-backup.timer",
    "fstrim.timer",
    "systemd-networkd-wait-online.service",
    "docker.service",
    "docker.socket",
    "containerd.service",
    "ssh.service",
    "cron.service",
    "exim4.service",
    "redis-server.service",
    "nginx.service",
    "memcached.service",
)

CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class MachineError(RuntimeError):
    pass


def nspawn_available() -> str | None:
    """Why a container cannot be booted here, or None if it can."""
    if os.geteuid() != 0:
        return "booting a systemd-nspawn container needs root"
    for tool in ("systemd-nspawn", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install systemd-container)"
    if not Path("/lib/systemd/systemd").exists():
        return "/lib/systemd/systemd is missing (apt-get install systemd)"
    return None


@dataclass
class Machine:
    """A running container. Enter it with `run()`; its files are under `host_path()`."""

    name: str
    base: Path
    nspawn: subprocess.Popen[bytes]
    leader: int
    env: dict[str, str] = field(default_factory=dict)

    @property
    def root(self) -> Path:
        return self.base / "root"

    def host_path(self, path: str | os.PathLike[str]) -> Path:
        """The host-side path of a file in the container (not for /tmp or /run inside)."""
        return self.root / str(path).lstrip("/")

    def command(
        self,
        argv: Sequence[str],
        *,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> list[str]:
        """The host-side argv that runs `argv` inside the container, with a clean env."""
        cmd = ["nsenter", "-t", str(self.leader), "-a"]
        if user is not None:
            cmd += ["setpriv", "--reuid", user, "--regid", user, "--init-groups", "--"]
        return [*cmd, "env", "-i", *[f"{k}={v}" for k, v in self._env(env).items()], *argv]

    def _env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {"PATH": CLEAN_PATH, "LANG": "C.UTF-8", "HOME": "/root", "SYSTEMD_PAGER": ""}
        env.update(self.env)
        if extra:
            env.update(extra)
        return env

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        input: str | bytes | None = None,
        timeout: float = 60,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        cmd = self.command(argv, user=user, env=env)
        text_input = input.decode() if isinstance(input, bytes) else input
        proc = subprocess.run(
            cmd, input=text_input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise MachineError(
                f"in container {self.name}: {' '.join(argv)} exited {proc.returncode}\n"
                f"stdout: {proc.stdout}\nstderr: {proc.stderr}"
            )
        return proc

    def sh(self, script: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return self.run(["/bin/sh", "-c", script], **kwargs)  # type: ignore[arg-type]

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(self.command(argv, env=env), text=True, **kwargs)  # type: ignore[call-overload, no-any-return]

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        target = self.host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)

    def wait_running(self, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                log = (self.base / "nspawn.log").read_text(errors="replace")[-2000:]
                raise MachineError(f"systemd-nspawn exited {self.nspawn.returncode}: {log}")
            proc = self.run(["systemctl", "is-system-running"], check=False, timeout=10)
            state = proc.stdout.strip() or proc.stderr.strip()
            if state in ("running", "degraded"):
                return state
            time.sleep(0.05)
        raise MachineError(f"container {self.name} did not finish booting: {state!r}")


def _find_leader(nspawn_pid: int, timeout: float = 10, log: Path | None = None) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{nspawn_pid}").exists() or _is_zombie(nspawn_pid):
            text = log.read_text(errors="replace")[-2000:] if log else ""
            raise MachineError(f"systemd-nspawn exited early: {text}")
        children = Path(f"/proc/{nspawn_pid}/task/{nspawn_pid}/children")
        with contextlib.suppress(OSError):
            # nspawn's first child is a short-lived setup process; the container's init
            # is the child that has exec'd systemd (PID 1 in its own namespace).
            for pid in children.read_text().split():
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                    return int(pid)
        time.sleep(0.01)
    raise MachineError("systemd-nspawn started no container init")


CGROUP_HIERARCHIES = ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")


def _private_cgroups(name: str) -> list[Path]:
    """A fresh cgroup per container in each systemd-relevant hierarchy that exists."""
    made = []
    for root in CGROUP_HIERARCHIES:
        base = Path(root)
        if not (base / "cgroup.procs").exists():
            continue
        if root == "/sys/fs/cgroup" and not (base / "cgroup.controllers").exists():
            continue  # v1 tmpfs root, not a hierarchy of its own
        path = base / f"volute-machine-{name}"
        path.mkdir(exist_ok=True)
        made.append(path)
    return made


def _enter_cgroups(cgroups: list[Path]) -> None:
    for path in cgroups:
        (path / "cgroup.procs").write_text(str(os.getpid()))


def _remove_cgroups(cgroups: list[Path]) -> None:
    """Remove the container's cgroup trees, deepest first (they are empty once it died)."""
    for top in cgroups:
        for _ in range(50):
            dirs = sorted(
                (p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
            )
            for path in [*dirs, top]:
                with contextlib.suppress(OSError):
                    path.rmdir()
            if not top.exists():
                break
            time.sleep(0.1)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@contextlib.contextmanager
def boot(
    *,
    binds: Sequence[str | os.PathLike[str]] = (),
    name: str | None = None,
    lower: str = "/",
    mask: Sequence[str] = MASKED_UNITS,
    extra_args: Sequence[str] = (),
    prepare: Mapping[str, str] | None = None,
    boot_timeout: float = 30,
) -> Iterator[Machine]:
    """Boot a container over an overlay of `lower`, yield it, and tear it all down."""
    reason = nspawn_available()
    if reason is not None:
        raise MachineError(reason)
    base = Path(tempfile.mkdtemp(prefix="volute-machine.", dir="/var/tmp"))
    suffix = "".join(ch for ch in base.name.rsplit(".", 1)[-1].lower() if ch.isalnum())
    name = name or f"volute-{suffix}"
    mounted: list[Path] = []
    cgroups: list[Path] = []
    nspawn: subprocess.Popen[bytes] | None = None
    try:
        root = _mount_overlay(base, lower, mounted)
        _prepare_root(root, mask, prepare or {})
        # Without systemd on the host, nspawn puts the container's cgroup tree under the
        # caller's cgroup: "/" here. Two containers would then share one tree, and one
        # container's systemd would reap the other's scopes. Each gets its own, named
        # after its directory too: two machines of one name (the same test in two
        # checkouts, or two modules' tests of one name side by side) never share one.
        cgroups = _private_cgroups(f"{name}-{suffix}")
        nspawn = _start_nspawn(_nspawn_argv(root, name, binds, extra_args), base, cgroups)
        machine = Machine(
            name=name,
            base=base,
            nspawn=nspawn,
            leader=_find_leader(nspawn.pid, log=base / "nspawn.log"),
        )
        machine.wait_running(boot_timeout)
        yield machine
    finally:
        _tear_down(base, nspawn, mounted, cgroups)


def _mount_overlay(base: Path, lower: str, mounted: list[Path]) -> Path:
    """A tmpfs at `base` holding an overlay of `lower`: the container's root. Each mount
    made is added to `mounted` at once, for the tear-down."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(base)], check=True)
    mounted.append(base)
    for sub in ("upper", "work", "root"):
        (base / sub).mkdir()
    root = base / "root"
    options = f"lowerdir={lower},upperdir={base}/upper,workdir={base}/work"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(root)], check=True)
    mounted.append(root)
    # The guard the notes ask for: the root we boot must be our own overlay.
    if not os.path.ismount(root) or root.resolve() == Path("/"):
        raise MachineError(f"refusing to boot systemd on {root}: not our overlay")
    return root


def _prepare_root(root: Path, mask: Sequence[str], prepare: Mapping[str, str]) -> None:
    """Mask `mask`'s units, give the machine an id, and write `prepare`'s files."""
    unit_dir = root / "etc/systemd/system"
    unit_dir.mkdir(parents=True, exist_ok=True)
    for unit in mask:
        link = unit_dir / unit
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to("/dev/null")
    # A machine-id keeps journald and friends quiet; /etc/machine-id may be empty.
    (root / "etc/machine-id").write_text(os.urandom(16).hex() + "\n")
    for path, text in prepare.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def _nspawn_argv(
    root: Path, name: str, binds: Sequence[str | os.PathLike[str]], extra_args: Sequence[str]
) -> list[str]:
    args = ["systemd-nspawn", "-q", "-D", str(root), "--register=no", "--keep-unit"]
    args += ["-M", name]
    for bind in binds:
        path = os.fspath(bind)
        args.append(f"--bind={path}:{path}")
    return [*args, *extra_args, "--boot"]


def _start_nspawn(args: list[str], base: Path, cgroups: list[Path]) -> subprocess.Popen[bytes]:
    """Start systemd-nspawn in `cgroups`, its output in `base`/nspawn.log."""
    log = open(base / "nspawn.log", "wb")  # closed below, once nspawn holds it
    try:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: _enter_cgroups(cgroups),
        )
    finally:
        log.close()


def _tear_down(
    base: Path,
    nspawn: subprocess.Popen[bytes] | None,
    mounted: list[Path],
    cgroups: list[Path],
) -> None:
    """Kill the container, unmount what was mounted, remove its cgroups and `base`."""
    if nspawn is not None and nspawn.poll() is None:
        # SIGKILL of the container's init tears the whole PID namespace down at once;
        # a graceful poweroff would only cost time in a throwaway machine.
        with contextlib.suppress(ProcessLookupError, MachineError):
            os.kill(_find_leader(nspawn.pid, timeout=0.5), signal.SIGKILL)
        try:
            nspawn.wait(timeout=10)
        except subprocess.TimeoutExpired:
            nspawn.kill()
            nspawn.wait(timeout=10)
    for mount in reversed(mounted):
        subprocess.run(["umount", "-l", str(mount)], check=False)
    _remove_cgroups(cgroups)
    with contextlib.suppress(OSError):
        base.rmdir()


def machine_binds() -> list[Path]:
    """The checkout, and the interpreter's environment when it lives elsewhere."""
    binds = [CHECKOUT]
    venv = Path(sys.prefix)
    if not venv.is_relative_to(CHECKOUT):
        binds.append(venv)
    return binds


def open_interpreter_path(machine: Machine) -> None:
    """Let non-root users in the container run the venv (its python may live under /root).

    Only the container's overlay copy of each directory changes, never the host's.
    """
    real = Path(os.path.realpath(sys.executable))
    dirs = [str(parent) for parent in real.parents if str(parent) != "/"]
    machine.run(["chmod", "a+x", *dirs])


@contextlib.contextmanager
def dev_machine(
    *, name: str | None = None, binds: Sequence[str | os.PathLike[str]] = ()
) -> Iterator[Machine]:
    """A booted machine that runs this checkout's volutectl with the tests' interpreter.

    The checkout and the interpreter's environment are bound in (plus `binds`), the
    environment's scripts directory leads PATH, and non-root users may run the
    interpreter.
    """
    with boot(binds=[*machine_binds(), *binds], name=name) as machine:
        machine.env["PATH"] = f"{SCRIPTS}:{CLEAN_PATH}"
        open_interpreter_path(machine)
        yield machine
