"""The install tier: the Debian package in a clean Debian trixie root.

packaging/build-deb builds the .debs from this checkout; a debootstrapped trixie minbase
root (cached under /var/cache/volute-test, see volute_testbed.rootfs) boots as a
throwaway overlay under systemd-nspawn; `apt-get install ./volutectl_*.deb` then pulls
python3-pystemd, python3-click and python3-pydantic-settings from Debian. The tests share
one container and run in file order: install, inspect, then remove and purge last.

Run: .venv/bin/pytest -m install tests/install   (root; about 1.5 min with a warm cache)
Artifacts (the `systemctl status volute-turns.slice` capture, lintian output) go to
$VOLUTE_ARTIFACTS, default dist/install-tier.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from volute_testbed.install_tier import archives_of
from volute_testbed.machine import Machine, boot
from volute_testbed.rootfs import apt_cache_binds, ensure_root

pytestmark = pytest.mark.install

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("VOLUTE_ARTIFACTS", REPO / "dist" / "install-tier"))
UNITS = sorted(p.name for p in (REPO / "units").iterdir())
MIND = "probe"
TURN_SECONDS = 30


@dataclass
class Installed:
    machine: Machine
    debs: list[str]
    build_output: str
    # `systemctl is-system-running` and the failed units before the install: purge
    # must leave them as they were.
    state_before: str
    failed_before: list[str]


def artifact(name: str, text: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / name).write_text(text)


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("debs")
    result = subprocess.run(
        [str(REPO / "packaging" / "build-deb"), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    artifact("build-deb.txt", result.stdout + result.stderr)
    return out, result.stdout + result.stderr


@pytest.fixture(scope="module")
def installed(debs: tuple[Path, str]) -> Iterator[Installed]:
    out, build_output = debs
    root = ensure_root()
    packages = sorted(str(p) for p in out.glob("*.deb"))
    with boot(
        lower=str(root),
        name="vt-install",
        binds=[out],
        extra_args=apt_cache_binds(),
        prepare={"/etc/resolv.conf": Path("/etc/resolv.conf").read_text()},
    ) as machine:
        state_before = machine.wait_running()
        failed_before = failed_units(machine)
        result = machine.sh(
            "apt-get update -q && apt-get install -y -q --no-install-recommends "
            + " ".join(packages),
            env={"DEBIAN_FRONTEND": "noninteractive"},
            timeout=900,
            check=False,
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        yield Installed(machine, packages, build_output, state_before, failed_before)


def failed_units(m: Machine) -> list[str]:
    listed = m.run(["systemctl", "list-units", "--failed", "--plain", "--no-legend"]).stdout
    return sorted(line.split()[0] for line in listed.splitlines() if line.strip())


def test_build_passes_lintian_without_errors(installed: Installed) -> None:
    tags = re.findall(r"^([EWIXPN]): (\S+): (\S+)", installed.build_output, re.MULTILINE)
    errors = [tag for tag in tags if tag[0] == "E"]
    assert not errors, errors
    sizes = {Path(p).name: Path(p).stat().st_size for p in installed.debs}
    artifact("lintian-and-sizes.txt", f"lintian tags: {tags}\nsizes: {sizes}\n")


def test_dependencies_come_from_debian(installed: Installed) -> None:
    m = installed.machine
    for package in ("python3-pystemd", "python3-click", "python3-pydantic-settings"):
        # By the archive's own Release file (trixie's Suite is "stable" or "testing" by
        # date, its Codename is trixie), not by the host name of the mirror it came from.
        archives = archives_of(m, package)
        assert archives, m.run(["apt-cache", "policy", package]).stdout
        for release in archives:
            assert (release.get("o"), release.get("l"), release.get("n")) == (
                "Debian",
                "Debian",
                "trixie",
            ), (package, release)
        status = m.run(["dpkg-query", "-W", "-f=${Status}", package]).stdout
        assert status == "install ok installed"
    versions = m.run(["dpkg-query", "-W", "python3-pystemd", "systemd", "python3"]).stdout
    assert re.search(r"^systemd\t257", versions, re.MULTILINE), versions


def test_units_are_installed_and_verify_under_trixie_systemd(installed: Installed) -> None:
    m = installed.machine
    for unit in UNITS:
        assert m.host_path(f"/usr/lib/systemd/system/{unit}").is_file(), unit
        assert not m.host_path(f"/lib/systemd/system/{unit}").is_symlink()
    names = [u.replace("@.", "@m1.") for u in UNITS]
    verify = m.sh(
        f"cd /usr/lib/systemd/system && systemd-analyze verify --man=no {' '.join(names)}"
    )
    assert verify.stdout + verify.stderr == "", verify.stderr
    # Every unit's Documentation= names this file; dh_compress must leave it readable.
    assert m.host_path("/usr/share/doc/volutectl/packaging.md").is_file()
    cat = m.run(["systemctl", "cat", "volute-turns.slice"]).stdout
    assert "# /usr/lib/systemd/system/volute-turns.slice" in cat
    for unit in ("volute-gate.service", "volute-gate.socket", "volute-launcher.socket"):
        enabled = m.run(["systemctl", "is-enabled", unit], check=False).stdout
        assert enabled.strip() == "enabled", unit
    # The slices are not started, enabled or restarted by the package scripts.
    assert m.run(["systemctl", "is-enabled", "volute.slice"], check=False).stdout.strip() in (
        "static",
        "disabled",
    )


def test_sysusers_tmpfiles_and_config_permissions(installed: Installed) -> None:
    m = installed.machine
    # The default turn user has a group of its own, and is no member of group volute
    # (which may read the config and use the socket).
    user = m.run(["getent", "passwd", "volute-turn"]).stdout.split(":")
    own = m.run(["getent", "group", "volute-turn"]).stdout.strip().split(":")
    socket_group = m.run(["getent", "group", "volute"]).stdout.strip().split(":")
    assert user[3] == own[2] != socket_group[2] and int(user[2]) < 1000
    assert "volute-turn" not in socket_group[3].split(",")
    # ... and in volute-turns, whose members the package's polkit rule keeps from lingering.
    assert m.run(["id", "-nG", "volute-turn"]).stdout.split() == ["volute-turn", "volute-turns"]
    listing = m.sh("stat -c '%U %G %a %n' /etc/volute/volutectl.toml /var/lib/volute /run/volute")
    assert listing.stdout.splitlines() == [
        "root volute-admin 640 /etc/volute/volutectl.toml",  # an admin's (roles, below)
        "volute-gate volute-gate 700 /var/lib/volute",
        "root root 755 /run/volute",
    ]
    conffiles = m.run(["dpkg-query", "-W", "-f=${Conffiles}", "volutectl"]).stdout
    assert "/etc/volute/volutectl.toml" in conffiles


def test_cli_config_check_and_completion(installed: Installed) -> None:
    m = installed.machine
    assert m.run(["which", "volutectl"]).stdout.strip() == "/usr/bin/volutectl"
    assert "Usage: volutectl" in m.run(["volutectl", "--help"]).stdout
    check = m.run(["volutectl", "config", "check"])
    assert "/etc/volute/volutectl.toml" in check.stdout + check.stderr
    completion = m.run(
        ["volutectl"],
        env={
            "_VOLUTECTL_COMPLETE": "bash_complete",
            "COMP_WORDS": "volutectl con",
            "COMP_CWORD": "1",
        },
    )
    assert "plain,config" in completion.stdout.split()
    sourced = m.run(
        [
            "bash",
            "-c",
            ". /usr/share/bash-completion/completions/volutectl && complete -p volutectl",
        ]
    )
    assert "_volutectl_completion" in sourced.stdout


def test_doctor_runs_and_reaches_the_manager(installed: Installed) -> None:
    m = installed.machine
    result = m.run(["volutectl", "doctor", "--json"], check=False)
    report = json.loads(result.stdout)
    by_name = {check["check"]: check for check in report["checks"]}
    assert by_name["config"]["status"] == "ok", by_name["config"]
    assert by_name["manager"]["status"] == "ok", by_name["manager"]
    assert by_name["socket-unit"]["status"] == "ok", by_name["socket-unit"]
    assert result.returncode == 0, result.stdout + result.stderr
    artifact("doctor.txt", m.run(["volutectl", "doctor"], check=False).stdout)


def test_the_gate_runs_the_adaptive_limit_with_no_configuration(installed: Installed) -> None:
    """Issue 21: a fresh install that changes nothing is protected. The config is the
    shipped one, every key commented out; the gate (started by its socket) runs the
    adaptive limit at its start value, with no ceiling, and says so in `status`, STATUS=
    and `doctor`."""
    m = installed.machine
    shipped = (REPO / "packaging" / "volutectl.toml").read_text()
    assert m.host_path("/etc/volute/volutectl.toml").read_text() == shipped
    status = json.loads(m.run(["volutectl", "status", "--json"]).stdout)
    adaptive = status["adaptive"]
    assert (adaptive["mode"], adaptive["limit"], adaptive["ceiling"]) == ("adaptive", 2, None)
    assert (adaptive["minimum"], adaptive["maximum"]) == (1, 16), adaptive
    assert status["global_cap"] is None, status  # no static cap: the adaptive limit alone
    line = show(m, "volute-gate.service", "StatusText")
    assert line.startswith("0/2 turns (adaptive limit)"), line
    report = json.loads(m.run(["volutectl", "doctor", "--json"], check=False).stdout)
    [check] = [c for c in report["checks"] if c["check"] == "adaptive"]
    assert check["status"] == "ok" and "2 turns at once" in check["found"], check


def test_gate_runs_a_delivered_turn_as_a_scope_in_the_slice(installed: Installed) -> None:
    m = installed.machine
    config = m.host_path("/etc/volute/volutectl.toml")
    config.write_text(
        config.read_text() + f'\n[minds.{MIND}]\ncommand = ["/bin/sleep", "{TURN_SECONDS}"]\n'
    )
    m.run(["volutectl", "config", "check"])
    m.run(["systemctl", "restart", "volute-gate.service"])
    assert m.run(["systemctl", "is-active", "volute-gate.service"]).stdout.strip() == "active"
    delivery = m.run(["volutectl", "deliver", MIND, "--message", "hello from the install tier"])
    assert delivery.stdout.strip(), "deliver printed no delivery id"
    deadline = time.monotonic() + 20
    scopes: list[str] = []
    while time.monotonic() < deadline and not scopes:
        listed = m.run(
            ["systemctl", "list-units", "--plain", "--no-legend", "volute-turn-*.scope"]
        ).stdout
        scopes = [line.split()[0] for line in listed.splitlines() if line.strip()]
        time.sleep(0.1)
    assert scopes, "no turn scope appeared within 20 s"
    assert scopes[0].startswith(f"volute-turn-{MIND}-")
    status = m.run(["systemctl", "status", "--no-pager", "volute-turns.slice"], check=False)
    artifact("systemctl-status-volute-turns.slice.txt", status.stdout)
    assert scopes[0] in status.stdout
    assert "sleep" in status.stdout
    assert m.run(["systemctl", "show", "-P", "Slice", scopes[0]]).stdout.strip() == (
        "volute-turns.slice"
    )
    assert m.run(["systemctl", "is-active", "volute-gate.service"]).stdout.strip() == "active"
    # Restarting the gate leaves the running turn alone.
    m.run(["systemctl", "restart", "volute-gate.service"])
    assert m.run(["systemctl", "is-active", scopes[0]], check=False).stdout.strip() == "active"
    # The heartbeat service, sandboxed as a DynamicUser in group volute, can queue.
    beat = m.run(["systemctl", "start", f"volute-heartbeat@{MIND}.service"], check=False)
    journal = m.run(["journalctl", "-b", "--no-pager", "-u", f"volute-heartbeat@{MIND}.service"])
    assert beat.returncode == 0, beat.stderr + journal.stdout
    queue = m.run(["volutectl", "queue", "list"], check=False)
    assert "heartbeat" in queue.stdout, queue.stdout + queue.stderr


QUICK = "quick"  # a mind whose turn ends at once, to see deliveries run
LONG = "long"  # a mind whose turn outlives an upgrade


def show(m: Machine, unit: str, prop: str) -> str:
    return m.run(["systemctl", "show", "-P", prop, unit]).stdout.strip()


STATES_SQL = """
import json, sqlite3
db = sqlite3.connect("/var/lib/volute/queue.sqlite3", timeout=10)
print(json.dumps(dict(db.execute("SELECT id, state FROM deliveries"))))
"""


def delivery_states(m: Machine) -> dict[int, str]:
    """Every delivery's state, from the store itself (`queue list` shows 200 rows at most)."""
    states = json.loads(m.run(["python3", "-c", STATES_SQL]).stdout)
    return {int(key): str(value) for key, value in states.items()}


