"""When the loop measures acceptance on held-out prompts, and who measures it.

Every ``training.eval_steps`` optimiser steps (the compiler resolves an unset one to every
``save_steps`` when there is eval data), and at the final step when ``training.eval_min_tau``
gates the run, unless the ranks agreed to stop at this step, rank 0 runs speculative decoding
on the first ``training.eval_num_prompts`` conversations of ``data.eval_data_path`` or of the
``data.eval_holdout`` slice of the training data (``training.eval_max_new_tokens`` each)
(:func:`~dflash_recipes.executor.evaluation.evaluate.evaluate_on_plan_data`) and sends an
``eval`` row to the trackers; every rank receives the measured tau
(:func:`~dflash_recipes.executor.coordination.rank0_measurement`), so no rank acts on a value
the others lack. Without eval data nothing is measured and the tau is None. The step decision
needs no collective: every rank holds the same step and the same agreed stop.

Under ``training.fsdp`` on several ranks the target and the drafter are sharded, and a sharded
module forwards only on every rank at once: every rank runs the same measurement in step (the
same prompts, the same seeded draws, so the same forwards), on an unsharded copy of the drafter
gathered on every rank (:func:`~dflash_recipes.executor.sharded_drafter.whole_drafter`: the
measurement calls the layers' attention outside their forwards, where FSDP does not gather);
rank 0 alone logs it. That copy is one whole drafter per rank in the master dtype, beside the
shards, AdamW's moments and the sharded gradients the step left: the resource plan's peak per
rank is the larger of the training step and this measurement
(:mod:`~dflash_recipes.plan.resources.rank_memory`). Otherwise the other
ranks wait for rank 0's measurement, past ``training.distributed_timeout_s`` with a message
saying so.
"""

from __future__ import annotations

import logging

import attrs
from transformers import PreTrainedTokenizerBase

from dflash_recipes.card.acceptance import eval_step_gate_note
from dflash_recipes.data.conversations import Conversation
from dflash_recipes.executor.coordination import rank0_measurement, wait_for_rank0
from dflash_recipes.executor.dist_env import DistEnv, is_main
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.sharded_drafter import whole_drafter
from dflash_recipes.executor.training.setup.models import Models
from dflash_recipes.executor.training.trackers.fanout import TrackerSet
from dflash_recipes.files.metrics_rows import eval_row
from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger("dflash_recipes.train")


@attrs.define(eq=False)
class EvalPolicy:
    """``training.eval_steps`` and the measurement it triggers."""

    plan: RunPlan
    env: DistEnv
    models: Models
    tokenizer: PreTrainedTokenizerBase
    trackers: TrackerSet
    #: The run's last optimiser step (measured too when training.eval_min_tau is set).
    final_step: int = 0
    #: The conversations data.eval_holdout holds out of training (rank 0; every rank under
    #: training.fsdp, where every rank measures).
    held_out: tuple[Conversation, ...] = ()

    def due(self, step: int, *, stopping: bool) -> bool:
        """Whether to evaluate after optimiser step `step` (never when the ranks stop now)."""
        training = self.plan.training
        if stopping or not self.plan.data.has_eval_data:
            return False
        every = training.eval_steps
        if every is not None and step % every == 0:
            return True
        # The gate judges the last measurement: make it the exported weights'.
        return training.eval_min_tau is not None and step == self.final_step

    @property
    def in_step(self) -> bool:
        """Whether every rank measures (sharded modules forward only on every rank at once)."""
        return self.env.is_distributed and self.plan.training.fsdp

    def measure(self, step: int) -> float | None:
        """Rank 0 measures tau after `step` and logs it (every rank measures with it under
        ``training.fsdp``); every rank returns rank 0's tau."""
        tau = None
        drafter = self.models.drafter
        if self.plan.data.has_eval_data and self.in_step:
            if self.models.sharded:
                drafter = whole_drafter(drafter, self.env.device)
            tau = self._measure(step, drafter)
            del drafter
        elif is_main(self.env) and self.plan.data.has_eval_data:
            tau = self._measure(step, drafter)
        self.models.training_modes()
        if not self.in_step:
            wait_for_rank0(
                self.env,
                f"measure the held-out acceptance after step {step}",
                timeout_s=self.plan.training.distributed_timeout_s,
            )
        return rank0_measurement(tau, self.env)

    def _measure(self, step: int, drafter: DFlashDraftModel) -> float:
        from dflash_recipes.executor.evaluation.evaluate import evaluate_on_plan_data

        was_training = drafter.training
        drafter.eval()
        training = self.plan.training
        report = evaluate_on_plan_data(
            self.plan,
            self.models.target,
            drafter,
            self.tokenizer,
            num_prompts=training.eval_num_prompts,
            max_new_tokens=training.eval_max_new_tokens,
            held_out=self.held_out,
        )
        drafter.train(was_training)
        if not is_main(self.env):  # measured in step with rank 0, which logs it
            return report.tau
        self.trackers.log_row({**report.to_dict(), **eval_row(step=step, tau=report.tau)})
        logger.info(
            "eval at step %d: held-out tau %.3f (measured on %d prompt(s) x %d new tokens)",
            step,
            report.tau,
            training.eval_num_prompts,
            training.eval_max_new_tokens,
        )
        note = eval_step_gate_note(self.plan, report.tau, step)
        if note is not None:
            logger.warning("%s", note)
        return report.tau


#: The modes of training.eval_steps, as the start line and the field's comment name them.
EVAL_STEPS_MODES = "N: every N steps; null (the default): every save_steps; 0: never"


def schedule_line(plan: RunPlan) -> str:
    """What `run` logs at start about the held-out measurement (issue 49: ``eval_steps: null``
    measures every save_steps, ``0`` never, and nothing said which a run had)."""
    data, training = plan.data, plan.training
    if not data.has_eval_data:
        return (
            "evaluation: none during training (no data.eval_data_path or data.eval_holdout); "
            f"training.eval_steps modes: {EVAL_STEPS_MODES}"
        )
    source = (
        data.eval_data_path
        if data.eval_data_path is not None
        else f"{data.eval_holdout} conversation(s) held out of data.data_path"
    )
    if training.eval_steps is None:
        when = "never during training (training.eval_steps: 0)"
        if training.eval_min_tau is not None:
            when += ", once at the last step for training.eval_min_tau"
    else:
        when = f"every {training.eval_steps} step(s) (training.eval_steps {training.eval_steps})"
    return (
        f"evaluation: held-out acceptance {when} on {source}; training.eval_steps modes: "
        f"{EVAL_STEPS_MODES}"
    )


__all__ = ["EVAL_STEPS_MODES", "EvalPolicy", "schedule_line"]
