"""Roles (volutectl/roles.py): who is an admin, which requests need one, and what a
client sees of the queue and the config.

The gate's handlers run in-process on a real store (tests/unit/gate_harness.py); a
caller's groups are given, so no user database is asked.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.gate_harness import Harness
from volutectl import events, roles
from volutectl.cli.config import check_may_show, inline_secret_warnings
from volutectl.config.settings import Settings
from volutectl.errors import EX_NOPERM, VoluteError
from volutectl.gate import handlers
from volutectl.gate.handlers import Caller
from volutectl.states import QueueState
from volutectl.wire.messages import (
    AcquireRequest,
    ChangedReply,
    ClaimRequest,
    DeliverAck,
    DeliverManyRequest,
    DeliverRequest,
    DropRequest,
    EndLeaseRequest,
    ErrorReply,
    PauseReply,
    PauseRequest,
    PingRequest,
    QueueReply,
    QueueRequest,
    RegisterRepoRequest,
    ReleaseRequest,
    Reply,
    Request,
    ResumeRequest,
    RetryRequest,
    StatusRequest,
    WaitReply,
    WaitRequest,
)

CLIENT = Caller(64001, frozenset({"volute", "alice"}))
OTHER_CLIENT = Caller(64002, frozenset({"volute"}))
ADMIN = Caller(64003, frozenset({"volute", "volute-admin"}))
ROOT = Caller(0, frozenset())
# What a client may ask; every other request changes others' work.
CLIENT_REQUESTS = {
    DeliverRequest,
    DeliverManyRequest,
    StatusRequest,
    QueueRequest,
    RegisterRepoRequest,
    PingRequest,
    WaitRequest,
    AcquireRequest,  # a lease, like a delivery: any member (issue 31)
    ReleaseRequest,
    ClaimRequest,
}


@pytest.mark.parametrize(
    ("uid", "groups", "role"),
    [
        (0, (), roles.Role.ADMIN),  # root, in no group at all
        (0, ("volute",), roles.Role.ADMIN),
        (1000, ("volute-admin",), roles.Role.ADMIN),  # without volute: admin, no socket
        (1000, ("volute", "volute-admin"), roles.Role.ADMIN),
        (1000, ("volute",), roles.Role.CLIENT),
        (1000, (), roles.Role.CLIENT),
        (1000, ("volute-admins", "admin", "wheel", "sudo"), roles.Role.CLIENT),
    ],
)
def test_root_and_the_admin_group_are_admins_everyone_else_a_client(
    uid: int, groups: tuple[str, ...], role: roles.Role
) -> None:
    assert roles.role_of(uid, groups) is role


def test_an_admin_may_do_what_a_client_may_and_not_the_other_way() -> None:
    assert roles.permits(roles.Role.ADMIN, roles.Role.ADMIN)
    assert roles.permits(roles.Role.ADMIN, roles.Role.CLIENT)
    assert roles.permits(roles.Role.CLIENT, roles.Role.CLIENT)
    assert not roles.permits(roles.Role.CLIENT, roles.Role.ADMIN)


def test_groups_come_from_the_user_database() -> None:
    assert "root" in roles.group_names(0)
    assert roles.group_names(2**31 - 7) == frozenset()  # no passwd entry: no group
    assert Caller(0).role is roles.Role.ADMIN


def test_every_request_is_either_a_clients_or_an_admins() -> None:
    # A new request must be placed: this fails until it is in one set or the other.
    answered = set(handlers.HANDLERS) | set(handlers.TOGETHER)
    assert answered == CLIENT_REQUESTS | handlers.ADMIN_ONLY
    assert not set(handlers.HANDLERS) & set(handlers.TOGETHER)  # one handler each
    assert not CLIENT_REQUESTS & handlers.ADMIN_ONLY
    assert handlers.ADMIN_ONLY == {
        PauseRequest,
        ResumeRequest,
        RetryRequest,
        DropRequest,
        EndLeaseRequest,
    }


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    opened = Harness(tmp_path)
    yield opened
    opened.close()


def delivered(harness: Harness, caller: Caller) -> int:
    [ack] = handlers.accept_deliveries(
        harness.gate.state, [DeliverRequest("mimsy", "hello")], [caller]
    )
    assert isinstance(ack, DeliverAck), ack
    return ack.id


def answer(harness: Harness, request: Request[Reply], caller: Caller) -> Reply:
    return handlers.handle(harness.gate.state, request, caller)


@pytest.mark.parametrize(
    "request_",
    [
        PauseRequest(),
        PauseRequest(("mimsy",)),
        ResumeRequest(),
        RetryRequest((1,)),
        DropRequest((1,)),
    ],
)
def test_a_client_is_refused_with_77_naming_the_group(
    harness: Harness, request_: Request[Reply]
) -> None:
    delivery = delivered(harness, CLIENT)  # its own, even
    reply = answer(harness, request_, CLIENT)
    assert isinstance(reply, ErrorReply) and reply.code == EX_NOPERM, reply
    assert reply.hint is not None and "volute-admin" in reply.hint
    assert not harness.gate.state.store.minds.pauses()
    row = harness.gate.state.store.row(delivery)
    assert row is not None and row.state is QueueState.PENDING


def test_a_refusal_is_journalled_once_a_minute_per_uid_with_the_count_unsaid(
    harness: Harness,
) -> None:
    state = harness.gate.state
    refused = handlers._say_refused  # the clock is given: the minute is not waited out
    refused(state, "drop", CLIENT.uid, 100.0)
    for moment in (101.0, 130.0, 159.0):
        refused(state, "pause", CLIENT.uid, moment)
    refused(state, "retry", OTHER_CLIENT.uid, 100.5)  # another uid: said at once
    said = harness.journal.of(events.AdminRequestRefused)
    assert [(event.op, event.uid, event.unsaid) for event in said] == [
        ("drop", CLIENT.uid, 0),
        ("retry", OTHER_CLIENT.uid, 0),
    ]
    refused(state, "resume", CLIENT.uid, 161.0)  # a minute on: said, with the 3 unsaid
    said = harness.journal.of(events.AdminRequestRefused)
    assert (said[-1].op, said[-1].uid, said[-1].unsaid) == ("resume", CLIENT.uid, 3)
    assert "3 more refused" in said[-1].message()
    # OTHER_CLIENT's record, older than a minute with nothing unsaid, is gone: a burst of
    # distinct uids does not grow the record for ever.
    assert set(state.admin_refused) == {CLIENT.uid}


def test_each_refused_request_is_counted_and_an_admins_is_not(harness: Harness) -> None:
    for _ in range(3):
        reply = answer(harness, DropRequest((1,)), CLIENT)
        assert isinstance(reply, ErrorReply) and reply.code == EX_NOPERM
    said = harness.journal.of(events.AdminRequestRefused)
    assert [(event.op, event.uid) for event in said] == [("drop", CLIENT.uid)]
    assert harness.gate.state.admin_refused[CLIENT.uid][1] == 2  # two more, to say later
    answer(harness, DropRequest((1,)), ADMIN)  # an admin's is not a refusal
    assert len(harness.journal.of(events.AdminRequestRefused)) == 1


def test_an_admin_and_root_change_others_work(harness: Harness) -> None:
    delivery = delivered(harness, CLIENT)
    assert isinstance(answer(harness, PauseRequest(("mimsy",)), ADMIN), PauseReply)
    assert "mimsy" in harness.gate.state.store.minds.pauses()
    assert answer(harness, DropRequest((delivery,)), ROOT) == ChangedReply((delivery,))
    row = harness.gate.state.store.row(delivery)
    assert row is not None and row.state is QueueState.DROPPED and row.uid == CLIENT.uid


def test_a_client_lists_its_own_deliveries_an_admin_everyones(harness: Harness) -> None:
    mine = [delivered(harness, CLIENT) for _ in range(3)]
    theirs = delivered(harness, OTHER_CLIENT)
    listed = answer(harness, QueueRequest(limit=2), CLIENT)
    assert isinstance(listed, QueueReply)
    assert [row.id for row in listed.rows] == mine[:0:-1] and listed.not_shown == 1
    every = answer(harness, QueueRequest(), ADMIN)
    assert isinstance(every, QueueReply)
    assert {row.id for row in every.rows} == {*mine, theirs}
    # ...with whose each is: the sender's uid, as the gate read it from the socket.
    assert {row.id: row.uid for row in every.rows} == {
        **dict.fromkeys(mine, CLIENT.uid),
        theirs: OTHER_CLIENT.uid,
    }


def test_a_client_waits_for_its_own_deliveries_only(harness: Harness) -> None:
    mine, theirs = delivered(harness, CLIENT), delivered(harness, OTHER_CLIENT)
    assert answer(harness, WaitRequest((mine,)), CLIENT) == WaitReply((mine,))
    refused = answer(harness, WaitRequest((mine, theirs)), CLIENT)
    assert isinstance(refused, ErrorReply) and refused.code == EX_NOPERM
    assert str(theirs) in refused.error
    assert answer(harness, WaitRequest((theirs,)), ADMIN) == WaitReply((theirs,))


def test_config_show_refuses_a_client_anothers_file(tmp_path: Path) -> None:
    config = tmp_path / "volutectl.toml"
    config.write_text('[minds.m]\ncommand = "true"\nenvironment = { KEY = "sk-x" }\n')
    os.chown(config, 0, 0)
    with pytest.raises(VoluteError) as refused:
        check_may_show(config, CLIENT.uid, CLIENT.groups)
    assert refused.value.exit_code == EX_NOPERM
    assert refused.value.hint is not None and "volute-admin" in refused.value.hint
    check_may_show(config, ADMIN.uid, ADMIN.groups)  # an admin may
    check_may_show(config, 0)  # root may
    os.chown(config, CLIENT.uid, 0)
    check_may_show(config, CLIENT.uid, CLIENT.groups)  # a file of one's own may be shown
    check_may_show(tmp_path / "absent.toml", CLIENT.uid, CLIENT.groups)  # defaults only


def test_inline_environment_is_warned_of_by_name_never_by_value() -> None:
    settings = Settings(
        minds={
            "m": {"command": "true", "environment": {"API_KEY": "sk-secret", "MODE": "x"}},
            "n": {"command": "true"},
        }
    )
    [warning] = inline_secret_warnings(settings, "m")
    assert "API_KEY, MODE" in warning and "minds.m.environment_file" in warning
    assert "sk-secret" not in warning
    assert inline_secret_warnings(settings, "n") == []
