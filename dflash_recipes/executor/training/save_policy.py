"""When the loop saves a training checkpoint, and what the checkpoint records.

A checkpoint is saved every ``training.save_steps`` optimiser steps, at the last step, and
whenever the loop is told to (the ranks agreed to stop on a signal, SIGUSR1 asked for one,
``stop_after`` was reached). Rank 0 writes it
(:func:`~dflash_recipes.executor.training.checkpoints.save_training_checkpoint`, which keeps at
most ``training.save_total_limit``) with the trainer state a resume needs (the data position,
the seed, the plan fingerprint, the world size) and a copy of the plan (``plan.json``, which a
resume with another plan compares); every rank waits for the save to finish
(:func:`~dflash_recipes.executor.coordination.wait_for_rank0`: past
``training.distributed_timeout_s`` with a message naming the save). A sharded drafter is saved
by every rank, each writing its part
(:func:`~dflash_recipes.executor.training.checkpoints.save_sharded_training_checkpoint`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs

from dflash_recipes.executor.coordination import wait_for_rank0
from dflash_recipes.executor.dist_env import DistEnv, is_main
from dflash_recipes.executor.training.checkpoints import (
    NONFINITE_STREAK,
    save_sharded_training_checkpoint,
    save_training_checkpoint,
)
from dflash_recipes.executor.training.setup.models import Models
from dflash_recipes.executor.training.setup.optimizer import Optimization
from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger("dflash_recipes.train")


@attrs.define(eq=False)
class SavePolicy:
    """``training.save_steps`` / ``save_total_limit`` and the save itself."""

    plan: RunPlan
    env: DistEnv
    models: Models
    optimization: Optimization

    def due(self, step: int, *, asked: bool) -> bool:
        """Whether to save after optimiser step `step`; `asked` forces a save."""
        total = self.optimization.total_steps
        return asked or step % self.plan.training.save_steps == 0 or step == total

    def save(self, step: int, position: tuple[int, int], nonfinite_streak: int = 0) -> None:
        """Rank 0 saves the checkpoint of `step` (`position`: the epoch and next index of the
        data; `nonfinite_streak`: the skipped steps in a row that end at `step`, recorded so
        that pruning keeps the last checkpoint of a finite step); every rank returns once it
        is written."""
        plan, env = self.plan, self.env
        state = {
            "epoch": position[0],
            "next_index": position[1],
            "seed": plan.training.seed,
            "plan_fingerprint": plan.fingerprint,
            "world_size": env.world_size,
            NONFINITE_STREAK: nonfinite_streak,
        }
        if self.models.sharded:  # every rank writes its part
            path = save_sharded_training_checkpoint(
                Path(plan.training.output_dir),
                step,
                self.models.drafter,
                self.optimization.optimizer,
                self.optimization.scheduler,
                state,
                env,
                save_total_limit=plan.training.save_total_limit,
                plan_json=plan.to_json(),
            )
            if is_main(env):
                logger.info("saved %s (sharded over %d ranks)", path, env.world_size)
            return
        if is_main(env):
            path = save_training_checkpoint(
                Path(plan.training.output_dir),
                step,
                self.models.drafter,
                self.optimization.optimizer,
                self.optimization.scheduler,
                state,
                save_total_limit=plan.training.save_total_limit,
                plan_json=plan.to_json(),
            )
            logger.info("saved %s", path)
        wait_for_rank0(
            env,
            f"save the checkpoint of step {step}",
            timeout_s=plan.training.distributed_timeout_s,
        )


__all__ = ["SavePolicy"]
