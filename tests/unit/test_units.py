"""The units, sysusers/tmpfiles files, example config, completion and Debian files.

`systemd-analyze verify`, `systemd-sysusers` and `systemd-tmpfiles` run for real against
a throwaway root in tmp_path (they need no running systemd with --root). The install
tier checks the same units again under trixie's systemd 257.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from volutectl import roles
from volutectl.config.settings import Settings, flatten, load_settings
from volutectl.host import doctor
from volutectl.launcher import home
from volutectl.wire import orders

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "units"
PACKAGING = REPO / "packaging"
DEBIAN = REPO / "debian"
EXAMPLE = PACKAGING / "volutectl.toml"
SYSTEM_UNITS = Path("/usr/lib/systemd/system")
VERIFY_NAMES = [
    "volute.slice",
    "volute-turns.slice",
    "volute-tests.slice",
    "volute-gate.service",
    "volute-gate.socket",
    "volute-launcher.service",
    "volute-launcher.socket",
    "volute-heartbeat@m1.timer",
    "volute-heartbeat@m1.service",
]


def unit_files() -> list[Path]:
    return sorted(
        p for p in UNITS.iterdir() if p.suffix in (".slice", ".service", ".socket", ".timer")
    )


def parse_unit(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(path)
    return parser


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/bin:/bin")
    assert found, f"{name} is not installed (apt-get install systemd)"
    return found


def verify_root(tmp_path: Path, units: Path = UNITS) -> Path:
    """A root with the system's units, ours, and an executable /usr/bin/volutectl."""
    root = tmp_path / "root"
    unit_dir = root / "usr/lib/systemd/system"
    shutil.copytree(SYSTEM_UNITS, unit_dir, symlinks=True)
    (root / "lib").symlink_to("usr/lib")
    for unit in units.iterdir():
        shutil.copy(unit, unit_dir / unit.name)
    binary = root / "usr/bin/volutectl"
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return root


