"""Preflight of the host and the commands' face: what bounds turns on flash storage, who may
use the gate's socket, and the exact lines and exit codes of `volutectl config check`
and `volutectl doctor` for minds that fail (tests/unit/test_preflight.py checks each
mind's user, command and working directory)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_preflight import ME, MY_GROUP, OWNER, VOLUTECTL
from volutectl.cli.config import limits_notes
from volutectl.config.settings import Settings
from volutectl.errors import EX_CONFIG
from volutectl.kernel import access
from volutectl.kernel.access import Who
from volutectl.launcher import preflight
from volutectl.launcher.fork import TURN_PATH


@pytest.fixture
def tree() -> Iterator[Path]:
    """A directory under /tmp that every user may search (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="volute-preflight-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


# -- what bounds turns at once on flash storage ----------------------------------------


def sysfs(root: Path, disk: str, major: int, kind: str | None, partition: bool = True) -> Path:
    disk_dir = root / "devices" / "platform" / disk
    (disk_dir / "device").mkdir(parents=True)
    if kind is not None:
        (disk_dir / "device" / "type").write_text(kind + "\n")
    (disk_dir / "dev").write_text(f"{major}:0\n")
    target = disk_dir
    if partition:
        target = disk_dir / f"{disk}p2"
        target.mkdir()
        (target / "partition").write_text("2\n")
    (root / "dev" / "block").mkdir(parents=True, exist_ok=True)
    (root / "dev" / "block" / f"{major}:2").symlink_to(target)
    return disk_dir


ADAPTIVE_OFF = {"adaptive": {"enabled": False}}


@pytest.mark.parametrize(
    ("disk", "kind", "said"),
    [
        ("mmcblk0", "SD", "an SD card"),
        ("mmcblk1", "MMC", "eMMC"),
        ("mmcblk0", None, "an SD card or eMMC"),
    ],
)
def test_no_cap_and_no_adaptive_limit_on_an_sd_card_or_emmc_warns(
    tmp_path: Path, disk: str, kind: str | None, said: str
) -> None:
    sysfs(tmp_path, disk, 179, kind)
    unlimited = Settings(limits=ADAPTIVE_OFF)
    status, found, change = preflight.check_cap(unlimited, device=(179, 2), sys_root=tmp_path)
    assert status == "warn"
    assert found == (
        "limits.adaptive is off and limits.global_concurrent_turns is unset, and "
        f"/var/lib/volute is on {disk}, {said}: "
        "turns that all wake at once can stall it until the host starves"
    )
    assert change == (
        "remove limits.adaptive.enabled = false (the adaptive limit is on by default), "
        "or set limits.global_concurrent_turns = 2 in the config"
    )


def test_an_adaptive_limit_turned_off_by_io_pressure_warns_on_an_sd_card(tmp_path: Path) -> None:
    sysfs(tmp_path, "mmcblk0", 179, "SD")
    held = Settings(limits={"io_pressure": {"enabled": True}})
    status, found, change = preflight.check_cap(held, device=(179, 2), sys_root=tmp_path)
    assert status == "warn"
    assert found.startswith("limits.adaptive is off (limits.io_pressure is on) and ")
    assert change.startswith("set limits.io_pressure.enabled = false to let the adaptive limit")


def test_the_default_adaptive_limit_protects_an_sd_card(tmp_path: Path) -> None:
    sysfs(tmp_path, "mmcblk0", 179, "SD")
    assert preflight.check_cap(Settings(), device=(179, 2), sys_root=tmp_path) == (
        "ok",
        "limits.adaptive is on: between 1 and 16 turns at once, starting at 2; no ceiling "
        "(limits.global_concurrent_turns is unset)",
        "",
    )
    capped = Settings(limits={"global_concurrent_turns": 2})
    assert preflight.check_cap(capped, device=(179, 2), sys_root=tmp_path) == (
        "ok",
        "limits.adaptive is on: between 1 and 16 turns at once, starting at 2, under the "
        "ceiling limits.global_concurrent_turns = 2",
        "",
    )


def test_a_cap_or_another_disk_is_fine_without_the_adaptive_limit(tmp_path: Path) -> None:
    sysfs(tmp_path, "mmcblk0", 179, "SD")
    capped = Settings(limits={"global_concurrent_turns": 2, **ADAPTIVE_OFF})
    assert preflight.check_cap(capped, device=(179, 2), sys_root=tmp_path) == (
        "ok",
        "limits.global_concurrent_turns = 2 (limits.adaptive is off)",
        "",
    )
    sysfs(tmp_path, "sda", 8, None)
    unlimited = Settings(limits=ADAPTIVE_OFF)
    assert preflight.check_cap(unlimited, device=(8, 2), sys_root=tmp_path) == (
        "ok",
        "limits.adaptive is off and limits.global_concurrent_turns is unset (no global limit); "
        "/var/lib/volute is on sda",
        "",
    )
    assert preflight.check_cap(unlimited, device=(0, 42), sys_root=tmp_path)[0] == "ok"


def test_a_device_mapper_disk_is_followed_to_the_card_under_it(tmp_path: Path) -> None:
    card = sysfs(tmp_path, "mmcblk0", 179, "SD")
    mapper = tmp_path / "devices" / "virtual" / "block" / "dm-0"
    (mapper / "slaves").mkdir(parents=True)
    (mapper / "slaves" / "mmcblk0p2").symlink_to(card / "mmcblk0p2")
    assert preflight.flash_kind(mapper) == "an SD card"


# -- who may use the socket --------------------------------------------------------------


def socket_file(tree: Path, mode: int = 0o660) -> str:
    path = tree / "gate.sock"
    path.write_text("")
    path.chmod(mode)
    return str(path)


def test_root_and_the_sockets_group_may_connect(tree: Path) -> None:
    path = socket_file(tree)
    root = Who("root", 0, 0, (0,))
    assert access.socket_access(path, "volute", root, ()) == (
        "ok",
        "root is uid 0: it may connect whatever the socket's group",
        "",
    )
    member = Who("alice", 64001, 64001, (64001, os.getgid()))
    status, found, _ = access.socket_access(path, "volute", member, ())
    assert (status, found) == ("ok", f"alice may connect to {path} (mode 0660, owner {OWNER})")


def test_a_caller_outside_the_group_is_told_how_to_join_it(tree: Path) -> None:
    path = socket_file(tree)
    alice = Who("alice", 64001, 64001, (64001,))
    assert access.socket_access(path, "volute", alice, (64001,)) == (
        "warn",
        f"alice may not connect to {path} (mode 0660, owner {OWNER}): it is neither root nor "
        f"in group {MY_GROUP}, so deliver, status and queue exit 77",
        f"usermod -aG {MY_GROUP} alice, then log in again",
    )
    # Added to the group, but this login is older than that:
    assert access.socket_access(path, "volute", alice, (64001, os.getgid())) == (
        "warn",
        f"alice is in group {MY_GROUP} but this login is not yet, so it may not connect to "
        f"{path} (mode 0660, owner {OWNER})",
        f"log in again (or run: newgrp {MY_GROUP})",
    )


def test_before_the_socket_exists_its_group_decides(tree: Path) -> None:
    missing = str(tree / "absent.sock")
    member = Who("alice", 64001, 64001, (64001, os.getgid()))
    assert access.socket_access(missing, MY_GROUP, member, ())[0] == "ok"
    stranger = Who("bob", 64002, 64002, (64002,))
    assert access.socket_access(missing, MY_GROUP, stranger, ())[2] == (
        f"usermod -aG {MY_GROUP} bob, then log in again"
    )
    assert access.socket_access(missing, "no-such-group-here", stranger, ()) == (
        "warn",
        f"{missing} does not exist, and its group no-such-group-here (gate.socket_group) neither",
        "groupadd --system no-such-group-here, or set gate.socket_group",
    )


# -- the commands: exact lines and exit codes --------------------------------------------


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("VOLUTE_")}
    return subprocess.run(
        [str(VOLUTECTL), *args], capture_output=True, text=True, env=env, timeout=60
    )


