"""The resource plan of a compiled run: memory per rank by part, tokens and FLOPs per step, disk.

Computed from the plan and headers only (the base model's config.json and, when present, its
safetensors headers; never tensor data, never torch), so `compile` can say what a rank will
hold before a GPU is touched (docs/dflash.md, "Will it fit?").

Memory per rank, in bytes:

- ``target_weights``: every target tensor in the plan's dtype. With ``training.fsdp`` over
  more than one rank, as :func:`~dflash_recipes.executor.parallel_wrappers.shard_target_fsdp2`
  shards: the tensors of the decoder layers (``...layers.<i>.``) split on their first dim over
  the world size (padded up, as FSDP2 pads), everything else (embeddings, final norm,
  ``lm_head``) whole on every rank. Offline training without evaluation loads no decoder.
- ``drafter_weights``, ``optimizer_states``: the drafter's master weights and AdamW's two
  moments in ``training.drafter_master_dtype`` (float32, or bfloat16 for half of each), plus
  its per-tensor step counters, exact from the layout. With ``training.fsdp`` over more than
  one rank the drafter is sharded too (``executor/sharded_drafter.py``: ``fully_shard`` per
  draft layer and at the root): each tensor split on its first dim over the world size (padded
  up), and so its gradients and AdamW's moments.
- ``activations`` and ``gradients``: the largest phase of a step, with the gradients alive in
  it (all of them, in the master dtype, are :attr:`ResourcePlan.gradient_bytes`). The phases:
  the target's forward (the tapped layers' outputs, recorded by hooks; without a teacher
  objective the forward stops after the deepest tap, with one the logits too; one decoder
  layer's transients, FSDP's gathered layers, the tapped states in the target's dtype); the turn
  from the drafter's forward to its backward (what it saves for ``num_anchors x block_size``
  positions through every layer, the attention's keys and values, autocast's weight copies
  when the master dtype is not the autocast dtype, plus the larger of one chunk of
  logits/loss, sized as :mod:`~dflash_recipes.plan.resources.chunk_budget` sizes it, and one
  layer's backward transients; with ``training.activation_checkpointing`` only each layer's
  input instead, and in the backward one layer's activations as it recomputes them with one
  layer's backward transients, against the loss's chunk); the end of
  the backward. The first two hold gradients only
  when they outlive a micro-step (gradient accumulation) and DDP's buckets (a second copy,
  allocated up front on several ranks); the last holds them all. A sharded drafter has no
  buckets: its drafter phase and the end of its backward hold the parameters FSDP2 gathers
  (the root's, ``fc``, the norms and a kind's head, for the whole step, and two draft layers:
  the one running and the one prefetched) in the dtype it computes in (the autocast dtype on
  CUDA for a bfloat16 or float16 target, so no autocast weight copies; the master dtype
  otherwise), the end of the backward one layer's unsharded gradients (that dtype, and float32
  for the reduction) besides the sharded ones; accumulated micro-steps keep the unsharded
  gradients whole in float32 until the last.
- ``allowance``: a stated margin for what no tensor count sees: :data:`CUDA_CONTEXT_BYTES` of
  CUDA context and library workspaces plus :data:`FRAGMENTATION` of the activations for the
  caching allocator's fragmentation (none on CPU).
- ``eval_drafter_copy``: held-out evaluation of a sharded drafter (``training.fsdp`` over several
  ranks, evaluation planned) holds a whole copy of it on every rank; ``memory`` is the larger of
  the step's and that phase's (:mod:`~dflash_recipes.plan.resources.rank_memory`).

``host_memory`` is what one process holds in host memory while it loads, not a device figure
(:mod:`~dflash_recipes.plan.resources.host_memory`).

What would fit a smaller device is :mod:`~dflash_recipes.plan.resources.fit`'s (loaded
only when a plan does not fit). The activation model is validated against real training steps by
``benchmarks/bench_memory.py`` (CPU) and ``benchmarks/gpu_check.py`` (CUDA).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import attrs

from dflash_recipes.checkpoint.kinds import registry as kinds
from dflash_recipes.checkpoint.tensor_layout import expected_layout, layout_spec_for
from dflash_recipes.errors import ResourceError
from dflash_recipes.plan.attention_chunks import split_chunk_count
from dflash_recipes.plan.resources.chunk_budget import logits_budget
from dflash_recipes.plan.resources.host_memory import NOTHING_LOADED, HostMemory, host_memory
from dflash_recipes.plan.resources.rank_memory import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION,
    EvalParts,
    MemoryPerRank,
    allowance,
    eval_phase,
    evaluates_whole_drafter,
)
from dflash_recipes.plan.resources.target_dims import (
    TargetDims,
    decoder_layer_index,
    is_decoder_layer_tensor,
    read_target_dims,
    sharded_numel,
    target_dims,
)
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.recipe.choices import AUTOCAST_DTYPES
from dflash_recipes.records import Record

GIB = 2**30
#: Peak dense bfloat16 throughput assumed for `--mfu` when no other is given (H100/H200 SXM).
DEFAULT_PEAK_TFLOPS = 989.0
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_ST_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}
#: safetensors header bytes per tensor (name, dtype, shape, offsets as JSON), about.
_HEADER_BYTES_PER_TENSOR = 120
#: torch.save bytes per optimizer tensor besides its data (pickle records, the step counter).
_PICKLE_BYTES_PER_TENSOR = 420
_PICKLE_BYTES = 4096

Device = Literal["cuda", "cpu"]


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------


@attrs.frozen(repr=False, eq=False, slots=False)
class ActivationParts(Record):
    """The activation estimate's pieces (bytes); ``activations`` is the larger phase."""

    #: Target forward: hidden states + one layer's transients (+ FSDP's gathered layers).
    target_forward_peak: int
    #: Tapped states (float32), teacher logits, block inputs, RoPE tables: alive all step.
    step_inputs: int
    #: What the drafter saves for backward, attention's keys and values included.
    drafter_saved: int
    #: Of which the attention (queries, keys, values, outputs, and the CPU split chunks).
    attention: int
    #: The largest chunk of logits with its loss, log-probabilities and their gradients.
    loss_peak: int
    #: One draft layer's gradients of activations during backward.
    backward_transient: int
    #: A sharded drafter's parameters FSDP2 holds gathered (the root's and two layers').
    fsdp_gathered: int = 0
    #: With activation checkpointing: one layer's activations, recomputed in the backward.
    recompute: int = 0

    @property
    def drafter_phase(self) -> int:
        """Peak of the drafter's forward and backward."""
        return (
            self.step_inputs
            + self.drafter_saved
            + self.fsdp_gathered
            + max(self.loss_peak, self.recompute + self.backward_transient)
        )

    @property
    def peak(self) -> int:
        """The activation part of the memory per rank: the larger phase."""
        return max(self.target_forward_peak, self.drafter_phase)


