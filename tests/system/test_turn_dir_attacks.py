"""Issue 18, findings 1-5, against the real gate: a mind's turn (or another process of
the mind's user) attacks root through the turn directory, as it did on 98e6a5e.

Each test boots its own systemd, runs volute-gate.service from this checkout, and gives
the mind its own unprivileged user, `mindy`. What the attack does runs as `mindy`: the
turn's own command, or a process started with setpriv. Each asserts what the attack
got on the old code: /etc/passwd the mind's, files of root's in /etc, /etc/shadow on a
turn's stdin, a gate blocked for ever, a gate that cannot start.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from volute_testbed.gate import (
    VOLUTECTL,
    all_settled,
    deliver,
    gate_events,
    journal,
    queue_rows,
    start_gate,
    wait_for,
)
from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

MIND_USER = "mindy"
# What the mind's user runs Python with: the checkout's interpreter may live under /root.
MIND_PYTHON = "/usr/bin/python3"


def mind_config(command: list[str], **gate: object) -> str:
    """One mind, `evil`, whose turns run `command` as MIND_USER."""
    lines = ["[gate]"] + [f"{key} = {json.dumps(value)}" for key, value in gate.items()]
    lines += ['[minds."evil"]', f"command = {json.dumps(command)}", f'user = "{MIND_USER}"']
    return "\n".join(lines) + "\n"


def add_mind_user(machine: Machine) -> None:
    machine.run(["useradd", "-r", "-M", "-d", "/nonexistent", "-s", "/bin/sh", MIND_USER])


def script(machine: Machine, name: str, text: str) -> str:
    path = f"/usr/local/bin/{name}"
    machine.write(path, text, mode=0o755)
    return path


def file_facts(machine: Machine, path: str) -> str:
    """Owner, type and checksum: what an attack on the file would change."""
    return machine.sh(f"stat -c '%U:%G %F %s' {path} && sha256sum {path}").stdout


def gate_answers(machine: Machine, timeout: float = 15) -> bool:
    try:
        proc = machine.run([VOLUTECTL, "status", "--json"], check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


def gate_pid(machine: Machine) -> str:
    return machine.run(["systemctl", "show", "-P", "MainPID", "volute-gate"]).stdout.strip()


# A turn that plants links where the gate once wrote, then takes what reaches its inbox
# until told to stop. $1: what to plant.
PLANTER = r"""#!/bin/sh
case "$1" in
links)  # finding 1: the gate created inbox/.<id>.tmp through them, then chowned it
  for i in $(seq 1 60); do ln -s /etc/passwd "$VOLUTE_INBOX/.$i.tmp"; done ;;
dirs)   # finding 2: the inbox and the offer record made links to /etc
  d=$VOLUTE_TURN_DIR
  for name in inbox .offered; do
    mv "$d/$name" "$d/$name.away" && ln -s /etc "$d/$name" && echo "$name" >> /var/tmp/swapped
  done ;;