def wait_done(m: Machine, delivery_ids: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    pending = list(delivery_ids)
    while pending and time.monotonic() < deadline:
        states = delivery_states(m)
        pending = [i for i in pending if states.get(i) != "done"]
        time.sleep(0.2)
    assert not pending, f"never ran: {pending}"


def listening_path(m: Machine, inode: str) -> str | None:
    """Where the listening unix socket with this inode is bound, from /proc/net/unix."""
    table = m.run(["cat", "/proc/net/unix"]).stdout.splitlines()[1:]
    # Num RefCount Protocol Flags Type St Inode Path; Flags 00010000: listening
    for fields in map(str.split, table):
        if fields[6] == inode and fields[3] == "00010000" and len(fields) == 8:
            return fields[7]
    return None


def test_the_socket_is_systemds_and_the_gate_serves_it(installed: Installed) -> None:
    m = installed.machine
    config = m.host_path("/etc/volute/volutectl.toml")
    config.write_text(
        config.read_text()
        + f'\n[minds.{QUICK}]\ncommand = ["/bin/true"]\n'
        + f'\n[minds.{LONG}]\ncommand = ["/bin/sleep", "300"]\n'
    )
    m.run(["systemctl", "restart", "volute-gate.service"])
    assert show(m, "volute-gate.socket", "ActiveState") == "active"
    assert show(m, "volute-gate.socket", "Listen") == "/run/volute/gate.sock (Stream)"
    assert m.run(["stat", "-c", "%U %G %a %F", "/run/volute/gate.sock"]).stdout.strip() == (
        "root volute 660 socket"
    )
    # The gate's listening fd is systemd's socket (fd 3, passed), not one it bound.
    gate = show(m, "volute-gate.service", "MainPID")
    fd3 = m.run(["readlink", f"/proc/{gate}/fd/3"]).stdout.strip()
    assert fd3.startswith("socket:["), fd3
    assert listening_path(m, fd3[len("socket:[") : -1]) == "/run/volute/gate.sock"
    assert fd3 in m.sh("ls -l /proc/1/fd").stdout  # and PID 1 holds the same socket
    delivered = m.run(["volutectl", "deliver", QUICK, "--message", "through the socket"])
    wait_done(m, [int(delivered.stdout)])


def test_a_delivery_to_a_stopped_gate_is_acknowledged_and_starts_it(installed: Installed) -> None:
    m = installed.machine
    m.run(["systemctl", "stop", "volute-gate.service"])
    assert show(m, "volute-gate.service", "ActiveState") == "inactive"
    assert show(m, "volute-gate.socket", "ActiveState") == "active"  # still listening
    delivered = m.run(["volutectl", "deliver", QUICK, "--message", "to a stopped gate"])
    assert show(m, "volute-gate.service", "ActiveState") == "active"  # socket activation
    wait_done(m, [int(delivered.stdout)])


UPGRADE_CLIENT = """
i=0
while [ ! -e /var/tmp/upgrade.done ]; do
  i=$((i + 1))
  if id=$(volutectl deliver quick --message "during the upgrade $i" 2>>/var/tmp/upgrade.err); then
    echo "ok $id" >> /var/tmp/upgrade.log
  else
    echo "refused $?" >> /var/tmp/upgrade.log
  fi
done
"""


def test_an_upgrade_restarts_the_gate_but_not_its_socket_or_slices(installed: Installed) -> None:
    """The same .deb again is an upgrade to dpkg: prerm upgrade, then postinst configure."""
    m = installed.machine
    m.run(["volutectl", "deliver", LONG, "--message", "a turn that outlives the upgrade"])
    deadline = time.monotonic() + 20
    long_turns: list[str] = []
    while not long_turns and time.monotonic() < deadline:
        long_turns = [t for t in live_turns(m) if t.startswith(f"volute-turn-{LONG}-")]
        time.sleep(0.1)
    [turn] = long_turns
    before = {
        unit: show(m, unit, "InvocationID")
        for unit in ("volute-gate.socket", "volute-gate.service", "volute-turns.slice")
    }
    client = m.popen(["sh", "-c", UPGRADE_CLIENT])
    time.sleep(1)
    [deb] = [d for d in installed.debs if Path(d).name.startswith("volutectl_")]
    upgrade = m.run(["dpkg", "-i", deb], env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=300)
    time.sleep(1)
    m.write("/var/tmp/upgrade.done", "")
    client.wait(timeout=60)
    after = {unit: show(m, unit, "InvocationID") for unit in before}
    units = m.run(
        [
            "journalctl",
            "-b",
            "--no-pager",
            "-n",
            "80",
            "-u",
            "volute-gate.service",
            "-u",
            "volute-gate.socket",
        ]
    ).stdout
    artifact("upgrade-journal.txt", f"{before}\n{after}\n{upgrade.stdout}{upgrade.stderr}\n{units}")
    assert after["volute-gate.service"] != before["volute-gate.service"]  # restarted...
    assert after["volute-gate.socket"] == before["volute-gate.socket"]  # ...but not these
    assert after["volute-turns.slice"] == before["volute-turns.slice"]
    assert show(m, turn, "ActiveState") == "active"
    results = m.host_path("/var/tmp/upgrade.log").read_text().split("\n")
    refused = [line for line in results if line.startswith("refused")]
    acknowledged = [int(line.split()[1]) for line in results if line.startswith("ok")]
    artifact(
        "upgrade.txt",
        f"{len(acknowledged)} deliveries acknowledged and {len(refused)} refused while "
        f"dpkg -i upgraded the package\n\n{upgrade.stdout}{upgrade.stderr}",
    )
    assert not refused, (refused, m.host_path("/var/tmp/upgrade.err").read_text())
    assert len(acknowledged) >= 5, results
    assert len(set(acknowledged)) == len(acknowledged)
    wait_done(m, acknowledged)


LEASED = "leased"  # a mind used only through leases: no command


def test_a_lease_held_across_an_upgrade_is_claimed_back_and_kept(installed: Installed) -> None:
    """Issue 31, item 4: a package upgrade while a lease is held keeps it. The lease's
    scope outlives the gate's restart (the same invocation), the holder claims it again
    on the new gate, and releases it when done: the scope goes, and nothing ended it."""
    m = installed.machine
    config = m.host_path(CONFIG)
    config.write_text(config.read_text() + f"\n[minds.{LEASED}]\n")
    m.run(["systemctl", "reload", "volute-gate.service"], timeout=60)
    holder = m.popen(
        ["volutectl", "lease", LEASED, "--session", "upgrade"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stderr is not None
    # Without CMD: the lease's id and its unit on stdout once granted, then it holds.
    # (The long mind's turn holds one place of the default's two, if still running.)
    ready, _, _ = select.select([holder.stdout], [], [], 90)
    if not ready:
        holder.kill()
        status = m.run(["volutectl", "status"], check=False).stdout
        raise AssertionError(f"no grant in 90 s: {holder.stderr.read()}\n{status}")
    granted = holder.stdout.readline().split()
    assert len(granted) == 2 and granted[1].startswith(f"volute-turn-{LEASED}-"), granted
    lease_id, scope = granted
    assert show(m, scope, "ActiveState") == "active"
    scope_before = show(m, scope, "InvocationID")
    gate_before = show(m, "volute-gate.service", "InvocationID")
    [deb] = [d for d in installed.debs if Path(d).name.startswith("volutectl_")]
    m.run(["dpkg", "-i", deb], env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=300)
    assert show(m, "volute-gate.service", "InvocationID") != gate_before  # restarted
    assert show(m, scope, "InvocationID") == scope_before  # the same scope, still running
    assert show(m, scope, "ActiveState") == "active"
    deadline = time.monotonic() + 30
    claimed = ""
    while "claimed again" not in claimed and time.monotonic() < deadline:
        claimed = m.run(
            [
                "journalctl",
                "-b",
                "--no-pager",
                "-u",
                "volute-gate.service",
                "-g",
                f"lease {lease_id} ",
            ],
            check=False,
        ).stdout
        time.sleep(0.2)
    assert "claimed again after the gate restarted" in claimed, claimed
    assert holder.poll() is None  # still holding
    _, err = holder.communicate(input="", timeout=60)  # stdin closed: release
    assert holder.returncode == 0, err
    assert "claimed lease" in err, err
    deadline = time.monotonic() + 30
    while show(m, scope, "ActiveState") == "active" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert show(m, scope, "ActiveState") != "active"
    ended = m.run(
        ["journalctl", "-b", "--no-pager", "-u", "volute-gate.service", "-g", f"lease {lease_id} "]
    ).stdout
    artifact("lease-upgrade.txt", f"{err}\n{ended}")
    assert "reclaim_expired" not in ended and "released" in ended, ended


def live_turns(m: Machine) -> list[str]:
    listed = m.run(["systemctl", "list-units", "--plain", "--no-legend", "volute-turn-*.scope"])
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


# -- roles (issue 22, item 1): a member of volute delivers, but gets 77 for pause and
# drop, and cannot read a mind's environment by any path ---------------------------------

KEEPER_KEY = "sk-install-4e1d93a7"
KEEPER_TURN = (  # the digest appears whole (a rename): the test reads it once it exists
    'printf %s "$KEEPER_KEY" | sha256sum > /var/tmp/keeper.sum.part; '
    "mv /var/tmp/keeper.sum.part /var/tmp/keeper.sum; "
    "i=0; while [ ! -e /var/tmp/keeper.go ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"
)
# Every /proc/PID/cmdline and environ this user may read, searched for the secret given on
# stdin (never in argv: the scan would find its own); prints the files read, then hits.
PROC_SCAN = r"""
import os, sys
secret = sys.stdin.read().strip().encode()
read, hits = 0, []
for pid in filter(str.isdigit, os.listdir("/proc")):
    for name in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        read += 1
        hits += [f"{pid}/{name}"] if secret in data else []
print(read, *hits)
"""


def as_user(m: Machine, user: str, *argv: str, stdin: str | None = None) -> tuple[int, str]:
    done = m.run(["runuser", "-u", user, "--", *argv], check=False, input=stdin, timeout=90)
    return done.returncode, done.stdout + done.stderr


def test_a_member_of_volute_delivers_but_may_not_pause_drop_or_read_a_secret(
    installed: Installed,
) -> None:
    m = installed.machine
    path = "/etc/volute/volutectl.toml"
    # An upgrade from before roles finds the config root:volute 0640; postinst moves it.
    m.run(["chgrp", "volute", path])
    [deb] = [d for d in installed.debs if Path(d).name.startswith("volutectl_")]
    m.run(["dpkg", "-i", deb], env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=300)
    assert m.run(["stat", "-c", "%U %G %a", path]).stdout.strip() == "root volute-admin 640"
    assert show(m, "volute-gate.service", "SupplementaryGroups").split() == [
        "volute",
        "volute-admin",
    ]
    m.run(["useradd", "-m", "-G", "volute", "delia"])
    m.run(["useradd", "-m", "-G", "volute,volute-admin", "opal"])
    m.run(["useradd", "-r", "-U", "-M", "-d", "/nonexistent", "keeper"])
    m.run(["install", "-d", "-m", "0700", "/etc/volute/minds"])
    m.write("/etc/volute/minds/keeper.env", f"KEEPER_KEY={KEEPER_KEY}\n", mode=0o600)
    config = m.host_path(path)
    config.write_text(
        config.read_text()
        + f'\n[minds.keeper]\ncommand = {json.dumps(KEEPER_TURN)}\nuser = "keeper"\n'
        + 'environment_file = "/etc/volute/minds/keeper.env"\n'
    )
    m.run(["systemctl", "restart", "volute-gate.service"])

    code, out = as_user(m, "delia", "volutectl", "deliver", "keeper", "-m", "from a member")
    assert code == 0, out
    mine = int(out.split()[0])
    for argv in (("pause",), ("pause", "keeper"), ("queue", "drop", str(mine))):
        code, out = as_user(m, "delia", "volutectl", *argv)
        assert code == 77 and "volute-admin" in out, (argv, code, out)
    # The turn has its secret (its digest proves it), and the member reads it nowhere.
    digest = m.host_path("/var/tmp/keeper.sum")
    deadline = time.monotonic() + 30
    while not digest.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert digest.read_text().split()[0] == hashlib.sha256(KEEPER_KEY.encode()).hexdigest()
    code, out = as_user(m, "delia", "cat", path)
    assert code != 0 and "Permission denied" in out
    for argv in (("config", "show"), ("config", "show", "--json")):
        code, out = as_user(m, "delia", "volutectl", *argv)
        assert code == 77 and KEEPER_KEY not in out and "volute-admin" in out, (code, out)
    assert not m.host_path("/var/tmp/keeper.go").exists()  # the turn runs still
    code, out = as_user(m, "delia", "python3", "-I", "-S", "-c", PROC_SCAN, stdin=KEEPER_KEY)
    read, *hits = out.split()
    assert code == 0 and hits == [] and int(read) > 10, out
    by_root = m.run(["python3", "-I", "-S", "-c", PROC_SCAN], input=KEEPER_KEY).stdout.split()
    assert any(hit.endswith("/environ") for hit in by_root[1:]), by_root  # the scan can find

    # An admin may pause and resume; its config show names the file, never its contents.
    code, out = as_user(m, "opal", "volutectl", "pause", "keeper")
    assert (code, out.strip()) == (0, "paused keeper")
    code, out = as_user(m, "opal", "volutectl", "resume", "keeper")
    assert code == 0, out
    code, out = as_user(m, "opal", "volutectl", "config", "show")
    assert code == 0 and "/etc/volute/minds/keeper.env" in out and KEEPER_KEY not in out, out
    m.write("/var/tmp/keeper.go", "")
    wait_done(m, [mine])
    # The secret is the operator's file, not the package's: purge (below) leaves it, and
    # /etc/volute with it, as dpkg leaves any file it did not ship. Take it away here.
    m.run(["rm", "-rf", "/etc/volute/minds"])


# -- issue 22, `reload`: a bad config never silences the gate; reload adds a mind ----------

CONFIG = "/etc/volute/volutectl.toml"


def test_a_misspelt_key_answers_78_within_2_s_and_restarts_at_most_once(
    installed: Installed,
) -> None:
    m = installed.machine
    config = m.host_path(CONFIG)
    good = config.read_text()
    # Into the shipped file's own [limits] table (a second one would not be TOML).
    assert good.count("\n[limits]\n") == 1
    config.write_text(good.replace("\n[limits]\n", "\n[limits]\nglobal_concurent_turns = 2\n"))
    try:
        m.run(["systemctl", "restart", "volute-gate.service"], timeout=60)
        restarts = int(show(m, "volute-gate.service", "NRestarts"))
        pid = show(m, "volute-gate.service", "MainPID")
        started = time.monotonic()
        refused = m.run(["volutectl", "deliver", QUICK, "--message", "typo"], check=False)
        took = time.monotonic() - started
        assert refused.returncode == 78, refused.stderr
        assert took < 2.0, took
        assert "limits.global_concurent_turns: unknown key" in refused.stderr
        assert "did you mean `global_concurrent_turns`?" in refused.stderr
        time.sleep(6)  # RestartSec=2s: a crash loop would have restarted it twice by now
        assert show(m, "volute-gate.service", "ActiveState") == "active"
        assert int(show(m, "volute-gate.service", "NRestarts")) <= restarts + 1
        assert show(m, "volute-gate.service", "MainPID") == pid
        assert "degraded" in show(m, "volute-gate.service", "StatusText")
        before = delivery_states(m)
    finally:
        config.write_text(good)
    m.run(["systemctl", "reload", "volute-gate.service"], timeout=60)
    assert show(m, "volute-gate.service", "MainPID") == pid  # up whole, in the same process
    assert delivery_states(m).keys() == before.keys()  # the refused one was never stored
    delivered = m.run(["volutectl", "deliver", QUICK, "--message", "after the fix"])
    wait_done(m, [int(delivered.stdout)])


def test_a_mind_added_and_reloaded_takes_deliveries_with_the_same_pid(
    installed: Installed,
) -> None:
    m = installed.machine
    pid = show(m, "volute-gate.service", "MainPID")
    config = m.host_path(CONFIG)
    config.write_text(config.read_text() + '\n[minds.added]\ncommand = ["/bin/true"]\n')
    unknown = m.run(["volutectl", "deliver", "added", "--message", "too early"], check=False)
    assert unknown.returncode == 67 and "systemctl reload volute-gate" in unknown.stderr
    m.run(["systemctl", "reload", "volute-gate.service"], timeout=60)
    delivered = m.run(["volutectl", "deliver", "added", "--message", "after the reload"])
    wait_done(m, [int(delivered.stdout)])
    assert show(m, "volute-gate.service", "MainPID") == pid


SLICES = ("volute.slice", "volute-turns.slice", "volute-tests.slice")


# -- issue 22, the client's part: --wait says each attempt; logs as a member is 77 --------

FAILING = "failing"  # a mind whose every turn exits 3
MEMBER = "op"  # a user in group volute, as an operator's script user would be
FAST_RETRIES = "/etc/systemd/system/volute-gate.service.d/fast-retries.conf"


def test_deliver_wait_on_a_failing_mind_prints_each_attempt(installed: Installed) -> None:
    m = installed.machine
    config = m.host_path("/etc/volute/volutectl.toml")
    config.write_text(
        config.read_text() + f'\n[minds.{FAILING}]\ncommand = ["/bin/sh", "-c", "exit 3"]\n'
    )
    m.write(
        FAST_RETRIES,
        "[Service]\nEnvironment=VOLUTE_GATE__MAX_ATTEMPTS=3\n"
        "Environment=VOLUTE_GATE__BACKOFF_INITIAL_SECONDS=0.5\n"
        "Environment=VOLUTE_GATE__BACKOFF_MAX_SECONDS=0.5\n",
    )
    m.run(["systemctl", "daemon-reload"])
    m.run(["systemctl", "restart", "volute-gate.service"])
    try:
        waited = m.run(["volutectl", "deliver", FAILING, "-m", "x", "--wait"], check=False)
        artifact("deliver-wait-failing.txt", waited.stdout + waited.stderr)
        assert waited.returncode == 3, waited.stderr  # the last attempt's turn's status
        delivery = int(waited.stdout)
        for attempt in (1, 2):
            said = f"delivery {delivery}: attempt {attempt} of 3 failed: turn"
            assert said in waited.stderr
        assert waited.stderr.count("next try at") == 2
        assert f"delivery {delivery} is dead" in waited.stderr
    finally:
        m.run(["rm", "-f", FAST_RETRIES])
        m.run(["systemctl", "daemon-reload"])
        m.run(["systemctl", "restart", "volute-gate.service"])


def test_logs_as_a_member_of_volute_exits_77_naming_the_journals_group(
    installed: Installed,
) -> None:
    m = installed.machine
    m.run(["sh", "-c", f"id {MEMBER} >/dev/null 2>&1 || useradd -M -G volute {MEMBER}"])
    result = m.run(["runuser", "-u", MEMBER, "--", "volutectl", "logs", FAILING], check=False)
    artifact("logs-as-member.txt", f"exit {result.returncode}\n{result.stderr}")
    assert result.returncode == 77, (result.returncode, result.stderr)
    assert f"usermod -aG systemd-journal {MEMBER}" in result.stderr
    assert "Traceback" not in result.stderr
    # Root reads it: the same command is not refused.
    assert m.run(["volutectl", "logs", FAILING], check=False).returncode == 0


# -- issue 22, the `removal` part: a lean install, a mind's home, clean removal --------


def test_a_lean_install_suffices_and_a_homeless_mind_has_a_home(installed: Installed) -> None:
    """The fixture installs with --no-install-recommends, and every test above ran on
    that: none of what the dependencies only recommend (49 packages with Recommends,
    19 without, on trixie minbase: the README's install section) is needed."""
    m = installed.machine
    for package in ("python3-httpx", "python3-cryptography", "python3-bs4", "python3-rich"):
        status = m.run(["dpkg-query", "-W", "-f=${Status}", package], check=False).stdout
        assert status != "install ok installed", package
    # The probe mind names no working directory and runs as volute-turn (home
    # /nonexistent): its turns ran in a home of its own, never in /.
    homes = m.sh("stat -c '%U %a %n' /var/lib/volute-minds /var/lib/volute-minds/" + MIND)
    assert homes.stdout.splitlines() == [
        "root 755 /var/lib/volute-minds",
        f"volute-turn 700 /var/lib/volute-minds/{MIND}",
    ]


# -- issue 29: a turn's user is kept out of cron and at, by the admin, as doctor says ------

CRON_JOB = "17 3 * * * true\n"
DEFAULT_TURN_USER = "volute-turn"
ONE_MIND = "/var/tmp/one-mind.toml"  # a mind of the default turn user, for doctor


def scheduler_checks(m: Machine) -> dict[str, dict[str, str]]:
    command = ["volutectl", "doctor", "--json", "--config", ONE_MIND]
    report = json.loads(m.run(command, check=False).stdout)
    return {c["check"]: c for c in report["checks"] if c["check"] in ("cron", "at")}


def test_doctor_names_the_turn_user_cron_and_at_take_and_its_line_keeps_it_out(
    installed: Installed,
) -> None:
    """Debian's cron and at decide by /etc/cron.{allow,deny} and /etc/at.{allow,deny},
    files of theirs that no other package may edit (Policy 10.7.4): the admin keeps the
    minds' users out, with the line `doctor` prints (docs/packaging.md, "Cron and at")."""
    m = installed.machine
    m.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "cron", "at"],
        env={"DEBIAN_FRONTEND": "noninteractive"},
        timeout=600,
    )
    m.write(ONE_MIND, '[minds.plain]\ncommand = ["/bin/true"]\n')
    checks = scheduler_checks(m)
    artifact("doctor-cron-at.json", json.dumps(checks, indent=2))
    # Fresh: cron takes every user (no cron.allow, no cron.deny); at.deny, at's conffile,
    # lists system users but not volute-turn. So a turn could leave a job behind.
    for name in ("cron", "at"):
        assert checks[name]["status"] == "warn", checks[name]
        assert "volute-turn" in checks[name]["found"], checks[name]
    assert as_user(m, DEFAULT_TURN_USER, "crontab", "-", stdin=CRON_JOB)[0] == 0
    assert as_user(m, DEFAULT_TURN_USER, "crontab", "-r")[0] == 0
    took, said = as_user(m, DEFAULT_TURN_USER, "at", "now", "+", "10", "hours", stdin="true\n")
    assert took == 0, said
    m.sh("atrm $(atq | cut -f1)")
    at_deny_before = m.host_path("/etc/at.deny").read_text()
    # The admin runs the lines doctor gives, as root.
    for name in ("cron", "at"):
        m.run(["sh", "-c", checks[name]["change"].removeprefix("as root: ")])
    after = scheduler_checks(m)
    assert [after[name]["status"] for name in ("cron", "at")] == ["ok", "ok"], after
    assert m.host_path("/etc/cron.deny").read_text() == "volute-turn\n"
    assert m.host_path("/etc/at.deny").read_text() == at_deny_before + "volute-turn\n"
    # crontab and at, setgid and setuid, now refuse the turn's user.
    refused, said = as_user(m, DEFAULT_TURN_USER, "crontab", "-", stdin=CRON_JOB)
    assert refused != 0 and "not allowed" in said, said
    refused, said = as_user(m, DEFAULT_TURN_USER, "at", "now", "+", "10", "hours", stdin="true\n")
    assert refused != 0 and "permission" in said, said
    artifact("cron-at-refused.txt", said)
    assert m.run(["atq"]).stdout == ""


# -- issue 29: a turn's user may not linger, by the package's polkit rule --------------

POLKIT_RULE = "/usr/share/polkit-1/rules.d/40-volutectl.rules"


def loginctl(m: Machine, user: str, verb: str, target: str) -> tuple[int, str]:
    """`loginctl VERB TARGET` as `user`, in a unit of its own as a turn is: trixie's
    logind reads its caller's cgroup, and a process entered with nsenter has none inside
    ("Protocol driver not attached")."""
    argv = ["systemd-run", "--quiet", "--pipe", "--wait", "--collect", "-p", f"User={user}"]
    done = m.run([*argv, "loginctl", verb, target], check=False, timeout=90)
    return done.returncode, done.stdout + done.stderr


def test_the_packages_polkit_rule_keeps_the_turn_user_from_lingering(
    installed: Installed,
) -> None:
    """systemd lets any user make itself linger (set-self-linger: yes), and a lingering
    user's manager runs what a turn started there after the turn. The .deb ships a rule
    in /usr/share/polkit-1/rules.d, where polkit reads packages' rules (polkitd's
    NEWS.Debian, 121): trixie's polkitd refuses it to volute-turn, and not to others."""
    m = installed.machine
    assert POLKIT_RULE in m.run(["dpkg", "-L", "volutectl"]).stdout.splitlines()
    m.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "polkitd"],
        env={"DEBIAN_FRONTEND": "noninteractive"},
        timeout=600,
    )
    polkitd = m.run(["dpkg-query", "-W", "-f=${Version}", "polkitd"]).stdout
    m.run(["useradd", "-M", "lingerer"])  # a user of no volute group: the rule's control
    allowed, said = loginctl(m, "lingerer", "enable-linger", "lingerer")
    assert allowed == 0, said
    assert m.host_path("/var/lib/systemd/linger/lingerer").exists()
    assert loginctl(m, "root", "disable-linger", "lingerer")[0] == 0
    refused, said = loginctl(m, DEFAULT_TURN_USER, "enable-linger", DEFAULT_TURN_USER)
    assert refused != 0 and "Access denied" in said, said
    assert not m.host_path(f"/var/lib/systemd/linger/{DEFAULT_TURN_USER}").exists()
    artifact("linger-refused.txt", f"polkitd {polkitd}\n{said}")


