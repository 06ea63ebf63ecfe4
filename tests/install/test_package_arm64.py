"""The install tier on arm64, the Raspberry Pi's architecture, under qemu-user emulation.

Raspberry Pi OS is Debian trixie on arm64. The amd64 install tier proves the packaging;
this one proves that Debian's arm64 builds of our dependencies (python3-pystemd has a C
extension) and Python on aarch64 work with our code. It installs the very
`Architecture: all` .debs that packaging/build-deb produced on this host, not an arm64
rebuild, into a debootstrapped arm64 trixie root booted with systemd-nspawn, with
qemu-aarch64 registered as a binfmt_misc handler only while the tier runs (binfmt.py).
On an arm64 host it runs natively and registers nothing.

Checks: `uname -m` is aarch64; the gate service is active; a delivered turn shows as a
scope under volute-turns.slice in `systemctl status`; `volutectl doctor` runs; and
`volutectl test --slots 1` holds a slot file in a small git repository and passes the
command's exit status through.

Run: .venv/bin/pytest -m install_arm64 tests/install   (root; ./run-tests excludes it,
.ci/run runs it as its own step). Cold, 4 to 7 min: debootstrap 2.5 to 6 min, apt-get
install inside about 1 min; warm, under 2 min (docs/benchmarks.md). $VOLUTE_DEBS names
a directory of already built .debs to install instead of running build-deb. Artifacts, in
$VOLUTE_ARTIFACTS (default dist/install-tier): arm64-systemctl-status-volute-turns.slice.txt,
arm64-doctor.txt, arm64-timings.json.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from tests.install.binfmt import qemu_aarch64, unavailable
from tests.install.rootfs import CACHE, RootSpec, apt_cache_binds, ensure_root, host_arch
from tests.machine import MASKED_UNITS, Machine, boot

pytestmark = pytest.mark.install_arm64

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("VOLUTE_ARTIFACTS", REPO / "dist" / "install-tier"))
# git is in the root itself: `volutectl test` needs it, and installing it at each run
# would cost a minute of emulated dpkg.
ARM64_ROOT = RootSpec(arch="arm64", include=(*RootSpec().include, "git"))
MIND = "probe"
TURN_SECONDS = 30
# Under qemu-user, the mounts systemd-executor makes for a unit's credentials
# (/run/credentials) and for mount namespacing fail with EINVAL: units that import
# credentials (journald, sysusers, tmpfiles) then fail at step CREDENTIALS, and
# logind, sandboxed with a mount namespace, at step NAMESPACE. Only in the emulated
# overlay: credentials are dropped from every service, and logind is masked. The gate's
# unit uses neither (docs/packaging.md says why), so it runs as it would on a Pi.
EMULATION_DROPIN = {
    "/etc/systemd/system/service.d/90-volute-qemu-user.conf": (
        "# qemu-user cannot mount the credentials directory\n"
        "[Service]\nImportCredential=\nLoadCredential=\nSetCredential=\n"
    )
}
EMULATION_MASK = ("systemd-logind.service",)
BOOT_TIMEOUT = 180  # an emulated systemd boots in tens of seconds
APT_TIMEOUT = 1200


@dataclass
class Timings:
    """Seconds, for docs/benchmarks.md; written to <arch>-timings.json."""

    arch: str
    root_cached: bool = True
    root_s: float = 0.0
    build_deb_s: float = 0.0
    boot_s: float = 0.0
    install_s: float = 0.0
    deliver_cli_s: float = 0.0
    first_turn_launch_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class Installed:
    machine: Machine
    debs: list[Path]
    timings: Timings


def artifact(name: str, text: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / name).write_text(text)


def apt_binds(arch: str) -> list[str]:
    """A package index and a .deb cache of this architecture's own (apt-lists-arm64,
    apt-archives-arm64): a shared index would be pruned to the other architecture by each
    `apt-get update`, and a shared archive lock makes a concurrent amd64 tier's apt fail
    ours. The amd64 tier's own caches (rootfs.apt_cache_binds) are left as they are."""
    if arch == host_arch():
        return apt_cache_binds()
    binds = []
    for name, inside in (
        ("apt-archives", "/var/cache/apt/archives"),
        ("apt-lists", "/var/lib/apt/lists"),
    ):
        path = CACHE / f"{name}-{arch}"
        (path / "partial").mkdir(parents=True, exist_ok=True)
        binds.append(f"--bind={path}:{inside}")
    return binds