@attrs.frozen(repr=False, eq=False, slots=False)
class StepFigures(Record):
    """One optimiser step over the whole job (all ranks, all accumulation micro-steps)."""

    #: Token positions the target reads: rows at training_seq_len, exact with data.packing
    #: (a packed row is full), an upper bound for padded rows (shorter than the longest).
    tokens: int
    #: Supervised block positions (anchors x (block_size - 1)): an upper bound.
    supervised_positions: int
    target_flops: int
    drafter_flops: int
    #: Of the two above, the attention's share.
    attention_flops: int

    @property
    def flops(self) -> int:
        """Target forward plus drafter forward and backward."""
        return self.target_flops + self.drafter_flops


@attrs.frozen(repr=False, eq=False, slots=False)
class DiskFigures(Record):
    """Bytes written under training.output_dir and by a capture."""

    checkpoint_bytes: int
    #: Checkpoints on disk at most: save_total_limit, plus the new one before the oldest goes.
    checkpoints_kept: int | None
    export_bytes: int
    #: One captured sequence at training_seq_len (taps, plus the last state for a teacher).
    capture_bytes_per_sequence: int

    @property
    def checkpoints_peak_bytes(self) -> int | None:
        """checkpoint_bytes x checkpoints_kept (None without a save_total_limit)."""
        if self.checkpoints_kept is None:
            return None
        return self.checkpoint_bytes * self.checkpoints_kept


