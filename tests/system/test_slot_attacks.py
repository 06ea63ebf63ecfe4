"""Issue 18, findings 7, 8c, 8d and 9a: the attacks on the test slots, made as the users
who made them, against the real gate in a container.

- bob is in group `volute` (he may use the gate's socket) and attacks others through it;
- alice is the victim: a user with a repository of her own, outside group `volute`;
- carol is any other local user, in no group of theirs.

Each attack is made the way it was reported (issue 18), and each test fails on 98e6a5e.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time

import pytest

from volute_testbed.gate import (
    VOLUTECTL,
    gate_config,
    gate_events,
    journal,
    start_gate,
    status,
    wait_for,
)
from volute_testbed.machine import Machine
from volute_testbed.paths import CHECKOUT, PYTHON

pytestmark = pytest.mark.system

ALICE_REPO = "/srv/alice/repo"
BOB = "/srv/bob"

# One request on the gate's socket, as a group member's own program would send it.
REGISTER = r"""
import json, socket, sys, time
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(60)
sock.connect("/run/volute/gate.sock")
started = time.monotonic()
sock.sendall(json.dumps({"v": 1, "op": "register_repo", "path": sys.argv[1]}).encode() + b"\n")
reply = json.loads(sock.makefile("rb").readline())
reply["seconds"] = time.monotonic() - started
print(json.dumps(reply))
"""


def add_users(machine: Machine) -> dict[str, int]:
    """alice and carol, and bob in group volute; each with a directory under /srv."""
    machine.run(["groupadd", "-f", "-r", "volute"])
    uids = {}
    for name, groups in (("alice", []), ("bob", ["-G", "volute"]), ("carol", [])):
        machine.run(["useradd", "--create-home", *groups, name])
        machine.run(["install", "-d", "-o", name, "-g", name, "-m", "755", f"/srv/{name}"])
        uids[name] = int(machine.run(["id", "-u", name]).stdout)
    machine.write("/var/tmp/register.py", REGISTER)
    return uids


def as_user(machine: Machine, user: str, script: str, check: bool = True) -> str:
    home = {"HOME": f"/home/{user}", "GIT_CONFIG_NOSYSTEM": "1"}
    return machine.run(["sh", "-c", script], user=user, env=home, check=check).stdout


def git_repo(machine: Machine, user: str, path: str) -> None:
    as_user(
        machine,
        user,
        f"git init -q {path} && git -C {path} -c user.email=t@example.org -c user.name=t "
        "commit -q --allow-empty -m i",
    )


def register_as(machine: Machine, user: str, path: str) -> dict[str, object]:
    out = machine.run([PYTHON, "/var/tmp/register.py", path], user=user, timeout=120).stdout
    reply: dict[str, object] = json.loads(out)
    return reply


def watched(machine: Machine) -> dict[str, dict[str, object]]:
    runs = status(machine)["test_runs"]
    assert isinstance(runs, list)
    return {str(entry["repository"]): entry for entry in runs}


def registry(machine: Machine) -> str:
    path = machine.host_path("/var/lib/volute/repositories.json")
    return path.read_text() if path.exists() else ""


def gate_pid(machine: Machine) -> int:
    return int(machine.run(["systemctl", "show", "-P", "MainPID", "volute-gate.service"]).stdout)


def test_a_commondir_to_another_users_repository_is_refused_and_not_kept(
    machine: Machine,
) -> None:
    """Finding 7: bob's own git dir, whose commondir (or .git file) names alice's."""
    uids = add_users(machine)
    start_gate(machine, gate_config({"a": "true"}))
    git_repo(machine, "alice", ALICE_REPO)
    as_user(
        machine,
        "bob",
        f"for d in {BOB}/fake.git {BOB}/wt; do mkdir -p $d/objects $d/refs && "
        "echo 'ref: refs/heads/main' > $d/HEAD; done && "
        f"echo {ALICE_REPO}/.git > {BOB}/fake.git/commondir && "
        f"echo 'gitdir: {ALICE_REPO}/.git' > {BOB}/wt/.git",
    )
    for path in (f"{BOB}/fake.git", f"{BOB}/wt"):
        reply = register_as(machine, "bob", path)
        assert (reply["ok"], reply["code"]) == (False, 65), reply
        assert f"leads to {ALICE_REPO}/.git, which belongs to uid {uids['alice']}" in str(
            reply["error"]
        )
    assert f"{ALICE_REPO}/.git" not in watched(machine)
    assert "alice" not in registry(machine)
    # A repository of bob's own is registered as before.
    git_repo(machine, "bob", f"{BOB}/mine")
    assert register_as(machine, "bob", f"{BOB}/mine/.git")["ok"] is True
    assert watched(machine)[f"{BOB}/mine/.git"]["slots_held"] == 0
    assert f"{BOB}/mine/.git" in registry(machine)


def test_a_sparse_2gb_git_file_is_refused_at_once_with_bounded_memory(machine: Machine) -> None:
    """Finding 8d: a 2 GB sparse `.git` took the gate from 133 MB to 4.26 GB."""
    add_users(machine)
    start_gate(machine, gate_config({"a": "true"}))
    as_user(
        machine,
        "bob",
        f"mkdir -p {BOB}/big/objects {BOB}/big/refs && echo 'ref: refs/heads/main' > "
        f"{BOB}/big/HEAD && truncate -s 2G {BOB}/big/.git",
    )
    pid = gate_pid(machine)
    before = peak_kib(machine, pid)
    reply = register_as(machine, "bob", f"{BOB}/big")
    assert (reply["ok"], reply["code"]) == (False, 65), reply
    assert "larger than 4096 bytes" in str(reply["error"])
    assert float(reply["seconds"]) < 2.0  # type: ignore[arg-type]
    grew_mib = (peak_kib(machine, pid) - before) / 1024
    print(f"\ngate's peak memory grew {grew_mib:.1f} MiB for a 2 GB sparse .git")
    assert grew_mib < 32
    assert gate_pid(machine) == pid  # the same gate, still serving
    assert status(machine)["test_runs"] == []


def peak_kib(machine: Machine, pid: int) -> int:
    text = machine.run(["cat", f"/proc/{pid}/status"]).stdout
    match = re.search(r"^VmHWM:\s+(\d+) kB", text, re.MULTILINE)
    assert match, text
    return int(match.group(1))


def inotify_watches(machine: Machine, pid: int) -> int:
    """Every inotify watch the gate's process holds, from /proc/PID/fdinfo."""
    script = f"cat /proc/{pid}/fdinfo/* 2>/dev/null | grep -c '^inotify wd:' || true"
    return int(machine.run(["sh", "-c", script]).stdout.strip() or 0)


