"""The training step as a library: what `run`, ``gpu_check``, the benchmarks and a user's own
loop all call (docs/dflash.md, "Driving the step yourself").

- :func:`build_step`: from a plan (and optionally a target already in memory and a device
  environment), the models, optimizer, scheduler, precision and loss settings of one training
  step, as a :class:`TrainStep`. No tokenizer, data, trackers or files are touched; `run`'s
  setup calls it and adds those.
- :func:`prepare_rows`: token-id rows (and their loss masks, and document ids for packed
  rows) as the prepared micro-batch the step takes, through the very function the prefetch
  thread uses (:func:`~dflash_recipes.executor.training.setup.prefetch.prepare_batch`).
- :func:`optimizer_step`: one optimiser step over its micro-batches (accumulation, the
  gradient sync on the last one, unscale, clip, the non-finite guard, AdamW and the schedule),
  returning what it measured. :func:`~dflash_recipes.executor.training.fit.fit` is its logging,
  evaluation, saving and signal decisions around this call.

Nothing here reads a value back from the device: the step's figures are tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from pathlib import Path

import attrs
import torch
from torch import Tensor
from transformers import PreTrainedModel

from dflash_recipes.executor.data.train_dataset import Batch
from dflash_recipes.executor.dist_env import DistEnv, detect_dist_env
from dflash_recipes.executor.model.convert import CapturedStates
from dflash_recipes.executor.training.loss import LossOutput
from dflash_recipes.executor.training.nonfinite import NonfiniteSteps
from dflash_recipes.executor.training.setup.accumulation import GradientAccumulation
from dflash_recipes.executor.training.setup.models import Models, build_models
from dflash_recipes.executor.training.setup.optimizer import (
    Optimization,
    build_optimization,
    clip_gradients,
)
from dflash_recipes.executor.training.setup.precision import (
    apply_tf32,
    autocast_dtype,
    build_grad_scaler,
)
from dflash_recipes.executor.training.setup.prefetch import PreparedBatch, prepare_batch
from dflash_recipes.executor.training.step import step_inputs
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import RunPlan


@attrs.define(eq=False)
class TrainStep:
    """One training step's parts, as :func:`build_step` makes them."""

    plan: RunPlan
    #: The drafter the plan resolves to (block size, label shift, taps).
    spec: ResolvedDraft
    env: DistEnv
    #: The target with its drafter, and the step module (DDP- or FSDP2-wrapped on several
    #: ranks).
    models: Models
    #: AdamW, its schedule and the run's number of optimiser steps.
    optimization: Optimization
    accumulation: GradientAccumulation
    #: The skip of a step whose gradient norm is NaN or Inf, and its counters.
    nonfinite: NonfiniteSteps
    #: Loss scaling of a float16-autocast step; None: none.
    scaler: torch.amp.GradScaler | None = None

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimiser step (``training.gradient_accumulation_steps``)."""
        return self.plan.training.gradient_accumulation_steps


@attrs.frozen(eq=False)
class StepOutput:
    """What one optimiser step measured, as tensors (reading them syncs the host)."""

    #: Each micro-batch's loss output and its token count, in order.
    micro: tuple[tuple[LossOutput, Tensor], ...]
    #: The gradients' global norm before clipping (NaN or Inf: the step was skipped).
    grad_norm: Tensor

    @property
    def loss(self) -> Tensor:
        """The step's loss: the micro-batches' weighted mean (as the gradient weighs them),
        summed in float32 and divided in float64, as `run`'s train rows compute it."""
        weights = torch.stack([out.weight_sum.detach().float() for out, _ in self.micro])
        losses = torch.stack([out.loss.detach().float() for out, _ in self.micro])
        total = weights.sum().double()
        return torch.where(total > 0, (losses * weights).sum().double() / total, 0.0)


def build_step(
    plan: RunPlan,
    *,
    env: DistEnv | None = None,
    target: PreTrainedModel | None = None,
    offline: bool = False,
    warm: bool = True,
    batches_per_epoch: int = 1,
    max_chunk_logits: int | None = None,
    skip_memory_check: bool = False,
    wrap: bool = True,
) -> TrainStep:
    """The parts of one training step of `plan`.

    `env`: the process's device and ranks (default: detected for ``training.device``).
    `target`: the frozen target already in memory (the drafter is attached to it; default:
    loaded from the plan's base model). `offline`: the states come from a capture, so the
    target's decoder is not loaded unless a measured evaluation needs it. `warm`: warm-start
    the drafter from the plan's init checkpoint (False: a resume restores it afterwards).
    `batches_per_epoch` (what one rank draws per epoch) sets the number of steps when
    ``training.max_steps`` is unset. `wrap`: wrap the step module in DDP on several ranks now
    (`run` wraps after restoring a checkpoint). The rest as ``run``'s flags.
    """
    env = env if env is not None else detect_dist_env(plan.training.device)
    apply_tf32(plan, env.device)  # training.tf32, on CUDA only
    models = build_models(
        plan,
        env,
        offline=offline,
        warm=warm,
        max_chunk_logits=max_chunk_logits,
        skip_memory_check=skip_memory_check,
        loaded_target=target,
    )
    training = plan.training
    step = TrainStep(
        plan=plan,
        spec=plan.resolved_draft(),
        env=env,
        models=models,
        optimization=build_optimization(
            plan, models.trainable, batches_per_epoch=batches_per_epoch
        ),
        accumulation=GradientAccumulation(
            training.gradient_accumulation_steps, models.trainable, env
        ),
        nonfinite=NonfiniteSteps(
            training.max_nonfinite_steps, env.device, output_dir=Path(training.output_dir)
        ),
        scaler=build_grad_scaler(plan, env.device),
    )
    if wrap:
        models.wrap_for_ranks(env)
    return step


