"""The qemu-aarch64 binfmt_misc handler, registered only while the arm64 install tier runs.

The kernel hands every aarch64 ELF binary to qemu-user-static's interpreter while the
handler is registered: that is what lets debootstrap's second stage, and then an arm64
systemd under systemd-nspawn, run on an amd64 host. The handler is host-wide, so it is
registered for the tier and removed again afterwards, also when the tier fails:

    with qemu_aarch64():
        ...                                  # aarch64 binaries run here

The registration line is qemu-user-static's own /usr/lib/binfmt.d/qemu-aarch64.conf. Its
flags include F (the interpreter is opened at registration), so it also works inside a
container whose root has no qemu. binfmt_misc is mounted if it is not, and unmounted
only if this mounted it. A handler that was already registered (binfmt-support,
systemd-binfmt) is used as it is and left in place.

    python -m tests.install.binfmt -- CMD...    # run CMD with the handler registered
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

BINFMT_MISC = Path("/proc/sys/fs/binfmt_misc")
QEMU_AARCH64_CONF = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")


class BinfmtError(RuntimeError):
    pass


def registration(conf: Path = QEMU_AARCH64_CONF) -> tuple[str, str]:
    """(name, register line) from a binfmt.d file: `:name:type:offset:magic:mask:interp:flags`."""
    try:
        text = conf.read_text()
    except FileNotFoundError:
        raise BinfmtError(f"{conf} is missing (apt-get install qemu-user-static)") from None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        fields = line.split(line[0])
        if len(fields) < 8 or not fields[1]:
            raise BinfmtError(f"{conf}: not a binfmt_misc registration: {line!r}")
        interpreter, flags = fields[6], fields[7]
        if "F" not in flags:
            raise BinfmtError(f"{conf}: flags {flags!r} lack F; a container could not use it")
        if not Path(interpreter).is_file():
            raise BinfmtError(f"{conf}: interpreter {interpreter} is missing")
        return fields[1], line
    raise BinfmtError(f"{conf} holds no registration")


def unavailable(conf: Path = QEMU_AARCH64_CONF) -> str | None:
    """Why the handler cannot be registered here, or None if it can."""
    if os.geteuid() != 0:
        return "registering a binfmt_misc handler needs root"
    try:
        registration(conf)
    except BinfmtError as error:
        return str(error)
    return None


def _handler_state(entry: Path) -> str:
    """'enabled', 'disabled' or '' (not registered)."""
    try:
        first = entry.read_text().splitlines()[0].strip()
    except (FileNotFoundError, IndexError):
        return ""
    return first


@contextlib.contextmanager
def qemu_aarch64(conf: Path = QEMU_AARCH64_CONF) -> Iterator[str]:
    """Register the handler for the duration of the block; yield its name."""
    name, line = registration(conf)
    mounted = registered = False
    try:
        if not (BINFMT_MISC / "register").exists():
            subprocess.run(
                ["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT_MISC)],
                check=True,
                capture_output=True,
            )
            mounted = True
        entry = BINFMT_MISC / name
        state = _handler_state(entry)
        if state == "":
            (BINFMT_MISC / "register").write_text(line)
            registered = True
        elif state != "enabled":
            raise BinfmtError(f"{entry} is registered but {state}; not touching another's handler")
        if _handler_state(entry) != "enabled":
            raise BinfmtError(f"{entry} did not come up enabled")
        yield name
    finally:
        if registered:
            with contextlib.suppress(FileNotFoundError):
                (BINFMT_MISC / name).write_text("-1")
        if mounted:
            subprocess.run(["umount", str(BINFMT_MISC)], check=False, capture_output=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m tests.install.binfmt -- CMD...", file=sys.stderr)
        return 64
    with qemu_aarch64():
        return subprocess.run(argv, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
