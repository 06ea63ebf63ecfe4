"""Scope launch: the adapter (volutectl.systemd.adapter) against `systemd-run --scope`, in one run.

What is measured, per launch, all on CLOCK_MONOTONIC in the bench process:

  adapter      os.fork() a child that blocks reading a release pipe;
               Manager.start_scope(name, [pid], ScopeProperties(slice=volute-turns.slice))
               on ONE persistent connection (watching units, as the gate does), which
               returns once systemd's job is done, i.e. the scope holds the child;
               write the release byte; the child execs /bin/true.
               - fork->scope  from just before fork() to start_scope() returning;
               - fork->exec   from just before fork() to the child's execve() having
                              replaced its image: the child keeps the write end of an
                              O_CLOEXEC pipe, so the bench's read() sees EOF exactly when
                              the kernel closes it during a successful execve();
               - fork->exit   to waitpid() returning: the same span systemd-run's figure
                              covers (its /bin/true also runs and exits).
  systemd-run  subprocess.run(["systemd-run", "--scope", "-q",
               "--slice=volute-turns.slice", "/bin/true"]), end to end: start of the call
               to its return (process spawn, bus connect, StartTransientUnit, waiting for
               the job, exec of /bin/true, exit, reap).

The two kinds alternate (their order flips every round) with a 20 ms pause after each
launch, in which the adapter's connection drains its unit signals as a gate's event loop
would; so drift and the previous scope's garbage collection hit both alike. The issue's
target: adapter fork->exec at most 0.6x systemd-run end to end (median).

When PID 1 here is not systemd, the bench boots a throwaway systemd (volute_testbed.machine:
systemd-nspawn over an overlay of this root, with the checkout bound at the same path)
and runs itself inside it.

    .venv/bin/python bench/bench_scope.py [--runs 50] [--pause-ms 20]
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

from volute_testbed.diskprobe import percentile
from volute_testbed.machine import dev_machine

REPO = Path(__file__).resolve().parents[1]
SLICE = "volute-turns.slice"
TARGET_RATIO = 0.6
SYSTEMD_RUN = ["systemd-run", "--scope", "-q", f"--slice={SLICE}", "/bin/true"]
# After each launch, an idle event loop of --pause-ms: the adapter's connection drains the
# unit signals (the last scope ending and being collected) as a gate's loop would, instead
# of finding them queued at the next start_scope().
PAUSE_MS = 20


def now_ms() -> float:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) / 1e6


# -- the measurements (run where systemd is PID 1) ----------------------------------------


class AdapterLauncher:
    def __init__(self) -> None:
        from volutectl.systemd.adapter import Manager, ScopeProperties

        self.manager = Manager.connect()
        self.manager.watch_units()
        self.props = ScopeProperties(slice=SLICE, description="bench_scope")
        self.count = 0

    def launch(self, verify: bool = False) -> tuple[float, float, float]:
        """One launch; returns (fork->scope, fork->exec, fork->exit) in ms."""
        self.count += 1
        name = f"volute-bench-{os.getpid()}-{self.count}.scope"
        release_r, release_w = os.pipe()
        exec_r, exec_w = os.pipe()  # os.pipe() fds are O_CLOEXEC
        started = now_ms()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.close(release_w)
                os.close(exec_r)
                os.read(release_r, 1)
                os.execv("/bin/true", ["true"])
            finally:
                os._exit(127)
        os.close(release_r)
        os.close(exec_w)
        try:
            self.manager.start_scope(name, [pid], self.props)
            scoped = now_ms()
            if verify:
                with open(f"/proc/{pid}/cgroup") as handle:
                    cgroup = handle.read()
                if f"/{SLICE}/{name}" not in cgroup:
                    raise SystemExit(f"bench_scope: {name} does not hold the child: {cgroup}")
            os.write(release_w, b"x")
            if os.read(exec_r, 1) != b"":
                raise SystemExit("bench_scope: unexpected data on the exec pipe")
            execed = now_ms()
            _, status = os.waitpid(pid, 0)
            exited = now_ms()
        finally:
            os.close(release_w)
            os.close(exec_r)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"bench_scope: the child in {name} failed: status {status}")
        return scoped - started, execed - started, exited - started

    def idle(self, seconds: float) -> None:
        """Run the event loop for `seconds`, as a gate does between launches."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            select.select([self.manager.fileno()], [], [], remaining)
            self.manager.process_events()


