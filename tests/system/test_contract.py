"""The real adapter (volutectl.systemd.adapter.Manager) on a real systemd keeps the promises that
tests/contract.py states and tests/unit/fake_systemd.py is held to."""

from __future__ import annotations

import json

import pytest

from tests import contract
from volute_testbed.machine import Machine
from volute_testbed.paths import CHECKOUT, PYTHON

pytestmark = pytest.mark.system


def test_the_real_systemd_keeps_the_contract(machine: Machine) -> None:
    out = machine.run(
        [str(PYTHON), str(CHECKOUT / "tests" / "contract.py")],
        env={"PYTHONPATH": str(CHECKOUT)},
        timeout=120,
    ).stdout
    results = json.loads(out)
    assert set(results) == {check.__name__ for check in contract.CHECKS}
    failed = {name: why for name, why in results.items() if why != "ok"}
    assert not failed, failed
