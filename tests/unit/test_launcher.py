"""The turn directory's records, on real files: what a fold offered and what the turn took.

A fold is: commit, write .offered/<id>.tmp, create .offered/<id>, rename to inbox/<id>.json.
A gate killed anywhere in that sequence must leave a directory from which `not_taken`
reads "never offered" (so the delivery goes back to the queue), never "taken" (which
would mark it done without it having run).
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from volutectl.launcher import fork, turndir


def account() -> fork.Account:
    entry = pwd.getpwuid(os.getuid())
    return fork.Account(entry.pw_name, entry.pw_uid, entry.pw_gid, (), entry.pw_dir)


@pytest.fixture
def turn_dir(tmp_path: Path) -> fork.TurnDir:
    return fork.make_turn_dir(tmp_path, 7, account())


def test_a_completed_offer_is_untaken_until_the_turn_takes_it(turn_dir: fork.TurnDir) -> None:
    fork.offer(turn_dir, 5, b"{}\n", account())
    assert (turn_dir.inbox / "5.json").read_bytes() == b"{}\n"
    assert turn_dir.not_taken([5]) == {5}
    (turn_dir.inbox / "5.json").unlink()  # the turn takes it
    assert turn_dir.not_taken([5]) == set()


def test_a_turn_may_take_by_moving_the_file_away(turn_dir: fork.TurnDir, tmp_path: Path) -> None:
    fork.offer(turn_dir, 5, b"{}\n", account())
    (turn_dir.inbox / "5.json").rename(tmp_path / "read-5.json")
    assert turn_dir.not_taken([5]) == set()
    fork.offer(turn_dir, 6, b"{}\n", account())
    (turn_dir.inbox / "6.json").rename(turn_dir.inbox / "read-6")  # within the inbox too
    assert turn_dir.not_taken([6]) == set()


def test_each_step_of_an_interrupted_offer_reads_as_never_offered(
    turn_dir: fork.TurnDir,
) -> None:
    # Killed after the commit, before anything was written.
    assert turn_dir.not_taken([5]) == {5}
    # Killed with the .tmp written, before the marker.
    (turn_dir.offered / "5.tmp").write_bytes(b"{}\n")
    assert turn_dir.not_taken([5]) == {5}
    # Killed with the marker made, before the rename.
    (turn_dir.offered / "5").touch()
    assert turn_dir.not_taken([5]) == {5}
    # The rename done: offered, and in the inbox.
    (turn_dir.offered / "5.tmp").rename(turn_dir.inbox / "5.json")
    assert turn_dir.not_taken([5]) == {5}
    # Taken.
    (turn_dir.inbox / "5.json").unlink()
    assert turn_dir.not_taken([5]) == set()


def test_a_fold_a_gate_before_this_layout_cut_short_reads_as_never_offered(
    turn_dir: fork.TurnDir,
) -> None:
    # It staged the file as inbox/.<id>.tmp, before the marker and the rename.
    (turn_dir.offered / "5").touch()
    (turn_dir.inbox / ".5.tmp").write_bytes(b"{}\n")
    assert turn_dir.not_taken([5]) == {5}


def test_a_directory_from_before_offer_records_trusts_the_inbox_alone(
    turn_dir: fork.TurnDir,
) -> None:
    turn_dir.offered.rmdir()  # what volutectl 0.1.0 made
    (turn_dir.inbox / "6.json").write_bytes(b"{}\n")
    assert turn_dir.not_taken([5, 6]) == {6}


def test_the_offer_record_is_the_gates_own(turn_dir: fork.TurnDir) -> None:
    assert turn_dir.offered.is_dir()
    assert turn_dir.offered.stat().st_mode & 0o777 == 0o700
    # So is the directory around it: the turn may enter it, and only its inbox is its own.
    assert turn_dir.path.stat().st_mode & 0o777 == 0o711
    assert turn_dir.path.stat().st_uid == os.geteuid()
    assert (turn_dir.path / "status").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in turn_dir.path.iterdir()) == [".offered", "inbox", "status"]


def test_the_status_files_time_is_when_the_turn_ended(turn_dir: fork.TurnDir) -> None:
    assert turn_dir.ended_at() is None and turn_dir.exit_status() is None
    assert not turn_dir.started()
    (turn_dir.path / "status").write_text("started\n")  # what the wrapper writes first
    os.utime(turn_dir.path / "status", (900.0, 900.0))
    assert turn_dir.started()
    assert turn_dir.exit_status() is None and turn_dir.ended_at() is None
    with (turn_dir.path / "status").open("a") as status:
        status.write("143\n")
    os.utime(turn_dir.path / "status", (1000.0, 1000.0))
    assert turn_dir.record() == turndir.Record(started=True, exit_status=143, ended_at=1000.0)


def test_a_directory_a_wrapper_before_the_status_descriptor_wrote(
    turn_dir: fork.TurnDir,
) -> None:
    (turn_dir.path / "started").touch()
    assert turn_dir.started() and turn_dir.exit_status() is None
    (turn_dir.path / "status").write_text("2\n")
    assert turn_dir.exit_status() == 2