def systemd_run_once() -> float:
    started = now_ms()
    proc = subprocess.run(SYSTEMD_RUN, capture_output=True, check=False)
    elapsed = now_ms() - started
    if proc.returncode != 0:
        raise SystemExit(f"bench_scope: systemd-run failed: {proc.stderr.decode().strip()}")
    return elapsed


def measure(runs: int, warmup: int, pause: float) -> None:
    adapter = AdapterLauncher()
    for _ in range(warmup):
        adapter.launch(verify=True)
        adapter.idle(pause)
        systemd_run_once()
        adapter.idle(pause)
    to_scope: list[float] = []
    to_exec: list[float] = []
    to_exit: list[float] = []
    systemd_run: list[float] = []
    for round_ in range(runs):
        for kind in ("adapter", "systemd-run") if round_ % 2 == 0 else ("systemd-run", "adapter"):
            if kind == "adapter":
                scope, execed, exited = adapter.launch()
                to_scope.append(scope)
                to_exec.append(execed)
                to_exit.append(exited)
            else:
                systemd_run.append(systemd_run_once())
            adapter.idle(pause)
    adapter.manager.close()
    report(runs, warmup, to_scope, to_exec, to_exit, systemd_run)


def report(
    runs: int,
    warmup: int,
    to_scope: list[float],
    to_exec: list[float],
    to_exit: list[float],
    systemd_run: list[float],
) -> None:
    version = subprocess.run(["systemctl", "--version"], capture_output=True, text=True)
    print(
        f"scope launch into {SLICE}: {runs} interleaved launches each (+{warmup} warm-up), "
        f"{version.stdout.split(chr(10))[0]}, Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs"
    )
    print()
    rows = [
        ("adapter fork -> scope holds child", to_scope),
        ("adapter fork -> exec of /bin/true", to_exec),
        ("adapter fork -> /bin/true exited", to_exit),
        ("systemd-run --scope, end to end", systemd_run),
    ]
    print("| what (ms) | median | p90 | min |")
    print("|---|---:|---:|---:|")
    for label, values in rows:
        print(
            f"| {label} | {statistics.median(values):.2f} | {percentile(values, 0.9):.2f} "
            f"| {min(values):.2f} |"
        )
    baseline = statistics.median(systemd_run)
    ratio = statistics.median(to_exec) / baseline
    print()
    print("| ratio to systemd-run end to end | median | p90 | min |")
    print("|---|---:|---:|---:|")
    for label, values in (("adapter fork -> exec", to_exec), ("adapter fork -> exit", to_exit)):
        print(
            f"| {label} | {statistics.median(values) / baseline:.2f} "
            f"| {percentile(values, 0.9) / percentile(systemd_run, 0.9):.2f} "
            f"| {min(values) / min(systemd_run):.2f} |"
        )
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print()
    print(
        f"target: adapter fork->exec <= {TARGET_RATIO}x systemd-run end to end (medians): "
        f"{verdict} ({ratio:.2f}x)"
    )


# -- where to run ----------------------------------------------------------------------


def systemd_is_pid1() -> bool:
    try:
        comm = Path("/proc/1/comm").read_text().strip()
    except OSError:
        return False
    return comm == "systemd" and Path("/run/systemd/system").is_dir()


def run_in_container(argv: list[str]) -> int:
    print("bench_scope: PID 1 is not systemd; booting a throwaway one (systemd-nspawn)")
    with dev_machine(name="volute-bench-scope") as machine:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--here", *argv]
        proc = subprocess.run(
            machine.command(cmd, env={"PYTHONPATH": str(REPO)}), check=False, timeout=600
        )
    return proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="launches of each kind (>= 30)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pause-ms", type=float, default=PAUSE_MS, help="idle after each launch")
    parser.add_argument("--here", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be positive")
    if args.runs < 30:
        print("bench_scope: note: the target is judged on medians of >= 30", file=sys.stderr)
    if args.here or systemd_is_pid1():
        if not systemd_is_pid1():
            raise SystemExit("bench_scope: --here needs systemd as PID 1")
        measure(args.runs, args.warmup, args.pause_ms / 1000)
        return
    raise SystemExit(
        run_in_container(
            [f"--runs={args.runs}", f"--warmup={args.warmup}", f"--pause-ms={args.pause_ms}"]
        )
    )


if __name__ == "__main__":
    main()
