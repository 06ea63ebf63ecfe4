"""Each turn's own log, against a real systemd and journald: the scope's stream, the gate's
MESSAGE_IDs, one entry per multi-line message, and `volutectl logs`.

Each test boots its own systemd and runs the real volute-gate.service from this checkout;
what it checks comes from journalctl, not from the gate.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from volute_testbed.gate import VOLUTECTL, all_settled, deliver, start_gate, wait_for
from volute_testbed.machine import Machine
from volute_testbed.paths import PYTHON
from volutectl.events import MESSAGE_IDS, EventName

pytestmark = pytest.mark.system

# Two minds: one runs as the packaged system user (volute, a system uid: the system
# journal), one with a dash in its name (escaped in its unit name) as a regular user
# (uid 1500: journald keeps its entries in a journal file of that user's).
CONFIG = """
[minds.mimsy]
command = 'echo "out of turn $VOLUTE_TURN_ID"; echo "err of turn $VOLUTE_TURN_ID" >&2'

[minds.m-1]
command = 'echo "m-1 says $VOLUTE_TURN_ID"'
user = "mindone"
"""


def entries(machine: Machine, *args: str) -> list[dict[str, Any]]:
    out = machine.run(["journalctl", "--no-pager", "-o", "json", *args], check=False).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def messages(machine: Machine, *args: str) -> list[str]:
    return [str(entry.get("MESSAGE")) for entry in entries(machine, *args)]


def logs(machine: Machine, *args: str, check: bool = True) -> Any:
    return machine.run([VOLUTECTL, "logs", *args], check=check)


def without_time(text: str) -> list[str]:
    """`volutectl logs` lines without their 'YYYY-MM-DD HH:MM:SS ' stamps."""
    return [line[20:] if line[:1].isdigit() else line for line in text.splitlines()]


def test_a_turns_output_is_its_scopes_own_journal_stream(machine: Machine) -> None:
    machine.run(["useradd", "-u", "1500", "-m", "mindone"])
    start_gate(machine, CONFIG)
    assert deliver(machine, "mimsy", "one", "--session", "chat", "--wait") > 0
    assert deliver(machine, "m-1", "two", "--wait") > 0
    scope = "volute-turn-mimsy-1.scope"
    wait_for(lambda: len(messages(machine, "-u", scope)) >= 2, timeout=10)

    # journalctl -u shows exactly the turn's output (stdout and stderr, in order), and
    # the entries say whose they are: the scope, the mind's identifier, its user.
    output = [e for e in entries(machine, "-u", scope) if e.get("_TRANSPORT") == "stdout"]
    assert [e["MESSAGE"] for e in output] == ["out of turn 1", "err of turn 1"]
    for entry in output:
        assert entry["_SYSTEMD_UNIT"] == scope
        assert entry["SYSLOG_IDENTIFIER"] == "volute-mimsy"
        # The slice only when journald could still read the writer's cgroup: a turn this
        # short may have exited first, and then only the header's unit is there
        # (launcher.py's docstring); journald then sends no _SYSTEMD_CGROUP either.
        if "_SYSTEMD_CGROUP" in entry:
            assert entry["_SYSTEMD_SLICE"] == "volute-turns.slice"
        assert entry["_UID"] == machine.run(["id", "-u", "volute-turn"]).stdout.strip()
    other = r"volute-turn-m\x2d1-2.scope"
    wait_for(lambda: messages(machine, f"_SYSTEMD_UNIT={other}") == ["m-1 says 2"], timeout=10)
    [entry] = entries(machine, "-t", "volute-m-1")
    assert (entry["_SYSTEMD_UNIT"], entry["_UID"]) == (other, "1500")
    # None of it in the gate's own journal any more.
    gate = messages(machine, "-u", "volute-gate.service")
    assert any("turn 1 of mimsy/chat started" in m for m in gate)
    assert not [m for m in gate if "of turn" in m or "says" in m]

    # volutectl logs: the mind's turns, each line with its turn and session.
    shown = without_time(logs(machine, "mimsy").stdout)
    assert "mimsy/chat turn 1: out of turn 1" in shown
    assert "mimsy/chat turn 1: err of turn 1" in shown
    assert any(line.startswith("gate: turn 1 of mimsy/chat started") for line in shown)
    assert not [line for line in shown if "m-1 says" in line]
    # --since: a second turn, in another session, after a point in time.
    time.sleep(1.1)
    since = f"@{int(time.time())}"
    time.sleep(1.1)
    assert deliver(machine, "mimsy", "three", "--session", "dm", "--wait") > 0
    wait_for(lambda: "out of turn 3" in logs(machine, "mimsy").stdout, timeout=10)
    later = without_time(logs(machine, "mimsy", "--since", since).stdout)
    assert "mimsy/dm turn 3: out of turn 3" in later
    assert not [line for line in later if "turn 1" in line]
    # One turn, with its session; and m-1's, found under its escaped scope name.
    one = without_time(logs(machine, "mimsy", "--turn", "3").stdout)
    assert one[0] == "-- turn 3 of mimsy, session dm (volute-turn-mimsy-3.scope)"
    assert "mimsy/dm turn 3: err of turn 3" in one
    assert not [line for line in one if "turn 1" in line]
    assert "m-1/main turn 2: m-1 says 2" in without_time(logs(machine, "m-1", "--turn", "2").stdout)
    # Errors: a turn that never ran, a turn of another mind, a mind that is not configured.
    never = logs(machine, "mimsy", "--turn", "99", check=False)
    assert never.returncode == 65 and "turn 99 of mimsy never ran" in never.stderr
    theirs = logs(machine, "mimsy", "--turn", "2", check=False)
    assert theirs.returncode == 65 and "turn 2 was m-1's" in theirs.stderr
    assert logs(machine, "nobody", check=False).returncode == 67


def test_a_turns_stream_outlives_a_sigkill_of_the_gate(machine: Machine) -> None:
    command = "echo before; while [ ! -e /run/volute/go ]; do sleep 0.05; done; echo after-the-kill"
    start_gate(machine, f"[minds.m]\ncommand = '{command}'\n")
    deliver(machine, "m", "x")
    scope = "volute-turn-m-1.scope"
    wait_for(lambda: messages(machine, "-u", scope, "_TRANSPORT=stdout") == ["before"])
    old = machine.run(["systemctl", "show", "-P", "MainPID", "volute-gate.service"]).stdout
    machine.run(["systemctl", "kill", "--signal=SIGKILL", "volute-gate.service"])
    wait_for(lambda: machine.run(["systemctl", "show", "-P", "MainPID", "volute-gate.service"])
             .stdout not in (old, "0\n"), timeout=30)  # fmt: skip
    machine.run(["touch", "/run/volute/go"])
    wait_for(lambda: all_settled(machine), timeout=30)
    wait_for(lambda: len(messages(machine, "-u", scope, "_TRANSPORT=stdout")) == 2, timeout=10)
    assert messages(machine, "-u", scope, "_TRANSPORT=stdout") == ["before", "after-the-kill"]
    assert "after-the-kill" not in "\n".join(messages(machine, "-u", "volute-gate.service"))
    shown = without_time(logs(machine, "m", "--turn", "1").stdout)
    assert shown[0] == "-- turn 1 of m, session main (volute-turn-m-1.scope)"
    assert "m/main turn 1: after-the-kill" in shown


def test_a_turns_stream_outlives_a_restart_of_journald(machine: Machine) -> None:
    # journald keeps its streams' fds in its fd store across a restart: the turn goes on
    # writing to the same stream, under its own unit, and is not killed by a broken pipe.
    command = "echo before; while [ ! -e /run/volute/go ]; do sleep 0.05; done; echo after"
    start_gate(machine, f"[minds.m]\ncommand = '{command}'\n")
    deliver(machine, "m", "x")
    scope = "volute-turn-m-1.scope"
    wait_for(lambda: messages(machine, "-u", scope, "_TRANSPORT=stdout") == ["before"])
    old = machine.run(["systemctl", "show", "-P", "MainPID", "systemd-journald"]).stdout
    machine.run(["systemctl", "restart", "systemd-journald"])
    assert machine.run(["systemctl", "show", "-P", "MainPID", "systemd-journald"]).stdout != old
    machine.run(["touch", "/run/volute/go"])
    wait_for(lambda: all_settled(machine), timeout=30)
    wait_for(lambda: len(messages(machine, "-u", scope, "_TRANSPORT=stdout")) == 2, timeout=10)
    assert messages(machine, "-u", scope, "_TRANSPORT=stdout") == ["before", "after"]
    [ended] = entries(machine, f"MESSAGE_ID={MESSAGE_IDS[EventName.END]}", "VOLUTE_MIND=m")
    assert (ended["VOLUTE_OUTCOME"], ended["VOLUTE_EXIT_STATUS"]) == ("ok", "0")


TIMEOUT_CONFIG = """
[limits]
global_concurrent_turns = 1
[limits.adaptive]
enabled = false
[turns]
timeout_grace_seconds = 1
[gate]
max_attempts = 1
[minds.slow]
command = "sleep 60"
max_runtime_seconds = 1
[minds.quick]
command = "true"
"""

PROBE = """
from volutectl.systemd.journal import EventName, Journal
Journal("volute-probe").log(
    "warning", "first line\\nMESSAGE_ID=00000000000000000000000000000000\\nVOLUTE_MIND=forged",
    event=EventName.DEAD, mind="real",
)
"""


@pytest.mark.serial
def test_the_gates_entries_carry_message_ids_and_a_multi_line_message_is_one_entry(
    machine: Machine,
) -> None:
    start_gate(machine, TIMEOUT_CONFIG)
    deliver(machine, "slow", "x")
    wait_for(lambda: bool(entries(machine, f"MESSAGE_ID={MESSAGE_IDS[EventName.START]}")))
    deliver(machine, "quick", "held behind the cap of 1")
    wait_for(lambda: all_settled(machine), timeout=30)
    for event, mind in [(EventName.HOLD, "quick"), (EventName.START, "slow"),
                        (EventName.END, "quick"), (EventName.TIMEOUT, "slow"),
                        (EventName.DEAD, "slow")]:  # fmt: skip
        found = entries(machine, f"MESSAGE_ID={MESSAGE_IDS[event]}", f"VOLUTE_MIND={mind}")
        assert found, event
        assert {e["VOLUTE_EVENT"] for e in found} == {event.value}
        assert {e["SYSLOG_IDENTIFIER"] for e in found} == {"volute-gate"}
    [ended] = entries(machine, f"MESSAGE_ID={MESSAGE_IDS[EventName.END]}", "VOLUTE_MIND=slow")
    assert (ended["VOLUTE_OUTCOME"], ended["VOLUTE_SESSION"]) == ("timeout", "main")

    # The journal module itself, in a service (stderr is the journal): a message with
    # newlines is one entry, and none of its lines becomes a field.
    machine.run(["systemd-run", "--wait", "--quiet", "--unit=volute-probe", PYTHON, "-c", PROBE])
    wait_for(lambda: bool(entries(machine, "-t", "volute-probe")), timeout=10)
    [entry] = entries(machine, "-t", "volute-probe")
    assert entry["MESSAGE"] == (
        "first line\nMESSAGE_ID=00000000000000000000000000000000\nVOLUTE_MIND=forged"
    )
    assert (entry["MESSAGE_ID"], entry["VOLUTE_MIND"]) == (MESSAGE_IDS[EventName.DEAD], "real")
    assert entry["PRIORITY"] == "4" and entry["_SYSTEMD_UNIT"] == "volute-probe.service"


class Lines:
    """A pipe's lines as they come, each with the time it came, read by a thread of its
    own (so the times are when the follower printed them, whatever the test is doing).

    Read with os.read on the descriptor, a chunk at a time. A select() and then a
    buffered readline() takes a whole chunk and returns one line; the rest waits in
    Python's buffer where select() cannot see it. On a loaded machine, where the
    follower's lines come several to a chunk, the old reader waited for lines it
    already had (issue 19)."""

    def __init__(self, stream: Any) -> None:
        import os
        import threading

        self.fd = os.dup(stream.fileno())  # its own: the test may close the pipe first
        self.seen: list[tuple[float, str]] = []
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        import os

        rest = b""
        try:
            while chunk := os.read(self.fd, 1 << 16):
                *lines, rest = (rest + chunk).split(b"\n")
                now = time.time()
                self.seen += [(now, line.decode(errors="replace")) for line in lines]
        finally:
            os.close(self.fd)
            self.ended.set()

    def texts(self) -> list[str]:
        return [text for _, text in list(self.seen)]

    def until(self, wanted: str, timeout: float = 20) -> list[str]:
        """The lines so far, once one contains `wanted`."""
        deadline = time.monotonic() + timeout
        while not any(wanted in text for text in self.texts()):
            assert time.monotonic() < deadline, f"{wanted!r} never came; saw {self.texts()}"
            assert not self.ended.is_set(), f"the follower ended before {wanted!r}"
            time.sleep(0.05)
        return self.texts()


def test_logs_follow_shows_each_new_turn_as_it_runs(machine: Machine) -> None:
    # `volutectl logs MIND --follow` against a real journald: started before any turn,
    # it prints each turn's output as it comes, turn after turn, and only that mind's.
    import subprocess

    machine.run(["useradd", "-u", "1500", "-m", "mindone"])
    start_gate(machine, CONFIG)
    follower = machine.popen(
        [VOLUTECTL, "logs", "mimsy", "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=1,
    )
    try:
        lines = Lines(follower.stdout)
        time.sleep(1.0)  # journalctl is reading the journal's tail
        assert follower.poll() is None, follower.communicate()
        assert deliver(machine, "mimsy", "one", "--session", "chat", "--wait") > 0
        first = without_time("\n".join(lines.until("out of turn 1")))
        assert "mimsy/chat turn 1: out of turn 1" in first
        assert deliver(machine, "m-1", "two", "--wait") > 0  # another mind's: not shown
        assert deliver(machine, "mimsy", "three", "--session", "dm", "--wait") > 0
        later = without_time("\n".join(lines.until("err of turn 3")))
        assert "mimsy/dm turn 3: out of turn 3" in later
        assert not [line for line in first + later if "m-1 says" in line]
        assert follower.poll() is None  # still following
    finally:
        follower.terminate()
        follower.wait(timeout=10)


# mimsy prints to stdout and stderr (its scope's stream) and logs five lines through
# syslog with its own identifier: logger exits at once, often before journald reads its
# cgroup, and then journald records no unit for that line. Even-numbered turns take a
# while; the others exit at once. m-1 (another user) prints its own lines and also logs
# one under mimsy's identifier, which is not mimsy's.
LOADED = """
[minds.mimsy]
command = '''
echo "out $VOLUTE_TURN_ID"; echo "err $VOLUTE_TURN_ID" >&2
for k in 1 2 3 4 5; do logger -t "volute-$VOLUTE_MIND" "logged $k of $VOLUTE_TURN_ID"; done
case $VOLUTE_TURN_ID in *[02468]) sleep 0.5;; esac
'''