SLOT_FILES = 20_000


@pytest.mark.serial
def test_a_repository_full_of_slot_files_costs_one_watch_and_a_fast_restart(
    machine: Machine,
) -> None:
    """Finding 8c: 145,000 slot files took one root inotify watch each, and a restart
    outlasted TimeoutStartSec. 20,000 here (the old gate took 20,001 watches for them):
    the gate takes one watch per repository, counts slot-1 .. slot-256, and says once
    that there are more."""
    add_users(machine)
    start_gate(machine, gate_config({"a": "true"}))
    git_repo(machine, "bob", f"{BOB}/repo")
    # bob's own `volutectl test` registers the repository, as any run does.
    as_user(machine, "bob", f"cd {BOB}/repo && {VOLUTECTL} test --slots 1 -- true")
    common = f"{BOB}/repo/.git"
    wait_for(lambda: common in watched(machine), timeout=20)
    as_user(
        machine,
        "bob",
        f"{PYTHON} -c 'import os\nfor i in range(2, {SLOT_FILES + 1}): "
        f'os.close(os.open("{common}/volute/test-slots/slot-%d" % i, os.O_CREAT | os.O_RDONLY))\'',
    )
    started = time.monotonic()
    machine.run(["systemctl", "restart", "volute-gate.service"], timeout=120)
    restart_s = time.monotonic() - started
    print(f"\nrestart with {SLOT_FILES} slot files: {restart_s:.2f} s")
    assert restart_s < 10
    pid = gate_pid(machine)
    assert inotify_watches(machine, pid) == 1
    entry = watched(machine)[common]
    assert (entry["slots"], entry["slots_held"]) == (256, 0)
    assert entry["problem"] == "slot files past slot-256 are not counted"
    # A run still holds and frees a slot, seen by the gate.
    holder = hold_a_slot(machine, "bob", f"{BOB}/repo")
    wait_for(lambda: watched(machine)[common]["slots_held"] == 1, timeout=20)
    release(machine, holder)
    wait_for(lambda: watched(machine)[common]["slots_held"] == 0, timeout=20)
    said = gate_events(machine, "VOLUTE_EVENT=slots_past_cap", f"VOLUTE_REPOSITORY={common}")
    assert [entry["VOLUTE_MAX_SLOT_FILES"] for entry in said] == ["256", "256"]
    # once by each gate: the one that saw them made, the restarted one
    assert "Traceback" not in journal(machine)


