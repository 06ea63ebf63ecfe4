"""A qemu-aarch64 binfmt_misc handler, registered only while the arm64 install tier runs.

The kernel hands every aarch64 ELF binary to qemu's user-mode emulator while the handler
is registered: that is what lets debootstrap's second stage, and then an arm64 systemd
under systemd-nspawn, run on an amd64 host. The handler is host-wide, so it is
registered for the tier and removed again afterwards, also when the tier fails:

    with qemu_aarch64():
        ...                                  # aarch64 binaries run here

The emulator is Debian trixie's `qemu-user` (10.0, statically linked), fetched with
apt-get from a private package index and unpacked under the test cache
(/var/cache/volute-test/qemu-user). The index is trixie main of the Debian archive the
host's own apt is configured with (the source whose Release file says Origin: Debian,
Label: Debian), or of the archive VOLUTE_DEBIAN_MIRROR names (see rootfs.py).
Bookworm's qemu-user-static 7.2 is not enough: under it, trixie's systemd 257 cannot
spawn systemd-executor (it spawns it with glibc's pidfd_spawn, a clone with
CLONE_PIDFD), so every service fails with "Failed to spawn executor: Invalid argument",
dbus included. Under 10.0 they start.

The registration line is the package's own binfmt.d/qemu-aarch64.conf, with the
interpreter's path moved into the cache and the name `volute-qemu-aarch64`. Its flags
include F (the kernel opens the interpreter at registration), so it works inside a
container whose root has no qemu. binfmt_misc tries the newest handler first, so ours
takes precedence over a qemu-aarch64 handler the host may have (binfmt-support,
systemd-binfmt), which is never touched and applies again once ours is removed.
binfmt_misc is mounted if it is not, and unmounted only if this mounted it.

    python -m volute_testbed.binfmt -- CMD...    # run CMD with the handler registered
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from volute_testbed.rootfs import CACHE, MAX_AGE_SECONDS, MIRROR_VARIABLE, debian_mirror

BINFMT_MISC = Path("/proc/sys/fs/binfmt_misc")
HANDLER = "volute-qemu-aarch64"
QEMU_USER = CACHE / "qemu-user"
QEMU_SUITE = "trixie"
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
CONF_IN_PACKAGE = "usr/share/qemu/binfmt.d/qemu-aarch64.conf"
COMPLETE = ".volute-qemu-complete"


class BinfmtError(RuntimeError):
    pass


def debian_archive() -> str:
    """VOLUTE_DEBIAN_MIRROR, or the Debian archive among the host's apt sources."""
    chosen = debian_mirror()
    if chosen:
        return chosen
    listed = subprocess.run(
        ["apt-get", "indextargets", "--format", "$(ORIGIN)\t$(LABEL)\t$(REPO_URI)"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for line in listed.splitlines():
        origin, _, rest = line.partition("\t")
        label, _, uri = rest.partition("\t")
        if (origin, label) == ("Debian", "Debian") and uri:
            return uri
    raise BinfmtError(
        "no Debian archive among the host's apt sources (or no index yet: apt-get update);"
        f" set {MIRROR_VARIABLE} to one"
    )


def _apt_options(work: Path) -> list[str]:
    """apt-get options for a private index of trixie main alone, leaving the host's be."""
    parts = work / "sources.list.d"
    parts.mkdir(parents=True, exist_ok=True)
    sources = work / "sources.list"
    archive = debian_archive()
    sources.write_text(f"deb [signed-by={KEYRING}] {archive} {QEMU_SUITE} main\n")
    for sub in ("lists/partial", "cache/archives/partial"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    return [
        "-q",
        "-o", f"Dir::Etc::SourceList={sources}",
        "-o", f"Dir::Etc::SourceParts={parts}",
        "-o", f"Dir::State::Lists={work / 'lists'}",
        "-o", f"Dir::Cache={work / 'cache'}",
        "-o", "Dir::Etc::Preferences=/dev/null",
        "-o", f"Dir::Etc::PreferencesParts={parts}",
    ]  # fmt: skip


def ensure_qemu_user(log: bool = True) -> Path:
    """The root of an unpacked trixie qemu-user .deb, fetched if missing or a week old."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "qemu-user.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = QEMU_USER / COMPLETE
        if stamp.exists() and time.time() - stamp.stat().st_mtime < MAX_AGE_SECONDS:
            return QEMU_USER
        for tool in ("apt-get", "dpkg-deb"):
            if shutil.which(tool) is None:
                raise BinfmtError(f"{tool} is missing: fetching trixie's qemu-user needs apt")
        started = time.monotonic()
        work = CACHE / "qemu-user.partial"
        shutil.rmtree(work, ignore_errors=True)
        options = _apt_options(work)
        for argv in (
            ["apt-get", *options, "update"],
            ["apt-get", *options, "download", "qemu-user"],
        ):
            result = subprocess.run(argv, cwd=work, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise BinfmtError(
                    f"{' '.join(argv[:1] + argv[-2:])} failed: {result.stderr[-2000:]}"
                )
        [deb] = work.glob("qemu-user_*.deb")
        # Only the aarch64 emulator: the package unpacks to 465 MB for every target.
        (work / "root").mkdir()
        members = ["./usr/bin/qemu-aarch64", "./usr/libexec/qemu-binfmt/aarch64-binfmt-P"]
        tar = f"dpkg-deb --fsys-tarfile {deb} | tar -x -C {work / 'root'} {' '.join(members)}"
        subprocess.run(["sh", "-c", f"set -e; {tar} ./{CONF_IN_PACKAGE}"], check=True)
        (work / "root" / COMPLETE).write_text(deb.name + "\n")
        shutil.rmtree(QEMU_USER, ignore_errors=True)
        (work / "root").rename(QEMU_USER)
        shutil.rmtree(work, ignore_errors=True)
        if log:
            print(f"fetched {deb.name} in {time.monotonic() - started:.0f} s", file=sys.stderr)
        return QEMU_USER


def registration(conf: Path, prefix: Path = Path("/"), name: str = HANDLER) -> str:
    """The register line from a binfmt.d file (`:name:type:offset:magic:mask:interp:flags`),
    renamed to `name`, with the interpreter looked up under `prefix`."""
    try:
        text = conf.read_text()
    except FileNotFoundError:
        raise BinfmtError(f"{conf} is missing") from None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        sep = line[0]
        fields = line.split(sep)
        if len(fields) < 8 or not fields[1] or not fields[6]:
            raise BinfmtError(f"{conf}: not a binfmt_misc registration: {line!r}")
        if "F" not in fields[7]:
            raise BinfmtError(f"{conf}: flags {fields[7]!r} lack F; a container could not use it")
        fields[1] = name
        fields[6] = str(prefix / fields[6].lstrip("/"))
        if not Path(fields[6]).is_file():
            raise BinfmtError(f"{conf}: interpreter {fields[6]} is missing")
        return sep.join(fields)
    raise BinfmtError(f"{conf} holds no registration")


def unavailable() -> str | None:
    """Why the handler cannot be registered here, or None if it can."""
    if os.geteuid() != 0:
        return "registering a binfmt_misc handler needs root"
    for tool in ("apt-get", "dpkg-deb", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not KEYRING.is_file():
        return f"{KEYRING} is missing (apt-get install debian-archive-keyring)"
    return None


def _handler_state(entry: Path) -> str:
    """'enabled', 'disabled' or '' (not registered)."""
    try:
        return entry.read_text().splitlines()[0].strip()
    except (FileNotFoundError, IndexError):
        return ""


@contextlib.contextmanager
def qemu_aarch64(conf: Path | None = None, prefix: Path = Path("/")) -> Iterator[str]:
    """Register the handler for the duration of the block; yield its name.

    By default the emulator is trixie's qemu-user from the cache (fetched on first use).
    """
    if conf is None:
        prefix = ensure_qemu_user()
        conf = prefix / CONF_IN_PACKAGE
    line = registration(conf, prefix)
    entry = BINFMT_MISC / HANDLER
    mounted = registered = False
    try:
        if not (BINFMT_MISC / "register").exists():
            subprocess.run(
                ["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT_MISC)],
                check=True,
                capture_output=True,
            )
            mounted = True
        if _handler_state(entry):
            # A leftover of a run that was SIGKILLed: ours by name, so replace it.
            entry.write_text("-1")
        (BINFMT_MISC / "register").write_text(line)
        registered = True
        if _handler_state(entry) != "enabled":
            raise BinfmtError(f"{entry} did not come up enabled")
        yield HANDLER
    finally:
        if registered:
            with contextlib.suppress(FileNotFoundError):
                entry.write_text("-1")
        if mounted:
            subprocess.run(["umount", str(BINFMT_MISC)], check=False, capture_output=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m volute_testbed.binfmt -- CMD...", file=sys.stderr)
        return 64
    with qemu_aarch64():
        return subprocess.run(argv, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
