"""Issue 29, findings 3 and 4: what a turn or a member wrote reaches root's terminal as
text, never as control; and a member's `status` names other minds without their paths.

Made as reported, in a real systemd with the real units: a turn prints a line that
erases its own prefix and writes a gate line in its place, then an OSC that retitles the
window; a member registers a repository whose path holds escapes; a member reads
`status --json` while a mind with a private command and working directory fails
preflight. `volutectl` runs as a user runs it, under a pseudo-terminal (what a terminal
would get, byte for byte: click passes escapes to a terminal and strips only some of
them from a pipe) and piped. Each test fails on 4bb6e7b.
"""

from __future__ import annotations

import base64
import json

import pytest

from volute_testbed.gate import VOLUTECTL, deliver, start_gate, status, wait_for
from volute_testbed.machine import Machine
from volute_testbed.paths import PYTHON

pytestmark = pytest.mark.system

# ARGV under a pseudo-terminal, as an admin's shell runs it: prints, as JSON, the exit
# status and every byte the terminal got (base64).
UNDER_PTY = r"""
import base64, json, os, pty, sys
pid, fd = pty.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
got = b""
while True:
    try:
        chunk = os.read(fd, 65536)
    except OSError:
        break
    if not chunk:
        break
    got += chunk
status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps({"status": status, "out": base64.b64encode(got).decode()}))
"""
# Erases the line so far (the real `evil/main turn 1:` prefix) and writes a gate line;
# then retitles the window (OSC 0) and writes the clipboard (OSC 52).
FORGED_LINE = r"x\r\033[2K2099-01-01 00:00:00 gate: turn 9 of root/main ended: exit 0"
TITLE_LINE = r"\033]0;TITLE\007\033]52;c;ZXZpbA==\007"
# What a terminal would obey: C0 but the line ends, DEL, C1 (as UTF-8 text).
OBEYED = {chr(code) for code in (*range(32), *range(0x7F, 0xA0))} - {"\n"}
MEMBER = "deliverer"


def on_terminal(machine: Machine, *argv: str, user: str | None = None) -> tuple[int, str]:
    """`argv` under a pseudo-terminal in the machine: its exit status, and what the
    terminal got, with the pty's own line ends (\\r\\n) made \\n."""
    machine.write("/var/tmp/under_pty.py", UNDER_PTY)
    done = machine.run([PYTHON, "/var/tmp/under_pty.py", *argv], user=user)
    result = json.loads(done.stdout)
    text = base64.b64decode(result["out"]).decode(errors="surrogateescape")
    return result["status"], text.replace("\r\n", "\n")


def turn_lines(machine: Machine) -> list[str]:
    """The lines of evil's turn 1 in the journal, as it wrote them (journalctl gives a
    line that holds control characters as a list of bytes)."""
    argv = ["journalctl", "-u", "volute-turn-evil-1.scope", "-o", "json", "_TRANSPORT=stdout"]
    found = []
    for line in machine.run(argv).stdout.splitlines():
        message = json.loads(line)["MESSAGE"]
        found.append(bytes(message).decode() if isinstance(message, list) else message)
    return found


def obeyed(text: str) -> list[str]:
    return sorted({char for char in text if char in OBEYED})


def test_a_turns_escapes_reach_volutectl_logs_as_text_on_a_terminal_and_piped(
    machine: Machine,
) -> None:
    command = f"printf '{FORGED_LINE}\\n{TITLE_LINE}\\n'"
    start_gate(machine, f"[minds.evil]\ncommand = {json.dumps(command)}\n")
    assert deliver(machine, "evil", "go", "--wait") > 0
    # The journal holds the turn's bytes as it wrote them.
    wait_for(lambda: "\033]0;TITLE\007\033]52;c;ZXZpbA==\007" in turn_lines(machine), timeout=10)
    assert "x\r\033[2K2099-01-01 00:00:00 gate: turn 9 of root/main ended: exit 0" in turn_lines(
        machine
    )

    for argv in (["logs", "evil"], ["logs", "evil", "--turn", "1"]):
        code, shown = on_terminal(machine, VOLUTECTL, *argv)
        piped = machine.run([VOLUTECTL, *argv]).stdout
        for text in (shown, piped):
            assert code == 0 and obeyed(text) == [], (argv, text)
            lines = text.splitlines()
            # Each line of the turn's is there, its real prefix with it, the escapes shown.
            assert [line for line in lines if line.endswith(
                r"evil/main turn 1: x\r\x1b[2K2099-01-01 00:00:00 gate: turn 9 of root/main "
                "ended: exit 0"
            )], text  # fmt: skip
            assert [line for line in lines if line.endswith(
                r"evil/main turn 1: \x1b]0;TITLE\a\x1b]52;c;ZXZpbA==\a"
            )], text  # fmt: skip


