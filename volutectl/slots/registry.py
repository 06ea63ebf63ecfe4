"""The repositories `volutectl test` registered with the gate, kept across restarts.

A JSON file in the gate's state directory:
{"version": 2, "repositories": [{"path": PATH, "uid": UID}, ...]}, where UID is the
user who registered it: the repository must stay theirs (or root's) to be watched.
Version 1 held bare paths; such an entry is read with the uid of the path's owner, as
version 1 checked it. The gate watches these besides tests.repositories from the
config. A socket client can register a repository, so the list has bounds, in all and
per user. Read and written only by the gate's slot watch (volutectl.slots.watch), which
reports each problem once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from volutectl import events

# A socket client must not be able to make the gate watch (and persist) without bound.
MAX_REPOSITORIES = 256
# ... nor take all of that bound from the other users (root, uid 0, has no own bound).
MAX_REPOSITORIES_PER_USER = 32
REGISTRY_VERSION = 2

Problem = Callable[[str, events.BaseEvent], None]  # (what it is about, the event)


@dataclass(frozen=True)
class Registered:
    path: Path  # the git common dir, absolute
    uid: int | None  # who registered it; None: a version 1 entry whose owner is unknown


def load_registry(path: Path, problem: Problem) -> list[Registered]:
    """The entries in the registry; none if it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        entries = data["repositories"]
        if not isinstance(entries, list):
            raise TypeError("repositories is not a list")
        return [entry for entry in map(_entry, entries) if entry is not None]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem(str(path), events.RegistryUnreadable(path=str(path), error=str(error)))
        return []


def _entry(raw: object) -> Registered | None:
    if isinstance(raw, str):  # version 1
        return Registered(Path(raw), None) if os.path.isabs(raw) else None
    if not isinstance(raw, dict):
        return None
    where, uid = raw.get("path"), raw.get("uid")
    if not isinstance(where, str) or not os.path.isabs(where):
        return None
    if not isinstance(uid, int) or isinstance(uid, bool) or uid < 0:
        return None
    return Registered(Path(where), uid)


def save_registry(path: Path, repositories: Iterable[Registered], problem: Problem) -> None:
    """Replace the registry, durably: a temporary file, fsync'ed, renamed over it."""
    entries = sorted(
        ({"path": str(entry.path), "uid": entry.uid} for entry in repositories),
        key=lambda entry: str(entry["path"]),
    )
    text = json.dumps({"version": REGISTRY_VERSION, "repositories": entries}, indent=1) + "\n"
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
        problem(str(path), events.RegistryNotSaved(path=str(path), error=str(error)))
