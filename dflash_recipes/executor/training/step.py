"""The training micro-step: what one batch feeds the drafter, and the drafter's loss on it.

:func:`step_inputs` runs the frozen target on a batch (or takes the captured states of offline
training) and packs the sampled blocks: their embeddings, positions, block mask, labels and
what the kind's head reads, as one frozen :class:`StepInputs`. :class:`DraftStep` (the module
DDP wraps) takes that object, fuses the taps, runs the drafter over all blocks at once, then
the target's ``lm_head`` and the kind's objective (head and loss,
:mod:`dflash_recipes.executor.kinds`), per chunk of blocks when the logits are large. Nothing
here names a drafter kind.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash_recipes.checkpoint.kinds.registry import needs_teacher
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.train_dataset import Batch
from dflash_recipes.executor.kinds.registry import kind_modules
from dflash_recipes.executor.model.convert import (
    CapturedStates,
    ConvertedModel,
    embed_tokens,
    lm_head,
    teacher_logits,
)
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.masks import (
    anchor_starts,
    build_flex_block_mask,
    build_split_block_mask,
)
from dflash_recipes.executor.model.target_states import (
    document_position_ids,
    stop_after_layer,
    target_states,
)
from dflash_recipes.executor.training.anchors import (
    AnchorBatch,
    block_inputs,
    block_labels,
    gather_teacher_logits,
)
from dflash_recipes.executor.training.loss import LossOutput, ObjectiveInputs, combine_losses
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.resources.chunk_budget import MAX_CHUNK_LOGITS, logits_budget
from dflash_recipes.plan.run_plan import ObjectivePlan


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
    #: 1 when block position k predicts anchor + k + 1 (a head with shift_label), else 0.
    shift: int = 0


class DraftStep(nn.Module):
    """Fuse taps, run the drafter over packed blocks, then lm_head and the kind's objective.

    Returns the objective's :class:`LossOutput`. The target's ``lm_head`` is held outside the
    module tree (frozen, shared, never part of the drafter's parameters), so wrapping this
    module in DDP reduces only drafter gradients.

    Memory: the drafter runs once over all blocks (one packed forward). Its logits
    ``[B, N, K, vocab]`` are the largest tensors of a step (5 GB in float32 for 512 blocks of
    16 at a 152k vocabulary, and the loss keeps copies for backward), so when they exceed
    `max_chunk_logits` elements (by default sized from the device's free memory on CUDA,
    :func:`~dflash_recipes.plan.resources.chunk_budget.logits_budget`, and
    :data:`MAX_CHUNK_LOGITS` on CPU), lm_head, head and loss run
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
        # The kind's head and objective (kept outside the module tree, like the lm_head: the
        # head's parameters are the drafter's).
        self.kind = kind_modules(drafter.spec.projector_type)
        object.__setattr__(self, "_lm_head", output_head)

    def blocks_per_chunk(self, batch: int, n_blocks: int) -> int:
        """How many blocks (per row) one chunk of lm_head + loss holds (all of them if they fit)."""
        spec = self.drafter.spec
        head: nn.Module = self._lm_head  # type: ignore[assignment]
        device = next(self.drafter.parameters()).device
        budget = logits_budget(
            free_device_bytes(device),
            vocab=spec.vocab_size,
            hidden=spec.hidden_size,
            dtype_bytes=_weight_dtype(head).itemsize,
            teacher=needs_teacher(spec.projector_type, self.objective),
            override=self.max_chunk_logits or None,
        )
        per_block = max(1, batch * spec.block_size * spec.vocab_size)
        return max(1, min(n_blocks, budget // per_block))

    def forward(self, inputs: StepInputs) -> LossOutput:
        """The objective's loss over the blocks of `inputs` (built by :func:`step_inputs`)."""
        head_inputs, targets = inputs.head_inputs, inputs.targets
        drafter = self.drafter
        context = drafter.fuse_context(inputs.tapped)
        hidden = drafter(
            inputs.block_embeds, context, inputs.q_positions, inputs.ctx_positions, inputs.mask
        )
        batch, q_len, width = hidden.shape
        block = drafter.spec.block_size
        n_blocks = q_len // block
        hidden = hidden.view(batch, n_blocks, block, width)
        per_chunk = self.blocks_per_chunk(batch, n_blocks)
        if per_chunk >= n_blocks:
            return self._objective(hidden, targets, 0, *head_inputs)
        # split, not slicing, for the states that carry gradients: its backward is one
        # concatenation, not a zero-filled full-size gradient per chunk. The other inputs carry
        # none and are sliced.
        parts = []
        for index, hidden_c in enumerate(torch.split(hidden, per_chunk, dim=1)):
            chunk = slice(index * per_chunk, (index + 1) * per_chunk)
            part = checkpoint(
                self._objective,
                hidden_c,
                targets,
                chunk.start,
                *(extra[:, chunk] for extra in head_inputs),
                use_reentrant=False,
            )
            assert isinstance(part, LossOutput)
            parts.append(part)
        return combine_losses(parts)

    def _objective(
        self, hidden: Tensor, targets: LossTargets, first: int, *head_inputs: Tensor
    ) -> LossOutput:
        """lm_head and the kind's objective of blocks ``first .. first + n - 1``: ``hidden [B,
        n, K, H]`` and the chunk's head inputs."""
        n, block = hidden.shape[1], hidden.shape[2]
        objective = self.objective
        head: nn.Module = self._lm_head  # type: ignore[assignment]
        teacher: Tensor | None = None
        if targets.target_logits is not None:
            anchors = targets.anchors[:, first : first + n]
            teacher = gather_teacher_logits(
                targets.target_logits, anchors, block_size=block, shift=targets.shift
            ).float()
        chunk_targets = ObjectiveInputs(
            labels=targets.labels[:, first : first + n],
            label_mask=targets.label_mask[:, first : first + n],
            teacher=teacher,
            step=targets.step,
            total_steps=targets.total_steps,
            shift=targets.shift,
        )
        logits = _lm_head_logits(head, hidden)
        return self.kind.objective(
            self.drafter.head, hidden, logits, head_inputs, chunk_targets, objective
        )


@attrs.frozen(eq=False)
class StepInputs:
    """The arguments of one :class:`DraftStep` call (see :func:`step_inputs`)."""

    tapped: Tensor
    block_embeds: Tensor
    q_positions: Tensor
    ctx_positions: Tensor
    mask: object
    #: What the kind's head reads per block (``KindModules.head_inputs``), each ``[B, N, K,
    #: ...]``; empty for plain DFlash.
    head_inputs: tuple[Tensor, ...]
    targets: LossTargets


def step_inputs(
    target: ConvertedModel,
    spec: ResolvedDraft,
    objective: ObjectivePlan,
    batch: Batch,
    drawn: AnchorBatch,
    *,
    step: int = 0,
    total_steps: int = 1,
    captured: CapturedStates | None = None,
    mask: object | None = None,
) -> StepInputs:
    """Everything a micro-step feeds the drafter, from a batch and its anchors (on one device).

    `batch` and `drawn` must already be on the target's device; `step` and `total_steps` (the
    optimiser step and the run's total) only feed Domino's decaying backbone weight.

    Runs the frozen target (its logits only when the objective needs a teacher) and builds
    the packed blocks, their positions, the block mask (flex on CUDA, the split form on CPU)
    and the labels. Fusing the taps is left to the step, which trains ``fc``. With `captured`
    (offline training) the taps come from the capture and the target's decoder does not run;
    teacher logits are recomputed from the captured last hidden state; a served target's states
    come the same way, each conversation computed alone, so packed rows take them too. `mask`:
    the block mask already built on the host
    (:mod:`~dflash_recipes.executor.training.setup.prefetch`, CPU), else it is built here.

    A packed batch (:attr:`Batch.document_ids`) keeps its conversations apart: the target runs
    with per-document positions and its own per-layer-type masks built from them
    (:func:`~dflash_recipes.executor.model.target_states.packed_attention`), a block's context
    is its own document before the anchor, and the drafter's positions restart per document, so each
    conversation's blocks get what they would get alone in a row.
    """
    ids, loss_mask = batch.input_ids, batch.loss_mask
    docs = batch.document_ids
    if docs is not None and captured is not None and not captured.documents_alone:
        msg = "packed rows cannot be trained from a capture; set data.packing: false offline"
        raise DataError(msg)
    anchors, valid = drawn.anchors, drawn.valid
    embeddings = embed_tokens(target)
    device = ids.device
    teacher = needs_teacher(spec.projector_type, objective)
    with torch.no_grad():
        if captured is None:  # hooks on the taps; without a teacher, stops after the deepest
            taps = spec.target_layer_ids
            # Rows are right-padded: under causal attention no real position sees the padding
            # after it, so no 2-D mask (whose padding test reads the device from the host).
            out = target_states(
                target,
                ids,
                None,
                taps,
                with_logits=teacher,
                stop_after=stop_after_layer(taps, needs_logits=teacher),
                document_ids=docs,
            )
            tapped = out.tapped  # the target's dtype: fc casts it (or autocast does)
            # Gathered per chunk of blocks inside the step, never as a whole [B, N, K, V].
            target_logits = out.logits
            del out
        else:
            tapped, target_logits = captured.tapped, None
            if teacher:
                if captured.last_hidden is None:
                    msg = "the objective needs teacher logits; the capture has no last hidden state"
                    raise DataError(msg)
                target_logits = teacher_logits(target, lm_head(target), captured.last_hidden)
        block_ids, q_positions = block_inputs(
            ids, anchors, valid, block_size=spec.block_size, mask_token_id=spec.mask_token_id
        )
        block_embeds = embeddings(block_ids).float()
        head_inputs = kind_modules(spec.projector_type).head_inputs(spec, ids, anchors, embeddings)
    ctx_len = int(ids.shape[1])
    if docs is None:
        ctx_positions = torch.arange(ctx_len, device=device).expand(ids.shape[0], ctx_len)
    else:  # positions restart per document, the blocks' too (anchor's place in its document)
        ctx_positions = document_position_ids(docs)
        starts = anchor_starts(anchors, docs).repeat_interleave(spec.block_size, dim=1)
        q_positions = q_positions - starts
    if mask is None and device.type == "cuda":
        mask = build_flex_block_mask(anchors, spec.block_size, ctx_len, valid, document_ids=docs)
    elif mask is None:
        # CPU: the split form of the dense mask (no blocks x blocks part).
        mask = build_split_block_mask(
            anchors,
            spec.block_size,
            ctx_len,
            valid,
            heads=spec.num_attention_heads,
            document_ids=docs,
        )
    labels, label_mask = block_labels(
        ids,
        loss_mask,
        anchors,
        valid,
        block_size=spec.block_size,
        shift=spec.label_shift,
        document_ids=docs,
    )
    return StepInputs(
        tapped=tapped,
        block_embeds=block_embeds,
        q_positions=q_positions,
        ctx_positions=ctx_positions,
        mask=mask,
        head_inputs=head_inputs,
        targets=LossTargets(
            labels=labels,
            label_mask=label_mask,
            anchors=anchors,
            target_logits=target_logits,
            step=step,
            total_steps=total_steps,
            shift=spec.label_shift,
        ),
    )


def _lm_head_logits(head: nn.Module, hidden: Tensor) -> Tensor:
    """float32 ``[..., vocab]`` logits of ``hidden [..., H]`` through one 2-D GEMM.

    A chunk of blocks is a strided view of the step's states (``[B, n, K, H]`` split on the
    block axis); fed to ``nn.Linear`` as is, matmul cannot fold its leading dims without a
    copy while the states require grad, and runs a batched matmul that re-reads the whole
    vocabulary matrix once per block (64% of the step's CUDA time on an H200). One contiguous
    ``[rows, H]`` operand makes it a single GEMM that reads the matrix once.
    """
    width = hidden.shape[-1]
    rows = hidden.to(_weight_dtype(head)).reshape(-1, width).contiguous()
    logits: Tensor = head(rows)
    return logits.float().view(*hidden.shape[:-1], logits.shape[-1])


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a CUDA device can still give this process: free on the device plus what the
    caching allocator holds unused (no sync: a driver query); None elsewhere (CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def _weight_dtype(module: nn.Module) -> torch.dtype:
    for parameter in module.parameters():
        return parameter.dtype
    return torch.float32


__all__ = [
    "MAX_CHUNK_LOGITS",
    "DraftStep",
    "LossTargets",
    "StepInputs",
    "free_device_bytes",
    "step_inputs",
]
