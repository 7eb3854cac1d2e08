"""Online DFlash training: exactly what the run plan says, nothing re-decided.

One optimiser step = ``gradient_accumulation_steps`` micro-batches. Each micro-batch:

1. the frozen target runs on the batch with hidden states on; the plan's taps are fused;
2. anchors are sampled per sequence (docs/dflash.md, "The training objective"), all blocks
   are packed into one draft forward under the block mask (chunked SDPA on CPU, block-sparse
   flex attention on CUDA);
3. the drafter's states go through the target's ``lm_head``; the loss is the plan's objective
   (decay or D-PACE weights, optional self-distillation, Domino/DSpark head objectives),
   per chunk of blocks when the logits are large (:class:`DraftStep`).

Randomness is counter-based: the anchors of a sequence are a pure function of ``(seed, epoch,
position of the sequence in the epoch's order)`` (splitmix64 counters, the whole batch in one
vectorised pass), the data order of ``(seed, epoch)``. There is no hidden RNG stream, so a
resumed run draws exactly what an uninterrupted run would have drawn, and a data-parallel run
draws the same anchors per sequence as a single-process run over the same global batch.

Under DDP the loss of each rank is normalised by the *global* weight sum of the micro-batch,
so the averaged gradient equals the single-process gradient over the whole global batch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import attrs
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dflash_recipes.crashsafe import write_text_atomic
from dflash_recipes.errors import CheckpointError, DataError, PlanError, RunIOError
from dflash_recipes.executor.anchors import (
    block_inputs,
    block_labels,
    gather_teacher_logits,
    sample_counter_anchors,
)
from dflash_recipes.executor.convert import (
    ConvertedModel,
    convert,
    dflash_module,
    embed_tokens,
    lm_head,
    load_base_model,
    target_forward,
)
from dflash_recipes.executor.data import (
    Batch,
    TrainDataset,
    batches,
    batches_per_epoch,
    epoch_order,
)
from dflash_recipes.executor.distributed import (
    DistEnv,
    barrier,
    detect_dist_env,
    init_distributed,
    is_main,
    shard_target_fsdp2,
    shutdown_distributed,
    wrap_ddp,
)
from dflash_recipes.executor.draft import (
    DFlashDraftModel,
    build_flex_block_mask,
    build_split_block_mask,
    taps_from_hidden_states,
)
from dflash_recipes.executor.export import export_drafter
from dflash_recipes.executor.loss import (
    LossOutput,
    combine_losses,
    dflash_loss,
    domino_backbone_weight,
    domino_loss,
    dspark_loss,
    estimated_acceptance_length,
    objective_weights,
    per_position_accuracy,
)
from dflash_recipes.executor.offline import (
    CapturedStates,
    CaptureReader,
    capture_dataset,
    load_target_without_decoder,
    open_capture,
    teacher_logits,
)
from dflash_recipes.executor.run_guard import (
    drop_metrics_after,
    last_train_row,
    locked_run_directory,
    restore_newest_readable,
)
from dflash_recipes.executor.training_checkpoints import save_training_checkpoint
from dflash_recipes.executor.warmstart import WarmStartReport
from dflash_recipes.export_target import check_export_target
from dflash_recipes.jsonio import FileReadProblem, JsonProblem, parse_json, read_regular_file
from dflash_recipes.plan import ObjectivePlan, ResolvedDraft, RunPlan
from dflash_recipes.report import eval_row, metrics_json_line, train_row
from dflash_recipes.run_dir import (
    EXPORT_DIR,
    METRICS_FILE,
    PLAN_FILE,
    TRAINER_STATE,
    latest_complete_checkpoint,
)

logger = logging.getLogger("dflash_recipes.train")


# ---------------------------------------------------------------------------------------------
# schedule
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# the trainable step module (what DDP wraps)
# ---------------------------------------------------------------------------------------------


#: Most logits one chunk of blocks may hold (elements of ``[B, n, K, vocab]``, 2**26 = 256 MiB
#: in float32). A batch whose logits exceed it computes lm_head, head and loss per chunk of
#: blocks under activation checkpointing (see :class:`DraftStep`).
MAX_CHUNK_LOGITS = 2**26


@attrs.frozen(eq=False)
class LossTargets:
    """What the objective compares the drafter's blocks with (all per block, ``[B, N, ...]``)."""

    #: ``[B, N, K]`` labels and supervision mask (:func:`block_labels`).
    labels: Tensor
    label_mask: Tensor
    #: ``[B, N]`` anchors, to gather the target's logits per chunk of blocks.
    anchors: Tensor
    #: ``[B, S, V]`` the target's logits when the objective needs a teacher, else None.
    target_logits: Tensor | None
    #: Optimiser step and total, for Domino's decaying backbone weight.
    step: int
    total_steps: int


