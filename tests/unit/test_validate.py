"""The gate's request checks, as pure functions of settings and a request."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from volutectl import validate
from volutectl.config import Settings
from volutectl.errors import EX_DATAERR, EX_NOUSER, VoluteError

SETTINGS = Settings(
    minds={"mimsy": {"command": "true"}, "pip": {"command": ["true"]}},  # type: ignore[dict-item]
    gate={"max_message_bytes": 10},  # type: ignore[arg-type]
)


def code(request: dict[str, Any]) -> int:
    with pytest.raises(VoluteError) as raised:
        validate.delivery(SETTINGS, request)
    return raised.value.exit_code


def test_a_good_delivery_comes_back_typed() -> None:
    got = validate.delivery(SETTINGS, {"mind": "mimsy", "message": "héllo", "interrupt": 1})
    assert got == ("mimsy", "main", "héllo".encode(), True)


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
        validate.delivery(SETTINGS, {"mind": "ghost", "message": "x"})
    assert raised.value.hint is not None and "mimsy, pip" in raised.value.hint


def test_the_size_limit_counts_utf8_bytes_not_characters() -> None:
    assert validate.delivery(SETTINGS, {"mind": "pip", "message": "é" * 5})[2] == "é".encode() * 5
    assert code({"mind": "pip", "message": "é" * 6}) == EX_DATAERR


@given(st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.integers(), st.text(),
                                                     st.lists(st.integers()))))  # fmt: skip
def test_no_request_raises_anything_but_a_volute_error(request_: dict[str, Any]) -> None:
    for check in (
        lambda r: validate.delivery(SETTINGS, r),
        validate.queue_states,
        validate.delivery_ids,
        validate.repository_path,
        validate.request_id,
    ):
        try:
            check(request_)
        except VoluteError:
            pass


def test_queue_states_ids_and_paths() -> None:
    assert validate.queue_states({}) == ["pending", "running", "dead"]
    assert validate.queue_states({"states": ["done"]}) == ["done"]
    bad: object
    for bad in ([{}], "pending", ["nope"]):
        with pytest.raises(VoluteError):
            validate.queue_states({"states": bad})
    assert validate.delivery_ids({"ids": [3, 4]}) == [3, 4]
    for bad_ids in (None, ["x"], [True], 3):
        with pytest.raises(VoluteError):
            validate.delivery_ids({"ids": bad_ids})
    assert validate.repository_path({"path": "/srv/repo/.git"}) == "/srv/repo/.git"
    with pytest.raises(VoluteError):
        validate.repository_path({"path": "relative/.git"})


def test_request_ids_are_128_bits_of_lowercase_hex_or_absent() -> None:
    good = "0123456789abcdef" * 2
    assert validate.request_id({"request_id": good}) == good
    assert validate.request_id({}) is None  # a client older than request ids
    assert validate.request_id({"request_id": None}) is None
    for bad in (good[:-1], good + "0", good.upper(), "g" * 32, 7, ["x"], "", True):
        with pytest.raises(VoluteError) as raised:
            validate.request_id({"request_id": bad})
        assert raised.value.exit_code == EX_DATAERR
        assert "request_id" in raised.value.message
