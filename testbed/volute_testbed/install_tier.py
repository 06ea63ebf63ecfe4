"""The Debian package installed in a booted Debian root, for the install tiers and
bench/install_tiers.py: build the .debs, boot an overlay of a debootstrapped root (native
or, for arm64 on another host, under qemu-user emulation), apt-get install them, and
time the steps; then configure a mind and time a delivered turn's scope.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from volute_testbed.machine import MASKED_UNITS, Machine, boot
from volute_testbed.paths import CHECKOUT
from volute_testbed.rootfs import CACHE, RootSpec, apt_cache_binds, host_arch

# git is in the root itself: `volutectl test` needs it, and installing it at each run
# would cost a minute of emulated dpkg.
ARM64_ROOT = RootSpec(arch="arm64", include=(*RootSpec().include, "git"))
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
    ),
    # Test-only, and for the emulated tier alone: qemu-user cannot set up the gate's
    # mount namespace (the same failure as for credentials), its JIT needs memory both
    # writable and executable, and the host's system calls it makes are not "native"
    # to the emulated systemd. The gate runs unprivileged all the same; the sandbox
    # itself is measured in the system tier (tests/system/test_gate_split.py).
    "/etc/systemd/system/volute-gate.service.d/90-volute-qemu-user.conf": (
        "# qemu-user: no mount namespace, no W^X, no architecture filter\n"
        "[Service]\nProtectSystem=no\nProtectHome=no\nPrivateTmp=no\nPrivateDevices=no\n"
        "PrivateMounts=no\nPrivateNetwork=no\nProtectKernelTunables=no\n"
        "ProtectKernelModules=no\nProtectKernelLogs=no\nProtectControlGroups=no\n"
        "ProtectClock=no\nProtectHostname=no\nMemoryDenyWriteExecute=no\n"
        "LockPersonality=no\nRestrictNamespaces=no\nSystemCallArchitectures=\n"
        "SystemCallFilter=\n"
    ),
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
        [str(CHECKOUT / "packaging" / "build-deb"), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return sorted(out.glob("*.deb"))


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


def archives_of(m: Machine, package: str) -> list[dict[str, str]]:
    """The Release fields (o=Origin, a=Suite, n=Codename, l=Label, c=Component, ...) of
    each archive that offers the installed version of `package`, as `apt-cache policy`
    reports them: where it came from by the archive's own word, not by its host name."""
    releases: dict[str, dict[str, str]] = {}
    source = ""
    for line in m.run(["apt-cache", "policy"]).stdout.splitlines():
        if re.fullmatch(r" *-?\d+ \S.*", line):
            source = line.split(None, 1)[1]
        elif line.strip().startswith("release ") and source:
            fields = line.strip().removeprefix("release ").split(",")
            releases[source] = dict(field.split("=", 1) for field in fields if "=" in field)
    offered: list[dict[str, str]] = []
    installed = False
    for line in m.run(["apt-cache", "policy", package]).stdout.splitlines()[1:]:
        version = re.fullmatch(r" (\*\*\*| {3}) \S+ -?\d+", line)
        if version:
            installed = version.group(1) == "***"
        elif installed and re.fullmatch(r" *-?\d+ \S.*", line):
            where = line.split(None, 1)[1]
            if where != "/var/lib/dpkg/status":
                offered.append(releases.get(where, {}))
    return offered