class DraftStep(nn.Module):
    """Fuse taps, run the drafter over packed blocks, then lm_head, head and loss.

    Returns the objective's :class:`LossOutput`. The target's ``lm_head`` is held outside the
    module tree (frozen, shared, never part of the drafter's parameters), so wrapping this
    module in DDP reduces only drafter gradients.

    Memory: the drafter runs once over all blocks (one packed forward). Its logits
    ``[B, N, K, vocab]`` are the largest tensors of a step (5 GB in float32 for 512 blocks of
    16 at a 152k vocabulary, and the loss keeps copies for backward), so when they exceed
    `max_chunk_logits` elements (default :data:`MAX_CHUNK_LOGITS`), lm_head, head and loss run
    per chunk of blocks under non-reentrant activation checkpointing: a chunk's logits are freed
    after its loss and recomputed during backward, and :func:`combine_losses` makes the
    batch's loss exactly the unchunked one. The price is a second lm_head/loss forward.
    """

    def __init__(
        self,
        drafter: DFlashDraftModel,
        output_head: nn.Module,
        objective: ObjectivePlan,
        *,
        max_chunk_logits: int | None = None,
    ) -> None:
        super().__init__()
        self.drafter = drafter
        self.objective = objective
        self.max_chunk_logits = max_chunk_logits
        object.__setattr__(self, "_lm_head", output_head)

    def blocks_per_chunk(self, batch: int, n_blocks: int) -> int:
        """How many blocks (per row) one chunk of lm_head + loss holds (all of them if they fit)."""
        spec = self.drafter.spec
        budget = self.max_chunk_logits or MAX_CHUNK_LOGITS
        per_block = max(1, batch * spec.block_size * spec.vocab_size)
        return max(1, min(n_blocks, budget // per_block))

    def forward(
        self,
        tapped: Tensor,
        block_embeds: Tensor,
        q_positions: Tensor,
        ctx_positions: Tensor,
        mask: object,
        prefix_embeds: Tensor | None,
        prefix_tokens: Tensor | None,
        targets: LossTargets,
    ) -> LossOutput:
        drafter = self.drafter
        context = drafter.fuse_context(tapped)
        hidden = drafter(block_embeds, context, q_positions, ctx_positions, mask)
        batch, q_len, width = hidden.shape
        block = drafter.spec.block_size
        n_blocks = q_len // block
        hidden = hidden.view(batch, n_blocks, block, width)
        if prefix_embeds is not None:
            prefix_embeds = prefix_embeds.view(batch, n_blocks, block, -1)
        per_chunk = self.blocks_per_chunk(batch, n_blocks)
        if per_chunk >= n_blocks:
            return self._objective(hidden, prefix_embeds, prefix_tokens, targets, 0)
        # split, not slicing, for the states that carry gradients: its backward is one
        # concatenation, not a zero-filled full-size gradient per chunk. The other inputs carry
        # none and are sliced.
        parts = []
        for index, hidden_c in enumerate(torch.split(hidden, per_chunk, dim=1)):
            chunk = slice(index * per_chunk, (index + 1) * per_chunk)
            part = checkpoint(
                self._objective,
                hidden_c,
                None if prefix_embeds is None else prefix_embeds[:, chunk],
                None if prefix_tokens is None else prefix_tokens[:, chunk],
                targets,
                chunk.start,
                use_reentrant=False,
            )
            assert isinstance(part, LossOutput)
            parts.append(part)
        return combine_losses(parts)

    def _objective(
        self,
        hidden: Tensor,
        prefix_embeds: Tensor | None,
        prefix_tokens: Tensor | None,
        targets: LossTargets,
        first: int,
    ) -> LossOutput:
        """lm_head, head and loss of blocks ``first .. first + n - 1``: ``hidden [B, n, K, H]``."""
        batch, n, block, width = hidden.shape
        objective = self.objective
        head: nn.Module = self._lm_head  # type: ignore[assignment]
        labels = targets.labels[:, first : first + n]
        label_mask = targets.label_mask[:, first : first + n]
        teacher: Tensor | None = None
        if targets.target_logits is not None:
            anchors = targets.anchors[:, first : first + n]
            teacher = gather_teacher_logits(
                targets.target_logits, anchors, block_size=block
            ).float()
        distill_teacher = teacher if objective.self_logit_distillation else None
        logits: Tensor = head(hidden.to(_weight_dtype(head))).float()
        kind = self.drafter.spec.projector_type
        if kind == "dflash":
            return dflash_loss(
                logits, labels, label_mask, objective=objective, teacher_logits=distill_teacher
            )
        flat_hidden = hidden.reshape(batch * n, block, width)
        flat_logits = logits.reshape(batch * n, block, -1)
        if kind == "domino":
            assert prefix_embeds is not None
            corrected = self.drafter.domino_head(
                flat_hidden, prefix_embeds.reshape(batch * n, block, -1), flat_logits
            ).view_as(logits)
            return domino_loss(
                corrected,
                logits,
                labels,
                label_mask,
                weights=objective_weights(
                    corrected.detach(), labels, label_mask, objective=objective
                ),
                backbone_weight=domino_backbone_weight(
                    targets.step, targets.total_steps, objective.domino_backbone_loss_weight
                ),
                teacher_logits=distill_teacher,
            )
        assert prefix_tokens is not None
        out, confidence = self.drafter.dspark_head(
            flat_hidden, prefix_tokens.reshape(batch * n, block), flat_logits
        )
        out = out.view_as(logits)
        return dspark_loss(
            out,
            labels,
            label_mask,
            weights=objective_weights(out.detach(), labels, label_mask, objective=objective),
            teacher_logits=teacher,
            confidence_logit=None if confidence is None else confidence.view(batch, n, block),
            tv_weight=objective.dspark_tv_weight,
            confidence_weight=objective.dspark_confidence_weight,
        )


@attrs.frozen(eq=False)
class StepInputs:
    """The arguments of one :class:`DraftStep` call (see :func:`step_inputs`)."""

    tapped: Tensor
    block_embeds: Tensor
    q_positions: Tensor
    ctx_positions: Tensor
    mask: object
    prefix_embeds: Tensor | None
    #: The tokens before each block position (Domino and DSpark heads only, else None).
    prefix_tokens: Tensor | None
    targets: LossTargets

    def args(self) -> tuple[object, ...]:
        """Positional arguments of ``DraftStep.forward``, in order."""
        return (
            self.tapped,
            self.block_embeds,
            self.q_positions,
            self.ctx_positions,
            self.mask,
            self.prefix_embeds,
            self.prefix_tokens,
            self.targets,
        )


def step_inputs(
    target: ConvertedModel,
    embeddings: nn.Module,
    spec: ResolvedDraft,
    objective: ObjectivePlan,
    ids: Tensor,
    attention: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    valid: Tensor,
    *,
    step: int,
    total_steps: int,
    captured: CapturedStates | None = None,
) -> StepInputs:
    """Everything a micro-step feeds the drafter, from a batch and its anchors (on one device).

    Runs the frozen target (its logits only when the objective needs a teacher) and builds
    the packed blocks, their positions, the block mask (flex on CUDA, the split form on CPU)
    and the labels. Fusing the taps is left to the step, which trains ``fc``. With `captured`
    (offline training) the taps come from the capture and the target's decoder does not run;
    teacher logits are recomputed from the captured last hidden state.
    """
    device = ids.device
    needs_teacher = objective.self_logit_distillation or (
        spec.projector_type == "dspark" and objective.dspark_tv_weight > 0
    )
    with torch.no_grad():
        if captured is None:
            out = target_forward(target, ids, attention, with_logits=needs_teacher)
            tapped = taps_from_hidden_states(out.hidden_states, spec.target_layer_ids).float()
            # Gathered per chunk of blocks inside the step, never as a whole [B, N, K, V].
            target_logits = out.logits
            del out
        else:
            tapped, target_logits = captured.tapped, None
            if needs_teacher:
                if captured.last_hidden is None:
                    msg = "the objective needs teacher logits; the capture has no last hidden state"
                    raise DataError(msg)
                target_logits = teacher_logits(target, lm_head(target), captured.last_hidden)
        block_ids, q_positions = block_inputs(
            ids, anchors, valid, block_size=spec.block_size, mask_token_id=spec.mask_token_id
        )
        block_embeds = embeddings(block_ids).float()
        prefix_tokens = (
            _prefix_tokens(ids, anchors, spec.block_size)
            if spec.projector_type in ("domino", "dspark")
            else None
        )
        prefix_embeds = (
            embeddings(prefix_tokens.flatten(1)).float()
            if prefix_tokens is not None and spec.projector_type == "domino"
            else None
        )
    ctx_len = int(ids.shape[1])
    ctx_positions = torch.arange(ctx_len, device=device).expand(ids.shape[0], ctx_len)
    mask: object
    if device.type == "cuda":
        mask = build_flex_block_mask(anchors, spec.block_size, ctx_len, valid)
    else:
        # CPU: the split form of the dense mask (no blocks x blocks part).
        mask = build_split_block_mask(
            anchors, spec.block_size, ctx_len, valid, heads=spec.num_attention_heads
        )
    labels, label_mask = block_labels(ids, loss_mask, anchors, valid, block_size=spec.block_size)
    return StepInputs(
        tapped=tapped,
        block_embeds=block_embeds,
        q_positions=q_positions,
        ctx_positions=ctx_positions,
        mask=mask,
        prefix_embeds=prefix_embeds,
        prefix_tokens=prefix_tokens,
        targets=LossTargets(
            labels=labels,
            label_mask=label_mask,
            anchors=anchors,
            target_logits=target_logits,
            step=step,
            total_steps=total_steps,
        ),
    )


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


def _weight_dtype(module: nn.Module) -> torch.dtype:
    for parameter in module.parameters():
        return parameter.dtype
    return torch.float32


# ---------------------------------------------------------------------------------------------
# per-sequence anchors (counter-based RNG)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def anchor_key(seed: int, epoch: int) -> int:
    """The counter-based key of one epoch's anchors: a pure function of (seed, epoch)."""
    digest = hashlib.sha256(f"dflash-anchors:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def sample_batch_anchors(
    batch: Batch,
    *,
    positions: list[int],
    seed: int,
    block_size: int,
    num_anchors: int,
) -> tuple[Tensor, Tensor]:
    """Anchors ``[B, N]`` (N >= 1) and validity; row ``r`` is drawn from the counter
    ``positions[r]`` under :func:`anchor_key` ``(seed, epoch)``, all rows in one pass."""
    drawn = sample_counter_anchors(
        batch.loss_mask,
        batch.attention_mask,
        block_size=block_size,
        num_anchors=num_anchors,
        key=anchor_key(seed, batch.epoch),
        rows=torch.tensor(positions, dtype=torch.int64),
    )
    if drawn.anchors.shape[1] == 0:
        # No row has an eligible position: one padding block, so every shape stays non-empty.
        rows = drawn.anchors.shape[0]
        return torch.zeros(rows, 1, dtype=torch.long), torch.zeros(rows, 1, dtype=torch.bool)
    return drawn.anchors, drawn.valid


def batch_positions(batch: Batch, env: DistEnv) -> list[int]:
    """Positions in the epoch's order of this rank's rows of the batch."""
    local = int(batch.input_ids.shape[0])
    global_rows = local * env.world_size
    start = batch.next_index - global_rows + env.rank * local
    return [start + row for row in range(local)]


# ---------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class TrainSummary:
    """What a finished run reports (also written as the last line of metrics.jsonl).

    ``steps`` is the optimiser step the run reached (fewer than ``planned_steps`` when it
    stopped early); ``steps_this_run`` is 0 when a finished run was resumed.
    """

    steps: int
    resumed_from_step: int | None
    final_loss: float
    accuracy_by_position: tuple[float, ...]
    acceptance_length_estimate: float
    tokens_per_second: float
    export_dir: str | None
    warm_start: str | None
    data_summary: str
    last_eval_tau: float | None = None
    planned_steps: int = 0
    steps_this_run: int = 0


class _MetricWindow:
    """Accumulates loss and per-position counts between logging steps.

    Everything stays a tensor on the step's device until :meth:`settle` (called only at a
    logging step), so a step that logs nothing makes no host sync and no host copy.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.reset()

    def reset(self) -> None:
        self.micro = 0
        self._loss: Tensor | None = None
        self._correct: Tensor | None = None
        self._count: Tensor | None = None
        self._tokens: Tensor | None = None
        self._grad_norm: Tensor | None = None
        self.loss_sum = 0.0
        self.correct = torch.zeros(self.block_size, dtype=torch.long)
        self.count = torch.zeros(self.block_size, dtype=torch.long)
        self.tokens = 0
        self.grad_norm: float | None = None
        self.started = time.perf_counter()

    def add_grad_norm(self, norm: Tensor) -> None:
        self._grad_norm = norm.detach()

    def add(self, out: LossOutput, tokens: Tensor) -> None:
        self.micro += 1
        self._loss = _accumulate(self._loss, out.loss.detach())
        self._correct = _accumulate(self._correct, out.per_position_correct.detach())
        self._count = _accumulate(self._count, out.per_position_count.detach())
        self._tokens = _accumulate(self._tokens, tokens)

    def settle(self) -> None:
        """Bring the accumulated tensors to Python numbers (the one host sync of a window)."""
        if self._loss is not None:
            self.loss_sum = float(self._loss)
        if self._correct is not None and self._count is not None:
            self.correct = self._correct.cpu().long()
            self.count = self._count.cpu().long()
        if self._tokens is not None:
            self.tokens = int(self._tokens)
        if self._grad_norm is not None:
            self.grad_norm = float(self._grad_norm)


def _accumulate(total: Tensor | None, value: Tensor) -> Tensor:
    return value.clone() if total is None else total.add_(value)


class Trainer:
    """Runs one plan: build, (warm start | resume), train, checkpoint, export."""

    def __init__(
        self, plan: RunPlan, *, progress: bool = True, stop_after: int | None = None
    ) -> None:
        self.plan = plan
        #: Stop after this optimiser step (its checkpoint saved), as if the job were killed
        #: there; the schedule still spans the whole run. For tests and preemption drills.
        self.stop_after = stop_after
        self.spec: ResolvedDraft = plan.resolved_draft()
        self.progress = progress
        self.env = detect_dist_env(plan.training.device)
        self.output_dir = Path(plan.training.output_dir)
        #: The capture offline training reads (data.hidden_states_path), else None.
        self.capture: CaptureReader | None = None
        self._order: list[int] = []
        self._order_key: tuple[int, int] | None = None

    # -- setup ------------------------------------------------------------------------------

    def _check_resume_state(self) -> Path | None:
        """The checkpoint to resume from, as the plan says; refuse to clobber unknown ones."""
        latest = latest_complete_checkpoint(self.output_dir)
        resume = self.plan.resume
        if resume is None:
            if latest is not None and _saved_by(latest[1]) == self.plan.fingerprint:
                # Checkpoints this very plan wrote (a requeued job reusing its plan.json):
                # continuing them is what the plan asked for, not a new decision.
                logger.info("continuing this plan's own checkpoint %s", latest[1].name)
                return latest[1]
            if latest is not None:
                msg = (
                    f"{self.output_dir} already holds training checkpoint {latest[1].name}, "
                    "but this plan was compiled as a fresh run; recompile the recipe "
                    "(`dflash-recipe compile` or `dflash-recipe run RECIPE`) so the plan "
                    "resumes from it, or choose another training.output_dir"
                )
                raise PlanError(msg)
            return None
        path = Path(resume.checkpoint_dir)
        if latest is not None and latest[0] > resume.step:
            logger.warning(
                "plan resumes from step %d but %s is newer; resuming from the newer one",
                resume.step,
                latest[1].name,
            )
            return latest[1]
        if not path.is_dir():
            msg = (
                f"the plan resumes from {path}, which no longer exists; recompile the recipe "
                "to resume from what output_dir holds now"
            )
            raise CheckpointError(msg)
        return path

    def _load_tokenizer(self) -> PreTrainedTokenizerBase:
        from transformers import AutoTokenizer

        base = self.plan.base_model
        known = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any((Path(base.path) / name).is_file() for name in known):
            # transformers would build an empty tokenizer from config.json alone.
            msg = (
                f"the base model directory {base.path} has no tokenizer files (none of "
                f"{', '.join(known)}); the directory needs them next to config.json: stage "
                f"the whole model with `hf download <repo> --local-dir {base.path}`"
            )
            raise CheckpointError(msg)
        try:
            tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
                base.path, local_files_only=True, trust_remote_code=base.trust_remote_code
            )
        except (OSError, ValueError) as exc:
            msg = (
                f"cannot load the tokenizer of the base model from {base.path}: {exc}; the "
                "directory needs the tokenizer files (tokenizer.json / tokenizer_config.json) "
                "next to config.json: stage the whole model with `hf download <repo> "
                f"--local-dir {base.path}`"
            )
            raise CheckpointError(msg) from exc
        return tokenizer

    def _build_dataset(self, tokenizer: PreTrainedTokenizerBase) -> TrainDataset:
        from dflash_recipes.executor.data import build_dataset

        if self.plan.data.hidden_states_path is not None:
            self.capture, manifest = open_capture(self.plan)
            return capture_dataset(self.capture, manifest, tokenizer)
        if self.plan.data.data_path is None:
            msg = "the plan has no data.data_path; set it in the recipe and recompile"
            raise DataError(msg)
        return build_dataset(self.plan, tokenizer)

    # -- main entry -------------------------------------------------------------------------

    def run(self) -> TrainSummary:
        """Train under the run directory's lock (rank 0); OSError becomes one RunIOError."""
        env = self.env
        try:
            with locked_run_directory(self.output_dir, main=is_main(env)):
                init_distributed(env)
                try:
                    return self._run()
                finally:
                    shutdown_distributed()
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else f" in {self.output_dir}"
            msg = (
                f"run stopped: cannot read or write{where}: {exc.strerror or exc}; the "
                "checkpoints already saved are intact: fix the cause (free space, "
                "permissions) and rerun to resume"
            )
            raise RunIOError(msg) from exc

    def _run(self) -> TrainSummary:
        plan, env, spec = self.plan, self.env, self.spec
        training = plan.training
        resume_from = self._check_resume_state()
        if is_main(env):  # refuse now, not after hours of training
            check_export_target(self.output_dir / EXPORT_DIR)
        tokenizer = self._load_tokenizer()
        # Data problems stop the run here, before anything is written to output_dir.
        dataset = self._build_dataset(tokenizer)
        if is_main(env):
            logger.info("data: %s", dataset.summary)

        # Offline, the decoder runs only for measured evaluation (speculative decoding needs it).
        needs_decoder = self.capture is None or (
            training.eval_steps is not None and plan.data.eval_data_path is not None
        )
        base = load_base_model(plan) if needs_decoder else load_target_without_decoder(plan)
        model = convert(base, plan, init=resume_from is None)
        drafter = dflash_module(model)
        warm: WarmStartReport | None = getattr(drafter, "warm_start_report", None)
        if training.fsdp and env.is_distributed:
            # Shard before moving: each decoder layer reaches the device already sharded.
            shard_target_fsdp2(model, env)
        else:
            nn.Module.to(model, env.device)
        # Master weights of the drafter stay float32; the frozen target keeps the plan dtype.
        drafter.float()
        step_module = DraftStep(drafter, lm_head(model), plan.draft.objective)
        trainable = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = build_optimizer(
            trainable, lr=training.learning_rate, weight_decay=training.weight_decay
        )
        total_steps = total_optimizer_steps(plan, len(dataset), env.world_size)

        def schedule(step: int) -> float:
            return lr_factor(
                step,
                total_steps=total_steps,
                warmup_ratio=training.warmup_ratio,
                kind=training.lr_scheduler_type,
            )

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        start_step, epoch, next_index = 0, 0, 0
        metrics_path = self.output_dir / METRICS_FILE
        if resume_from is not None:
            resume_from, state = restore_newest_readable(
                resume_from, self.output_dir, drafter, optimizer, scheduler
            )
            start_step = _int(state, "step")
            epoch = _int(state, "epoch")
            next_index = _int(state, "next_index")
            if is_main(env):
                logger.info(
                    "resumed from %s (step %d); dflash_init_checkpoint is ignored",
                    resume_from,
                    start_step,
                )
                # The steps after the checkpoint are redone: their old rows go.
                drop_metrics_after(metrics_path, start_step)
        wrapped = wrap_ddp(step_module, env)

        if is_main(env):
            self.output_dir.mkdir(parents=True, exist_ok=True)
            # Atomic: other ranks (or a resume compile) may read plan.json at any moment.
            write_text_atomic(self.output_dir / PLAN_FILE, plan.to_json())
        barrier(env)

        data = self._data_stream(dataset, epoch, next_index)
        window = _MetricWindow(spec.block_size)
        last_row: dict[str, object] = {}
        bar = self._progress_bar(total_steps, start_step)
        position = (epoch, next_index)
        done = start_step
        target = model
        embeddings = embed_tokens(model)
        total_tokens_time = (0, 0.0)
        last_eval_tau: float | None = None
        _training_modes(model, drafter)
        for step in range(start_step, total_steps):
            optimizer.zero_grad(set_to_none=True)
            for micro in range(training.gradient_accumulation_steps):
                batch = next(data)
                position = (batch.epoch, batch.next_index)
                sync = micro == training.gradient_accumulation_steps - 1
                context: AbstractContextManager[object] = (
                    nullcontext() if sync or not env.is_distributed else wrapped.no_sync()  # type: ignore[operator]
                )
                with context:
                    out, micro_tokens = self._micro_step(
                        wrapped, target, embeddings, batch, step=step, total_steps=total_steps
                    )
                window.add(out, micro_tokens)
            norm = clip_gradients(trainable, training.max_grad_norm)
            window.add_grad_norm(norm)
            optimizer.step()
            scheduler.step()
            done = step + 1
            if bar is not None:
                bar.update(1)
            if done % training.logging_steps == 0 or done == total_steps:
                window.settle()
                last_row = self._log_metrics(
                    window, done, float(scheduler.get_last_lr()[0]), metrics_path
                )
                elapsed = time.perf_counter() - window.started
                total_tokens_time = (
                    total_tokens_time[0] + window.tokens,
                    total_tokens_time[1] + elapsed,
                )
                if bar is not None:
                    bar.set_postfix(
                        loss=f"{last_row['loss']:.3f}",
                        tau=f"{last_row['acceptance_length_estimate']:.2f}",
                    )
                window.reset()
            if training.eval_steps is not None and done % training.eval_steps == 0:
                last_eval_tau = self._maybe_eval(model, tokenizer, done, metrics_path)
                _training_modes(model, drafter)
            stopping = self.stop_after is not None and done >= self.stop_after
            if done % training.save_steps == 0 or done == total_steps or stopping:
                self._save(drafter, optimizer, scheduler, done, position)
            if stopping:
                break
        if bar is not None:
            bar.close()

        export_dir: Path | None = None
        if done < total_steps:
            logger.info("stopped after step %d of %d as asked (no export)", done, total_steps)
        elif is_main(env):
            export_dir = export_drafter(drafter, plan, self.output_dir / EXPORT_DIR)
            logger.info("exported the drafter to %s", export_dir)
        barrier(env)
        tokens, seconds = total_tokens_time
        if not last_row:  # nothing logged in this run (a finished run resumed): the last row
            last_row = last_train_row(metrics_path, done) or {}
        acc = _accuracies(last_row.get("accuracy_by_position"))
        summary = TrainSummary(
            steps=done,
            resumed_from_step=start_step if resume_from is not None else None,
            final_loss=float(last_row.get("loss", float("nan"))),  # type: ignore[arg-type]
            accuracy_by_position=tuple(acc),
            acceptance_length_estimate=float(last_row.get("acceptance_length_estimate", 1.0)),  # type: ignore[arg-type]
            tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
            export_dir=str(export_dir) if export_dir is not None else None,
            warm_start=warm.describe() if warm is not None else None,
            data_summary=dataset.summary,
            last_eval_tau=last_eval_tau,
            planned_steps=total_steps,
            steps_this_run=done - start_step,
        )
        if is_main(env):
            _append_jsonl(metrics_path, {"kind": "summary", **attrs.asdict(summary)})
        return summary

    # -- pieces ------------------------------------------------------------------------------

    def _data_stream(self, dataset: TrainDataset, epoch: int, start: int) -> Iterator[Batch]:
        training, env = self.plan.training, self.env
        while True:
            produced = False
            for batch in batches(
                dataset,
                batch_size=training.per_device_train_batch_size,
                seed=training.seed,
                epoch=epoch,
                start_index=start,
                rank=env.rank,
                world_size=env.world_size,
            ):
                produced = True
                yield batch
            if not produced and start == 0:
                msg = (
                    f"the data has {len(dataset)} usable conversations, fewer than one global "
                    f"batch ({training.per_device_train_batch_size} x {env.world_size} "
                    "processes); add data or lower per_device_train_batch_size"
                )
                raise DataError(msg)
            epoch, start = epoch + 1, 0

    def _micro_step(
        self,
        wrapped: nn.Module,
        target: ConvertedModel,
        embeddings: nn.Module,
        batch: Batch,
        *,
        step: int,
        total_steps: int,
    ) -> tuple[LossOutput, Tensor]:
        plan, spec, env = self.plan, self.spec, self.env
        objective = plan.draft.objective
        device = env.device
        ids = batch.input_ids.to(device)
        attention = batch.attention_mask.to(device)
        loss_mask = batch.loss_mask.to(device)
        anchors_cpu, valid_cpu = sample_batch_anchors(
            batch,
            positions=batch_positions(batch, env),
            seed=plan.training.seed,
            block_size=spec.block_size,
            num_anchors=objective.num_anchors,
        )
        anchors, valid = anchors_cpu.to(device), valid_cpu.to(device)
        captured = None
        if self.capture is not None:
            captured = self.capture.states(self._sample_indices(batch), int(ids.shape[1]), device)
        inputs = step_inputs(
            target,
            embeddings,
            spec,
            objective,
            ids,
            attention,
            loss_mask,
            anchors,
            valid,
            step=step,
            total_steps=total_steps,
            captured=captured,
        )
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda" and plan.base_model.dtype == "bfloat16"
            else nullcontext()
        )
        with autocast:
            result: LossOutput = wrapped(*inputs.args())
        # Normalise by the global weight sum so DDP's gradient average equals the
        # single-process gradient over the whole global batch; then average over micro-batches.
        loss = result.loss
        if env.is_distributed:
            local = result.weight_sum
            total = all_reduce_sum(local.clone(), env)
            # No host sync: where() instead of a Python test of the total.
            positive = total > 0
            safe_total = torch.where(positive, total, torch.ones_like(total))
            scale = torch.where(positive, local * env.world_size / safe_total, 1.0)
            loss = loss * scale
        # (One process: the scale is local / local = 1 exactly, so it is left out.)
        loss = loss / plan.training.gradient_accumulation_steps
        loss.backward()  # type: ignore[no-untyped-call]
        return result, attention.sum()

    def _sample_indices(self, batch: Batch) -> list[int]:
        """Dataset indices of this rank's rows of `batch` (offline: which captured samples)."""
        assert self.capture is not None
        key = (batch.epoch, self.capture.manifest.num_samples)
        if self._order_key != key:
            self._order = epoch_order(key[1], seed=self.plan.training.seed, epoch=batch.epoch)
            self._order_key = key
        return [self._order[p] for p in batch_positions(batch, self.env)]

    def _log_metrics(
        self, window: _MetricWindow, step: int, lr: float, path: Path
    ) -> dict[str, object]:
        env = self.env
        correct = all_reduce_sum(window.correct.to(env.device).float(), env).cpu()
        count = all_reduce_sum(window.count.to(env.device).float(), env).cpu()
        tokens = float(all_reduce_sum(torch.tensor(float(window.tokens), device=env.device), env))
        loss_mean = (
            float(
                all_reduce_sum(
                    torch.tensor(window.loss_sum / max(1, window.micro), device=env.device), env
                )
            )
            / env.world_size
        )
        acc = per_position_accuracy(correct.long(), count.long())
        elapsed = max(1e-9, time.perf_counter() - window.started)
        row: dict[str, object] = {
            "kind": "train",
            "step": step,
            "loss": loss_mean,
            "lr": lr,
            "accuracy_by_position": acc,
            "acceptance_length_estimate": estimated_acceptance_length(acc),
            "tokens_per_second": tokens / elapsed,
        }
        if is_main(env):
            line = metrics_json_line(
                train_row(
                    step=step,
                    loss=loss_mean,
                    lr=lr,
                    # Position 0 (the anchor) carries no loss: null, not a 0.0 accuracy.
                    accuracy_by_position=[None, *acc[1:]],
                    acceptance_length_estimate=estimated_acceptance_length(acc),
                    tokens_per_second=tokens / elapsed,
                    grad_norm=window.grad_norm,
                )
            )
            with path.open("a", encoding="utf-8") as handle:
                handle.write(line)
            accs = " ".join(f"{a:.2f}" for a in acc[1:])
            logger.info(
                "step %d loss %.4f lr %.3g acc[1..] %s tau~%.2f tok/s %.0f",
                step,
                row["loss"],
                lr,
                accs,
                row["acceptance_length_estimate"],
                row["tokens_per_second"],
            )
        return row

    def _maybe_eval(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        step: int,
        metrics_path: Path,
    ) -> float | None:
        if not is_main(self.env) or self.plan.data.eval_data_path is None:
            return None
        from dflash_recipes.executor.evaluate import evaluate_on_plan_data

        drafter = dflash_module(model)
        was_training = drafter.training
        drafter.eval()
        report = evaluate_on_plan_data(self.plan, model, drafter, tokenizer)
        drafter.train(was_training)
        row = {**report.to_dict(), **eval_row(step=step, tau=report.tau)}
        _append_jsonl(metrics_path, row)
        logger.info("eval at step %d: tau %.3f (measured)", step, report.tau)
        return report.tau

    def _save(
        self,
        drafter: DFlashDraftModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        step: int,
        position: tuple[int, int],
    ) -> None:
        env = self.env
        if is_main(env):
            state = {
                "epoch": position[0],
                "next_index": position[1],
                "seed": self.plan.training.seed,
                "plan_fingerprint": self.plan.fingerprint,
                "world_size": env.world_size,
            }
            path = save_training_checkpoint(
                self.output_dir,
                step,
                drafter,
                optimizer,
                scheduler,
                state,
                save_total_limit=self.plan.training.save_total_limit,
            )
            logger.info("saved %s", path)
        barrier(env)

    def _progress_bar(self, total: int, start: int) -> _Bar | None:
        if not self.progress or not is_main(self.env):
            return None
        from tqdm.auto import tqdm

        # disable=None: no bar when stderr is not a terminal (CI logs, files).
        bar: _Bar = tqdm(
            total=total, initial=start, desc="train", unit="step", leave=False, disable=None
        )
        return bar


class _Bar:
    """The part of tqdm the trainer uses (for typing)."""

    def update(self, n: int) -> None: ...
    def set_postfix(self, **kwargs: str) -> None: ...
    def close(self) -> None: ...


def _training_modes(model: nn.Module, drafter: nn.Module) -> None:
    """Frozen target in eval mode, drafter in train mode (set once, again after an eval)."""
    model.train(False)
    drafter.train(True)


def _prefix_tokens(ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """``[B, N, K]``: index k holds the token at anchor + k - 1 (index 0: the anchor)."""
    offsets = torch.arange(block_size, device=anchors.device) - 1
    positions = (anchors.unsqueeze(-1) + offsets).clamp(min=0, max=ids.shape[1] - 1)
    flat = torch.gather(ids, 1, positions.flatten(1))
    return flat.view_as(positions)


def all_reduce_sum(tensor: Tensor, env: DistEnv) -> Tensor:
    """Sum a tensor over all ranks (identity for a single process)."""
    if env.is_distributed:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def _saved_by(checkpoint: Path) -> str | None:
    """The plan fingerprint a training checkpoint records (None if unreadable)."""
    try:
        state = parse_json(read_regular_file(checkpoint / TRAINER_STATE, max_bytes=2**20))
    except (FileReadProblem, JsonProblem):
        return None
    value = state.get("plan_fingerprint") if isinstance(state, dict) else None
    return value if isinstance(value, str) else None


def _int(state: dict[str, object], key: str) -> int:
    value = state.get(key)
    if not isinstance(value, int):
        msg = f"trainer_state.json has no integer {key!r}; the checkpoint is from another tool"
        raise CheckpointError(msg)
    return value


def _accuracies(value: object) -> list[float]:
    """Accuracy by position from a metrics row (read back, position 0 is null)."""
    if not isinstance(value, (list, tuple)):
        return []
    return [float(a) if isinstance(a, (int, float)) else 0.0 for a in value]


def _strict(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    return value


def _append_jsonl(path: Path, row: Mapping[str, object]) -> None:
    """One strict-JSON line (non-finite numbers as null), like the report's rows."""
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(_strict(dict(row)), allow_nan=False, sort_keys=True) + "\n")


def run_plan(
    plan: RunPlan, *, progress: bool = True, stop_after: int | None = None
) -> TrainSummary:
    """Train as the plan says and return the summary (rank 0's view under torchrun).

    `stop_after` stops after that optimiser step with its checkpoint saved, as a killed job
    would; rerunning the recipe then resumes.
    """
    return Trainer(plan, progress=progress, stop_after=stop_after).run()


__all__ = [
    "MAX_CHUNK_LOGITS",
    "DraftStep",
    "LossTargets",
    "StepInputs",
    "TrainSummary",
    "Trainer",
    "anchor_key",
    "build_optimizer",
    "clip_gradients",
    "lr_factor",
    "run_plan",
    "sample_batch_anchors",
    "step_inputs",
    "total_optimizer_steps",
]