def build_debs(out: Path) -> list[Path]:
    result = subprocess.run(
        [str(REPO / "packaging" / "build-deb"), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return sorted(out.glob("*.deb"))


def deb_field(deb: Path, name: str) -> str:
    return subprocess.run(
        ["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True, check=True
    ).stdout.strip()


@contextlib.contextmanager
def booted_with_package(root: Path, debs: list[Path], arch: str, name: str) -> Iterator[Installed]:
    """Boot an overlay of `root`, apt-get install the .debs inside, and time both."""
    timings = Timings(arch=arch)
    emulated = arch != host_arch()
    prepare = {"/etc/resolv.conf": Path("/etc/resolv.conf").read_text()}
    started = time.monotonic()
    with boot(
        lower=str(root),
        name=name,
        binds=sorted({deb.parent for deb in debs}),
        extra_args=apt_binds(arch),
        prepare={**prepare, **EMULATION_DROPIN} if emulated else prepare,
        mask=(*MASKED_UNITS, *EMULATION_MASK) if emulated else MASKED_UNITS,
        boot_timeout=BOOT_TIMEOUT,
    ) as machine:
        timings.boot_s = time.monotonic() - started
        started = time.monotonic()
        # Runs of this tier that share the caches take turns at apt.
        with open(CACHE / f"apt-{arch}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            result = machine.sh(
                "apt-get update -q && apt-get install -y -q --no-install-recommends "
                + " ".join(str(deb) for deb in debs),
                env={"DEBIAN_FRONTEND": "noninteractive"},
                timeout=APT_TIMEOUT,
                check=False,
            )
        timings.install_s = time.monotonic() - started
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        yield Installed(machine, debs, timings)


def configure_mind(m: Machine, mind: str, command: str) -> None:
    config = m.host_path("/etc/volute/volutectl.toml")
    config.write_text(config.read_text() + f"\n[minds.{mind}]\ncommand = {command}\n")
    m.run(["volutectl", "config", "check"], timeout=120)


def live_turns(m: Machine) -> list[str]:
    listed = m.run(["systemctl", "list-units", "--plain", "--no-legend", "volute-turn-*.scope"])
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def deliver_and_wait_for_scope(
    m: Machine, mind: str, timeout: float = 120
) -> tuple[str, float, float]:
    """Deliver to `mind` and wait for its turn's scope: (scope, deliver CLI seconds,
    seconds from the deliver command's start to the scope's ActiveEnterTimestamp)."""
    before = set(live_turns(m))
    started = time.monotonic()
    delivery = m.run(["volutectl", "deliver", mind, "--message", "hello from aarch64"], timeout=120)
    deliver_s = time.monotonic() - started
    assert delivery.stdout.strip(), "deliver printed no delivery id"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = [s for s in live_turns(m) if s not in before and s.startswith(f"volute-turn-{mind}-")]
        if new:
            # nspawn makes no time namespace: the scope's CLOCK_MONOTONIC is ours.
            entered = m.run(["systemctl", "show", "-P", "ActiveEnterTimestampMonotonic", new[0]])
            assert entered.stdout.strip() not in ("", "0"), entered.stdout
            return new[0], deliver_s, int(entered.stdout) / 1e6 - started
        time.sleep(0.1)
    journal = m.run(["journalctl", "-b", "--no-pager", "-u", "volute-gate.service"], check=False)
    raise AssertionError(f"no turn scope for {mind} within {timeout} s:\n{journal.stdout[-3000:]}")


@pytest.fixture(scope="module")
def aarch64() -> Iterator[str]:
    """aarch64 binaries run while this is alive; the handler goes away after the module."""
    if host_arch() == "arm64":
        yield "native"
        return
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"cannot emulate aarch64: {reason}")
    with qemu_aarch64() as handler:
        yield handler


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], float]:
    given = os.environ.get("VOLUTE_DEBS")
    started = time.monotonic()
    if given:
        found = sorted(Path(given).glob("*.deb"))
        assert found, f"VOLUTE_DEBS={given} holds no .deb"
        return found, 0.0
    return build_debs(tmp_path_factory.mktemp("debs")), time.monotonic() - started


@pytest.fixture(scope="module")
def installed(aarch64: str, debs: tuple[list[Path], float]) -> Iterator[Installed]:
    packages, build_s = debs
    started = time.monotonic()
    stamp = CACHE / ARM64_ROOT.key / ".volute-rootfs-complete"
    cached = stamp.exists()
    root = ensure_root(ARM64_ROOT)
    root_s = time.monotonic() - started
    with booted_with_package(root, packages, "arm64", "vt-arm64") as result:
        result.timings.root_cached, result.timings.root_s = cached, root_s
        result.timings.build_deb_s = build_s
        try:
            yield result
        finally:
            artifact("arm64-timings.json", json.dumps(asdict(result.timings), indent=2) + "\n")