def test_remove_keeps_state_and_purge_leaves_nothing(installed: Installed) -> None:
    m = installed.machine
    m.run(["systemctl", "enable", "volute-heartbeat@m1.timer"])
    # A heartbeat enabled and running, as an admin sets one up: remove must stop and
    # disable it, or it fails at its next elapse ("Unit to trigger vanished").
    beat = f"volute-heartbeat@{MIND}.timer"
    m.run(["systemctl", "enable", "--now", beat])
    assert show(m, beat, "ActiveState") == "active"
    # Only the long mind's turn (sleep 300, from the upgrade test) is sure to outlive the
    # remove: a probe turn (sleep 30) may end on its own while apt runs.
    turns = [t for t in live_turns(m) if t.startswith(f"volute-turn-{LONG}-")]
    assert turns, "no turn runs: the remove below would not prove the slices stay"
    removed = m.run(
        ["apt-get", "remove", "-y", "-q", "volutectl"], env={"DEBIAN_FRONTEND": "noninteractive"}
    )
    assert m.host_path("/var/lib/volute").is_dir()
    assert m.host_path(f"/var/lib/volute-minds/{MIND}").is_dir()
    assert m.host_path("/etc/volute/volutectl.toml").is_file()
    assert m.run(["getent", "passwd", "volute-turn"], check=False).returncode == 0
    assert not m.host_path("/usr/lib/systemd/system/volute-gate.service").exists()
    # Removing the package stops the gate but no running turn, nor the slices they run in.
    assert set(turns) <= set(live_turns(m)), (turns, live_turns(m))
    assert show(m, "volute-turns.slice", "ActiveState") == "active"
    said = removed.stdout + removed.stderr  # apt passes dpkg's scripts' stderr to stdout
    assert "volute.slice still holds running turns" in said, said
    # Every heartbeat timer is stopped and disabled (no wants link left), none failed.
    for timer in (beat, "volute-heartbeat@m1.timer"):
        assert show(m, timer, "ActiveState") == "inactive", timer
        assert show(m, timer, "UnitFileState") in ("", "disabled"), timer
    assert not m.sh("find /etc/systemd/system -name 'volute-heartbeat@*'").stdout
    assert not [unit for unit in failed_units(m) if unit.startswith("volute")]
    # Once the turns have ended, purge stops the slices, whose unit files went with the
    # remove: before, they stayed loaded and active until a reboot.
    for turn in live_turns(m):
        m.run(["systemctl", "stop", turn])
    assert show(m, "volute-turns.slice", "ActiveState") == "active"

    m.run(["apt-get", "purge", "-y", "-q", "volutectl"], env={"DEBIAN_FRONTEND": "noninteractive"})
    m.run(["systemctl", "daemon-reload"])
    # (A slice needs no unit file to load, so systemctl show loads it anew: "loaded" but
    # inactive, with no file behind it. Left running, it would stay active.)
    for slice_unit in SLICES:
        assert show(m, slice_unit, "ActiveState") == "inactive", slice_unit
        assert show(m, slice_unit, "FragmentPath") == "", slice_unit
    leftovers = m.sh(
        "find /etc/systemd /usr/lib/systemd/system /var/lib/systemd/deb-systemd-helper-enabled"
        " /var/lib/systemd/deb-systemd-helper-masked -name '*volute*' 2>/dev/null; "
        "ls -d /etc/volute /var/lib/volute /var/lib/volute-minds /run/volute"
        " /usr/lib/python3/dist-packages/volutectl"
        " 2>/dev/null; true"
    ).stdout
    assert leftovers == "", leftovers
    unit_files = m.run(
        ["systemctl", "list-unit-files", "--no-legend", "volute*"], check=False
    ).stdout
    assert unit_files.strip() == "", unit_files
    # No volute unit is left failed, and the host is as healthy as before the install.
    assert failed_units(m) == installed.failed_before
    assert m.wait_running() == installed.state_before
    # Debian keeps system users: files turns left keep an owner by name.
    assert m.run(["getent", "passwd", "volute-turn"], check=False).returncode == 0
    assert m.run(["getent", "group", "volute"], check=False).returncode == 0
    assert m.run(["dpkg-query", "-W", "-f=${Status}", "volutectl"], check=False).stdout in (
        "",
        "unknown ok not-installed",
    )