[minds.m-1]
command = '''
echo "m-1 says $VOLUTE_TURN_ID"; logger -t volute-mimsy "m-1 posing as mimsy $VOLUTE_TURN_ID"
'''
user = "mindone"
"""

# Two CPU hogs and one that writes and syncs, for two minutes at most.
HOG = (
    "for i in 1 2; do timeout 120 python3 -c 'while 1: pass' & done; "
    "timeout 120 sh -c 'while :; do dd if=/dev/zero of=/var/tmp/hog bs=1M count=32 "
    "conv=fsync 2>/dev/null; done'; wait"
)


@pytest.mark.serial  # its two CPU hogs would starve the tests beside it
def test_logs_follow_on_a_loaded_machine_shows_every_line_of_the_mind_once(
    machine: Machine,
) -> None:
    import subprocess

    machine.run(["useradd", "-u", "1500", "-m", "mindone"])
    start_gate(machine, LOADED)
    machine.run(["systemd-run", "--unit=hog", "--quiet", "sh", "-c", HOG])
    follower = machine.popen(
        [VOLUTECTL, "logs", "mimsy", "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    lines = Lines(follower.stdout)
    try:
        # Its journalctl --follow runs: from here on, every new entry reaches it.
        following = ["pgrep", "-f", "journalctl.*--follow"]
        wait_for(lambda: machine.run(following, check=False).returncode == 0, timeout=60)
        for i in range(10):  # 20 turns, the two minds' interleaved
            deliver(machine, "mimsy", f"m{i}", "--session", f"s{i % 3}")
            deliver(machine, "m-1", f"o{i}")
        wait_for(lambda: all_settled(machine), timeout=120)
        ends = {
            int(e["VOLUTE_TURN_ID"]): int(e["__REALTIME_TIMESTAMP"]) / 1e6
            for e in entries(
                machine, f"MESSAGE_ID={MESSAGE_IDS[EventName.END]}", "VOLUTE_MIND=mimsy"
            )
        }
        assert len(ends) >= 4, ends  # batching may merge some, never all
        time.sleep(max(0.0, max(ends.values()) + 5 - time.time()))
    finally:
        follower.terminate()
        follower.wait(timeout=30)
        machine.run(["systemctl", "stop", "hog"], check=False)

    by_text: dict[str, list[float]] = {}
    for when, text in lines.seen:
        by_text.setdefault(text.split(": ", 1)[-1], []).append(when)
    for turn, ended in sorted(ends.items()):
        logged = [f"logged {k} of {turn}" for k in range(1, 6)]
        for text in [f"out {turn}", f"err {turn}", *logged]:
            times = by_text.get(text, [])
            assert len(times) == 1, (text, lines.texts())  # once: not lost, not twice
            assert times[0] <= ended + 5, (text, times[0] - ended)
    others = [t for t in lines.texts() if "m-1" in t or "posing" in t]
    assert not others, others
    # Each line names its turn: by its scope, or marked when journald could not tell.
    for text in lines.texts():
        assert text[20:].startswith(("gate: ", "mimsy/")), text


# A local user who is neither a mind's user nor in group volute sends what the gate and
# a turn send: a native entry with the gate's identifier and fields (and the trusted
# fields too, which journald drops from a client), and lines under the mind's
# identifier, through the native protocol, syslog, and a stream whose header names the
# turn's scope (journald takes a header's unit from root only).
FORGE = r"""
import socket, sys
from volutectl.events import MESSAGE_IDS, EventName
turn, session = sys.argv[1], sys.argv[2]
fields = {
    "MESSAGE": f"turn {turn} of mimsy/{session} started with deliveries 9",
    "MESSAGE_ID": MESSAGE_IDS[EventName.START], "SYSLOG_IDENTIFIER": "volute-gate",
    "VOLUTE_EVENT": "start", "VOLUTE_MIND": "mimsy", "VOLUTE_TURN_ID": turn,
    "VOLUTE_SESSION": session, "_SYSTEMD_UNIT": "volute-gate.service", "_UID": "0",
}
native = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
native.sendto("".join(f"{k}={v}\n" for k, v in fields.items()).encode(),
              "/run/systemd/journal/socket")
