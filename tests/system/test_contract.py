"""The real adapter (volutectl.systemd.Manager) on a real systemd keeps the promises that
tests/contract.py states and tests/unit/fake_systemd.py is held to."""

from __future__ import annotations

import json

import pytest

from tests import contract
from tests.conftest import REPO, VENV_BIN
from tests.machine import Machine

pytestmark = pytest.mark.system


def test_the_real_systemd_keeps_the_contract(machine: Machine) -> None:
    out = machine.run(
        [str(VENV_BIN / "python"), str(REPO / "tests" / "contract.py")],
        env={"PYTHONPATH": str(REPO)},
        timeout=120,
    ).stdout
    results = json.loads(out)
    assert set(results) == {check.__name__ for check in contract.CHECKS}
    failed = {name: why for name, why in results.items() if why != "ok"}
    assert not failed, failed
