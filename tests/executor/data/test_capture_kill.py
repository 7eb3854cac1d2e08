"""`kill -9` of a real `capture` process in the middle of a shard, then a rerun.

The killed process is a separate interpreter; each shard's write is slowed down (in that
process only) so that the kill lands while a shard is half written: its temporary file exists
and its final name does not. The rerun must resume and leave exactly the files of an
uninterrupted capture.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.data.capture import capture_plan
from dflash_recipes.files.capture_manifest import MANIFEST_FILE, read_manifest
from dflash_recipes.files.locking import LOCK_FILE

pytestmark = pytest.mark.timing

SHARD_BYTES = 2**19

#: The killed capture: every shard's safetensors write pauses before its rename.
CHILD = """
import sys, time
from pathlib import Path
from dflash_recipes.executor.data import capture
from dflash_recipes.plan.run_plan import RunPlan

real_save = capture.save_file

def slow_save(tensors, path, metadata=None):
    real_save(tensors, path, metadata=metadata)
    Path(sys.argv[3]).touch()  # a shard is half written: its temporary file is complete
    time.sleep(30)

capture.save_file = slow_save
plan = RunPlan.from_json(Path(sys.argv[1]).read_text())
capture.capture_plan(plan, Path(sys.argv[2]), max_shard_bytes=int(sys.argv[4]), progress=False)
"""


@pytest.mark.slow
def test_kill_9_in_the_middle_of_a_shard_then_rerun_equals_an_uninterrupted_capture(
    tmp_path: Path,
) -> None:
    plan = tiny_scratch_plan(tmp_path / "run")
    whole = tmp_path / "whole"
    capture_plan(plan, whole, max_shard_bytes=SHARD_BYTES, progress=False)
    assert len(read_manifest(whole).shards) > 1

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    parts, signal_file = tmp_path / "parts", tmp_path / "half-written"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", CHILD, str(plan_file), str(parts), str(signal_file)]
    child = subprocess.Popen([*argv, str(SHARD_BYTES)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not signal_file.exists():
            assert child.poll() is None, "the capture ended before it could be killed"
            assert time.monotonic() < deadline, "the capture never reached its first shard"
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    # What the kill left: an incomplete capture with a half-written shard's temporary file.
    assert not read_manifest(parts).complete
    leftovers = [p.name for p in parts.iterdir() if ".tmp" in p.name]
    assert leftovers, sorted(p.name for p in parts.iterdir())

    rerun = capture_plan(plan, parts, max_shard_bytes=SHARD_BYTES, progress=False)
    assert rerun.complete
    names = sorted(p.name for p in whole.iterdir())
    assert sorted(p.name for p in parts.iterdir()) == names
    for name in names:
        if name != LOCK_FILE:
            assert (whole / name).read_bytes() == (parts / name).read_bytes(), name
    assert read_manifest(parts).complete and (parts / MANIFEST_FILE).exists()
