"""A mind's environment file, on real files: root reads it only when root alone could
have written it and no one else may read it, never follows a link, never blocks, reads
a bounded amount, and names the file (and the line, never its text) when it refuses.

These run as root, as the gate does (the machines that run them are root in a VM); the
files are given to another user where a test needs one."""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from volutectl.config.settings import Settings
from volutectl.errors import ConfigError
from volutectl.launcher import envfile, fork

NOBODY = 65534
SECRET = "sk-live-0123456789"


@pytest.fixture(autouse=True)
def as_root() -> None:
    assert os.geteuid() == 0, "these tests check root's reads: run them as root"


@pytest.fixture
def secrets(tmp_path: Path) -> Path:
    """A directory of root's, closed to others, as /etc/volute/minds would be."""
    directory = tmp_path / "minds"
    directory.mkdir(mode=0o700)
    return directory


def write(path: Path, text: str | bytes, mode: int = 0o600) -> Path:
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    os.chmod(path, mode)
    return path


def refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        envfile.read_environment_file(path)
    assert caught.value.exit_code == 78
    message = caught.value.message
    assert message.startswith(f"environment file {path}: "), message
    return message


@pytest.fixture
def alarm() -> Iterator[None]:
    """A read that would block fails the test after 5 s instead of hanging it."""

    def hung(signum: int, frame: object) -> None:
        raise AssertionError("the read blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_reads_the_variables_of_a_file_of_roots(secrets: Path) -> None:
    path = write(
        secrets / "alpha.env",
        "# the model's key\n"
        "\n"
        f"API_KEY={SECRET}\n"
        "  SPACED = around the value  \n"
        "DOUBLE=\"quoted 'inner'\"\n"
        "SINGLE='one'\n"
        "EMPTY=\n"
        "EQUALS=a=b==\n"
        'UNMATCHED="half\n',
    )
    assert envfile.read_environment_file(path) == {
        "API_KEY": SECRET,
        "SPACED": "around the value",
        "DOUBLE": "quoted 'inner'",
        "SINGLE": "one",
        "EMPTY": "",
        "EQUALS": "a=b==",
        "UNMATCHED": '"half',
    }


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o644, 0o660])
def test_a_file_open_to_group_or_others_is_refused(secrets: Path, mode: int) -> None:
    path = write(secrets / "alpha.env", f"API_KEY={SECRET}\n", mode)
    message = refusal(path)
    assert "open to group or others" in message and f"{mode:04o}" in message


def test_a_read_only_file_of_roots_is_fine(secrets: Path) -> None:
    path = write(secrets / "alpha.env", "A=1\n", 0o400)
    assert envfile.read_environment_file(path) == {"A": "1"}


def test_a_file_of_another_user_is_refused(secrets: Path) -> None:
    path = write(secrets / "alpha.env", f"API_KEY={SECRET}\n")
    os.chown(path, NOBODY, NOBODY)
    message = refusal(path)
    assert "belongs to" in message and "not root" in message


def test_a_symlink_to_a_good_file_is_refused(secrets: Path) -> None:
    target = write(secrets / "real.env", "A=1\n")
    (secrets / "alpha.env").symlink_to(target)
    assert "is a symbolic link" in refusal(secrets / "alpha.env")


def test_a_symlink_on_the_way_is_refused(tmp_path: Path, secrets: Path) -> None:
    write(secrets / "alpha.env", "A=1\n")
    (tmp_path / "link").symlink_to(secrets)
    message = refusal(tmp_path / "link" / "alpha.env")
    assert f"{tmp_path / 'link'} is a symbolic link, not a directory" in message


def test_a_fifo_is_refused_without_blocking(secrets: Path, alarm: None) -> None:
    os.mkfifo(secrets / "alpha.env", 0o600)
    assert "is a FIFO" in refusal(secrets / "alpha.env")


