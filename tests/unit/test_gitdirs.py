"""volutectl.slots.gitdirs: a repository's common dir from git's own files, the same as git says."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from volutectl.kernel import pathwalk
from volutectl.slots import gitdirs, slotfiles
from volutectl.slots.gitdirs import Checkout, find_checkout, parse_gitdir_file, resolve_common_dir


def git(*args: str, cwd: Path) -> str:
    result = subprocess.run(
        ["git", "-c", "user.email=t@example.org", "-c", "user.name=t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    )
    return result.stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A checkout with one commit; its git common dir is repo/.git."""
    checkout = tmp_path / "repo"
    checkout.mkdir()
    git("init", "-q", cwd=checkout)
    git("commit", "-q", "--allow-empty", "-m", "i", cwd=checkout)
    return checkout


def test_resolve_common_dir_from_checkout_worktree_and_git_dir(repo: Path, tmp_path: Path) -> None:
    common = (repo / ".git").resolve()
    git("worktree", "add", "-q", str(tmp_path / "wt1"), cwd=repo)
    assert resolve_common_dir(repo) == common
    assert resolve_common_dir(repo / ".git") == common
    assert resolve_common_dir(tmp_path / "wt1") == common
    assert resolve_common_dir(common / "worktrees" / "wt1") == common
    assert resolve_common_dir(tmp_path) is None
    assert resolve_common_dir(tmp_path / "missing") is None
    # The same answer as git's own, without running git:
    found = slotfiles.find_repository(tmp_path / "wt1")
    assert found is not None and found.common_dir.resolve() == common
    assert parse_gitdir_file("gitdir: ../x/.git\n") == "../x/.git"
    assert parse_gitdir_file("nonsense") is None


