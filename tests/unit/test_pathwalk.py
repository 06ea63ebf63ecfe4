"""volutectl.kernel.pathwalk: what the gate opens in trees users control, on real files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from volutectl.kernel import pathwalk


def test_a_walk_opens_the_directory_itself_and_names_it(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    fd = pathwalk.open_directory(tmp_path / "a" / "b")
    try:
        assert pathwalk.descriptor_path(fd) == tmp_path / "a" / "b"
        inner = pathwalk.open_directory("../b/.", relative_to=fd)
        assert pathwalk.descriptor_path(inner) == tmp_path / "a" / "b"
        os.close(inner)
    finally:
        os.close(fd)
    with pytest.raises(NotADirectoryError):
        (tmp_path / "file").write_text("x")
        pathwalk.open_directory(tmp_path / "file")
    with pytest.raises(FileNotFoundError):
        pathwalk.open_directory(tmp_path / "gone")


def test_a_magic_link_on_proc_is_never_followed() -> None:
    """/proc/self/cwd's text is a path, but the link leads into the process's own view;
    following either would leave /proc without the kernel-filesystem check seeing it."""
    with pytest.raises(pathwalk.KernelPath, match="is under /proc"):
        pathwalk.open_directory("/proc/self/cwd")
    with pytest.raises(pathwalk.KernelPath):
        pathwalk.open_directory("/proc/self/root/tmp", any_symlink=True)


def test_a_symlink_loop_ends(tmp_path: Path) -> None:
    (tmp_path / "one").symlink_to(tmp_path / "two")
    (tmp_path / "two").symlink_to(tmp_path / "one")
    with pytest.raises(OSError) as raised:
        pathwalk.open_directory(tmp_path / "one", any_symlink=True)
    assert raised.value.errno == errno.ELOOP


def test_the_kernels_filesystems_are_known_by_their_descriptor(tmp_path: Path) -> None:
    for path, expected in [
        ("/proc", "/proc"),
        ("/sys/kernel", "/sys"),
        ("/dev", "/dev"),
        ("/dev/shm", "/dev"),
        (str(tmp_path), None),
        ("/", None),
    ]:
        fd = os.open(path, pathwalk.DIRECTORY_FLAGS)
        try:
            assert pathwalk.kernel_filesystem(fd) == expected, path
        finally:
            os.close(fd)


def test_small_files_are_read_bounded_and_only_if_regular(tmp_path: Path) -> None:
    (tmp_path / "ok").write_text("gitdir: x\n")
    (tmp_path / "big").write_bytes(b"x" * 5000)
    (tmp_path / "link").symlink_to(tmp_path / "ok")
    os.mkfifo(tmp_path / "fifo")
    fd = os.open(tmp_path, pathwalk.DIRECTORY_FLAGS)
    try:
        assert pathwalk.read_small_file(fd, "ok", 4096) == b"gitdir: x\n"
        for name, reason in [
            ("big", "larger than 4096 bytes"),
            ("link", "not a regular file"),
            ("fifo", "not a regular file"),
        ]:
            with pytest.raises(pathwalk.UntrustedPath, match=reason):
                pathwalk.read_small_file(fd, name, 4096)
        with pytest.raises(FileNotFoundError):
            pathwalk.read_small_file(fd, "gone", 4096)
    finally:
        os.close(fd)
