"""A clean debootstrapped Debian root for the install tier, cached outside the repository.

The root is built once per (suite, arch, variant, packages, mirror) and reused for a
week; each test boots a throwaway overlay of it, so nothing a test does reaches the
cache. Building takes about 40 s for amd64. Concurrent builders serialize on a flock.

debootstrap fetches from its own default Debian mirror, and the root's apt then uses
the sources.list debootstrap wrote. Set VOLUTE_DEBIAN_MIRROR to a Debian archive URL
(a local mirror or a caching proxy) to use that instead: debootstrap gets it as its
MIRROR argument, and the qemu-user download of binfmt.py uses it too.

    python -m volute_testbed.rootfs          # build (or reuse) and print the path
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CACHE = Path(os.environ.get("VOLUTE_TEST_CACHE", "/var/cache/volute-test"))
MAX_AGE_SECONDS = 7 * 24 * 3600
COMPLETE = ".volute-rootfs-complete"
MIRROR_VARIABLE = "VOLUTE_DEBIAN_MIRROR"


def debian_mirror() -> str | None:
    """The Debian archive VOLUTE_DEBIAN_MIRROR names, or None for the tools' defaults."""
    return os.environ.get(MIRROR_VARIABLE) or None


def host_arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


@dataclass(frozen=True)
class RootSpec:
    suite: str = "trixie"
    arch: str = "amd64"
    variant: str = "minbase"
    include: tuple[str, ...] = ("systemd", "systemd-sysv", "dbus", "python3")
    # None: debootstrap's own default.
    mirror: str | None = field(default_factory=debian_mirror)

    def argv(self, target: Path) -> list[str]:
        argv = ["debootstrap", f"--variant={self.variant}", f"--arch={self.arch}"]
        argv.append("--include=" + ",".join(self.include))
        argv += [self.suite, str(target)]
        return [*argv, self.mirror] if self.mirror else argv

    @property
    def key(self) -> str:
        digest = hashlib.sha256(" ".join(self.argv(Path("-"))).encode()).hexdigest()[:12]
        return f"{self.suite}-{self.arch}-{digest}"


def apt_archives() -> Path:
    """Downloaded .debs, shared by all runs so a warm run downloads no package again."""
    path = CACHE / "apt-archives"
    (path / "partial").mkdir(parents=True, exist_ok=True)
    return path


def apt_lists() -> Path:
    """The package index, shared too: a warm `apt-get update` only revalidates it."""
    path = CACHE / "apt-lists"
    (path / "partial").mkdir(parents=True, exist_ok=True)
    return path


def apt_cache_binds() -> list[str]:
    """systemd-nspawn arguments that put both caches over the container's own."""
    return [
        f"--bind={apt_archives()}:/var/cache/apt/archives",
        f"--bind={apt_lists()}:/var/lib/apt/lists",
    ]


def ensure_root(spec: RootSpec | None = None, *, log: bool = True) -> Path:
    """The path of a complete root for `spec`, debootstrapping it if missing or stale."""
    spec = spec or RootSpec(arch=host_arch())
    CACHE.mkdir(parents=True, exist_ok=True)
    root = CACHE / spec.key
    with open(CACHE / f"{spec.key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = root / COMPLETE
        if stamp.exists() and time.time() - stamp.stat().st_mtime < MAX_AGE_SECONDS:
            return root
        if shutil.which("debootstrap") is None:
            raise RuntimeError("debootstrap is not installed (apt-get install debootstrap)")
        partial = CACHE / f"{spec.key}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        started = time.monotonic()
        result = subprocess.run(spec.argv(partial), capture_output=True, text=True, check=False)
        if result.returncode != 0:
            tail = (result.stdout + result.stderr)[-3000:]
            raise RuntimeError(f"debootstrap failed ({result.returncode}):\n{tail}")
        # Debian's minbase keeps no apt lists; the tests run `apt-get update` themselves.
        (partial / COMPLETE).write_text(" ".join(spec.argv(root)) + "\n")
        shutil.rmtree(root, ignore_errors=True)
        partial.rename(root)
        if log:
            print(f"built {root} in {time.monotonic() - started:.0f} s", file=sys.stderr)
        return root


if __name__ == "__main__":
    print(ensure_root())
