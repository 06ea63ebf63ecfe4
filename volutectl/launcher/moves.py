"""A lease's processes moved into its scope and back, by the launcher (root), on the
gate's MoveIn and MoveBack orders (volutectl/wire/orders.py).

The gate passes the client's pidfds on (never pid numbers: no pid reuse can redirect a
move), and asks; the launcher decides, and trusts nothing the gate says
(volutectl/core/pidmoves.py's `refusal`): each process is read from /proc by its pidfd
(volutectl/kernel/pidfds.py), checked against the launcher's own configuration and
systemd's own answers, and one that fails refuses the whole order (`pids[3]: ...`)
before anything moves. Then:

1. what moves is recorded (pid, its start time, the cgroup and unit it came from) in
   /run/volute-launcher/moved/<turn id>.json, root's and 0700, written through directory
   fds with O_NOFOLLOW, BEFORE the move: a launcher killed mid-move leaves a record that
   a MoveBack after a restart (of the gate or the launcher) still reads;
2. each process moves: into a unit with Delegate=yes through systemd's
   AttachProcessesToUnit; into any other (a turn scope, a service) by the launcher's own
   write of its cgroup.procs (volutectl/kernel/cgroupmove.py says why).

MoveBack returns each recorded process that still lives (same pid and start time) and is
still in the lease's scope: to the cgroup it came from while its unit is active, else to
the fallback, a scope of its own, `volute-returned-<mind>-<turn id>.scope`, started
around it in the slice it came from (docs/protocol.md says why). Then the record goes:
a second MoveBack finds none and is done.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from volutectl import events, names
from volutectl.core import pidmoves
from volutectl.errors import DataError, VoluteError
from volutectl.kernel import cgroupmove, dirfds, pidfds
from volutectl.systemd.port import ScopeProperties
from volutectl.wire import orders

if TYPE_CHECKING:
    from volutectl.launcher.hands import LocalHands

RECORDS_DIR = Path(orders.DEFAULT_SOCKET).parent / "moved"
MAX_RECORD = 64 * 1024  # 64 processes of about 300 bytes each, with room
ACTIVE = ("active", "reloading")
GATE_UNIT = "volute-gate.service"
LAUNCHER_UNIT = "volute-launcher.service"


@dataclass(frozen=True)
class MovedProcess:
    pid: int
    start_time: int
    cgroup: str  # where it was, in the systemd hierarchy
    unit: str  # its unit then
    slice: str  # that unit's slice (the fallback's)


@dataclass(frozen=True)
class Record:
    mind: str
    turn_id: int
    scope: str
    processes: tuple[MovedProcess, ...]


class Records:
    """The records of what was moved, one file per lease, in a directory root alone may
    write (made 0700; one found otherwise is refused, never trusted)."""

    def __init__(self, path: Path = RECORDS_DIR) -> None:
        self.path = path

    def _open(self, create: bool = False) -> int | None:
        """The directory's fd; None if it does not exist and `create` is false."""
        if create:
            # Its parent is the launcher's socket's directory (volute-launcher.socket
            # makes it, root's 0755); a launcher run by hand may have none yet.
            os.makedirs(self.path.parent, 0o755, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.path, 0o700)
        try:
            fd = dirfds.open_directory(str(self.path))
        except FileNotFoundError:
            if create:
                raise
            return None
        found = os.fstat(fd)
        if found.st_uid != os.geteuid() or stat.S_IMODE(found.st_mode) & 0o077:
            os.close(fd)
            raise DataError(f"{self.path} is not the launcher's own (0700): not trusted")
        return fd

    def load(self, turn_id: int) -> Record | None:
        fd = self._open()
        if fd is None:
            return None
        try:
            small = dirfds.read_small_file(fd, f"{turn_id}.json", MAX_RECORD)
        finally:
            os.close(fd)
        if small is None:
            return None
        raw: dict[str, Any] = json.loads(small.data)
        moved = tuple(MovedProcess(**entry) for entry in raw.pop("processes"))
        return Record(processes=moved, **raw)

    def save(self, record: Record) -> None:
        """Whole or not at all: a new file, renamed over the old."""
        data = json.dumps(asdict(record), separators=(",", ":")).encode()
        name, temporary = f"{record.turn_id}.json", f".{record.turn_id}.tmp"
        fd = self._open(create=True)
        assert fd is not None
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary, dir_fd=fd)
            out = dirfds.create_file(fd, temporary)
            try:
                dirfds.write_all(out, data)
            finally:
                os.close(out)
            os.rename(temporary, name, src_dir_fd=fd, dst_dir_fd=fd)
        finally:
            os.close(fd)

    def drop(self, turn_id: int) -> None:
        fd = self._open()
        if fd is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{turn_id}.json", dir_fd=fd)
        finally:
            os.close(fd)

    def turn_ids(self) -> list[int]:
        fd = self._open()
        if fd is None:
            return []
        try:
            listed = os.listdir(fd)
        finally:
            os.close(fd)
        stems = (name.removesuffix(".json") for name in listed if name.endswith(".json"))
        return sorted(int(stem) for stem in stems if stem.isdigit())


