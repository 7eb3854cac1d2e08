"""Fault injection on the run lock: two `run`s on one output_dir, and `kill -9` of a holder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from testkit.compiling import SMALL_BLOCKS, TINY_SCRATCH

from dflash_recipes.cli import main
from dflash_recipes.files.locking import LOCK_FILE

REPO = Path(__file__).resolve().parents[4]

pytestmark = pytest.mark.usefixtures("one_thread")

#: `dflash-recipe run ...` whose first checkpoint save waits for a gate file: the run is
#: certainly holding its lock (and mid-training) while the test starts a second run.
GATED_RUN = """
import sys, time
from pathlib import Path
from dflash_recipes.executor.training.save_policy import SavePolicy
gate = Path(sys.argv[1])
real_save = SavePolicy.save
def gated_save(self, *args, **kwargs):
    while not gate.exists():
        time.sleep(0.05)
    return real_save(self, *args, **kwargs)
SavePolicy.save = gated_save
sys.argv = ["dflash-recipe", *sys.argv[2:]]
from dflash_recipes.cli import run_cli
run_cli()
"""

HOLDER = """
import sys, time
from pathlib import Path
from dflash_recipes.files.locking import hold_directory_lock
with hold_directory_lock(Path(sys.argv[1]), purpose="run"):
    print("locked", flush=True)
    time.sleep(120)
"""


def _args(out: Path) -> list[str]:
    return [
        "run",
        str(TINY_SCRATCH),
        f"training.output_dir={out}",
        "training.max_steps=3",
        "training.save_steps=1",
        "training.logging_steps=1",
        *SMALL_BLOCKS,
        "--no-progress",
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _wait_for_lock(out: Path, pid: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if json.loads((out / LOCK_FILE).read_text(encoding="utf-8"))["pid"] == pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    pytest.fail("the first run never took the lock")


@pytest.mark.timing
def test_a_second_run_fails_fast_and_the_first_finishes_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "run"
    gate = tmp_path / "gate"
    first = subprocess.Popen(
        [sys.executable, "-c", GATED_RUN, str(gate), *_args(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )
    try:
        _wait_for_lock(out, first.pid, first)
        second = subprocess.run(
            [sys.executable, "-m", "dflash_recipes.cli", *_args(out)],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=300,
        )
        assert second.returncode == 1, second.stderr
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, second.stderr
        assert errors[0].startswith(f"error: {out} is in use by another run (pid {first.pid} on")
        assert "Traceback" not in second.stderr
        # Refused while the first still holds the lock (it waits at its gate until released
        # below): the second run did not wait for it to finish.
        assert first.poll() is None
        assert not any(p.name.startswith("checkpoint") for p in out.iterdir())
    finally:
        gate.touch()
        output, _ = first.communicate(timeout=300)
    assert first.returncode == 0, output
    assert "done: 3 steps" in output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    assert [r["kind"] for r in rows].count("summary") == 1


def test_after_kill_9_of_the_holder_the_next_run_starts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True, env=_env()
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "locked"
    refused = CliRunner().invoke(main, _args(out))
    assert refused.exit_code == 1
    assert f"error: {out} is in use by another run (pid {holder.pid} on" in refused.output
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    result = CliRunner().invoke(main, _args(out))
    assert result.exit_code == 0, result.output
    assert "done: 3 steps" in result.output
