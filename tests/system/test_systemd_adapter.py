"""The systemd adapter against a real manager (systemd 252 in a throwaway container)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from volute_testbed.machine import Machine
from volute_testbed.paths import CHECKOUT, PYTHON

pytestmark = pytest.mark.system

PROBE = str(CHECKOUT / "tests/system/adapter_probe.py")
PY = PYTHON
ENV = {"PYTHONPATH": str(CHECKOUT)}


def probe(machine: Machine, *args: str) -> dict[str, Any]:
    """adapter_probe.py's JSON object: what it saw, as JSON has it."""
    proc = machine.run([PY, PROBE, *args], env=ENV, timeout=60)
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def show(machine: Machine, unit: str, *props: str) -> dict[str, str]:
    out = machine.run(["systemctl", "show", "-p", ",".join(props), unit]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_scope_holds_the_child_before_it_runs_and_the_end_is_reported(machine: Machine) -> None:
    unit = "volute-turn-probe-1.scope"
    result = probe(machine, "launch", unit, "volute-turns.slice", "0.2", "42", "77")
    assert result["error"] is None
    # Read by the parent after start_scope returned and before the child was released:
    assert f"/volute.slice/volute-turns.slice/{unit}" in str(result["cgroup_before_exec"])
    # And what the child itself saw once it ran:
    child = machine.host_path("/var/tmp/child-cgroup").read_text()
    assert f"volute-turns.slice/{unit}" in child
    assert result["live_while_running"] == [unit]
    assert (unit, "inactive") in [tuple(e) for e in result["ended"]]
    assert result["ended_ms"] is not None


def test_properties_land_in_systemd(machine: Machine) -> None:
    unit = "volute-turn-props-2.scope"
    runner = machine.popen(
        [PY, PROBE, "launch", unit, "volute-turns.slice", "3", "42", "77", "/dev/null 1000000"],
        env=ENV,
        stdout=-1,
    )
    try:
        deadline = time.monotonic() + 10
        props: dict[str, str] = {}
        while time.monotonic() < deadline:
            props = show(machine, unit, "ActiveState", "Slice", "CPUWeight", "IOWeight",
                         "IOWriteBandwidthMax", "CollectMode", "Description")  # fmt: skip
            if props.get("ActiveState") == "active":
                break
            time.sleep(0.05)
        assert props["ActiveState"] == "active"
        assert props["Slice"] == "volute-turns.slice"
        assert props["CPUWeight"] == "42"
        assert props["IOWeight"] == "77"
        assert props["IOWriteBandwidthMax"] == "/dev/null 1000000"
        assert props["CollectMode"] == "inactive-or-failed"
        assert props["Description"] == "adapter probe"
        status = machine.run(["systemctl", "status", "--no-pager", "volute-turns.slice"]).stdout
        assert unit in status
    finally:
        runner.wait(timeout=30)


def test_odd_names_are_escaped_and_stay_in_their_slice(machine: Machine) -> None:
    from volutectl.names import escape_unit_part

    odd = "a-b/../c d$é"
    unit = f"volute-turn-{escape_unit_part(odd)}-3.scope"
    result = probe(machine, "launch", unit, "volute-turns.slice", "0.1", "100", "100")
    assert result["error"] is None
    assert f"/volute.slice/volute-turns.slice/{unit}" in str(result["cgroup_before_exec"])
    # systemd agrees with our escaping: unescaping the name gives back the input.
    out = machine.run(["systemd-escape", "-u", escape_unit_part(odd)]).stdout.strip()
    assert out == odd


def test_a_failing_start_raises_a_clear_error(machine: Machine) -> None:
    result = probe(machine, "launch-dead-pid", "volute-turn-dead-4.scope")
    assert result["error"] is not None
    assert "volute-turn-dead-4.scope" in str(result["error"])
    assert "999999" in str(result["error"])
    assert result["code"] == 69


def test_unreachable_manager_is_unavailable_not_a_traceback(machine: Machine) -> None:
    machine.run(["systemctl", "stop", "dbus.socket", "dbus.service"])
    proc = machine.run(
        [PY, "-c",
         "from volutectl.systemd.adapter import Manager\n"
         "from volutectl.errors import UnavailableError\n"
         "try:\n    Manager.connect()\nexcept UnavailableError as e:\n"
         "    print('unavailable', e.exit_code, e.message)\n"],
        env=ENV,
    )  # fmt: skip
    assert proc.stdout.startswith("unavailable 69 cannot reach the system systemd manager")
