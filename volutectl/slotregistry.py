"""The repositories `volutectl test` registered with the gate, kept across restarts.

A JSON file in the gate's state directory: {"version": 1, "repositories": [PATH...]}.
The gate watches these besides tests.repositories from the config. A socket client
can register a repository, so the list has a bound. Read and written only by the
gate's slot watch (volutectl.slotwatch), which reports each problem once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

# A socket client must not be able to make the gate watch (and persist) without bound.
MAX_REPOSITORIES = 256
REGISTRY_VERSION = 1

Problem = Callable[[Path, str], None]  # (what it is about, the message)


def load_registry(path: Path, problem: Problem) -> list[Path]:
    """The absolute paths in the registry; none if it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        paths = data["repositories"]
        if not isinstance(paths, list):
            raise TypeError("repositories is not a list")
        return [Path(p) for p in paths if isinstance(p, str) and os.path.isabs(p)]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem(path, f"ignoring unreadable {path}: {error}")
        return []


def save_registry(path: Path, repositories: Iterable[Path], problem: Problem) -> None:
    """Replace the registry, durably: a temporary file, fsync'ed, renamed over it."""
    paths = sorted(str(repository) for repository in repositories)
    text = json.dumps({"version": REGISTRY_VERSION, "repositories": paths}, indent=1) + "\n"
    temporary = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError as error:
        problem(path, f"cannot save {path}: {error}")
