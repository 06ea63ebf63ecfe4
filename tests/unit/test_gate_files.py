"""What a gate run by hand (no StateDirectory=, no tmpfiles) makes on disk: the messages
are private, whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.gate_harness import Harness
from volutectl.store.queue import Store


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The umask of a login shell, which left the files world-readable."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_hand_run_gate_makes_its_state_directory_0700_and_its_database_0600(
    tmp_path: Path, open_umask: None
) -> None:
    tmp_path.chmod(0o755)  # the state directory's parent, as /var/lib is
    harness = Harness(tmp_path)
    try:
        harness.deliver_ok()  # a committed message: the WAL exists too
        state = tmp_path / "state"
        assert mode(state) == 0o700
        assert mode(state / "queue.sqlite3") == 0o600
        assert mode(state / "queue.sqlite3-wal") == 0o600
        assert mode(state / "queue.sqlite3-shm") == 0o600
        assert mode(tmp_path) == 0o755  # a parent the gate did not make is not its to set
    finally:
        harness.close()


def test_what_exists_already_keeps_its_mode(tmp_path: Path, open_umask: None) -> None:
    """An admin's choice (a group-readable directory for a backup tool) is not undone."""
    state = tmp_path / "shared"
    state.mkdir(mode=0o750)
    database = state / "queue.sqlite3"
    Store(database).close()
    assert mode(state) == 0o750
    assert mode(database) == 0o600
    database.chmod(0o640)
    Store(database).close()
    assert mode(database) == 0o640