def test_the_architecture_all_debs_run_on_aarch64(installed: Installed) -> None:
    m = installed.machine
    assert m.run(["uname", "-m"]).stdout.strip() == "aarch64"
    assert m.run(["dpkg", "--print-architecture"]).stdout.strip() == "arm64"
    state = m.run(["systemctl", "is-system-running"], check=False).stdout.strip()
    failed = m.run(["systemctl", "--failed", "--no-legend", "--plain"], check=False).stdout
    assert state == "running", failed
    machine = m.run(["python3", "-c", "import platform; print(platform.machine())"], timeout=120)
    assert machine.stdout.strip() == "aarch64"
    for deb in installed.debs:
        # The host's build, unchanged: an arm64 root installs the amd64 host's output.
        assert deb_field(deb, "Architecture") == "all", deb
        package, version = deb_field(deb, "Package"), deb_field(deb, "Version")
        got = m.run(["dpkg-query", "-W", "-f=${Version} ${Architecture}", package]).stdout
        assert got == f"{version} all", (package, got)
    # Debian's arm64 builds of the dependencies, the compiled one included.
    for package in ("python3-pystemd", "python3-click", "python3-pydantic-settings"):
        arch = m.run(["dpkg-query", "-W", "-f=${Architecture}", package]).stdout
        assert arch in ("arm64", "all"), (package, arch)
    assert m.run(["dpkg-query", "-W", "-f=${Architecture}", "python3-pystemd"]).stdout == "arm64"
    m.run(["python3", "-c", "import pystemd.dbuslib, inotify_simple, volutectl"], timeout=120)
    verify = m.run(["dpkg", "--verify", "volutectl", "python3-inotify-simple"], check=False)
    assert verify.returncode == 0 and verify.stdout == "", verify.stdout


def test_the_gate_service_is_active_after_install(installed: Installed) -> None:
    m = installed.machine
    state = m.run(["systemctl", "is-active", "volute-gate.service"], check=False).stdout.strip()
    if state == "activating":
        time.sleep(10)  # python3's first imports under emulation take seconds
        state = m.run(["systemctl", "is-active", "volute-gate.service"], check=False).stdout
    assert state.strip() == "active", m.run(
        ["journalctl", "-b", "--no-pager", "-u", "volute-gate.service"], check=False
    ).stdout[-3000:]


def test_doctor_runs_and_reaches_the_manager(installed: Installed) -> None:
    m = installed.machine
    result = m.run(["volutectl", "doctor", "--json"], check=False, timeout=120)
    report = json.loads(result.stdout)
    by_name = {check["check"]: check for check in report["checks"]}
    assert by_name["config"]["status"] == "ok", by_name["config"]
    assert by_name["manager"]["status"] == "ok", by_name["manager"]
    assert by_name["socket"]["status"] == "ok", by_name["socket"]
    assert result.returncode == 0, result.stdout + result.stderr
    text = m.run(["volutectl", "doctor"], check=False, timeout=120).stdout
    artifact("arm64-doctor.txt", m.run(["uname", "-m"]).stdout + text)


def test_a_delivered_turn_is_a_scope_under_volute_turns_slice(installed: Installed) -> None:
    m = installed.machine
    configure_mind(m, MIND, f'["/bin/sleep", "{TURN_SECONDS}"]')
    m.run(["systemctl", "restart", "volute-gate.service"], timeout=120)
    assert m.run(["systemctl", "is-active", "volute-gate.service"]).stdout.strip() == "active"
    scope, deliver_s, launch_s = deliver_and_wait_for_scope(m, MIND)
    installed.timings.deliver_cli_s, installed.timings.first_turn_launch_s = deliver_s, launch_s
    uname = m.run(["uname", "-m"]).stdout
    status = m.run(["systemctl", "status", "--no-pager", "volute-turns.slice"], check=False)
    artifact(
        "arm64-systemctl-status-volute-turns.slice.txt",
        f"# uname -m\n{uname}# systemctl status --no-pager volute-turns.slice\n{status.stdout}",
    )
    assert uname.strip() == "aarch64"
    assert scope.startswith(f"volute-turn-{MIND}-")
    assert scope in status.stdout and "sleep" in status.stdout, status.stdout
    assert m.run(["systemctl", "show", "-P", "Slice", scope]).stdout.strip() == "volute-turns.slice"
    assert m.run(["systemctl", "is-active", scope]).stdout.strip() == "active"


def test_volutectl_test_holds_a_slot_and_passes_the_exit_status(installed: Installed) -> None:
    m = installed.machine
    m.sh(
        "set -e; mkdir -p /srv/repo && cd /srv/repo && git init -q"
        " && git -c user.name=t -c user.email=t@t commit -q --allow-empty -m init"
    )
    ran = m.sh("cd /srv/repo && volutectl test --slots 1 --json -- true", timeout=120, check=False)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    outcome = json.loads(ran.stdout.splitlines()[-1])
    slot = "/srv/repo/.git/volute/test-slots/slot-1"
    assert outcome["slot"] == slot and outcome["exit_status"] == 0, outcome
    assert m.host_path(slot).is_file()
    # The command runs in a scope in volute-tests.slice, and its exit status comes back.
    failed = m.sh(
        "cd /srv/repo && volutectl test --slots 1 -- sh -c 'cat /proc/self/cgroup; exit 3'",
        timeout=120,
        check=False,
    )
    assert failed.returncode == 3, failed.stdout + failed.stderr
    assert "volute-tests.slice" in failed.stdout, failed.stdout
    plain = m.sh("cd /srv/repo && volutectl test --slots 1 -- true", timeout=120, check=False)
    assert plain.returncode == 0, plain.stderr
