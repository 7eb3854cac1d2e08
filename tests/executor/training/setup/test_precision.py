"""The precision builder: TF32 on CUDA only, the autocast dtype per target dtype, loss scaling
under float16, and the drafter's master dtype (trained in it, exported in model.dtype)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.dist_env import detect_dist_env
from dflash_recipes.executor.model.convert import torch_dtype
from dflash_recipes.executor.training import fit, train_step
from dflash_recipes.executor.training.setup.models import build_models
from dflash_recipes.executor.training.setup.precision import (
    apply_tf32,
    autocast_dtype,
    build_grad_scaler,
    master_dtype,
    needs_loss_scaling,
    tf32_settings,
)
from dflash_recipes.plan.run_plan import RunPlan

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def restore_tf32() -> Iterator[None]:
    """The process-wide TF32 flags as they were before the test."""
    precision = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = cudnn


def _plan(tmp_path: Path, *extra: str) -> RunPlan:
    return tiny_scratch_plan(tmp_path / "run", "training.max_steps=2", *extra)


def test_tf32_is_set_on_cuda_only_and_to_the_plans_value() -> None:
    assert tf32_settings("cpu", True) is None
    assert tf32_settings("cpu", False) is None
    assert tf32_settings("cuda", True) == {"cuda.matmul.allow_tf32": True, "cudnn.allow_tf32": True}
    assert tf32_settings("cuda", False) == {
        "cuda.matmul.allow_tf32": False,
        "cudnn.allow_tf32": False,
    }


@pytest.mark.usefixtures("restore_tf32")
def test_apply_tf32_sets_the_backends_for_a_cuda_device_and_nothing_on_cpu(
    tmp_path: Path,
) -> None:
    on, off = _plan(tmp_path), _plan(tmp_path, "training.tf32=false")
    assert on.training.tf32 is True and off.training.tf32 is False
    torch.set_float32_matmul_precision("highest")
    assert apply_tf32(on, torch.device("cpu")) is None
    assert torch.get_float32_matmul_precision() == "highest"  # untouched on the CPU
    # a CUDA device claimed (the flags are settable on a CPU build too)
    assert apply_tf32(on, torch.device("cuda")) == tf32_settings("cuda", True)
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert apply_tf32(off, torch.device("cuda")) == tf32_settings("cuda", False)
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_setup_applies_the_plans_tf32_on_the_runs_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan(tmp_path, "training.tf32=false")
    seen: list[tuple[bool, str]] = []

    def recording(plan: RunPlan, device: torch.device) -> dict[str, bool] | None:
        seen.append((plan.training.tf32, device.type))
        return apply_tf32(plan, device)

    monkeypatch.setattr(train_step, "apply_tf32", recording)  # build_step applies it
    fit.run_plan(plan, progress=False)
    assert seen == [(False, "cpu")]


def test_autocast_follows_a_half_precision_target_on_cuda() -> None:
    assert autocast_dtype("cuda", "bfloat16") == torch.bfloat16
    assert autocast_dtype("cuda", "float16") == torch.float16  # was none before
    assert autocast_dtype("cuda", "float32") is None
    for dtype in ("bfloat16", "float16", "float32"):
        assert autocast_dtype("cpu", dtype) is None


def test_only_float16_autocast_scales_the_loss(tmp_path: Path) -> None:
    assert needs_loss_scaling("cuda", "float16")
    assert not needs_loss_scaling("cuda", "bfloat16")
    assert not needs_loss_scaling("cuda", "float32")
    assert not needs_loss_scaling("cpu", "float16")
    plan = _plan(tmp_path, "model.dtype=float16")
    assert build_grad_scaler(plan, torch.device("cpu")) is None


def test_the_drafter_trains_in_the_master_dtype(tmp_path: Path) -> None:
    for name, expected in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        plan = _plan(tmp_path / name, f"training.drafter_master_dtype={name}")
        assert master_dtype(plan) == expected
        models = build_models(
            plan, detect_dist_env("cpu"), offline=False, warm=True, max_chunk_logits=None
        )
        assert {p.dtype for p in models.drafter.parameters()} == {expected}
        assert {p.dtype for p in models.trainable} == {expected}
        # the frozen target keeps model.dtype
        target_dtypes = {
            p.dtype for n, p in models.target.named_parameters() if "dflash_module" not in n
        }
        assert target_dtypes == {torch_dtype(plan.base_model.dtype)}


def test_a_bfloat16_master_trains_keeps_bf16_adam_state_and_exports_in_model_dtype(
    tmp_path: Path,
) -> None:
    plan = _plan(tmp_path, "training.drafter_master_dtype=bfloat16")
    assert plan.base_model.dtype == "float32"
    summary = fit.run_plan(plan, progress=False)
    assert summary.steps == 2
    out = Path(plan.training.output_dir)
    exported = load_file(str(out / "export" / "model.safetensors"))
    assert {t.dtype for t in exported.values()} == {torch.float32}  # model.dtype, not bf16
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["torch_dtype"] == "float32"
    # the training checkpoint holds AdamW's moments in the parameters' dtype
    optimizer = next(out.glob("checkpoint-*/optimizer.pt"))
    state = torch.load(optimizer, weights_only=True)["optimizer"]["state"]
    moments = {v.dtype for s in state.values() for k, v in s.items() if k != "step"}
    assert moments == {torch.bfloat16}
