"""benchmarks/gpu_check.py stays runnable: its CPU dry run passes every check, and a wrong
reference makes it fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
CHECKS = ("flex", "bf16", "chunked", "nccl", "fsdp", "step")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_dry_run_passes_every_check() -> None:
    done = _run()
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for name in CHECKS:
        assert f"\nPASS {name} (" in done.stdout, out
    assert "FAIL" not in done.stdout and "BAD" not in done.stdout, out
    assert "tolerance" in done.stdout  # every comparison states its tolerance
    assert "target tokens/s" in done.stdout and "FLOPs formula" in done.stdout
    assert "gpu_check: all checks passed" in done.stdout


@pytest.mark.slow
def test_a_wrong_reference_fails_the_run() -> None:
    done = _run("--only", "flex", "nccl", "--inject-mismatch", "flex", "nccl")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "\nFAIL flex (" in done.stdout and "\nFAIL nccl (" in done.stdout, out
    assert "BAD  draft states, no sinks" in done.stdout, out
    assert "BAD  all_reduce over 1 rank(s)" in done.stdout, out
    assert "gpu_check: 2 check(s) failed: flex, nccl" in done.stdout, out


def test_without_cuda_it_says_to_use_the_dry_run() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "flex"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device is visible" in done.stderr and "--dry-run" in done.stderr
