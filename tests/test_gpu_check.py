"""benchmarks/gpu_check.py stays runnable: its CPU dry run passes every check, and a wrong
reference makes it fail."""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
CHECKS = ("flex", "bf16", "chunked", "nccl", "fsdp", "step", "eval", "packing", "run")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
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
    assert "tokens/s: " in done.stdout  # the eval check's speed
    assert "gpu_check: all checks passed" in done.stdout
    # the run check launched the CLI and found the export
    assert "--nproc-per-node 1" in done.stdout
    assert "model.safetensors, config.json" in done.stdout


@pytest.mark.slow
def test_a_wrong_reference_fails_the_run() -> None:
    done = _run(
        "--only",
        "flex",
        "nccl",
        "fsdp",
        "eval",
        "--inject-mismatch",
        "flex",
        "nccl",
        "fsdp",
        "eval",
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    for name in ("flex", "nccl", "fsdp", "eval"):
        assert f"\nFAIL {name} (" in done.stdout, out
    assert "BAD  draft states, no sinks" in done.stdout, out
    assert "BAD  all_reduce over 1 rank(s)" in done.stdout, out
    assert "BAD  target taps, step_inputs on shard_target_fsdp2" in done.stdout, out
    assert "BAD  bf16 target on cpu: tau" in done.stdout, out
    assert "gpu_check: 4 check(s) failed: flex, nccl, fsdp, eval" in done.stdout, out


@pytest.mark.slow
def test_the_fsdp_check_shards_over_two_gloo_ranks() -> None:
    """The dry run's fsdp check with 2 CPU processes: the target really sharded, its taps through
    the trainer's step_inputs equal the plain target's on both ranks."""
    done = _run("--only", "fsdp", "--ddp-world", "2")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "gloo on the CPU, 2 process(es)" in done.stdout, out
    assert "ok   target taps, step_inputs on shard_target_fsdp2 over 2 rank(s)" in done.stdout, out
    assert "ok   drafter loss, shard_drafter_fsdp2 vs plain" in done.stdout, out
    assert "\nPASS fsdp (" in done.stdout and "BAD" not in done.stdout, out


@pytest.mark.slow
def test_the_run_check_fails_without_the_export() -> None:
    # (its passing run is test_dry_run_passes_every_check's)
    wrong = _run("--only", "run", "--inject-mismatch", "run")
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert "BAD  export" in wrong.stdout and "nothing written" in wrong.stdout


def test_profile_breaks_the_step_into_phases_and_prints_the_profiler_table(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "step.json"
    done = _run("--only", "step", "--profile", "--steps", "2", "--profile-trace", str(trace))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    phases = next(line for line in done.stdout.splitlines() if "profile: per phase" in line)
    for phase in (
        "target forward + masks",
        "drafter + head forward",
        "backward",
        "optimizer (clip + AdamW)",
    ):
        assert f"{phase} " in phases and " ms" in phases, phases
    assert "top 25 CPU ops by self CPU time" in done.stdout, out
    assert "Self CPU %" in done.stdout and "aten::mm" in done.stdout, out
    assert trace.stat().st_size > 0
    assert "\nPASS step (" in done.stdout, out


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


# ---------------------------------------------------------------------------------------------
# the gradient comparison (the flex check's backward runs on CUDA only: its rule is tested here)
# ---------------------------------------------------------------------------------------------


@functools.cache
def _gpu_check() -> ModuleType:
    """benchmarks/gpu_check.py imported as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _Fused(torch.nn.Module):
    """A drafter's shape in small: `fc` fuses the context, `body` runs after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3)
        self.body = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, *, fused: bool) -> torch.Tensor:
        out: torch.Tensor = self.body(self.fc(x) if fused else x[..., :3])
        return out


def _backward(module: _Fused, *, fused: bool) -> _Fused:
    x = torch.arange(8.0).view(2, 4) / 8
    module(x, fused=fused).sum().backward()  # type: ignore[no-untyped-call]
    return module


def _grads_line(
    got: _Fused, ref: _Fused, outside: frozenset[str] = frozenset()
) -> tuple[bool, str]:
    gpu_check = _gpu_check()
    report = gpu_check.Report("flex")
    report.grads("drafter gradients", got, ref, tol=1e-6, outside=outside)
    return report.failed, report.lines[-1]


def test_gradients_are_compared_for_what_both_graphs_contain() -> None:
    fused = _Fused()
    failed, line = _grads_line(
        _backward(copy.deepcopy(fused), fused=True), _backward(fused, fused=True)
    )
    assert not failed, line
    assert "4 gradients" in line  # fc and body, weight and bias


def test_a_gradient_in_one_graph_only_fails() -> None:
    """The GPU run's `fc.weight has no gradient`: a graph without fc against one with it."""
    got, ref = _backward(_Fused(), fused=False), _backward(_Fused(), fused=True)
    failed, line = _grads_line(got, ref)
    assert failed, line
    assert "fc.weight has a gradient in the reference only" in line


def test_a_parameter_left_out_of_both_graphs_fails_unless_the_check_says_so() -> None:
    got, ref = _backward(_Fused(), fused=False), _backward(_Fused(), fused=False)
    failed, line = _grads_line(got, ref)
    assert failed, line
    assert "fc.weight should get a gradient and gets none" in line
    failed, line = _grads_line(got, ref, outside=frozenset({"fc.weight", "fc.bias"}))
    assert not failed, line
    assert "2 gradients" in line and "not in the check's graph: fc.bias, fc.weight" in line
    # the check's premise wrong: a parameter said to be outside the graph gets a gradient
    got, ref = _backward(_Fused(), fused=True), _backward(_Fused(), fused=True)
    failed, line = _grads_line(got, ref, outside=frozenset({"fc.weight"}))
    assert failed and "fc.weight has a gradient, but the check's graph leaves it out" in line
