"""The one table of exit codes, and the error type every user-facing failure raises.

Codes follow sysexits(3), so scripts and systemd can tell a usage error from an
unavailable daemon from a bad config.
"""

from __future__ import annotations

from volutectl.visible import visible

EX_OK = 0
EX_FAILURE = 1
EX_USAGE = 64
EX_DATAERR = 65
EX_NOUSER = 67
EX_UNAVAILABLE = 69
EX_SOFTWARE = 70
EX_OSERR = 71
EX_CANTCREAT = 73
EX_IOERR = 74
EX_TEMPFAIL = 75
EX_PROTOCOL = 76
EX_NOPERM = 77
EX_CONFIG = 78

# `volutectl lease -- CMD`: the lease ended under CMD (its time limit, an admin, its
# scope gone, a gate restart it was not claimed back from), so CMD was stopped.
LEASE_ENDED_EXIT = EX_TEMPFAIL


class VoluteError(Exception):
    """A failure the user can act on: one line, an optional hint, an exit code."""

    exit_code: int = EX_SOFTWARE

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(VoluteError):
    exit_code = EX_USAGE


class DataError(VoluteError):
    exit_code = EX_DATAERR


class ConfigError(VoluteError):
    exit_code = EX_CONFIG


class UnavailableError(VoluteError):
    """A daemon or manager we need is not there (socket missing, D-Bus down)."""

    exit_code = EX_UNAVAILABLE


class PermissionDeniedError(VoluteError):
    exit_code = EX_NOPERM


class TemporaryError(VoluteError):
    exit_code = EX_TEMPFAIL


class SystemdError(VoluteError):
    """systemd refused or failed an operation; names the unit and the reason."""

    exit_code = EX_UNAVAILABLE


class SystemdNoAnswer(SystemdError):
    """systemd gave no answer (it was re-executing, or did not reply in time): what the
    call did is unknown, and the same call may work a moment later."""


def format_error(error: VoluteError) -> str:
    """The error for a terminal: its line, and its hint on a second. Either may quote
    others' text (a refusal the gate sent, a path, a turn's error), so their control
    characters are shown, not obeyed (volutectl/visible.py)."""
    text = f"volutectl: {visible(error.message)}"
    if error.hint:
        text += f"\n  hint: {visible(error.hint)}"
    return text


def one_line(error: VoluteError) -> str:
    """The error and its hint as one line, for a journal field or a status line."""
    return f"{error.message} (hint: {error.hint})" if error.hint else error.message
