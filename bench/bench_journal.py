"""What each turn's own log costs: journal bytes per turn, and the cost of sending entries.

Boots a throwaway systemd (volute_testbed.machine) with the real volute-gate.service and
measures, inside it:

1. Journal bytes per turn: the used bytes of every journal file (each file header's
   tail object offset, i.e. what journald wrote, not what it preallocated) before and
   after N turns of each kind, the gate's own entries included:
   - silent: the command prints nothing (the gate's entries: queued, start, end);
   - talker: the command prints LINES lines of 80 bytes (a known amount of output).
   Beside it, the same output written to a plain file: the bytes a log of our own
   would have cost.
2. Sending one entry of the gate's (6 fields, the start entry's shape), in a service
   whose stderr is the journal: through libsystemd's sd_journal_sendv (pystemd, what
   volutectl.systemd.journal uses) against the native protocol written by hand (the code it
   replaced), alternating, one entry every 2 ms as the gate sends them (a flood would
   time journald's intake instead).
3. Opening a turn's stream, as the child does after its release (connect, shut the
   read side, send the header): the cost it adds to the handoff.

    .venv/bin/python bench/bench_journal.py [--turns 50] [--lines 20] [--entries 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from volute_testbed.gate import VOLUTECTL, all_settled, start_gate, wait_for
from volute_testbed.machine import Machine, dev_machine
from volute_testbed.paths import PYTHON

LINE = "x" * 60  # with "line NN of turn NNNN: " and the newline: 80 bytes

CONFIG = """
[gate]
max_attempts = 1
[minds.silent]
command = "true"
[minds.talker]
command = '''i=0; while [ $i -lt {lines} ]; do
  printf "line %02d of turn %04d: {line}\\n" $i $VOLUTE_TURN_ID; i=$((i + 1)); done'''
"""

# Inside the machine: the bytes journald has written, summed over every journal file.
USED_BYTES = """
import glob, struct
total = 0
for path in glob.glob("/run/log/journal/*/*.journal") + glob.glob("/var/log/journal/*/*.journal"):
    with open(path, "rb") as journal:
        header = journal.read(160)
    (tail,) = struct.unpack_from("<Q", header, 136)  # Header.tail_object_offset
    with open(path, "rb") as journal:
        journal.seek(tail)
        (size,) = struct.unpack_from("<Q", journal.read(16), 8)  # ObjectHeader.size
    total += tail + size
print(total)
"""

# Inside the machine, in a service: one entry's send, by libsystemd and by hand.
SENDS = """
import json, os, socket, sys, time
from volutectl.systemd.journal import Journal, entry_fields
n = int(sys.argv[1])
fields = dict(mind="mimsy", session="chat", unit="volute-turn-mimsy-17.scope", turn_id=17,
              delivery_ids="41 42", event="start")
library = Journal("volute-bench")
assert library.sender is not None, "stderr is not the journal"
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.connect("/run/systemd/journal/socket")
# The code volutectl.systemd.journal had before: one datagram, KEY=value lines.
def by_hand(message):
    lines = [f"MESSAGE={message}", "PRIORITY=6", "SYSLOG_IDENTIFIER=volute-bench"]
    lines += [f"VOLUTE_{k.upper()}={v}" for k, v in fields.items()]
    sock.send("\\n".join(lines).encode() + b"\\n")
times = {"sd_journal_sendv (pystemd)": [], "native protocol by hand": []}
for i in range(n):
    for name in (list(times) if i % 2 else list(times)[::-1]):
        start = time.perf_counter_ns()
        if name.startswith("sd_"):
            library.log("info", f"turn {i} of mimsy/chat started", **fields)
        else:
            by_hand(f"turn {i} of mimsy/chat started")
        times[name].append((time.perf_counter_ns() - start) / 1000)
        time.sleep(0.002)  # one at a time, as the gate sends them: journald keeps up
