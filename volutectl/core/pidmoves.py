"""The pure part of moving a lease's processes into its scope and back: what the root
launcher reads of a process, and whether it may move it.

The gate asks (a MoveIn order, with the client's pidfds); the launcher decides, from its
own reading of each process and its own configuration, and trusts nothing the gate says:
a gate taken over must not be able to move sshd into a scope and then stop it. So a
process moves only if (`refusal`):
- its real and effective uid are both the mind's user's (from the launcher's config),
  and that user is not root (a mind that runs as root moves nothing: every daemon of the
  host would pass the uid check);
- it is not pid 1, the gate's or the launcher's main process, nor in their units;
- it is in no turn scope but the lease's own (never in another mind's turn);
- the target is lease `turn_id`'s own scope of that mind.

And it goes back (`return_target`) to the unit it came from while that unit is active,
else to a scope of its own, `volute-returned-<mind>-<turn id>.scope`, in the slice it
came from: never left in the lease's scope, which is stopped right after.
"""

from __future__ import annotations

from dataclasses import dataclass

from volutectl import names

# The systemd units whose processes are never moved, whatever their uid.
PROTECTED_UNITS = ("volute-gate.service", "volute-launcher.service", "init.scope")


@dataclass(frozen=True)
class Seen:
    """What the launcher read of one process, before it checked the pidfd still held it."""

    pid: int
    real_uid: int
    effective_uid: int
    cgroup: str  # its path in the systemd hierarchy, "/system.slice/x.service/sub"
    start_time: int  # field 22 of /proc/PID/stat: with the pid, it names the process


@dataclass(frozen=True)
class Origin:
    """Where a process came from: the unit systemd knows it by, the part of that unit's
    cgroup it was in (a delegated unit's, e.g. user@.service's), and the unit's slice."""

    unit: str
    subcgroup: str
    slice: str


def origin_of(cgroup: str) -> Origin | None:
    """The unit of a systemd cgroup path: its first component that is not a slice.

    `/user.slice/user-1000.slice/user@1000.service/app.slice/x.service` is
    user@1000.service (the system manager's unit), subcgroup `app.slice/x.service`,
    slice user-1000.slice. None for the root cgroup or a path with no unit."""
    parts = [part for part in cgroup.split("/") if part]
    slice_ = "-.slice"
    for index, part in enumerate(parts):
        if part.endswith(".slice"):
            slice_ = part
            continue
        if "." not in part or ".." in part:
            return None
        return Origin(part, "/".join(parts[index + 1 :]), slice_)
    return None


def parse_status_uids(status: str) -> tuple[int, int] | None:
    """(real, effective) uid from /proc/PID/status's `Uid:` line."""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()[1:]
            if len(fields) >= 2 and fields[0].isdigit() and fields[1].isdigit():
                return int(fields[0]), int(fields[1])
    return None


def parse_systemd_cgroup(text: str) -> str | None:
    """The systemd hierarchy's path from /proc/PID/cgroup: the `name=systemd` line on a
    legacy or hybrid host, else the unified one (`0::`)."""
    unified = None
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "name=systemd":
            return path
        if hierarchy == "0" and controllers == "":
            unified = path
    return unified


def parse_start_time(stat: str) -> int | None:
    """Field 22 (starttime, in clock ticks since boot) of /proc/PID/stat. The command
    (field 2) may hold spaces and parentheses: count from the last ')'."""
    _, paren, rest = stat.rpartition(")")
    fields = rest.split()
    if not paren or len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])


@dataclass(frozen=True)
class Rules:
    """What the launcher knows, not the gate: the mind's user, the pids and units that
    never move, and the scope the order may target."""

    mind: str
    turn_id: int
    mind_uid: int
    forbidden_pids: frozenset[int]  # pid 1, the gate's and the launcher's main pids

    @property
    def scope(self) -> str:
        return names.turn_scope_name(self.mind, self.turn_id)


def refusal(seen: Seen, rules: Rules) -> str | None:
    """Why this process may not move into the lease's scope; None if it may."""
    if rules.mind_uid == 0:
        return f"mind {rules.mind!r} runs as root: its processes are not moved"
    if seen.pid == 1 or seen.pid in rules.forbidden_pids:
        return f"pid {seen.pid} is pid 1, the gate or the launcher"
    if seen.real_uid != rules.mind_uid or seen.effective_uid != rules.mind_uid:
        return (
            f"pid {seen.pid} runs as uid {seen.real_uid}/{seen.effective_uid} (real/effective),"
            f" not as mind {rules.mind!r}'s user (uid {rules.mind_uid})"
        )
    origin = origin_of(seen.cgroup)
    if origin is None:
        return f"pid {seen.pid} is in no systemd unit ({seen.cgroup!r})"
    if origin.unit in PROTECTED_UNITS:
        return f"pid {seen.pid} is in {origin.unit}"
    turn = names.parse_turn_scope_name(origin.unit)
    if turn is not None and origin.unit != rules.scope:
        return f"pid {seen.pid} is in another turn's scope, {origin.unit}"
    if origin.unit.startswith("volute-turn-") and turn is None:
        return f"pid {seen.pid} is in {origin.unit}"
    return None


def returned_scope(mind: str, turn_id: int) -> str:
    """The fallback for a process whose unit of origin is gone: a scope of its own."""
    return f"volute-returned-{names.escape_unit_part(mind)}-{turn_id}.scope"


def return_target(origin: Origin, origin_active: bool, mind: str, turn_id: int) -> str:
    """The unit a process goes back to: its own while that is active, else the
    fallback scope (in the slice it came from)."""
    return origin.unit if origin_active else returned_scope(mind, turn_id)
