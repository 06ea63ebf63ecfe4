"""The real gate, in-process and without root, turn by turn: admission and its caps,
fold-in, interrupts, retries and dead letters, time limits, scopes around dead
processes, and a crash at each step of a turn's start.

The gate is volutectl.gate.loop.Gate on real sockets and a real SQLite file, its turns real
processes (a shell probe that logs what each turn received and how it exited); systemd
is tests/unit/fake_systemd.py, held to systemd's promises by tests/contract.py. The
system tier proves the same against real systemd; this tier reaches the moments that
are hard to time there, in milliseconds.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_clock import FakeClock
from tests.unit.gate_harness import Harness, Turns, settled
from volutectl import events, faults, names
from volutectl.states import HoldReason, Outcome, QueueState
from volutectl.store.queue import NewDelivery, Store
from volutectl.systemd.port import ScopeProperties


def gate(tmp_path: Path, minds: dict[str, str], **options: Any) -> Harness:
    return Harness(tmp_path, minds=minds, **options)


def deliver(harness: Harness, mind: str, session: str = "main", **fields: Any) -> int:
    reply = harness.connect().request(
        {"op": "deliver", "mind": mind, "session": session, "message": "m", **fields}
    )
    assert reply.get("ok") is True, reply
    return int(reply["id"])


def rows(harness: Harness, state: QueueState) -> list[Any]:
    return harness.gate.state.store.list_rows([state])


# -- admission -------------------------------------------------------------------------


def test_a_fan_out_holds_the_global_cap_and_one_turn_per_mind(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness], hold: Path
) -> None:
    command, log = probe
    # Every turn waits for `hold` before it runs: the first two still run when each
    # mind's second session is delivered, however slowly a loaded machine delivers.
    minds = {f"m{i}": f"while [ -e {hold} ]; do sleep 0.02; done; {command} 0.15" for i in range(6)}
    # The static cap alone: an adaptive limit under it could hold the fan-out to 1.
    limits = {"global_concurrent_turns": 2, "adaptive": {"enabled": False}}
    harness = gate(tmp_path, minds, limits=limits)
    harnesses.append(harness)
    hold.touch()
    acked = [deliver(harness, mind, session) for session in ("a", "b") for mind in minds]
    hold.unlink()
    harness.pump(lambda: settled(harness), timeout=30)
    assert harness.manager.most_live == 2  # never more, from the fake systemd's own count
    assert max(harness.manager.most_per_mind.values()) == 1
    assert sorted(log.runs()) == sorted(acked) and set(log.runs().values()) == {1}
    done = rows(harness, QueueState.DONE)
    assert all(row.attempts == 0 for row in done)
    reasons = {held.reason for held in harness.journal.of(events.DeliveryHeld)}
    assert {HoldReason.GLOBAL_CAP, HoldReason.MIND_BUSY} <= reasons


def test_a_session_gets_its_deliveries_in_order_one_batch_per_turn(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    command, log = probe
    harness = gate(tmp_path, {"m": f"{command} 0.3"})
    harnesses.append(harness)
    first = deliver(harness, "m", "other")
    harness.pump(lambda: log.started() == 1)
    batch = [deliver(harness, "m", "chat") for _ in range(3)]  # held behind "other"
    harness.pump(lambda: settled(harness), timeout=30)
    starts = [fields for fields in log.lines() if fields[0] == "start"]
    assert [[int(x) for x in fields[5:]] for fields in starts] == [[first], batch]


# -- fold-in and interrupts --------------------------------------------------------------


def test_a_delivery_to_a_running_session_folds_into_its_inbox(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    command, log = probe
    harness = gate(tmp_path, {"reader": f"{command} 0.6", "deaf": "sleep 0.4"})
    harnesses.append(harness)
    first = deliver(harness, "reader", "s")
    harness.pump(lambda: log.started() == 1)
    second = deliver(harness, "reader", "s")
    harness.pump(lambda: settled(harness), timeout=30)
    assert log.started() == 1  # no second process
    assert log.runs() == {first: 1, second: 1}
    # A turn that never takes its inbox: the folded delivery goes to the next turn,
    # with no attempt counted.
    a = deliver(harness, "deaf", "s")
    harness.pump(lambda: any(n.startswith("volute-turn-deaf") for n in harness.manager.scopes))
    b = deliver(harness, "deaf", "s")
    harness.pump(lambda: settled(harness), timeout=30)
    deaf_scopes = [n for n in harness.manager.scopes if n.startswith("volute-turn-deaf")]
    assert len(deaf_scopes) == 2
    assert all(row.attempts == 0 for row in rows(harness, QueueState.DONE))
    assert {a, b} <= {row.id for row in rows(harness, QueueState.DONE)}


def test_an_offer_the_inbox_refuses_goes_to_the_next_turn_and_stops_nothing(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    """A turn that puts a directory where its next delivery's file goes: the offer fails
    (root creates nothing in the inbox), and that costs admission nothing."""
    command, log = probe
    blocker = 'for i in $(seq 1 9); do mkdir "$VOLUTE_INBOX/$i.json"; done; sleep 0.4'
    harness = gate(tmp_path, {"blocked": blocker, "other": f"{command} 0"})
    harnesses.append(harness)
    first = deliver(harness, "blocked", "s")
    harness.pump(lambda: any(n.startswith("volute-turn-blocked") for n in harness.manager.scopes))
    folded = deliver(harness, "blocked", "s")
    other = deliver(harness, "other", "s")
    harness.pump(lambda: settled(harness), timeout=30)
    assert harness.journal.messages("error") == []
    done = rows(harness, QueueState.DONE)
    assert {first, folded, other} == {row.id for row in done}
    assert all(row.attempts == 0 for row in done)
    blocked = [n for n in harness.manager.scopes if n.startswith("volute-turn-blocked")]
    assert len(blocked) == 2  # the refused delivery went to a turn of its own
    assert log.runs() == {other: 1}


def test_an_interrupt_signals_the_turn_and_counts_as_carried(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    command, log = probe
    harness = gate(tmp_path, {"m": f"{command} 5 exit-on-int"})
    harnesses.append(harness)
    first = deliver(harness, "m", "s")
    harness.pump(lambda: log.started() == 1)
    second = deliver(harness, "m", "s", interrupt=True)
    harness.pump(lambda: settled(harness), timeout=30)
    [(unit, signum)] = harness.manager.signals
    assert unit.startswith("volute-turn-m-") and signum == signal.SIGINT
    assert [f[4] for f in log.lines() if f[0] == "end"] == ["130"]
    done = rows(harness, QueueState.DONE)
    assert {row.id for row in done} == {first, second} and all(r.attempts == 0 for r in done)
    ends = [(e.outcome, e.exit_status) for e in harness.journal.of(events.TurnEnded)]
    assert (Outcome.INTERRUPTED, 130) in ends


def test_the_turns_of_one_pass_are_committed_together_and_a_start_unanswered_returns_the_rest(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    """Three minds' deliveries held by a pause of every mind, then resumed: one pass
    starts all three, committed together (one started_at, consecutive ids). systemd gives
    the first start no answer, so starts pause: the other two are never handed to their
    hands (one start_scope call in all) and go back as the first's do, no attempt
    counted. Once systemd answers, each runs once."""
    command, log = probe
    minds = {name: f"{command} 0" for name in ("m", "n", "o")}
    # A fake clock: the second's pause of starts lasts until the test moves it on.
    clock = FakeClock()
    limits = {"global_concurrent_turns": 3, "adaptive": {"enabled": False}}
    harness = gate(tmp_path, minds, limits=limits, clock=clock)
    harnesses.append(harness)
    assert harness.connect().request({"op": "pause"})["changed"] == ["*"]
    ids = [deliver(harness, mind, "s") for mind in minds]
    harness.manager.silent.add("start_scope")
    assert harness.connect().request({"op": "resume"})["ok"] is True
    harness.pump(lambda: len(harness.journal.of(events.TurnNeverStarted)) == 3)
    assert harness.manager.calls.get("start_scope") == 1
    never = harness.journal.of(events.TurnNeverStarted)
    assert "no answer to an earlier start of the pass" in never[1].error
    turns = [harness.gate.state.store.turn(event.turn_id) for event in never]
    assert len({turn.started_at for turn in turns if turn is not None}) == 1
    assert sorted(event.turn_id for event in never) == list(
        range(never[0].turn_id, never[0].turn_id + 3)
    )
    pending = rows(harness, QueueState.PENDING)
    assert sorted(row.id for row in pending) == ids
    assert all(row.attempts == 0 and row.last_error is None for row in pending)
    assert log.started() == 0
    harness.manager.silent.clear()
    clock.advance(2.0)
    harness.pump(lambda: settled(harness), timeout=30)
    assert log.runs() == {delivery: 1 for delivery in ids}


def test_a_start_systemd_never_answers_is_no_attempt_and_runs_once_it_answers(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    """A daemon-reexec drops every D-Bus call in flight: a start caught in it never ran
    its command (the child exits unreleased). It is not the delivery's failure: no
    attempt, no backoff; the gate starts nothing more for a second, then tries again."""
    command, log = probe
    harness = gate(tmp_path, {"m": f"{command} 0"})
    harnesses.append(harness)
    harness.manager.silent.add("start_scope")
    delivery = deliver(harness, "m", "s")
    harness.pump(lambda: bool(harness.journal.of(events.TurnNeverStarted)))
    [row] = [r for r in rows(harness, QueueState.PENDING) if r.id == delivery]
    assert row.attempts == 0 and row.last_error is None
    assert log.started() == 0  # the command never ran
    harness.manager.silent.clear()
    harness.pump(lambda: settled(harness), timeout=30)
    [done] = rows(harness, QueueState.DONE)
    assert done.id == delivery and done.attempts == 0
    assert log.runs() == {delivery: 1}
    assert harness.journal.messages("error") == []


def test_after_a_start_systemd_never_answers_no_turn_starts_for_a_second(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    """ "Start nothing for a second" is a deadline (gate/lifecycle.py's PauseStarts), not
    a flag one pass clears: a delivery for another mind, admitted in a pass inside that
    second, starts only once the second is over."""
    command, _ = probe
    harness = gate(tmp_path, {"m": f"{command} 0", "n": f"{command} 0"})
    harnesses.append(harness)
    emitted: list[tuple[float, events.BaseEvent]] = []  # each event, and when
    emit = harness.journal.emit

    def timed(event: events.BaseEvent) -> None:
        emitted.append((time.time(), event))
        emit(event)

    harness.journal.emit = timed  # type: ignore[method-assign]
    harness.manager.silent.add("start_scope")
    deliver(harness, "m", "s")
    harness.pump(lambda: bool(harness.journal.of(events.TurnNeverStarted)))
    harness.manager.silent.clear()
    deliver(harness, "n", "s")
    harness.pump(lambda: settled(harness), timeout=30)
    [never_at] = [at for at, event in emitted if isinstance(event, events.TurnNeverStarted)]
    started = [at for at, event in emitted if isinstance(event, events.TurnStarted)]
    assert len(started) == 2  # m's delivery, tried again, and n's
    assert min(started) >= never_at + 1.0  # none inside the second


# -- failures --------------------------------------------------------------------------------


def test_a_failing_turn_is_retried_then_dead_and_its_waiter_told(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = gate(
        tmp_path, {"m": "exit 3"}, max_attempts=2, backoff_initial_seconds=0.05,
        backoff_max_seconds=0.05,
    )  # fmt: skip
    harnesses.append(harness)
    waiter = harness.connect()
    ack = waiter.request({"op": "deliver", "mind": "m", "message": "x", "wait": True})
    # The waiter is told once the delivery settles: after its second, last attempt.
    settled_event = waiter.reply(timeout=10)
    assert settled_event == {
        "v": 1, "ok": True, "event": "dead", "id": ack["id"], "error": "turn 2 exited 3",
        "exit_code": 3, "turn_id": 2, "outcome": "failed",
    }  # fmt: skip
    [dead] = rows(harness, QueueState.DEAD)
    assert (dead.id, dead.attempts, dead.last_error) == (ack["id"], 2, "turn 2 exited 3")
    # Retried by hand: pending again, attempts reset, and it fails its way back.
    peer = harness.connect()
    assert peer.request({"op": "retry", "ids": [dead.id, 999]})["changed"] == [dead.id]
    harness.pump(lambda: bool(rows(harness, QueueState.DEAD)), timeout=10)
    waiter = harness.connect()
    waiter.request({"op": "deliver", "mind": "m", "message": "y", "wait": True})
    harness.pump(lambda: len(rows(harness, QueueState.DEAD)) == 2, timeout=10)
    assert peer.request({"op": "drop", "ids": [dead.id]})["changed"] == [dead.id]


def test_a_turn_past_its_time_limit_is_stopped_and_reported_as_timeout(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    harness = gate(
        tmp_path,
        {"polite": "trap 'exit 143' TERM; sleep 30 & wait", "stubborn": "trap '' TERM; sleep 30"},
        turns={"max_runtime_seconds": 0.3, "timeout_grace_seconds": 0.3},
        max_attempts=1,
    )
    harnesses.append(harness)
    polite, stubborn = harness.connect(), harness.connect()
    polite.request({"op": "deliver", "mind": "polite", "message": "x", "wait": True})
    stubborn.request({"op": "deliver", "mind": "stubborn", "message": "x", "wait": True})
    started = time.monotonic()
    ended = [polite.reply(timeout=10), stubborn.reply(timeout=10)]
    assert time.monotonic() - started < 5  # 0.3 s, then 0.3 s of grace: not 30 s
    # Their one attempt timed out: dead, and a waiter exits 124, as timeout(1) does.
    assert [(e["event"], e["outcome"], e["exit_code"]) for e in ended] == [
        ("dead", "timeout", 124)
    ] * 2
    assert ["exit status 143" in e["error"] for e in ended] == [True, False]
    assert "exit status 137" in ended[1]["error"]  # SIGKILL: 128 + 9
    harness.pump(lambda: len(rows(harness, QueueState.DEAD)) == 2)
    assert all("ran past its time limit" in str(r.last_error) for r in rows(harness, "dead"))  # type: ignore[arg-type]


# -- systemd's word ----------------------------------------------------------------------


def zombie() -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0)
    # A zombie once it has exited, whenever a loaded machine lets it: waited for, not
    # reaped (WNOWAIT), so that its pid stays for the scope to be started around.
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    return pid


@pytest.mark.serial
def test_scopes_around_dead_processes_are_stopped_and_settled_at_start(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness]
) -> None:
    command, log = probe
    harness = Harness(tmp_path, start=False, minds={"m": command, "other": command},
                      limits={"global_concurrent_turns": 1})  # fmt: skip
    harnesses.append(harness)
    # What a gate SIGKILLed with its cgroup between fork and scope leaves: a committed
    # turn, and a scope started around its dead child; plus one nobody knows.
    store = Store(harness.settings.gate.state_dir / "queue.sqlite3")
    [stranded] = store.add_deliveries([NewDelivery("m", "main", b"x")])
    assert isinstance(stranded, int), stranded
    turn, _ = store.start_turn("m", "main", lambda t: names.turn_scope_name("m", t),
                               [stranded], time.time())  # fmt: skip
    store.close()
    unit = names.turn_scope_name("m", turn)
    slice_ = harness.settings.turns.slice
    for name in (unit, "volute-turn-other-9999.scope"):
        pid = zombie()
        harness.manager.start_scope(name, [pid], ScopeProperties(slice=slice_))
        os.waitpid(pid, 0)
    assert harness.manager.active_state(unit) == "active"
    assert harness.manager.unit_processes(unit) == []
    harness.restart()
    other = deliver(harness, "other")  # the orphan must not hold the cap of 1
    harness.pump(lambda: settled(harness), timeout=10)
    assert log.runs() == {stranded: 1, other: 1}
    assert all(row.attempts == 0 for row in rows(harness, QueueState.DONE))
    assert harness.manager.list_units(slice_, ["volute-turn-*"]) == []
    stopped = harness.journal.of(events.TurnScopeEmpty) + harness.journal.of(events.EmptyScopeFound)
    assert len(stopped) == 2 and {e.level for e in stopped} == {"warning"}


# -- a crash at each step --------------------------------------------------------------------


@pytest.mark.parametrize("point", faults.POINTS)
def test_a_crash_at_each_step_loses_nothing_and_runs_nothing_twice(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness], point: str
) -> None:
    command, log = probe
    harness = gate(tmp_path, {"m": f"{command} 0.3"})
    harnesses.append(harness)
    rid = "ab" * 16
    faults.arm(point)
    client = harness.connect()
    client.send(
        b'{"v":1,"op":"deliver","mind":"m","session":"s","message":"one","request_id":"'
        + rid.encode() + b'"}\n'
    )  # fmt: skip
    acked: list[int] = []
    if point in ("fold_committed", "inbox_written"):
        faults.arm(None)
        acked.append(int(client.reply()["id"]))
        harness.pump(lambda: log.started() == 1)
        faults.arm(point)
        client = harness.connect()
        client.send(b'{"v":1,"op":"deliver","mind":"m","session":"s","message":"two"}\n')
    with pytest.raises(faults.SimulatedCrash):
        harness.pump(lambda: False, timeout=10)
    if client.has_line():
        acked.append(int(client.reply()["id"]))
    harness.crash()
    harness.restart()
    if point == "request_committed":  # no ack came: the client sends the same request again
        assert not acked
        reply = harness.connect().request(
            {"op": "deliver", "mind": "m", "session": "s", "message": "one", "request_id": rid}
        )
        acked.append(int(reply["id"]))
        assert sum(harness.gate.state.store.counts().values()) == 1  # not a second row
    harness.pump(lambda: settled(harness) and not harness.gate.state.turns.all(), timeout=15)
    assert log.runs() == dict.fromkeys(acked, 1)
    assert all(row.attempts == 0 for row in rows(harness, QueueState.DONE))
    assert harness.manager.list_units(harness.settings.turns.slice, ["volute-turn-*"]) == []


@pytest.mark.parametrize("point", ["start_committed", "forked", "release_recorded"])
def test_a_crash_amid_the_starts_of_one_pass_loses_nothing_and_runs_nothing_twice(
    tmp_path: Path, probe: tuple[str, Turns], harnesses: list[Harness], point: str
) -> None:
    """Three turns committed together by one pass (a pause of every mind lifted): a crash
    once they are committed, as the first one's child forks, or once the first is
    released and recorded, the other two committed and never handed to their hands. The
    next gate finds each as a lone start would leave it: each delivery runs once, none
    with an attempt counted."""
    command, log = probe
    minds = {name: f"{command} 0.2" for name in ("m", "n", "o")}
    limits = {"global_concurrent_turns": 3, "adaptive": {"enabled": False}}
    harness = gate(tmp_path, minds, limits=limits)
    harnesses.append(harness)
    assert harness.connect().request({"op": "pause"})["changed"] == ["*"]
    acked = [deliver(harness, mind, "s") for mind in minds]
    faults.arm(point)
    client = harness.connect()
    client.send(b'{"v":1,"op":"resume"}\n')
    with pytest.raises(faults.SimulatedCrash):
        harness.pump(lambda: False, timeout=10)
    committed = [t for t in harness.gate.state.store.open_turns() if t.mind in minds]
    assert len(committed) == 3  # the crash came after the one commit of all three
    harness.crash()
    harness.restart()
    harness.pump(lambda: settled(harness) and not harness.gate.state.turns.all(), timeout=15)
    assert log.runs() == dict.fromkeys(acked, 1)
    assert all(row.attempts == 0 for row in rows(harness, QueueState.DONE))
    assert harness.manager.list_units(harness.settings.turns.slice, ["volute-turn-*"]) == []