def test_an_outsider_cannot_open_or_lock_a_slot(machine: Machine) -> None:
    """Finding 9a: slot files were 0644, so anyone's flock on one held runs (and, through
    the gate, turns with reason test_run). A slot file made before, 0644, is tightened
    by its owner's next run."""
    add_users(machine)
    git_repo(machine, "alice", ALICE_REPO)
    slot_dir = f"{ALICE_REPO}/.git/volute/test-slots"
    as_user(
        machine,
        "alice",
        f"mkdir -p {slot_dir} && touch {slot_dir}/slot-1 && chmod 644 {slot_dir}/slot-1",
    )
    as_user(machine, "alice", f"cd {ALICE_REPO} && volutectl test --slots 2 -- true")
    modes = machine.run(
        ["stat", "-c", "%a %U %G %n", slot_dir, f"{slot_dir}/slot-1", f"{slot_dir}/slot-2"]
    )
    assert modes.stdout.split("\n")[:3] == [
        f"755 alice alice {slot_dir}",
        f"660 alice alice {slot_dir}/slot-1",
        f"660 alice alice {slot_dir}/slot-2",
    ]
    for name in ("slot-1", "slot-2"):
        attempt = machine.run(
            ["flock", "-n", f"{slot_dir}/{name}", "true"], user="carol", check=False
        )
        assert attempt.returncode != 0
        assert "Permission denied" in attempt.stderr
        made = machine.run(["touch", f"{slot_dir}/slot-3"], user="carol", check=False)
        assert made.returncode != 0  # nor make a slot of its own
    # Alice herself still takes her slots, as before.
    holder = hold_a_slot(machine, "alice", ALICE_REPO)
    wait_for(
        lambda: (
            machine.run(["flock", "-n", f"{slot_dir}/slot-1", "true"], check=False).returncode != 0
        ),
        timeout=20,
    )
    release(machine, holder)


def hold_a_slot(machine: Machine, user: str, checkout: str) -> subprocess.Popen[str]:
    """`volutectl test --slots 1` as `user`, holding its slot until release()."""
    machine.run(["rm", "-f", "/var/tmp/release"])
    wait = "while [ ! -e /var/tmp/release ]; do sleep 0.05; done"
    line = f"cd {checkout} && exec {VOLUTECTL} test --slots 1 -- sh -c {shlex.quote(wait)}"
    return machine.popen(
        ["runuser", "-u", user, "--", "sh", "-c", line],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def release(machine: Machine, holder: subprocess.Popen[str]) -> None:
    machine.run(["touch", "/var/tmp/release"])
    assert holder.wait(timeout=30) == 0


# The gate's slot watch, run as the gate's own unprivileged user would run it (issue 18
# splits the gate; its socket side runs as `volute-gate`, with ProtectHome=read-only).
WATCH_AS_GATE = r"""
import json, sys
from pathlib import Path
from volutectl.slots.watch import SlotWatch

said = []
watch = SlotWatch([Path(p) for p in sys.argv[1:]], Path("/var/tmp/gate-registry.json"),
                  lambda event: said.append(event.journal_fields()))
print(json.dumps({"events": said, "status": watch.status([])}))
"""


def test_a_gate_that_may_not_look_says_so(machine: Machine) -> None:
    """A repository in a private home is one the unprivileged gate cannot watch: `status`
    and the journal say "cannot watch REPO: permission denied", and no more."""
    add_users(machine)
    machine.run(["useradd", "--system", "--no-create-home", "volute-gate"])
    machine.run(["chmod", "700", "/home/alice"])
    git_repo(machine, "alice", "/home/alice/private")
    git_repo(machine, "alice", ALICE_REPO)  # outside the home: readable, so watched
    machine.write("/var/tmp/watch-as-gate.py", WATCH_AS_GATE)
    out = machine.run(
        [PYTHON, "/var/tmp/watch-as-gate.py", "/home/alice/private", ALICE_REPO],
        user="volute-gate",
        env={"PYTHONPATH": str(CHECKOUT)},
    ).stdout
    seen = json.loads(out)
    by_repository = {entry["repository"]: entry for entry in seen["status"]}
    private = by_repository["/home/alice/private"]
    assert (private["slots_held"], private["problem"]) == (None, "permission denied")
    assert seen["events"] == [
        {
            "repository": "/home/alice/private",
            "problem": "permission denied",
            "user": "volute-gate",
            "event": "repository_unwatchable",
        }
    ]
    public = by_repository[f"{ALICE_REPO}/.git"]
    assert (public["slots_held"], public["problem"]) == (0, None)
