"""A mind's home: where a turn runs when its mind names no working directory and its
user has no home (the package's default turn user, `volute-turn`, has /nonexistent).

A turn never runs in `/`: each such mind gets a directory of its own,
HOMES_DIR/NAME, owned by the mind's user, mode 0700, and its turns run there with HOME
set to it. HOMES_DIR is root's, 0755 (volute-launcher.service's StateDirectory=): a
mind may enter its own home and nothing else there, and may create nothing beside it.

The launcher (root) makes a home at the mind's first turn. A directory a mind's user
owns is one it can change, so root reaches it only through directory fds: it opens
HOMES_DIR, checks it is root's and writable by root alone, makes the home with mkdirat,
opens it with O_NOFOLLOW|O_DIRECTORY, checks on the fd that it is a directory that
root or the mind's user owns, and gives it to that user with fchown. A symbolic link
or a file in its place (only root could have put one there) is refused with its
reason, never followed; a home that another user owns (the mind's user changed) too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from volutectl.errors import DataError
from volutectl.kernel import dirfds

HOMES_DIR = Path("/var/lib/volute-minds")
HOME_MODE = 0o700
HOMES_MODE = 0o755


def home_of(mind: str, homes: Path = HOMES_DIR) -> Path:
    return homes / mind


def homes_problem(st: os.stat_result, homes: Path) -> str | None:
    """Why the directory of the minds' homes may not hold them, or None: it must be
    root's, and writable by root alone, or a mind could put a link where its home goes."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{homes} is not a directory"
    if st.st_uid != 0:
        return f"{homes} belongs to uid {st.st_uid}, not root"
    if st.st_mode & 0o022:
        return f"{homes} is writable by others than root (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def home_problem(st: os.stat_result, path: Path, uid: int, user: str) -> str | None:
    """Why an existing entry at a mind's home is not one its turns may run in, or None.
    A root-owned directory is a home made and not yet given (the launcher stopped
    between its mkdirat and its fchown): the launcher gives it."""
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid not in (uid, 0):
        return f"{path} belongs to uid {st.st_uid}, not to user {user!r}"
    return None


def refusal(problem: str, mind: str, path: Path) -> DataError:
    return DataError(
        f"mind {mind!r}: its home {problem}",
        hint=f"remove {path} (the launcher makes it again), or set minds.{mind}.working_directory",
    )


def _open_homes(homes: Path) -> int:
    """HOMES_DIR as a directory fd, made (root's, 0755) if it is missing."""
    try:
        fd = dirfds.open_directory(str(homes))
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            os.mkdir(homes, HOMES_MODE)
        fd = dirfds.open_directory(str(homes))
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, HOMES_MODE)  # whatever the umask: minds must enter it
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise DataError(
                f"{homes} is not a directory", hint=f"remove it: the launcher makes {homes}"
            ) from None
        raise
    problem = homes_problem(os.fstat(fd), homes)
    if problem is not None:
        os.close(fd)
        raise DataError(problem, hint=f"chown root: {homes} && chmod 0755 {homes}")
    return fd


def ensure_home(mind: str, uid: int, gid: int, user: str, homes: Path = HOMES_DIR) -> str:
    """The mind's home, made and given to its user if need be; a DataError naming the
    problem if what is there may not be used. Root's code: nothing here follows a link."""
    path = home_of(mind, homes)
    homes_fd = _open_homes(homes)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(mind, HOME_MODE, dir_fd=homes_fd)
        found = dirfds.entry_stat(homes_fd, mind)
        if found is None:  # removed since: another start's business, not this one's
            raise refusal("vanished while it was made", mind, path)
        problem = home_problem(found, path, uid, user)
        if problem is not None:
            raise refusal(problem, mind, path)
        try:
            fd = dirfds.open_directory(mind, homes_fd)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                raise refusal("is not a directory", mind, path) from None
            raise
    finally:
        os.close(homes_fd)
    try:
        st = os.fstat(fd)
        problem = home_problem(st, path, uid, user)
        if problem is not None:
            raise refusal(problem, mind, path)
        if st.st_uid != uid:  # root's: made just now, or by a start cut short
            os.fchmod(fd, HOME_MODE)
            os.fchown(fd, uid, gid)
    finally:
        os.close(fd)
    return str(path)