def git_says(path: Path) -> Checkout | None:
    """What `git rev-parse` answers in `path`: what `volutectl test` ran before."""
    result = subprocess.run(
        ["git", "rev-parse", "--path-format=absolute", "--git-common-dir", "--show-toplevel"],
        cwd=path,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = result.stdout.splitlines()
    if result.returncode != 0 or len(lines) != 2:
        return None
    return Checkout(Path(lines[0]), Path(lines[1]))


def test_find_checkout_answers_as_git_does(repo: Path, tmp_path: Path) -> None:
    git("worktree", "add", "-q", str(tmp_path / "wt1"), cwd=repo)
    (repo / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "wt1" / "sub").mkdir()
    (repo / "sub" / "HEAD").write_text("a file named HEAD in the work tree\n")
    (repo / "empty" / ".git").mkdir(parents=True)  # a .git that is no repository
    git("init", "-q", "--bare", str(tmp_path / "bare.git"), cwd=tmp_path)
    git("clone", "-q", f"--separate-git-dir={tmp_path / 'sep.git'}", str(repo), "sep", cwd=tmp_path)
    git("-c", "protocol.file.allow=always", "submodule", "add", "-q", str(repo), "mod", cwd=repo)
    main = Checkout(repo / ".git", repo)
    linked = Checkout(repo / ".git", tmp_path / "wt1")
    places = {
        "main": (repo, main),
        "subdirectory": (repo / "sub" / "deep", main),
        "worktree": (tmp_path / "wt1", linked),
        "worktree subdirectory": (tmp_path / "wt1" / "sub", linked),
        "a .git that is no repository": (repo / "empty", main),
        "separate git dir": (tmp_path / "sep", Checkout(tmp_path / "sep.git", tmp_path / "sep")),
        "submodule": (repo / "mod", Checkout(repo / ".git" / "modules" / "mod", repo / "mod")),
        "inside .git": (repo / ".git" / "objects", None),
        "a worktree's git dir": (repo / ".git" / "worktrees" / "wt1", None),
        "bare": (tmp_path / "bare.git", None),
        "outside": (tmp_path, None),
    }  # fmt: skip
    for name, (path, expected) in places.items():
        assert git_says(path) == expected, name
        assert find_checkout(path) == expected, name
    assert find_checkout(tmp_path / "missing") is None


def test_find_checkout_stops_at_a_filesystem_boundary(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As git does without GIT_DISCOVERY_ACROSS_FILESYSTEM: a mount inside a checkout
    (a tmpfs build directory, say) is not in it."""
    mounted = repo / "mnt"
    mounted.mkdir()
    real_stat = Path.stat

    def stat(self: Path, **kwargs: bool) -> object:
        result = real_stat(self, **kwargs)
        if self == mounted:
            values = list(result)
            values[2] = result.st_dev + 1  # st_dev
            return type(result)(values)
        return result

    monkeypatch.setattr(Path, "stat", stat)
    assert find_checkout(mounted) is None
    assert find_checkout(repo) == Checkout(repo / ".git", repo)


# -- what the gate reads in other users' trees: bounded, through no user's symlink ------


def test_a_huge_sparse_git_file_is_refused_by_its_size_unread(tmp_path: Path) -> None:
    """Finding 8d: a 2 GB sparse `.git` file took the gate to 4.26 GB. It is refused by
    its size: measured in a child, whose peak memory is its own."""
    checkout = tmp_path / "big"
    checkout.mkdir()
    with (checkout / ".git").open("wb") as handle:
        handle.truncate(2 * 1024**3)
    code = (
        "import resource, sys, time\n"
        "from volutectl.slots.gitdirs import resolve_common_dir\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "started = time.monotonic()\n"
        "found = resolve_common_dir(sys.argv[1])\n"
        "took = time.monotonic() - started\n"
        "grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
        "print(found, took, grew)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(checkout)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "None"
    assert float(out[1]) < 0.5
    assert int(out[2]) < 16 * 1024  # KiB: nothing like the file's size was read
    with pytest.raises(gitdirs.RepositoryRefused, match="larger than 4096 bytes"):
        gitdirs.open_common_dir(checkout)


def test_a_fifo_or_symlink_in_place_of_a_git_file_is_refused_without_blocking(
    repo: Path, tmp_path: Path
) -> None:
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / ".git")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "commondir").symlink_to(repo / ".git" / "HEAD")  # a git dir with a linked file
    (linked / "HEAD").write_text("ref: refs/heads/main\n")
    started = time.monotonic()
    with pytest.raises(gitdirs.NotARepository):  # a FIFO is no .git: never opened
        gitdirs.open_common_dir(fifo)
    with pytest.raises(gitdirs.RepositoryRefused, match="commondir is not a regular file"):
        gitdirs.open_common_dir(linked)
    assert time.monotonic() - started < 1.0


def test_a_symlink_that_a_user_controls_is_not_followed_but_roots_are(
    repo: Path, tmp_path: Path
) -> None:
    """The gate follows a symlink only if only root could have made or swapped it."""
    common = repo / ".git"
    users = tmp_path / "users"  # a directory another user owns
    users.mkdir()
    (users / "link").symlink_to(common)
    os.chown(users, 65534, 65534)
    os.lchown(users / "link", 65534, 65534)
    assert resolve_common_dir(users / "link") is None
    with pytest.raises(gitdirs.RepositoryRefused, match="symlink that a user other than root"):
        gitdirs.open_common_dir(users / "link")
    assert resolve_common_dir(users / "link", any_symlink=True) == common  # for the user
    # The same link, root's, in root's directory that nobody else may write: followed.
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    (mine / "link").symlink_to(common)
    if os.geteuid() == 0:
        assert resolve_common_dir(mine / "link") == common
    # ... but not in a directory others may write (unless it is sticky, as /tmp is).
    os.chmod(mine, 0o777)
    if os.geteuid() == 0:
        assert resolve_common_dir(mine / "link") is None
        os.chmod(mine, 0o1777)
        assert resolve_common_dir(mine / "link") == common
    # A worktree's .git file naming its git dir through a user's symlink: the same.
    worktree = tmp_path / "wt"
    worktree.mkdir()
    (worktree / ".git").write_text(f"gitdir: {users / 'link'}\n")
    assert resolve_common_dir(worktree) is None


def test_commondir_is_followed_and_the_owner_checked_where_it_leads(
    repo: Path, tmp_path: Path
) -> None:
    """Finding 7: a git dir of one's own whose commondir names somebody else's."""
    victim = repo / ".git"
    os.chown(victim, 65533, 65533)
    fake = tmp_path / "fake.git"
    for name in ("objects", "refs"):
        (fake / name).mkdir(parents=True)
    (fake / "HEAD").write_text("ref: refs/heads/main\n")
    (fake / "commondir").write_text(f"{victim}\n")
    os.chown(fake, 65534, 65534)
    fd = gitdirs.open_common_dir(fake)
    try:
        assert pathwalk.descriptor_path(fd) == victim
        with pytest.raises(gitdirs.RepositoryRefused, match="belongs to uid 65533"):
            gitdirs.check_common_dir(fd, 65534)
        gitdirs.check_common_dir(fd, 65533)  # its owner may
        gitdirs.check_common_dir(fd, 0)  # and root may
    finally:
        os.close(fd)