REGISTER = r"""
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(60)
sock.connect("/run/volute/gate.sock")
sock.sendall(json.dumps({"v": 1, "op": "register_repo", "path": sys.argv[1]}).encode() + b"\n")
print(sock.makefile("rb").readline().decode(), end="")
"""
# A directory of the member's, closed to the gate: it erases the status line, writes
# one of its own on a line of its own, and retitles root's window.
EVIL_NAME = "x\r\033[2Kpreflight: all is well\033]0;TITLE\007\nqueue: forged\x9b"
EVIL_SHOWN = r"x\r\x1b[2Kpreflight: all is well\x1b]0;TITLE\a\nqueue: forged\x9b"


def test_a_members_path_reaches_roots_status_as_text_on_a_terminal_and_piped(
    machine: Machine,
) -> None:
    start_gate(machine, '[minds.m]\ncommand = "true"\n')
    machine.run(["useradd", "-M", "-G", "volute", MEMBER])
    machine.run(["install", "-d", "-o", MEMBER, "-m", "0700", "/srv/bob"])
    path = f"/srv/bob/{EVIL_NAME}"
    machine.run(["install", "-d", "-o", MEMBER, path])
    machine.write("/var/tmp/register.py", REGISTER)
    reply = machine.run([PYTHON, "/var/tmp/register.py", path], user=MEMBER).stdout
    # Kept, with its problem (the gate may not enter /srv/bob): status lists it.
    assert path in [entry["repository"] for entry in status(machine)["test_runs"]], reply

    code, shown = on_terminal(machine, VOLUTECTL, "status")
    piped = machine.run([VOLUTECTL, "status"]).stdout
    for text in (shown, piped):
        assert code == 0 and obeyed(text) == [], text
        line = f"test slots: cannot watch /srv/bob/{EVIL_SHOWN}: permission denied"
        assert line in text.splitlines(), text
        # The newline in the path made no line of the status's own.
        assert not [line for line in text.splitlines() if line.startswith("queue: forged")]
    # --json stays exact: JSON's escapes are safe, and say what the member sent.
    exact = json.loads(machine.run([VOLUTECTL, "status", "--json"]).stdout)
    assert path in [entry["repository"] for entry in exact["test_runs"]]


# A mind whose command and working directory are the admin's business: its working
# directory does not exist, so preflight fails and names it.
PRIVATE = """
[minds.alpha]
command = ["/opt/alpha-secret/bin/agent", "--key-file", "/etc/alpha-secret/key"]
working_directory = "/srv/alpha-private/work"

[minds.beta]
command = "true"
"""


def test_a_members_status_holds_no_other_minds_command_or_working_directory(
    machine: Machine,
) -> None:
    start_gate(machine, PRIVATE)
    machine.run(["useradd", "-M", "-G", "volute", MEMBER])
    # As the package leaves it: the config is root:volute-admin 0640, closed to members.
    machine.run(["chgrp", "volute-admin", "/etc/volute/volutectl.toml"])
    machine.run(["chmod", "0640", "/etc/volute/volutectl.toml"])
    secrets = ("/opt/alpha-secret", "/etc/alpha-secret", "/srv/alpha-private")

    # Root sees why alpha cannot start: the working directory, by its path.
    wait_for(lambda: "alpha" in status(machine)["preflight"], timeout=10)
    whole = machine.run([VOLUTECTL, "status", "--json"]).stdout
    assert "/srv/alpha-private/work" in whole, whole

    seen = machine.run([VOLUTECTL, "status", "--json"], user=MEMBER).stdout
    assert not [secret for secret in secrets if secret in seen], seen
    member = json.loads(seen)
    assert sorted(member["minds"]) == ["alpha", "beta"]  # every mind's name and counts
    assert list(member["preflight"]) == ["alpha"]  # that it fails, not why
    text = machine.run([VOLUTECTL, "status"], user=MEMBER).stdout
    assert not [secret for secret in secrets if secret in text], text
    assert "preflight: mind alpha cannot start turns: withheld" in text, text
