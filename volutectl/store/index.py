"""Admission in O(what changed): an in-memory index of the pending deliveries.

admission.admit() decides over every pending row, in id order, on every pass; at 100,000
rows that costs a second per delivery. This index decides the same from state kept in
step with every commit (the store feeds it), looking only at what changed.

Why the same decisions can be had per session and per mind (admission.admit's rules):
- A session's rows up to its first backing-off row (its *eligible prefix*) share one
  fate: they fold into its live turn, start together as one turn, or are held together.
  The backing-off row itself is not held; the rows after it are held `behind_backoff`.
  So a session is decided at its head.
- A held session's reason depends only on its mind and on where admission stopped
  starting turns: `paused` if the mind is, else `mind_busy` if the mind is at its limit,
  else the *regime* that stopped the starts: the cap's reason (`test_run` when other
  work fills it, `adaptive_limit` when the adaptive limit is below the ceiling) or
  `io_pressure`. Once the regime holds one session no start happens
  after it, so one regime reason holds for every mind it holds.
- Turns start in the order of their sessions' heads: a heap of each startable mind's
  oldest eligible head gives them; a pass pops only the starts it makes, plus the one
  the regime stops.

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
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

from volutectl.core.admission import (
    Admission,
    Delivery,
    Fold,
    Hold,
    Limits,
    LiveTurn,
    Start,
    may_pass,
)
from volutectl.states import HoldReason

Key = tuple[str, str]  # (mind, session)
Change = tuple[int, HoldReason | None]  # a row's hold reason to record (None: not held)
REGIME = (
    HoldReason.GLOBAL_CAP,
    HoldReason.ADAPTIVE_LIMIT,
    HoldReason.TEST_RUN,
    HoldReason.IO_PRESSURE,
)


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


@dataclass
class Tally:
    """What runs as a pass starts turns: places taken (turns and other work), turns,
    and their IO costs (admission.Limits.costs), all and the light ones'."""

    busy: int
    running: int
    load: float  # the turns' costs; other work costs 1 a place
    light: float  # the costs under 1
    other_busy: int

    @classmethod
    def of(cls, limits: Limits, live: Counter[str], running: int, other_busy: int) -> Tally:
        costs = [(limits.running_cost_of(mind), n) for mind, n in live.items()]
        load = sum(cost * n for cost, n in costs)
        light = sum(cost * n for cost, n in costs if cost < 1)
        return cls(running + other_busy, running, load, light, other_busy)

    def held_by(self, limits: Limits, other_reason: HoldReason, cost: float) -> HoldReason | None:
        return limits.held_by(
            self.busy,
            self.running,
            other_reason,
            load=self.load + self.other_busy,
            running_load=self.load,
            cost=cost,
        )

    def take(self, cost: float) -> None:
        self.busy += 1
        self.running += 1
        self.load += cost
        self.light += cost if cost < 1 else 0.0


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
        self.live: Counter[str] = Counter()  # live turns per mind, as of the last pass
        self.other_busy_reason = HoldReason.GLOBAL_CAP  # as of the last pass
        self.live_sessions: dict[Key, int] = {}
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
        other_busy: int = 0,
        pressure: bool = False,
        other_busy_reason: HoldReason = HoldReason.GLOBAL_CAP,
        paused: Iterable[str] = (),
        all_paused: bool = False,
        max_starts: int | None = None,
    ) -> tuple[Admission, list[Change]]:
        """What admission.admit() would decide over the pending rows, and the hold reasons the
        store must write so that every row's recorded reason is the one it would give.

        `paused` names the paused minds; `all_paused` is a pause of every mind."""
        self.now = now
        if limits != self.limits:  # new limits change every mind's capacity
            self.dirty_minds |= set(self.minds)
            self.limits = limits
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
        per_mind = Counter(self.live)
        folds = self._folds()
        self.other_busy_reason = other_busy_reason
        starts, regime = self._starts(limits, per_mind, len(live), other_busy, pressure, max_starts)
        changes = self._reasons(limits, per_mind, regime, starts, folds)
        # What was decided is carried out by the store, whose commits come back here; a
        # start that fails before its commit must be offered again, so look again.
        for mind, session in [(s.mind, s.session) for s in starts] + self._fold_keys(folds):
            self.dirty_minds.add(mind)
            self.dirty_sessions.add((mind, session))
        holds = [Hold(i, reason) for i, reason in changes if reason is not None]
        return Admission(starts, folds, holds), changes

    def _fold_keys(self, folds: list[Fold]) -> list[Key]:
        by_turn = {turn_id: key for key, turn_id in self.live_sessions.items()}
        return [by_turn[fold.turn_id] for fold in folds]

    def _paused(self, mind: str) -> bool:
        return self.all_paused or mind in self.paused_minds

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
            sessions.setdefault((turn.mind, turn.session), turn.turn_id)
        for key in set(sessions.items()) ^ set(self.live_sessions.items()):
            self.dirty_sessions.add(key[0])
            self.dirty_minds.add(key[0][0])
        self.live, self.live_sessions = counts, sessions

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
            if queue.eligible and (mind, session) not in self.live_sessions:
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

    def _starts(
        self,
        limits: Limits,
        per_mind: Counter[str],
        running: int,
        other_busy: int,
        pressure: bool,
        max_starts: int | None,
    ) -> tuple[list[Start], HoldReason | None]:
        """Start sessions in the order of their heads until the regime stops it, but for
        the light heads admission.may_pass lets by a held one; the regime's reason, if
        one stopped them (or would, at the next head)."""
        starts: list[Start] = []
        tally = Tally.of(limits, self.live, running, other_busy)
        least = min(limits.costs.values(), default=1.0)
        passing = not pressure and max_starts is None
        regime: HoldReason | None = None
        passed: list[tuple[int, str]] = []  # held heads light ones went past
        while self.startable:
            head, mind = self.startable[0]
            queues = self.minds.get(mind)
            if queues is None or not queues.heads or queues.heads[0][0] != head:
                heapq.heappop(self.startable)  # stale: the mind changed since
                continue
            if self._paused(mind) or per_mind[mind] >= limits.for_mind(mind):
                heapq.heappop(self.startable)  # back when its pause or a turn ends
                continue
            cost = limits.cost_of(mind)
            held = tally.held_by(limits, self.other_busy_reason, cost)
            if regime is None and held is None:
                paced = max_starts is not None and len(starts) >= max_starts
                if (pressure and tally.busy >= 1) or paced:
                    held = HoldReason.IO_PRESSURE
            regime = regime or held
            if regime is not None and not (passing and may_pass(regime, held, tally.light, cost)):
                if not passing or regime is not HoldReason.ADAPTIVE_LIMIT:
                    break
                if tally.light + least >= 1 or tally.held_by(limits, regime, least) is not None:
                    break  # no light head could pass any more
                passed.append(heapq.heappop(self.startable))
                continue
            heapq.heappop(self.startable)
            _, session = heapq.heappop(queues.heads)
            queue = queues.sessions[session]
            starts.append(
                Start(mind=mind, session=session, delivery_ids=tuple(queue.ids[: queue.eligible]))
            )
            per_mind[mind] += 1
            tally.take(cost)
            if queues.heads:
                heapq.heappush(self.startable, (queues.heads[0][0], mind))
        for entry in passed:
            heapq.heappush(self.startable, entry)
        if regime is None:  # no head held: what the next one would meet
            regime = tally.held_by(limits, self.other_busy_reason, 1.0)
            paced = max_starts is not None and len(starts) >= max_starts
            if regime is None and ((pressure and tally.busy >= 1) or paced):
                regime = HoldReason.IO_PRESSURE
        return starts, regime

    def _reasons(
        self,
        limits: Limits,
        per_mind: Counter[str],
        regime: HoldReason | None,
        starts: list[Start],
        folds: list[Fold],
    ) -> list[Change]:
        """The hold reasons that changed: for each mind that changed, the regime's minds
        if the regime changed, sessions whose prefix moved, and rows just added."""
        taken = {i for start in starts for i in start.delivery_ids}
        taken |= {i for fold in folds for i in fold.delivery_ids}
        for delivery_id in taken:
            self._record(delivery_id, None)  # taking a row clears its hold in the store
        minds = set(self.dirty_minds) | {start.mind for start in starts}
        if regime != self.regime:
            minds |= self.regime_minds
        self.regime = regime
        changes: list[Change] = []
        started = {(start.mind, start.session) for start in starts}
        for mind in minds:
            queues = self.minds.get(mind)
            if queues is None:
                continue
            reason = self._mind_reason(mind, limits, per_mind, regime)
            if reason in REGIME:
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
                changes += self._session_changes(queue, queues.reason if held else None, taken)
        for delivery_id in self.fresh - taken:
            row = self.rows[delivery_id]
            if (row.mind, row.session) in self.dirty_sessions:
                continue  # done with its session
            queues = self.minds[row.mind]
            queue = queues.sessions[row.session]
            at = bisect.bisect_left(queue.ids, delivery_id)
            held = (row.mind, row.session) not in started
            held = held and (row.mind, row.session) not in self.live_sessions
            want = _reason_at(at, queue.eligible, queues.reason if held else None, row, self.now)
            changes += self._change(delivery_id, want)
        self.dirty_minds.clear()
        self.dirty_sessions.clear()
        self.fresh.clear()
        return changes

    def _mind_reason(
        self, mind: str, limits: Limits, per_mind: Counter[str], regime: HoldReason | None
    ) -> HoldReason | None:
        """The reason admission.admit gives a held session of this mind, in this pass."""
        if self._paused(mind):
            return HoldReason.PAUSED
        if per_mind[mind] >= limits.for_mind(mind):
            return HoldReason.MIND_BUSY
        return regime

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