ROOT_WARNING = "runs as root: its turns may do anything on this host, every mind's secrets included"


def apart(*others: str) -> list[str]:
    """The warnings of a mind of ME that shares ME with `others` (and ME is root here)."""
    which = f"mind {others[0]}" if len(others) == 1 else f"minds {', '.join(others)}"
    shared = (
        f"shares user {ME!r} with {which}: each can read and change the other's files, read "
        "its turns' environment in /proc/PID/environ (secrets included) and signal its processes"
    )
    return [ROOT_WARNING, shared] if os.geteuid() == 0 else [shared]


CEILING = {"global_concurrent_turns": 2}


def config_file(tree: Path, minds: str) -> Path:
    path = tree / "volutectl.toml"
    gate = f'[gate]\nstate_dir = "{tree}/state"\nsocket = "{tree}/gate.sock"\n'
    path.write_text(f"{gate}[limits]\nglobal_concurrent_turns = 2\n\n{minds}")  # CEILING
    return path


def test_config_check_lists_each_minds_problems_and_exits_78(tree: Path) -> None:
    closed = tree / "closed"
    closed.mkdir(mode=0o700)
    config = config_file(
        tree,
        '[minds.ghost]\ncommand = ["/bin/true"]\nuser = "no-such-user-here"\n\n'
        f'[minds.lost]\ncommand = ["no-such-turn-command"]\nuser = "{ME}"\n'
        f'working_directory = "{tree}/gone"\n\n'
        f'[minds.fine]\ncommand = ["sleep", "1"]\nuser = "{ME}"\nworking_directory = "{tree}"\n',
    )
    result = run("config", "check", "--config", str(config))
    assert result.returncode == EX_CONFIG, result.stderr
    assert result.stdout.splitlines() == [
        *[f"  note: {note}" for note in limits_notes(Settings(limits=CEILING))],
        f"  mind ghost: from file {config} (at most 1 turn(s) at once)",
        "    fail: user 'no-such-user-here' does not exist",
        f"  mind lost: from file {config} (at most 1 turn(s) at once)",
        f"    fail: working directory {tree}/gone does not exist",
        f"    fail: command 'no-such-turn-command' is not in the turn's PATH ({TURN_PATH})",
        *[f"    warn: {warning}" for warning in apart("fine")],
        f"  mind fine: from file {config} (at most 1 turn(s) at once)",
        *[f"    warn: {warning}" for warning in apart("lost")],
        f"fail: {config}",  # the verdict, last
    ]
    assert result.stderr.splitlines() == [
        "volutectl: warning: minds lost, fine are not kept apart (see the warn lines)",
        f"  hint: {preflight.APART_HINT}",
        "volutectl: minds ghost, lost fail preflight: their turns cannot start on this host",
        "  hint: fix what each fail line says; until then every turn fails and goes dead",
    ]


