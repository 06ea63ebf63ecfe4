"""volute_testbed.lines: the lines a child writes to a pipe, read with a timeout, on a
real pipe. The lease holders' reader (tests/system/test_leases.py, test_lease_moves.py)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from volute_testbed.lines import PipeLines


@pytest.fixture
def pipe() -> Iterator[tuple[PipeLines, int]]:
    read_fd, write_fd = os.pipe()
    try:
        yield PipeLines(read_fd), write_fd
    finally:
        os.close(read_fd)
        with contextlib.suppress(OSError):  # a test may have closed it
            os.close(write_fd)


def test_two_lines_written_together_are_both_there_without_waiting(
    pipe: tuple[PipeLines, int],
) -> None:
    """A buffered reader's first readline() took both into its buffer, and the select()
    for the second then waited on an empty pipe: the lease grant that never came."""
    lines, write_fd = pipe
    os.write(write_fd, b'{"state": "waiting"}\n{"event": "lease_granted"}\n')
    assert lines.ready(5.0) and lines.take() == b'{"state": "waiting"}'
    assert lines.ready(0.0) and lines.take() == b'{"event": "lease_granted"}'
    assert not lines.ready(0.0)  # written before: a poll, not a wait, says nothing more came


def test_a_part_of_a_line_is_not_a_line_until_its_end_comes(
    pipe: tuple[PipeLines, int],
) -> None:
    lines, write_fd = pipe
    os.write(write_fd, b'{"eve')
    assert not lines.ready(0.0) and lines.take() is None
    os.write(write_fd, b'nt": 1}\n')
    assert lines.ready(5.0) and lines.take() == b'{"event": 1}'


def test_a_closed_pipe_is_ready_with_no_line(pipe: tuple[PipeLines, int]) -> None:
    lines, write_fd = pipe
    os.write(write_fd, b"last\nunfinished")
    os.close(write_fd)
    assert lines.ready(5.0) and lines.take() == b"last"
    assert lines.ready(5.0) and lines.take() is None and lines.closed
