"""The precision builder: TF32, the autocast dtype, loss scaling and the drafter's master dtype.

Each decision is a small pure function of the plan and the device, so it is tested on the CPU;
:func:`apply_tf32` and :func:`build_grad_scaler` act on them at setup.

- ``training.tf32`` (default on): float32 matmuls and cuDNN convolutions may use TF32 tensor
  cores. Only on CUDA: on the CPU nothing is set (the settings are process-wide and mean
  nothing there).
- Autocast: on CUDA the drafter's step runs under ``torch.autocast`` in the target's dtype when
  it is bfloat16 or float16 (the matmuls in low precision over the master weights); a float32
  target, or the CPU, runs without autocast.
- Loss scaling: float16 has bfloat16's precision budget but not its range, so small gradients
  of a float16-autocast step underflow. Under float16 autocast the step's loss is scaled by a
  ``torch.amp.GradScaler`` (dynamic scale, skipped steps on inf/NaN). The trainer's fused AdamW
  takes the scaler's scale and inf flag as tensors, so scaling adds no host sync.
- ``training.drafter_master_dtype``: the drafter's parameters (and so its gradients and AdamW's
  moments) in float32 (default) or bfloat16. The export casts to ``model.dtype`` either way.
"""

from __future__ import annotations

import torch

from dflash_recipes.executor.model.convert import torch_dtype
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.recipe.choices import AUTOCAST_DTYPES


def tf32_settings(device_type: str, enabled: bool) -> dict[str, bool] | None:
    """What :func:`apply_tf32` sets for a run on `device_type`: the backend flags and their value
    (`enabled`, the plan's ``training.tf32``), or None on anything but CUDA."""
    if device_type != "cuda":
        return None
    return {"cuda.matmul.allow_tf32": enabled, "cudnn.allow_tf32": enabled}


def apply_tf32(plan: RunPlan, device: torch.device) -> dict[str, bool] | None:
    """Set the plan's TF32 choice on the backends when `device` is CUDA; returns what was set
    (None: nothing, on CPU)."""
    settings = tf32_settings(device.type, plan.training.tf32)
    if settings is None:
        return None
    enabled = settings["cuda.matmul.allow_tf32"]
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = settings["cudnn.allow_tf32"]
    return settings


def autocast_dtype(device_type: str, target_dtype: str) -> torch.dtype | None:
    """The dtype the drafter's step autocasts to: the target's on CUDA when it is bfloat16 or
    float16; None (no autocast) for a float32 target or off CUDA."""
    if device_type != "cuda" or target_dtype not in AUTOCAST_DTYPES:
        return None
    return torch_dtype(target_dtype)


def needs_loss_scaling(device_type: str, target_dtype: str) -> bool:
    """True when the step runs under float16 autocast, whose gradients need loss scaling."""
    return autocast_dtype(device_type, target_dtype) == torch.float16


def build_grad_scaler(plan: RunPlan, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for a float16-autocast step (None otherwise: no scaling)."""
    if not needs_loss_scaling(device.type, plan.base_model.dtype):
        return None
    return torch.amp.GradScaler(device.type)


def master_dtype(plan: RunPlan) -> torch.dtype:
    """The drafter's parameter dtype while it trains (``training.drafter_master_dtype``)."""
    return torch_dtype(plan.training.drafter_master_dtype)


__all__ = [
    "apply_tf32",
    "autocast_dtype",
    "build_grad_scaler",
    "master_dtype",
    "needs_loss_scaling",
    "tf32_settings",
]
