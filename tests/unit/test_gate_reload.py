"""`systemctl reload volute-gate` and a bad config: the reload's plan (which keys change,
which wait for a restart), "did you mean", the in-process gate's reload, the unknown
mind that the file has, and the degraded gate that refuses every request with 78."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import BaseModel

from tests.unit.gate_harness import ME, Harness
from volutectl import events
from volutectl.config.reload import ConfigFile, changed_keys, plan_reload, restart_keys
from volutectl.config.settings import RESTART, Section, Settings, load_settings
from volutectl.errors import EX_CONFIG, EX_NOUSER, ConfigError
from volutectl.gate.degraded import Degraded
from volutectl.systemd.journal import Journal

# -- the plan -------------------------------------------------------------------------------


def test_a_new_mind_and_new_limits_apply_but_the_socket_waits_for_a_restart() -> None:
    running = Settings(minds={"a": {"command": "true"}})
    read = Settings(
        minds={"a": {"command": "true"}, "b.v2": {"command": ["x"], "turns_per_mind": 2}},
        limits={"turns_per_mind": 3, "adaptive": {"maximum": 4, "rule": "aimd"}},
        gate={"socket": "/elsewhere.sock", "max_attempts": 3},
    )
    plan = plan_reload(running, read)
    assert plan.changed == (
        "gate.max_attempts",
        "gate.socket",
        "limits.adaptive.maximum",
        "limits.adaptive.rule",
        "limits.turns_per_mind",
        "minds.b.v2",  # one entry per mind, whatever it holds
    )
    assert plan.needs_restart == ("gate.socket", "limits.adaptive.rule")
    applied = plan.settings
    assert sorted(applied.minds) == ["a", "b.v2"] and applied.mind_limit("b.v2") == 2
    assert applied.limits.turns_per_mind == 3 and applied.gate.max_attempts == 3
    assert applied.limits.adaptive.maximum == 4
    assert applied.gate.socket == running.gate.socket  # kept
    assert applied.limits.adaptive.rule == "gradient"  # kept


def test_the_same_file_changes_nothing_and_a_removed_mind_is_named() -> None:
    running = Settings(minds={"a": {"command": "true"}, "gone": {"command": "true"}})
    assert plan_reload(running, running).changed == ()
    assert changed_keys(running, Settings(minds={"a": {"command": "true"}})) == ("minds.gone",)


def test_keeping_a_restart_key_keeps_an_unset_key_unset() -> None:
    """limits.adaptive.enabled left unset under io_pressure reads as 'off for io_pressure'."""
    running = Settings(limits={"io_pressure": {"enabled": True}})
    assert running.limits.adaptive_off_for_io_pressure
    plan = plan_reload(running, Settings())
    assert plan.needs_restart == ("limits.adaptive.enabled", "limits.io_pressure.enabled")
    assert plan.settings.limits.adaptive_off_for_io_pressure


def test_the_keys_that_need_a_restart_are_the_fields_marked_so() -> None:
    """Each field says itself whether a reload may change it: no list beside them."""
    assert set(restart_keys()) == {
        "gate.socket",
        "gate.socket_group",
        "gate.state_dir",
        "gate.runtime_dir",
        "gate.launcher_socket",
        "gate.manager",
        "gate.watchdog",
        "limits.io_pressure",  # the whole table
        "limits.adaptive.enabled",
        "limits.adaptive.rule",
        "limits.adaptive.devices",  # the disks are found when the gate starts
        "turns.slice",
        "tests.repositories",
        "tests.max_slot_files",
    }

    class Inner(Section):
        kept: Annotated[int, RESTART] = 1
        free: int = 2

    class Outer(Section):
        inner: Inner = Inner()
        table: Annotated[Inner, RESTART] = Inner()
        other: str = ""

    assert restart_keys(Outer) == ("inner.kept", "table")


# -- did you mean ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "meant"),
    [
        (
            "[limits]\nglobal_concurent_turns = 2\n",
            "limits.global_concurent_turns",
            "global_concurrent_turns",
        ),
        ("[limit]\n", "limit", "limits"),
        ('[minds.a]\ncomand = "x"\n', "minds.a.comand", "command"),
        ("[limits.adaptive]\nmaximun = 3\n", "limits.adaptive.maximun", "maximum"),
    ],
)
def test_an_unknown_key_names_the_known_key_it_resembles(
    tmp_path: Path, text: str, key: str, meant: str
) -> None:
    path = tmp_path / "volutectl.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_settings(path, {})
    message = f"{raised.value.message}\n{raised.value.hint}"  # the first error, or among more
    assert f"{key}: unknown key (did you mean `{meant}`?)" in message


def test_an_unknown_key_like_no_known_one_gets_no_guess(tmp_path: Path) -> None:
    path = tmp_path / "volutectl.toml"
    path.write_text("[limits]\nzzzz = 1\n")
    with pytest.raises(ConfigError) as raised:
        load_settings(path, {})
    assert "limits.zzzz: unknown key (in" in raised.value.message
    assert "config show" not in str(raised.value.hint)  # it would fail the same way


# -- the gate's reload, in process --------------------------------------------------------------


def config_text(harness: Harness, minds: dict[str, str], extra: str = "") -> str:
    gate = harness.settings.gate
    lines = [
        "[gate]",
        f'socket = "{gate.socket}"',
        f'socket_group = "{ME}"',
        f'state_dir = "{gate.state_dir}"',
        f'runtime_dir = "{gate.runtime_dir}"',
        "watchdog = false",
        extra,
    ]
    for name, command in minds.items():
        lines += [f"[minds.{name}]", f'command = "{command}"', f'user = "{ME}"']
    return "\n".join(lines) + "\n"


@pytest.fixture
def reloadable(tmp_path: Path) -> Iterator[tuple[Harness, Path]]:
    harness = Harness(tmp_path)
    path = tmp_path / "volutectl.toml"
    path.write_text(config_text(harness, {"mimsy": "true"}))
    harness.gate.config = ConfigFile(str(path), {})
    harness.gate.state.minds_on_disk = harness.gate.config.minds_on_disk
    yield harness, path
    harness.close()


def test_a_mind_in_the_file_but_not_loaded_says_to_reload_and_reload_loads_it(
    reloadable: tuple[Harness, Path],
) -> None:
    harness, path = reloadable
    peer = harness.connect()
    reply = peer.request({"op": "deliver", "mind": "pip", "message": "hi"})
    assert reply["code"] == EX_NOUSER and "add a [minds.pip] table" in reply["hint"]
    path.write_text(config_text(harness, {"mimsy": "true", "pip": "true"}))
    reply = peer.request({"op": "deliver", "mind": "pip", "message": "hi"})
    assert reply["code"] == EX_NOUSER
    assert "systemctl reload volute-gate" in reply["hint"]
    harness.gate.reload()
    [reloaded] = harness.journal.of(events.GateConfigReloaded)
    assert reloaded.changed == "minds.pip" and reloaded.needs_restart == ""
    assert harness.deliver_ok(peer, mind="pip") > 0
    assert harness.deliver_ok(peer, mind="mimsy") > 0


def test_an_invalid_file_at_reload_is_refused_and_the_old_config_serves(
    reloadable: tuple[Harness, Path],
) -> None:
    harness, path = reloadable
    before = harness.gate.settings
    path.write_text(config_text(harness, {"pip": "true"}, "max_atempts = 3"))
    harness.gate.reload()
    [refused] = harness.journal.of(events.GateConfigRefused)
    assert "gate.max_atempts: unknown key (did you mean `max_attempts`?)" in refused.error
    assert harness.gate.settings is before
    peer = harness.connect()
    status = peer.request({"op": "status"})["status"]
    assert "gate.max_atempts" in status["config"]["refused"]
    assert status["config"]["refused_at"] >= status["config"]["loaded_at"]
    assert harness.deliver_ok(peer, mind="mimsy") > 0
    # Fixed: the next reload applies it, and the refusal is gone from status.
    path.write_text(config_text(harness, {"mimsy": "true", "pip": "true"}, "max_attempts = 3"))
    harness.gate.reload()
    assert harness.gate.settings.gate.max_attempts == 3
    status = peer.request({"op": "status"})["status"]
    assert status["config"]["refused"] is None
    assert harness.deliver_ok(peer, mind="pip") > 0


def test_a_reload_that_moves_the_socket_keeps_it_and_says_so(
    reloadable: tuple[Harness, Path],
) -> None:
    harness, path = reloadable
    text = config_text(harness, {"mimsy": "true"}).replace(
        str(harness.settings.gate.socket), "/run/elsewhere.sock"
    )
    path.write_text(text + "[limits]\nturns_per_mind = 2\n")
    harness.gate.reload()
    [reloaded] = harness.journal.of(events.GateConfigReloaded)
    assert reloaded.needs_restart == "gate.socket"
    assert harness.gate.settings.gate.socket == harness.settings.gate.socket
    assert harness.gate.state.limits.turns_per_mind == 2
    status = harness.connect().request({"op": "status"})["status"]
    assert status["config"]["needs_restart"] == ["gate.socket"]
    assert status["turns_per_mind"] == 2


def test_every_part_reads_the_one_holder_that_a_reload_swaps(
    reloadable: tuple[Harness, Path],
) -> None:
    """No part keeps a copy of the settings: after a reload each reads the new values."""
    harness, path = reloadable
    gate = harness.gate
    parts = [gate, gate.state, gate.state.turns, gate.state.liveness, gate.server]
    parts += [gate.retention, gate.state.adaptive, gate.serving, gate.waiters]
    for part in parts:
        copies = [name for name, value in vars(part).items() if isinstance(value, BaseModel)]
        assert copies == [], f"{type(part).__name__} keeps settings of its own: {copies}"
    extra = "max_attempts = 3\nclient_idle_seconds = 7.0\nretention_days = 2.0\n"
    extra += "[limits]\nglobal_concurrent_turns = 5\n[limits.adaptive]\ninterval_seconds = 2.5\n"
    path.write_text(config_text(harness, {"mimsy": "true"}, extra))
    harness.gate.reload()
    assert gate.settings.gate.max_attempts == 3
    for part in (gate.state, gate.state.turns, gate.state.liveness, gate.server):
        assert part.settings is gate.settings, type(part).__name__
    assert gate.server.settings.gate.client_idle_seconds == 7.0
    assert gate.retention.keep_seconds == 2.0 * 86400
    assert gate.state.limits.global_cap == 5
    assert gate.state.adaptive is not None
    assert gate.state.adaptive.interval == 2.5 and gate.state.adaptive.global_cap == 5


# -- the degraded gate ---------------------------------------------------------------------------


class Recording(Journal):
    def __init__(self) -> None:
        super().__init__("volute-gate-test")
        self.events: list[events.BaseEvent] = []

    def emit(self, event: events.BaseEvent) -> None:
        self.events.append(event)


def test_a_gate_without_a_valid_config_refuses_everything_with_78_until_reloaded(
    tmp_path: Path,
) -> None:
    path = tmp_path / "volutectl.toml"
    path.write_text("[limits]\nglobal_concurent_turns = 2\n")
    config = ConfigFile(str(path), {})
    with pytest.raises(ConfigError) as raised:
        config.load()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "gate.sock"))
    listener.listen(8)
    journal = Recording()
    degraded = Degraded(raised.value, journal, listener)
    stop_read, stop_write = os.pipe2(os.O_NONBLOCK)
    reload_read, reload_write = os.pipe2(os.O_NONBLOCK)
    result: list[Settings | None] = []
    thread = threading.Thread(
        target=lambda: result.append(
            degraded.serve(stop_read, reload_read, lambda: config.load().settings)
        )
    )
    thread.start()
    try:
        for request in (b'{"v":1,"op":"deliver","mind":"m","message":"x"}\n', b"nonsense\n"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.settimeout(5)
                client.connect(str(tmp_path / "gate.sock"))
                client.sendall(request)
                reply = client.makefile().readline()
            assert '"code":78' in reply and "global_concurent_turns" in reply, reply
            assert "did you mean `global_concurrent_turns`?" in reply
            assert "systemctl reload volute-gate" in reply
        # More lines at once than one pass takes: each is answered, none waits for more.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(5)
            client.connect(str(tmp_path / "gate.sock"))
            client.sendall(b'{"v":1,"op":"ping"}\n' * 600)
            replies = client.makefile()
            assert all('"code":78' in replies.readline() for _ in range(600))
        [invalid] = [e for e in journal.events if isinstance(e, events.GateConfigInvalid)]
        assert "global_concurent_turns" in invalid.error
        # Fixed, then reloaded: serve returns the settings, for the whole gate to start.
        path.write_text('[minds.m]\ncommand = "true"\n')
        os.write(reload_write, b"x")
        thread.join(10)
        assert not thread.is_alive()
        [settings] = result
        assert settings is not None and list(settings.minds) == ["m"]
        # The listener itself stays open for that gate: the server closed only its copy.
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    finally:
        os.write(stop_write, b"x")
        thread.join(10)
        listener.close()
    assert EX_CONFIG == 78
