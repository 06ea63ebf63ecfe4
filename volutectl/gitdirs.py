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
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path


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


def resolve_common_dir(path: str | os.PathLike[str]) -> Path | None:
    """The common dir for a checkout's top level, a linked worktree's, or a git dir.

    Looks at `path` only, not at its parents: the gate is given these exact paths."""
    path = Path(os.path.abspath(path))
    dotgit = path / ".git"
    if dotgit.is_file():
        try:
            named = parse_gitdir_file(dotgit.read_text(errors="replace"))
        except OSError:
            return None
        if named is None:
            return None
        git_dir = (path / named).resolve()
    elif dotgit.is_dir():
        git_dir = dotgit.resolve()
    elif (path / "HEAD").is_file():
        git_dir = path.resolve()
    else:
        return None
    commondir = git_dir / "commondir"
    with contextlib.suppress(OSError):
        if commondir.is_file():
            return (git_dir / commondir.read_text().strip()).resolve()
    return git_dir if (git_dir / "HEAD").is_file() else None


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
            common_dir = resolve_common_dir(directory)
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
