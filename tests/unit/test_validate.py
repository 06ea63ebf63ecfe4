"""The gate's request checks: messages.decode_request (each field's type, range and name)
and validate (what needs the gate's settings, or the filesystem)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from volutectl.config.settings import Settings
from volutectl.errors import EX_DATAERR, EX_NOUSER, EX_USAGE, VoluteError
from volutectl.gate import validate
from volutectl.states import QueueState
from volutectl.store.queue import NewDelivery
from volutectl.wire import fields, messages
from volutectl.wire.messages import DeliverRequest, Op

SETTINGS = Settings(
    minds={"mimsy": {"command": "true"}, "pip": {"command": ["true"]}},
    gate={"max_message_bytes": 10},
)


def delivery(request: dict[str, Any]) -> NewDelivery:
    """A deliver request as the gate takes it: decoded, then checked against settings."""
    return validate.delivery(SETTINGS, DeliverRequest.decode(request))


def code(request: dict[str, Any]) -> int:
    with pytest.raises(VoluteError) as raised:
        delivery(request)
    return raised.value.exit_code


def test_a_good_delivery_comes_back_typed() -> None:
    got = delivery({"mind": "mimsy", "message": "héllo", "interrupt": True})
    assert got == NewDelivery("mimsy", "main", "héllo".encode(), True)
    got = delivery({"mind": "pip", "session": "s", "message": "", "wait": True})
    assert got == NewDelivery("pip", "s", b"", False)


@pytest.mark.parametrize("field", ["interrupt", "wait"])
@pytest.mark.parametrize("value", [1, 0, "yes", "true", None, 1.0, [], {}])
def test_flags_are_booleans_and_nothing_is_coerced(field: str, value: object) -> None:
    with pytest.raises(VoluteError) as raised:
        delivery({"mind": "mimsy", "message": "x", field: value})
    assert raised.value.exit_code == EX_DATAERR
    assert raised.value.message.startswith(f"{field}: must be true or false")


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        ({"mind": "bad/name", "message": "x"}, EX_DATAERR),
        ({"mind": "mimsy", "session": "a b", "message": "x"}, EX_DATAERR),
        ({"mind": "ghost", "message": "x"}, EX_NOUSER),
        ({"mind": "mimsy", "message": "x" * 11}, EX_DATAERR),
        ({"mind": "mimsy", "message": "\udcff"}, EX_DATAERR),
        ({"mind": 7, "message": "x"}, EX_DATAERR),
        ({"mind": "mimsy", "message": None}, EX_DATAERR),
    ],
)
def test_bad_deliveries_name_the_problem_with_a_sysexits_code(
    request_: dict[str, Any], expected: int
) -> None:
    assert code(request_) == expected


def test_an_unknown_mind_lists_the_configured_ones() -> None:
    with pytest.raises(VoluteError) as raised:
        delivery({"mind": "ghost", "message": "x"})
    assert raised.value.hint is not None and "mimsy, pip" in raised.value.hint


def test_the_size_limit_counts_utf8_bytes_not_characters() -> None:
    assert delivery({"mind": "pip", "message": "é" * 5}).message == "é".encode() * 5
    assert code({"mind": "pip", "message": "é" * 6}) == EX_DATAERR


FIELDS = ["op", "mind", "session", "message", "interrupt", "wait", "states", "ids", "path"]
VALUES = st.none() | st.booleans() | st.integers() | st.floats() | st.text()


@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8),
                       VALUES | st.lists(VALUES, max_size=3)
                       | st.dictionaries(st.text(max_size=3), VALUES, max_size=2)))  # fmt: skip
def test_no_request_raises_anything_but_a_volute_error(request_: dict[str, Any]) -> None:
    for check in (
        messages.decode_request,
        delivery,
        fields.queue_states,
        fields.delivery_ids,
        messages.RegisterRepoRequest.decode,
        fields.request_id,
    ):
        try:
            check(request_)
        except VoluteError:
            pass


def test_queue_states_ids_and_paths() -> None:
    assert fields.queue_states({}) == ()  # the default: states.DEFAULT_LISTED
    assert fields.queue_states({"states": ["done"]}) == (QueueState.DONE,)
    bad: object
    for bad in ([{}], "pending", ["nope"]):
        with pytest.raises(VoluteError):
            fields.queue_states({"states": bad})
    assert fields.delivery_ids({"ids": [3, 4]}) == (3, 4)
    for bad_ids in (None, ["x"], [True], 3):
        with pytest.raises(VoluteError):
            fields.delivery_ids({"ids": bad_ids})
    register = messages.RegisterRepoRequest.decode
    assert register({"path": "/srv/repo/.git"}).path == "/srv/repo/.git"
    with pytest.raises(VoluteError):
        register({"path": "relative/.git"})
    for bad_path in ("/srv/\0", None, 5):
        with pytest.raises(VoluteError, match="^path: "):
            register({"path": bad_path})


def test_each_refusal_names_its_field() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"message": "x"}, "mind: missing"),
        ({"mind": ["m"], "message": "x"}, "mind: must be a string, not an array"),
        ({"mind": "mimsy", "session": 3, "message": "x"}, "session: must be a string"),
        ({"mind": "mimsy"}, "message: missing"),
        ({"mind": "mimsy", "message": {"a": 1}}, "message: must be a string, not an object"),
        ({"mind": "mimsy", "message": "x", "interrupt": None}, "interrupt: must be true or false"),
    ]
    for request_, start in cases:
        with pytest.raises(VoluteError) as raised:
            delivery(request_)
        assert raised.value.message.startswith(start), raised.value.message
    with pytest.raises(VoluteError, match=r"^states\[1\]: 'nope' is not one of"):
        fields.queue_states({"states": ["done", "nope"]})
    with pytest.raises(VoluteError, match=r"^states: must be an array"):
        fields.queue_states({"states": "done"})
    with pytest.raises(VoluteError, match=r"^ids\[1\]: a delivery id is an integer, not a number"):
        fields.delivery_ids({"ids": [1, 2.0]})
    with pytest.raises(VoluteError, match=r"^ids\[0\]: delivery ids start at 1, not 0"):
        fields.delivery_ids({"ids": [0]})


def test_the_op_is_a_known_string() -> None:
    assert [messages.op_of({"op": op.value}) for op in Op] == list(Op)
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({}, EX_DATAERR, "op: missing"),
        ({"op": None}, EX_DATAERR, "op: missing"),
        ({"op": 5}, EX_DATAERR, "op: must be a string, not an integer"),
        ({"op": "frobnicate"}, EX_USAGE, "op: unknown request 'frobnicate'"),
    ]
    for request_, code_, start in cases:
        with pytest.raises(VoluteError) as raised:
            messages.op_of(request_)
        assert (raised.value.exit_code, raised.value.message[: len(start)]) == (code_, start)


def fake_git_dir(path: Path) -> Path:
    """The shape register_repo asks for: HEAD, objects/ and refs/."""
    (path / "objects").mkdir(parents=True)
    (path / "refs").mkdir()
    (path / "HEAD").write_text("ref: refs/heads/main\n")
    return path


def test_a_git_common_dir_of_ones_own_is_accepted_resolved(tmp_path: Path) -> None:
    git = fake_git_dir(tmp_path / "repo" / ".git")
    (tmp_path / "link").symlink_to(git)
    assert validate.git_common_dir(str(git), os.getuid()) == git
    assert validate.git_common_dir(str(tmp_path / "link"), os.getuid()) == git


def test_a_git_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    git = fake_git_dir(tmp_path / ".git")
    owner = os.getuid()
    if owner == 0:  # root's own would be accepted: give it to somebody else
        os.chown(git, 65534, 65534)
        owner = 65534
    assert validate.git_common_dir(str(git), owner) == git
    with pytest.raises(VoluteError, match=f"belongs to uid {owner}") as raised:
        validate.git_common_dir(str(git), owner + 1)  # neither its owner nor root
    assert raised.value.exit_code == EX_DATAERR
    # Root, who may read and watch any tree anyway, may register anyone's.
    assert validate.git_common_dir(str(git), 0) == git


def test_kernel_filesystems_are_refused_wherever_a_symlink_points(tmp_path: Path) -> None:
    shm = fake_git_dir(Path("/dev/shm") / f"volute-test-{os.getpid()}")
    try:
        (tmp_path / "to-shm").symlink_to(shm)
        (tmp_path / "to-proc").symlink_to("/proc/self")
        for path, under in [
            ("/proc/self", "/proc"),
            ("/proc", "/proc"),
            ("/sys/kernel", "/sys"),
            (str(shm), "/dev"),
            (str(tmp_path / "to-shm"), "/dev"),
            (str(tmp_path / "to-proc"), "/proc"),
        ]:
            with pytest.raises(VoluteError, match=f"is under {under},") as raised:
                validate.git_common_dir(path, os.getuid())
            assert raised.value.exit_code == EX_DATAERR
    finally:
        for name in ("HEAD", "objects", "refs"):
            target = shm / name
            target.unlink() if target.is_file() else target.rmdir()
        shm.rmdir()


def test_what_is_not_a_git_common_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    half = tmp_path / "half"
    half.mkdir()
    (half / "HEAD").write_text("ref: refs/heads/main\n")  # a worktree's git dir looks so
    for path, reason in [
        ("/", "not a git common directory"),
        (str(tmp_path), "not a git common directory"),
        (str(half), "not a git common directory"),
        (str(tmp_path / "file"), "not a directory"),
        (str(tmp_path / "gone"), "No such file or directory"),
    ]:
        with pytest.raises(VoluteError, match=reason) as raised:
            validate.git_common_dir(path, os.getuid())
        assert raised.value.exit_code == EX_DATAERR
        assert raised.value.message.startswith(f"path: {path}")


def test_request_ids_are_random_hex_or_a_users_name_or_absent() -> None:
    random = "0123456789abcdef" * 2
    for good in (random, random.upper(), "nightly-2026.12.01", "a", "job:7@host+x_y", "x" * 128):
        assert fields.request_id({"request_id": good}) == good
    assert fields.request_id({}) is None  # a client older than request ids
    assert fields.request_id({"request_id": None}) is None
    for bad in ("x" * 129, "-x", ".x", "a b", "a/b", "caf\u00e9", "a\n", 7, ["x"], "", True):
        with pytest.raises(VoluteError) as raised:
            fields.request_id({"request_id": bad})
        assert raised.value.exit_code == EX_DATAERR
        assert "request_id" in raised.value.message
