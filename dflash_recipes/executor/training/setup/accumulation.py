"""Gradient accumulation that equals one micro-step over the whole batch.

Each micro-batch's loss is a weighted mean over its supervised positions (normalised by its
own ``weight_sum``). Averaging those means over ``gradient_accumulation_steps`` micro-batches
would weigh a short micro-batch's positions more than a long one's, so the step would not be
the step of one batch holding them all. With accumulation, each micro-batch back-propagates
its weighted *sum* (``loss * weight_sum``), and after the last one the summed gradients are
divided by the step's total weight (over every rank under DDP, times the world size that DDP's
average divides by): exactly the whole batch's weighted mean, as
:func:`~dflash_recipes.executor.training.loss.combine_losses` does for chunks of blocks. A
term normalised by a count rather than by the weights (DSpark's confidence BCE) is scaled the
same way, as :func:`~dflash_recipes.executor.collectives.global_batch_loss` does across ranks.

Without accumulation (one micro-batch per step) the loss is the one of
:func:`~dflash_recipes.executor.collectives.global_batch_loss`, unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflash_recipes.executor.collectives import all_reduce_sum, global_batch_loss
from dflash_recipes.executor.dist_env import DistEnv
from dflash_recipes.executor.training.loss import LossOutput


class GradientAccumulation:
    """What each micro-batch back-propagates, and the gradients' scale after the last one."""

    def __init__(self, steps: int, params: list[nn.Parameter], env: DistEnv) -> None:
        self.steps = steps
        self.params = params
        self.env = env
        self._seen = 0
        self._weight: Tensor | None = None

    def loss(self, result: LossOutput) -> Tensor:
        """The scalar this micro-batch back-propagates."""
        if self.steps == 1:
            return global_batch_loss(result.loss, result.weight_sum, self.env)
        return result.loss * result.weight_sum.detach()

    def after_backward(self, result: LossOutput) -> None:
        """Count the micro-batch; after the step's last one, divide the summed gradients by
        the step's total weight (no host sync)."""
        if self.steps == 1:
            return
        weight = result.weight_sum.detach().float()
        self._weight = weight.clone() if self._weight is None else self._weight.add_(weight)
        self._seen += 1
        if self._seen < self.steps:
            return
        total = self._weight
        if self.env.is_distributed:
            total = all_reduce_sum(total, self.env)
        self._seen, self._weight = 0, None
        positive = total > 0
        scale = torch.where(positive, self.env.world_size / torch.where(positive, total, 1.0), 0.0)
        with torch.no_grad():
            for param in self.params:
                if param.grad is not None:
                    param.grad.mul_(scale.to(param.grad.dtype))


__all__ = ["GradientAccumulation"]