@attrs.frozen(repr=False, eq=False, slots=False)
class ResourcePlan(Record):
    """Memory per rank, step figures and disk of one plan on `world_size` ranks of `device`."""

    world_size: int
    device: Device
    fsdp_sharded: bool
    memory: MemoryPerRank
    activation_parts: ActivationParts
    step: StepFigures
    disk: DiskFigures
    #: Parameters of the drafter and the target (the target as loaded).
    drafter_parameters: int
    target_parameters: int
    #: Where the target's sizes came from: its safetensors headers or its config.json.
    target_source: Literal["safetensors", "config.json"]
    #: Every gradient of the drafter (master dtype), as after a backward; DDP's buckets apart.
    gradient_bytes: int = 0
    #: The draft layers are recomputed in the backward (training.activation_checkpointing).
    activation_checkpointing: bool = False
    #: The drafter, its gradients and AdamW's moments are sharded (training.fsdp, several ranks).
    drafter_sharded: bool = False
    #: Host memory of one process while it loads.
    host_memory: HostMemory = NOTHING_LOADED
    #: The training step's memory per rank, and held-out evaluation's when a sharded drafter is
    #: measured whole on every rank (else None): `memory` is the larger (None: `memory`).
    step_memory: MemoryPerRank | None = None
    eval_memory: MemoryPerRank | None = None
    eval_parts: EvalParts | None = None

    def to_dict(self) -> dict[str, object]:
        """The JSON form: fixed keys (scripts rely on them), bytes and counts as integers."""
        memory, parts, disk = self.memory, self.activation_parts, self.disk
        return {
            "world_size": self.world_size,
            "device": self.device,
            "fsdp_sharded": self.fsdp_sharded,
            "drafter_sharded": self.drafter_sharded,
            "activation_checkpointing": self.activation_checkpointing,
            "target_source": self.target_source,
            "parameters": {"drafter": self.drafter_parameters, "target": self.target_parameters},
            "gradient_bytes": self.gradient_bytes,
            "memory_per_rank": {
                "target_weights": memory.target_weights,
                "drafter_weights": memory.drafter_weights,
                "gradients": memory.gradients,
                "optimizer_states": memory.optimizer_states,
                "activations": memory.activations,
                "allowance": memory.allowance,
                "eval_drafter_copy": memory.eval_drafter_copy,
                "total": memory.total,
            },
            "phases": {
                "training_step": (self.step_memory or memory).total,
                "held_out_eval": _eval_dict(self.eval_memory, self.eval_parts),
            },
            "activations": {
                "target_forward_peak": parts.target_forward_peak,
                "step_inputs": parts.step_inputs,
                "drafter_saved": parts.drafter_saved,
                "attention": parts.attention,
                "loss_peak": parts.loss_peak,
                "backward_transient": parts.backward_transient,
                "fsdp_gathered": parts.fsdp_gathered,
                "recompute": parts.recompute,
            },
            "host_memory_per_rank": {
                "target": self.host_memory.target,
                "drafter": self.host_memory.drafter,
                "total": self.host_memory.total,
                "sharded_load": self.host_memory.sharded_load,
                "drafter_other_ranks": self.host_memory.drafter_other_ranks,
            },
            "step": {
                "tokens": self.step.tokens,
                "supervised_positions": self.step.supervised_positions,
                "flops": self.step.flops,
                "target_flops": self.step.target_flops,
                "drafter_flops": self.step.drafter_flops,
                "attention_flops": self.step.attention_flops,
            },
            "disk": {
                "checkpoint_bytes": disk.checkpoint_bytes,
                "checkpoints_kept": disk.checkpoints_kept,
                "checkpoints_peak_bytes": disk.checkpoints_peak_bytes,
                "export_bytes": disk.export_bytes,
                "capture_bytes_per_sequence": disk.capture_bytes_per_sequence,
            },
        }


