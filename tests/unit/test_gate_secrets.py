"""The real gate in-process with minds that have environment files: a file root does not
hold alone fails the turn's start, naming it, before anything is forked; the file is read
again at the next start; its variables reach its own mind's turns and no other's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.gate_harness import ME, Harness
from volutectl.config.settings import MindSettings
from volutectl.store.queue import Row

SECRET = "sk-keyed-42"


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    assert os.geteuid() == 0, "the gate reads environment files as root: run as root"
    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o700)
    (secrets / "keyed.env").write_text(f"API_KEY={SECRET}\n")
    (secrets / "keyed.env").chmod(0o640)  # open to its group: refused
    opened = Harness(tmp_path, start=False, backoff_initial_seconds=0.05, backoff_max_seconds=0.05)
    probe = 'printf %s "${API_KEY-unset}" > ' + str(tmp_path)
    minds = {
        "keyed": MindSettings(
            command=f"{probe}/keyed.out",
            user=ME,
            environment={"API_KEY": "from-the-config"},
            environment_file=secrets / "keyed.env",
        ),
        "other": MindSettings(command=f"{probe}/other.out", user=ME),
    }
    opened.settings = opened.settings.model_copy(update={"minds": minds})
    opened.restart()
    yield opened
    opened.close()


def row_of(harness: Harness, delivery_id: int) -> Row:
    row = harness.gate.state.store.row(delivery_id)
    assert row is not None
    return row


def test_a_file_open_to_others_fails_the_start_and_a_fixed_one_reaches_its_mind_alone(
    harness: Harness, tmp_path: Path
) -> None:
    path = tmp_path / "secrets" / "keyed.env"
    delivery = harness.deliver_ok(mind="keyed")
    harness.pump(lambda: row_of(harness, delivery).attempts == 1)
    error = row_of(harness, delivery).last_error or ""
    assert error.startswith(f"environment file {path}: is open to group or others"), error
    assert SECRET not in error
    assert harness.manager.scopes == {}  # nothing was forked
    assert not (tmp_path / "keyed.out").exists()
    # Read again at the next start: no restart needed once it is root's alone.
    path.chmod(0o600)
    harness.pump(lambda: row_of(harness, delivery).state == "done")
    assert (tmp_path / "keyed.out").read_text() == SECRET  # the file's, over the config's
    other = harness.deliver_ok(mind="other")
    harness.pump(lambda: row_of(harness, other).state == "done")
    assert (tmp_path / "other.out").read_text() == "unset"
