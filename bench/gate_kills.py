"""The kill storm, run by hand: the gate's whole cgroup SIGKILLed at random N times while
clients deliver to many minds (volute_testbed.chaos), in a throwaway systemd.

It prints what the clients saw (acknowledged, refused), what the turns' own log says
(lost, run twice), what systemd showed (the most turn scopes holding a process at once,
empty scopes seen), and how long the queue took to drain after the last kill. Exits 1
if anything acknowledged was lost or ran twice, or the queue did not drain in 60 s.

    .venv/bin/python bench/gate_kills.py [--kills 50] [--minds 12] [--clients 3] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import sys

from volute_testbed import chaos
from volute_testbed.machine import dev_machine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--minds", type=int, default=12)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--cap", type=int, default=2)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    storm = chaos.Storm(
        kills=args.kills, minds=args.minds, clients=args.clients, cap=args.cap, seed=args.seed
    )
    with dev_machine(name="gate-kills") as machine:
        record = chaos.run(machine, storm)
    result = chaos.verdict(record)
    print(json.dumps(result, indent=2))
    drained = result["drain_seconds"]
    ok = (
        not result["lost"]
        and not result["ran_twice"]
        and drained is not None
        and float(drained) <= 60  # type: ignore[arg-type]
    )
    print(
        f"gate_kills: {result['kills']} kills, {result['acknowledged']} acknowledged, "
        f"{result['refused']} refused, {len(result['lost'])} lost, "  # type: ignore[arg-type]
        f"{len(result['ran_twice'])} run twice, {result['dead']} dead, "  # type: ignore[arg-type]
        f"drained {drained} s after the last kill, at most {result['max_turns']} turns at once "
        f"(cap {args.cap}): {'OK' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
