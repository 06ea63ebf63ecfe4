"""The config model, its sources and `volutectl config show|check`.

Errors are checked twice: in process (the message names the key and the file or
variable) and through the real console script (one line plus a hint, exit 78, no
traceback).
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest
from pydantic import ValidationError

from volutectl import cli
from volutectl.config import settings as config
from volutectl.config.settings import flatten, load_settings
from volutectl.errors import EX_CONFIG, ConfigError

VOLUTECTL = Path(sys.executable).parent / "volutectl"

GOOD = """\
[limits]
global_concurrent_turns = 2

[turns]
io_write_bandwidth_max = ["/dev/mmcblk0 8M"]

[tests]
concurrent_runs = 1
repositories = ["/srv/repo"]

[minds.alice]
command = ["claude", "-p"]
user = "alice"
turns_per_mind = 2

[minds."bob.v2"]
command = "echo hi"
"""


@pytest.fixture(autouse=True)
def no_outside_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Neither the host's /etc/volute nor the caller's VOLUTE_ variables leak in."""
    for name in list(os.environ):
        if name.upper().startswith("VOLUTE_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(config, "DEFAULT_CONFIG_PATH", tmp_path / "absent" / "volutectl.toml")
    yield


def write(tmp_path: Path, text: str, name: str = "volutectl.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    out, err = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 1), out, err


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("VOLUTE_")}
    env.update(extra)
    return env


# --- the model and its sources -------------------------------------------------------


def test_defaults_without_a_file() -> None:
    loaded = load_settings(environ={})
    assert loaded.path is None
    settings = loaded.settings
    assert settings.limits.global_concurrent_turns is None  # unlimited
    assert settings.limits.turns_per_mind == 1
    assert settings.tests.concurrent_runs == 0  # off
    assert settings.tests.slice == "volute-tests.slice"
    assert settings.turns.slice == "volute-turns.slice"
    assert all(source == "default" for source in map(loaded.source_of, flatten(settings)))


def test_file_values_and_their_source(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    loaded = load_settings(path, environ={})
    settings = loaded.settings
    assert settings.limits.global_concurrent_turns == 2
    assert settings.minds["alice"].command == ["claude", "-p"]
    assert settings.minds["bob.v2"].command == "echo hi"
    assert settings.mind_limit("alice") == 2
    assert settings.mind_limit("bob.v2") == 1
    assert settings.tests.repositories == [Path("/srv/repo")]
    assert loaded.source_of("limits.global_concurrent_turns") == f"file {path}"
    assert loaded.source_of("limits.turns_per_mind") == "default"
    # A mind name with a dot is one key part, not two.
    assert loaded.source_of("minds.bob.v2.command") == f"file {path}"
    assert loaded.source_of("minds.bob.v2.user") == "default"


def test_settings_are_frozen(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, GOOD), environ={}).settings
    with pytest.raises(ValueError):
        settings.limits.turns_per_mind = 5  # type: ignore[misc]  # frozen: it must refuse


def test_env_beats_file(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    environ = {"VOLUTE_LIMITS__GLOBAL_CONCURRENT_TURNS": "3", "VOLUTE_MINDS__ALICE__USER": "bob"}
    loaded = load_settings(path, environ=environ)
    assert loaded.settings.limits.global_concurrent_turns == 3
    assert loaded.settings.minds["alice"].user == "bob"
    assert loaded.settings.minds["alice"].command == ["claude", "-p"]  # merged, not replaced
    assert loaded.source_of("limits.global_concurrent_turns") == (
        "env VOLUTE_LIMITS__GLOBAL_CONCURRENT_TURNS"
    )
    assert loaded.source_of("minds.alice.user") == "env VOLUTE_MINDS__ALICE__USER"
    assert loaded.source_of("minds.alice.command") == f"file {path}"
    assert loaded.table_sources("minds.alice") == [
        f"file {path}",
        "env VOLUTE_MINDS__ALICE__USER",
    ]


def test_json_section_variable_claims_only_the_keys_it_sets(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    loaded = load_settings(path, environ={"VOLUTE_LIMITS": '{"turns_per_mind": 4}'})
    assert loaded.settings.limits.turns_per_mind == 4
    assert loaded.settings.limits.global_concurrent_turns == 2
    assert loaded.source_of("limits.turns_per_mind") == "env VOLUTE_LIMITS"
    assert loaded.source_of("limits.global_concurrent_turns") == f"file {path}"
    assert loaded.source_of("limits.test_runs_count_as_turns") == "default"


def test_volute_config_variable_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    loaded = load_settings(environ={"VOLUTE_CONFIG": str(path)})
    assert loaded.path == path
    assert loaded.settings.limits.global_concurrent_turns == 2


def test_explicit_path_beats_volute_config(tmp_path: Path) -> None:
    chosen = write(tmp_path, "[limits]\nturns_per_mind = 3\n", "chosen.toml")
    other = write(tmp_path, "[limits]\nturns_per_mind = 9\n", "other.toml")
    loaded = load_settings(chosen, environ={"VOLUTE_CONFIG": str(other)})
    assert loaded.settings.limits.turns_per_mind == 3


# --- errors name the key and where it came from --------------------------------------

BAD_FILES = {
    "unknown key": ("[limits]\nbogus = 1\n", "limits.bogus", "unknown key"),
    "unknown section": ("[limit]\nturns_per_mind = 1\n", "limit", "unknown key"),
    "unknown mind key": ('[minds.a]\ncommand = "x"\nshell = 1\n', "minds.a.shell", "unknown"),
    "wrong type": ('[limits]\nturns_per_mind = "two"\n', "limits.turns_per_mind", "integer"),
    "wrong type in mind": ("[minds.a]\ncommand = 5\n", "minds.a.command", "valid"),
    "negative global cap": (
        "[limits]\nglobal_concurrent_turns = -1\n",
        "limits.global_concurrent_turns",
        "greater than or equal to 1",
    ),
    "negative test runs": (
        "[tests]\nconcurrent_runs = -1\n",
        "tests.concurrent_runs",
        "greater than or equal to 0",
    ),
    "zero per-mind": (
        "[minds.a]\ncommand = 'x'\nturns_per_mind = 0\n",
        "minds.a.turns_per_mind",
        "",
    ),
    "weight out of range": ("[turns]\ncpu_weight = 0\n", "turns.cpu_weight", ""),
    "zero retention": ("[gate]\nretention_days = 0\n", "gate.retention_days", "greater than 0"),
    "retention as text": ('[gate]\nretention_days = "7d"\n', "gate.retention_days", "number"),
    "bad mind name": (
        '[minds."bad name"]\ncommand = "x"\n',
        "minds",
        "invalid mind name 'bad name'",
    ),
    "empty command": ("[minds.a]\ncommand = []\n", "minds.a.command", "must not be empty"),
    "relative environment file": (
        '[minds.a]\ncommand = "x"\nenvironment_file = "a.env"\n',
        "minds.a.environment_file",
        "a.env is not an absolute path",
    ),
    "bad slice": ('[turns]\nslice = "turns"\n', "turns.slice", "invalid slice name"),
    "root slice": ('[tests]\nslice = "-.slice"\n', "tests.slice", "invalid slice name"),
    "bad bandwidth": (
        '[turns]\nio_read_bandwidth_max = ["8M"]\n',
        "turns.io_read_bandwidth_max",
        "",
    ),
    "root's reserve takes every place": (
        "[gate]\nmax_clients = 16\n",
        "gate",
        "clients_reserved_for_root (16) must be below max_clients (16)",
    ),
    "no connection for a member": (
        "[gate]\nmax_clients_per_uid = 0\n",
        "gate.max_clients_per_uid",
        "greater than or equal to 1",
    ),
    "no pending bytes": (
        "[gate]\nmax_pending_bytes_per_uid = 0\n",
        "gate.max_pending_bytes_per_uid",
        "greater than or equal to 1",
    ),
    "adaptive minimum over its maximum": (
        "[limits.adaptive]\nminimum = 4\nstart = 4\nmaximum = 3\n",
        "limits.adaptive",
        "minimum (4) is over maximum (3)",
    ),
    "adaptive start below its minimum": (
        "[limits.adaptive]\nminimum = 3\n",
        "limits.adaptive",
        "start (2) is outside [minimum, maximum] ([3, 16])",
    ),
    "adaptive start over its maximum": (
        "[limits.adaptive]\nstart = 17\n",
        "limits.adaptive",
        "start (17) is outside [minimum, maximum] ([1, 16])",
    ),
    "adaptive minimum of no turn": (
        "[limits.adaptive]\nminimum = 0\n",
        "limits.adaptive.minimum",
        "greater than or equal to 1",
    ),
    "adaptive interval too short": (
        "[limits.adaptive]\ninterval_seconds = 0.01\n",
        "limits.adaptive.interval_seconds",
        "greater than or equal to 0.1",
    ),
    "io_pressure and adaptive both enabled": (
        "[limits.io_pressure]\nenabled = true\n[limits.adaptive]\nenabled = true\n",
        "limits",
        "io_pressure.enabled and adaptive.enabled are both true: choose one",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_names_key_and_file(tmp_path: Path, case: str) -> None:
    text, key, words = BAD_FILES[case]
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        load_settings(path, environ={})
    error = raised.value
    assert error.exit_code == EX_CONFIG == 78
    assert f"{key}: " in error.message
    assert words in error.message
    assert f"(in {path})" in error.message


def test_adaptive_admission_is_on_by_default_within_its_bounds() -> None:
    adaptive = config.Settings().limits.adaptive
    assert adaptive == config.AdaptiveSettings(
        enabled=True, start=2, minimum=1, maximum=16, interval_seconds=0.5
    )
    assert config.Settings().limits.global_concurrent_turns is None  # no ceiling
    assert not config.Settings().limits.adaptive_off_for_io_pressure


def test_io_pressure_turns_an_unset_adaptive_off(tmp_path: Path) -> None:
    # A config from before the adaptive limit keeps today's PSI hold, and only that.
    path = write(tmp_path, "[limits.io_pressure]\nenabled = true\n")
    limits = load_settings(path, environ={}).settings.limits
    assert limits.io_pressure.enabled and not limits.adaptive.enabled
    assert limits.adaptive_off_for_io_pressure
    from_env = load_settings(environ={"VOLUTE_LIMITS__IO_PRESSURE__ENABLED": "true"})
    assert from_env.settings.limits.adaptive_off_for_io_pressure
    # Either one off by name is no contradiction, and not "turned off by io_pressure".
    path = write(
        tmp_path, "[limits.io_pressure]\nenabled = true\n[limits.adaptive]\nenabled = false\n"
    )
    limits = load_settings(path, environ={}).settings.limits
    assert limits.io_pressure.enabled and not limits.adaptive.enabled
    assert not limits.adaptive_off_for_io_pressure
    path = write(
        tmp_path, "[limits.io_pressure]\nenabled = false\n[limits.adaptive]\nenabled = true\n"
    )
    limits = load_settings(path, environ={}).settings.limits
    assert limits.adaptive.enabled and not limits.adaptive_off_for_io_pressure


def test_io_pressure_and_adaptive_both_enabled_is_refused_from_any_source(tmp_path: Path) -> None:
    path = write(tmp_path, "[limits.adaptive]\nenabled = true\n")
    with pytest.raises(ConfigError) as raised:
        load_settings(path, environ={"VOLUTE_LIMITS__IO_PRESSURE__ENABLED": "true"})
    assert raised.value.message.startswith(
        "invalid config: limits: io_pressure.enabled and adaptive.enabled are both true: choose one"
    )
    with pytest.raises(ValidationError, match="choose one"):
        config.Settings(limits={"io_pressure": {"enabled": True}, "adaptive": {"enabled": True}})


def test_bad_toml_syntax_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[limits\nturns_per_mind = 1\n")
    with pytest.raises(ConfigError) as raised:
        load_settings(path, environ={})
    assert str(path) in raised.value.message
    assert "not valid TOML" in raised.value.message
    assert "line 1" in raised.value.message


def test_missing_named_file_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    for kwargs in ({"path": missing, "environ": {}}, {"environ": {"VOLUTE_CONFIG": str(missing)}}):
        with pytest.raises(ConfigError) as raised:
            load_settings(**kwargs)
        assert f"{missing}: config file not found" == raised.value.message


def test_directory_as_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_settings(tmp_path, environ={})


@pytest.mark.parametrize(
    ("variable", "value", "key"),
    [
        ("VOLUTE_LIMITS__BOGUS", "1", "limits.bogus"),
        ("VOLUTE_LIMITS__TURNS_PER_MIND", "x", "limits.turns_per_mind"),
        ("VOLUTE_TESTS__CONCURRENT_RUNS", "-1", "tests.concurrent_runs"),
        ("VOLUTE_LIMITS__GLOBAL_CONCURRENT_TURNS", "-1", "limits.global_concurrent_turns"),
        ("VOLUTE_GATE__MANAGER", "session", "gate.manager"),
    ],
)
def test_bad_env_names_key_and_variable(
    tmp_path: Path, variable: str, value: str, key: str
) -> None:
    path = write(tmp_path, GOOD)
    with pytest.raises(ConfigError) as raised:
        load_settings(path, environ={variable: value})
    assert f"{key}: " in raised.value.message
    assert f"(from env {variable})" in raised.value.message


def test_undecodable_env_list_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(environ={"VOLUTE_TESTS__REPOSITORIES": "/srv/repo"})
    assert "VOLUTE_TESTS__REPOSITORIES" in raised.value.message
    assert raised.value.hint is not None and "JSON" in raised.value.hint


def test_several_problems_all_reported(tmp_path: Path) -> None:
    path = write(tmp_path, "[limits]\nturns_per_mind = 0\nbogus = 1\n")
    with pytest.raises(ConfigError) as raised:
        load_settings(path, environ={})
    text = f"{raised.value.message} {raised.value.hint}"
    assert "limits.turns_per_mind" in text and "limits.bogus" in text


def test_failed_load_leaves_os_environ_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VOLUTE_SOMETHING_ELSE", "kept")
    before = dict(os.environ)
    with pytest.raises(ConfigError):
        load_settings(environ={"VOLUTE_LIMITS__TURNS_PER_MIND": "x"})
    assert dict(os.environ) == before


def test_loading_never_writes_os_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another thread reading os.environ while configs load sees it unchanged throughout.

    (The loader used to clear os.environ's VOLUTE_ variables and put others in their
    place for the length of each load, under every other thread of the process.)"""
    monkeypatch.setenv("VOLUTE_LIMITS__TURNS_PER_MIND", "2")
    monkeypatch.setenv("VOLUTE_UNRELATED", "kept")
    before = dict(os.environ)
    path = write(tmp_path, GOOD)
    writes: list[tuple[object, ...]] = []  # os.environ writes through os.putenv/unsetenv
    monkeypatch.setattr(os, "putenv", lambda *args: writes.append(("putenv", *args)))
    monkeypatch.setattr(os, "unsetenv", lambda *args: writes.append(("unsetenv", *args)))
    seen: list[dict[str, str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(dict(os.environ))

    reader = threading.Thread(target=watch)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # let the reader in between any two bytecodes of a load
    reader.start()
    try:
        for round_ in range(200):
            environ = {"VOLUTE_LIMITS__TURNS_PER_MIND": str(3 + round_ % 5)}
            loaded = load_settings(path, environ=environ)
            assert loaded.settings.limits.turns_per_mind == 3 + round_ % 5
            with pytest.raises(ConfigError):
                load_settings(path, environ={"VOLUTE_LIMITS__TURNS_PER_MIND": "x"})
            assert load_settings(path).settings.limits.turns_per_mind == 2  # os.environ's
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(switch_interval)
    assert writes == []
    assert seen and all(snapshot == before for snapshot in seen)
    assert dict(os.environ) == before


def test_loading_only_reads_os_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With os.environ made read-only, loading from it and from a mapping still works."""
    monkeypatch.setenv("VOLUTE_MINDS__ALICE__USER", "bob")
    path = write(tmp_path, GOOD)
    with pytest.MonkeyPatch.context() as patch:  # undone before pytest writes os.environ
        patch.setattr(os, "environ", MappingProxyType(dict(os.environ)))
        loaded = load_settings(path)
        from_mapping = load_settings(path, environ={})
    assert loaded.settings.minds["alice"].user == "bob"
    assert loaded.source_of("minds.alice.user") == "env VOLUTE_MINDS__ALICE__USER"
    assert from_mapping.settings.minds["alice"].user == "alice"


def test_settings_outside_a_load_read_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings(...) is its arguments over the defaults; only load_settings reads sources."""
    monkeypatch.setenv("VOLUTE_LIMITS__TURNS_PER_MIND", "x")  # would not validate
    assert config.Settings().limits.turns_per_mind == 1
    assert config.Settings(limits={"turns_per_mind": 3}).limits.turns_per_mind == 3


def test_a_deeper_variable_wins_over_a_section_variable_and_is_named(tmp_path: Path) -> None:
    environ = {
        "VOLUTE_LIMITS__TURNS_PER_MIND": "5",
        "VOLUTE_LIMITS": '{"turns_per_mind": 4, "global_concurrent_turns": 3}',
    }
    loaded = load_settings(write(tmp_path, GOOD), environ=environ)
    assert loaded.settings.limits.turns_per_mind == 5
    assert loaded.source_of("limits.turns_per_mind") == "env VOLUTE_LIMITS__TURNS_PER_MIND"
    assert loaded.settings.limits.global_concurrent_turns == 3
    assert loaded.source_of("limits.global_concurrent_turns") == "env VOLUTE_LIMITS"


def test_an_undecodable_variable_is_named_alone() -> None:
    environ = {"VOLUTE_TESTS__CONCURRENT_RUNS": "1", "VOLUTE_TESTS__REPOSITORIES": "/srv/repo"}
    with pytest.raises(ConfigError) as raised:
        load_settings(environ=environ)
    assert raised.value.message == "invalid config: tests: cannot parse VOLUTE_TESTS__REPOSITORIES"


# --- volutectl config show ----------------------------------------------------------


def test_show_lists_every_key_with_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, GOOD)
    monkeypatch.setenv("VOLUTE_LIMITS__TURNS_PER_MIND", "3")
    code, out, _ = run_cli(["config", "show", "--config", str(path)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"# config file: {path}"
    assert f"limits.global_concurrent_turns = 2  # file {path}" in lines
    assert "limits.turns_per_mind = 3  # env VOLUTE_LIMITS__TURNS_PER_MIND" in lines
    assert 'tests.slice = "volute-tests.slice"  # default' in lines
    assert 'gate.socket = "/run/volute/gate.sock"  # default' in lines
    assert f'minds.alice.command = ["claude", "-p"]  # file {path}' in lines
    # where each mind's table came from, just before its keys
    header = lines.index(f"# [minds.alice] from file {path}")
    assert lines[header + 1].startswith("minds.alice.")
    assert f"# [minds.bob.v2] from file {path}" in lines
    keys = [line.split(" = ")[0] for line in lines if not line.startswith("#")]
    loaded = load_settings(path, environ={"VOLUTE_LIMITS__TURNS_PER_MIND": "3"})
    assert keys == list(flatten(loaded.settings))


def test_show_unset_cap_reads_as_unset(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["config", "show"], capsys)
    assert code == 0
    assert "not found): defaults and environment only" in out.splitlines()[0]
    assert "limits.global_concurrent_turns = (unset)  # default" in out.splitlines()


def test_show_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, GOOD)
    monkeypatch.setenv("VOLUTE_MINDS__CAROL__COMMAND", '["run", "carol"]')
    code, out, _ = run_cli(["config", "show", "--json", "--config", str(path)], capsys)
    assert code == 0
    document = json.loads(out)
    assert document["limits.global_concurrent_turns"] == {"value": 2, "source": f"file {path}"}
    assert document["limits.turns_per_mind"] == {"value": 1, "source": "default"}
    assert document["tests.repositories"]["value"] == ["/srv/repo"]
    assert document["minds.carol.command"] == {
        "value": ["run", "carol"],
        "source": "env VOLUTE_MINDS__CAROL__COMMAND",
    }
    assert document["gate.socket"]["value"] == "/run/volute/gate.sock"


# --- volutectl config check ---------------------------------------------------------


def runnable(tmp_path: Path) -> str:
    """GOOD, but with minds that pass preflight here: this user, a directory it owns."""
    me = pwd.getpwuid(os.getuid()).pw_name
    return (
        GOOD.replace('["claude", "-p"]', '["sleep", "1"]')
        .replace('user = "alice"', f'user = "{me}"\nworking_directory = "{tmp_path}"')
        .replace('command = "echo hi"', f'command = "echo hi"\nuser = "{me}"')
    )


def test_check_ok_names_file_and_minds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, runnable(tmp_path))
    code, out, err = run_cli(["config", "check", "--config", str(path)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[-1] == f"ok: {path}"  # the verdict comes last, after what it judged
    assert f"  mind alice: from file {path} (at most 2 turn(s) at once)" in lines
    assert f"  mind bob.v2: from file {path} (at most 1 turn(s) at once)" in lines
    assert not [line for line in lines if "fail:" in line], out


def test_check_warns_about_variables_naming_no_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VOLUTE_LIMTS__TURNS_PER_MIND", "3")
    path = write(tmp_path, runnable(tmp_path))
    code, _, err = run_cli(["config", "check", "--config", str(path)], capsys)
    assert code == 0
    assert "VOLUTE_LIMTS__TURNS_PER_MIND names no config section" in err


def test_check_notes_a_ceiling_over_the_adaptive_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, runnable(tmp_path))  # global_concurrent_turns = 2
    code, out, err = run_cli(["config", "check", "--config", str(path)], capsys)
    assert code == 0, err
    [note] = [line for line in out.splitlines() if line.startswith("  note: limits.")]
    assert note.startswith(
        "  note: limits.global_concurrent_turns = 2 is a hard ceiling over the adaptive limit: "
        "at most 2 turns at once"
    )
    # With the adaptive limit off by name, the cap is just the cap: nothing to note.
    path = write(tmp_path, runnable(tmp_path) + "\n[limits.adaptive]\nenabled = false\n")
    code, out, err = run_cli(["config", "check", "--config", str(path)], capsys)
    assert code == 0, err
    assert not [line for line in out.splitlines() if line.startswith("  note: limits.")]


def test_show_says_why_the_adaptive_limit_is_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "[limits.io_pressure]\nenabled = true\n")
    code, out, _ = run_cli(["config", "show", "--config", str(path)], capsys)
    assert code == 0
    expected = "limits.adaptive.enabled = false  # default, off for limits.io_pressure.enabled"
    assert expected in out.splitlines()
    code, out, _ = run_cli(["config", "show", "--json", "--config", str(path)], capsys)
    assert json.loads(out)["limits.adaptive.enabled"] == {
        "value": False,
        "source": "default, off for limits.io_pressure.enabled",
    }


def test_check_notes_an_adaptive_limit_turned_off_by_io_pressure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "[limits.io_pressure]\nenabled = true\n")
    code, out, err = run_cli(["config", "check", "--config", str(path)], capsys)
    assert code == 0, err
    assert out.splitlines()[0].startswith(
        "  note: limits.adaptive is off because limits.io_pressure.enabled is true"
    )
    path = write(tmp_path, "[limits]\n")
    code, out, err = run_cli(["config", "check", "--config", str(path)], capsys)
    assert code == 0, err
    assert out.splitlines() == [f"ok: {path}"]


CHECK_FAILURES = {
    "unknown key": ("[limits]\nbogus = 1\n", "limits.bogus: unknown key"),
    "misspelt key": (
        "[limits]\nglobal_concurent_turns = 2\n",
        "limits.global_concurent_turns: unknown key (did you mean `global_concurrent_turns`?)",
    ),
    "misspelt mind key": (
        '[minds.a]\ncommand = "x"\nuserr = "a"\n',
        "minds.a.userr: unknown key (did you mean `user`?)",
    ),
    "wrong type": ("[tests]\nconcurrent_runs = 'one'\n", "tests.concurrent_runs: "),
    "negative global cap": (
        "[limits]\nglobal_concurrent_turns = -1\n",
        "limits.global_concurrent_turns: ",
    ),
    "negative test runs": ("[tests]\nconcurrent_runs = -1\n", "tests.concurrent_runs: "),
    "bad mind name": ('[minds."../etc"]\ncommand = "x"\n', "invalid mind name '../etc'"),
    "bad toml": ("limits = [\n", "not valid TOML"),
    "io_pressure and adaptive both enabled": (
        "[limits.io_pressure]\nenabled = true\n[limits.adaptive]\nenabled = true\n",
        "limits: io_pressure.enabled and adaptive.enabled are both true: choose one",
    ),
    "adaptive bounds": (
        "[limits.adaptive]\nminimum = 3\nmaximum = 2\nstart = 2\n",
        "limits.adaptive: minimum (3) is over maximum (2)",
    ),
}


@pytest.mark.parametrize("case", sorted(CHECK_FAILURES))
def test_check_failure_is_one_line_and_hint(tmp_path: Path, case: str) -> None:
    text, expected = CHECK_FAILURES[case]
    path = write(tmp_path, text)
    result = subprocess.run(
        [str(VOLUTECTL), "config", "check", "--config", str(path)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )
    assert result.returncode == 78, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("volutectl: ") and expected in lines[0]
    assert str(path) in lines[0]
    assert lines[1].startswith("  hint: ")
    # Not `config show`, which fails with the same error.
    assert "config show" not in lines[1]
    assert "Traceback" not in result.stderr


def test_check_missing_named_file_exits_78(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    for args, env in (
        (["--config", str(missing)], clean_env()),
        ([], clean_env(VOLUTE_CONFIG=str(missing))),
    ):
        result = subprocess.run(
            [str(VOLUTECTL), "config", "check", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert result.returncode == 78
        assert result.stderr.splitlines()[0] == f"volutectl: {missing}: config file not found"
        assert "Traceback" not in result.stderr


def test_check_env_error_names_the_variable(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(VOLUTECTL), "config", "check", "--config", str(write(tmp_path, GOOD))],
        capture_output=True,
        text=True,
        env=clean_env(VOLUTE_TESTS__CONCURRENT_RUNS="-1"),
        timeout=60,
    )
    assert result.returncode == 78
    assert "tests.concurrent_runs" in result.stderr
    assert "(from env VOLUTE_TESTS__CONCURRENT_RUNS)" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_debug_shows_the_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "[limits]\nbogus = 1\n")
    result = subprocess.run(
        [str(VOLUTECTL), "--debug", "config", "check", "--config", str(path)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )
    assert result.returncode == 78
    assert "Traceback" in result.stderr
    assert "limits.bogus: unknown key" in result.stderr


def test_a_mind_without_a_command_is_valid_and_takes_leases_only(tmp_path: Path) -> None:
    """Issue 31: a mind a daemon runs through leases needs no command."""
    settings = load_settings(write(tmp_path, '[minds.a]\nuser = "a"\n'), environ={}).settings
    assert settings.minds["a"].command is None
