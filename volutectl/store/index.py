"""Admission in O(what changed): an in-memory index of the pending deliveries.

admission.admit() decides over every pending row, in id order, on every pass; at 100,000
rows that costs a second per delivery. This index decides the same from state kept in
step with every commit (the store feeds it), looking only at what changed.

Why the same decisions can be had per session and per mind (admission.admit's rules):
- A session's rows up to its first backing-off row (its *eligible prefix*) share one
  fate: they fold into its live turn, start together as one turn, or are held together.
  The backing-off row itself is not held; the rows after it are held `behind_backoff`.
  So a session is decided at its head.
- Whether a head starts is admission.decide's to say, here as in admit(): the index
  only chooses which heads to ask about, and in what order.
- A held session's reason depends only on its mind and on where admission stopped
  starting turns: its mind's own (admission.mind_hold: `paused`, `mind_busy`; and
  admission.writer_hold's `writer_running`, which depends on its mind's cost and on
  the writers running and started, not on where it stands), else
  the *regime* that stopped the starts (admission.cap_hold). Once the regime holds one
  session no start happens after it but the light ones admission.may_pass lets by, so
  one regime reason holds for every mind it holds.
- Turns start in the order of their sessions' heads: a heap of each startable mind's
  oldest eligible head gives them; a pass pops only the starts it makes, plus the ones
  the regime holds until no head could pass it.

So a pass costs O(live turns + starts + minds and sessions that changed + rows whose
hold reason changes). tests/unit/test_queueindex.py holds it to admission.admit over the
same rows, through random histories: the same starts, folds, and hold reason for every row.

Pure: no I/O. It remembers the hold reason the store holds for each row, so that a
pass returns only the reasons to write, and `counts` are the status line's, for free.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Collection, Container, Iterable, Sequence
from dataclasses import dataclass, field

from volutectl.core.admission import (
    EVERY_MIND,
    MIND_REASONS,
    Acquire,
    Admission,
    Delivery,
    Fold,
    Hold,
    LeaseQueue,
    Limits,
    LiveTurn,
    Place,
    Rules,
    Start,
    Tally,
    cap_hold,
    decide,
    mind_hold,
    writer_hold,
)
from volutectl.states import HoldReason

Key = tuple[str, str]  # (mind, session)
Change = tuple[int, HoldReason | None]  # a row's hold reason to record (None: not held)


@dataclass(eq=False)
class SessionQueue:
    """One (mind, session)'s pending rows, oldest first."""

    rows: list[Delivery] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the rows' ids, for bisect
    eligible: int = 0  # rows before the first backing-off one, as of the last look


@dataclass(eq=False)
class MindQueues:
    sessions: dict[str, SessionQueue] = field(default_factory=dict)
    heads: list[tuple[int, str]] = field(default_factory=list)  # startable heads, a heap
    reason: HoldReason | None = None  # its held sessions' reason, as of the last pass


