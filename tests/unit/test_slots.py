"""The slot adapter against real files, flock, inotify and processes (no systemd needed)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from inotify_simple import flags

from volutectl.errors import TemporaryError
from volutectl.slots import slotfiles

# A fallback so long that a prompt wake can only have come from inotify.
NO_FALLBACK = 60.0


def holder(path: Path, seconds: float) -> subprocess.Popen[bytes]:
    """flock(1) holding `path` for `seconds`; returns once the lock is held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        ["flock", "-n", str(path), "sh", "-c", f"echo held; exec sleep {seconds}"],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"held\n"
    return proc


def test_takes_slot_one_and_creates_it(tmp_path: Path) -> None:
    slot = slotfiles.acquire_slot(tmp_path, 3)
    assert slot is not None
    try:
        assert slot.index == 1
        assert slot.path == tmp_path / "volute" / "test-slots" / "slot-1"
        assert sorted(p.name for p in slot.path.parent.iterdir()) == [
            "slot-1",
            "slot-2",
            "slot-3",
        ]
    finally:
        slot.release()


def test_slots_exclude_within_one_process(tmp_path: Path) -> None:
    with slotfiles.hold_slot(tmp_path, 2) as first, slotfiles.hold_slot(tmp_path, 2) as second:
        assert first is not None and second is not None
        assert {first.index, second.index} == {1, 2}
        with pytest.raises(TemporaryError, match="no test slot came free within 0.2s"):
            slotfiles.acquire_slot(tmp_path, 2, timeout=0.2)
    # Released on leaving the block.
    again = slotfiles.acquire_slot(tmp_path, 1, timeout=0)
    assert again is not None and again.index == 1
    again.release()


def test_a_freed_slot_wakes_the_waiter_at_once(tmp_path: Path) -> None:
    slot_path = slotfiles.slot_directory(tmp_path) / "slot-1"
    proc = holder(slot_path, 0.3)
    waited: list[bool] = []
    start = time.monotonic()
    slot = slotfiles.acquire_slot(
        tmp_path, 1, on_wait=lambda: waited.append(True), fallback_seconds=NO_FALLBACK
    )
    woke = time.monotonic()
    assert proc.wait() == 0
    assert slot is not None
    slot.release()
    assert waited == [True]
    assert 0.25 < woke - start < 0.3 + 0.2


def test_any_slot_freeing_wakes_the_waiter(tmp_path: Path) -> None:
    directory = slotfiles.slot_directory(tmp_path)
    long = holder(directory / "slot-1", 30)
    short = holder(directory / "slot-2", 0.3)
    try:
        start = time.monotonic()
        slot = slotfiles.acquire_slot(tmp_path, 2, fallback_seconds=NO_FALLBACK)
        assert slot is not None
        assert slot.index == 2
        assert time.monotonic() - start < 0.3 + 0.2
        slot.release()
    finally:
        long.kill()
        long.wait()
        short.wait()


def test_waiting_does_not_spin(tmp_path: Path) -> None:
    proc = holder(slotfiles.slot_directory(tmp_path) / "slot-1", 30)
    try:
        cpu = time.process_time()
        with pytest.raises(TemporaryError):
            slotfiles.acquire_slot(tmp_path, 1, timeout=1.0, fallback_seconds=NO_FALLBACK)
        # A busy spin on our own IN_CLOSE events would burn the whole second.
        assert time.process_time() - cpu < 0.1
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.serial
def test_fallback_reprobe_covers_a_missed_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Watch for an event that never comes, so only the fallback re-probe can wake us.
    monkeypatch.setattr(slotfiles, "CLOSE_EVENTS", flags.DELETE_SELF)
    proc = holder(slotfiles.slot_directory(tmp_path) / "slot-1", 0.2)
    start = time.monotonic()
    slot = slotfiles.acquire_slot(tmp_path, 1, fallback_seconds=0.5)
    elapsed = time.monotonic() - start
    proc.wait()
    assert slot is not None
    slot.release()
    assert 0.4 < elapsed < 1.0


