"""The main-job demonstration: a cron-aligned fan-out to many minds, bounded by the gate.

By default the gate runs as the package installs it: the adaptive limit
([limits.adaptive], on by default) bounds the turns at once, with no cap to choose.
`--cap N` adds limits.global_concurrent_turns, a hard ceiling over the adaptive limit;
`--no-adaptive` turns the adaptive limit off, leaving the static cap alone (or nothing).

On a machine whose PID 1 is not systemd this boots a throwaway systemd (systemd-nspawn
over an overlay of this machine's root; nothing is written to the host), installs the
units from this checkout, starts the real volute-gate.service, and then does what the
heartbeat timers do at the top of the hour: starts every mind's
volute-heartbeat@MIND.service in the same instant.

While it runs it prints, every 200 ms, the live turn scopes as systemd lists them in
volute-turns.slice (not the gate's own counters), and the gate's hold/start/end lines
as the journal receives them. It ends with `systemctl status volute-turns.slice`
captured mid-run and a summary checked against systemd's own record.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from volute_testbed.gate import (
    VOLUTECTL,
    Sampler,
    gate_config,
    install_probe,
    live_turn_scopes,
    start_gate,
    turn_log,
)
from volute_testbed.machine import dev_machine, nspawn_available
from volutectl.config.settings import AdaptiveSettings


def describe_limits(cap: int | None, adaptive: bool) -> str:
    """What bounds the fan-out, as the config the demo writes says."""
    ceiling = f"limits.global_concurrent_turns = {cap}" if cap is not None else "no ceiling"
    if not adaptive:
        return f"limits.adaptive off; {ceiling}"
    bounds = AdaptiveSettings()
    return (
        f"limits.adaptive on (the default): starts at {bounds.start} turns at once, "
        f"between {bounds.minimum} and {bounds.maximum}, moves at most every "
        f"{bounds.interval_seconds}s; {ceiling}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minds", type=int, default=12, help="how many minds wake at once")
    parser.add_argument(
        "--cap",
        type=int,
        default=None,
        help="limits.global_concurrent_turns: a hard ceiling over the adaptive limit (none)",
    )
    parser.add_argument(
        "--no-adaptive",
        dest="adaptive",
        action="store_false",
        help="turn the adaptive limit off: the static --cap alone bounds the fan-out",
    )
    parser.add_argument("--turn-seconds", type=float, default=1.0, help="how long a turn runs")
    args = parser.parse_args()
    if Path("/run/systemd/system").exists():
        print(
            "systemd is PID 1 here: install the package and use the real gate instead\n"
            "  (apt install ./volutectl_*.deb; volutectl deliver MIND -m hello; "
            "systemctl status volute-turns.slice)"
        )
        return 0
    reason = nspawn_available()
    if reason:
        print(f"cannot run the demo: {reason}", file=sys.stderr)
        return 69
    minds = {f"mind{i:02d}": f"turn-probe {args.turn_seconds}" for i in range(1, args.minds + 1)}
    print("booting a throwaway systemd (nspawn over an overlay of /) ...", flush=True)
    with dev_machine() as machine:
        install_probe(machine)
        limits = {} if args.cap is None else {"limits": {"global_concurrent_turns": args.cap}}
        start_gate(machine, gate_config(minds, adaptive=args.adaptive, **limits))
        print(
            f"gate running: {len(minds)} minds, 1 turn per mind; each turn runs "
            f"{args.turn_seconds}s\n  {describe_limits(args.cap, args.adaptive)}\n"
        )
        journal = machine.popen(
            ["journalctl", "-f", "-n", "0", "-o", "cat", "-u", "volute-gate.service"],
            stdout=subprocess.PIPE,
        )
        sampler = Sampler(machine, "demo")
        print(f"{'t':>6}  live turns (from systemd)", flush=True)
        print(f"{'0.0':>6}  firing volute-heartbeat@*.service for all {len(minds)} minds at once")
        started = time.monotonic()
        machine.run(
            ["systemctl", "start", "--no-block"]
            + [f"volute-heartbeat@{name}.service" for name in minds]
        )
        snapshot, most_live = "", 0
        assert journal.stdout is not None
        os.set_blocking(journal.stdout.fileno(), False)
        buffered = ""
        while True:
            ready, _, _ = select.select([journal.stdout], [], [], 0.2)
            if ready:
                buffered += journal.stdout.read() or ""
                *lines, buffered = buffered.split("\n")
                for line in lines:
                    words = ("holding", "started turn", "ended", "held", "limit")
                    if any(word in line for word in words):
                        print(f"{time.monotonic() - started:6.1f}    gate: {line}")
            live = live_turn_scopes(machine)
            print(f"{time.monotonic() - started:6.1f}  {len(live)} {' '.join(sorted(live))}")
            if len(live) > most_live:  # the slice at its fullest
                most_live = len(live)
                snapshot = machine.run(
                    ["systemctl", "status", "--no-pager", "--lines=0", "volute-turns.slice"]
                ).stdout
            ended = [f for f in turn_log(machine) if f[0] == "end"]
            if len(ended) == len(minds):
                break
            if time.monotonic() - started > 60 + len(minds) * args.turn_seconds * 2:
                print("the fan-out did not finish in time", file=sys.stderr)
                return 1
        seen = sampler.stop()
        journal.terminate()
        status = json.loads(machine.run([VOLUTECTL, "status", "--json"]).stdout)
        print("\nsystemctl status volute-turns.slice, captured mid-run:\n")
        print(snapshot)
        print("summary (from systemd's own scope listing, sampled every ~2 ms):")
        bound = f"cap {args.cap}" if args.cap is not None else "no ceiling"
        print(f"  most turn scopes live at once: {seen['max_turns']} ({bound})")
        if "adaptive" in status:  # the gate's own account of its limit
            print(f"  the gate's adaptive limit:     {json.dumps(status['adaptive'])}")
        print(f"  most per mind at once:         {max(seen['max_per_mind'].values())}")
        print(f"  turns run:                     {len(seen['seen'])} for {len(minds)} minds")
        print(f"  queue now: {status['queue_depth']} pending, {status['dead']} dead")
        print(f"  fan-out makespan:              {time.monotonic() - started:.1f}s")
        most = min(
            args.cap or len(minds), AdaptiveSettings().maximum if args.adaptive else len(minds)
        )
        ok = seen["max_turns"] <= most and status["queue_depth"] == 0
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
