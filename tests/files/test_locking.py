"""One writer per output directory: `hold_directory_lock` and `DirectoryLockedError`."""

from __future__ import annotations

import json
import os
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
