"""A mind's environment file: its secrets, read by root at each turn's start, for that
mind's turns alone.

The main config is readable by group volute (every user of the socket), so a mind's
`environment` there is no place for an API key. `minds.NAME.environment_file` names a
file that only root may read; the part of the gate that starts turns reads it, as root,
and passes its variables to that mind's turns only.

Root opens it through directory file descriptors, so nothing on the way is followed
that someone other than root could change:
- every directory from / down is owned by root, and writable by no one else (a
  sticky directory such as /tmp is allowed: in it, only root may rename what root owns);
- no component is a symbolic link (each is opened with O_NOFOLLOW);
- the file is a regular file (checked before it is opened, so a FIFO or a device is
  never opened), owned by root, with no bits for group or others (mode 0600 or 0400);
- at most MAX_BYTES are read.
A file that fails any of these is refused with an error that names it and says why:
the turn does not start, and `volutectl config check` and `doctor` say so beforehand.

The format, one variable a line:
    # a comment, and blank lines, are skipped
    KEY=VALUE
KEY is a shell variable name ([A-Za-z_][A-Za-z0-9_]*). VALUE is the rest of the line,
with the spaces around it removed and, if it is wrapped in one pair of matching single
or double quotes, without them; nothing else is interpreted (no escapes, no $expansion,
no `export`). A key may appear once. Errors name the line by its number, never its
text, which may hold a secret.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from volutectl.errors import ConfigError
from volutectl.kernel.access import describe, user_name

MAX_BYTES = 64 * 1024
VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FORMAT_HINT = "one KEY=VALUE a line; blank lines and lines starting with # are skipped"


class NotVisible(ConfigError):
    """This process may not look (permission denied): only root can check the file."""


def _refuse(path: Path | str, why: str, hint: str | None = None) -> ConfigError:
    return ConfigError(f"environment file {path}: {why}", hint=hint)


def _type_name(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _check_directory(path: Path, where: str, st: os.stat_result, owner: int) -> None:
    if st.st_uid != owner:
        raise _refuse(
            path,
            f"directory {where} belongs to {user_name(st.st_uid)}, not {user_name(owner)} "
            f"({describe(st)}): its owner could swap the file",
            hint="keep environment files in a directory of root's, e.g. /etc/volute/minds",
        )
    writable_by_others = st.st_mode & 0o022
    if writable_by_others and not st.st_mode & stat.S_ISVTX:
        raise _refuse(
            path,
            f"directory {where} is writable by group or others ({describe(st)}): "
            "they could swap the file",
            hint=f"chmod go-w {where}, or keep the file elsewhere",
        )


def check_file_status(path: Path, st: os.stat_result, owner: int = 0) -> None:
    """The file's own checks: a regular file of root's, closed to group and others."""
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, f"is {_type_name(st.st_mode)}, not a regular file")
    if st.st_uid != owner:
        raise _refuse(
            path,
            f"belongs to {user_name(st.st_uid)}, not {user_name(owner)} ({describe(st)})",
            hint=f"chown {user_name(owner)} {path}",
        )
    if st.st_mode & 0o077:
        raise _refuse(
            path,
            f"is open to group or others ({describe(st)}); it holds secrets",
            hint=f"chmod 600 {path}",
        )


def _open_directory(path: Path, owner: int) -> tuple[int, str]:
    """An O_PATH descriptor of the file's directory, every directory on the way checked,
    and the file's name in it."""
    if not path.is_absolute():
        raise _refuse(path, "is not an absolute path")
    parts = path.parts[1:]
    if not parts or ".." in parts:
        raise _refuse(path, "must name a file by an absolute path without '..'")
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags)
    try:
        _check_directory(path, "/", os.fstat(fd), owner)
        for depth, name in enumerate(parts[:-1], start=1):
            where = "/" + "/".join(parts[:depth])
            try:
                inner = os.open(name, flags, dir_fd=fd)
            except OSError as error:
                raise _path_error(path, where, fd, name, error) from None
            os.close(fd)
            fd = inner
            _check_directory(path, where, os.fstat(fd), owner)
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def _path_error(path: Path, where: str, dir_fd: int, name: str, error: OSError) -> ConfigError:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        hint = "name the file by its real path" if stat.S_ISLNK(st.st_mode) else None
        return _refuse(path, f"{where} is {_type_name(st.st_mode)}, not a directory", hint)
    if isinstance(error, FileNotFoundError):
        return _refuse(path, f"{where} does not exist")
    if isinstance(error, PermissionError):
        return NotVisible(f"environment file {path}: {where}: permission denied")
    return _refuse(path, f"{where}: {error.strerror or error}")


def _stat_file(path: Path, dir_fd: int, name: str, owner: int) -> os.stat_result:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise _refuse(path, "does not exist") from None
    except PermissionError:
        raise NotVisible(f"environment file {path}: permission denied") from None
    except OSError as error:
        raise _refuse(path, error.strerror or str(error)) from None
    check_file_status(path, st, owner)
    return st


def check_environment_file(path: Path, owner: int = 0) -> None:
    """Every check but the read: what a user other than root can still tell (a NotVisible
    error where the path is closed to it)."""
    fd, name = _open_directory(path, owner)
    try:
        _stat_file(path, fd, name, owner)
    finally:
        os.close(fd)


def read_environment_file(path: Path, owner: int = 0) -> dict[str, str]:
    """The file's variables, after every check above; a ConfigError naming it if any fails."""
    dir_fd, name = _open_directory(path, owner)
    try:
        st = _stat_file(path, dir_fd, name, owner)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except OSError as error:
            raise _refuse(path, error.strerror or str(error)) from None
    finally:
        os.close(dir_fd)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise _refuse(path, "changed while it was opened")
        check_file_status(path, opened, owner)
        data = _read_bounded(path, fd)
    finally:
        os.close(fd)
    return parse_environment(data, path)


def _read_bounded(path: Path, fd: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = os.read(fd, MAX_BYTES + 1 - size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BYTES:
            raise _refuse(path, f"is larger than {MAX_BYTES // 1024} KiB")


def parse_environment(data: bytes, path: Path | str) -> dict[str, str]:
    """KEY=VALUE lines to a dict; a ConfigError naming the line (by number) if one is bad."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = data[: error.start].count(b"\n") + 1
        raise _refuse(path, f"line {bad} is not UTF-8") from None
    variables: dict[str, str] = {}
    first_seen: dict[str, int] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, equals, value = stripped.partition("=")
        key = key.strip()
        if not equals:
            raise _refuse(path, f"line {number} has no '='", hint=FORMAT_HINT)
        if not VARIABLE.fullmatch(key):
            raise _refuse(
                path,
                f"line {number}: the name before '=' is not a variable name "
                "(letters, digits and _, not starting with a digit)",
                hint=FORMAT_HINT,
            )
        if key in first_seen:
            raise _refuse(path, f"line {number} sets {key} again (first on line {first_seen[key]})")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        if "\0" in value:
            raise _refuse(path, f"line {number} holds a NUL byte, which no variable can")
        first_seen[key] = number
        variables[key] = value
    return variables