class Mover:
    """MoveIn and MoveBack, with the launcher's hands (its config, its systemd)."""

    def __init__(self, hands: LocalHands, records: Records | None = None) -> None:
        self.hands = hands
        self.manager = hands.manager
        self.records = records or Records()

    # -- in ----------------------------------------------------------------------------

    def move_in(self, order: orders.MoveIn, passed: Sequence[int]) -> orders.Moved:
        """Check every pidfd, record, then move; a refusal moves nothing."""
        if len(passed) != order.pids or order.pids > orders.MAX_LEASE_PIDS:
            raise DataError(f"pids: {order.pids} announced, {len(passed)} came")
        scope = self._own_scope(order.turn_id, order.mind)
        rules = self._rules(order)
        seen = self._check(passed, rules)
        before = self.records.load(order.turn_id)
        kept = {(p.pid, p.start_time): p for p in before.processes} if before else {}
        new = [s for s in seen if (s.pid, s.start_time) not in kept]
        for index, found in enumerate(new):
            origin = pidmoves.origin_of(found.cgroup)
            if origin is not None and origin.unit == scope:
                raise DataError(f"pids[{index}]: pid {found.pid} is already in {scope}")
        entries = [_entry(found) for found in new]
        record = Record(order.mind, order.turn_id, scope, (*kept.values(), *entries))
        self.records.save(record)
        try:
            target = self._cgroup_of(scope)
            for entry in entries:
                self._move_one(scope, target, entry)
        except (VoluteError, OSError) as error:
            self._undo(record, entries)
            raise VoluteError(f"pids: the move into {scope} failed, none moved: {error}") from None
        for entry in entries:
            self.hands.journal.emit(
                events.PidMovedIn(
                    mind=order.mind, turn_id=order.turn_id, pid=entry.pid, unit=entry.unit
                )
            )
        alive = [p for p in record.processes if _alive(p)]
        return orders.Moved(tuple(p.pid for p in alive), tuple(p.unit for p in alive))

    def _own_scope(self, turn_id: int, mind: str) -> str:
        """Lease `turn_id`'s scope of `mind`, started by this launcher, and active."""
        scope = names.turn_scope_name(mind, turn_id)
        if self.hands.units.get(turn_id) != scope:
            raise DataError(f"turn_id: {scope} is not a scope this launcher started")
        if self.manager.active_state(scope) not in ACTIVE:
            raise DataError(f"turn_id: {scope} is not active")
        return scope

    def _rules(self, order: orders.MoveIn) -> pidmoves.Rules:
        account = self.hands.account_of(self.hands.held.current, order.mind)
        forbidden = {1, os.getpid()}
        for unit in (GATE_UNIT, LAUNCHER_UNIT):
            main = self.manager.unit_property(unit, "MainPID")
            if isinstance(main, int) and main > 0:
                forbidden.add(main)
        return pidmoves.Rules(order.mind, order.turn_id, account.uid, frozenset(forbidden))

    @staticmethod
    def _check(passed: Sequence[int], rules: pidmoves.Rules) -> list[pidmoves.Seen]:
        seen: list[pidmoves.Seen] = []
        for index, pidfd in enumerate(passed):
            try:
                found = pidfds.read_process(pidfd)
            except pidfds.NotAProcess as error:
                raise DataError(f"pids[{index}]: {error}") from None
            why = pidmoves.refusal(found, rules)
            if why is not None:
                raise DataError(f"pids[{index}]: {why}")
            if all(found.pid != other.pid for other in seen):
                seen.append(found)
        return seen

    def _cgroup_of(self, unit: str) -> str:
        path = self.manager.unit_property(unit, "ControlGroup")
        if not isinstance(path, str) or not path.startswith("/"):
            raise VoluteError(f"{unit} has no control group")
        return path

    def _attach(self, unit: str, cgroup: str, subcgroup: str, pid: int) -> None:
        """Into a delegated unit by systemd's AttachProcessesToUnit; else by the
        launcher's own write of `cgroup` (the unit's, or a path below it)."""
        if self.manager.unit_property(unit, "Delegate") is True:
            self.manager.attach_processes(unit, [pid], subcgroup)
        else:
            cgroupmove.attach(cgroup, pid)

    def _move_one(self, scope: str, target: str, entry: MovedProcess) -> None:
        """One process into the scope; one that exited meanwhile needs no move (its
        record stays until MoveBack, which skips it: its pid and start time name no
        process any more)."""
        try:
            self._attach(scope, target, "", entry.pid)
        except cgroupmove.ProcessGone:
            return
        except (VoluteError, OSError):
            if _alive(entry):
                raise

    def _undo(self, record: Record, entries: Sequence[MovedProcess]) -> None:
        """A failed move: whatever moved goes back, and the record forgets them."""
        self._return(record, entries)
        left = tuple(p for p in record.processes if p not in entries)
        if left:
            self.records.save(Record(record.mind, record.turn_id, record.scope, left))
        else:
            self.records.drop(record.turn_id)

    # -- back --------------------------------------------------------------------------

    def move_back(self, turn_id: int, mind: str) -> None:
        """Every recorded process of lease `turn_id` that still lives, back; then the
        record goes. Idempotent: with no record there is nothing to do."""
        record = self.records.load(turn_id)
        if record is None:
            return
        if record.mind != mind:
            raise DataError(f"mind: lease {turn_id}'s processes are {record.mind}'s")
        failed = self._return(record, record.processes)
        if failed:
            self.records.save(Record(record.mind, turn_id, record.scope, tuple(failed)))
            raise VoluteError(f"pids {[p.pid for p in failed]} could not be moved back")
        self.records.drop(turn_id)

    def sweep(self, open_ids: Sequence[int]) -> None:
        """The records of leases the gate no longer holds open (it was killed between a
        lease's end and its MoveBack): their processes go back now, never left in a
        scope whose lease has ended. Never fails the sweep it serves."""
        keep = set(open_ids)
        try:
            found = self.records.turn_ids()
        except (VoluteError, OSError):
            return
        for turn_id in found:
            if turn_id in keep:
                continue
            record = self.records.load(turn_id)
            if record is None:
                continue
            with contextlib.suppress(VoluteError, OSError):
                self.move_back(turn_id, record.mind)

    def _return(self, record: Record, entries: Sequence[MovedProcess]) -> list[MovedProcess]:
        """Each of `entries` still alive and in the scope goes back; the ones that could
        not be moved anywhere are returned."""
        failed = []
        for entry in entries:
            pidfd = pidfds.open_recorded(entry.pid, entry.start_time)
            if pidfd is None:
                continue  # exited: nothing to return
            try:
                where = pidfds.current_cgroup(pidfd)
                origin = pidmoves.origin_of(where) if where is not None else None
                if origin is None or origin.unit != record.scope:
                    continue  # not in the lease's scope (never moved, or moved since)
                target = self._send_back(record, entry)
                self.hands.journal.emit(
                    events.PidMovedBack(
                        mind=record.mind, turn_id=record.turn_id, pid=entry.pid, unit=target
                    )
                )
            except (VoluteError, OSError, ValueError) as error:
                self.hands.journal.emit(
                    events.PidNotMovedBack(
                        mind=record.mind, turn_id=record.turn_id, pid=entry.pid, error=str(error)
                    )
                )
                failed.append(entry)
            except cgroupmove.ProcessGone:
                continue
            finally:
                os.close(pidfd)
        return failed

    def _send_back(self, record: Record, entry: MovedProcess) -> str:
        """Its own unit if still active (into the very cgroup it left), else the
        fallback scope; the unit it went to."""
        origin = pidmoves.origin_of(entry.cgroup)
        if origin is not None and self.manager.active_state(entry.unit) in ACTIVE:
            try:
                self._attach(entry.unit, entry.cgroup, origin.subcgroup, entry.pid)
                return entry.unit
            except (VoluteError, OSError):
                pass  # its cgroup went, or systemd refused: the fallback
        fallback = pidmoves.returned_scope(record.mind, record.turn_id)
        if self.manager.active_state(fallback) in ACTIVE:
            cgroupmove.attach(self._cgroup_of(fallback), entry.pid)
        else:
            props = ScopeProperties(
                slice=entry.slice if entry.slice != "-.slice" else "system.slice",
                description=f"volute: processes of {record.mind}'s lease {record.turn_id},"
                f" whose unit {entry.unit} was gone",
            )
            self.manager.start_scope(fallback, [entry.pid], props)
        return fallback


def _alive(entry: MovedProcess) -> bool:
    pidfd = pidfds.open_recorded(entry.pid, entry.start_time)
    if pidfd is None:
        return False
    os.close(pidfd)
    return True


def _entry(found: pidmoves.Seen) -> MovedProcess:
    origin = pidmoves.origin_of(found.cgroup)
    assert origin is not None  # refusal() refused a process with no unit
    return MovedProcess(found.pid, found.start_time, found.cgroup, origin.unit, origin.slice)