def analyze_verify(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("systemd-analyze"), "verify", "--man=no", f"--root={root}", *VERIFY_NAMES],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    result = analyze_verify(verify_root(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == "", result.stderr + result.stdout


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """Guard against a vacuous pass: verify must see our files under --root."""
    broken = tmp_path / "units"
    shutil.copytree(UNITS, broken)
    gate = broken / "volute-gate.service"
    gate.write_text(gate.read_text().replace("Type=notify", "Type=notifyish"))
    result = analyze_verify(verify_root(tmp_path, broken))
    assert "notifyish" in result.stderr


def test_every_unit_is_documented() -> None:
    for path in unit_files():
        assert parse_unit(path).get("Unit", "Documentation", fallback=""), path.name


NAMED_UNIT = re.compile(r"\bvolute-[\w-]+(?:@[\w]*)?\.(?:service|socket|slice|timer)\b")


def test_every_unit_the_package_and_docs_name_is_one_we_ship() -> None:
    """A hint, a docstring or a page that names a unit names one in units/ (an instance
    of a template, `volute-heartbeat@MIND.timer`, names the template)."""
    shipped = {path.name for path in unit_files()}
    texts = [
        *(REPO / "volutectl").rglob("*.py"),
        *(REPO / "docs").glob("*.md"),
        REPO / "README.md",
        PACKAGING / "volutectl.1",
    ]
    named = {
        (re.sub(r"@\w*\.", "@.", name), str(path.relative_to(REPO)))
        for path in texts
        for name in NAMED_UNIT.findall(path.read_text())
    }
    assert len({unit for unit, _ in named}) >= 6  # the texts were read at all
    assert sorted(pair for pair in named if pair[0] not in shipped) == []


def test_slices_nest_and_turns_outweigh_tests() -> None:
    turns = parse_unit(UNITS / "volute-turns.slice")
    tests = parse_unit(UNITS / "volute-tests.slice")
    assert (UNITS / "volute.slice").exists()  # the parent of both, by the dash rule
    assert Settings().turns.slice == "volute-turns.slice"
    assert Settings().tests.slice == "volute-tests.slice"
    assert int(turns.get("Slice", "CPUWeight")) > int(tests.get("Slice", "CPUWeight"))


# Settings every turn would inherit from the launcher, which forks it (see the unit).
LEAKS_INTO_TURNS = {
    "ProtectSystem",
    "ProtectHome",
    "PrivateTmp",
    "PrivateDevices",
    "PrivateNetwork",
    "PrivateUsers",
    "NoNewPrivileges",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
    "ProtectProc",
    "ProtectHostname",
    "ProtectClock",
    "ReadOnlyPaths",
    "InaccessiblePaths",
    "TemporaryFileSystem",
    "RestrictAddressFamilies",
    "RestrictNamespaces",
    "RestrictSUIDSGID",
    "MemoryDenyWriteExecute",
    "LockPersonality",
    "SystemCallArchitectures",
    "CapabilityBoundingSet",
    "AmbientCapabilities",
    "UMask",
    "OOMScoreAdjust",
    "Nice",
    "IOSchedulingClass",
    "CPUSchedulingPolicy",
    "LimitNOFILE",
}


def test_launcher_service_contract() -> None:
    service = parse_unit(UNITS / "volute-launcher.service")["Service"]
    assert service["Type"] == "notify"
    assert service["ExecStart"] == "/usr/bin/volutectl launcher"
    assert service["Restart"] == "on-failure"
    # control-group reaches only the service cgroup; turns live in their own scopes.
    assert service["KillMode"] == "control-group"
    assert service["RuntimeDirectory"] == "volute"
    assert service["RuntimeDirectoryPreserve"] == "yes"
    assert "User" not in service  # root: it forks turns as their minds' users
    settings = Settings()
    assert settings.gate.runtime_dir == Path("/run") / service["RuntimeDirectory"]
    # The minds' homes: root's directory, which no mind may write (home.py checks it).
    assert Path("/var/lib") / service["StateDirectory"] == home.HOMES_DIR
    assert service["StateDirectoryMode"] == "0755"
    leaked = sorted(LEAKS_INTO_TURNS & set(service))
    assert not leaked, f"these would silently bind every turn: {leaked}"
    for option in service.get("SystemCallFilter", "").split():
        assert option.lstrip("~") in ("@clock", "@module", "@raw-io", "@swap"), option
    assert service["SystemCallFilter"].startswith("~")  # a deny list, never an allow list


def test_launcher_socket_is_the_gates_alone() -> None:
    unit = parse_unit(UNITS / "volute-launcher.socket")
    socket = unit["Socket"]
    assert socket["ListenStream"] == orders.DEFAULT_SOCKET
    assert socket["SocketUser"] == "root"
    assert socket["SocketGroup"] == orders.GATE_USER
    assert socket["SocketMode"] == "0660"
    assert socket.get("Accept", "no") == "no"
    service = parse_unit(UNITS / "volute-launcher.service")["Unit"]
    assert "volute-launcher.socket" in service["Requires"].split()
    assert service["StartLimitIntervalSec"] == "0"


def test_gate_service_contract() -> None:
    unit = parse_unit(UNITS / "volute-gate.service")
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert service["ExecStart"] == "/usr/bin/volutectl gate"
    assert service["Restart"] == "on-failure"
    assert service["KillMode"] == "control-group"
    assert service["StateDirectory"] == "volute"
    assert Settings().gate.state_dir == Path("/var/lib") / service["StateDirectory"]
    # Unprivileged and sandboxed: it forks nothing, so nothing of this reaches a turn.
    assert service["User"] == orders.GATE_USER
    # The config is root:volute-admin 0640: the gate reads it as a member (no role comes
    # of it: roles are the peers', volutectl/roles.py).
    groups = service["SupplementaryGroups"].split()
    assert groups == [Settings().gate.socket_group, roles.ADMIN_GROUP]
    assert service["CapabilityBoundingSet"] == ""
    for option in ("NoNewPrivileges", "PrivateTmp", "PrivateDevices", "RestrictSUIDSGID"):
        assert service[option] == "yes", option
    assert service["ProtectSystem"] == "strict"
    assert service["RestrictAddressFamilies"] == "AF_UNIX"
    assert "RuntimeDirectory" not in service  # /run/volute is the launcher's (root's)
    # Its orders go to the launcher's socket.
    launcher = parse_unit(UNITS / "volute-launcher.socket")["Socket"]["ListenStream"]
    assert f"VOLUTE_GATE__LAUNCHER_SOCKET={launcher}" in service["Environment"].split()
    assert "volute-launcher.socket" in unit["Unit"]["Wants"].split()
    assert "volute-launcher.socket" in unit["Unit"]["After"].split()


def test_gate_socket_is_systemds_and_matches_the_config() -> None:
    unit = parse_unit(UNITS / "volute-gate.socket")
    socket = unit["Socket"]
    settings = Settings()
    # The path and group a client finds in the default config are the unit's.
    assert socket["ListenStream"] == str(settings.gate.socket)
    assert socket["SocketGroup"] == settings.gate.socket_group
    assert socket["SocketUser"] == "root"
    assert socket["SocketMode"] == "0660"
    assert socket.get("Accept", "no") == "no"  # the listening socket itself goes to the gate
    assert socket.get("RemoveOnStop", "no") == "no"
    assert not [key for key in socket if key.startswith("Listen") and key != "ListenStream"]
    assert unit["Install"]["WantedBy"] == "sockets.target"
    assert "man:systemd.socket(5)" in unit["Unit"]["Documentation"]


def test_gate_service_is_wired_to_its_socket_and_still_starts_at_boot() -> None:
    unit = parse_unit(UNITS / "volute-gate.service")
    # However the gate is started, its socket listens first and is passed to it.
    assert "volute-gate.socket" in unit["Unit"]["Requires"].split()
    assert "volute-gate.socket" in unit["Unit"]["After"].split()
    # A tripped start limit would fail the socket too ('service-start-limit-hit').
    assert unit["Unit"]["StartLimitIntervalSec"] == "0"
    assert float(unit["Service"]["RestartSec"].rstrip("s")) >= 1  # what paces a crash loop
    # Enabled on its own too: deliveries queued before a reboot drain without a client.
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    # dh_installsystemd follows Also= into the service's restart-on-upgrade snippet.
    assert "Also" not in unit["Install"]
    # The socket's file lives in the launcher's runtime directory, which a stop or a
    # restart of the launcher must never remove under systemd.
    service = parse_unit(UNITS / "volute-launcher.service")["Service"]
    socket = parse_unit(UNITS / "volute-gate.socket")["Socket"]
    listen = Path(socket["ListenStream"])
    assert listen.parent == Path("/run") / service["RuntimeDirectory"]
    assert service["RuntimeDirectoryPreserve"] == "yes"
    assert socket["DirectoryMode"] == service["RuntimeDirectoryMode"]


def test_heartbeat_is_aligned_and_delivers() -> None:
    timer = parse_unit(UNITS / "volute-heartbeat@.timer")["Timer"]
    assert timer["OnCalendar"] == "*-*-* *:00:00"
    assert timer["AccuracySec"] == "1s"
    service = parse_unit(UNITS / "volute-heartbeat@.service")["Service"]
    assert service["Type"] == "oneshot"
    assert service["ExecStart"] == (
        "/usr/bin/volutectl deliver %i --session heartbeat --message heartbeat"
    )
    assert service["SupplementaryGroups"] == Settings().gate.socket_group
    # A client needs the socket, not a running gate: a connection starts it.
    heartbeat = parse_unit(UNITS / "volute-heartbeat@.service")["Unit"]
    assert heartbeat["Wants"] == heartbeat["After"] == "volute-gate.socket"


# -- sysusers and tmpfiles, applied for real to a throwaway root ---------------------------


def test_sysusers_creates_the_group_and_the_default_turn_user(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    result = subprocess.run(
        [tool("systemd-sysusers"), f"--root={tmp_path}", str(DEBIAN / "volutectl.sysusers")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    settings = Settings()
    groups = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/group").read_text().splitlines()
    }
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    assert settings.gate.socket_group in groups
    # The admins' group, empty: the package makes no user an admin (root is one anyway).
    assert groups[roles.ADMIN_GROUP][3] == ""
    user = passwd[settings.turns.default_user]
    # The default turn user is no member of the socket's group, which may use the gate:
    # not its primary group, nor a supplementary one. Its group is its own.
    socket_group = groups[settings.gate.socket_group]
    assert user[3] != socket_group[2]
    assert settings.turns.default_user not in socket_group[3].split(",")
    own = [name for name, fields in groups.items() if fields[2] == user[3]]
    assert own == [settings.turns.default_user]
    assert 0 < int(user[2]) < 1000  # a system user
    assert user[6] == "/usr/sbin/nologin"
    gate = passwd[orders.GATE_USER]  # the gate's own user, and group; reads the config
    assert gate[3] == groups[orders.GATE_USER][2] and 0 < int(gate[2]) < 1000
    assert orders.GATE_USER in groups[settings.gate.socket_group][3].split(",")


def test_tmpfiles_make_the_directories_the_unit_expects(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    users = [tool("systemd-sysusers"), f"--root={tmp_path}", str(DEBIAN / "volutectl.sysusers")]
    subprocess.run(users, check=True, capture_output=True, timeout=60)
    result = subprocess.run(
        [
            tool("systemd-tmpfiles"),
            f"--root={tmp_path}",
            "--create",
            str(DEBIAN / "volutectl.tmpfiles"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    service = parse_unit(UNITS / "volute-gate.service")["Service"]
    launcher = parse_unit(UNITS / "volute-launcher.service")["Service"]
    settings = Settings()
    state = tmp_path / str(settings.gate.state_dir).lstrip("/")
    runtime = tmp_path / str(settings.gate.runtime_dir).lstrip("/")
    assert stat.S_IMODE(state.stat().st_mode) == int(service["StateDirectoryMode"], 8)
    assert stat.S_IMODE(runtime.stat().st_mode) == int(launcher["RuntimeDirectoryMode"], 8)
    passwd = (tmp_path / "etc/passwd").read_text().splitlines()
    [gate_uid] = [line.split(":")[2] for line in passwd if line.startswith(f"{service['User']}:")]
    assert state.stat().st_uid == int(gate_uid)  # the store is the gate's
    assert runtime.stat().st_uid == 0  # the turns' directories are root's


# -- the example config --------------------------------------------------------------------

KEY_LINE = re.compile(r"^#(?P<key>[a-z_]+) = (?P<value>.+)$")
SECTION_LINE = re.compile(r"^#?\[(?P<section>[a-z_.]+)\]$")


def commented_keys() -> dict[str, list[str]]:
    """dotted key -> the values shown on its commented lines, in file order."""
    found: dict[str, list[str]] = {}
    section = ""
    for line in EXAMPLE.read_text().splitlines():
        if match := SECTION_LINE.match(line):
            section = match["section"]
        elif match := KEY_LINE.match(line):
            found.setdefault(f"{section}.{match['key']}", []).append(match["value"])
    return found


def test_example_config_as_shipped_is_all_defaults() -> None:
    loaded = load_settings(EXAMPLE, environ={})
    assert loaded.settings == Settings()
    assert tomllib.loads(EXAMPLE.read_text()) == {
        "gate": {},
        "limits": {},
        "turns": {},
        "tests": {},
    }


def test_example_config_shows_every_key_with_its_default() -> None:
    shown = commented_keys()
    defaults = flatten(Settings())
    del defaults["minds"]  # an empty table by default; see the example mind test
    missing = sorted(set(defaults) - set(shown))
    assert not missing, f"keys missing from {EXAMPLE.name}: {missing}"
    for key, default in defaults.items():
        if default is None:
            continue  # no TOML spelling for "unset"; the line shows an example value
        value = tomllib.loads(f"v = {shown[key][0]}")["v"]
        *sections, name = key.split(".")
        table: dict[str, object] = {name: value}
        for section in reversed(sections[1:]):
            table = {section: table}
        section_table: dict[str, Any] = {sections[0]: table}  # Settings validates it
        parsed: object = getattr(Settings(**section_table), sections[0])
        for section in sections[1:]:
            parsed = getattr(parsed, section)
        assert getattr(parsed, name) == default, key


def test_example_mind_uncommented_is_valid(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    mind = text[text.index("#[minds.example]") :]
    uncommented = "\n".join(
        line[1:] if KEY_LINE.match(line) or SECTION_LINE.match(line) else line
        for line in mind.splitlines()
    )
    path = tmp_path / "volutectl.toml"
    path.write_text(uncommented + "\n")
    settings = load_settings(path, environ={}).settings
    example = settings.minds["example"]
    fields = set(type(example).model_fields)
    shown = {key.split(".", 2)[-1] for key in commented_keys() if key.startswith("minds.")}
    assert fields == shown, f"mind keys not shown: {sorted(fields - shown)}"


# -- completion and the Debian files --------------------------------------------------------


def test_bash_completion_is_clicks_current_script() -> None:
    volutectl = Path(sys.executable).parent / "volutectl"
    env = {**os.environ, "_VOLUTECTL_COMPLETE": "bash_source"}
    generated = subprocess.run(
        [str(volutectl)], capture_output=True, text=True, env=env, timeout=60, check=True
    ).stdout
    shipped = (PACKAGING / "completion" / "volutectl").read_text()
    assert shipped == generated, "regenerate: _VOLUTECTL_COMPLETE=bash_source volutectl"


@pytest.mark.parametrize("script", ["volutectl.postinst", "volutectl.postrm"])
def test_maintainer_scripts_keep_the_debhelper_token(script: str) -> None:
    text = (DEBIAN / script).read_text()
    assert text.startswith("#!/bin/sh\nset -e\n")
    assert "\n#DEBHELPER#\n" in text


def test_package_depends_on_debians_own_modules() -> None:
    control = (DEBIAN / "control").read_text()
    for package in ("python3-pystemd", "python3-click", "python3-pydantic-settings"):
        assert package in control
    assert "Architecture: all" in control
    assert "Rules-Requires-Root: no" in control


def test_every_unit_is_installed_and_only_the_gate_is_restarted_on_upgrade() -> None:
    install = (DEBIAN / "volutectl.install").read_text()
    for suffix in ("slice", "service", "socket", "timer"):
        assert f"units/*.{suffix} usr/lib/systemd/system" in install
    assert {path.suffix for path in UNITS.iterdir()} == {".slice", ".service", ".socket", ".timer"}
    calls = [
        line.split()[1:]
        for line in (DEBIAN / "rules").read_text().splitlines()
        if line.strip().startswith("dh_installsystemd")
    ]
    # Restarting volute-turns.slice on upgrade would stop every running turn; stopping
    # the socket would refuse the deliveries that arrive while the gate restarts.
    assert calls == [
        ["--no-stop-on-upgrade", "volute-gate.socket", "volute-launcher.socket"],
        ["volute-gate.service"],
        ["--no-enable", "volute-launcher.service"],
    ]


def test_the_polkit_rule_its_group_and_doctor_agree(tmp_path: Path) -> None:
    """The rule the .deb installs is the file doctor checks, refuses both linger actions
    to the default turn user and the group sysusers makes, and sysusers puts that user
    in that group (docs/packaging.md, "Lingering")."""
    rule = REPO / "packaging" / "polkit" / doctor.POLKIT_RULE.name
    install = (DEBIAN / "volutectl.install").read_text().splitlines()
    assert f"packaging/polkit/{rule.name} {doctor.POLKIT_RULE.parent.relative_to('/')}" in install
    text = rule.read_text()
    for action in ("set-self-linger", "set-user-linger"):
        assert f'action.id == "org.freedesktop.login1.{action}"' in text
    assert f'subject.user == "{Settings().turns.default_user}"' in text
    assert f'subject.isInGroup("{doctor.TURNS_GROUP}")' in text
    assert "polkit.Result.NO" in text and "polkit.Result.YES" not in text
    (tmp_path / "etc").mkdir()
    users = [tool("systemd-sysusers"), f"--root={tmp_path}", str(DEBIAN / "volutectl.sysusers")]
    subprocess.run(users, check=True, capture_output=True, timeout=60)
    groups = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/group").read_text().splitlines()
    }
    assert groups[doctor.TURNS_GROUP][3].split(",") == [Settings().turns.default_user]
