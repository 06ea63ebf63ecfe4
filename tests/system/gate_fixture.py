"""Helpers to run the real gate service (units/ from this checkout) in a test container."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from tests.conftest import REPO, VENV_BIN
from tests.machine import Machine

UNITS = REPO / "units"
VOLUTECTL = str(VENV_BIN / "volutectl")


def install_units(machine: Machine) -> None:
    """Copy units/ into the container; the gate runs this checkout's volutectl."""
    for unit in UNITS.iterdir():
        if unit.suffix in (".service", ".slice", ".timer", ".socket"):
            text = unit.read_text().replace("/usr/bin/volutectl", VOLUTECTL)
            machine.write(f"/etc/systemd/system/{unit.name}", text)
    machine.run(["groupadd", "-f", "-r", "volute"])
    machine.run(
        [
            "sh",
            "-c",
            "id volute >/dev/null 2>&1 || useradd -r -g volute -M -d /nonexistent -s /usr/sbin/nologin volute",
        ]
    )
    machine.run(["systemctl", "daemon-reload"])


def start_gate(machine: Machine, config: str) -> None:
    machine.write("/etc/volute/volutectl.toml", config)
    install_units(machine)
    machine.run(["systemctl", "start", "volute-gate.service"], timeout=60)


def status(machine: Machine) -> dict[str, object]:
    out = machine.run([VOLUTECTL, "status", "--json"]).stdout
    result: dict[str, object] = json.loads(out)
    return result


def deliver(machine: Machine, mind: str, message: str, *args: str, check: bool = True) -> int:
    proc = machine.run([VOLUTECTL, "deliver", mind, "--message", message, *args], check=check)
    return int(proc.stdout.strip()) if proc.returncode == 0 else -proc.returncode


def live_turn_scopes(machine: Machine, slice_: str = "volute-turns.slice") -> list[str]:
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


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {predicate}")


def journal(machine: Machine, unit: str = "volute-gate.service") -> str:
    return machine.run(["journalctl", "--no-pager", "-o", "cat", "-u", unit], check=False).stdout


def mind_of(unit: str) -> str:
    match = re.fullmatch(r"volute-turn-(.+)-[0-9]+\.scope", unit)
    return match.group(1) if match else ""


def host_path(machine: Machine, path: str) -> Path:
    return machine.host_path(path)
