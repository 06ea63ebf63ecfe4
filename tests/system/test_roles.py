"""Roles (issue 22, item 1), in a real systemd with the real units, as real users.

A member of group `volute` delivers, but is refused with 77 what changes others' work
(pause, queue drop, retry), sees only its own queue entries, and cannot read a mind's
environment by any path: the config file, `config show`, or /proc while that mind's
turn runs. A member of `volute-admin` may pause. The turn itself gets its secret from
its environment_file.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from volute_testbed.gate import VOLUTECTL, deliver, gate_config, start_gate, wait_for
from volute_testbed.machine import Machine
from volute_testbed.paths import PYTHON

pytestmark = pytest.mark.system

CONFIG = "/etc/volute/volutectl.toml"
SECRETS = "/etc/volute/minds"
OUT = "/var/tmp/roles"
SECRET = "sk-roles-9b3e71d2"
INLINE = "inline-7c0ffee"
MEMBER, ADMIN = "deliverer", "overseer"

# alpha's turn: proves it got its secret (a digest, never the secret, where others may
# look), then stays until told to go, so that /proc can be read while it runs.
TURN = rf"""#!/bin/sh
printf %s "$ALPHA_KEY" | sha256sum | cut -d' ' -f1 > {OUT}/alpha.sum.tmp
mv {OUT}/alpha.sum.tmp {OUT}/alpha.sum
i=0
while [ ! -e {OUT}/go ] && [ $i -lt 900 ]; do sleep 0.1; i=$((i+1)); done
"""
# Every /proc/PID/cmdline and environ this user may read; the secret comes on stdin (in
# argv, the scan would find it in its own cmdline). Prints: files read, then the hits.
SCAN = r"""
import os, sys
secrets = [line.encode() for line in sys.stdin.read().split()]
read, hits = 0, []
for pid in filter(str.isdigit, os.listdir("/proc")):
    for name in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        read += 1
        hits += [f"{pid}/{name}" for secret in secrets if secret in data]
print(read, *hits)
"""


def volutectl(machine: Machine, user: str, *args: str) -> tuple[int, str]:
    done = machine.run(["runuser", "-u", user, "--", VOLUTECTL, *args], check=False, timeout=90)
    return done.returncode, done.stdout + done.stderr


def test_a_member_delivers_but_may_not_change_others_work_nor_read_a_secret(
    machine: Machine,
) -> None:
    machine.run(["useradd", "-r", "-U", "-M", "-d", "/nonexistent", "minda"])
    machine.write("/usr/local/bin/roles-turn", TURN, mode=0o755)
    machine.run(["install", "-d", "-m", "1777", OUT])
    machine.run(["install", "-d", "-m", "0700", SECRETS])
    machine.write(f"{SECRETS}/alpha.env", f"ALPHA_KEY={SECRET}\n", mode=0o600)
    config = gate_config({"beta": "true"}) + (
        '[minds.alpha]\ncommand = "roles-turn"\nuser = "minda"\n'
        f'environment = {{ ALPHA_MODE = "{INLINE}" }}\n'
        f'environment_file = "{SECRETS}/alpha.env"\n'
    )
    start_gate(machine, config)  # makes the groups, as the package's sysusers does
    machine.run(["useradd", "-M", "-G", "volute", MEMBER])
    machine.run(["useradd", "-M", "-G", "volute,volute-admin", ADMIN])
    # As the package leaves it (postinst): root:volute-admin 0640.
    machine.run(["chgrp", "volute-admin", CONFIG])
    machine.run(["chmod", "0640", CONFIG])

    # Root's delivery, which the member may neither see nor drop.
    roots = deliver(machine, "beta", "root's")
    code, out = volutectl(machine, MEMBER, "deliver", "beta", "-m", "mine")
    assert code == 0, out
    mine = int(out.split()[0])
    states = [f"--state={state}" for state in ("pending", "running", "done")]
    listed = machine.run([VOLUTECTL, "queue", "list", "--json", *states], user=MEMBER)
    assert [row["id"] for row in json.loads(listed.stdout)] == [mine]
    every = machine.run([VOLUTECTL, "queue", "list", "--json", *states], user=ADMIN)
    assert sorted(row["id"] for row in json.loads(every.stdout)) == [roots, mine]

    # 77, with the group to join, for what changes others' work; nothing changed.
    for argv in (("pause",), ("pause", "alpha"), ("queue", "drop", str(mine))):
        code, out = volutectl(machine, MEMBER, *argv)
        assert code == 77, (argv, out)
        assert "volute-admin" in out, out
    code, out = volutectl(machine, MEMBER, "queue", "retry", str(roots))
    assert code == 77, out

    # The secret: the turn has it, from its environment_file.
    deliver(machine, "alpha", "go")
    digest = machine.host_path(f"{OUT}/alpha.sum")
    wait_for(digest.exists, timeout=30)
    assert digest.read_text().strip() == hashlib.sha256(SECRET.encode()).hexdigest()
    # The member reads it by no path while that turn runs: not the config, not `config
    # show`, not the environment file, not /proc.
    for path in (CONFIG, f"{SECRETS}/alpha.env"):
        attack = machine.run(["cat", path], user=MEMBER, check=False)
        assert attack.returncode != 0 and SECRET not in attack.stdout + attack.stderr
    for argv in (("config", "show"), ("config", "show", "--json"), ("config", "check")):
        code, out = volutectl(machine, MEMBER, *argv)
        assert code == 77, (argv, out)
        assert SECRET not in out and INLINE not in out and "volute-admin" in out
    assert not machine.host_path(f"{OUT}/go").exists()  # the turn still runs
    scan = machine.run(
        ["runuser", "-u", MEMBER, "--", PYTHON, "-I", "-S", "-c", SCAN],
        input=f"{SECRET}\n{INLINE}\n",
    )
    read, *hits = scan.stdout.split()
    assert hits == [] and int(read) > 10, scan.stdout
    # The same scan as root finds the turn's environment: the scan could fail.
    as_root = machine.run([PYTHON, "-I", "-S", "-c", SCAN], input=f"{SECRET}\n")
    assert any(hit.endswith("/environ") for hit in as_root.stdout.split()[1:]), as_root.stdout

    # An admin may pause (the member's pauses changed nothing), and resume; its `config
    # show` names the environment file, never its lines.
    code, out = volutectl(machine, ADMIN, "pause", "alpha")
    assert (code, out.strip()) == (0, "paused alpha")
    code, out = volutectl(machine, ADMIN, "resume", "alpha")
    assert code == 0, out
    code, out = volutectl(machine, ADMIN, "config", "show")
    assert code == 0, out
    assert f"{SECRETS}/alpha.env" in out and SECRET not in out
    # config check warns of the inline environment, by name, not by value.
    code, out = volutectl(machine, ADMIN, "config", "check")
    assert "ALPHA_MODE" in out and "environment_file" in out and INLINE not in out, out
    machine.run(["touch", f"{OUT}/go"])
