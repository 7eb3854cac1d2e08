"""One writer per output directory: `hold_directory_lock` and `DirectoryLockedError`."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_recipes.errors import DirectoryLockedError
from dflash_recipes.files.locking import LOCK_FILE, describe_holder, hold_directory_lock

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
from pathlib import Path
from dflash_recipes.files.locking import hold_directory_lock
with hold_directory_lock(Path(sys.argv[1]), purpose="capture"):
    print("locked", flush=True)
    time.sleep(120)
"""


def _start_holder(directory: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_holder_is_refused_at_once_and_told_who_holds_it(tmp_path: Path) -> None:
    out = tmp_path / "new" / "run"
    with hold_directory_lock(out, purpose="run") as lock:
        assert lock == out / LOCK_FILE  # the directory was created for it
        record = json.loads(lock.read_text(encoding="utf-8"))
        assert record["pid"] == os.getpid() and record["purpose"] == "run"
        with pytest.raises(DirectoryLockedError) as info, hold_directory_lock(out, purpose="run"):
            pytest.fail("a second holder got the lock")
        text = str(info.value)
        assert text.startswith(f"{out} is in use by another run (pid {os.getpid()} on host ")
        assert socket.gethostname() in text and "started 20" in text
        assert "choose another directory" in text
    with hold_directory_lock(out, purpose="run"):  # released on exit
        pass


def test_a_holder_in_another_process_is_named_and_kill_9_frees_the_lock(tmp_path: Path) -> None:
    proc = _start_holder(tmp_path)
    try:
        expected = rf"another capture \(pid {proc.pid} on "
        with (
            pytest.raises(DirectoryLockedError, match=expected),
            hold_directory_lock(tmp_path, purpose="run"),
        ):
            pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert (tmp_path / LOCK_FILE).exists()  # the file stays, the lock does not
    with hold_directory_lock(tmp_path, purpose="run"):
        pass


def test_an_unreadable_holder_record_is_described_not_raised(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_bytes(b"\xff[[[")
    assert describe_holder(tmp_path / LOCK_FILE) == "a process whose details could not be read"
    (tmp_path / LOCK_FILE).write_text("[1, 2]", encoding="utf-8")
    assert describe_holder(tmp_path / LOCK_FILE) == "a process whose details could not be read"
    assert describe_holder(tmp_path / "missing") == "a process whose details could not be read"


def test_a_symlinked_lock_file_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep", encoding="utf-8")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(victim)
    with pytest.raises(OSError), hold_directory_lock(run, purpose="run"):
        pass
    assert victim.read_text(encoding="utf-8") == "keep"


def test_a_new_holder_record_leaves_no_tail_of_a_longer_old_one(tmp_path: Path) -> None:
    # the record is rewritten in place: without truncation a shorter new record keeps the
    # old one's tail, the file is no longer JSON, and a refused process cannot name the holder
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"purpose": "capture", "pid": 1, "note": "x" * 500}))
    with hold_directory_lock(tmp_path, purpose="run"):
        record = json.loads(lock.read_text())
        assert record["purpose"] == "run" and record["pid"] == os.getpid()
        assert describe_holder(lock).startswith(f"run (pid {os.getpid()} on host ")


