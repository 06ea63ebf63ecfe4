"""The install tier on arm64, the Raspberry Pi's architecture, under qemu-user emulation.

Raspberry Pi OS is Debian trixie on arm64. The amd64 install tier proves the packaging;
this one proves that Debian's arm64 builds of our dependencies (python3-pystemd has a C
extension) and Python on aarch64 work with our code. It installs the very
`Architecture: all` .debs that packaging/build-deb produced on this host, not an arm64
rebuild, into a debootstrapped arm64 trixie root booted with systemd-nspawn, with
qemu-aarch64 registered as a binfmt_misc handler only while the tier runs
(volute_testbed.binfmt; booting and installing: volute_testbed.install_tier).
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

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from volute_testbed.binfmt import qemu_aarch64, unavailable
from volute_testbed.install_tier import (
    ARM64_ROOT,
    Installed,
    booted_with_package,
    build_debs,
    configure_mind,
    deliver_and_wait_for_scope,
)
from volute_testbed.rootfs import CACHE, ensure_root, host_arch

pytestmark = pytest.mark.install_arm64

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("VOLUTE_ARTIFACTS", REPO / "dist" / "install-tier"))
MIND = "probe"
TURN_SECONDS = 30


def artifact(name: str, text: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / name).write_text(text)


def deb_field(deb: Path, name: str) -> str:
    return subprocess.run(
        ["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True, check=True
    ).stdout.strip()


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