def _rows(values: Tensor | Sequence[Sequence[int]], length: int, fill: int) -> Tensor:
    if isinstance(values, Tensor):
        return values.to(torch.long)
    rows = torch.full((len(values), length), fill, dtype=torch.long)
    for row, value in enumerate(values):
        rows[row, : len(value)] = torch.tensor(list(value), dtype=torch.long)
    return rows


def prepare_rows(
    step: TrainStep,
    input_ids: Tensor | Sequence[Sequence[int]],
    loss_mask: Tensor | Sequence[Sequence[int]],
    *,
    attention_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
    pad_token_id: int = 0,
    epoch: int = 0,
    next_index: int = 0,
    states: CapturedStates | None = None,
) -> PreparedBatch:
    """One micro-batch from token-id rows, prepared as the prefetch thread prepares `run`'s.

    Rows of different lengths are right-padded with `pad_token_id` (attention 0 there);
    ``[B, T]`` tensors are taken as they are, with their `attention_mask` (default: no
    padding). A packed row passes `document_ids` (``[B, T]``: each token's document number
    in its row, -1 for the filler). `epoch` and `next_index` (the index into the epoch's
    order just after this global batch) place the rows where `run`'s data stream would, and
    with the seed fix the anchors drawn; `states`: the target's states of an offline batch
    (None: the target runs in the step).
    """
    lengths: list[int] | None = None
    if isinstance(input_ids, Tensor):
        length = int(input_ids.shape[1])
    else:
        lengths = [len(row) for row in input_ids]
        length = max(lengths, default=0)
    ids = _rows(input_ids, length, pad_token_id)
    labels = _rows(loss_mask, length, 0)
    if attention_mask is not None:
        attention = attention_mask.to(torch.long)
    elif document_ids is not None:
        attention = (document_ids >= 0).to(torch.long)
    elif lengths is not None:
        attention = _rows([[1] * n for n in lengths], length, 0)
    else:
        attention = torch.ones_like(ids)
    batch = Batch(ids, attention, labels, epoch, next_index, document_ids=document_ids)
    plan = step.plan
    return prepare_batch(
        batch,
        env=step.env,
        seed=plan.training.seed,
        spec=step.spec,
        num_anchors=plan.draft.objective.num_anchors,
        states=None if states is None else (lambda _batch: states),
    )


def micro_step(
    step: TrainStep, prepared: PreparedBatch, *, index: int
) -> tuple[LossOutput, Tensor]:
    """One micro-batch of optimiser step `index` (0-based): its inputs, forward and backward.
    Returns the loss output and the batch's token count (a tensor: no host sync)."""
    plan, device = step.plan, step.env.device
    captured = prepared.captured_on(device)  # offline: the target's stored states
    on_device, drawn = prepared.to(device)
    inputs = step_inputs(
        step.models.target,
        step.spec,
        plan.draft.objective,
        on_device,
        drawn,
        step=index,
        total_steps=step.optimization.total_steps,
        captured=captured,
        mask=prepared.mask,
    )
    dtype = autocast_dtype(device.type, plan.base_model.dtype)
    autocast = nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)
    with autocast:
        result: LossOutput = step.models.step(inputs)
    # Normalised by the global weight sum of the whole step (DDP, accumulation).
    loss = step.accumulation.loss(result)
    if step.scaler is not None:
        loss = step.scaler.scale(loss)
    loss.backward()  # type: ignore[no-untyped-call]
    step.accumulation.after_backward(result)
    return result, on_device.attention_mask.sum()


def optimizer_step(
    step: TrainStep, micro_batches: Iterable[PreparedBatch], *, index: int
) -> StepOutput:
    """Optimiser step `index` (0-based) over `micro_batches` (exactly
    :attr:`TrainStep.micro_batches` of them, taken one at a time as each micro-step starts):
    gradients accumulated and synchronised over the ranks on the last one, unscaled (float16),
    clipped to ``training.max_grad_norm``, the step skipped without a host sync when their norm
    is NaN or Inf, then AdamW and the learning-rate schedule (which advances on a skipped step
    too, as under GradScaler)."""
    models, optimization = step.models, step.optimization
    optimization.optimizer.zero_grad(set_to_none=True)
    expected = step.micro_batches
    done: list[tuple[LossOutput, Tensor]] = []
    for prepared in micro_batches:
        if len(done) == expected:
            msg = f"optimizer_step takes {expected} micro-batch(es) per step, got more"
            raise ValueError(msg)
        with models.gradient_sync(last_micro_batch=len(done) == expected - 1):
            done.append(micro_step(step, prepared, index=index))
    if len(done) != expected:
        msg = f"optimizer_step takes {expected} micro-batch(es) per step, got {len(done)}"
        raise ValueError(msg)
    if step.scaler is not None:  # clip the true gradients
        step.scaler.unscale_(optimization.optimizer)
    grad_norm = clip_gradients(models.trainable, step.plan.training.max_grad_norm)
    # a NaN/Inf norm: fused AdamW's found_inf leaves weights and moments, no host sync
    step.nonfinite.step(optimization.optimizer, grad_norm, step=index, scaler=step.scaler)
    optimization.scheduler.step()
    return StepOutput(tuple(done), grad_norm)


__all__ = [
    "StepOutput",
    "TrainStep",
    "build_step",
    "micro_step",
    "optimizer_step",
    "prepare_rows",
]