HOLD_AND_SPAWN = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from volutectl.slots import slotfiles
    slot = slotfiles.acquire_slot(sys.argv[1], 1)
    child = subprocess.Popen(["sleep", "30"], pass_fds=[slot.fd])
    print(child.pid, flush=True)
    time.sleep(60)
    """
)


def test_slot_lives_as_long_as_any_process_of_the_run(tmp_path: Path) -> None:
    run = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_SPAWN, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert run.stdout is not None
    child = int(run.stdout.readline())
    try:
        run.send_signal(signal.SIGKILL)
        run.wait()
        # The command inherited the slot's descriptor, so the slot is still held.
        with pytest.raises(TemporaryError):
            slotfiles.acquire_slot(tmp_path, 1, timeout=0.3)
        start = time.monotonic()
        os.kill(child, signal.SIGKILL)
        slot = slotfiles.acquire_slot(tmp_path, 1, fallback_seconds=NO_FALLBACK)
        assert slot is not None
        assert time.monotonic() - start < 0.2
        slot.release()
    finally:
        with_suppressed_kill(child)


def with_suppressed_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def test_unusable_slot_directory_fails_open_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "volute").mkdir()
    (tmp_path / "volute" / "test-slots").write_text("not a directory\n")
    notices: list[str] = []
    with slotfiles.hold_slot(tmp_path, 1, notice=notices.append) as slot:
        assert slot is None
    assert len(notices) == 1
    assert "\n" not in notices[0]
    assert "test-slots" in notices[0]
    assert "running without the test-run cap" in notices[0]


def test_unopenable_slot_file_fails_open(tmp_path: Path) -> None:
    directory = slotfiles.slot_directory(tmp_path)
    directory.mkdir(parents=True)
    (directory / "slot-2").symlink_to(tmp_path / "missing" / "target")
    notices: list[str] = []
    assert slotfiles.acquire_slot(tmp_path, 2, notice=notices.append) is None
    assert len(notices) == 1 and "slot-2" in notices[0]
    # Slot 1 was opened and must not stay locked behind our back.
    slot = slotfiles.acquire_slot(tmp_path, 1, timeout=0)
    assert slot is not None
    slot.release()


def test_nesting_marker_and_cap_zero_take_nothing(tmp_path: Path) -> None:
    environ = {"VOLUTE_TEST_SLOT": "/somewhere/slot-1"}
    with slotfiles.hold_slot(tmp_path, 1, environ=environ) as slot:
        assert slot is None
    with slotfiles.hold_slot(tmp_path, 0, environ={}) as slot:
        assert slot is None
    assert not (tmp_path / "volute").exists()


def git(*args: str, cwd: Path) -> str:
    result = subprocess.run(
        ["git", "-c", "user.email=t@example.org", "-c", "user.name=t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    )
    return result.stdout


def test_worktrees_share_the_common_dir_and_its_setting(tmp_path: Path) -> None:
    main = tmp_path / "repo"
    main.mkdir()
    git("init", "-q", cwd=main)
    git("commit", "-q", "--allow-empty", "-m", "init", cwd=main)
    git("worktree", "add", "-q", str(tmp_path / "wt1"), cwd=main)
    git("config", "volute.testSlots", "2", cwd=tmp_path / "wt1")
    (tmp_path / "wt1" / "sub").mkdir()
    found_main = slotfiles.find_repository(main)
    found_wt = slotfiles.find_repository(tmp_path / "wt1" / "sub")
    assert found_main is not None and found_wt is not None
    assert found_main.common_dir == found_wt.common_dir == main / ".git"
    assert found_wt.worktree == tmp_path / "wt1"
    assert found_main.cap_setting == found_wt.cap_setting == "2"
    assert slotfiles.find_repository(tmp_path) is None


# -- who may lock a slot (issue 18, finding 9a) -------------------------------------------


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_slot_files_are_for_the_owner_and_group_only(tmp_path: Path) -> None:
    """An outsider's flock on a 0644 slot held runs (and turns) up: slots are 0660, in
    the git dir's group; the directories let others look, not create or remove."""
    common = tmp_path / "repo.git"
    common.mkdir(mode=0o755)
    os.chmod(common, 0o755)
    slot = slotfiles.acquire_slot(common, 2)
    assert slot is not None
    slot.release()
    directory = slotfiles.slot_directory(common)
    assert mode_of(directory.parent) == mode_of(directory) == 0o755
    for name in ("slot-1", "slot-2"):
        assert mode_of(directory / name) == 0o660
        assert os.lstat(directory / name).st_gid == os.lstat(common).st_gid
    # A shared repository (core.sharedRepository: a group-writable git dir).
    shared = tmp_path / "shared.git"
    shared.mkdir()
    os.chmod(shared, 0o2775)
    slotfiles.acquire_slot(shared, 1).release()  # type: ignore[union-attr]
    assert mode_of(slotfiles.slot_directory(shared)) & 0o777 == 0o775
    assert mode_of(slotfiles.slot_directory(shared) / "slot-1") == 0o660


def test_the_owners_next_run_tightens_old_slot_files(tmp_path: Path) -> None:
    directory = slotfiles.slot_directory(tmp_path)
    directory.mkdir(parents=True)
    os.chmod(directory, 0o777)
    (directory / "slot-1").touch()
    os.chmod(directory / "slot-1", 0o644)  # as every version before made them
    slot = slotfiles.acquire_slot(tmp_path, 1)
    assert slot is not None
    slot.release()
    assert mode_of(directory / "slot-1") == 0o660
    assert mode_of(directory) == 0o755


def test_a_slot_that_is_a_link_is_not_followed_nor_changed(tmp_path: Path) -> None:
    """Root running the tests in another user's checkout is not steered by its files."""
    precious = tmp_path / "precious"
    precious.write_text("keep\n")
    os.chmod(precious, 0o644)
    directory = slotfiles.slot_directory(tmp_path / "repo")
    directory.mkdir(parents=True)
    (directory / "slot-1").symlink_to(precious)
    notices: list[str] = []
    assert slotfiles.acquire_slot(tmp_path / "repo", 1, notice=notices.append) is None
    assert len(notices) == 1 and "slot-1" in notices[0]
    (directory / "slot-1").unlink()
    os.link(precious, directory / "slot-1")  # a hard link: the same inode, two names
    slot = slotfiles.acquire_slot(tmp_path / "repo", 1)
    assert slot is not None
    slot.release()
    assert mode_of(precious) == 0o644 and precious.read_text() == "keep\n"
    # A symlink in place of a slot directory is not followed either.
    (tmp_path / "elsewhere").mkdir()
    os.rename(directory.parent, tmp_path / "old-volute")
    (tmp_path / "repo" / "volute").symlink_to(tmp_path / "elsewhere")
    notices.clear()
    assert slotfiles.acquire_slot(tmp_path / "repo", 1, notice=notices.append) is None
    assert len(notices) == 1 and "volute" in notices[0]
    assert list((tmp_path / "elsewhere").iterdir()) == []
