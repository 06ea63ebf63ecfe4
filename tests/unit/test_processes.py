"""volutectl.kernel.processes: the one way volutectl starts a program and reads how it ended."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from volutectl.kernel import processes


def test_exit_code_is_the_code_or_128_plus_the_signal() -> None:
    assert processes.run(["/bin/sh", "-c", "exit 0"]).exit_code == 0
    assert processes.run(["/bin/sh", "-c", "exit 3"]).exit_code == 3
    assert processes.run(["/bin/sh", "-c", "kill -TERM $$"]).exit_code == 128 + signal.SIGTERM
    assert processes.run(["/bin/sh", "-c", "kill -KILL $$"]).exit_code == 137
    assert processes.exit_code(0) == 0
    assert processes.exit_code(5 << 8) == 5
    assert processes.exit_code(signal.SIGINT) == 130


def test_run_captures_stdout_and_redirects_the_rest(capfd: pytest.CaptureFixture[str]) -> None:
    finished = processes.run(
        ["/bin/sh", "-c", "echo out; echo err >&2; exit 4"],
        redirect={2: os.devnull},
        capture=True,
    )
    assert finished == processes.Finished(4, "out\n")
    assert capfd.readouterr() == ("", "")  # stdout captured, stderr discarded
    processes.run(["/bin/sh", "-c", "echo to-stderr"], redirect={1: 2})
    assert capfd.readouterr() == ("", "to-stderr\n")


def test_environment_and_path_search() -> None:
    finished = processes.run(
        ["sh", "-c", 'echo "$ONLY"'], env={"ONLY": "this", "PATH": "/usr/bin:/bin"},
        capture=True, search_path=True,
    )  # fmt: skip
    assert finished.output == "this\n"
    with pytest.raises(FileNotFoundError):
        processes.spawn(["/nonexistent/program"])
    with pytest.raises(FileNotFoundError):
        processes.run(["no-such-program-volutectl"], search_path=True)


def test_redirect_onto_the_same_number_survives_exec() -> None:
    """dup2(fd, fd) is a no-op that keeps close-on-exec: the helper must move it first."""
    read_fd, write_fd = os.pipe()
    try:
        code = f"import os; os.write({write_fd}, b'through')"
        pid = processes.spawn([sys.executable, "-c", code], redirect={write_fd: write_fd})
        assert processes.wait(pid) == 0
        os.close(write_fd)
        write_fd = -1
        assert os.read(read_fd, 100) == b"through"
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)


def test_inherited_descriptors_stay_private_to_the_child() -> None:
    read_fd, write_fd = os.pipe()
    try:
        code = f"import os; os.write({write_fd}, b'kept')"
        pid = processes.spawn([sys.executable, "-c", code], inherit=[write_fd])
        assert not os.get_inheritable(write_fd)  # restored at once in the parent
        assert processes.wait(pid) == 0
        assert os.read(read_fd, 100) == b"kept"
        # Not inherited unless asked: the child cannot write to it.
        pid = processes.spawn([sys.executable, "-c", code])
        assert processes.wait(pid) != 0
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_the_child_gets_sigpipe_back() -> None:
    """Python ignores SIGPIPE, and an ignored signal stays ignored across exec."""
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
    status = processes.run(["/bin/cat", "/proc/self/status"], capture=True).output
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:"))[7:], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))
    assert not ignored & (1 << (signal.SIGXFSZ - 1))
    # So a writer into a closed pipe dies of it, as in a shell.
    assert processes.run(["/bin/sh", "-c", "yes | head -n 1 >/dev/null"]).exit_code == 0


def test_poll_reaps_only_an_ended_child() -> None:
    pid = processes.spawn(["/bin/sh", "-c", "read -r _"], redirect={0: os.devnull})
    deadline = time.monotonic() + 10
    while (code := processes.poll(pid)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert code == 1  # read hit the end of /dev/null
    pid = processes.spawn(["/bin/sleep", "5"])
    try:
        assert processes.poll(pid) is None
    finally:
        os.kill(pid, signal.SIGKILL)
        assert processes.wait(pid) == 137
