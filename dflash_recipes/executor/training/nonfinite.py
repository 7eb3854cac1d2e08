"""Non-finite steps: a step whose gradient norm is NaN or Inf never reaches the weights.

:meth:`NonfiniteSteps.step` replaces the loop's ``optimizer.step()``: it hands the fused AdamW
a device-side ``found_inf`` flag (``not isfinite(grad_norm)``), as ``torch.amp.GradScaler``
does, so the kernel leaves the weights, both moments and the step counter as they were, with
no host sync. Under float16 loss scaling the scaler's own flag (any inf/NaN among the unscaled
gradients) skips the step, and backs the scale off, as before. The learning-rate scheduler
advances on a skipped step, as it does under GradScaler: the rate stays a function of the step
number (``Optimization.lr_at``) and the batch was consumed.

The counters live on the device: the skips of the logging window
(:meth:`NonfiniteSteps.take_window`), the current run of skips in a row and the first step at
which that run reached ``training.max_nonfinite_steps``. They are read only where the loop reads
the device anyway (:meth:`NonfiniteSteps.check` at a logging step and before a checkpoint), so
a run that reaches the limit stops at the next of those with :class:`TrainingDivergedError`
naming the steps, and saves nothing after them. Every rank computes the same norm from the
same all-reduced gradients, so every rank skips, counts and stops alike without a collective.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from dflash_recipes.errors import TrainingDivergedError


class NonfiniteSteps:
    """The skip of a non-finite step and its device-side counters (module docstring)."""

    def __init__(self, limit: int, device: torch.device, *, output_dir: Path) -> None:
        #: Skipped steps in a row that stop the run (``training.max_nonfinite_steps``).
        self.limit = limit
        #: Where the run's checkpoints are (for the message that stops the run).
        self.output_dir = output_dir
        self._found = torch.zeros((), dtype=torch.float32, device=device)
        self._window = torch.zeros((), dtype=torch.long, device=device)
        self._streak = torch.zeros((), dtype=torch.long, device=device)
        #: The 1-based step at which a run of skips first reached the limit; 0: never.
        self._tripped = torch.zeros((), dtype=torch.long, device=device)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        grad_norm: Tensor,
        *,
        step: int,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """The optimiser step of 0-based `step` unless `grad_norm` is NaN or Inf (then nothing
        changes: weights, moments, AdamW's step counter), and the counters; no host sync."""
        bad = ~torch.isfinite(grad_norm.detach())
        if scaler is not None:  # the scaler's found_inf skips, and backs the scale off
            scaler.step(optimizer)
            scaler.update()
        else:
            if not optimizer.defaults.get("fused"):
                msg = (
                    "skipping a non-finite step needs the fused AdamW (found_inf); this "
                    "optimizer is not fused: its parameters must be floating point on CPU or CUDA"
                )
                raise RuntimeError(msg)
            self._found.copy_(bad)
            optimizer.found_inf = self._found  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        self._window.add_(bad)
        self._streak.copy_(torch.where(bad, self._streak + 1, 0))
        reached = (self._tripped == 0) & (self._streak >= self.limit)
        self._tripped.copy_(torch.where(reached, step + 1, self._tripped))

    def take_window(self) -> Tensor:
        """The skips since the last call (a device tensor, read at the logging step)."""
        count = self._window.clone()
        self._window.zero_()
        return count

    def check(self, done: int) -> int:
        """After optimiser step `done` (1-based): the skips in a row that end it (0: it was
        finite), or :class:`TrainingDivergedError` when a run of skips reached the limit. A
        host sync: call it only where the loop reads the device anyway."""
        tripped, streak = (int(v) for v in torch.stack([self._tripped, self._streak]).cpu())
        if tripped:
            first = tripped - self.limit + 1
            kept = (
                f"the weights and AdamW's moments are still those of step {first - 1}, the "
                "last finite one"
                if first > 1
                else "no step before them was finite: the weights are the initial ones"
            )
            msg = (
                f"training stopped after step {done}: the gradient norm was NaN or Inf in "
                f"{self.limit} steps in a row (steps {first}..{tripped}; "
                f"training.max_nonfinite_steps: {self.limit}); each was skipped, so {kept}, "
                f"and no checkpoint was saved after step {tripped - 1} in {self.output_dir}. "
                "Fix the cause (a lower training.learning_rate or max_grad_norm, a longer "
                "warmup_ratio, drafter_master_dtype: float32, or the data those steps read) "
                "and rerun: it resumes from the newest checkpoint"
            )
            raise TrainingDivergedError(msg)
        return streak


__all__ = ["NonfiniteSteps"]
