"""The real gate service (units/ from this checkout) in a booted machine: install and start
it, deliver, and read back what systemd, the store and the turn probe saw."""

from __future__ import annotations

import json
import sys
import time
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from volute_testbed import turn_probe
from volute_testbed.machine import Machine
from volute_testbed.paths import CHECKOUT, PYTHON, SCRIPTS
from volute_testbed.scope_sampler import Samples
from volute_testbed.turn_probe import TURNS_LOG

UNITS = CHECKOUT / "units"
DEFAULT_SOCKET = "/run/volute/gate.sock"  # volute-gate.socket's ListenStream=
VOLUTECTL = str(SCRIPTS / "volutectl")
DEFAULT_TURN_USER = "volute-turn"  # turns.default_user's default, as the package makes it
# As debian/volutectl.sysusers makes it: its own group, and volute to read the config.
GATE_USER_GROUPS = ("-g", "volute-gate", "-G", "volute")
TURNS_GROUP = "volute-turns"  # debian/volutectl.sysusers: the turns' users
POLKIT_RULE = CHECKOUT / "packaging" / "polkit" / "40-volutectl.rules"
POLKIT_RULES = f"/usr/share/polkit-1/rules.d/{POLKIT_RULE.name}"  # where the package puts it


def install_units(machine: Machine) -> None:
    """Copy units/ into the container; the gate and the launcher run this checkout's
    volutectl, and the users the package makes (debian/volutectl.sysusers) are made,
    and its polkit rule is installed.

    volute-gate.socket and volute-launcher.socket come along and are enabled as the
    package does; the gate Requires= its socket, so every gate a test starts serves
    systemd's socket, not its own, and gives its orders to the launcher's."""
    for unit in UNITS.iterdir():
        if unit.suffix in (".service", ".slice", ".timer", ".socket"):
            text = unit.read_text().replace("/usr/bin/volutectl", VOLUTECTL)
            machine.write(f"/etc/systemd/system/{unit.name}", text)
    # Test-only: this checkout and its interpreter may live under /root (pyenv), /tmp or
    # /var/tmp (a CI clone), which the heartbeat's ProtectHome=yes and the private /tmp
    # and /var/tmp of DynamicUser=yes hide; so they are bound back in, read-only. The
    # packaged volutectl is /usr/bin/volutectl and needs none of this.
    paths = {str(CHECKOUT), str(Path(sys.prefix)), str(Path(sys.base_prefix))}
    binds = " ".join(f"-{path}" for path in sorted(paths))
    machine.write(
        "/etc/systemd/system/volute-heartbeat@.service.d/test-venv.conf",
        f"[Service]\nProtectHome=read-only\nBindReadOnlyPaths={binds}\n",
    )
    # The gate's unit has ProtectHome=read-only and a private /tmp of its own already.
    machine.write(
        "/etc/systemd/system/volute-gate.service.d/test-venv.conf",
        f"[Service]\nBindReadOnlyPaths={binds}\n",
    )
    machine.run(["groupadd", "-f", "-r", "volute"])
    machine.run(["groupadd", "-f", "-r", "volute-admin"])
    machine.run(["groupadd", "-f", "-r", "volute-gate"])
    # As debian/volutectl.sysusers does: the default turn user with a group of its own,
    # outside the socket's group; the gate's user in volute, to read the config.
    users = ((DEFAULT_TURN_USER, ("-U",)), ("volute-gate", GATE_USER_GROUPS))
    for user, groups in users:
        add = ["useradd", "-r", *groups, "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin"]
        machine.sh(f"id {user} >/dev/null 2>&1 || {' '.join(add)} {user}")
    # As the package does: the default turn user in group volute-turns, whose members
    # the package's polkit rule refuses lingering (debian/volutectl.install puts it in
    # /usr/share/polkit-1/rules.d; polkitd, D-Bus activated, reads it when it starts).
    machine.run(["groupadd", "-f", "-r", TURNS_GROUP])
    machine.run(["usermod", "-a", "-G", TURNS_GROUP, DEFAULT_TURN_USER])
    machine.write(POLKIT_RULES, POLKIT_RULE.read_text())
    machine.run(["systemctl", "daemon-reload"])
    machine.run(["systemctl", "enable", "volute-gate.socket", "volute-launcher.socket"])


