"""Install tier timings, amd64 (native) against arm64 (qemu-user emulation), one run.

For each architecture, on the cached debootstrapped trixie root of the install tiers:
- boot: systemd-nspawn over a fresh overlay to `running`/`degraded`, `--boots` times;
- install: `apt-get update && apt-get install` of the same `Architecture: all` .debs
  (packaging/build-deb, built once, on this host), once per architecture;
- first turn's launch: `volutectl deliver` starts to the turn scope's ActiveEnterTimestamp
  (CLOCK_MONOTONIC, shared with the container), for `--turns` minds, each the first
  turn of its mind after a gate restart; and the deliver command's own wall time.

Prints medians and the arm64/amd64 ratio. Emulated arm64 figures say nothing about a
real Raspberry Pi's speed: every aarch64 instruction is translated by qemu on this host.
Not in bench/run_all.sh: it needs the network for apt and takes about 5 min warm.

    .venv/bin/python bench/install_tiers.py [--boots 3] [--turns 5] [--arch amd64 arm64]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from volute_testbed.binfmt import qemu_aarch64
from volute_testbed.install_tier import (
    ARM64_ROOT,
    BOOT_TIMEOUT,
    EMULATION_DROPIN,
    EMULATION_MASK,
    booted_with_package,
    build_debs,
    configure_mind,
    deliver_and_wait_for_scope,
)
from volute_testbed.machine import MASKED_UNITS, boot
from volute_testbed.rootfs import RootSpec, ensure_root, host_arch


@contextlib.contextmanager
def runnable(arch: str) -> Iterator[None]:
    if arch == host_arch() or arch != "arm64":
        yield
    else:
        with qemu_aarch64():
            yield


def measure(arch: str, debs: list[Path], boots: int, turns: int) -> dict[str, list[float]]:
    spec = ARM64_ROOT if arch == "arm64" else RootSpec(arch=arch)
    root = ensure_root(spec)
    out: dict[str, list[float]] = {"boot": [], "install": [], "deliver": [], "launch": []}
    emulated = arch != host_arch()
    # The same overlay as the tier's: under emulation, no credentials and no logind.
    prepare = EMULATION_DROPIN if emulated else {}
    mask = (*MASKED_UNITS, *EMULATION_MASK) if emulated else MASKED_UNITS
    for i in range(boots):
        started = time.monotonic()
        with boot(
            lower=str(root),
            name=f"vb-{arch}-{i}",
            boot_timeout=BOOT_TIMEOUT,
            prepare=prepare,
            mask=mask,
        ):
            out["boot"].append(time.monotonic() - started)
    with booted_with_package(root, debs, arch, f"vb-{arch}-pkg") as installed:
        out["install"].append(installed.timings.install_s)
        m = installed.machine
        for n in range(turns):
            configure_mind(m, f"m{n}", '["/bin/sleep", "20"]')
        m.run(["systemctl", "restart", "volute-gate.service"], timeout=120)
        for n in range(turns):
            _, deliver_s, launch_s = deliver_and_wait_for_scope(m, f"m{n}")
            out["deliver"].append(deliver_s)
            out["launch"].append(launch_s)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boots", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--arch", nargs="+", default=["amd64", "arm64"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        started = time.monotonic()
        debs = build_debs(Path(tmp))
        print(f"build-deb: {time.monotonic() - started:.1f} s ({', '.join(d.name for d in debs)})")
        results = {}
        for arch in args.arch:
            with runnable(arch):
                results[arch] = measure(arch, debs, args.boots, args.turns)
            print(
                f"{arch}: "
                + ", ".join(f"{k}={[round(v, 2) for v in vs]}" for k, vs in results[arch].items())
            )
    rows = [
        ("boot", "boot to running (s)"),
        ("install", "apt-get update + install (s)"),
        ("deliver", "volutectl deliver, wall (s)"),
        ("launch", "deliver start -> turn scope active (s)"),
    ]
    print(f"\n| {'what':<40} | " + " | ".join(f"{a} median" for a in args.arch) + " | ratio |")
    for key, label in rows:
        medians = [statistics.median(results[a][key]) for a in args.arch]
        ratio = f"{medians[-1] / medians[0]:.1f}x" if len(medians) > 1 and medians[0] else "-"
        print(f"| {label:<40} | " + " | ".join(f"{v:.2f}" for v in medians) + f" | {ratio} |")
    subprocess.run(["uname", "-srm"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
