"""`volutectl test` against a real systemd and real git worktrees, inside a container.

Each run's command writes its own start and end times (date +%s%N) to a file, so the
overlap checks rest on what the commands saw, not on what volutectl says it did.
"""

from __future__ import annotations

import json
import re
import select
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import pytest

from volute_testbed.machine import Machine

pytestmark = pytest.mark.system

REPO = "/srv/repo"
WORKTREES = 4
T = TypeVar("T")


def make_repository(machine: Machine) -> None:
    script = [
        f"git init -q {REPO}",
        f"git -C {REPO} -c user.email=t@example.org -c user.name=t commit -q --allow-empty -m i",
    ]
    script += [f"git -C {REPO} worktree add -q /srv/wt{i}" for i in range(1, WORKTREES + 1)]
    machine.sh(" && ".join(script))


def timed_command(name: str, seconds: float) -> list[str]:
    """A command that logs its own start and end, in nanoseconds since the epoch."""
    log = f"/srv/log-{name}"
    return [
        "sh",
        "-c",
        f"echo start $(date +%s%N) >> {log}; sleep {seconds}; echo end $(date +%s%N) >> {log}",
    ]


def start_run(
    machine: Machine,
    worktree: str,
    argv: Sequence[str],
    *,
    options: Sequence[str] = ("--json",),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    line = f"cd {worktree} && exec volutectl test {shlex.join(options)} -- {shlex.join(argv)}"
    return machine.popen(
        ["sh", "-c", line], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, dict[str, object], str]:
    out, err = proc.communicate(timeout=timeout)
    result = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    return proc.returncode, result, err


def intervals(machine: Machine, names: Sequence[str]) -> list[tuple[int, int]]:
    spans = []
    for name in names:
        lines = machine.host_path(f"/srv/log-{name}").read_text().split()
        stamps = dict(zip(lines[::2], map(int, lines[1::2]), strict=True))
        spans.append((stamps["start"], stamps["end"]))
    return spans


def most_at_once(spans: Sequence[tuple[int, int]]) -> int:
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, step in edges:  # an end sorts before a start at the same instant
        running += step
        peak = max(peak, running)
    return peak


def live_scopes(machine: Machine) -> list[str]:
    out = machine.run(
        ["systemctl", "list-units", "--plain", "--no-legend", "--state=active", "volute-test-*"]
    ).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def wait_for(predicate: Callable[[], T], timeout: float = 15, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def read_line(proc: subprocess.Popen[str], timeout: float = 15) -> str:
    assert proc.stderr is not None
    ready, _, _ = select.select([proc.stderr], [], [], timeout)
    assert ready, "no line on stderr in time"
    return proc.stderr.readline()


def test_cap_one_serializes_three_worktrees(machine: Machine) -> None:
    make_repository(machine)
    env = {"VOLUTE_TESTS__CONCURRENT_RUNS": "1"}
    # The first run holds the slot until both others wait for it: on a loaded machine the
    # three need not start together, and one that started late waited less (issue 19).
    release = "until [ -e /srv/release ]; do sleep 0.02; done; "
    held = timed_command("wt1", 0.4)
    first = start_run(machine, "/srv/wt1", [*held[:2], release + held[2]], env=env)
    wait_for(lambda: live_scopes(machine), what="the first run's scope")
    others = [
        start_run(machine, f"/srv/wt{i}", timed_command(f"wt{i}", 0.4), env=env) for i in (2, 3)
    ]
    for proc in others:
        assert "waiting for a test slot" in read_line(proc)
    machine.run(["touch", "/srv/release"])
    results = [finish(proc) for proc in [first, *others]]
    assert [code for code, _, _ in results] == [0, 0, 0], [err for _, _, err in results]
    assert {result["cap_source"] for _, result, _ in results} == {
        "tests.concurrent_runs (env VOLUTE_TESTS__CONCURRENT_RUNS)"
    }
    assert most_at_once(intervals(machine, ["wt1", "wt2", "wt3"])) == 1
    waited = sorted(int(result["waited_ms"]) for _, result, _ in results)  # type: ignore[call-overload]
    assert waited[-1] >= 400  # the last one queued behind the first and a run of 0.4 s
    for _, result, _ in results:
        assert result["duration_ms"] >= result["waited_ms"] + result["execution_ms"]  # type: ignore[operator]
        assert result["execution_ms"] >= 400  # type: ignore[operator]


def test_cap_two_from_git_config_runs_two_never_three(machine: Machine) -> None:
    make_repository(machine)
    # Set from one worktree, read from all: it lives in the common config.
    machine.run(["git", "-C", "/srv/wt3", "config", "volute.testSlots", "2"])
    runs = [
        start_run(machine, f"/srv/wt{i}", timed_command(f"wt{i}", 0.6))
        for i in range(1, WORKTREES + 1)
    ]
    results = [finish(proc) for proc in runs]
    assert [code for code, _, _ in results] == [0] * WORKTREES, [err for _, _, err in results]
    assert {result["cap"] for _, result, _ in results} == {2}
    assert {result["cap_source"] for _, result, _ in results} == {"git config volute.testSlots"}
    names = [f"wt{i}" for i in range(1, WORKTREES + 1)]
    assert most_at_once(intervals(machine, names)) == 2


@pytest.mark.serial
def test_sigkill_of_the_holder_frees_the_slot_promptly(machine: Machine) -> None:
    make_repository(machine)
    holder = start_run(machine, "/srv/wt1", ["sleep", "60"], options=["--slots", "1"])
    scope = wait_for(lambda: live_scopes(machine), what="the holder's scope")[0]
    holder_pid = int(scope.rsplit("-", 1)[1].removesuffix(".scope"))
    waiter = start_run(
        machine,
        "/srv/wt2",
        ["sh", "-c", "date +%s%N > /srv/waiter-started"],
        options=["--slots", "1", "--json"],
    )
    assert "waiting for a test slot" in read_line(waiter)
    # SIGKILL of volutectl alone: the command inherited the slot and still holds it.
    machine.run(["kill", "-KILL", str(holder_pid)])
    holder.wait(timeout=10)
    time.sleep(0.5)
    assert not machine.host_path("/srv/waiter-started").exists()
    # Killing the whole run frees it.
    machine.sh(f"date +%s%N > /srv/killed; systemctl kill --signal=SIGKILL {scope}")
    started_path = machine.host_path("/srv/waiter-started")
    wait_for(lambda: started_path.exists() and started_path.read_text().strip(), what="waiter")
    killed = int(machine.host_path("/srv/killed").read_text())
    latency_ms = (int(started_path.read_text()) - killed) / 1e6
    print(f"SIGKILL of the run -> next waiter's command started: {latency_ms:.1f} ms")
    assert latency_ms < 1000
    code, result, _ = finish(waiter)
    assert code == 0
    assert result["scope"] and result["slot"] == f"{REPO}/.git/volute/test-slots/slot-1"


def test_wait_line_names_the_in_flight_run(machine: Machine) -> None:
    make_repository(machine)
    code, _, _ = finish(start_run(machine, "/srv/wt2", ["true"], options=["--slots", "1"]))
    assert code == 0  # leaves history behind for the estimate
    holder = start_run(machine, "/srv/wt1", ["sleep", "60"], options=["--slots", "1"])
    scope = wait_for(lambda: live_scopes(machine), what="the holder's scope")[0]
    time.sleep(1.1)  # so "running for" has something to say
    waiter = start_run(machine, "/srv/wt2", ["true"], options=["--slots", "1", "--json"])
    line = read_line(waiter)
    assert "1 run at a time in /srv/repo/.git" in line
    assert re.search(r"in flight: /srv/wt1 `sleep 60` for [1-9]\.\ds;", line), line
    assert re.search(r"a run typically takes \d+\.\ds", line), line
    machine.run(["systemctl", "stop", scope])
    holder.wait(timeout=10)
    code, result, err = finish(waiter)
    assert code == 0
    assert (line + err).count("waiting for a test slot") == 1  # once, calmly
    wait = result["wait"]
    assert isinstance(wait, dict)
    assert wait["cap"] == 1 and wait["typical_ms"] is not None
    assert [(run["unit"], run["worktree"], run["command"]) for run in wait["in_flight"]] == [
        (scope, "/srv/wt1", "sleep 60")
    ]
    assert wait["in_flight"][0]["running_seconds"] >= 1.1
    assert result["waited_ms"] > 0  # type: ignore[operator]


def test_nested_runs_do_not_deadlock(machine: Machine) -> None:
    make_repository(machine)
    inner = "volutectl test --slots 1 --json -- sh -c 'cat /proc/self/cgroup >&2'"
    proc = start_run(machine, "/srv/wt1", ["sh", "-c", inner], options=["--slots", "1", "--json"])
    code, outer_result, err = finish(proc, timeout=30)
    assert code == 0, err
    # The inner run's JSON went to the outer command's stdout, i.e. our stderr.
    inner_result = json.loads(next(line for line in err.splitlines() if line.startswith("{")))
    assert inner_result["nested"] is True and inner_result["exit_status"] == 0
    # ... and it stayed in the outer run's scope.
    assert f"/{outer_result['scope']}" in err


def test_unusable_slot_directory_fails_open_with_one_notice(machine: Machine) -> None:
    make_repository(machine)
    machine.sh(f"mkdir -p {REPO}/.git/volute && echo x > {REPO}/.git/volute/test-slots")
    code, result, err = finish(
        start_run(machine, "/srv/wt1", ["true"], options=["--slots", "1", "--json"])
    )
    assert code == 0
    assert result["slot"] is None and result["scope"]
    notices = [line for line in err.splitlines() if line.strip()]
    assert len(notices) == 1, err
    assert "test-slots" in notices[0] and "running without the test-run cap" in notices[0]


def test_scope_sits_in_the_tests_slice_with_its_weights(machine: Machine) -> None:
    make_repository(machine)
    env = {"VOLUTE_TESTS__CPU_WEIGHT": "30", "VOLUTE_TESTS__IO_WEIGHT": "40"}
    wait_go = "while [ ! -e /srv/go ]; do sleep 0.02; done; exit 7"
    proc = start_run(machine, "/srv/wt1", ["sh", "-c", wait_go], options=["--slots", "1"], env=env)
    scope = wait_for(lambda: live_scopes(machine), what="the scope")[0]
    assert scope.startswith("volute-test-wt1-")
    shown = machine.run(
        ["systemctl", "show", "-p", "Slice,CPUWeight,IOWeight,Description,CollectMode", scope]
    ).stdout
    props = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
    assert props["Slice"] == "volute-tests.slice"
    assert props["CPUWeight"] == "30" and props["IOWeight"] == "40"
    assert props["Description"] == f"volutectl test in /srv/wt1: sh -c {shlex.quote(wait_go)}"
    assert props["CollectMode"] == "inactive-or-failed"
    machine.run(["touch", "/srv/go"])
    assert proc.wait(timeout=15) == 7  # the command's own status
    wait_for(lambda: not live_scopes(machine), what="the scope to go")


def test_sigterm_stops_the_whole_run(machine: Machine) -> None:
    make_repository(machine)
    proc = start_run(
        machine, "/srv/wt1", ["sh", "-c", "sleep 300 & sleep 300"], options=["--slots", "1"]
    )
    scope = wait_for(lambda: live_scopes(machine), what="the scope")[0]
    pid = int(scope.rsplit("-", 1)[1].removesuffix(".scope"))
    machine.run(["kill", "-TERM", str(pid)])
    assert proc.wait(timeout=15) == 143
    wait_for(lambda: not live_scopes(machine), what="the scope to stop")
    assert machine.run(["pgrep", "-f", "sleep 300"], check=False).returncode == 1
    # The slot is free again.
    code, _, _ = finish(start_run(machine, "/srv/wt2", ["true"], options=["--slots", "1"]), 10)
    assert code == 0


def test_another_user_runs_in_their_own_manager_or_as_a_plain_child(machine: Machine) -> None:
    machine.run(["useradd", "--create-home", "tester"])
    # /root is 0700 and the venv's interpreter lives under it; this chmod lands in the
    # container's overlay only.
    machine.run(["chmod", "711", "/root"])
    machine.run(["sh", "-c", "mkdir /srv/mine && chown tester: /srv/mine"])
    home = {"HOME": "/home/tester"}
    machine.run(["git", "init", "-q", "/srv/mine"], user="tester", env=home)
    machine.run(["loginctl", "enable-linger", "tester"])
    uid = machine.run(["id", "-u", "tester"]).stdout.strip()
    runtime = f"/run/user/{uid}"
    wait_for(
        lambda: machine.run(["test", "-S", f"{runtime}/bus"], check=False).returncode == 0,
        what="the user's manager and bus",
    )

    def run_as_tester(env: dict[str, str]) -> tuple[int, dict[str, object], str]:
        script = (
            "cd /srv/mine && "
            "volutectl test --slots 1 --json -- sh -c 'id -un; cat /proc/self/cgroup'"
        )
        proc = machine.run(["sh", "-c", script], user="tester", env=env, check=False)
        return proc.returncode, json.loads(proc.stdout.splitlines()[-1]), proc.stderr

    code, result, err = run_as_tester({**home, "XDG_RUNTIME_DIR": runtime})
    assert code == 0, err
    assert result["manager"] == "user"
    assert f"user@{uid}.service/volute.slice/volute-tests.slice/{result['scope']}" in err
    assert result["slot"] == "/srv/mine/.git/volute/test-slots/slot-1"

    # No bus to reach: a plain child, with one line saying so.
    code, result, err = run_as_tester(home)
    assert code == 0 and result["manager"] is None and result["scope"] is None
    notices = [line for line in err.splitlines() if line.startswith("volutectl test:")]
    assert len(notices) == 1 and "plain child" in notices[0]

    # A slot directory this user may not write fails open (root would bypass this).
    machine.run(["sh", "-c", "rm -r /srv/mine/.git/volute && mkdir -m 755 /srv/mine/.git/volute"])
    code, result, err = run_as_tester({**home, "XDG_RUNTIME_DIR": runtime})
    assert code == 0 and result["slot"] is None and result["scope"]
    notices = [line for line in err.splitlines() if line.startswith("volutectl test:")]
    assert len(notices) == 1
    assert "Permission denied" in notices[0] and "running without the test-run cap" in notices[0]