line = {"MESSAGE": f"forged native line {turn}", "SYSLOG_IDENTIFIER": "volute-mimsy",
        "_SYSTEMD_UNIT": f"volute-turn-mimsy-{turn}.scope", "_UID": "999"}
native.sendto("".join(f"{k}={v}\n" for k, v in line.items()).encode(),
              "/run/systemd/journal/socket")
stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
stream.connect("/run/systemd/journal/stdout")
stream.sendall(f"volute-mimsy\nvolute-turn-mimsy-{turn}.scope\n6\n0\n0\n0\n0\n".encode())
stream.sendall(f"forged stream line {turn}\n".encode())
"""


def test_a_local_users_forged_gate_entries_and_turn_lines_are_not_shown(
    machine: Machine,
) -> None:
    import subprocess

    machine.run(["useradd", "-u", "1600", "-m", "stranger"])
    start_gate(machine, CONFIG)
    assert deliver(machine, "mimsy", "one", "--session", "chat", "--wait") > 0

    def forge(turn: int, session: str) -> None:
        machine.run(["runuser", "-u", "stranger", "--", PYTHON, "-c", FORGE, str(turn), session])
        stranger = ["runuser", "-u", "stranger", "--"]
        machine.run([*stranger, "logger", "-t", "volute-mimsy", f"forged syslog line {turn}"])
        cat = ["systemd-cat", "-t", "volute-mimsy", "echo", f"forged systemd-cat line {turn}"]
        machine.run([*stranger, *cat])

    follower = machine.popen(
        [VOLUTECTL, "logs", "mimsy", "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    lines = Lines(follower.stdout)
    try:
        lines.until("out of turn 1")
        following = ["pgrep", "-f", "journalctl.*--follow"]
        wait_for(lambda: machine.run(following, check=False).returncode == 0, timeout=60)
        forge(1, "forged")
        forge(2, "forged")
        assert deliver(machine, "mimsy", "two", "--session", "dm", "--wait") > 0
        lines.until("err of turn 2")
        # The forged entries are in the journal, as sent by the stranger.
        forged = entries(machine, "VOLUTE_SESSION=forged")
        assert len(forged) == 2 and {e["_UID"] for e in forged} == {"1600"}, forged
        assert not [e for e in forged if "_SYSTEMD_UNIT" in e and "volute" in e["_SYSTEMD_UNIT"]]
        assert len(messages(machine, "-t", "volute-mimsy", "_UID=1600")) == 8
        time.sleep(1)  # anything still to come from the forged entries comes by now
    finally:
        follower.terminate()
        follower.wait(timeout=30)

    followed = without_time("\n".join(lines.texts()))
    shown = without_time(logs(machine, "mimsy").stdout)
    one = without_time(logs(machine, "mimsy", "--turn", "1").stdout)
    for seen in (followed, shown, one):
        assert not [line for line in seen if "forged" in line], seen
        assert "mimsy/chat turn 1: out of turn 1" in seen, seen
    assert one[0] == "-- turn 1 of mimsy, session chat (volute-turn-mimsy-1.scope)"
    assert "mimsy/dm turn 2: err of turn 2" in followed
    assert "mimsy/dm turn 2: err of turn 2" in shown


GATE_SAYS = """
import sys
from volutectl.systemd.journal import EventName, Journal
Journal("volute-gate").log("info", sys.argv[1], event=EventName.START, mind="mimsy",
                           session=sys.argv[2], turn_id=sys.argv[3])
