"""volutectl.gitdirs: a repository's common dir from git's own files, the same as git says."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from volutectl import gitdirs, slots
from volutectl.gitdirs import Checkout, find_checkout, parse_gitdir_file, resolve_common_dir


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
    found = slots.find_repository(tmp_path / "wt1")
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

    monkeypatch.setattr(gitdirs.Path, "stat", stat)
    assert find_checkout(mounted) is None
    assert find_checkout(repo) == Checkout(repo / ".git", repo)
