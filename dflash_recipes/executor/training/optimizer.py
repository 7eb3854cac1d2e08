"""The trainer's optimiser, gradient clipping and learning-rate schedule.

AdamW over the drafter's trainable parameters (fused where torch has it), global-norm clipping
with the multi-tensor kernels, and the warmup-then-decay multiplier of the peak learning rate
that a ``LambdaLR`` applies once per optimiser step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dflash_recipes.executor.data.conversations import batches_per_epoch
from dflash_recipes.plan.run_plan import RunPlan


def lr_factor(step: int, *, total_steps: int, warmup_ratio: float, kind: str) -> float:
    """Multiplier of the peak learning rate at optimiser step `step` (0-based).

    Linear warmup over ``ceil(warmup_ratio * total_steps)`` steps (step 0 already gets
    ``1 / warmup``), then cosine to 0, linear to 0, or constant.
    """
    warmup = math.ceil(warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def total_optimizer_steps(plan: RunPlan, num_examples: int, world_size: int) -> int:
    """max_steps, else epochs x optimiser steps per epoch (at least 1)."""
    training = plan.training
    if training.max_steps is not None:
        return training.max_steps
    per_epoch = batches_per_epoch(
        num_examples, batch_size=training.per_device_train_batch_size, world_size=world_size
    )
    steps = training.num_train_epochs * (per_epoch // training.gradient_accumulation_steps)
    return max(1, steps)


def build_optimizer(
    params: list[nn.Parameter], *, lr: float, weight_decay: float
) -> torch.optim.AdamW:
    """The trainer's AdamW: fused (one kernel over every tensor) where torch has it for these
    parameters (floating point, on CPU or CUDA), else the multi-tensor foreach form; both
    compute the per-tensor loop's update up to float rounding."""
    fused = bool(params) and all(
        p.dtype.is_floating_point and p.device.type in ("cpu", "cuda") for p in params
    )
    if fused:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """Clip the gradients' global norm to `max_norm` with the multi-tensor kernels; returns
    the norm before clipping as a tensor (no host sync)."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


__all__ = [
    "build_optimizer",
    "clip_gradients",
    "lr_factor",
    "total_optimizer_steps",
]
