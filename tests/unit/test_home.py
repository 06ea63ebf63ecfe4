"""A mind's home (volutectl/launcher/home.py): made by root for the mind's user, through
directory fds, and refused, never followed, when something else stands in its place.

These make real directories and chown them, so they need root (the unit tier runs as
root in CI); the uid and gid given are made up, owning nothing else."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from volutectl.errors import DataError
from volutectl.launcher import home

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes directories for another uid")

UID, GID = 64020, 64021


@pytest.fixture
def homes(tmp_path: Path) -> Path:
    return tmp_path / "minds"


def test_a_home_is_made_with_its_parent_and_given_to_the_minds_user(homes: Path) -> None:
    path = home.ensure_home("mimsy", UID, GID, "mimsy-user", homes)
    assert path == str(homes / "mimsy")
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert (st.st_uid, st.st_gid) == (UID, GID)
    parent = os.lstat(homes)
    assert (parent.st_uid, stat.S_IMODE(parent.st_mode)) == (0, 0o755)
    # Again: the same home, its contents and mode left as the mind keeps them.
    os.chmod(path, 0o750)
    assert home.ensure_home("mimsy", UID, GID, "mimsy-user", homes) == path
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o750


def test_a_root_owned_home_left_by_a_start_cut_short_is_given(homes: Path) -> None:
    homes.mkdir(mode=0o755)
    (homes / "mimsy").mkdir(mode=0o755)
    home.ensure_home("mimsy", UID, GID, "mimsy-user", homes)
    st = os.lstat(homes / "mimsy")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (UID, 0o700)


def refused(homes: Path) -> str:
    with pytest.raises(DataError) as caught:
        home.ensure_home("mimsy", UID, GID, "mimsy-user", homes)
    return caught.value.message


def test_a_symbolic_link_in_its_place_is_refused_not_followed(homes: Path, tmp_path: Path) -> None:
    target = tmp_path / "etc"
    target.mkdir(mode=0o755)
    homes.mkdir(mode=0o755)
    (homes / "mimsy").symlink_to(target)
    assert refused(homes) == f"mind 'mimsy': its home {homes}/mimsy is a symbolic link"
    assert os.lstat(target).st_uid == 0 and stat.S_IMODE(os.lstat(target).st_mode) == 0o755


def test_a_file_or_another_users_directory_in_its_place_is_refused(homes: Path) -> None:
    homes.mkdir(mode=0o755)
    (homes / "mimsy").write_text("")
    assert refused(homes).endswith("is not a directory")
    (homes / "mimsy").unlink()
    (homes / "mimsy").mkdir()
    os.chown(homes / "mimsy", UID + 1, GID)
    assert refused(homes).endswith(f"belongs to uid {UID + 1}, not to user 'mimsy-user'")


def test_a_parent_a_mind_could_write_or_a_link_as_the_parent_is_refused(
    homes: Path, tmp_path: Path
) -> None:
    homes.mkdir(mode=0o755)
    homes.chmod(0o1777)
    assert "is writable by others than root (mode 1777)" in refused(homes)
    homes.chmod(0o755)
    os.chown(homes, UID, GID)
    assert refused(homes) == f"{homes} belongs to uid {UID}, not root"
    os.rmdir(homes)
    homes.symlink_to(tmp_path)
    assert refused(homes) == f"{homes} is not a directory"
    assert not (tmp_path / "mimsy").exists()
