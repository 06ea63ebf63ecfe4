"""The gate: one event loop over file descriptors, no polling.

It waits in one select() (volutectl/gate/reactor.py) on: the listening socket and its
clients (volutectl/gate/server.py), the D-Bus connection (scope-ended signals), a pidfd
per turn's main process, the test-slot watch, the PSI trigger when enabled, the
adaptive limit's probe (volutectl/gate/adaptive.py), and a stop fd; each part
registers its descriptors with a callback. The select() times out only for real
deadlines, all on the monotonic clock: a failed delivery's backoff, a turn's
time limit, a question to systemd to ask again, a retry of admission, a checkpoint of
the queue, an idle client, the watchdog, retention's next batch, and the adaptive
limit's next reading (only while turns run or wait) and its held-back journal entry.

Each pass (`step`): answer the requests that came (volutectl/gate/serving.py:
deliveries share one commit, acknowledged once the pass's fsync (its starts' commit,
or the sync before it sleeps) has made them durable; after one, requests from
other clients gather a while before they are served, `gather_until`, so that a burst
of deliveries shares its commits), learn which turns ended
(volutectl/gate/liveness.py), then run admission against the scopes that hold a place:
`PendingIndex.admit` (volutectl/store/index.py), which keeps the pending rows indexed
and decides with the pure rules of volutectl/core/admission.py; then carry out its
decisions (volutectl/gate/turns.py). A client waiting for an outcome is told by
volutectl/gate/outcomes.py. Retention's batch (volutectl/store/retention.py) comes
last, and only in a pass that started no turn.

`Gate(settings)` builds every part, or fails having opened nothing that stays;
`run(stop_fd)` serves until told to stop. A byte on `reload_fd` (SIGHUP: `systemctl
reload volute-gate`) has it read its config file again in the loop (`reload`): what
volutectl/config/reload.py says may change applies at once, running turns and the
queue untouched; an invalid file is refused and the running config stays. Tests build
it with a fake systemd (tests/unit/fake_systemd.py), often a clock they move by hand
(tests/unit/fake_clock.py), and drive `step()` themselves. The
CLI edge (signals, sd_notify) is volutectl/cli/gate.py.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from volutectl import events
from volutectl.clock import SYSTEM, Clock
from volutectl.config.reload import ConfigFile, SettingsHolder, plan_reload
from volutectl.config.settings import Settings
from volutectl.core import admission
from volutectl.errors import VoluteError, one_line
from volutectl.gate import handlers, status
from volutectl.gate.adaptive import AdaptiveLimit, Sensor
from volutectl.gate.cpu import CpuSignal
from volutectl.gate.leases import Leases
from volutectl.gate.liveness import Evidence, Liveness
from volutectl.gate.outcomes import Settled, Waiters
from volutectl.gate.pressure import open_for_turns
from volutectl.gate.reactor import Reactor, only_wake
from volutectl.gate.server import REQUESTS_PER_PASS, Client, Incoming, Server
from volutectl.gate.serving import Serving
from volutectl.gate.state import GateState
from volutectl.gate.turns import Turn, Turns
from volutectl.launcher import preflight
from volutectl.launcher.hands import LocalHands, RemoteHands, TurnHands
from volutectl.slots.watch import FdStore, SlotWatch
from volutectl.states import HoldReason
from volutectl.store.indexed import IndexedStore
from volutectl.store.retention import Retention
from volutectl.systemd import activation
from volutectl.systemd.journal import Journal, sd_notify, watchdog_interval
from volutectl.systemd.port import SystemdManager
from volutectl.wire.messages import ConfigStatus

ADMIT_RETRY_SECONDS = 1.0
# One pass serves the requests that arrived in batches of this many (the deliveries of
# a batch share one commit), until server.REQUESTS_PER_PASS, or until PASS_SECONDS (no
# request is begun after it): then the loop goes round (reading, systemd's news,
# deadlines, admission), and the rest wait in the clients' buffers, taken in turns
# (volutectl/gate/server.py's `take_requests`).
REQUEST_BATCH = 16
PASS_SECONDS = 0.2


class Gate:
    """Built whole by its constructor (or not at all: what it opened is closed again)."""

    def __init__(
        self,
        settings: Settings,
        *,
        manager: SystemdManager | None = None,
        journal: Journal | None = None,
        listener: socket.socket | None = None,
        hands: TurnHands | None = None,
        config: ConfigFile | None = None,
        anchors: Sequence[tuple[str, int]] = (),
        clock: Clock = SYSTEM,
        sensor: Sensor | None = None,
        cpu: CpuSignal | None = None,
    ) -> None:
        """Open the store, connect to systemd (subscribed before anything is listed, so no
        turn can end unseen), take the socket, then take back the open turns. Every part
        reads `clock`; the adaptive limit measures with `sensor` (gate/adaptive.py's)
        and `cpu` (gate/cpu.py's)."""
        self.clock, self._sensor, self._cpu = clock, sensor, cpu
        # The settings every part reads, as the last reload left them (`apply`).
        self.held = SettingsHolder(settings)
        self.config = config  # the file to read again on reload; None: no reload
        self.journal = journal or Journal("volute-gate")
        self.reactor = Reactor(clock)
        self.stopping = False
        self.watchdog: float | None = None
        self.next_ping: float | None = None  # monotonic: the watchdog's next ping
        self.backoff_wake: float | None = None  # wall clock, as stored: a backoff's end
        self.admit_retry: float | None = None  # monotonic: admission failed, try again then
        self.admit_latch = events.Latch(self.journal.emit, ADMIT_RETRY_SECONDS)
        self.notifier = status.StatusNotifier()  # STATUS= for systemd, when it changes
        self.started = False  # this pass started a turn
        self._opened: list[Any] = [self.reactor]
        self._anchors = anchors  # repositories' descriptors from the fd store: the watch's
        try:
            self.state = self._build_state(manager, hands)
            handlers.load_pauses(self.state)  # a pause outlives the gate that took it
            self.state.config = ConfigStatus(loaded_at=clock.wall())
            if config is not None:
                self.state.minds_on_disk = config.minds_on_disk
            self._open_parts(listener)
            # What start loaded (a deep queue's index, the imports) lives as long as the
            # gate: keep the cyclic collector from scanning it again and again.
            gc.freeze()
        except BaseException:
            for part in reversed(self._opened):
                with contextlib.suppress(Exception):
                    part.close()
            raise

    def _open_parts(self, listener: socket.socket | None) -> None:
        """Around the state: the deadlines, the socket, the turns taken back, retention,
        and what wakes the loop (systemd, the slots, pressure, the adaptive limit)."""
        self._add_deadlines()
        self.server = Server(self.held, self.reactor, self.journal, inherited=listener)
        self._opened.append(self.server)
        self.waiters = Waiters(self.server, self.state.store)
        self.serving = Serving(self.state, self.server, self.waiters)
        self.state.leases = leases = Leases(
            self.held,
            self.state.store,
            self.state.turns,
            self.journal,
            send=self.server.reply,
            wake=self.mark_dirty,
            clock=self.clock,
            watch_fd=self._watch_lease_pid,
            unwatch_fd=self._unwatch,
        )
        self.server.on_drop = self._on_drop
        self.reactor.at(leases.deadline, self._on_reclaim_deadline)
        self.state.liveness.recover()
        leases.recover()
        self.state.store.sync()
        self.retention = Retention(
            self.state.store, lambda: self.settings.gate.retention_days, self.journal
        )
        self.retention.prepare(progress=self._starting)
        # systemd's news is read in every pass (pystemd may hold some it has read
        # already): its descriptor needs only to wake the loop.
        self.reactor.watch(self.state.manager.fileno(), only_wake)
        self.reactor.watch(self.state.slots.fileno(), self._on_slots)
        self._open_pressure()
        self._open_adaptive()
        preflight.log_failing(self.settings, self.journal.emit)  # status shows it too

    @property
    def settings(self) -> Settings:
        """The settings held now (`self.held`)."""
        return self.held.current

    def _build_state(self, manager: SystemdManager | None, hands: TurnHands | None) -> GateState:
        settings, journal = self.settings, self.journal
        store = IndexedStore(settings.gate.state_dir / "queue.sqlite3", clock=self.clock)
        self._opened.append(store)
        if manager is None:
            from volutectl.systemd.adapter import Manager

            manager = Manager.connect(user=settings.gate.manager == "user")
            self._opened.append(manager)  # one we were given is its giver's to close
        manager.watch_units()
        if hands is None:
            hands = self._hands(store, manager)
        self._opened.append(hands)
        turns = Turns(
            self.held,
            store,
            hands,
            journal,
            notify=self._notify,
            watch_fd=self._watch,
            unwatch_fd=self._unwatch,
            wake=self.mark_dirty,
            processes=manager.unit_processes,
            ask=Evidence(manager, hands, self.clock).about,
            durable=self._durable,
            clock=self.clock,
        )
        liveness = Liveness(
            self.held, store, manager, turns, wake=self.mark_dirty, clock=self.clock
        )
        slots = SlotWatch(
            settings.tests.repositories,
            settings.gate.state_dir / "repositories.json",
            journal.emit,
            max_slot_files=settings.tests.max_slot_files,
            anchors=self._anchors,
            fd_store=FdStore(keep=activation.keep, forget=activation.forget),
        )
        self._opened.append(slots)
        return GateState(
            held=self.held,
            store=store,
            manager=manager,
            turns=turns,
            liveness=liveness,
            slots=slots,
            pressure=None,  # opened once the rest is up: _open_pressure
            journal=journal,
            notify=self._notify,
            clock=self.clock,
            status_asks=status.SystemdAsks(clock=self.clock.monotonic),
        )

    def _hands(self, store: IndexedStore, manager: SystemdManager) -> TurnHands:
        """volute-launcher's socket when one is configured (the gate is unprivileged),
        else this process's own hands (a root gate run by hand)."""
        path = self.settings.gate.launcher_socket
        if path is None:
            return LocalHands(self.held, manager, self.journal)
        return RemoteHands(path, lambda: [row.id for row in store.open_turns()])

    # Callbacks for the parts: they run only once the constructor has finished.

    def _notify(self, settled: Settled) -> None:
        self.waiters.tell(settled)

    def _watch(self, fd: int, turn: Turn) -> None:
        """A turn's main process: its pidfd is readable once it has exited."""
        self.reactor.watch(fd, lambda mask: self._on_pidfd(turn))

    def _unwatch(self, fd: int) -> None:
        self.reactor.unwatch(fd)

    def _watch_lease_pid(self, fd: int, on_exit: Callable[[int], None]) -> None:
        """A process a lease moved in: its pidfd is readable once it has exited."""

        def on_ready(mask: int) -> None:
            self._guarded("a lease's process that exited", on_exit, mask)
            self.state.dirty = True

        self.reactor.watch(fd, on_ready)

    def _open_pressure(self) -> None:
        pressure = open_for_turns(self.settings, self.state.manager, self.journal.emit)
        if pressure is not None:
            self.reactor.watch(pressure.fileno(), self._on_pressure)
        self.state.pressure = pressure

    def _open_adaptive(self) -> None:
        adaptive = AdaptiveLimit(self.held, self.journal.emit, sensor=self._sensor, cpu=self._cpu)
        self._opened.append(adaptive)
        if adaptive.probe is not None:
            self.reactor.watch(adaptive.probe.fileno(), adaptive.on_probe_done)
        self.state.adaptive = adaptive
        self.state.turns.on_written = adaptive.learn_cost
        self.state.turns.sampled_written = adaptive.sampled_written

    def _starting(self) -> None:
        """Still busy starting (retention's first pass over an old database)."""
        sd_notify(
            "EXTEND_TIMEOUT_USEC=30000000\n"
            "STATUS=deleting expired rows, then reclaiming the queue's free pages (once)"
        )

    def _durable(self) -> None:
        self.serving.release()  # the pass's deliveries are durable: acknowledge them

    def mark_dirty(self) -> None:
        self.state.dirty = True

    def close(self) -> None:
        """Stop serving. Turns keep running in their scopes, and leases with them; a
        restarted gate adopts them, and the holders claim their leases again."""
        if self.state.leases is not None:
            self.state.leases.stopping = True  # closing its clients ends no lease
        self.server.close()
        for turn in self.state.turns.all():
            self.state.turns.close_pidfd(turn)
        self.state.slots.close()
        if self.state.pressure is not None:
            self.state.pressure.close()
        if self.state.adaptive is not None:
            self.state.adaptive.close()
        self.state.store.close()
        self.state.turns.hands.close()
        self.state.manager.close()
        self.reactor.close()

    def run(
        self,
        stop_fd: int | None = None,
        ready: Callable[[], None] | None = None,
        reload_fd: int | None = None,
    ) -> None:
        """Serve until `stop_fd` becomes readable, then close; read the config again
        whenever `reload_fd` does."""
        if stop_fd is not None:
            self.reactor.watch(stop_fd, self._on_stop)
        if reload_fd is not None:
            self.reactor.watch(reload_fd, lambda mask: self._on_reload(reload_fd))
        adaptive = self.state.adaptive
        if adaptive is not None and not self.state.store.open_turns():
            adaptive.measure_quiet_disk(self.clock.monotonic())
        if ready is not None:
            ready()
        limits = self.state.limits
        self.journal.emit(
            events.GateReady(
                socket=str(self.settings.gate.socket),
                global_cap=limits.global_cap,
                turns_per_mind=limits.turns_per_mind,
            )
        )
        self.watchdog = watchdog_interval() if self.settings.gate.watchdog else None
        self.next_ping = self.clock.monotonic() + self.watchdog if self.watchdog else None
        try:
            while not self.stopping:
                self.step(self.timeout())
        finally:
            self.close()

    # -- what wakes the loop ----------------------------------------------------------------

    def _on_pidfd(self, turn: Turn) -> None:
        self._guarded(f"the end of turn {turn.id}", self.state.liveness.reap, turn)

    def _on_slots(self, mask: int) -> None:
        if self.state.slots.on_ready():
            self.state.dirty = True  # a test run started or ended: the budget moved

    def _on_pressure(self, mask: int) -> None:
        assert self.state.pressure is not None
        if self.state.pressure.on_ready(self.clock.monotonic()):
            self.state.dirty = True

    def _on_stop(self, mask: int) -> None:
        self.stopping = True

    def _on_reload(self, fd: int) -> None:
        """SIGHUPs that came together are one reload. It runs here, inside the reactor's
        wait: the requests read in the same wait are served after it, by the new config."""
        with contextlib.suppress(BlockingIOError):
            while os.read(fd, 512):
                pass
        self.reload()

    # -- reload ---------------------------------------------------------------------------

    def reload(self) -> None:
        """Read the config file again and apply it, or refuse it and keep the running
        one. systemd hears RELOADING=1 first, and READY=1 once it is done."""
        sd_notify(
            # systemd compares it with its own CLOCK_MONOTONIC: the host's, not the gate's
            f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}\n"
            "STATUS=reloading the config"
        )
        assert self.state.config is not None
        try:
            if self.config is None:
                raise VoluteError("this gate was started with no config file to read again")
            read = self.config.load().settings
        except VoluteError as error:
            text = one_line(error)
            running = self.state.config
            self.state.config = ConfigStatus(
                loaded_at=running.loaded_at,
                refused=text,
                refused_at=self.clock.wall(),
                needs_restart=running.needs_restart,
            )
            self.journal.emit(events.GateConfigRefused(error=text))
        else:
            plan = plan_reload(self.settings, read)
            self.apply(plan.settings)
            self.state.config = ConfigStatus(
                loaded_at=self.clock.wall(), needs_restart=plan.needs_restart
            )
            self.journal.emit(
                events.GateConfigReloaded(
                    changed=" ".join(plan.changed), needs_restart=" ".join(plan.needs_restart)
                )
            )
        line = status.gate_line(self.state, self.clock.wall(), len(self.state.slots.held()))
        self.notifier.last = line
        sd_notify(f"READY=1\nSTATUS={line}")

    def apply(self, settings: Settings) -> None:
        """Run with `settings` from now on (volutectl/config/reload.py has kept the keys
        that only a restart applies): the holder every part reads swaps them at once.
        Running turns and the queue are not touched: admission decides again, under the
        new limits, and the adaptive limit moves what it learnt into its new bounds."""
        self.held.swap(settings)
        state = self.state
        if state.adaptive is not None:
            state.adaptive.reconfigure()
        preflight.log_failing(settings, self.journal.emit)
        state.dirty = True

    # -- deadlines ----------------------------------------------------------------------

    def _add_deadlines(self) -> None:
        """The gate's own deadlines (the server adds its clients'), on the monotonic
        clock; a part's stored wall-clock time is turned into it here."""
        self.reactor.at(lambda: self.next_ping, self._ping_watchdog)
        self.reactor.at(self._pressure_deadline, self._on_pressure_deadline)
        self.reactor.at(self._adaptive_deadline, self._on_adaptive_deadline)
        self.reactor.at(self._adaptive_log_deadline, self._on_adaptive_log_deadline)
        self.reactor.at(self._sample_deadline, self._sample_written)
        self.reactor.at(self._backoff_deadline, self._on_backoff_end)
        self.reactor.at(lambda: self.admit_retry, self._retry_admission)
        self.reactor.at(self.state.store.checkpoint_deadline, self._checkpoint)
        self.reactor.at(self._turn_deadline, self._on_turn_deadline)
        self.reactor.at(lambda: self.retention.deadline())  # its pass runs in `step`

    def timeout(self) -> float | None:
        """How long the wait may sleep: only until a real deadline, else forever."""
        if self.state.dirty or self.state.manager.has_pending_events():
            return 0.0  # a pass is owed (a new gate's first one included): no sleep
        if self.server.backlog or self.serving.left:
            now = self.clock.monotonic()
            until = self.gather_until(now)
            if until is None:
                return 0.0  # requests are owed a pass
            later = self.reactor.timeout()
            return min(until - now, later) if later is not None else until - now
        return self.reactor.timeout()

    def gather_until(self, now: float) -> float | None:
        """Until when the requests that wait gather before they are served: a while
        after a commit of deliveries, when clients other than its own wait
        (volutectl/gate/serving.py's Commit). None: serve them now."""
        commit = self.serving.last_commit
        if commit is None:
            return None
        waiting = set(self.server.backlog) | {client.fd for client, _ in self.serving.left}
        until = commit.gather_until(waiting)
        return until if until is not None and now < until else None

    def _ping_watchdog(self, now: float) -> None:
        sd_notify("WATCHDOG=1")
        self.next_ping = now + self.watchdog if self.watchdog else None

    def _pressure_deadline(self) -> float | None:
        return self.state.pressure.deadline() if self.state.pressure is not None else None

    def _on_pressure_deadline(self, now: float) -> None:
        if self.state.pressure is not None and self.state.pressure.on_deadline(now):
            self.state.dirty = True  # pressure fell below the resume threshold

    # The adaptive limit: built after the deadlines are registered, so asked through here.

    def _adaptive_deadline(self) -> float | None:
        adaptive = self.state.adaptive
        return adaptive.deadline() if adaptive is not None else None

    def _on_adaptive_deadline(self, now: float) -> None:
        adaptive = self.state.adaptive
        if adaptive is None:
            return
        self._sample_written(now)
        if adaptive.on_deadline(now):
            self.state.dirty = True  # the limit moved: admission decides again

    def _sample_deadline(self) -> float | None:
        adaptive = self.state.adaptive
        return adaptive.sample_deadline() if adaptive is not None else None

    def _sample_written(self, now: float) -> None:
        """Ask the launcher what the running turns have written so far (the adaptive
        limit's evidence: volutectl/core/iocost.py's `Running`)."""
        adaptive = self.state.adaptive
        if adaptive is None:
            return
        if adaptive.pause_over(now):
            self.state.dirty = True  # writers' pause ended: a held writer may start
        if turn_ids := adaptive.wants_sample(now):
            try:
                written = self.state.turns.hands.sample(turn_ids)
            except (VoluteError, OSError) as error:
                adaptive.sample_failed(
                    now, error.message if isinstance(error, VoluteError) else str(error)
                )
            else:
                if adaptive.observe(now, written):
                    self.state.dirty = True  # a turn showed its writes: decide again

    def _adaptive_log_deadline(self) -> float | None:
        adaptive = self.state.adaptive
        return adaptive.log_deadline() if adaptive is not None else None

    def _on_adaptive_log_deadline(self, now: float) -> None:
        if self.state.adaptive is not None:
            self.state.adaptive.on_log_deadline(now)

    def _backoff_deadline(self) -> float | None:
        """The next backoff to end. One that has ended stays due until a pass took it."""
        now = self.clock.wall()
        if self.backoff_wake is None or self.backoff_wake > now:
            self.backoff_wake = self.state.store.next_backoff_deadline(after=now)
        return self.reactor.from_wall_clock(self.backoff_wake)

    def _on_backoff_end(self, now: float) -> None:
        self.backoff_wake = None
        self.state.dirty = True

    def _retry_admission(self, now: float) -> None:
        self.admit_retry = None
        self.state.dirty = True

    def _checkpoint(self, now: float) -> None:
        # Off the handoff path: the gate has been quiet for a second.
        self._guarded("a checkpoint of the queue", self.state.store.checkpoint)

    def _on_drop(self, client: Client) -> None:
        """A client was dropped: its waiters are forgotten, its leases end."""
        self.waiters.forget(client)
        if self.state.leases is not None:
            self.state.leases.client_closed(client)

    def _on_reclaim_deadline(self, now: float) -> None:
        assert self.state.leases is not None
        self._guarded("a lease's reclaim window or stop", self.state.leases.on_deadline, now)

    def _turn_deadline(self) -> float | None:
        """A turn's time limit (stored on the wall clock), or a question to systemd due."""
        return self.reactor.from_wall_clock(self.state.liveness.next_deadline())

    def _on_turn_deadline(self, now: float) -> None:
        self._guarded("a turn's deadline", self.state.liveness.on_deadline, self.clock.wall())

    # -- one pass ---------------------------------------------------------------------------

    def step(self, timeout: float | None) -> None:
        """One pass of the loop: wait, take in what arrived, then admit."""
        ready = self.reactor.wait(timeout)
        self.started = False
        served = self._serve_requests()
        events = self.state.manager.process_events()
        for event in events:
            news = f"systemd's news of {event.name}"
            self._guarded(news, self.state.liveness.unit_ended, event.name)
        self.reactor.run_due()
        if self.state.dirty and not self.stopping:
            self.state.dirty = False
            self.admit()
        # A turn's settlement is durable before the gate sleeps; if the disk refuses,
        # the next pass tries again (what was not synced is still in the WAL).
        self._guarded("syncing the queue", self.state.store.sync)
        self.serving.release()  # the pass's deliveries are acknowledged once durable
        if self.state.leases is not None:
            self.state.leases.flush()  # after the pass's replies: a grant after its acquire's
        idle = not (ready or served or events)  # woke for deadlines alone
        mono = self.clock.monotonic()
        self._guarded("retention", self.retention.on_pass, mono, idle, self.started)

    def _serve_requests(self) -> int:
        """Serve this pass's share of the requests that arrived, batch after batch, and
        feed the watchdog between batches: at most server.REQUESTS_PER_PASS of them, and
        none begun after PASS_SECONDS (volutectl/gate/serving.py). How many were served."""
        if self.gather_until(self.clock.monotonic()) is not None:
            return 0  # the requests that wait gather a while (`timeout` wakes for them)
        deadline = self.clock.monotonic() + PASS_SECONDS
        served = 0
        while served < REQUESTS_PER_PASS:
            left, self.serving.left = self.serving.left, []
            budget = min(REQUEST_BATCH, REQUESTS_PER_PASS - served) - len(left)
            # Those left from the last pass first, but root's first of all.
            incoming = sorted(left + self.server.take_requests(max(0, budget)), key=_not_roots)
            if not incoming:
                break
            served += self.serving.serve(incoming, deadline)
            now = self.clock.monotonic()
            if self.next_ping is not None and now >= self.next_ping:
                self._ping_watchdog(now)
            if self.serving.left or now >= deadline:
                break
        return served

    # -- admission ---------------------------------------------------------------------------

    def _guarded(self, what: str, handler: Callable[..., None], *args: Any) -> None:
        """Run one event's handler; a failure there must not take the loop down.

        Its state stays as it was: a turn keeps its place, a row its state. systemd or
        the disk failing is logged; anything else is a bug, logged with its type."""
        try:
            handler(*args)
        except (VoluteError, sqlite3.Error, OSError) as error:
            text = error.message if isinstance(error, VoluteError) else str(error)
            self.journal.emit(events.HandlingFailed(what=what, error=text))
            self.state.dirty = True
        except Exception as error:  # noqa: BLE001 - the loop must outlive a bug
            self.journal.emit(
                events.HandlingFailed(what=what, error=f"{type(error).__name__}: {error}")
            )
            self.state.dirty = True

    def admit(self) -> None:
        """Run admission; if systemd or the store fails, say so once and retry in a second.

        Nothing is started on a guess: without systemd's listing, no turn starts."""
        try:
            self._admit()
        except (VoluteError, sqlite3.Error, OSError) as error:
            text = error.message if isinstance(error, VoluteError) else str(error)
            failing = events.AdmissionFailing(error=text, retry_seconds=ADMIT_RETRY_SECONDS)
            self.admit_retry = self.admit_latch.failed(failing, self.clock.monotonic())
            self.notifier.update(f"admission failing, no turn starts: {text}")
            return
        self.admit_latch.works(events.AdmissionWorks())

    def _admit(self) -> None:
        """One admission pass over the store's index of pending rows (O(what changed):
        volutectl/store/index.py), then carry out what it decided."""
        state = self.state
        if state.store.index.rows or (state.leases is not None and state.leases.waiting()):
            # Starts and folds need the launcher: without it, decide nothing (and say so).
            state.turns.hands.ensure()
        live, state.foreign_live = state.liveness.count_live()
        # With limits.test_runs_count_as_turns, each held test slot takes one unit of the
        # global budget; test runs are never held here, only turns.
        test_runs = 0
        if self.settings.limits.test_runs_count_as_turns:
            test_runs = len(state.slots.held())
        now, clock = self.clock.wall(), self.clock
        pressure = state.pressure
        adaptive, leases = state.adaptive, state.leases
        assert adaptive is not None and leases is not None  # both set once the rest is up
        decision, changes = state.store.index.admit(
            live,
            self._limits(adaptive, [turn.turn_id for turn in live]),
            now=now,
            others=admission.other_work(scopes=state.foreign_live, test_runs=test_runs),
            pressure=pressure is not None and pressure.high,
            paused=() if isinstance(state.paused, admission.EveryMind) else state.paused,
            all_paused=isinstance(state.paused, admission.EveryMind),
            # PSI is reactive: start at most one turn per pass, and let it settle.
            max_starts=pressure.may_start() if pressure is not None else None,
            acquires=leases.waiting(),
        )
        for fold in decision.folds:
            state.turns.fold(fold, now)
        if decision.starts and state.turns.starts_paused(now) is None:
            # One commit for all of them; if systemd gives one no answer (starts pause),
            # the rest go back to pending with no attempt, decided again in a later pass.
            self.started = True
            state.turns.start(decision.starts, now)
        self._grant(decision, now)
        paused = state.turns.starts_paused(now)
        if paused is not None:
            self.admit_retry = self.reactor.from_wall_clock(paused)
        if pressure is not None and decision.starts:
            pressure.note_started(clock.monotonic())
        state.turns.record_holds(changes, now)
        others = state.foreign_live + test_runs
        busy = len(live) + len(decision.starts) + len(decision.grants) + others
        adaptive.track(clock.monotonic(), {turn.id: turn.mind for turn in state.turns.all()})
        load = adaptive.load_of([t.mind for t in live], [s.mind for s in decision.starts])
        waiting = state.store.index.counts[HoldReason.ADAPTIVE_LIMIT]
        adaptive.after_pass(clock.monotonic(), busy, waiting, load + others)
        self.notifier.update(status.gate_line(state, now, test_runs))

    def _limits(self, adaptive: AdaptiveLimit, live: list[int]) -> admission.Limits:
        """The configured limits, with what the adaptive limit says for this pass over the
        turns `live` (by id). One clock reading notes writers' pause (a turn gone that may
        have been writing) and judges it."""
        now = self.clock.monotonic()
        adaptive.before_pass(now, live)
        return replace(
            self.state.limits,
            adaptive=adaptive.limit(),
            costs=adaptive.costs(),
            running_costs=adaptive.running_costs(),
            adaptive_turns=adaptive.turns_bound(),
            stagger=adaptive.stagger(),
            writers=adaptive.writers(live, now),
        )

    def _grant(self, decision: admission.Admission, now: float) -> None:
        """The acquires admission granted, after its starts (a grant may join one of
        them); the reasons of those still waiting."""
        leases = self.state.leases
        assert leases is not None
        leases.held_by(decision.lease_holds)
        for lease_id in decision.grants:
            if self.state.turns.starts_paused(now) is not None:
                break  # they wait, decided again in the next pass
            leases.grant(lease_id, now)


def _not_roots(incoming: Incoming) -> bool:
    """The sort key that puts root's requests first (a stable sort: each client's keep
    their order)."""
    return incoming[0].uid != 0
