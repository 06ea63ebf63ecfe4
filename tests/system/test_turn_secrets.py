"""Minds apart from each other and from the socket (issue 18, finding 6), in a real systemd
with the real units, attacked as the turn's own user.

On 98e6a5e the default turn user, `volute`, was in group `volute`, which may read
/etc/volute/volutectl.toml (root:volute 0640, as the package installs it): a default-user
turn read every mind's `environment` (an API key) from the config, and could use the
gate's socket. A mind's secret had nowhere else to go.
"""

from __future__ import annotations

import shlex

import pytest

from volute_testbed.gate import (
    VOLUTECTL,
    all_settled,
    deliver,
    gate_config,
    gate_events,
    queue_rows,
    start_gate,
    wait_for,
)
from volute_testbed.machine import Machine
from volute_testbed.paths import PYTHON
from volutectl.config.settings import Settings

pytestmark = pytest.mark.system

CONFIG = "/etc/volute/volutectl.toml"
SOCKET = "/run/volute/gate.sock"
SECRETS = "/etc/volute/minds"
OUT = "/var/tmp/secrets"
ALPHA_KEY = "sk-alpha-5f1e0c"

CONNECT = shlex.quote(f"import socket; socket.socket(socket.AF_UNIX).connect({SOCKET!r})")
# A turn command: what the turn can see and reach, as its own user, into OUT/<mind>.
PROBE = rf"""#!/bin/sh
out={OUT}/$VOLUTE_MIND
try() {{ if "$@" >/dev/null 2>&1; then echo yes; else echo no; fi; }}
{{
  echo "user $(id -un)"
  echo "groups $(id -Gn)"
  echo "ALPHA_KEY ${{ALPHA_KEY-unset}}"
  echo "ALPHA_PUBLIC ${{ALPHA_PUBLIC-unset}}"
  echo "read-config $(try cat {CONFIG})"
  echo "read-alpha-env $(try cat {SECRETS}/alpha.env)"
  echo "python $(try {PYTHON} -c pass)"
  echo "connect-socket $(try {PYTHON} -c {CONNECT})"
}} > $out.tmp && mv $out.tmp $out
"""


def install_probe(machine: Machine) -> None:
    machine.write("/usr/local/bin/secrets-probe", PROBE, mode=0o755)
    machine.run(["install", "-d", "-m", "1777", OUT])


def as_packaged(machine: Machine) -> None:
    """The config as the package leaves it (postinst): root:volute-admin 0640 (root:volute
    0640 before roles, issue 22: a turn of the default user read neither)."""
    machine.run(["chgrp", "volute-admin", CONFIG])
    machine.run(["chmod", "0640", CONFIG])


def probed(machine: Machine, mind: str) -> dict[str, str]:
    path = machine.host_path(f"{OUT}/{mind}")
    wait_for(path.exists, timeout=30)
    return dict(line.split(" ", 1) for line in path.read_text().splitlines())


def test_a_default_user_turn_reads_neither_the_config_nor_the_socket(machine: Machine) -> None:
    install_probe(machine)
    # alpha's API key where 0.1 had it go: the config. beta runs as the default user.
    config = gate_config({"beta": "secrets-probe"})
    config += f'[minds.alpha]\ncommand = "true"\nenvironment = {{ API_KEY = "{ALPHA_KEY}" }}\n'
    start_gate(machine, config)
    as_packaged(machine)
    default_user = Settings().turns.default_user
    deliver(machine, "beta", "probe")
    seen = probed(machine, "beta")
    assert seen["user"] == default_user
    assert (seen["read-config"], seen["python"], seen["connect-socket"]) == ("no", "yes", "no")
    assert "volute" not in seen["groups"].split()
    # The same, straight from a shell of that user (what any process of a turn can do).
    attack = machine.run(["cat", CONFIG], user=default_user, check=False)
    assert attack.returncode != 0 and "Permission denied" in attack.stderr
    assert ALPHA_KEY not in attack.stdout
    attack = machine.run([VOLUTECTL, "deliver", "alpha", "-m", "x"], user=default_user, check=False)
    assert attack.returncode != 0
    wait_for(lambda: all_settled(machine), timeout=30)
    assert [row["mind"] for row in queue_rows(machine, "done")] == ["beta"]


def test_a_minds_secret_reaches_its_own_turns_alone(machine: Machine) -> None:
    install_probe(machine)
    machine.run(["useradd", "-r", "-U", "-M", "-d", "/nonexistent", "minda"])
    machine.run(["install", "-d", "-m", "0700", SECRETS])
    machine.write(f"{SECRETS}/alpha.env", f"# alpha's key\nALPHA_KEY={ALPHA_KEY}\n", mode=0o600)
    machine.write(f"{SECRETS}/gamma.env", "GAMMA_KEY=sk-gamma\n", mode=0o640)  # open
    config = gate_config({"beta": "secrets-probe"}) + (
        '[minds.alpha]\ncommand = "secrets-probe"\nuser = "minda"\n'
        'environment = { ALPHA_PUBLIC = "public", ALPHA_KEY = "overridden" }\n'
        f'environment_file = "{SECRETS}/alpha.env"\n'
        '[minds.gamma]\ncommand = "secrets-probe"\n'
        f'environment_file = "{SECRETS}/gamma.env"\n'
    )
    start_gate(machine, config)
    as_packaged(machine)

    # Preflight says beforehand which file is refused, and why.
    check = machine.run([VOLUTECTL, "config", "check"], check=False)
    assert check.returncode == 78, check.stdout + check.stderr
    assert f"fail: environment file {SECRETS}/gamma.env: is open to group or others" in (
        check.stdout
    )

    for mind in ("alpha", "beta", "gamma"):
        deliver(machine, mind, "probe")
    alpha = probed(machine, "alpha")
    assert alpha["user"] == "minda"
    assert alpha["ALPHA_KEY"] == ALPHA_KEY  # the file's value, over the config's
    assert alpha["ALPHA_PUBLIC"] == "public"
    beta = probed(machine, "beta")
    assert beta["ALPHA_KEY"] == "unset" and beta["ALPHA_PUBLIC"] == "unset"
    assert beta["read-alpha-env"] == "no" and beta["read-config"] == "no"
    # A default-user shell can't read alpha's file either.
    attack = machine.run(
        ["cat", f"{SECRETS}/alpha.env"], user=Settings().turns.default_user, check=False
    )
    assert attack.returncode != 0 and ALPHA_KEY not in attack.stdout

    # gamma's file is open to group volute: its turn does not start, and the gate says why.
    refused = f"environment file {SECRETS}/gamma.env: is open to group or others"
    wait_for(
        lambda: bool(
            gate_events(
                machine, "VOLUTE_EVENT=end", "VOLUTE_OUTCOME=start_failed", "VOLUTE_MIND=gamma"
            )
        ),
        timeout=30,
    )
    assert not machine.host_path(f"{OUT}/gamma").exists()
    [row] = [row for row in queue_rows(machine) if row["mind"] == "gamma"]
    assert refused in str(row["last_error"])