def test_config_check_passes_minds_that_can_run(tree: Path) -> None:
    config = config_file(tree, f'[minds.fine]\ncommand = "exec sleep 1"\nuser = "{ME}"\n')
    result = run("config", "check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "fail:" not in result.stdout
    assert "    note: of the shell command only 'sleep' is checked; sh -c runs the rest" in (
        result.stdout.splitlines()
    )


def test_doctor_fails_a_mind_with_78_and_reports_the_socket_and_the_cap(tree: Path) -> None:
    config = config_file(
        tree,
        f'[minds.lost]\ncommand = ["/bin/true"]\nuser = "{ME}"\n'
        f'working_directory = "{tree}/gone"\n\n'
        f'[minds.fine]\ncommand = ["/bin/true"]\nuser = "{ME}"\nworking_directory = "{tree}"\n',
    )
    result = run("doctor", "--json", "--config", str(config))
    assert result.returncode == EX_CONFIG, result.stderr
    checks = {check["check"]: check for check in json.loads(result.stdout)["checks"]}
    warnings = "; ".join(apart("fine"))
    assert checks["mind lost"] == {
        "check": "mind lost",
        "status": "fail",
        "found": f"working directory {tree}/gone does not exist; {warnings}",
        "change": "fix it (a config change needs a restart of the gate); until then every turn "
        "of this mind fails",
        "exit_code": EX_CONFIG,
    }
    # Its turns can start: it passes, with a warning (root, and a user shared with lost).
    assert checks["mind fine"] == {
        "check": "mind fine",
        "status": "warn",
        "found": "; ".join(apart("lost"))
        + f"; runs as {ME}: user, command and working directory pass",
        "change": preflight.APART_HINT,
        "exit_code": 0,
    }
    assert checks["turn-cap"]["found"] == preflight.check_cap(Settings(limits=CEILING))[1]
    assert checks["socket-access"]["status"] == "ok"  # root, or this user's own group
    text = run("doctor", "--config", str(config)).stdout.splitlines()
    assert (
        f"fail mind lost    working directory {tree}/gone does not exist; {warnings}; "
        "change: fix it (a config change needs a restart of the gate); until then every turn "
        "of this mind fails"
    ) in text