def start_gate(machine: Machine, config: str, *, move_socket: bool = True) -> None:
    """Install the units and start the gate behind its socket, with this config.

    A config that names another gate.socket moves volute-gate.socket there as an admin
    must (a drop-in: an empty ListenStream=, then the path), unless `move_socket` is
    False: then the two disagree, and the gate serves the unit's socket anyway."""
    machine.write("/etc/volute/volutectl.toml", config)
    path = str(tomllib.loads(config).get("gate", {}).get("socket", DEFAULT_SOCKET))
    if move_socket and path != DEFAULT_SOCKET:
        machine.write(
            "/etc/systemd/system/volute-gate.socket.d/path.conf",
            f"[Socket]\nListenStream=\nListenStream={path}\n",
        )
    install_units(machine)
    machine.run(["systemctl", "start", "volute-gate.socket", "volute-gate.service"], timeout=60)
    assert gate_serves_systemds_socket(machine, path if move_socket else DEFAULT_SOCKET)


def unit_property(machine: Machine, unit: str, prop: str) -> str:
    return machine.run(["systemctl", "show", "-P", prop, unit]).stdout.strip()


def listening_socket(machine: Machine, inode: str) -> str | None:
    """The path a listening unix socket is bound to, by inode, from /proc/net/unix.

    By inode, not by path: containers share the host's network namespace, so another
    test's container may have a socket listening at the same path."""
    table = machine.run(["cat", "/proc/net/unix"]).stdout.splitlines()[1:]
    # Num RefCount Protocol Flags Type St Inode Path; Flags 00010000: listening
    for fields in map(str.split, table):
        if fields[6] == inode and fields[3] == "00010000" and len(fields) == 8:
            return fields[7]
    return None


def gate_serves_systemds_socket(machine: Machine, path: str = DEFAULT_SOCKET) -> bool:
    """The running gate's fd 3 listens at `path`, and PID 1 (systemd) holds it too."""
    pid = unit_property(machine, "volute-gate.service", "MainPID")
    fd3 = machine.run(["readlink", f"/proc/{pid}/fd/3"], check=False).stdout.strip()
    if pid == "0" or not fd3.startswith("socket:["):
        return False
    # An fd PID 1 closes while ls lists them makes ls exit 1 (CI): the rest is listed.
    held_by_systemd = fd3 in machine.sh("ls -l /proc/1/fd", check=False).stdout
    return held_by_systemd and listening_socket(machine, fd3[len("socket:[") : -1]) == path


STATES_SQL = """
import json, sqlite3
db = sqlite3.connect("/var/lib/volute/queue.sqlite3", timeout=10)
print(json.dumps(dict(db.execute("SELECT id, state FROM deliveries"))))
"""


def delivery_states(machine: Machine) -> dict[int, str]:
    """Every delivery in the store and its state (`queue list` shows the newest 50 unless asked)."""
    out = machine.run([PYTHON, "-c", STATES_SQL]).stdout
    return {int(key): str(value) for key, value in json.loads(out).items()}


def status(machine: Machine) -> dict[str, Any]:
    """`status --json`'s object, as JSON has it."""
    out = machine.run([VOLUTECTL, "status", "--json"]).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def deliver(machine: Machine, mind: str, message: str, *args: str, check: bool = True) -> int:
    proc = machine.run([VOLUTECTL, "deliver", mind, "--message", message, *args], check=check)
    return int(proc.stdout.strip()) if proc.returncode == 0 else -proc.returncode