print(json.dumps(times))
"""

# Inside the machine, as root (the gate's child is): open a turn's stream, N times.
STREAMS = """
import json, os, sys, time
from volutectl.systemd.journal import STDOUT_SOCKET, TurnStream
stream = TurnStream(STDOUT_SOCKET, "volute-bench", "volute-turn-bench-1.scope")
times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter_ns()
    fd = stream.connect()
    times.append((time.perf_counter_ns() - start) / 1000)
    os.close(fd)
print(json.dumps(times))
"""


def used_bytes(machine: Machine) -> int:
    machine.run(["journalctl", "--sync"])
    return int(machine.run([PYTHON, "-c", USED_BYTES]).stdout)


def turns_cost(machine: Machine, mind: str, turns: int) -> float:
    """Journal bytes per turn of `mind`, over `turns` turns one after another."""
    before = used_bytes(machine)
    for i in range(turns):
        machine.run([VOLUTECTL, "deliver", mind, "--session", f"s{i}", "-m", "go", "--wait"])
    wait_for(lambda: all_settled(machine), timeout=120)
    time.sleep(1.0)  # let journald read the last streams before it syncs
    return (used_bytes(machine) - before) / turns


def run(args: argparse.Namespace) -> dict[str, object]:
    results: dict[str, object] = {}
    with dev_machine(name=f"volute-bench-journal-{os.getpid()}") as machine:
        start_gate(machine, CONFIG.format(lines=args.lines, line=LINE))
        machine.run([VOLUTECTL, "deliver", "silent", "-m", "warm up", "--wait"])
        results["silent"] = turns_cost(machine, "silent", args.turns)
        results["talker"] = turns_cost(machine, "talker", args.turns)
        results["output_bytes"] = args.lines * 80
        storage = machine.run(["sh", "-c", "ls -d /var/log/journal 2>/dev/null || true"]).stdout
        results["storage"] = "persistent" if storage.strip() else "volatile (/run/log/journal)"
        # A service of its own: stderr is the journal, stdout the figures.
        machine.run(["systemd-run", "--wait", "--quiet", "-p", "StandardError=journal",
                     "-p", "StandardOutput=file:/run/bench-sends.json", PYTHON, "-c", SENDS,
                     str(args.entries)], timeout=300)  # fmt: skip
        results["sends_us"] = json.loads(machine.run(["cat", "/run/bench-sends.json"]).stdout)
        results["stream_us"] = json.loads(
            machine.run([PYTHON, "-c", STREAMS, str(args.streams)]).stdout
        )
    return results


def report(results: dict[str, object], args: argparse.Namespace) -> None:
    silent, talker = float(results["silent"]), float(results["talker"])  # type: ignore[arg-type]
    output = int(results["output_bytes"])  # type: ignore[call-overload]
    print(f"\n1. Journal bytes per turn ({args.turns} turns each, {results['storage']})")
    print(f"  silent turn (the gate's entries only)          {silent:8.0f} B")
    print(f"  turn printing {args.lines} lines of 80 B ({output} B)      {talker:8.0f} B")
    per_line = (talker - silent) / args.lines
    print(f"  per line of output                              {per_line:8.0f} B"
          f"  ({per_line / 80:.1f}x the line; a file of our own: 80 B)")  # fmt: skip
    sends: dict[str, list[float]] = results["sends_us"]  # type: ignore[assignment]
    print(f"\n2. Sending one gate entry ({args.entries} each, interleaved, 2 ms apart)")
    for name, values in sends.items():
        p90 = sorted(values)[int(0.9 * (len(values) - 1))]
        print(f"  {name:<30} {statistics.median(values):8.1f} us median, p90 {p90:.1f} us")
    streams: list[float] = results["stream_us"]  # type: ignore[assignment]
    print(f"\n3. Opening a turn's stream ({len(streams)} times): median "
          f"{statistics.median(streams):.0f} us, p90 "
          f"{sorted(streams)[int(0.9 * (len(streams) - 1))]:.0f} us")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--lines", type=int, default=20)
    parser.add_argument("--entries", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    started = time.time()
    results = run(args)
    report(results, args)
    print(f"\n(bench took {time.time() - started:.0f} s; {os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
