"""Which git repository a path belongs to: its common dir, found by reading git's files.

The test-run cap is per repository, across all its worktrees, so its slots live under
the git common dir. `volutectl test` asks where that is for its working directory, and
the gate asks for each registered repository and each running test's worktree. Both
read the files git itself reads, and never run git:
- the gate runs as root in other users' checkouts. There git refuses to work (its
  safe.directory check), and running it would obey a config that someone else writes
  (core.fsmonitor, for one, names a program to run);
- a git process costs milliseconds on every `volutectl test` and every gate status.

The layout read here:
- a main checkout has a `.git` directory, which is its git dir and the common dir;
- a linked worktree or a submodule has a `.git` file, `gitdir: PATH`, naming its git
  dir;
- a linked worktree's git dir holds a `commondir` file naming the shared one.

Git's environment (GIT_DIR, GIT_CEILING_DIRECTORIES, GIT_DISCOVERY_ACROSS_FILESYSTEM)
is not read: the cap belongs to the checkout that a command runs in.

The gate reads these files in other users' trees, as root (or as its own user), so it
reads them as volutectl.kernel.pathwalk does: each directory opened with O_NOFOLLOW relative
to the one before, no symlink that a user controls followed, and the `.git` and
`commondir` files read only when they are regular files of at most MAX_GIT_FILE_BYTES
(a 2 GB sparse `.git` file is refused by its size, unread). What it then watches is the
descriptor it checked (`open_common_dir`, `check_common_dir`), never the path again.
`volutectl test` runs as the user, in the user's own checkout, so it follows any
symlink (`any_symlink=True`), as git does.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from volutectl.kernel import pathwalk

# git writes one short line to each; a path is at most PATH_MAX (4096) bytes.
MAX_GIT_FILE_BYTES = 4096


class RepositoryRefused(Exception):
    """Why a path is not a repository the gate may watch; the message completes the
    sentence "PATH ...", e.g. "is under /proc, not a git repository"."""


class NotARepository(RepositoryRefused):
    pass


@dataclass(frozen=True)
class Checkout:
    common_dir: Path  # shared by every worktree of the repository
    worktree: Path  # the top level of this checkout


def parse_gitdir_file(text: str) -> str | None:
    """The path in a `.git` file (`gitdir: ../.git/worktrees/wt1`), or None."""
    first = text.splitlines()[0] if text.strip() else ""
    if not first.startswith("gitdir:"):
        return None
    return first[len("gitdir:") :].strip() or None


def resolve_common_dir(path: str | os.PathLike[str], *, any_symlink: bool = False) -> Path | None:
    """The common dir for a checkout's top level, a linked worktree's, or a git dir.

    Looks at `path` only, not at its parents: the gate is given these exact paths."""
    try:
        fd = open_common_dir(path, any_symlink=any_symlink)
    except (OSError, RepositoryRefused):
        return None
    try:
        return pathwalk.descriptor_path(fd)
    finally:
        os.close(fd)


def open_common_dir(path: str | os.PathLike[str], *, any_symlink: bool = False) -> int:
    """An O_PATH descriptor of the common dir of `path` (as resolve_common_dir).

    Raises RepositoryRefused (NotARepository when it is none) or OSError."""
    try:
        top = pathwalk.open_directory(os.path.abspath(path), any_symlink=any_symlink)
    except pathwalk.UntrustedPath as error:
        raise RepositoryRefused(f"is reached through {error}") from None
    try:
        return common_dir_of(top, any_symlink=any_symlink)
    finally:
        os.close(top)


def common_dir_of(top: int, *, any_symlink: bool = False) -> int:
    """The common dir of the directory open at `top`, opened: its `.git` (a directory,
    or a file naming the git dir), or itself when it is a git dir; then the git dir's
    `commondir`, when it has one. Raises RepositoryRefused or OSError."""
    try:
        git_dir = _open_git_dir(top, any_symlink)
        try:
            named = _read_path_file(git_dir, "commondir")
            common = (
                os.dup(git_dir)
                if named is None
                else pathwalk.open_directory(named, relative_to=git_dir, any_symlink=any_symlink)
            )
        finally:
            os.close(git_dir)
    except pathwalk.UntrustedPath as error:
        raise RepositoryRefused(f"is not watched: {error}") from None
    if not _entry_is(common, "HEAD", stat.S_ISREG, stat.S_ISLNK):
        os.close(common)
        raise NotARepository("is not a git repository")
    return common


def _open_git_dir(top: int, any_symlink: bool) -> int:
    mode = _mode(top, ".git")
    if mode is not None and stat.S_ISREG(mode):
        named = _read_path_file(top, ".git")
        named = None if named is None else parse_gitdir_file(named)
        if named is None:
            raise NotARepository("has a .git file that names no git dir")
        return pathwalk.open_directory(named, relative_to=top, any_symlink=any_symlink)
    if mode is not None and (stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
        return pathwalk.open_directory(".git", relative_to=top, any_symlink=any_symlink)
    if _entry_is(top, "HEAD", stat.S_ISREG, stat.S_ISLNK):
        return os.dup(top)
    raise NotARepository("is not a git repository")


def _read_path_file(directory: int, name: str) -> str | None:
    """The first line of `.git` or `commondir`, bounded; None when there is no such file."""
    try:
        data = pathwalk.read_small_file(directory, name, MAX_GIT_FILE_BYTES)
    except FileNotFoundError:
        return None
    text = data.decode(errors="replace")
    return text.splitlines()[0].strip() if text.strip() else ""


def _mode(directory: int, name: str) -> int | None:
    try:
        return os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
    except OSError:
        return None


def _entry_is(directory: int, name: str, *kinds: Callable[[int], bool]) -> bool:
    mode = _mode(directory, name)
    return mode is not None and any(kind(mode) for kind in kinds)


def check_common_dir(fd: int, uid: int) -> None:
    """That the common dir open at `fd` is one `uid` may have the gate watch: not on the
    kernel's filesystems, shaped as a git common dir (HEAD, objects/, refs/), and owned
    by `uid` or by root (root, uid 0, may have any repository watched).

    Raises RepositoryRefused; every check is on the descriptor, none on a path."""
    where = pathwalk.kernel_filesystem(fd)
    if where is not None:
        raise RepositoryRefused(f"is under {where}, not a git repository")
    if not (
        _entry_is(fd, "HEAD", stat.S_ISREG, stat.S_ISLNK)
        and _entry_is(fd, "objects", stat.S_ISDIR, stat.S_ISLNK)
        and _entry_is(fd, "refs", stat.S_ISDIR, stat.S_ISLNK)
    ):
        raise NotARepository("is not a git common directory (it needs HEAD, objects/ and refs/)")
    owner = os.fstat(fd).st_uid
    if uid != 0 and owner not in (uid, 0):
        raise RepositoryRefused(
            f"belongs to uid {owner}; a user may register only a repository of their own "
            "(or root's)"
        )


def find_checkout(path: str | os.PathLike[str]) -> Checkout | None:
    """The checkout `path` is in, looking upwards as git does; None outside of one.

    As with `git rev-parse --show-toplevel`: the search stops at a filesystem boundary,
    passes over a `.git` directory that is no repository, and finds no checkout inside
    a git dir or a bare repository (they have no work tree)."""
    try:
        start = Path(path).resolve(strict=True)
        device = start.stat().st_dev
    except OSError:
        return None
    for directory in (start, *start.parents):
        try:
            if directory.stat().st_dev != device:
                return None
        except OSError:
            return None
        dotgit = directory / ".git"
        if dotgit.is_file() or (dotgit.is_dir() and _is_git_dir(dotgit)):
            common_dir = resolve_common_dir(directory, any_symlink=True)
            return None if common_dir is None else Checkout(common_dir, directory)
        if _is_git_dir(directory):
            return None
    return None


def _is_git_dir(path: Path) -> bool:
    """What git takes for a git dir: HEAD, refs, and objects (or a linked worktree's
    commondir, which has them)."""
    if not (path / "HEAD").is_file():
        return False
    return (path / "commondir").is_file() or (
        (path / "objects").is_dir() and (path / "refs").is_dir()
    )
