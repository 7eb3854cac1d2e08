"""The optimiser builder: AdamW, the learning-rate schedule, the number of steps, clipping.

:func:`build_optimization` returns what the loop steps: AdamW over the drafter's trainable
parameters (fused where torch has it), a ``LambdaLR`` applying the warmup-then-decay multiplier
of the peak learning rate (:func:`lr_factor`) once per optimiser step, and the run's number of
optimiser steps (:func:`total_optimizer_steps`). :func:`clip_gradients` is the global-norm
clipping of each step, with the multi-tensor kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import torch
from torch import Tensor, nn

from dflash_recipes.plan.run_plan import RunPlan


@attrs.define(eq=False)
class Optimization:
    """What the loop steps: the optimiser, its schedule, and how many steps the run takes."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    #: The peak learning rate (the schedule's multiplier scales it).
    peak_lr: float = 0.0
    #: The schedule's multiplier of the peak learning rate at a 0-based optimiser step.
    factor: Callable[[int], float] = attrs.field(default=lambda step: 1.0)
    #: AdamW's weight decay, as the plan says.
    weight_decay: float = 0.0

    def follow_plan(self, step: int) -> None:
        """After a checkpoint's optimiser and scheduler state is restored: the plan's peak
        learning rate and weight decay, not the checkpoint's, from optimiser step `step` on.

        ``load_state_dict`` brings back the hyperparameters the checkpoint was saved with (the
        param groups' ``lr``, ``initial_lr`` and ``weight_decay``, the scheduler's
        ``base_lrs``), so a resume with another ``training.learning_rate`` would train at the
        old one while logging the new one. Adam's moments and the step count stay restored.
        """
        groups = self.optimizer.param_groups
        for group in groups:
            group["initial_lr"] = self.peak_lr
            group["weight_decay"] = self.weight_decay
            group["lr"] = self.lr_at(step)
        self.scheduler.base_lrs = [self.peak_lr] * len(groups)
        self.scheduler._last_lr = [group["lr"] for group in groups]

    def lr_at(self, step: int) -> float:
        """The learning rate optimiser step `step` (0-based) updates with. Not the
        scheduler's ``get_last_lr()`` after that step: the scheduler has moved on to the
        next step's rate by then (0.0 after a cosine run's last step)."""
        return self.peak_lr * self.factor(step)


def build_optimization(
    plan: RunPlan, params: list[nn.Parameter], *, batches_per_epoch: int
) -> Optimization:
    """AdamW over `params` with the plan's schedule over the run's optimiser steps.

    `batches_per_epoch` is what one rank draws per epoch (from the data builder); with
    ``training.max_steps`` unset it sets the number of steps.
    """
    training = plan.training
    optimizer = build_optimizer(
        params, lr=training.learning_rate, weight_decay=training.weight_decay
    )
    total_steps = total_optimizer_steps(plan, batches_per_epoch)

    def schedule(step: int) -> float:
        return lr_factor(
            step,
            total_steps=total_steps,
            warmup_ratio=training.warmup_ratio,
            kind=training.lr_scheduler_type,
        )

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return Optimization(
        optimizer,
        scheduler,
        total_steps,
        peak_lr=training.learning_rate,
        factor=schedule,
        weight_decay=training.weight_decay,
    )


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


def total_optimizer_steps(plan: RunPlan, batches_per_epoch: int) -> int:
    """max_steps, else epochs x optimiser steps per epoch (at least 1); `batches_per_epoch` is
    the number of batches one rank draws per epoch."""
    training = plan.training
    if training.max_steps is not None:
        return training.max_steps
    steps = training.num_train_epochs * (batches_per_epoch // training.gradient_accumulation_steps)
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
    the norm before clipping as a plain tensor (no host sync).

    With a sharded drafter the gradients are DTensors: the norm is the global one (the
    squares summed over every rank's shard by one all-reduce) and comes back replicated, so
    every rank holds the same value and skips a non-finite step alike."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return norm.to_local() if isinstance(norm, DTensor) else norm


__all__ = [
    "Optimization",
    "build_optimization",
    "build_optimizer",
    "clip_gradients",
    "lr_factor",
    "total_optimizer_steps",
]