def live_turn_scopes(machine: Machine) -> list[str]:
    out = machine.run(
        [
            "systemctl",
            "list-units",
            "--plain",
            "--no-legend",
            "--state=active,activating,deactivating",
            "volute-turn-*.scope",
        ]
    ).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def wait_for(
    # Called with no arguments; `...` lets a lambda bind a loop variable as a default.
    predicate: Callable[..., object],
    timeout: float = 30.0,
    interval: float = 0.05,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {predicate}")


def journal(machine: Machine, unit: str = "volute-gate.service") -> str:
    return machine.run(["journalctl", "--no-pager", "-o", "cat", "-u", unit], check=False).stdout


def gate_events(
    machine: Machine, *matches: str, unit: str = "volute-gate.service"
) -> list[dict[str, object]]:
    """The unit's journal entries (journalctl -o json) that carry every FIELD=value in
    `matches`, e.g. "VOLUTE_EVENT=adopt": the events of volutectl/events.py as the
    journal recorded them. Tests assert on their MESSAGE_ID and VOLUTE_* fields, which
    docs/journal.md fixes, not on MESSAGE, which is free to change."""
    command = ["journalctl", "--no-pager", "-o", "json", "-u", unit, *matches]
    out = machine.run(command, check=False).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def install_probe(machine: Machine) -> None:
    """/usr/local/bin/turn-probe (volute_testbed.turn_probe), and an empty log for it."""
    machine.write("/usr/local/bin/turn-probe", turn_probe.script(), mode=0o755)
    machine.run(["sh", "-c", f": > {TURNS_LOG}; chmod 666 {TURNS_LOG}"])


def turn_log(machine: Machine) -> list[list[str]]:
    """The turn probe's log, each line split into its words."""
    text = machine.host_path(TURNS_LOG).read_text()
    return [line.split() for line in text.splitlines() if line.strip()]


def delivered_ids(log: list[list[str]]) -> list[int]:
    """Every delivery id a turn received, from stdin (start lines) or its inbox (took)."""
    ids: list[int] = []
    for fields in log:
        if fields[0] == "start":
            ids += [int(x) for x in fields[5:]]
        elif fields[0] == "took":
            ids.append(int(fields[4]))
    return ids


class Sampler:
    """Samples live turn/test scopes from systemd inside the container, every ~2 ms."""

    def __init__(self, machine: Machine, name: str = "sampler") -> None:
        self.machine = machine
        self.stop_file = f"/var/tmp/{name}.stop"
        self.out_file = f"/var/tmp/{name}.json"
        self.proc = machine.popen(
            [PYTHON, "-m", "volute_testbed.scope_sampler", self.stop_file, self.out_file]
        )
        self.result: Samples | None = None

    def stop(self) -> Samples:
        self.machine.write(self.stop_file, "")
        self.proc.wait(timeout=30)
        result: Samples = json.loads(self.machine.host_path(self.out_file).read_text())
        self.result = result
        return result


def gate_config(
    minds: Mapping[str, str], *, adaptive: bool = False, **sections: Mapping[str, object]
) -> str:
    """A config TOML: `minds` maps name -> command string; sections add [limits] etc.
    (a nested table by its dotted name: `**{"limits.io_pressure": {...}}`).

    The adaptive limit is off unless `adaptive` is true or a "limits.adaptive" section is
    given: the file then says `[limits.adaptive] enabled = false`, so that the tests
    written before it (issue 21) run as they did, with no global limit on turns at once
    but the [limits] they set. A test that relies on that says `adaptive=False` itself;
    one of the adaptive gate passes `adaptive=True` for the package's default."""
    if not adaptive and "limits.adaptive" not in sections:
        sections = {**sections, "limits.adaptive": {"enabled": False}}
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {json.dumps(value)}")
    for name, command in minds.items():
        lines.append(f'[minds."{name}"]')
        lines.append(f"command = {json.dumps(command)}")
    return "\n".join(lines) + "\n"


def all_settled(machine: Machine) -> bool:
    """No delivery is pending or running any more."""
    return not queue_rows(machine, "pending", "running")


def queue_rows(machine: Machine, *states: str) -> list[dict[str, Any]]:
    """The rows in `states` (default: pending, running, dead) in id order: all of them,
    up to the gate's most (10,000), not the newest 50 that `queue list` shows by default.
    Each is `queue list --json`'s object, as JSON has it (docs/protocol.schema.json)."""
    args = [VOLUTECTL, "queue", "list", "--json", "--limit", "10000"]
    for state in states:
        args += ["--state", state]
    rows: list[dict[str, Any]] = json.loads(machine.run(args).stdout)
    return sorted(rows, key=lambda row: int(row["id"]))