def test_build_deb_from_scratch_on_trixie(debs: tuple[Path, str]) -> None:
    """packaging/build-deb on a clean trixie root (the Pi's userspace): it installs its own
    build dependencies, trixie's debhelper finds the units in /usr/lib/systemd/system
    without the bookworm shim, and trixie's lintian finds nothing, not even info tags."""
    host_out, _ = debs
    with boot(
        lower=str(ensure_root()),
        name="vt-build",
        binds=[REPO],
        extra_args=apt_cache_binds(),
        prepare={"/etc/resolv.conf": Path("/etc/resolv.conf").read_text()},
    ) as m:
        # The sdist the host fetched (hash-checked again by build-deb): this sandbox's
        # TLS interception is trusted by the host only, not by a clean root.
        sources = m.host_path("/srv/out/sources")
        sources.mkdir(parents=True)
        for sdist in (host_out / "sources").glob("*.tar.gz"):
            (sources / sdist.name).write_bytes(sdist.read_bytes())
        build = m.run(
            [str(REPO / "packaging" / "build-deb"), "/srv/out"],
            env={"DEBIAN_FRONTEND": "noninteractive"},
            timeout=900,
            check=False,
        )
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
        lintian = m.sh("cd /srv/out && lintian -I --pedantic *.deb 2>/dev/null", check=False)
        assert lintian.stdout == "", lintian.stdout
        artifact("lintian-trixie.txt", m.run(["lintian", "--version"]).stdout + lintian.stdout)

        for name in ("volutectl_*.deb", "python3-inotify-simple_*.deb"):
            [on_trixie] = m.host_path("/srv/out").glob(name)
            [on_host] = host_out.glob(name)
            assert deb_contents(on_trixie) == deb_contents(on_host), name


def deb_contents(deb: Path) -> list[str]:
    """Paths, modes and owners in a .deb, but the wheel metadata (.dist-info), whose
    files differ between bookworm's and trixie's Python build tools."""
    listing = subprocess.run(
        ["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    rows = (line.split() for line in listing)
    return sorted(" ".join(row[:2] + row[5:]) for row in rows if ".dist-info/" not in row[5])