esac
echo "$VOLUTE_TURN_ID" >> /var/tmp/planted
while [ ! -e /var/tmp/stop ]; do
  for f in "$VOLUTE_INBOX"/*.json "$VOLUTE_TURN_DIR"/inbox.away/*.json; do
    [ -f "$f" ] && cat "$f" >> /var/tmp/took && rm -f "$f"
  done
  sleep 0.05
done
"""


def start_planter(machine: Machine, mode: str) -> None:
    add_mind_user(machine)
    planter = script(machine, "planter", PLANTER)
    machine.sh(": > /var/tmp/took; chmod 666 /var/tmp/took")
    start_gate(machine, mind_config([planter, mode]))


def planted_then_fold(machine: Machine) -> int:
    """A turn of `evil` plants, then a delivery to its session folds in; returns the
    folded delivery's id once the turn ended and everything settled."""
    deliver(machine, "evil", "first", "--session", "s")
    wait_for(lambda: machine.host_path("/var/tmp/planted").exists(), timeout=30)
    folded = deliver(machine, "evil", "second", "--session", "s")

    def taken_or_refused() -> bool:
        taken = f'"id": {folded}' in machine.host_path("/var/tmp/took").read_text()
        return taken or bool(
            gate_events(machine, "VOLUTE_EVENT=not_offered", f"VOLUTE_DELIVERY_ID={folded}")
        )

    wait_for(taken_or_refused, timeout=30)
    machine.write("/var/tmp/stop", "")
    wait_for(lambda: all_settled(machine), timeout=60)
    return folded


def test_links_in_the_inbox_do_not_give_the_mind_etc_passwd(machine: Machine) -> None:
    start_planter(machine, "links")
    before = file_facts(machine, "/etc/passwd")
    assert before.startswith("root:root regular file")
    folded = planted_then_fold(machine)
    assert file_facts(machine, "/etc/passwd") == before
    # And the fold-in still reached the turn, through the inbox.
    assert f'"id": {folded}' in machine.host_path("/var/tmp/took").read_text()
    assert [row["id"] for row in queue_rows(machine, "done")] == [1, folded]


def test_the_inbox_and_offer_record_cannot_be_swapped_for_etc(machine: Machine) -> None:
    start_planter(machine, "dirs")
    before = machine.sh("ls -A /etc | sort").stdout
    folded = planted_then_fold(machine)
    assert not machine.host_path("/var/tmp/swapped").exists()  # the turn could not
    assert machine.sh("ls -A /etc | sort").stdout == before
    for name in (f"{folded}.json", f".{folded}.tmp", str(folded)):
        assert not machine.host_path(f"/etc/{name}").exists()
    done = queue_rows(machine, "done")
    assert folded in [row["id"] for row in done]  # taken, or run by the next turn
    assert all(row["attempts"] == 0 for row in done)


# Another process of the mind's user, outside any turn: it swapped the next turns'
# stdin.jsonl for a link to /etc/shadow in the moment between the gate handing the turn
# directory over and the child opening it.
SWAPPER = r"""
import os, sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end and not os.path.exists("/var/tmp/stop"):
    for n in range(1, 12):
        d = f"/run/volute/turns/{n}"
        try:
            os.rename(f"{d}/stdin.jsonl", f"{d}/stdin.away")
            os.symlink("/etc/shadow", f"{d}/stdin.jsonl")
            print("swapped", n, flush=True)
        except OSError:
            pass
"""

READER = r"""#!/bin/sh
cat > "/var/tmp/stdin-$VOLUTE_TURN_ID"
"""


def test_a_turns_stdin_cannot_be_swapped_for_etc_shadow(machine: Machine) -> None:
    add_mind_user(machine)
    reader = script(machine, "stdin-reader", READER)
    start_gate(machine, mind_config([reader]))
    swapper = subprocess.Popen(
        machine.command([MIND_PYTHON, "-c", SWAPPER, "120"], user=MIND_USER),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(1)  # the swapper is looping
        ids = []
        for n in range(10):
            ids.append(deliver(machine, "evil", f"message {n}", "--session", f"s{n}", "--wait"))
    finally:
        machine.write("/var/tmp/stop", "")
        swapped, _ = swapper.communicate(timeout=30)
    assert ids == list(range(1, 11))
    for turn_id, delivery_id in enumerate(ids, start=1):
        seen = machine.host_path(f"/var/tmp/stdin-{turn_id}").read_text()
        assert json.loads(seen)["id"] == delivery_id, seen
        assert "root:" not in seen
    assert swapped == ""  # not once


# The turn's command puts a FIFO where the wrapper writes its status, waits for the
# gate's restart, then kills the wrapper (its own user's process): the restarted gate,
# with no exit status of its own child, reads the status file to settle the turn.
FIFO_PLANTER = r"""#!/bin/sh
d=$VOLUTE_TURN_DIR
if rm -f "$d/status" 2>/dev/null && mkfifo "$d/status" 2>/dev/null; then
  echo planted > /var/tmp/fifo
else
  echo refused > /var/tmp/fifo
fi
while [ ! -e /var/tmp/go ]; do sleep 0.05; done
kill -KILL "$PPID"
"""


def test_a_fifo_at_status_never_blocks_the_gate(machine: Machine) -> None:
    add_mind_user(machine)
    planter = script(machine, "fifo-planter", FIFO_PLANTER)
    start_gate(machine, mind_config([planter], max_attempts=1))
    delivery = deliver(machine, "evil", "x")
    wait_for(lambda: machine.host_path("/var/tmp/fifo").exists(), timeout=30)
    machine.run(["systemctl", "restart", "volute-gate"], timeout=60)
    wait_for(lambda: bool(gate_events(machine, "VOLUTE_EVENT=adopt")), timeout=30)
    machine.write("/var/tmp/go", "")
    pid = gate_pid(machine)
    wait_for(lambda: not queue_rows(machine, "pending", "running"), timeout=30, interval=0.3)
    assert [row["id"] for row in queue_rows(machine, "dead")] == [delivery]
    assert gate_answers(machine) and gate_pid(machine) == pid  # never blocked, never killed
    assert machine.host_path("/var/tmp/fifo").read_text() == "refused\n"
    # Every later start is a start like any other.
    machine.run(["systemctl", "restart", "volute-gate"], timeout=60)
    assert gate_answers(machine)


DEEP_TREE = r"""
import os
fd = os.open(os.environ["VOLUTE_INBOX"], os.O_RDONLY | os.O_DIRECTORY)
for _ in range(2000):
    os.mkdir("d", dir_fd=fd)
    inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = inner
"""


def test_a_deep_tree_in_the_turn_directory_never_stops_the_gate(machine: Machine) -> None:
    add_mind_user(machine)
    start_gate(machine, mind_config([MIND_PYTHON, "-c", DEEP_TREE]))
    deliver(machine, "evil", "deep", "--wait")
    assert [row["id"] for row in queue_rows(machine, "done")] == [1]
    wait_for(lambda: gate_answers(machine), timeout=30)
    assert "RecursionError" not in journal(machine)
    # The next start removes whatever a budget left, and starts.
    machine.run(["systemctl", "restart", "volute-gate"], timeout=60)
    assert machine.run(["systemctl", "is-active", "volute-gate"]).stdout.strip() == "active"
    assert machine.sh("ls -A /run/volute/turns /run/volute/turns/.trash").stdout.split() == [
        "/run/volute/turns:",
        ".trash",
        "/run/volute/turns/.trash:",
    ]
    assert deliver(machine, "evil", "after", "--wait") == 2
    assert "RecursionError" not in journal(machine)


# A turn that fills its inbox: bytes until the write fails (at most 512 MiB), then empty
# files until one cannot be made (at most 40,000); says how far it got, then holds on.
FILLER = r"""
import os, time
inbox = os.environ["VOLUTE_INBOX"]
mib = files = 0
try:
    with open(inbox + "/fill", "wb", buffering=0) as out:
        while mib < 512:
            out.write(bytes(1 << 20))
            mib += 1
except OSError:
    pass
try:
    while files < 40000:
        os.close(os.open(f"{inbox}/f{files}", os.O_CREAT | os.O_WRONLY, 0o600))
        files += 1
except OSError:
    pass
with open("/var/tmp/filled", "w") as report:
    report.write(f"{mib} {files}\n")
time.sleep(20)
"""


def run_space(machine: Machine) -> tuple[int, int]:
    """Free KiB and free inodes of /run."""
    blocks = machine.run(["df", "--output=avail", "/run"]).stdout.split()[-1]
    inodes = machine.run(["df", "--output=iavail", "/run"]).stdout.split()[-1]
    return int(blocks), int(inodes)


def test_a_turn_that_fills_its_inbox_leaves_run_to_the_others(machine: Machine) -> None:
    add_mind_user(machine)
    machine.write("/usr/local/bin/turn-probe", "#!/bin/sh\ncat >/dev/null\n", mode=0o755)
    # /run as small as a small host's: on the merged code the turn filled it, bytes and
    # inodes, and systemd could start no other mind's turn (no room for its unit file).
    machine.run(["mount", "-o", "remount,size=48M,nr_inodes=20000", "/run"])
    config = mind_config([MIND_PYTHON, "-c", FILLER])
    config += '[minds."good"]\ncommand = "turn-probe"\n'
    start_gate(machine, config)
    deliver(machine, "evil", "fill your inbox")
    wait_for(lambda: machine.host_path("/var/tmp/filled").exists(), timeout=60)
    mib, files = map(int, machine.host_path("/var/tmp/filled").read_text().split())
    free_kib, free_inodes = run_space(machine)
    assert free_kib > 40 * 1024 and free_inodes > 15_000, (mib, files, free_kib, free_inodes)
    # Its own tmpfs held it back: 256 MiB and 16,384 inodes (the root directory's, the
    # offer record's, the status file's and the inbox's among them).
    assert 0 < mib <= 256 and 0 < files < 16_384, (mib, files)
    # Another mind's turn runs while the filler still holds its inbox.
    good = deliver(machine, "good", "still room for me")
    wait_for(lambda: any(r["id"] == good for r in queue_rows(machine, "done")), timeout=30)
    assert any(r["mind"] == "evil" for r in queue_rows(machine, "running"))
    # Once the filler's turn has ended, its tmpfs is detached and nothing is left.
    wait_for(lambda: all_settled(machine), timeout=60)
    wait_for(lambda: "volute-turn" not in machine.run(["findmnt", "-rn"]).stdout, timeout=15)
    listed = machine.sh("ls -A /run/volute/turns /run/volute/turns/.trash").stdout.split()
    assert listed == ["/run/volute/turns:", ".trash", "/run/volute/turns/.trash:"]