def test_a_device_is_refused(secrets: Path) -> None:
    os.mknod(secrets / "alpha.env", 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null
    assert "is a device" in refusal(secrets / "alpha.env")


def test_a_directory_is_refused(secrets: Path) -> None:
    (secrets / "alpha.env").mkdir(mode=0o700)
    assert "is a directory" in refusal(secrets / "alpha.env")


def test_a_directory_others_may_write_is_refused(secrets: Path) -> None:
    path = write(secrets / "alpha.env", "A=1\n")
    os.chmod(secrets, 0o777)
    message = refusal(path)
    assert f"directory {secrets} is writable by group or others" in message
    os.chmod(secrets, 0o770)
    assert f"directory {secrets} is writable by group or others" in refusal(path)


def test_a_sticky_directory_of_roots_is_fine(secrets: Path) -> None:
    # As /tmp: in it, no one but root may rename or remove what root owns.
    path = write(secrets / "alpha.env", "A=1\n")
    os.chmod(secrets, 0o1777)
    assert envfile.read_environment_file(path) == {"A": "1"}


def test_a_directory_of_another_user_is_refused(secrets: Path) -> None:
    path = write(secrets / "alpha.env", "A=1\n")
    os.chown(secrets, NOBODY, NOBODY)
    assert f"directory {secrets} belongs to" in refusal(path)


def test_a_missing_file_is_named(secrets: Path) -> None:
    assert refusal(secrets / "alpha.env").endswith(": does not exist")
    assert f"{secrets / 'gone'} does not exist" in refusal(secrets / "gone" / "alpha.env")


def test_a_relative_path_or_dotdot_is_refused(secrets: Path) -> None:
    write(secrets / "alpha.env", "A=1\n")
    with pytest.raises(ConfigError, match="not an absolute path"):
        envfile.read_environment_file(Path("minds/alpha.env"))
    with pytest.raises(ConfigError, match="without '..'"):
        envfile.read_environment_file(secrets / ".." / "minds" / "alpha.env")


def test_the_size_is_bounded(secrets: Path) -> None:
    line = f"A={'x' * (envfile.MAX_BYTES - 3)}\n"
    assert len(line) == envfile.MAX_BYTES
    path = write(secrets / "alpha.env", line)
    assert len(envfile.read_environment_file(path)["A"]) == envfile.MAX_BYTES - 3
    write(path, line + "\n")
    assert "larger than 64 KiB" in refusal(path)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (f"A=1\n# c\n{SECRET}\n", "line 3 has no '='"),
        (f"A=1\n\n{SECRET}-x=1\n", "line 3: the name before '=' is not a variable name"),
        (f"A=1\nB=2\nA={SECRET}\n", "line 3 sets A again (first on line 1)"),
        ("A=1\nB=2\nC=x\0y\n", "line 3 holds a NUL byte"),
        (b"A=1\nB=2\nC=\xff\n", "line 3 is not UTF-8"),
    ],
)
def test_a_parse_error_names_the_line_and_never_its_text(
    secrets: Path, text: str | bytes, says: str
) -> None:
    message = refusal(write(secrets / "alpha.env", text))
    assert says in message, message
    assert SECRET not in message


def test_every_check_but_the_read_is_open_to_other_users(secrets: Path) -> None:
    path = write(secrets / "alpha.env", "not parsed here\n")
    envfile.check_environment_file(path)  # the metadata passes
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="open to group or others"):
        envfile.check_environment_file(path)


def test_the_file_overrides_the_configs_environment(secrets: Path) -> None:
    path = write(secrets / "alpha.env", f"API_KEY={SECRET}\n")
    configured = {"API_KEY": "placeholder", "MODEL": "small"}
    assert fork.mind_environment(configured, path) == {"API_KEY": SECRET, "MODEL": "small"}
    assert fork.mind_environment(configured, None) == configured


def test_the_config_takes_only_an_absolute_path() -> None:
    mind = {"command": "true", "environment_file": "/etc/volute/minds/a.env"}
    settings = Settings.model_validate({"minds": {"a": mind}})
    assert settings.minds["a"].environment_file == Path("/etc/volute/minds/a.env")
    with pytest.raises(ValueError, match="is not an absolute path"):
        Settings.model_validate({"minds": {"a": {**mind, "environment_file": "a.env"}}})
