"""`volutectl doctor`: each probe against a fake /sys, /proc or cgroup tree in tmp_path,
real Unix sockets for the socket check, and the console script for exit codes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from volutectl.errors import EX_CONFIG, EX_OK, EX_UNAVAILABLE
from volutectl.host import doctor
from volutectl.host.doctor import Check
from volutectl.kernel.probes import existing_ancestor
from volutectl.launcher import preflight
from volutectl.states import AdaptiveMode
from volutectl.wire.messages import AdaptiveStatus

VOLUTECTL = Path(sys.executable).parent / "volutectl"
PI_CONTROLLERS = "cpuset cpu io pids"  # a stock Raspberry Pi: cgroup_disable=memory


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def cgroup_tree(root: Path, controllers: str, enabled: str = "", hybrid: bool = False) -> Path:
    v2 = root / "unified" if hybrid else root
    write(v2 / "cgroup.controllers", controllers + "\n")
    write(v2 / "cgroup.subtree_control", enabled + "\n")
    return root


def sys_tree(root: Path, disk: str, major: int, scheduler: str, partition: int | None = 2) -> Path:
    """/sys/dev/block/MAJ:MIN -> ../../devices/.../block/DISK[/DISKpN], like the kernel."""
    disk_dir = root / "devices" / "platform" / "soc" / "block" / disk
    write(disk_dir / "queue" / "scheduler", scheduler + "\n")
    write(disk_dir / "dev", f"{major}:0\n")
    target = disk_dir
    minor = 0
    if partition is not None:
        minor = partition
        target = disk_dir / f"{disk}p{partition}"
        write(target / "partition", f"{partition}\n")
        write(target / "dev", f"{major}:{minor}\n")
    links = root / "dev" / "block"
    links.mkdir(parents=True, exist_ok=True)
    (links / f"{major}:{minor}").symlink_to(os.path.relpath(target, links))
    return root


# -- cgroups -----------------------------------------------------------------------------


def test_unified_hierarchy_is_ok(tmp_path: Path) -> None:
    check = doctor.check_cgroup_version(cgroup_tree(tmp_path, PI_CONTROLLERS))
    assert check.status == "ok"
    assert "unified" in check.found


def test_hybrid_hierarchy_warns_that_weights_are_not_enforced(tmp_path: Path) -> None:
    check = doctor.check_cgroup_version(cgroup_tree(tmp_path, "", hybrid=True))
    assert check.status == "warn"
    assert "hybrid" in check.found
    assert "systemd.unified_cgroup_hierarchy=1" in check.change


def test_no_cgroup2_at_all_warns(tmp_path: Path) -> None:
    assert doctor.check_cgroup_version(tmp_path).status == "warn"
    assert doctor.check_controllers(tmp_path).status == "warn"


def test_stock_pi_controllers_say_memory_is_off_and_how_to_turn_it_on(tmp_path: Path) -> None:
    check = doctor.check_controllers(cgroup_tree(tmp_path, PI_CONTROLLERS, "cpu io pids"))
    assert check.status == "warn"
    assert "memory (MemoryHigh=, MemoryMax=)" in check.found
    assert "cpu (" not in check.found and "io (" not in check.found
    assert "enabled below the root: cpu io pids" in check.found
    assert "cgroup_enable=memory" in check.change
    assert "cmdline.txt" in check.change


def test_all_controllers_present_is_ok(tmp_path: Path) -> None:
    check = doctor.check_controllers(cgroup_tree(tmp_path, "cpuset cpu io memory hugetlb pids"))
    assert check.status == "ok"
    assert check.change == ""


def test_hybrid_controllers_point_at_the_cgroup_line(tmp_path: Path) -> None:
    check = doctor.check_controllers(cgroup_tree(tmp_path, "hugetlb", hybrid=True))
    assert check.status == "warn"
    assert "cpu (CPUWeight=)" in check.found
    assert "cgroup line" in check.change


# -- the IO scheduler ----------------------------------------------------------------------


def test_sd_card_with_mq_deadline_and_no_bfq(tmp_path: Path) -> None:
    sys_root = sys_tree(tmp_path / "sys", "mmcblk0", 179, "[mq-deadline] kyber none")
    check = doctor.check_io_scheduler(
        Path("/var/lib/volute"), device=(179, 2), sys_root=sys_root, cgroup_root=tmp_path
    )
    assert check.status == "warn"
    assert "on mmcblk0 (scheduler mq-deadline)" in check.found  # the disk, not the partition
    assert "IOWeight= has no effect" in check.found
    assert "caps (io.max) work" in check.found
    assert '["/dev/mmcblk0 8M"]' in check.change
    assert "no BFQ" in check.change


def test_bfq_available_but_not_chosen_suggests_a_udev_rule(tmp_path: Path) -> None:
    sys_root = sys_tree(tmp_path / "sys", "sda", 8, "[mq-deadline] bfq none", partition=1)
    check = doctor.check_io_scheduler(
        Path("/srv"), device=(8, 1), sys_root=sys_root, cgroup_root=tmp_path
    )
    assert check.status == "warn"
    assert 'KERNEL=="sda", ATTR{queue/scheduler}="bfq"' in check.change


def test_bfq_enforces_weights(tmp_path: Path) -> None:
    sys_root = sys_tree(tmp_path / "sys", "sda", 8, "mq-deadline [bfq] none", partition=None)
    check = doctor.check_io_scheduler(
        Path("/srv"), device=(8, 0), sys_root=sys_root, cgroup_root=tmp_path
    )
    assert check.status == "ok"
    assert "BFQ" in check.found


def test_iocost_enabled_on_the_disk_enforces_weights(tmp_path: Path) -> None:
    sys_root = sys_tree(tmp_path / "sys", "nvme0n1", 259, "[none] mq-deadline")
    cgroups = cgroup_tree(tmp_path / "cgroup", "cpu io memory pids")
    write(cgroups / "io.cost.qos", "259:0 enable=1 ctrl=auto rpct=0.00 rlat=250000\n")
    check = doctor.check_io_scheduler(
        Path("/srv"), device=(259, 2), sys_root=sys_root, cgroup_root=cgroups
    )
    assert check.status == "ok"
    assert "iocost" in check.found
    # iocost configured but disabled does not count.
    write(cgroups / "io.cost.qos", "259:0 enable=0 ctrl=auto\n")
    assert (
        doctor.check_io_scheduler(
            Path("/srv"), device=(259, 2), sys_root=sys_root, cgroup_root=cgroups
        ).status
        == "warn"
    )


def test_io_controller_off_means_no_io_control_at_all(tmp_path: Path) -> None:
    sys_root = sys_tree(tmp_path / "sys", "mmcblk0", 179, "[mq-deadline] none")
    check = doctor.check_io_scheduler(
        Path("/var/lib/volute"),
        device=(179, 2),
        sys_root=sys_root,
        cgroup_root=tmp_path,
        io_controller=False,
    )
    assert check.status == "warn"
    assert "neither IOWeight= nor io.max caps apply" in check.found


def test_state_dir_on_no_block_device(tmp_path: Path) -> None:
    (tmp_path / "sys" / "dev" / "block").mkdir(parents=True)
    check = doctor.check_io_scheduler(
        Path("/run/x"), device=(0, 42), sys_root=tmp_path / "sys", cgroup_root=tmp_path
    )
    assert check.status == "warn"
    assert "0:42" in check.found and "no block device" in check.found


def test_missing_state_dir_is_judged_by_its_nearest_existing_parent(tmp_path: Path) -> None:
    missing = tmp_path / "not" / "yet" / "there"
    assert existing_ancestor(missing) == tmp_path
    # The real device of tmp_path, looked up in a fake /sys that knows it as "disk0".
    st_dev = tmp_path.stat().st_dev
    major, minor = os.major(st_dev), os.minor(st_dev)
    sys_root = tmp_path / "sys"
    disk = write(sys_root / "devices" / "disk0" / "queue" / "scheduler", "[bfq] none\n")
    links = sys_root / "dev" / "block"
    links.mkdir(parents=True)
    (links / f"{major}:{minor}").symlink_to(disk.parent.parent)
    check = doctor.check_io_scheduler(missing, sys_root=sys_root, cgroup_root=tmp_path)
    assert check.status == "ok", check
    assert "is on disk0" in check.found


def test_parse_scheduler() -> None:
    assert doctor.parse_scheduler("none [mq-deadline] kyber bfq \n") == (
        "mq-deadline",
        ["none", "mq-deadline", "kyber", "bfq"],
    )
    assert doctor.parse_scheduler("none\n") == ("none", ["none"])


# -- PSI -------------------------------------------------------------------------------------


def test_psi_present(tmp_path: Path) -> None:
    write(tmp_path / "pressure" / "io", "some avg10=1.00 avg60=0.50 avg300=0.10 total=9\nfull x\n")
    check = doctor.check_psi(tmp_path)
    assert check.status == "ok"
    assert "some avg10=1.00" in check.found


def test_psi_missing(tmp_path: Path) -> None:
    check = doctor.check_psi(tmp_path)
    assert check.status == "warn"
    assert "CONFIG_PSI" in check.change


# -- reachability ----------------------------------------------------------------------------


def test_manager_unreachable_fails_with_69() -> None:
    check = doctor.check_manager(lambda: "cannot reach the system manager", "system")
    assert (check.status, check.exit_code) == ("fail", EX_UNAVAILABLE)
    assert doctor.check_manager(lambda: None, "system").status == "ok"


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "gate.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    try:
        yield path
    finally:
        server.close()


def test_socket_accepting(listening: Path) -> None:
    check = doctor.check_socket(listening)
    assert check.status == "ok"
    assert str(listening) in check.found


def test_socket_missing_says_start_the_gate(tmp_path: Path) -> None:
    check = doctor.check_socket(tmp_path / "gate.sock")
    assert check.status == "warn"
    assert "volute-gate" in check.change


def test_stale_socket(tmp_path: Path) -> None:
    path = tmp_path / "gate.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.close()  # the file stays, nobody listens
    check = doctor.check_socket(path)
    assert check.status == "warn"
    assert "stale" in check.found


# -- the socket unit: systemd holds the socket that clients look for ------------------------

GATE_SOCKET = Path("/run/volute/gate.sock")


def test_socket_unit_listening_where_the_config_says_is_ok() -> None:
    check = doctor.check_socket_unit(
        GATE_SOCKET, "loaded", "active", [("Stream", "/run/volute/gate.sock")]
    )
    assert check.status == "ok"
    assert "volute-gate.socket listens on /run/volute/gate.sock" in check.found


def test_socket_unit_elsewhere_than_the_config_names_both_and_says_which_wins() -> None:
    check = doctor.check_socket_unit(GATE_SOCKET, "loaded", "active", [("Stream", "/srv/g.sock")])
    assert check.status == "warn"
    assert "gate.socket is /run/volute/gate.sock" in check.found
    assert "the gate serves /srv/g.sock" in check.found
    assert 'gate.socket = "/srv/g.sock"' in check.change
    assert "ListenStream=/run/volute/gate.sock" in check.change
    assert check.exit_code == EX_OK  # advice: the gate still runs


@pytest.mark.parametrize(
    ("load", "active", "listen", "says"),
    [
        ("not-found", "inactive", [], "volute-gate.socket is not-found"),
        ("masked", "inactive", [], "volute-gate.socket is masked"),
        ("loaded", "inactive", [("Stream", "/run/volute/gate.sock")], "is inactive"),
        ("loaded", "failed", [("Stream", "/run/volute/gate.sock")], "is failed"),
        ("loaded", "active", [("Datagram", "/run/volute/gate.sock")], "exactly one ListenStream"),
        (
            "loaded",
            "active",
            [("Stream", "/run/volute/gate.sock"), ("Stream", "/run/other.sock")],
            "exactly one ListenStream",
        ),
    ],
)
def test_socket_unit_missing_stopped_or_odd_is_a_warning(
    load: str, active: str, listen: list[tuple[str, str]], says: str
) -> None:
    check = doctor.check_socket_unit(GATE_SOCKET, load, active, listen)
    assert check.status == "warn"
    assert says in check.found
    assert "volute-gate.socket" in check.change


# -- the report and exit codes --------------------------------------------------------------


def test_exit_code_prefers_config_then_manager() -> None:
    ok = Check("psi", "ok", "fine")
    config = Check("config", "fail", "bad", "fix", EX_CONFIG)
    manager = Check("manager", "fail", "down", "start", EX_UNAVAILABLE)
    advice = Check("socket", "warn", "missing", "start the gate")
    assert doctor.exit_code([ok, advice]) == EX_OK
    assert doctor.exit_code([ok, manager, advice]) == EX_UNAVAILABLE
    assert doctor.exit_code([manager, config]) == EX_CONFIG


def test_line_has_status_check_found_and_change() -> None:
    line = Check("psi", "warn", "missing", "use psi=1").line()
    assert line.split()[:2] == ["warn", "psi"]
    assert line.endswith("missing; change: use psi=1")
    assert "change" not in Check("psi", "ok", "present").line()


def volutectl(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("VOLUTE_")}
    env.update(extra)
    return subprocess.run(
        [str(VOLUTECTL), *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_invalid_config_exits_78_and_still_reports_the_host(tmp_path: Path) -> None:
    bad = write(tmp_path / "volutectl.toml", "[gate]\nbogus = 1\n")
    result = volutectl("doctor", "--json", "--config", str(bad))
    assert result.returncode == EX_CONFIG, result.stderr
    report = json.loads(result.stdout)
    assert report["exit_code"] == EX_CONFIG
    by_name = {check["check"]: check for check in report["checks"]}
    assert set(by_name) == {
        "config",
        "cgroup",
        "controllers",
        "io-scheduler",
        "psi",
        "psi-trigger",
        "manager",
        "socket",
        "socket-unit",
        "socket-access",
        "turn-cap",
        "adaptive",
    }  # and no mind: the defaults have none
    assert by_name["config"]["status"] == "fail"
    assert "gate.bogus" in by_name["config"]["found"]
    assert all(check["status"] in ("ok", "warn", "fail") for check in report["checks"])


def test_invalid_config_variable_exits_78_too(tmp_path: Path) -> None:
    """A bad VOLUTE_ variable is a config failure like a bad file, not an internal error
    (doctor's fallback to the defaults used to read the same variable again)."""
    good = write(tmp_path / "volutectl.toml", "[limits]\nturns_per_mind = 1\n")
    result = volutectl("doctor", "--json", "--config", str(good), VOLUTE_LIMITS__TURNS_PER_MIND="x")
    assert result.returncode == EX_CONFIG, result.stderr
    by_name = {check["check"]: check for check in json.loads(result.stdout)["checks"]}
    assert by_name["config"]["status"] == "fail"
    assert "(from env VOLUTE_LIMITS__TURNS_PER_MIND)" in by_name["config"]["found"]


def test_text_report_is_one_line_per_check(tmp_path: Path) -> None:
    good = write(tmp_path / "volutectl.toml", f'[gate]\nsocket = "{tmp_path}/gate.sock"\n')
    result = volutectl("doctor", "--config", str(good))
    lines = result.stdout.splitlines()
    assert [line.split()[1] for line in lines] == [
        "config",
        "cgroup",
        "controllers",
        "io-scheduler",
        "psi",
        "psi-trigger",
        "manager",
        "socket",
        "socket-unit",
        "socket-access",
        "turn-cap",
        "adaptive",
    ]
    assert lines[0].startswith("ok   config")
    assert f"{tmp_path}/gate.sock does not exist" in lines[7]
    manager_ok = lines[6].startswith("ok")
    assert result.returncode == (EX_OK if manager_ok else EX_UNAVAILABLE)


def test_psi_trigger_check_says_where_a_trigger_can_be_armed() -> None:
    from volutectl.host.doctor import check_psi_triggers

    none: dict[str, object] = {
        "slice_trigger": "no: the slice has no cgroup yet",
        "system_trigger": "no",
        "slice_path": "/s/io.pressure",
        "system_path": "/proc/pressure/io",
    }
    assert check_psi_triggers(none, enabled=True).status == "warn"
    assert check_psi_triggers(none, enabled=False).status == "ok"  # nothing asked of it
    coarse = dict(none, system_trigger="ok, 2 s windows only ('some 300000 2000000')")
    check = check_psi_triggers(coarse, enabled=True)
    assert check.status == "ok" and "2 s" in check.line() and "/proc/pressure/io" in check.line()
    assert "pressure gate on" in check.line()


# -- minds apart -------------------------------------------------------------------------


SHARED = "shares user 'volute-turn' with mind b: each can read ..."


def test_a_mind_not_kept_apart_is_a_warning_that_says_how_to_fix_it() -> None:
    report = preflight.MindReport("a", "volute-turn", (), ("a note",), (SHARED,))
    check = doctor.check_mind(report)
    assert (check.check, check.status, check.exit_code) == ("mind a", "warn", EX_OK)
    assert check.found == (
        f"{SHARED}; runs as volute-turn: user, command and working directory pass; a note"
    )
    assert check.change == preflight.APART_HINT
    assert doctor.exit_code([check]) == EX_OK  # advice: its turns still start


def test_a_failing_mind_keeps_its_warnings_and_fails() -> None:
    report = preflight.MindReport("a", "volute-turn", ("no such command",), (), (SHARED,))
    check = doctor.check_mind(report)
    assert (check.status, check.exit_code) == ("fail", EX_CONFIG)
    assert check.found == f"no such command; {SHARED}"


def test_a_mind_kept_apart_is_ok() -> None:
    check = doctor.check_mind(preflight.MindReport("a", "alice", (), ()))
    assert (check.status, check.change) == ("ok", "")


# -- the adaptive limit, as the running gate has it ------------------------------------------


def adaptive_status(mode: str, limit: int | None, reason: str | None) -> AdaptiveStatus:
    return AdaptiveStatus(
        mode=AdaptiveMode(mode), limit=limit, minimum=1, maximum=16, ceiling=None, reason=reason
    )


def test_adaptive_fallback_is_a_warning_that_names_the_failed_signal() -> None:
    why = "/proc/pressure/io cannot be read (not PSI text)"
    check = doctor.check_adaptive(adaptive_status("fallback", 2, why))
    assert check.status == "warn"
    assert "fell back to a static 2 turns" in check.found and why in check.found
    assert "psi" in check.change


def test_adaptive_measuring_or_off_is_ok_and_says_the_limit() -> None:
    check = doctor.check_adaptive(adaptive_status("adaptive", 5, "probe 3 ms: healthy"))
    assert check.status == "ok" and "is 5 turns at once (between 1 and 16)" in check.found
    off = doctor.check_adaptive(adaptive_status("static", None, None))
    assert off.status == "ok" and "off" in off.found


def test_adaptive_of_a_gate_out_of_reach_says_why(tmp_path: Path) -> None:
    status, problem = doctor.gate_adaptive(tmp_path / "gate.sock")
    assert status is None and problem is not None and "not running" in problem
    check = doctor.check_adaptive(status, problem)
    assert check.status == "warn" and "cannot ask the gate" in check.found


# -- cron and at: read as cron and at read them, with the line that keeps a user out --

CRON, AT = doctor.SCHEDULERS


def installed_programs(root: Path) -> list[Path]:
    bin_dir = root / "usr" / "bin"
    bin_dir.mkdir(parents=True)
    for program in ("crontab", "at"):
        write(bin_dir / program, "")
    return [bin_dir]


def keep_out(check: Check, etc: Path) -> None:
    """Run the line the check gives, as root would (here: the test's user, on its files)."""
    assert check.change.startswith("as root: "), check
    subprocess.run(["sh", "-c", check.change.removeprefix("as root: ")], check=True, cwd=etc)


@pytest.mark.parametrize(
    ("files", "cron_takes", "at_takes"),
    [
        ({}, True, False),  # Debian's cron: every user; at: root alone
        ({"cron.deny": "", "at.deny": ""}, True, True),  # an empty deny file refuses no one
        ({"cron.deny": "volute-turn\n", "at.deny": "daemon\nvolute-turn\n"}, False, False),
        ({"cron.deny": " volute-turn\n", "at.deny": "#volute-turn\n"}, True, True),  # whole lines
        ({"cron.allow": "volute-turn\n", "cron.deny": "volute-turn\n"}, True, False),  # allow first
        ({"cron.allow": "alice\n", "at.allow": "alice\n", "at.deny": ""}, False, False),
        ({"cron.deny": "daemon\nvolute-turn", "at.deny": "volute-turn"}, False, False),  # no \n
    ],
)
def test_cron_and_at_take_jobs_as_their_allow_and_deny_files_say(
    tmp_path: Path, files: dict[str, str], cron_takes: bool, at_takes: bool
) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    for name, text in files.items():
        write(etc / name, text)
    bins = installed_programs(tmp_path)
    for scheduler, takes in ((CRON, cron_takes), (AT, at_takes)):
        check = doctor.check_scheduler(scheduler, ["volute-turn", "root"], etc, bins)
        assert check.status == ("warn" if takes else "ok"), check
        if takes:
            assert "user(s) volute-turn (" in check.found  # root's jobs are always taken
            keep_out(check, etc)  # the line it gives works
            after = doctor.check_scheduler(scheduler, ["volute-turn"], etc, bins)
            assert after.status == "ok", (check, after)


def test_the_line_to_keep_users_out_is_exact() -> None:
    etc = Path("/etc")
    assert doctor.keep_out_line(CRON, ["a", "b.c"], etc / "cron.allow", etc) == (
        r"sed -i -e '/^a$/d' -e '/^b\.c$/d' /etc/cron.allow"
    )
    assert doctor.keep_out_line(CRON, ["volute-turn"], None, etc) == (
        r"printf '%s\n' volute-turn >> /etc/cron.deny"
    )


def test_a_deny_file_without_its_last_newline_gets_one_first(tmp_path: Path) -> None:
    write(tmp_path / "at.deny", "daemon")
    line = doctor.keep_out_line(AT, ["m1"], tmp_path / "at.deny", tmp_path)
    assert line == rf"printf '\n%s\n' m1 >> {tmp_path}/at.deny"


def test_cron_or_at_not_installed_is_ok_and_an_unreadable_file_says_run_as_root(
    tmp_path: Path,
) -> None:
    check = doctor.check_scheduler(CRON, ["volute-turn"], tmp_path, [tmp_path / "none"])
    assert (check.status, check.found) == ("ok", "not installed (no crontab)")
    (tmp_path / "cron.allow").mkdir()  # reading it fails, as a file root alone may read
    check = doctor.check_scheduler(CRON, ["volute-turn"], tmp_path, installed_programs(tmp_path))
    assert check.status == "warn" and "cannot read" in check.found
    assert "as root" in check.change


def test_doctor_checks_cron_and_at_for_each_minds_user() -> None:
    from volutectl.config.settings import Settings

    settings = Settings.model_validate(
        {
            "minds": {
                "a": {"command": "x"},
                "b": {"command": "x", "user": "bob"},
                "c": {"command": "x"},
            }
        }
    )
    assert doctor.mind_users(settings) == ["bob", "volute-turn"]


def test_a_minds_user_that_lingers_is_named_with_the_line_that_stops_it(tmp_path: Path) -> None:
    assert doctor.check_linger(["volute-turn"], tmp_path).status == "ok"
    write(tmp_path / "volute-turn", "")  # as `loginctl enable-linger volute-turn` leaves it
    check = doctor.check_linger(["bob", "volute-turn"], tmp_path)
    assert check.status == "warn" and "volute-turn" in check.found and "bob" not in check.found
    assert check.change == "as root: loginctl disable-linger volute-turn"


def test_the_linger_rule_covers_the_turn_group_and_names_each_user_outside_it(
    tmp_path: Path,
) -> None:
    rule = tmp_path / "40-volutectl.rules"
    members = {"volute-turn": True, "bob": False, "carol": False, "ghost": None}

    def check(users: list[str], group_exists: bool = True) -> doctor.Check:
        return doctor.check_linger_rule(users, members.get, rule, lambda group: group_exists)

    missing = check(["volute-turn"])
    assert missing.status == "warn" and str(rule) in missing.found  # no rule: nothing refuses
    write(rule, "polkit.addRule(...)")
    assert check(["volute-turn", "root", "ghost"]).status == "ok"
    outside = check(["carol", "volute-turn", "bob"])
    assert outside.status == "warn"
    assert outside.found.startswith("the minds' user(s) bob, carol are not in group volute-turns")
    assert outside.change == (
        "as root: usermod -a -G volute-turns bob; usermod -a -G volute-turns carol"
    )
    # A group the package did not make (volutectl installed without it, e.g. by pip).
    assert check(["bob"], group_exists=False).change == (
        "as root: groupadd -r volute-turns; usermod -a -G volute-turns bob"
    )


def test_membership_is_read_as_polkit_reads_it() -> None:
    import grp
    import os
    import pwd

    me = pwd.getpwuid(os.getuid())
    primary = grp.getgrgid(me.pw_gid).gr_name
    assert doctor.in_group(me.pw_name, primary) is True  # its primary group counts
    assert doctor.in_group(me.pw_name, "no-such-group-volute") is False
    assert doctor.in_group("no-such-user-volute", primary) is None