def test_a_record_without_fields_is_described_with_question_marks(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_text("{}", encoding="utf-8")
    assert describe_holder(tmp_path / LOCK_FILE) == "? (pid ? on host ?, started ?)"


def test_only_the_first_4096_bytes_of_a_record_are_read(tmp_path: Path) -> None:
    record = json.dumps({"purpose": "run", "pid": 7, "host": "h", "started": "s"})
    (tmp_path / LOCK_FILE).write_text(record + " " * (4096 - len(record)), encoding="utf-8")
    assert describe_holder(tmp_path / LOCK_FILE) == "run (pid 7 on host h, started s)"
    (tmp_path / LOCK_FILE).write_text(record + " " * 4096 + "x", encoding="utf-8")
    # the tail past the bound is never read, so the garbage there does not spoil the record
    assert describe_holder(tmp_path / LOCK_FILE) == "run (pid 7 on host h, started s)"
    (tmp_path / LOCK_FILE).write_text('{"pid": "' + "9" * 5000 + '"}', encoding="utf-8")
    assert describe_holder(tmp_path / LOCK_FILE) == "a process whose details could not be read"


def test_the_holder_record_names_the_command_host_and_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["dflash-recipe", "run", "x" * 600])
    with hold_directory_lock(tmp_path, purpose="capture") as lock:
        record = json.loads(lock.read_text(encoding="utf-8"))
        assert oct(lock.stat().st_mode & 0o777) in ("0o644", "0o640", "0o600", "0o604")
    assert record["command"] == ("dflash-recipe run " + "x" * 600)[:400]
    assert record["host"] == socket.gethostname() and record["purpose"] == "capture"
    assert re.fullmatch(r"20\d\d-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", record["started"])
    assert lock.read_text(encoding="utf-8").endswith("}\n")
    assert set(record) == {"command", "host", "pid", "purpose", "started"}


def test_a_refused_process_keeps_the_holder_record_and_frees_its_descriptor(
    tmp_path: Path,
) -> None:
    with hold_directory_lock(tmp_path, purpose="run") as lock:
        before = lock.read_bytes()
        open_fds = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            with pytest.raises(DirectoryLockedError), hold_directory_lock(tmp_path, purpose="x"):
                pass
        assert len(os.listdir("/proc/self/fd")) == open_fds
        assert lock.read_bytes() == before


def test_a_lock_error_other_than_held_is_raised_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_flock(_fd: int, _op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", broken_flock)
    with (
        pytest.raises(OSError, match="No locks available") as info,
        hold_directory_lock(tmp_path, purpose="run"),
    ):
        pass
    assert not isinstance(info.value, DirectoryLockedError)


def test_a_record_with_a_stray_byte_still_names_the_holder(tmp_path: Path) -> None:
    # a hostname in a legacy encoding: the record is still read, the byte replaced
    (tmp_path / LOCK_FILE).write_bytes(
        b'{"host": "caf\xe9", "pid": 7, "purpose": "run", "started": "s"}'
    )
    assert describe_holder(tmp_path / LOCK_FILE) == "run (pid 7 on host caf\ufffd, started s)"


def test_the_holder_record_is_one_line_of_sorted_keys(tmp_path: Path) -> None:
    with hold_directory_lock(tmp_path, purpose="run") as lock:
        text = lock.read_text(encoding="utf-8")
    assert text.count("\n") == 1 and list(json.loads(text)) == sorted(json.loads(text))


def test_a_waiting_process_tries_again_at_least_every_tenth_of_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another rank waiting for the data cache notices its builder is done within 0.1 s."""
    from dflash_recipes.files import locking

    held = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX)  # another open file description: a real second holder
    clock = [0.0]
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        clock[0] += seconds
        if clock[0] >= 5.0:  # the holder finishes after five seconds
            os.close(held)

    monkeypatch.setattr(locking.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(locking.time, "sleep", sleep)
    with hold_directory_lock(tmp_path, purpose="run", wait_s=60.0):
        pass
    assert 5.0 <= clock[0] <= 5.1  # taken at the first try after the holder let go
    assert pauses[0] == 0.05 and max(pauses) == 0.1


def test_a_lock_still_held_when_the_wait_is_spent_is_refused_after_waiting_all_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflash_recipes.files import locking

    held = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX)
    clock = [0.0]
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        assert seconds > 0 and len(pauses) < 100, "waiting without end"
        pauses.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(locking.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(locking.time, "sleep", sleep)
    try:
        with (
            pytest.raises(DirectoryLockedError, match="is in use by another"),
            hold_directory_lock(tmp_path, purpose="run", wait_s=0.3),
        ):
            pass
    finally:
        os.close(held)
    assert clock[0] == pytest.approx(0.3)  # the whole wait, then the refusal
    assert pauses[:3] == [0.05, 0.1, 0.1]