# ---------------------------------------------------------------------------------------------
# the estimate
# ---------------------------------------------------------------------------------------------


def estimate_resources(
    plan: RunPlan,
    *,
    world_size: int = 1,
    device: Device | None = None,
    target: TargetDims | None = None,
    autocast: bool | None = None,
    device_bytes: int | None = None,
    chunk_logits: int | None = None,
) -> ResourcePlan:
    """The resource plan of a resolved `plan` on `world_size` ranks.

    `device` defaults to the plan's (``auto`` counts as cuda, the device it is sized for);
    `target` to what :func:`read_target_dims` reads from the plan's base model. `autocast`
    (half-precision matmuls over the master weights) defaults to what the trainer does: on
    CUDA with a bfloat16 or float16 target. `device_bytes` (a CUDA device's total memory)
    sizes the lm_head/loss chunks from the memory left free, as the step does on that device;
    without it they hold the fixed floor
    (:data:`~dflash_recipes.plan.resources.chunk_budget.MAX_CHUNK_LOGITS`), the least the step
    takes.
    `chunk_logits` stands for the step's ``max_chunk_logits`` override. Raises ResourceError
    when the plan is unresolved or the target's files cannot be read.
    """
    facts, arch, taps = plan.base_model.facts, plan.draft.architecture, plan.draft.target_layer_ids
    dims = (
        arch.num_hidden_layers,
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.head_dim,
        arch.intermediate_size,
    )
    if not plan.resolved or facts is None or taps is None or None in dims:
        msg = "resources need a resolved plan (compile, not lint); recompile the recipe"
        raise ResourceError(msg)
    layers, nh, nkv, d, inter = (int(value or 0) for value in dims)
    h, v, n_taps = facts.hidden_size, facts.vocab_size, len(taps)
    try:
        spec = layout_spec_for(arch, hidden_size=h, n_taps=n_taps, vocab_size=v)
    except ValueError as exc:
        raise ResourceError(str(exc)) from exc
    if world_size < 1:
        msg = f"world size must be at least 1, got {world_size}"
        raise ResourceError(msg)
    if device is None:
        device = "cpu" if plan.training.device == "cpu" else "cuda"
    if target is None:
        target = read_target_dims(Path(plan.base_model.path))
    training, objective = plan.training, plan.draft.objective
    pd = _DTYPE_BYTES[plan.base_model.dtype]
    fsdp = training.fsdp and world_size > 1
    # A capture or a served target (target_server) gives the states: the trainer holds only
    # the target's embeddings, final norm and lm_head, unless a measured evaluation runs it.
    offline = plan.data.hidden_states_path is not None or plan.target_server is not None
    decoder_loaded = not offline or (training.eval_steps is not None and plan.data.has_eval_data)

    # -- weights ----------------------------------------------------------------------------
    target_numel = 0
    layer_numel = 0  # one decoder layer, unsharded (what FSDP gathers)
    for name, shape in target.shapes.items():
        in_layer = is_decoder_layer_tensor(name)
        if in_layer and not decoder_loaded:
            continue
        target_numel += sharded_numel(shape, world_size) if in_layer and fsdp else math.prod(shape)
        if in_layer:
            layer_numel += math.prod(shape)
    layer_numel //= max(1, target.num_hidden_layers)
    layout = expected_layout(spec)
    drafter_numel = sum(math.prod(shape) for shape in layout.values())
    n_tensors = len(layout)
    # The drafter is sharded with the target (training.fsdp): each tensor on its first dim.
    local_numel = (
        sum(sharded_numel(shape, world_size) for shape in layout.values())
        if fsdp
        else drafter_numel
    )

    # -- activations ----------------------------------------------------------------------
    cuda = device == "cuda"
    master = training.drafter_master_dtype
    mb = _DTYPE_BYTES[master]  # the drafter's parameters, gradients and AdamW moments
    if autocast is None:
        autocast = cuda and plan.base_model.dtype in AUTOCAST_DTYPES
    # The dtype the drafter's matmuls run in: autocast's (the target's), else the weights'.
    mm = 2 if autocast else mb
    # The dtype of the weights the drafter's forward sees: a sharded drafter's FSDP2 gathers
    # them in the autocast dtype (its mixed precision policy), else the master weights.
    wd = mm if fsdp else mb
    # Autocast casts weights and matmul inputs only when the weights are not already in its
    # dtype (a bfloat16 master under bfloat16 autocast casts nothing, nor a gathered drafter).
    casts = autocast and master != plan.base_model.dtype and not fsdp
    rq = max(mm, wd)  # what the q/k norm weights promote the roped queries and keys to
    f32 = 4
    b, t = training.per_device_train_batch_size, training.training_seq_len
    n, k = objective.num_anchors, plan.draft.block_size
    q = n * k  # packed block positions per row
    needs_teacher = kinds.needs_teacher(arch.projector_type, objective)

    # Step inputs, alive for the whole drafter phase: tapped states (the target's dtype, plus
    # the copy fc saves when its matmul dtype differs: the master dtype without autocast),
    # block embeddings, RoPE tables, labels, teacher logits.
    tapped = b * t * n_taps * h * pd
    inputs = tapped + (b * t * n_taps * h * mm if mm != pd else 0)
    inputs += b * q * h * f32 + 2 * b * (t + q) * d * f32 + 3 * b * q * 8
    if needs_teacher:
        inputs += b * t * v * pd
    # Per draft layer, what autograd keeps (see the module docstring of draft.py for the ops):
    # input norm (its float32 input or upcast, the normed states in the master dtype, what
    # q_proj saves), [context ; x] for k/v (one copy per projection when autocast casts), q and
    # k norms (the float32 upcast, the normed states in the matmul dtype), o_proj's input, the
    # post-attention norm (as the input norm, gate and up each casting) and the SwiGLU's four
    # [Q, I] tensors.
    kv_rows = t + q
    per_layer = b * (
        q * h * (f32 + wd + mm)
        + kv_rows * h * mm * (2 if casts else 1)
        + q * nh * d * (f32 + mm)
        + kv_rows * nkv * d * (f32 + mm)
        + q * nh * d * mm
        + q * h * (f32 + wd + mm * (2 if casts else 1))
        + 4 * q * inter * mm
    )
    if cuda:
        # flex attention: roped q and k (promoted by the norm weights), v, the output and its
        # log-sum-exp.
        attention = b * (
            q * nh * d * rq + kv_rows * nkv * d * (rq + mm) + q * nh * d * rq + q * nh * f32
        )
    else:
        # The CPU split form copies each chunk's visible context (about half of it on average
        # for sorted anchors) and its own blocks into fresh keys and values; SDPA saves them,
        # the queries, its output and log-sum-exp, and the boolean mask made a float one
        # (all in the matmul dtype: CPU autocast casts SDPA's inputs).
        chunks = split_chunk_count(b, n, k, t, heads=nh)
        keys = kv_rows if chunks == 1 else t * (chunks + 1) // 2 + q
        attention = b * (
            2 * q * nh * d * mm
            + 2 * keys * nkv * d * mm
            + q * nh * f32
            + -(-q // chunks) * keys * mm
        )
    layer_input = b * q * h * wd  # what a checkpointed layer keeps: its input, the weights' dtype
    recompute = 0
    if training.activation_checkpointing:
        # Each layer keeps its input; its backward recomputes its forward, holding one layer's
        # activations at a time, in the backward (after the loss's chunks are gone).
        drafter_saved = layers * layer_input
        recompute = per_layer + attention
    else:
        drafter_saved = layers * (per_layer + attention)
    # Once per step: hidden_norm's float32 input and its normed states (cast back to the
    # matmul dtype), and the final norm's input and normed states.
    drafter_saved += b * t * h * (f32 + mm) + b * q * h * (f32 + wd)
    if casts:
        drafter_saved += drafter_numel * 2  # autocast's cached half-precision weight copies
    # Logits and loss: per chunk of blocks (recomputed in backward) when they exceed the
    # step's budget, sized as DraftStep.blocks_per_chunk sizes it (chunk_budget.logits_budget:
    # from the memory free at that moment when the device's size is known, else the fixed
    # floor). A chunk holds the rows' contiguous states (lm_head's dtype, and their float32
    # gradient), the logits in lm_head's dtype and in float32, the saved log-probabilities and
    # one float32 gradient at a time (the budget's bytes_per_row counts more, to leave room).
    per_block = max(1, b * k * v)
    # Everything alive when the step sizes its chunks (the drafter's forward is done; on the
    # first micro-step no gradient exists yet), for the budget's free memory.
    grads = local_numel * mb  # this rank's gradients (its shards' when sharded)
    accumulates = training.gradient_accumulation_steps > 1
    if fsdp:
        # No buckets; accumulated micro-steps keep the unsharded gradients whole in float32
        # (FSDP2 reduces only on the last), the sharded ones exist after it.
        buckets = 0
        grads_in_forward = drafter_numel * f32 if accumulates else 0
    else:
        buckets = grads if world_size > 1 else 0  # DDP's gradient buckets, allocated up front
        grads_in_forward = buckets + (grads if accumulates else 0)
    # A sharded drafter's gathered parameters (in the dtype it computes in): the root's own
    # (outside the draft layers), gathered for the whole step, and two layers at a time.
    gathered = 0
    layer_grads_transient = 0
    if fsdp:
        per_draft_layer = {
            name: math.prod(shape) for name, shape in layout.items() if name.startswith("layers.")
        }
        root_numel = drafter_numel - sum(per_draft_layer.values())
        one_layer = sum(per_draft_layer.values()) // max(1, layers)
        gathered = (root_numel + 2 * one_layer) * wd
        # the end of the backward: one layer's unsharded gradients and their float32 copy
        layer_grads_transient = one_layer * (wd + f32)
    static = target_numel * pd + local_numel * 3 * mb + n_tensors * 4
    free = None
    if cuda and device_bytes is not None:
        used = static + grads_in_forward + inputs + drafter_saved + gathered
        free = device_bytes - CUDA_CONTEXT_BYTES - used
    budget = logits_budget(
        free, vocab=v, hidden=h, dtype_bytes=pd, teacher=needs_teacher, override=chunk_logits
    )
    blocks_per_chunk = max(1, min(n, budget // per_block))
    chunk_rows_held = blocks_per_chunk * b * k
    chunk_logits_held = chunk_rows_held * v
    loss_peak = chunk_logits_held * (3 * f32 + (pd if pd < f32 else 0))
    loss_peak += chunk_rows_held * h * (pd + f32)
    if needs_teacher:
        loss_peak += chunk_logits_held * 2 * f32  # the teacher's softmax and gathered logits
    # What the kind's head keeps beyond the plain loss (Domino, DSpark: the corrected logits and
    # their log-softmax, a rough count).
    loss_peak += chunk_logits_held * kinds.kind_facts(arch.projector_type).loss_logit_copies * f32
    # Backward frees what each op saved as it goes: the transient is about the gradients of
    # the widest op's inputs and output (the SwiGLU's [Q, I] tensors).
    backward_transient = 3 * b * q * max(inter, h) * f32
    # Target forward (no grad). Hooks keep the tapped layers' outputs only
    # (target_states.target_states); without a teacher the forward stops after the deepest
    # tap: the kept outputs, the running layer's input and transients, then their
    # concatenation made float32. With a teacher: the same kept outputs, one layer's
    # transients, the tapped states being concatenated and the teacher logits. FSDP adds its
    # gathered layers.
    bth = b * t * target.hidden_size
    if decoder_loaded and not offline:
        layer_tmp = (
            b
            * t
            * pd
            * (
                3 * target.intermediate_size
                + 3 * target.hidden_size
                + 2 * target.num_attention_heads * target.head_dim
                + 2 * target.num_key_value_heads * target.head_dim
            )
        )
        kept = (n_taps + 1) * bth * pd
        if needs_teacher:
            target_peak = kept + layer_tmp + tapped + b * t * target.vocab_size * pd
        else:
            target_peak = max(kept + layer_tmp, 2 * n_taps * bth * pd)  # hooks' + their concat
        if fsdp:
            target_peak += 2 * layer_numel * pd  # the layer running and the one prefetched
    else:
        target_peak = inputs
    parts = ActivationParts(
        target_forward_peak=target_peak,
        step_inputs=inputs,
        drafter_saved=drafter_saved,
        attention=attention if training.activation_checkpointing else layers * attention,
        loss_peak=loss_peak,
        backward_transient=backward_transient,
        fsdp_gathered=gathered,
        recompute=recompute,
    )
    # The step's peak is the largest phase with the gradients alive in it: the target's forward
    # and the drafter's forward-to-backward turn hold the gradients only when they outlive a
    # micro-step (accumulation) or are DDP's buckets; the end of the backward holds them all
    # with only the step's inputs left.
    end_grads = grads + buckets + (grads_in_forward if fsdp else 0)
    phases = (
        (parts.target_forward_peak, grads_in_forward),
        (parts.drafter_phase, grads_in_forward),
        (inputs + backward_transient + gathered + layer_grads_transient, end_grads),
    )
    activations, gradients_at_peak = max(phases, key=sum)
    step_memory = MemoryPerRank(
        target_weights=target_numel * pd,
        drafter_weights=local_numel * mb,
        gradients=gradients_at_peak,
        optimizer_states=local_numel * 2 * mb + n_tensors * 4,
        activations=activations,
        allowance=allowance(activations, cuda=cuda),
    )
    # Held-out evaluation of a sharded drafter: a whole copy on every rank (rank_memory).
    eval_parts = eval_memory = None
    if evaluates_whole_drafter(plan, drafter_sharded=fsdp):
        eval_parts = EvalParts(
            drafter_copy=drafter_numel * mb,
            in_flight=max(sharded_numel(s, world_size) * world_size for s in layout.values()) * mb,
            target_gathered=2 * layer_numel * pd,  # the sharded target's two gathered layers
        )
        eval_memory = eval_phase(step_memory, eval_parts, gradients=grads, cuda=cuda)
    memory = max(step_memory, eval_memory or step_memory, key=lambda phase: phase.total)
    host = host_memory(
        target,
        pd,
        drafter_numel * mb,
        decoder_loaded=decoder_loaded,
        fsdp=fsdp,
        world_size=world_size,
    )

    # -- step -----------------------------------------------------------------------------
    rows = b * world_size * training.gradient_accumulation_steps
    # Every row at training_seq_len: what a packed row is (data.packing; its target attention
    # is a dense masked SDPA over the whole row), a padded batch's upper bound.
    tokens = rows * t
    supervised = rows * n * (k - 1)
    # Without a teacher the target stops after the deepest tap: later layers never run.
    layers_run = target.num_hidden_layers if needs_teacher else max(taps) + 1
    dense_target = 0
    for name, shape in target.shapes.items():
        if len(shape) == 2 and "embed_tokens" not in name:
            index = decoder_layer_index(name)
            if index is not None and (not decoder_loaded or index >= layers_run):
                continue
            dense_target += math.prod(shape)
    if not needs_teacher:
        dense_target -= target.vocab_size * target.hidden_size  # lm_head is not run
    target_attention = 2 * rows * t * t * target.num_attention_heads * target.head_dim * layers_run
    if offline:
        target_flops = 2 * max(0, dense_target) * tokens if needs_teacher else 0
        target_attention = 0
    else:
        target_flops = 2 * max(0, dense_target) * tokens + target_attention
    ctx_seen = t // 2 + k  # sorted uniform anchors: half the context on average, plus the block
    per_row = (
        t * n_taps * h * h  # fc
        + layers
        * (
            q * (2 * nh * d * h + 3 * h * inter)
            + kv_rows * 2 * nkv * d * h
            + 2 * q * ctx_seen * nh * d
        )
        + q * h * v  # lm_head
    )
    layers_macs = per_row - t * n_taps * h * h - q * h * v  # the decoder layers' forward
    # forward, then backward (twice the forward), plus the layers' forward again when they are
    # recomputed (activation checkpointing)
    passes = 4 if training.activation_checkpointing else 3
    draft_attention = rows * layers * 2 * q * ctx_seen * nh * d * 2 * passes
    # forward 2 x MACs; backward 2x forward, but the frozen lm_head computes no weight
    # gradient, and the chunked loss recomputes the lm_head forward once more.
    lm = q * h * v
    recomputed = layers_macs if training.activation_checkpointing else 0
    drafter_flops = rows * 2 * (3 * per_row - lm + (lm if blocks_per_chunk < n else 0) + recomputed)
    step = StepFigures(
        tokens=tokens,
        supervised_positions=supervised,
        target_flops=target_flops,
        drafter_flops=drafter_flops,
        attention_flops=target_attention + draft_attention,
    )

    # -- disk -----------------------------------------------------------------------------
    checkpoint = (
        drafter_numel * 12
        + n_tensors * (_HEADER_BYTES_PER_TENSOR + _PICKLE_BYTES_PER_TENSOR)
        + _PICKLE_BYTES
    )
    export = drafter_numel * pd + n_tensors * _HEADER_BYTES_PER_TENSOR + 8192
    capture = t * n_taps * h * pd + (t * h * pd if needs_teacher else 0) + t * 16
    limit = training.save_total_limit
    disk = DiskFigures(
        checkpoint_bytes=checkpoint,
        checkpoints_kept=None if limit is None else limit + 1,
        export_bytes=export,
        capture_bytes_per_sequence=capture,
    )
    return ResourcePlan(
        world_size=world_size,
        device=device,
        fsdp_sharded=fsdp,
        memory=memory,
        activation_parts=parts,
        step=step,
        disk=disk,
        drafter_parameters=drafter_numel,
        target_parameters=sum(math.prod(s) for s in target.shapes.values()),
        target_source=target.source,
        gradient_bytes=grads,
        activation_checkpointing=training.activation_checkpointing,
        drafter_sharded=fsdp,
        host_memory=host,
        step_memory=step_memory,
        eval_memory=eval_memory,
        eval_parts=eval_parts,
    )


def _eval_dict(memory: MemoryPerRank | None, parts: EvalParts | None) -> dict[str, int] | None:
    """Held-out evaluation's phase in the JSON (None: not counted)."""
    if memory is None or parts is None:
        return None
    return {**attrs.asdict(parts), "total": memory.total}


def gib(value: int) -> str:
    """Bytes as GiB with two decimals."""
    return f"{value / GIB:.2f}"


__all__ = [
    "CUDA_CONTEXT_BYTES",
    "DEFAULT_PEAK_TFLOPS",
    "FRAGMENTATION",
    "GIB",
    "ActivationParts",
    "Device",
    "DiskFigures",
    "HostMemory",
    "MemoryPerRank",
    "ResourcePlan",
    "StepFigures",
    "TargetDims",
    "decoder_layer_index",
    "estimate_resources",
    "gib",
    "is_decoder_layer_tensor",
    "read_target_dims",
    "sharded_numel",
    "target_dims",
]