class PendingIndex:
    def __init__(self) -> None:
        self.rows: dict[int, Delivery] = {}
        self.minds: dict[str, MindQueues] = {}
        self.recorded: dict[int, HoldReason | None] = {}  # what the store holds
        self.counts: Counter[HoldReason] = Counter()
        self.backoffs: list[tuple[float, int]] = []  # (not_before, id); may be stale
        self.startable: list[tuple[int, str]] = []  # (mind's oldest head, mind); may be stale
        self.dirty_minds: set[str] = set()  # heads, capacity or pause may have changed
        self.dirty_sessions: set[Key] = set()  # the eligible prefix may have moved
        self.fresh: set[int] = set()  # rows added at a session's tail since the last pass
        self.regime_minds: set[str] = set()  # minds whose held sessions the regime holds
        self.regime: HoldReason | None = None
        self.writers_held = False  # whether writers waited for one (writer_hold), last pass
        self.live: Counter[str] = Counter()  # live turns per mind, as of the last pass
        self.live_sessions: dict[Key, int] = {}
        self.leased: set[Key] = set()  # sessions a live lease holds: `mind_busy`
        self.paused_minds: frozenset[str] = frozenset()
        self.all_paused = False
        self.limits: Limits | None = None
        self.now = 0.0

    # -- keeping in step with the store ----------------------------------------------

    def add(self, delivery: Delivery, recorded: HoldReason | None = None) -> None:
        """A row is pending: new, loaded, returned to the queue, backing off, retried."""
        if delivery.id in self.rows:
            self.remove([delivery.id])
        self.rows[delivery.id] = delivery
        self._record(delivery.id, recorded)
        mind = self.minds.setdefault(delivery.mind, MindQueues())
        queue = mind.sessions.setdefault(delivery.session, SessionQueue())
        at = bisect.bisect(queue.ids, delivery.id)
        queue.ids.insert(at, delivery.id)
        queue.rows.insert(at, delivery)
        if delivery.not_before is not None:
            heapq.heappush(self.backoffs, (delivery.not_before, delivery.id))
        if at == len(queue.ids) - 1 and delivery.not_before is None:
            # At the tail, with no backoff: it changes no other row, and extends the
            # eligible prefix if that reached the tail.
            if queue.eligible == at:
                queue.eligible += 1
            self.fresh.add(delivery.id)
        else:
            self.dirty_sessions.add((delivery.mind, delivery.session))
        self.dirty_minds.add(delivery.mind)

    def load(self, rows: Iterable[tuple[Delivery, HoldReason | None]]) -> None:
        """Fill a new index with rows in id order, each with the hold reason the store
        records for it: no bookkeeping per row; the first pass looks at every session."""
        for delivery, recorded in rows:
            self.rows[delivery.id] = delivery
            self._record(delivery.id, recorded)
            mind = self.minds.setdefault(delivery.mind, MindQueues())
            queue = mind.sessions.setdefault(delivery.session, SessionQueue())
            if queue.ids and queue.ids[-1] >= delivery.id:
                raise ValueError("PendingIndex.load takes rows in id order")
            queue.ids.append(delivery.id)
            queue.rows.append(delivery)
            if delivery.not_before is not None:
                self.backoffs.append((delivery.not_before, delivery.id))
        heapq.heapify(self.backoffs)
        for name, mind in self.minds.items():
            self.dirty_minds.add(name)
            self.dirty_sessions.update((name, session) for session in mind.sessions)

    def remove(self, ids: Iterable[int]) -> None:
        """Rows that left pending: taken by a turn, dropped."""
        for delivery_id in ids:
            delivery = self.rows.pop(delivery_id, None)
            if delivery is None:
                continue
            self._record(delivery_id, None)
            del self.recorded[delivery_id]
            self.fresh.discard(delivery_id)
            mind = self.minds[delivery.mind]
            queue = mind.sessions[delivery.session]
            at = bisect.bisect_left(queue.ids, delivery_id)
            del queue.ids[at], queue.rows[at]
            if not queue.ids:
                del mind.sessions[delivery.session]
                if not mind.sessions:
                    del self.minds[delivery.mind]
                    self.regime_minds.discard(delivery.mind)
            self.dirty_sessions.add((delivery.mind, delivery.session))
            self.dirty_minds.add(delivery.mind)

    def _record(self, delivery_id: int, reason: HoldReason | None) -> None:
        old = self.recorded.get(delivery_id)
        if old is not None:
            self.counts[old] -= 1
            if not self.counts[old]:
                del self.counts[old]
        self.recorded[delivery_id] = reason
        if reason is not None:
            self.counts[reason] += 1

    def __len__(self) -> int:
        return len(self.rows)

    def pending_of(self, mind: str) -> int:
        queues = self.minds.get(mind)
        return sum(len(queue.ids) for queue in queues.sessions.values()) if queues else 0

    def next_backoff(self, after: float) -> float | None:
        """The earliest backoff end later than `after`, or `after` itself when a backoff
        has ended that no pass has seen yet (its session must be looked at now: a wake
        that came a hair early would otherwise lose it). Stale entries are dropped."""
        while self.backoffs:
            not_before, delivery_id = self.backoffs[0]
            row = self.rows.get(delivery_id)
            if row is None or row.not_before != not_before:
                heapq.heappop(self.backoffs)  # stale: the row left or was retried
                continue
            if not_before > after:
                return not_before
            self._notice_backoffs_ending(after)  # marks its session for the next pass
            return after
        return None

    def backing_off(self, now: float) -> list[Delivery]:
        """The rows still backing off at `now` (each once), from the backoff heap: as
        many as failed, not as many as wait."""
        rows = {}
        for not_before, delivery_id in self.backoffs:
            row = self.rows.get(delivery_id)
            if row is not None and row.not_before == not_before and not_before > now:
                rows[delivery_id] = row
        return list(rows.values())

    # -- a pass --------------------------------------------------------------------------

    def admit(
        self,
        live: Sequence[LiveTurn],
        limits: Limits,
        *,
        now: float,
        others: Collection[Place] = (),
        pressure: bool = False,
        paused: Iterable[str] = (),
        all_paused: bool = False,
        max_starts: int | None = None,
        acquires: Iterable[Acquire] = (),
    ) -> tuple[Admission, list[Change]]:
        """What admission.admit() would decide over the pending rows, and the hold reasons the
        store must write so that every row's recorded reason is the one it would give.

        `others`: the places other work holds (admission.admit's); `paused` names the
        paused minds; `all_paused` is a pause of every mind."""
        self.now = now
        if limits != self.limits:  # new limits change every mind's capacity
            self.dirty_minds |= set(self.minds)
            self.limits = limits
        if (limits.stagger and limits.writers >= 1) != self.writers_held:
            # The writers that held writers' heads (writer_hold) at the last pass's end,
            # its own starts among them, are not those running now: offer them again.
            self.dirty_minds |= set(self.minds)
        self._notice_backoffs_ending(now)
        self._notice_live(live)
        self._notice_paused(frozenset(paused), all_paused)
        for mind in self.dirty_minds:
            self._refresh(mind, now)
        if len(self.startable) > 2 * len(self.minds) + 64:
            # Stale entries leave only from the top: while the cap holds, each delivery
            # adds one. Rebuilt from the heads, the heap stays O(minds).
            self.startable = [(q.heads[0][0], m) for m, q in self.minds.items() if q.heads]
            heapq.heapify(self.startable)
        folds = self._folds()
        every = EVERY_MIND if self.all_paused else self.paused_minds
        rules = Rules(limits, every, pressure, max_starts)
        tally = Tally.of([*live, *others], limits)
        leases = LeaseQueue.of(acquires)
        starts = self._starts(rules, tally, leases)
        # A grant takes a place of its mind, as a start does: its held rows' reason may
        # change (mind_busy) though nothing of theirs did.
        self.dirty_minds |= {mind for mind, _ in leases.granted}
        changes = self._reasons(rules, tally, starts, folds)
        # What was decided is carried out by the store, whose commits come back here; a
        # start that fails before its commit must be offered again, so look again.
        again = [(s.mind, s.session) for s in starts] + self._fold_keys(folds)
        for mind, session in again + sorted(leases.granted):
            self.dirty_minds.add(mind)
            self.dirty_sessions.add((mind, session))
        holds = [Hold(i, reason) for i, reason in changes if reason is not None]
        return Admission(starts, folds, holds, leases.grants, leases.holds), changes

    def _fold_keys(self, folds: list[Fold]) -> list[Key]:
        by_turn = {turn_id: key for key, turn_id in self.live_sessions.items()}
        return [by_turn[fold.turn_id] for fold in folds]

    def _notice_backoffs_ending(self, now: float) -> None:
        while self.backoffs and self.backoffs[0][0] <= now:
            _, delivery_id = heapq.heappop(self.backoffs)
            row = self.rows.get(delivery_id)
            if row is not None:
                self.dirty_sessions.add((row.mind, row.session))
                self.dirty_minds.add(row.mind)

    def _notice_live(self, live: Sequence[LiveTurn]) -> None:
        counts = Counter(turn.mind for turn in live)
        for mind in set(counts) | set(self.live):
            if counts[mind] != self.live[mind]:
                self.dirty_minds.add(mind)
        sessions: dict[Key, int] = {}
        for turn in sorted(live, key=lambda t: t.turn_id):
            if not turn.lease:
                sessions.setdefault((turn.mind, turn.session), turn.turn_id)
        for key in set(sessions.items()) ^ set(self.live_sessions.items()):
            self.dirty_sessions.add(key[0])
            self.dirty_minds.add(key[0][0])
        leased = {(turn.mind, turn.session) for turn in live if turn.lease}
        for changed in leased ^ self.leased:
            self.dirty_sessions.add(changed)
            self.dirty_minds.add(changed[0])
        self.live, self.live_sessions, self.leased = counts, sessions, leased

    def _notice_paused(self, paused: frozenset[str], every: bool) -> None:
        if every != self.all_paused:
            self.dirty_minds |= set(self.minds)
        else:
            self.dirty_minds |= paused ^ self.paused_minds
        self.paused_minds, self.all_paused = paused, every

    def _refresh(self, mind: str, now: float) -> None:
        """Recount a changed mind's eligible prefixes, and offer its oldest head."""
        queues = self.minds.get(mind)
        if queues is None:
            return
        queues.heads = []
        for session, queue in queues.sessions.items():
            if (mind, session) in self.dirty_sessions:
                queue.eligible = _eligible(queue.rows, now)
            key = (mind, session)
            if queue.eligible and key not in self.live_sessions and key not in self.leased:
                queues.heads.append((queue.ids[0], session))
        heapq.heapify(queues.heads)
        if queues.heads:
            heapq.heappush(self.startable, (queues.heads[0][0], mind))

    def _folds(self) -> list[Fold]:
        folds = []
        for (mind, session), turn_id in sorted(self.live_sessions.items(), key=lambda i: i[1]):
            queues = self.minds.get(mind)
            queue = queues.sessions.get(session) if queues else None
            if queue is None or not queue.eligible:
                continue
            taken = queue.rows[: queue.eligible]
            folds.append(
                Fold(
                    turn_id=turn_id,
                    delivery_ids=tuple(d.id for d in taken),
                    interrupt=any(d.interrupt for d in taken),
                )
            )
        return folds

    def _starts(self, rules: Rules, tally: Tally, leases: LeaseQueue) -> list[Start]:
        """Offer admission.decide the sessions' heads in order, and start those it lets,
        until its regime holds every head that could be left (the light heads
        admission.may_pass lets by a held one are still asked); the waiting acquires
        (`leases`) are decided where they stand among the heads, as admission.admit
        decides them. `tally` ends with the pass's starts, and its regime: the one that
        stopped them, or, if none did, the one the next head would meet."""
        starts: list[Start] = []
        started: set[Key] = set()

        def taken(key: Key) -> bool:
            return key in started or key in self.live_sessions or key in self.leased

        least = min(rules.limits.costs.values(), default=1.0)
        passed: list[tuple[int, str]] = []  # held heads light ones went past
        while self.startable:
            head, mind = self.startable[0]
            queues = self.minds.get(mind)
            if queues is None or not queues.heads or queues.heads[0][0] != head:
                heapq.heappop(self.startable)  # stale: the mind changed since
                continue
            leases.until(head, tally, rules, taken)
            reason = decide(mind, tally, rules)
            tally.note(mind, reason, rules.limits)
            if reason in MIND_REASONS:
                heapq.heappop(self.startable)  # back when its pause or a turn ends
                continue
            if reason is not None:
                if cap_hold(least, tally, rules) is not None:
                    break  # no head could pass any more
                passed.append(heapq.heappop(self.startable))
                continue
            heapq.heappop(self.startable)
            _, session = heapq.heappop(queues.heads)
            queue = queues.sessions[session]
            starts.append(
                Start(mind=mind, session=session, delivery_ids=tuple(queue.ids[: queue.eligible]))
            )
            started.add((mind, session))
            if queues.heads:
                heapq.heappush(self.startable, (queues.heads[0][0], mind))
        leases.until(None, tally, rules, taken)
        for entry in passed:
            heapq.heappush(self.startable, entry)
        if tally.regime is None:  # no head held: what the next one would meet
            tally.regime = cap_hold(1.0, tally, rules)
        return starts

    def _reasons(
        self, rules: Rules, tally: Tally, starts: list[Start], folds: list[Fold]
    ) -> list[Change]:
        """The hold reasons that changed: for each mind that changed, the regime's minds
        if the regime changed, sessions whose prefix moved, and rows just added."""
        taken = {i for start in starts for i in start.delivery_ids}
        taken |= {i for fold in folds for i in fold.delivery_ids}
        for delivery_id in taken:
            self._record(delivery_id, None)  # taking a row clears its hold in the store
        minds = self._minds_to_reason(rules, tally, starts)
        regime = tally.regime
        changes: list[Change] = []
        started = {(start.mind, start.session) for start in starts}
        for mind in minds:
            queues = self.minds.get(mind)
            if queues is None:
                continue
            cost = rules.limits.cost_of(mind)
            reason = mind_hold(mind, tally, rules) or writer_hold(cost, tally, rules) or regime
            if reason is not None and reason not in MIND_REASONS:
                self.regime_minds.add(mind)
            else:
                self.regime_minds.discard(mind)
            if reason == queues.reason:
                continue
            queues.reason = reason
            for session in queues.sessions:
                self.dirty_sessions.add((mind, session))
        for mind, session in self.dirty_sessions:
            queues = self.minds.get(mind)
            queue = queues.sessions.get(session) if queues else None
            if queue is not None and queues is not None:
                held = (mind, session) not in started and (mind, session) not in self.live_sessions
                reason = queues.reason if held else None
                if (mind, session) in self.leased:
                    reason = HoldReason.MIND_BUSY  # a lease holds its session
                changes += self._session_changes(queue, reason, taken)
        for delivery_id in self.fresh - taken:
            row = self.rows[delivery_id]
            if (row.mind, row.session) in self.dirty_sessions:
                continue  # done with its session
            queues = self.minds[row.mind]
            queue = queues.sessions[row.session]
            at = bisect.bisect_left(queue.ids, delivery_id)
            held = (row.mind, row.session) not in started
            held = held and (row.mind, row.session) not in self.live_sessions
            reason = queues.reason if held else None
            if (row.mind, row.session) in self.leased:
                reason = HoldReason.MIND_BUSY
            want = _reason_at(at, queue.eligible, reason, row, self.now)
            changes += self._change(delivery_id, want)
        self.dirty_minds.clear()
        self.dirty_sessions.clear()
        self.fresh.clear()
        return changes

    def _minds_to_reason(self, rules: Rules, tally: Tally, starts: list[Start]) -> set[str]:
        """The minds whose held sessions' reason may have changed: those that changed or
        started; the regime's, if the regime changed; every mind, if whether writers
        wait for one did (the pass's own starts may have made them wait)."""
        minds = set(self.dirty_minds) | {start.mind for start in starts}
        if tally.regime != self.regime:
            minds |= self.regime_minds
        self.regime = tally.regime
        writers_held = writer_hold(1.0, tally, rules) is not None
        if writers_held != self.writers_held:
            minds |= set(self.minds)
        self.writers_held = writers_held
        return minds

    def _session_changes(
        self, queue: SessionQueue, reason: HoldReason | None, taken: Container[int]
    ) -> list[Change]:
        changes: list[Change] = []
        for at, row in enumerate(queue.rows):
            if row.id not in taken:
                want = _reason_at(at, queue.eligible, reason, row, self.now)
                changes += self._change(row.id, want)
        return changes

    def _change(self, delivery_id: int, want: HoldReason | None) -> list[Change]:
        if self.recorded.get(delivery_id) == want:
            return []
        self._record(delivery_id, want)
        return [(delivery_id, want)]


def _eligible(rows: Sequence[Delivery], now: float) -> int:
    for index, row in enumerate(rows):
        if row.not_before is not None and row.not_before > now:
            return index
    return len(rows)


def _reason_at(
    at: int, eligible: int, reason: HoldReason | None, row: Delivery, now: float
) -> HoldReason | None:
    """A row's reason from its place in its session: in the eligible prefix, its
    session's; a row backing off itself, none; a row behind one, behind_backoff."""
    if at < eligible:
        return reason
    if row.not_before is not None and row.not_before > now:
        return None
    return HoldReason.BEHIND_BACKOFF
