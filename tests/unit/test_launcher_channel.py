"""The split gate in-process: the gate gives its orders to the launcher's order loop
(volutectl/launcher/service.py, in a thread) over a real socket (volutectl/wire/orders.py), and
what the launcher refuses, and what the gate does when the launcher is lost or away.

Turns are real processes; systemd is tests/unit/fake_systemd.py. The same in a real
systemd, with the real units and users, is tests/system/test_gate_split.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness, settled
from volutectl import events
from volutectl.errors import VoluteError
from volutectl.events import EventName
from volutectl.launcher.hands import Launched, LauncherLost, RemoteHands
from volutectl.launcher.service import (
    EXECUTE,
    ReloadingSettings,
    allowed_uids,
    bind_listener,
    peer_uid,
)
from volutectl.wire import orders

# -- the channel's types ----------------------------------------------------------------

EVERY_ORDER: list[orders.Order[Any]] = [
    orders.StartTurn(turn_id=7, mind="mimsy", session="chat", delivery_ids=(1, 2)),
    orders.Offer(turn_id=7, mind="mimsy", delivery_id=3),
    orders.Interrupt(7, "mimsy"),
    orders.Stop(7, "mimsy"),
    orders.Inspect(7, (3,)),
    orders.Remove(7),
    orders.Sweep((1, 7)),
    orders.Sample((1, 7)),
    orders.MoveIn(turn_id=7, mind="mimsy", pids=2),
    orders.MoveBack(turn_id=7, mind="mimsy"),
]


@pytest.mark.parametrize("order", EVERY_ORDER, ids=lambda order: order.ORDER)
def test_every_order_goes_through_the_channel_unchanged(order: orders.Order[Any]) -> None:
    line = orders.encode(order)
    assert line.endswith(b"\n") and json.loads(line)["v"] == orders.VERSION
    assert orders.decode_order(line.rstrip(b"\n")) == order


def test_every_reply_goes_through_the_channel_unchanged() -> None:
    for reply in (
        orders.Done(),
        orders.Started(42),
        orders.Report(started=True, exit_status=None, ended_at=1.5, not_taken=(3, 4)),
        orders.Report(True, 0, 1.5, (), written_bytes=3 << 20),
        orders.Written((7, 9), (0, 3 << 20)),
        orders.Refused("no"),
        orders.Moved((41, 42), ("a.service", "session-3.scope")),
    ):
        assert orders.decode_reply(orders.encode(reply).rstrip(b"\n")) == reply


def test_every_order_declares_its_reply_and_has_one_executor() -> None:
    """One table carries out orders (volutectl/launcher/service.py): an order type
    without an entry would be refused, one whose reply is not declared could not be
    checked by the gate (RemoteHands.ask)."""
    assert set(EXECUTE) == set(orders.ORDERS.values())
    for order in orders.ORDERS.values():
        assert order.answer() in orders.REPLIES.values(), order
    assert orders.StartTurn.answer() is orders.Started
    assert orders.Inspect.answer() is orders.Report


def test_a_started_reply_never_carries_its_descriptor_in_the_line() -> None:
    line = orders.encode(orders.Started(42, pidfd=9))
    assert json.loads(line) == {"v": orders.VERSION, "reply": "started", "pid": 42}
    # A line that names one anyway is not believed: the descriptor is the one passed.
    assert orders.decode_reply(line.replace(b"}", b',"pidfd":3}')) == orders.Started(42)


def test_a_reply_of_another_kind_than_the_order_declares_is_a_lost_launcher(
    tmp_path: Path,
) -> None:
    """The gate checks each reply against its order's declared reply: a launcher that
    answers an inspect with `done` is not believed, and the connection is dropped."""
    path = tmp_path / "launcher.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        hands = RemoteHands(path, lambda: [])
        connect = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connect.connect(str(path))
        peer, _ = listener.accept()
        hands.sock = connect
        with peer:
            peer.sendall(orders.encode(orders.Done()))
            with pytest.raises(LauncherLost, match="answered a inspect with a done"):
                hands.inspect(7, ())
        assert hands.sock is None  # dropped: the next order connects again
        hands.close()


def test_a_report_across_an_upgrade_decodes_either_way() -> None:
    """The gate and the launcher restart one after the other on an upgrade: a report
    from an older launcher lacks written_bytes, a newer one's may carry a field this
    gate does not know. Both decode; an order to the root launcher stays exact."""
    old = b'{"v":1,"reply":"report","started":true,"exit_status":0,"ended_at":1.5,"not_taken":[]}'
    assert orders.decode_reply(old) == orders.Report(True, 0, 1.5, (), written_bytes=None)
    newer = old.replace(b"}", b',"written_bytes":4096,"read_bytes":7}')
    assert orders.decode_reply(newer) == orders.Report(True, 0, 1.5, (), written_bytes=4096)
    with pytest.raises(orders.OrderError, match="missing fields"):
        orders.decode_reply(b'{"v":1,"reply":"report","started":true}')
    with pytest.raises(orders.OrderError, match="unexpected fields"):
        orders.decode_order(b'{"v":1,"order":"remove","turn_id":1,"also":2}')


BAD_ORDERS = {
    "no version": b'{"order":"remove","turn_id":1}',
    "another version": b'{"v":2,"order":"remove","turn_id":1}',
    "unknown order": b'{"v":1,"order":"chown","path":"/etc/passwd"}',
    "an extra field": b'{"v":1,"order":"remove","turn_id":1,"path":"/etc"}',
    "a missing field": b'{"v":1,"order":"stop","turn_id":1}',
    "a bool for an id": b'{"v":1,"order":"remove","turn_id":true}',
    "a negative id": b'{"v":1,"order":"remove","turn_id":-1}',
    "a huge id": b'{"v":1,"order":"remove","turn_id":99999999999999999999999}',
    "a string for an id": b'{"v":1,"order":"remove","turn_id":"1"}',
    "a path for a mind": b'{"v":1,"order":"stop","turn_id":1,"mind":"../../etc"}',
    "a unit for a mind": b'{"v":1,"order":"stop","turn_id":1,"mind":"ssh.service x"}',
    "a bad session": b'{"v":1,"order":"start","turn_id":1,"mind":"m","session":"a b",'
    b'"delivery_ids":[]}',
    "ids not a list": b'{"v":1,"order":"sweep","open_ids":{"1":2}}',
    "not json": b"rm -rf /",
    "not an object": b"[1]",
}


@pytest.mark.parametrize("line", BAD_ORDERS.values(), ids=BAD_ORDERS.keys())
def test_an_order_that_does_not_fit_its_type_is_refused(line: bytes) -> None:
    with pytest.raises(orders.OrderError):
        orders.decode_order(line)


def test_a_line_past_the_bound_is_refused_before_it_ends() -> None:
    left, right = socket.socketpair()
    reader = orders.LineReader(max_line=1024)
    left.sendall(b"x" * 70_000)
    with pytest.raises(orders.OrderError, match="longer than"):
        while True:
            reader.receive(right)
    left.close()
    right.close()


def test_a_payload_is_only_a_bounded_regular_file(tmp_path: Path) -> None:
    fd = orders.payload_fd(b"abc", "test")
    assert orders.read_payload(fd, 3) == b"abc"
    with pytest.raises(orders.OrderError, match="more than"):
        orders.read_payload(fd, 2)
    os.close(fd)
    read, write = os.pipe()  # a FIFO never blocks the launcher: it is refused
    with pytest.raises(orders.OrderError, match="not a regular file"):
        orders.read_payload(read, 10)
    os.close(read)
    os.close(write)


# -- the gate and the launcher, split -------------------------------------------------------


def state_of(harness: Harness, delivery_id: int) -> str:
    row = harness.gate.state.store.row(delivery_id)
    assert row is not None
    return row.state


def test_a_split_gate_runs_folds_interrupts_and_settles_turns(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    log = tmp_path / "log"
    script = f"cat >> {log}; sleep 0.5; cat $VOLUTE_INBOX/*.json >> {log}; rm -f $VOLUTE_INBOX/*"
    harness = Harness(tmp_path, remote=True, minds={"m": script})
    harnesses.append(harness)
    assert isinstance(harness.gate.state.turns.hands, RemoteHands)
    first = harness.deliver_ok(mind="m")
    harness.pump(lambda: state_of(harness, first) == "running")
    [turn] = harness.gate.state.turns.all()
    assert turn.pid is not None and turn.pidfd >= 0  # the launcher's pidfd, passed over
    assert list(harness.manager.scopes) == [turn.unit]
    reply = harness.connect().request({"op": "deliver", "mind": "m", "message": "folded"})
    harness.pump(lambda: settled(harness))
    assert state_of(harness, first) == state_of(harness, int(reply["id"])) == "done"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["id"] for r in records] == [first, reply["id"]]
    assert not (tmp_path / "run" / "turns" / str(turn.id)).exists()  # removed by the launcher


def test_a_sample_through_the_launcher_says_what_each_running_turn_has_written(
    tmp_path: Path, harnesses: list[Harness], hold: Path
) -> None:
    # The turns write to the test's own disk (ext4 here: write_bytes counts what goes to
    # storage, so a tmpfs would read 0), then wait; the turn with no child is left out.
    hold.touch()
    script = "head -c {} /dev/zero > {}/w-$VOLUTE_MIND; while [ -e {} ]; do sleep 0.05; done"
    minds = {
        "writer": script.format(1 << 20, tmp_path, hold),
        "quiet": script.format(0, tmp_path, hold),
    }
    harness = Harness(tmp_path, remote=True, minds=minds)
    harnesses.append(harness)
    harness.deliver_ok(mind="writer")
    harness.deliver_ok(mind="quiet")
    harness.pump(lambda: len(harness.gate.state.turns.all()) == 2)
    turns = {turn.mind: turn.id for turn in harness.gate.state.turns.all()}
    hands = harness.gate.state.turns.hands

    def writer_wrote() -> bool:
        seen = hands.sample(list(turns.values())).get(turns["writer"])
        return seen is not None and seen.bytes >= 1 << 20

    harness.pump(writer_wrote)
    written = hands.sample([*turns.values(), 999])
    assert set(written) == set(turns.values())  # 999 is no turn of the launcher's
    assert written[turns["writer"]].bytes >= 1 << 20
    assert written[turns["quiet"]].bytes < 64 << 10
    hold.unlink()
    harness.pump(lambda: settled(harness))
    assert hands.sample(list(turns.values())) == {}  # ended: nothing running to read


def test_an_interrupt_reaches_the_turns_scope_through_the_launcher(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    # The signal's effect on a turn is tests/unit/test_gate_loop.py's (here the turn's
    # child is forked from a thread, where Python cannot reset its signal dispositions).
    harness = Harness(tmp_path, remote=True, minds={"m": "sleep 0.5"})
    harnesses.append(harness)
    first = harness.deliver_ok(mind="m")
    harness.pump(lambda: state_of(harness, first) == "running")
    [turn] = harness.gate.state.turns.all()
    harness.connect().request({"op": "deliver", "mind": "m", "message": "x", "interrupt": True})
    harness.pump(lambda: settled(harness), timeout=5)
    assert harness.manager.signals == [(turn.unit, signal.SIGINT)]
    row = harness.gate.state.store.row(first)
    assert row is not None and row.state == "done"


def test_a_launcher_that_is_away_holds_turns_says_so_once_and_they_start_when_it_is_back(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(tmp_path, remote=True, minds={"m": "true"}, clock=FakeClock())
    harnesses.append(harness)
    assert harness.launcher is not None
    harness.launcher.stop()
    delivery = harness.deliver_ok(mind="m")
    harness.advance(2.5)  # tried again each second of the gate's clock
    assert harness.manager.scopes == {} and state_of(harness, delivery) == "pending"
    failures = harness.journal.of(events.AdmissionFailing)  # said once
    assert len(failures) == 1, harness.journal.events
    assert "launcher does not answer" in failures[0].error
    harness.launcher.start()
    harness.advance(1.0)  # the next retry finds it
    harness.pump(lambda: state_of(harness, delivery) == "done")
    row = harness.gate.state.store.row(delivery)
    assert row is not None and row.attempts == 0  # the launcher's absence was no attempt


@pytest.mark.parametrize("carried_out", [True, False], ids=["started", "never-started"])
def test_a_start_whose_reply_is_lost_is_settled_on_systemds_word_alone(
    tmp_path: Path, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch, carried_out: bool
) -> None:
    log = tmp_path / "ran"
    harness = Harness(tmp_path, remote=True, minds={"m": f"echo ran >> {log}; sleep 0.3"})
    harnesses.append(harness)
    hands = harness.gate.state.turns.hands
    assert isinstance(hands, RemoteHands)
    real_start = hands.start
    lost: list[int] = []

    def start_then_lose(order: orders.StartTurn, stdin: bytes) -> Launched:
        if lost:
            return real_start(order, stdin)
        lost.append(order.turn_id)
        if carried_out:
            os.close(real_start(order, stdin).pidfd)
        hands.close()
        raise LauncherLost("the launcher was lost during a start: test")

    monkeypatch.setattr(hands, "start", start_then_lose)
    delivery = harness.deliver_ok(mind="m")
    harness.pump(lambda: settled(harness), timeout=10)
    row = harness.gate.state.store.row(delivery)
    assert row is not None and row.state == "done" and row.attempts == 0
    assert log.read_text() == "ran\n"  # exactly once: adopted if it ran, else run anew
    store = harness.gate.state.store
    first = store.turn(lost[0])
    assert first is not None and first.outcome == ("ok" if carried_out else "never_ran")
    assert (store.turn(lost[0] + 1) is None) == carried_out  # run anew only if it never ran


def test_the_launcher_refuses_a_peer_that_is_not_the_gate(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(tmp_path, remote=True, minds={"m": "true"})
    harnesses.append(harness)
    assert harness.launcher is not None
    harness.launcher.launcher.allowed = frozenset({os.getuid() + 1})
    hostile = RemoteHands(harness.launcher.path, lambda: [])
    with pytest.raises(VoluteError):
        hostile.remove(1)
    hostile.close()
    refusals = harness.launcher.journal.of(events.OrderConnectionRefused)
    assert os.getuid() in [refusal.uid for refusal in refusals]


def test_the_launcher_answers_a_bad_order_with_a_refusal_and_hangs_up(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(tmp_path, remote=True, minds={"m": "true"})
    harnesses.append(harness)
    assert harness.launcher is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(harness.launcher.path))
        sock.sendall(b'{"v":1,"order":"remove","turn_id":"../../etc"}\n')
        reply = sock.makefile("rb").readline()
        assert isinstance(orders.decode_reply(reply.rstrip(b"\n")), orders.Refused)
        assert sock.recv(10) == b""  # and hung up
    harness.deliver_ok(mind="m")  # the same launcher serves the gate still
    harness.pump(lambda: settled(harness))


def test_the_launcher_refuses_an_unknown_minds_offer_and_an_unclaimed_descriptor(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    # The same as tests/system/test_launcher_attacks.py, in-process: an offer for a mind
    # the config lacks ended the launcher on a KeyError; a descriptor no order takes was
    # kept, one per line, until the launcher's table was full.
    harness = Harness(tmp_path, remote=True, minds={"m": "true"})
    harnesses.append(harness)
    assert harness.launcher is not None
    hostile = RemoteHands(harness.launcher.path, lambda: [])
    with pytest.raises(VoluteError, match="mind 'nosuch' is not configured"):
        hostile.offer(orders.Offer(turn_id=1, mind="nosuch", delivery_id=2), b"{}\n")
    hostile.close()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(harness.launcher.path))
        null = os.open(os.devnull, os.O_RDONLY)
        line = orders.encode(orders.Inspect(turn_id=1, folded=()))
        orders.send_line(sock, line, (null,))
        os.close(null)
        reply = orders.decode_reply(sock.makefile("rb").readline().rstrip(b"\n"))
        assert isinstance(reply, orders.Refused) and "takes none" in reply.error
        assert sock.recv(10) == b""  # and hung up, closing the descriptor
    harness.deliver_ok(mind="m")  # the same launcher serves the gate still
    harness.pump(lambda: settled(harness))


# -- the launcher's own configuration and socket --------------------------------------------


def test_the_launcher_reads_the_config_again_when_it_changes_and_keeps_the_last_good(
    tmp_path: Path,
) -> None:
    config = tmp_path / "volutectl.toml"
    config.write_text('[minds.a]\ncommand = "true"\n')
    logged: list[events.BaseEvent] = []
    settings = ReloadingSettings(str(config), logged.append)
    first = settings()
    assert list(first.minds) == ["a"] and settings() is first  # unchanged: not read again
    config.write_text('[minds.a]\ncommand = "true"\n[minds.b]\ncommand = "true"\n')
    assert list(settings().minds) == ["a", "b"]  # a mind added for the gate is known here
    config.write_text("[minds.a]\ncommand = 3\n")
    assert list(settings().minds) == ["a", "b"]  # a broken file keeps the last good one
    assert [event.EVENT for event in logged] == [EventName.CONFIG_RELOADED, EventName.CONFIG_KEPT]
    assert [event.level for event in logged] == ["info", "warning"]


def test_a_launcher_run_by_hand_binds_a_socket_for_root_and_the_gate_only(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sub" / "launcher.sock"
    sock = bind_listener(path)
    try:
        mode = path.stat().st_mode & 0o777
        assert mode in (0o600, 0o660)  # 0660 with group volute-gate where it exists
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
            peer, _ = sock.accept()
            assert peer_uid(peer) == os.getuid()
            peer.close()
    finally:
        sock.close()
    assert 0 in allowed_uids()


def test_a_refusal_longer_than_a_field_may_be_still_reaches_the_gate_as_a_refusal(
    tmp_path: Path, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Were it cut off as undecodable, the start would look lost: tried again for ever.
    harness = Harness(tmp_path, remote=True, minds={"m": "true"}, max_attempts=1)
    harnesses.append(harness)
    assert harness.launcher is not None

    def refuse(order: orders.StartTurn, stdin: bytes) -> Launched:
        raise VoluteError("x" * (orders.MAX_TEXT * 2))

    monkeypatch.setattr(harness.launcher.hands, "start", refuse)
    delivery = harness.deliver_ok(mind="m")
    harness.pump(lambda: state_of(harness, delivery) == "dead")
    row = harness.gate.state.store.row(delivery)
    assert row is not None and row.attempts == 1


def test_a_move_ins_pidfds_go_with_its_line_and_a_miscount_is_refused(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = Harness(tmp_path, remote=True, minds={"m": "true"})
    harnesses.append(harness)
    assert harness.launcher is not None
    gate = RemoteHands(harness.launcher.path, lambda: [])
    pidfd = os.pidfd_open(os.getpid())
    try:
        # The descriptor came with the line: the launcher got as far as its own checks
        # (no scope of turn 5 was started here).
        with pytest.raises(VoluteError, match="turn_id: .* not a scope this launcher started"):
            gate.move_in(orders.MoveIn(turn_id=5, mind="m", pids=1), (pidfd,))
        # One announced, two sent: refused before any check.
        with pytest.raises(VoluteError, match="1 descriptors were announced, 2 came"):
            gate.move_in(orders.MoveIn(turn_id=5, mind="m", pids=1), (pidfd, pidfd))
    finally:
        os.close(pidfd)
        gate.close()
    harness.deliver_ok(mind="m")  # the same launcher serves the gate still
    harness.pump(lambda: settled(harness))
