"""The fake systemd keeps systemd's promises to the gate (tests/contract.py); the same
checks run against the real systemd in tests/system/test_contract.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests import contract
from tests.unit.fake_systemd import FakeManager
from volutectl.systemd.port import SystemdManager


@pytest.fixture
def manager() -> Iterator[FakeManager]:
    fake = FakeManager()
    fake.watch_units()
    yield fake
    fake.close()


@pytest.mark.serial
@pytest.mark.parametrize("check", contract.CHECKS, ids=lambda check: check.__name__)
def test_the_fake_keeps_the_contract(
    manager: FakeManager, check: Callable[[SystemdManager, str], None]
) -> None:
    check(manager, "volute-contract.slice")


def test_a_question_can_be_made_to_fail_as_a_cut_d_bus_call_does(manager: FakeManager) -> None:
    manager.failing.add("active_state")
    with pytest.raises(Exception, match="Interrupted system call"):
        manager.active_state("volute-contract-x.scope")
    manager.failing.clear()
    assert manager.active_state("volute-contract-x.scope") is None