"""


def test_the_gates_entries_count_from_the_gate_and_launcher_units_as_root_or_volute_gate(
    machine: Machine,
) -> None:
    # The units of the split gate (issue 18): volute-gate.service as user volute-gate,
    # volute-launcher.service as root. Run here as transient services that log as the
    # gate does; the same code in another unit, or as another user, is not the gate.
    machine.run(["useradd", "-r", "-M", "volute-gate"])
    machine.run(["useradd", "-u", "1600", "-m", "stranger"])
    machine.write("/etc/volute/volutectl.toml", CONFIG)
    runs = [
        ("volute-gate.service", "volute-gate", "gate as volute-gate", True),
        ("volute-launcher.service", "root", "launcher as root", True),
        ("volute-gate-x.service", "root", "another unit", False),
        ("volute-launcher.service", "stranger", "launcher as a stranger", False),
    ]
    for turn, (unit, user, said, _) in enumerate(runs, start=1):
        service = ["systemd-run", "--wait", "--quiet", f"--unit={unit}", "-p", f"User={user}"]
        machine.run([*service, PYTHON, "-c", GATE_SAYS, said, f"s{turn}", str(turn)])
        match = f"VOLUTE_SESSION=s{turn}"
        wait_for(lambda match=match: bool(entries(machine, match)), timeout=10)
    shown = without_time(logs(machine, "mimsy").stdout)
    assert shown == [f"gate: {said}" for _, _, said, trusted in runs if trusted]
    # A turn's session comes from the trusted start entry only.
    assert without_time(logs(machine, "mimsy", "--turn", "2").stdout)[0] == (
        "-- turn 2 of mimsy, session s2 (volute-turn-mimsy-2.scope)"
    )
    # The stranger's entry about turn 4 is no trace of it.
    never = logs(machine, "mimsy", "--turn", "4", check=False)
    assert never.returncode == 65 and "turn 4 of mimsy never ran" in never.stderr
