"""GPU check: the CUDA paths against CPU/eager float32 references, then a timed 8B-sized step.

    python benchmarks/gpu_check.py [--peak-tflops 989] [--steps 3] [--only CHECK ...]
    python benchmarks/gpu_check.py --only step --profile [--profile-trace step.json]
    python benchmarks/gpu_check.py --dry-run      # every check on the CPU at tiny dims (< 30 s)

Checks (each prints its tolerances, then PASS, FAIL or SKIP with the reason):

- ``flex``: the drafter's forward and backward under the flex-attention block mask
  (:func:`build_flex_block_mask`, the compiled ``flex_attention`` kernel the CUDA path uses),
  with and without attention sinks, and a DFlash 2 drafter (its convolutions, a non-causal
  sliding layer), against the dense-mask eager forward on the CPU in float32;
  the graph is the trainer's (raw taps through ``fuse_context``, so ``fc`` and ``hidden_norm``
  are in it), and gradients are compared for exactly the parameters that get one in both
  graphs: a parameter with a gradient on one side only, or a trainable one with none on
  either, fails (the backward needs CUDA: no gradients in a dry run);
- ``bf16``: one training step (``optimizer_step``: fuse, drafter, lm_head, loss, backward,
  clipping) under the bf16 autocast a bf16 plan gets on the device, against the same step in
  float32 on the CPU;
- ``chunked``: the step built with a small ``max_chunk_logits`` (lm_head + loss per chunk of
  blocks under activation checkpointing) under autocast, against the unchunked step;
- ``nccl``: a process group (NCCL on CUDA, 2 processes when there are 2 GPUs, else 1; gloo in a
  dry run): an all_reduce, and a DDP step (``build_step`` on the ranks: DDP-wrapped, each rank
  its rows) whose gradients equal the single-process step on the whole batch;
- ``fsdp``: FSDP2 (``fully_shard``): the sharded frozen target (``shard_target_fsdp2``, what
  ``training.fsdp`` does), run through the trainer's own ``step_inputs`` (taps captured by
  forward hooks, the forward stopped after the deepest tap: ``target_states``), gives
  the plain target's ``output_hidden_states`` taps, and so does a teacher objective's path
  (``target_states`` with logits) on the sharded target; one ``optimizer_step`` of the drafter
  sharded as the trainer shards it (``build_step`` with ``training.fsdp``: the target and
  ``shard_drafter_fsdp2``), each rank its rows, equals the plain single-process one;
- ``step``: a timed training step at real proportions (CUDA; tiny dims in a dry run): the
  drafter of Qwen3-8B (hidden 4096, 5 layers, 32 heads / 8 kv heads x 128, intermediate 12288,
  vocab 151936, block 16, 5 taps) on a Qwen3-8B-wide target truncated to 6 layers (built from a
  config, random weights, no download), 4096 tokens, 512 anchors, bf16 target, float32 master
  weights under bf16 autocast, AdamW. Prints tokens/s, peak memory and model FLOPs
  utilisation (formula printed; the peak is ``--peak-tflops``, default H200 bf16 dense).
  The step is what ``run`` runs: ``build_step`` (the target in memory), the rows through
  ``prepare_rows`` once (``run`` prepares them on its prefetch thread), each step one
  ``optimizer_step`` (clipping, the non-finite guard, the plan's AdamW and schedule).
  Then the compile-time resource plan (``dflash_recipes.plan.resources``) of the same shape
  against the step: its exact parts (target and drafter weights, AdamW states) against the
  built modules' bytes, and its memory per rank (less the stated allowance) against
  ``torch.cuda.max_memory_allocated`` of a step, within 15% (exact parts only in a dry run).
  With ``--profile``: the step's phases (target forward + masks, drafter + head forward,
  backward, optimizer) timed per step (CUDA events recorded by hooks: the step module's forward,
  each gradient's accumulation, the end of ``optimizer_step``; one synchronize per step, in
  this mode only), then ``torch.profiler``'s ``key_averages`` table: the top CUDA kernels by
  self CUDA time (CPU ops by self CPU time in a dry run);
- ``eval``: KV-cached verification (``evaluate_acceptance``, the product's eval loop) of the
  shipped tiny target in bf16 with a random float32 drafter on the device, against both in
  float32 on the CPU: the CPU's output equals greedy decoding, the device's pooled tau is
  within 10% of the CPU's; tokens/s of both printed;
- ``packing``: packed rows keep their documents apart on the device, in the target's bf16
  (float32 in a dry run): targets with sliding-window (Gemma 3, SDPA), eager-with-sinks
  (gpt-oss) and chunked (Llama 4) layers, built from their transformers configs at small
  width (random weights), each a packed row of two documents longer than its window against
  each document alone (``target_states``, taps of the first and last layers and the logits),
  within the run-start check's tolerance for the dtype (``ISOLATION_TOLERANCE``); then the
  product's ``check_packed_isolation`` itself passes. A family this transformers lacks is
  skipped with the reason;
- ``run``: ``dflash-recipe run`` of the tiny from-scratch recipe through ``--nproc-per-node 1``
  (torchrun; ``training.device=cuda``, NCCL; the CPU and gloo in a dry run): it completes its 2
  steps and writes an export (``model.safetensors``, ``config.json``).

Exits 1 when any check fails, 0 otherwise (SKIPs included), 2 when there is no CUDA device and
no ``--dry-run``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.errors import PlanError
from dflash_recipes.executor.data.train_dataset import Batch as TokenBatch
from dflash_recipes.executor.dist_env import DistEnv, init_distributed, shutdown_distributed
from dflash_recipes.executor.evaluation.cached_decoding import speculative_generate_batch
from dflash_recipes.executor.evaluation.evaluate import AcceptanceReport, evaluate_acceptance
from dflash_recipes.executor.evaluation.sampling import Sampling
from dflash_recipes.executor.model.convert import (
    load_base_model,
)
from dflash_recipes.executor.model.draft import (
    DFlashDraftModel,
    rope_parameters,
    taps_from_hidden_states,
)
from dflash_recipes.executor.model.masks import build_dense_block_mask, build_flex_block_mask
from dflash_recipes.executor.model.target_states import (
    ISOLATION_TOLERANCE,
    check_packed_isolation,
    decoder_layers,
    stop_after_layer,
    target_states,
)
from dflash_recipes.executor.training.anchors import AnchorBatch, block_positions, sample_anchors
from dflash_recipes.executor.training.loss import LossOutput
from dflash_recipes.executor.training.setup.prefetch import PreparedBatch
from dflash_recipes.executor.training.step import DraftStep, StepInputs, step_inputs
from dflash_recipes.executor.training.train_step import (
    StepOutput,
    TrainStep,
    build_step,
    optimizer_step,
    prepare_rows,
)
from dflash_recipes.plan.resources.estimate import estimate_resources, target_dims
from dflash_recipes.plan.run_plan import RunPlan

REPO = Path(__file__).resolve().parents[1]
CHECKS = ("flex", "bf16", "chunked", "nccl", "fsdp", "step", "eval", "packing", "run")
#: H200 (and H100 SXM) dense bf16 tensor-core peak, TFLOP/s.
DEFAULT_PEAK_TFLOPS = 989.0


# ---------------------------------------------------------------------------------------------
# dimensions and models
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    """Drafter, target and batch dimensions of one check."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    target_layers: int
    taps: tuple[int, ...]
    block: int
    batch: int
    seq: int
    anchors: int


#: The checks' dims on the GPU: big enough for several flex tiles and chunks, fast on the CPU.
CHECK_DIMS = Dims(256, 2, 4, 2, 64, 512, 4096, 4, (1, 2, 3), 16, 2, 640, 24)
#: The checks' dims in a dry run.
TINY_DIMS = Dims(64, 2, 4, 2, 16, 128, 256, 4, (1, 2), 4, 2, 48, 6)
#: The timed step: Qwen3-8B's drafter on a truncated Qwen3-8B-wide target.
QWEN3_8B_DIMS = Dims(4096, 5, 32, 8, 128, 12288, 151936, 6, (1, 2, 3, 4, 5), 16, 1, 4096, 512)
#: The timed step in a dry run.
TINY_STEP_DIMS = Dims(64, 2, 4, 2, 16, 128, 256, 4, (1, 2), 4, 1, 128, 16)


def make_plan(dims: Dims, workdir: Path) -> RunPlan:
    """The tiny demo recipe's plan, resized to `dims` (target facts, drafter, block, anchors)."""
    result = compile_file(
        REPO / "recipes" / "tiny" / "tiny_scratch.yaml",
        overrides=(f"training.output_dir={workdir / 'unused'}",),
    )
    if result.plan is None:
        msg = f"cannot compile recipes/tiny/tiny_scratch.yaml: {result.diagnostics}"
        raise RuntimeError(msg)
    plan = result.plan
    assert plan.base_model.facts is not None
    facts = attrs.evolve(
        plan.base_model.facts,
        hidden_size=dims.hidden,
        num_hidden_layers=dims.target_layers,
        vocab_size=dims.vocab,
        max_position_embeddings=max(dims.seq + dims.block, 128),
    )
    arch = attrs.evolve(
        plan.draft.architecture,
        num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        head_dim=dims.head_dim,
        intermediate_size=dims.intermediate,
    )
    draft = attrs.evolve(
        plan.draft,
        block_size=dims.block,
        mask_token_id=dims.vocab - 1,
        target_layer_ids=dims.taps,
        architecture=arch,
        objective=attrs.evolve(plan.draft.objective, num_anchors=dims.anchors),
    )
    base = attrs.evolve(plan.base_model, facts=facts, dtype="float32")
    return attrs.evolve(plan, base_model=base, draft=draft)


def target_config(dims: Dims, plan: RunPlan) -> Qwen3Config:
    """A Qwen3 config of the target's dims (RoPE from the plan), for random weights."""
    facts = plan.base_model.facts
    assert facts is not None
    return Qwen3Config(
        hidden_size=dims.hidden,
        intermediate_size=dims.intermediate,
        num_hidden_layers=dims.target_layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        head_dim=dims.head_dim,
        vocab_size=dims.vocab,
        max_position_embeddings=facts.max_position_embeddings,
        rope_parameters=rope_parameters(facts.rope),
        tie_word_embeddings=False,
    )


def base_target(dims: Dims, plan: RunPlan, seed: int) -> PreTrainedModel:
    """A random float32 target on the CPU (no drafter yet)."""
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(target_config(dims, plan))


def randomize_norms(drafter: nn.Module, seed: int) -> None:
    """Norm weights away from 1, so that a wrong norm shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))


def single_env(device: torch.device) -> DistEnv:
    """One process on `device` (the check's device, not the plan's ``training.device``)."""
    return DistEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        is_distributed=False,
        backend="nccl" if device.type == "cuda" else "gloo",
        device=device,
    )


def train_step_for(
    plan: RunPlan,
    target: PreTrainedModel,
    env: DistEnv,
    *,
    drafter_seed: int,
    max_chunk_logits: int | None = None,
    like: TrainStep | None = None,
) -> TrainStep:
    """What ``run`` builds for one step of `plan` (:func:`build_step`) on the in-memory `target`
    (not converted yet), its drafter seeded by `drafter_seed` with random norms, or with the
    weights of `like`'s drafter; DDP-wrapped on several ranks (a sharded drafter: as built)."""
    torch.manual_seed(drafter_seed)
    step = build_step(
        plan,
        env=env,
        target=target,
        max_chunk_logits=max_chunk_logits,
        skip_memory_check=True,  # the checks' shapes are not what the estimate is for
        wrap=False,
    )
    if not step.models.sharded:  # a sharded drafter holds DTensors: left as initialised
        if like is None:
            randomize_norms(step.models.drafter, drafter_seed + 1)
        else:
            step.models.drafter.load_state_dict(like.models.drafter.state_dict())
    step.models.wrap_for_ranks(env)
    step.models.training_modes()
    return step


def prepared_rows(step: TrainStep, batch: Batch, *, next_index: int) -> PreparedBatch:
    """`batch`'s rows prepared as ``run``'s prefetch thread prepares them (:func:`prepare_rows`:
    their anchors from the plan's seed and the rows' place in the epoch, `next_index` the index
    just after the global batch)."""
    return prepare_rows(step, batch.ids, batch.loss_mask, next_index=next_index)


def loss_of(out: StepOutput) -> LossOutput:
    """The one micro-batch's loss output of a step."""
    (result, _tokens), *rest = out.micro
    assert not rest
    return result


def _moved(model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
    nn.Module.to(model, device)
    return model


@dataclass(frozen=True)
class Batch:
    """Token ids, masks and anchors of one batch (on the CPU)."""

    ids: Tensor
    attention: Tensor
    loss_mask: Tensor
    anchors: Tensor
    valid: Tensor

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.ids.to(device),
            self.attention.to(device),
            self.loss_mask.to(device),
            self.anchors.to(device),
            self.valid.to(device),
        )

    def rows(self, start: int, end: int) -> Batch:
        rows = slice(start, end)
        return Batch(
            self.ids[rows],
            self.attention[rows],
            self.loss_mask[rows],
            self.anchors[rows],
            self.valid[rows],
        )


def make_batch(dims: Dims, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, dims.vocab - 1, (dims.batch, dims.seq), generator=gen)
    attention = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, : dims.seq // 8] = 0  # a prompt: no anchors there
    drawn = sample_anchors(
        loss_mask, attention, block_size=dims.block, num_anchors=dims.anchors, generator=gen
    )
    return Batch(ids, attention, loss_mask, drawn.anchors, drawn.valid)


def inputs_for(model: PreTrainedModel, plan: RunPlan, batch: Batch) -> StepInputs:
    """The trainer's micro-step inputs (target forward included) on the model's device."""
    tokens = TokenBatch(
        batch.ids, batch.attention, batch.loss_mask, epoch=0, next_index=int(batch.ids.shape[0])
    )
    drawn = AnchorBatch(anchors=batch.anchors, valid=batch.valid)
    return step_inputs(model, plan.resolved_draft(), plan.draft.objective, tokens, drawn)


def bf16_plan(plan: RunPlan) -> RunPlan:
    """`plan` with a bf16 target: its step autocasts to bf16 on CUDA (float32 on the CPU)."""
    return attrs.evolve(plan, base_model=attrs.evolve(plan.base_model, dtype="bfloat16"))


# ---------------------------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------------------------


@dataclass
class Report:
    """The lines and verdict of one check."""

    name: str
    lines: list[str] = field(default_factory=list)
    failed: bool = False
    skipped: str | None = None
    inject: bool = False

    def note(self, text: str) -> None:
        self.lines.append(f"  {text}")

    def _reference(self, ref: Tensor) -> Tensor:
        if not self.inject:
            return ref
        self.inject = False  # only the first comparison gets the wrong reference
        return ref * 1.5 + 0.1

    def close(self, what: str, got: Tensor, ref: Tensor, *, atol: float, rtol: float) -> None:
        """Elementwise: |got - ref| <= atol + rtol * |ref| everywhere."""
        ref = self._reference(ref.detach().float().cpu())
        got = got.detach().float().cpu()
        if got.shape != ref.shape:
            self._line(what, False, f"shape {tuple(got.shape)} vs {tuple(ref.shape)}")
            return
        err = (got - ref).abs()
        ok = bool((err <= atol + rtol * ref.abs()).all()) and bool(torch.isfinite(got).all())
        worst = float(err.max()) if err.numel() else 0.0
        self._line(what, ok, f"max abs err {worst:.3g} (tolerance atol {atol:g} + rtol {rtol:g})")

    def rel(self, what: str, got: Tensor, ref: Tensor, *, tol: float) -> None:
        """Relative norm: ||got - ref|| <= tol * ||ref||."""
        ref = self._reference(ref.detach().float().cpu())
        got = got.detach().float().cpu()
        if got.shape != ref.shape:
            self._line(what, False, f"shape {tuple(got.shape)} vs {tuple(ref.shape)}")
            return
        value = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
        ok = math.isfinite(value) and value <= tol
        self._line(what, ok, f"relative error {value:.3g} (tolerance {tol:g}, norm-wise)")

    def grads(
        self,
        what: str,
        got: nn.Module,
        ref: nn.Module,
        *,
        tol: float,
        full: bool = False,
        outside: frozenset[str] = frozenset(),
    ) -> None:
        """Every parameter's gradient (or value, with `full`), norm-wise.

        Gradients are compared for exactly the parameters that get one in both graphs. Any other
        trainable parameter fails the line: one that gets a gradient in one graph only, and one
        that gets none in either unless the check's graph leaves it out by construction
        (`outside`, named in the line); a parameter of `outside` that does get a gradient fails
        too (the check's premise is wrong)."""
        ref_params = dict(ref.named_parameters())
        pairs = [(n, p, ref_params[n]) for n, p in got.named_parameters() if n in ref_params]
        if not pairs:
            self._line(what, False, "no parameters in common")
            return
        if full:
            compared = [(n, _full(p), _full(r)) for n, p, r in pairs]
        else:
            problems: list[str] = []
            compared = []
            for name, p, r in pairs:
                a, b = _full(p.grad), _full(r.grad)
                if a is not None and b is not None:
                    if name in outside:
                        problems.append(
                            f"{name} has a gradient, but the check's graph leaves it out"
                        )
                    compared.append((name, a, b))
                elif a is not None or b is not None:
                    side = "the reference" if a is None else "the tested graph"
                    problems.append(f"{name} has a gradient in {side} only")
                elif name not in outside and (p.requires_grad or r.requires_grad):
                    problems.append(f"{name} should get a gradient and gets none")
            if problems:
                self.inject = False
                self._line(what, False, "; ".join(problems))
                return
        inject = self.inject
        self.inject = False
        worst, worst_name = -1.0, ""
        for name, a, b in compared:
            assert a is not None and b is not None
            if inject:
                b, inject = b * 1.5 + 0.1, False
            value = float((a - b).norm() / b.norm().clamp_min(1e-30))
            if not math.isfinite(value):
                value = math.inf
            if value > worst:
                worst, worst_name = value, name
        ok = worst <= tol
        kind = "values" if full else "gradients"
        left_out = f"; not in the check's graph: {', '.join(sorted(outside))}" if outside else ""
        self._line(
            what,
            ok,
            f"{len(compared)} {kind}, worst relative error {worst:.3g} ({worst_name}; tolerance "
            f"{tol:g}, norm-wise per tensor){left_out}",
        )

    def _line(self, what: str, ok: bool, detail: str) -> None:
        self.failed |= not ok
        self.note(f"{'ok  ' if ok else 'BAD '} {what}: {detail}")


def _full(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    full_tensor = getattr(t, "full_tensor", None)  # a DTensor (FSDP2) -> the whole tensor
    value = full_tensor() if callable(full_tensor) else t
    assert isinstance(value, Tensor)
    return value.detach().float().cpu()


@dataclass(frozen=True)
class Setup:
    """What every check needs to know."""

    device: torch.device
    dry_run: bool
    inject: frozenset[str]
    workdir: Path
    check_dims: Dims
    steps: int
    peak_tflops: float
    ddp_world: int
    profile: bool = False
    profile_trace: Path | None = None


# ---------------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------------


def check_flex(setup: Setup, report: Report) -> None:
    dims = setup.check_dims
    device = setup.device
    if device.type == "cuda":
        report.note("flex_attention compiled with torch.compile (the CUDA path), 128x128 tiles")
        tile = (128, 128)
    else:
        report.note("dry run: eager flex_attention on the CPU (torch.compile is the CUDA path)")
        tile = (16, 16)
    # DFlash 2: convolutions in every layer (made non-identity below) and a non-causal
    # sliding layer next to a full one; its selector is not in the draft states' graph.
    dflash2 = {
        "projector_type": "dflash2",
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
        "layer_types": ("sliding_attention",) + ("full_attention",) * (dims.layers - 1),
        "sliding_window": dims.seq // 3,
    }
    variants: tuple[tuple[str, dict[str, object]], ...] = (
        ("no sinks", {}),
        ("with attention sinks", {"attention_sink": True}),
        ("dflash2, non-causal sliding layer", dflash2),
    )
    for label, changes in variants:
        sink = bool(changes.get("attention_sink"))
        plan = make_plan(dims, setup.workdir)
        plan = attrs.evolve(
            plan,
            draft=attrs.evolve(
                plan.draft,
                architecture=attrs.evolve(plan.draft.architecture, **changes),
            ),
        )
        drafter = DFlashDraftModel(
            plan.resolved_draft(), generator=torch.Generator().manual_seed(7)
        )
        outside: frozenset[str] = frozenset()
        if sink:
            with torch.no_grad():
                for layer in drafter.layers:
                    bias = layer.get_submodule("self_attn").attention_sink_bias
                    assert isinstance(bias, Tensor)
                    bias.copy_(torch.linspace(-2.0, 2.0, bias.numel()))
        if changes is dflash2:
            conv_gen = torch.Generator().manual_seed(8)
            with torch.no_grad():
                for name, param in drafter.named_parameters():
                    if "_conv." in name:
                        param.add_(0.1 * torch.randn(param.shape, generator=conv_gen))
            outside = frozenset(
                n for n, _ in drafter.named_parameters() if n.startswith("candidate_selector.")
            )
        batch = make_batch(dims, seed=11)
        gen = torch.Generator().manual_seed(12)
        q_len = batch.anchors.shape[1] * dims.block
        embeds = torch.randn(dims.batch, q_len, dims.hidden, generator=gen)
        # Raw taps, fused by the drafter as the trainer does: fc and hidden_norm are in the graph.
        taps = torch.randn(dims.batch, dims.seq, len(dims.taps) * dims.hidden, generator=gen)
        q_pos = block_positions(batch.anchors, dims.block)
        c_pos = torch.arange(dims.seq).expand(dims.batch, dims.seq)
        probe = torch.randn(dims.batch, q_len, dims.hidden, generator=gen)

        reference = copy.deepcopy(drafter)
        dense = build_dense_block_mask(batch.anchors, dims.block, dims.seq, batch.valid)
        ref_out = reference(embeds, reference.fuse_context(taps), q_pos, c_pos, dense)
        (ref_out * probe).sum().backward()

        tested = copy.deepcopy(drafter).to(device)
        mask = build_flex_block_mask(
            batch.anchors.to(device), dims.block, dims.seq, batch.valid.to(device), tile_size=tile
        )
        with warnings.catch_warnings(), torch.set_grad_enabled(device.type == "cuda"):
            warnings.simplefilter("ignore")  # eager flex_attention warns on the CPU
            context = tested.fuse_context(taps.to(device))
            out = tested(embeds.to(device), context, q_pos.to(device), c_pos.to(device), mask)
        report.close(f"draft states, {label}", out, ref_out, atol=1e-4, rtol=1e-3)
        if device.type == "cuda":
            (out * probe.to(device)).sum().backward()
            report.grads(
                f"drafter gradients, {label}", tested, reference, tol=1e-3, outside=outside
            )
        else:
            report.note(f"gradients, {label}: not checked (flex_attention has no CPU backward)")


def check_bf16(setup: Setup, report: Report) -> None:
    dims = setup.check_dims
    plan = make_plan(dims, setup.workdir)
    base = base_target(dims, plan, seed=21)
    batch = make_batch(dims, seed=23)
    report.note(
        f"one optimizer_step of a bf16 plan's step on {setup.device.type} (build_step: bf16 "
        "autocast on CUDA, none on the CPU) vs the float32 plan's on the CPU (target float32 on "
        "both sides)"
    )
    cpu = single_env(torch.device("cpu"))
    ref = train_step_for(plan, copy.deepcopy(base), cpu, drafter_seed=22)
    env = single_env(setup.device)
    tested = train_step_for(bf16_plan(plan), base, env, drafter_seed=22, like=ref)
    ref_out = optimizer_step(ref, [prepared_rows(ref, batch, next_index=dims.batch)], index=0)
    out = optimizer_step(tested, [prepared_rows(tested, batch, next_index=dims.batch)], index=0)
    report.rel("loss", out.loss, ref_out.loss, tol=2e-2)
    report.grads(
        "drafter gradients (clipped as the step clips them)",
        tested.models.drafter,
        ref.models.drafter,
        tol=1e-1,
    )


def check_chunked(setup: Setup, report: Report) -> None:
    dims = setup.check_dims
    plan = bf16_plan(make_plan(dims, setup.workdir))
    spec = plan.resolved_draft()
    base = base_target(dims, plan, seed=31)
    batch = make_batch(dims, seed=33)
    env = single_env(setup.device)
    budget = 3 * dims_logits_per_block(dims, spec.vocab_size)
    whole = train_step_for(plan, copy.deepcopy(base), env, drafter_seed=32)
    chunked = train_step_for(plan, base, env, drafter_seed=32, max_chunk_logits=budget, like=whole)
    module = chunked.models.step
    assert isinstance(module, DraftStep)
    prepared = prepared_rows(chunked, batch, next_index=dims.batch)
    n_blocks = int(prepared.drawn.anchors.shape[1])
    per_chunk = module.blocks_per_chunk(dims.batch, n_blocks)
    chunks = -(-n_blocks // per_chunk)
    report.note(
        f"max_chunk_logits {budget}: {chunks} chunks of {per_chunk} blocks vs one, both one "
        "optimizer_step under the bf16 plan's autocast (none on the CPU)"
    )
    if chunks < 2:
        report.note("BAD  the budget does not split the blocks into chunks")
        report.failed = True
        return
    ref_out = optimizer_step(whole, [prepared_rows(whole, batch, next_index=dims.batch)], index=0)
    out = optimizer_step(chunked, [prepared], index=0)
    report.rel("loss", out.loss, ref_out.loss, tol=1e-3)
    report.close(
        "per-position correct counts",
        loss_of(out).per_position_correct,
        loss_of(ref_out).per_position_correct,
        atol=1,
        rtol=0,
    )
    report.grads("drafter gradients", chunked.models.drafter, whole.models.drafter, tol=1e-2)


def dims_logits_per_block(dims: Dims, vocab: int) -> int:
    return dims.batch * dims.block * vocab


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _dist_worker(
    rank: int, world: int, port: int, setup: Setup, which: str, queue: mp.Queue[object]
) -> None:
    """One rank of the ``nccl`` or ``fsdp`` check; puts (rank, lines, failed) on `queue`."""
    report = Report(which, inject=which in setup.inject and rank == 0)
    try:
        if setup.device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        env = DistEnv(
            rank=rank,
            world_size=world,
            local_rank=rank,
            is_distributed=True,
            backend="nccl" if device.type == "cuda" else "gloo",
            device=device,
        )
        variables = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
        }
        with _env(variables):
            init_distributed(env)
        try:
            if which == "nccl":
                _ddp_rank(setup, env, report)
            else:
                _fsdp_rank(setup, env, report)
        finally:
            shutdown_distributed()
    except Exception as exc:  # a rank's failure is the check's FAIL, with its traceback
        report.failed = True
        report.note(f"BAD  rank {rank}: {type(exc).__name__}: {exc}")
        report.lines.extend("    " + line for line in traceback.format_exc().splitlines()[-8:])
    queue.put((rank, report.lines, report.failed))


def _ddp_rank(setup: Setup, env: DistEnv, report: Report) -> None:
    world, rank, device = env.world_size, env.rank, env.device
    summed = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(summed)
    expected = torch.full((4,), world * (world + 1) / 2)
    report.close(
        f"all_reduce over {world} rank(s) ({env.backend})", summed, expected, atol=0, rtol=0
    )

    dims = dataclasses.replace(setup.check_dims, batch=2 * world) if world > 1 else setup.check_dims
    plan = make_plan(dims, setup.workdir)
    base = base_target(dims, plan, seed=41)
    batch = make_batch(dims, seed=43)
    # One process on the whole batch, and the ranks' step (build_step: DDP-wrapped, the loss
    # normalised by the global weight sum) on their rows, from the same weights.
    reference = train_step_for(plan, copy.deepcopy(base), single_env(device), drafter_seed=42)
    step = train_step_for(plan, base, env, drafter_seed=42, like=reference)
    optimizer_step(reference, [prepared_rows(reference, batch, next_index=dims.batch)], index=0)
    share = dims.batch // world
    mine = batch.rows(rank * share, (rank + 1) * share)
    optimizer_step(step, [prepared_rows(step, mine, next_index=dims.batch)], index=0)
    report.grads(
        f"DDP gradients ({world} rank(s), {share} row(s) each; one optimizer_step of build_step's "
        "step) vs one process, whole batch",
        step.models.drafter,
        reference.models.drafter,
        tol=1e-4,
    )


def _fsdp_rank(setup: Setup, env: DistEnv, report: Report) -> None:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2 is there)
    except ImportError as exc:
        report.note(f"BAD  FSDP2 is not available in torch {torch.__version__}: {exc}")
        report.failed = True
        return
    device, world, rank = env.device, env.world_size, env.rank
    dims = dataclasses.replace(setup.check_dims, batch=2 * world) if world > 1 else setup.check_dims
    plan = make_plan(dims, setup.workdir)
    base = base_target(dims, plan, seed=51)
    rows = make_batch(dims, seed=53)
    batch = rows.to(device)
    spec = plan.resolved_draft()

    plain = _moved(copy.deepcopy(base), device)
    # What training.fsdp builds: the target sharded (shard_target_fsdp2), then the drafter
    # (shard_drafter_fsdp2) with the optimizer over its shards.
    fsdp_plan = attrs.evolve(plan, training=attrs.evolve(plan.training, fsdp=True))
    fsdp_step = train_step_for(fsdp_plan, copy.deepcopy(base), env, drafter_seed=52)
    sharded = fsdp_step.models.target
    # The reference: the unsharded target's Hugging Face hidden states (output_hidden_states).
    with torch.no_grad():
        states = plain(
            input_ids=batch.ids, attention_mask=batch.attention, output_hidden_states=True
        )
        expected = taps_from_hidden_states(states.hidden_states, spec.target_layer_ids).float()
    # The trainer's own path on the sharded target: step_inputs (forward hooks on the taps,
    # the forward stopped after the deepest one: target_states), as training.fsdp runs it.
    stop = stop_after_layer(spec.target_layer_ids, needs_logits=False)
    report.note(
        f"taps {list(spec.target_layer_ids)} of {dims.target_layers} layers: the trainer's "
        f"forward stops after layer {stop}"
    )
    tapped = inputs_for(sharded, plan, batch).tapped
    report.close(
        f"target taps, step_inputs on shard_target_fsdp2 over {world} rank(s) (the trainer's "
        "hooks, stopped after the deepest tap) vs the plain target's hidden states",
        tapped,
        expected,
        atol=1e-5,
        rtol=1e-5,
    )
    # A teacher objective's path (logits wanted: the whole causal LM, taps by the same hooks).
    taps = spec.target_layer_ids
    with torch.no_grad():
        teacher = target_states(sharded, batch.ids, batch.attention, taps, with_logits=True)
    report.close(
        "target taps, the whole causal LM on the sharded target (a teacher objective's path) "
        "vs plain",
        teacher.tapped,
        expected,
        atol=1e-5,
        rtol=1e-5,
    )

    # One optimizer_step of the sharded step (each rank its rows) against the plain step of one
    # process on the whole batch, from the same initial drafter (the same seed).
    reference = train_step_for(plan, base, single_env(device), drafter_seed=52)
    reference.models.drafter.load_state_dict(
        {k: _full(v) for k, v in fsdp_step.models.drafter.state_dict().items()}
    )
    ref_out = optimizer_step(
        reference, [prepared_rows(reference, rows, next_index=dims.batch)], index=0
    )
    share = dims.batch // world
    mine = rows.rows(rank * share, (rank + 1) * share)
    prepared = prepared_rows(fsdp_step, mine, next_index=dims.batch)
    out = optimizer_step(fsdp_step, [prepared], index=0)
    # The global batch's loss: the ranks' weighted means, weighted by their weight sums.
    result = loss_of(out)
    pooled = torch.stack([result.loss.detach() * result.weight_sum, result.weight_sum.float()])
    dist.all_reduce(pooled)
    report.close(
        f"drafter loss, shard_drafter_fsdp2 vs plain (build_step with training.fsdp, {share} "
        "row(s) per rank, one optimizer_step; the ranks' loss pooled)",
        pooled[0] / pooled[1],
        ref_out.loss,
        atol=1e-5,
        rtol=1e-5,
    )
    report.grads(
        "drafter after one optimizer_step (AdamW), shard_drafter_fsdp2 vs plain",
        fsdp_step.models.drafter,
        reference.models.drafter,
        tol=1e-5,
        full=True,
    )


def _distributed_check(setup: Setup, report: Report, which: str) -> None:
    world = setup.ddp_world
    if setup.device.type == "cuda":
        world = min(world, torch.cuda.device_count())
        if world < 2:
            report.note(
                f"{torch.cuda.device_count()} GPU: a 1-rank NCCL group (2 ranks need 2 GPUs)"
            )
    else:
        report.note(f"dry run: gloo on the CPU, {world} process(es) (NCCL needs CUDA)")
    ctx = mp.get_context("spawn")
    queue: mp.Queue[object] = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_dist_worker, args=(rank, world, port, setup, which, queue))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[list[str], bool]] = {}
    deadline = time.monotonic() + 240
    while len(results) < world and time.monotonic() < deadline:
        try:
            item = queue.get(timeout=1.0)
        except Exception:  # queue.Empty: poll for dead workers
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            continue
        assert isinstance(item, tuple)
        results[int(item[0])] = (list(item[1]), bool(item[2]))
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    for rank in range(world):
        if rank not in results:
            report.failed = True
            code = procs[rank].exitcode
            report.note(f"BAD  rank {rank} gave no result (exit code {code}, or timed out)")
            continue
        lines, failed = results[rank]
        report.failed |= failed
        if rank == 0 or failed:
            report.lines.extend(lines if rank == 0 else [f"  rank {rank}:", *lines])


def check_nccl(setup: Setup, report: Report) -> None:
    _distributed_check(setup, report, "nccl")


def check_fsdp(setup: Setup, report: Report) -> None:
    _distributed_check(setup, report, "fsdp")


def model_flops(dims: Dims, anchors: Tensor, valid: Tensor) -> tuple[float, str]:
    """Model FLOPs of one training step (frozen target forward + drafter forward/backward)."""
    h, t, b = dims.hidden, dims.seq, dims.batch
    attn = dims.heads * dims.head_dim
    kv = dims.kv_heads * dims.head_dim
    n_valid = int(valid.sum())
    q = n_valid * dims.block  # drafted positions in the batch
    layer_params_per_token = h * (attn + 2 * kv) + attn * h + 3 * h * dims.intermediate
    target = 2 * b * t * dims.target_layers * layer_params_per_token
    target += 2 * b * dims.target_layers * t * t * attn  # causal QK^T + AV: 4*T^2*d / 2
    # Keys a drafted query attends to: its anchor's visible context plus its own block.
    pairs = float((anchors.clamp(max=t) * valid).sum()) * dims.block + q * dims.block
    draft_fwd = (
        2 * b * t * len(dims.taps) * h * h  # fc over the context
        + 2 * dims.layers * (q * h * 2 * attn + (b * t + q) * h * 2 * kv)  # q, o / k, v
        + 2 * dims.layers * q * 3 * h * dims.intermediate  # MLP
        + 4 * dims.layers * pairs * attn  # QK^T + AV over visible keys
    )
    head = 2 * q * h * dims.vocab  # the frozen lm_head
    total = target + 3 * draft_fwd + 2 * head
    formula = (
        "target forward 2*B*T*L_t*P_layer + 2*B*L_t*T^2*d_attn (causal) + drafter 3x forward "
        "(fc 2*B*T*taps*H^2, projections, MLP 6*Q*H*I per layer, attention 4*d_attn per visible "
        "query-key pair) + frozen lm_head 2x forward (2*Q*H*V: input gradient only); "
        "checkpoint recomputation not counted"
    )
    return float(total), formula


def check_step(setup: Setup, report: Report) -> None:
    device = setup.device
    dims = TINY_STEP_DIMS if setup.dry_run else QWEN3_8B_DIMS
    plan = bf16_plan(make_plan(dims, setup.workdir))
    # the index runs past the tiny recipe's 60 steps with --steps and --profile
    plan = attrs.evolve(plan, training=attrs.evolve(plan.training, max_steps=100_000))
    torch.manual_seed(61)
    with torch.device(device):
        base = Qwen3ForCausalLM(target_config(dims, plan))
    nn.Module.to(base, torch.bfloat16)
    # What run builds (build_step): the drafter in float32 master weights, the step sized for
    # the device's memory, the plan's AdamW and schedule, bf16 autocast on CUDA.
    step = build_step(plan, env=single_env(device), target=base, skip_memory_check=True)
    step.models.training_modes()
    model, drafter = step.models.target, step.models.drafter
    report.note(
        f"drafter {dims.layers} layers x {dims.hidden} ({dims.heads} heads / {dims.kv_heads} kv x "
        f"{dims.head_dim}, intermediate {dims.intermediate}, {len(dims.taps)} taps), vocab "
        f"{dims.vocab}, block {dims.block}; target {dims.target_layers} layers x {dims.hidden} "
        f"in bf16; {dims.batch} x {dims.seq} tokens, {dims.anchors} anchors; drafter float32 "
        "master weights under bf16 autocast (CUDA), AdamW: build_step, prepare_rows, "
        "optimizer_step"
    )
    batch = make_batch(dims, seed=63)
    # prepared once: run prepares each batch on its prefetch thread, beside the steps
    prepared = prepared_rows(step, batch, next_index=dims.batch)
    drawn = prepared.drawn
    done = [0]
    clock: list[Callable[[str], None]] = []
    _hook_phases(step, clock)

    def one_step(mark: Callable[[str], None] = lambda _phase: None) -> float:
        """One training step of ``run``; `mark` is called at the end of each of
        :data:`PHASES` (by the hooks, and at the end of the step)."""
        clock.append(mark)
        try:
            out = optimizer_step(step, [prepared], index=done[0])
            mark(PHASES[3])
        finally:
            clock.pop()
        done[0] += 1
        return float(out.loss)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    started = time.perf_counter()
    first = one_step()  # compiles the flex kernels on CUDA
    sync()
    report.note(
        f"first step (compiles on CUDA): {time.perf_counter() - started:.1f} s, loss {first:.4f}"
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    loss = first
    for _ in range(setup.steps):
        started = time.perf_counter()
        loss = one_step()
        sync()
        times.append(time.perf_counter() - started)
    if not math.isfinite(loss):
        report.note(f"BAD  loss is {loss}")
        report.failed = True
    seconds = sorted(times)[len(times) // 2]
    tokens = dims.batch * dims.seq
    drafted = int(drawn.valid.sum()) * dims.block
    flops, formula = model_flops(dims, drawn.anchors, drawn.valid)
    report.note(
        f"median step {seconds * 1000:.1f} ms over {setup.steps} steps: {tokens / seconds:,.0f} "
        f"target tokens/s, {drafted / seconds:,.0f} drafted tokens/s, loss {loss:.4f}"
    )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        report.note(f"peak memory (torch.cuda.max_memory_allocated): {peak:.2f} GiB")
        mfu = flops / seconds / (setup.peak_tflops * 1e12)
        report.note(
            f"model FLOPs {flops / 1e12:.2f} TFLOP/step, {flops / seconds / 1e12:.1f} TFLOP/s: "
            f"MFU {100 * mfu:.1f}% of {setup.peak_tflops:g} TFLOP/s (--peak-tflops)"
        )
    else:
        report.note(
            f"model FLOPs {flops / 1e9:.3f} GFLOP/step (dry run: no peak memory or MFU on the CPU)"
        )
    report.note(f"FLOPs formula: {formula}")
    peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    device_bytes = (
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    )
    optimizer = step.optimization.optimizer
    compare_memory(plan, dims, model, drafter, optimizer, peak_bytes, report, device_bytes)
    if setup.profile:
        profile_step(one_step, device, setup.steps, report, trace=setup.profile_trace)


#: The phases of a training step that ``--profile`` times, in order.
PHASES = (
    "target forward + masks",
    "drafter + head forward",
    "backward",
    "optimizer (clip + AdamW)",
)
#: Rows of the profiler's table that ``--profile`` prints.
PROFILE_ROWS = 25


def _hook_phases(step: TrainStep, clock: list[Callable[[str], None]]) -> None:
    """Mark the phase ends of `step`'s optimiser steps on the innermost of `clock` (when there
    is one), by hooks that leave the step itself as it is: the step module's forward starts
    (the target forward and masks end) and ends (the drafter and head forward end), and each
    gradient accumulated (the last one ends the backward)."""

    def mark(phase: str) -> None:
        if clock:
            clock[-1](phase)

    models = step.models
    models.step.register_forward_pre_hook(lambda _module, _args: mark(PHASES[0]))
    models.step.register_forward_hook(lambda _module, _args, _out: mark(PHASES[1]))
    for param in models.trainable:
        param.register_post_accumulate_grad_hook(lambda _param: mark(PHASES[2]))  # type: ignore[no-untyped-call]


class _PhaseClock:
    """The ends of a step's phases: CUDA events on CUDA (read after a synchronize), the host
    clock on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.start = self._now()
        self.marks: list[tuple[str, torch.cuda.Event | float]] = []

    def _now(self) -> torch.cuda.Event | float:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def mark(self, phase: str) -> None:
        """The end of `phase` now; marked again before the next phase: the later end."""
        if self.marks and self.marks[-1][0] == phase:
            self.marks.pop()
        self.marks.append((phase, self._now()))

    def durations_ms(self) -> list[tuple[str, float]]:
        out, previous = [], self.start
        for phase, at in self.marks:
            if isinstance(previous, float) and isinstance(at, float):
                out.append((phase, (at - previous) * 1000))
            else:
                assert isinstance(previous, torch.cuda.Event) and isinstance(at, torch.cuda.Event)
                out.append((phase, float(previous.elapsed_time(at))))
            previous = at
        return out


def profile_step(
    one_step: Callable[[Callable[[str], None]], float],
    device: torch.device,
    steps: int,
    report: Report,
    *,
    trace: Path | None = None,
) -> None:
    """``--profile``: each phase of `steps` training steps timed (CUDA events recorded at the
    phase ends, one synchronize per step, in this mode only; the host clock on the CPU), their
    medians printed, then ``torch.profiler``'s ``key_averages`` table of `steps` more steps
    (sorted by self CUDA time on CUDA: the top kernels; by self CPU time on the CPU), and the
    profiler's Chrome trace written to `trace` when given."""
    cuda = device.type == "cuda"
    per_phase: dict[str, list[float]] = {name: [] for name in PHASES}
    totals: list[float] = []
    for _ in range(steps):
        clock = _PhaseClock(cuda)
        one_step(clock.mark)
        if cuda:
            torch.cuda.synchronize(device)
        for name, ms in clock.durations_ms():
            per_phase[name].append(ms)
        totals.append(sum(ms for _, ms in clock.durations_ms()))
    how = "CUDA events, a synchronize after each step" if cuda else "host clock"
    medians = ", ".join(
        f"{name} {sorted(ms)[len(ms) // 2]:.1f} ms" for name, ms in per_phase.items()
    )
    report.note(
        f"profile: per phase, median of {steps} step(s) ({how}): {medians}; step "
        f"{sorted(totals)[len(totals) // 2]:.1f} ms"
    )
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            one_step(lambda _phase: None)
        if cuda:
            torch.cuda.synchronize(device)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    what = "CUDA kernels and ops by self CUDA time" if cuda else "CPU ops by self CPU time"
    report.note(f"profile: torch.profiler over {steps} step(s), top {PROFILE_ROWS} {what}:")
    table = prof.key_averages().table(
        sort_by=sort, row_limit=PROFILE_ROWS, max_name_column_width=70
    )
    report.lines.extend("    " + line for line in table.splitlines())
    if trace is not None:
        prof.export_chrome_trace(str(trace))
        report.note(f"profile: Chrome trace written to {trace}")


#: The activation estimate's tolerance against a measured step.
MEMORY_TOLERANCE = 0.10  # issue 34: the estimate within 10% of max_memory_allocated


def compare_memory(
    plan: RunPlan,
    dims: Dims,
    model: nn.Module,
    drafter: nn.Module,
    optimizer: torch.optim.Optimizer,
    peak_bytes: int | None,
    report: Report,
    device_bytes: int | None = None,
) -> None:
    """The resource plan of the step's shape against the built modules and the measured peak
    (`peak_bytes`, None in a dry run). On CUDA the plan's lm_head/loss chunk is sized from the
    device's memory (`device_bytes`), as `run`'s memory check and the step itself size it."""
    training = attrs.evolve(
        plan.training, per_device_train_batch_size=dims.batch, training_seq_len=dims.seq
    )
    sized = attrs.evolve(plan, training=training)
    config = target_config(dims, plan).to_dict()
    estimate = estimate_resources(
        sized,
        world_size=1,
        device="cuda",
        target=target_dims(config),
        device_bytes=device_bytes,
    )
    memory = estimate.memory
    drafter_ids = {id(p) for p in drafter.parameters()}
    target_bytes = sum(
        p.numel() * p.element_size() for p in model.parameters() if id(p) not in drafter_ids
    )
    drafter_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())
    moments = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for k, v in state.items()
        if k != "step" and isinstance(v, Tensor)
    )
    for what, est, real in (
        ("target weights", memory.target_weights, target_bytes),
        ("drafter weights", memory.drafter_weights, drafter_bytes),
        # the estimate counts 4 bytes of step counter per tensor: not a moment
        ("AdamW moments", memory.optimizer_states - 4 * len(optimizer.state), moments),
    ):
        ok = est == real
        report.note(
            f"{'ok  ' if ok else 'BAD '} estimate {what}: {est:,} bytes, built {real:,} bytes "
            "(exact)"
        )
        report.failed |= not ok
    if peak_bytes is None:
        report.note("memory estimate vs max_memory_allocated: dry run, not measured")
        return
    expected = memory.total - memory.allowance
    ratio = expected / peak_bytes
    ok = abs(ratio - 1) <= MEMORY_TOLERANCE
    parts = estimate.activation_parts
    gib = 2**30
    split = (
        f"activations {memory.activations / gib:.2f}: target forward "
        f"{parts.target_forward_peak / gib:.2f}, drafter saved {parts.drafter_saved / gib:.2f}, "
        f"loss peak {parts.loss_peak / gib:.2f}"
    )
    report.note(
        f"{'ok  ' if ok else 'BAD '} memory estimate {expected / gib:.2f} GiB (without the "
        f"{memory.allowance / gib:.2f} GiB allowance; {split}) vs max_memory_allocated "
        f"{peak_bytes / gib:.2f} GiB: ratio {ratio:.3f} (tolerance +-{MEMORY_TOLERANCE:.0%})"
    )
    report.failed |= not ok


#: The eval check's tolerance: the device's pooled tau against the CPU's, relative.
EVAL_TAU_TOLERANCE = 0.10


def check_eval(setup: Setup, report: Report) -> None:
    """KV-cached verification (``evaluate_acceptance``: the product's eval loop) of the shipped
    tiny target in bf16 with a float32 drafter on the device, against both in float32 on the
    CPU."""
    device = setup.device
    result = compile_file(
        REPO / "recipes" / "tiny" / "tiny_released.yaml",
        overrides=(f"training.output_dir={setup.workdir / 'eval-run'}",),
    )
    if result.plan is None:
        msg = f"cannot compile recipes/tiny/tiny_released.yaml: {result.diagnostics}"
        raise RuntimeError(msg)
    plan = result.plan
    spec = plan.resolved_draft()
    reference = load_base_model(plan)  # float32, CPU
    drafter = DFlashDraftModel(spec, generator=torch.Generator().manual_seed(71))
    n_prompts, new_tokens = (4, 24) if setup.dry_run else (8, 192)
    gen = torch.Generator().manual_seed(73)
    vocab = int(reference.config.vocab_size)
    prompts = [
        torch.randint(3, vocab - 10, (12 + 4 * k,), generator=gen).tolist()
        for k in range(n_prompts)
    ]
    tested = copy.deepcopy(reference)
    nn.Module.to(tested, device=device, dtype=torch.bfloat16)
    tested_drafter = copy.deepcopy(drafter).to(device)
    report.note(
        f"the shipped tiny target ({reference.config.num_hidden_layers} layers x "
        f"{reference.config.hidden_size}), a random float32 drafter (block {spec.block_size}); "
        f"{n_prompts} prompts x {new_tokens} new tokens, batch {n_prompts}: bf16 target on "
        f"{device.type} vs float32 on the CPU"
    )

    def measure(target: PreTrainedModel, module: nn.Module) -> AcceptanceReport:
        return evaluate_acceptance(
            target,
            module,
            spec,
            prompts,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            batch_size=n_prompts,
        )

    ref = measure(reference, drafter)
    # CUDA context and kernels warm before the timed run
    evaluate_acceptance(
        tested, tested_drafter, spec, prompts[:1], max_new_tokens=4, eos_token_id=None
    )
    got = measure(tested, tested_drafter)
    ok_ref = ref.lossless
    report.note(
        f"{'ok  ' if ok_ref else 'BAD '} float32 CPU: tau {ref.tau:.3f} over {ref.steps} "
        f"verification steps, output equal to greedy decoding: {ref.lossless}"
    )
    report.failed |= not ok_ref
    ref_tau = ref.tau
    if report.inject:  # the suite's wrong reference
        ref_tau, report.inject = ref_tau * 1.5 + 0.1, False
    gap = abs(got.tau - ref_tau) / ref_tau if ref_tau else math.inf
    ok = gap <= EVAL_TAU_TOLERANCE and got.steps > 0
    report.note(
        f"{'ok  ' if ok else 'BAD '} bf16 target on {device.type}: tau {got.tau:.3f} over "
        f"{got.steps} steps vs {ref_tau:.3f} on the CPU: relative gap {gap:.3g} (tolerance "
        f"{EVAL_TAU_TOLERANCE:g}); output equal to its own greedy decoding: {got.lossless} "
        "(bf16 near-ties may differ between the cached and the whole forward: not failed)"
    )
    report.failed |= not ok
    # Per prompt: the same tokens, and the same accepted length at every verification step?
    runs = [
        speculative_generate_batch(
            target, module, spec, prompts, max_new_tokens=new_tokens, eos_token_id=None
        )
        for target, module in ((reference, drafter), (tested, tested_drafter))
    ]
    same_tokens = sum(a.tokens == b.tokens for a, b in zip(*runs, strict=True))
    same_taus = sum(a.accepted_per_step == b.accepted_per_step for a, b in zip(*runs, strict=True))
    report.note(
        f"per prompt: {same_tokens} of {n_prompts} with the CPU's tokens, {same_taus} of "
        f"{n_prompts} with its accepted length at every step (bf16 may flip a near-tied "
        "argmax: reported, not failed)"
    )
    report.note(
        f"tokens/s: {got.tokens_per_second:,.0f} on {device.type} (bf16 target), "
        f"{ref.tokens_per_second:,.0f} on the CPU (float32); {got.tokens} tokens each"
    )
    # Sampled verification (eval --temperature): its draws (a generator on the device, the
    # inverse-CDF draw, the rejection rule) run there; the CPU's draws are another stream, so
    # only the range and the length are checked.
    sampled = evaluate_acceptance(
        tested, tested_drafter, spec, prompts, max_new_tokens=new_tokens, eos_token_id=None,
        batch_size=n_prompts, sampling=Sampling(temperature=1.0, seed=0),
    )  # fmt: skip
    ok_sampled = (
        1.0 <= sampled.tau <= spec.drafted_tokens + 1
        and sampled.tokens == n_prompts * new_tokens
        and sampled.lossless is None
    )
    report.note(
        f"{'ok  ' if ok_sampled else 'BAD '} sampled at temperature 1 on {device.type}: tau "
        f"{sampled.tau:.3f} over {sampled.steps} steps, {sampled.tokens} tokens, "
        f"{sampled.tokens_per_second:,.0f} tokens/s"
    )
    report.failed |= not ok_sampled


#: The run check's recipe, resized small: 2 steps of 1 sequence x 64 tokens, 4 blocks of 4.
RUN_OVERRIDES = (
    "training.max_steps=2",
    "training.per_device_train_batch_size=1",
    "training.training_seq_len=64",
    "training.logging_steps=1",
    "dflash.dflash_num_anchors=4",
    "dflash.dflash_block_size=4",
)


#: Families whose layers packing must keep apart by something else than one causal mask:
#: (name, transformers config class, its own settings), each window or chunk 16 tokens.
_PACKING_FAMILIES: tuple[tuple[str, str, dict[str, object]], ...] = (
    ("gemma3_text", "Gemma3TextConfig", {"sliding_window": 16, "num_hidden_layers": 6}),
    (
        "gpt_oss",
        "GptOssConfig",
        {"sliding_window": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    (
        "llama4_text",
        "Llama4TextConfig",
        {"attention_chunk_size": 16, "num_local_experts": 4, "intermediate_size_mlp": 512},
    ),
)


def check_packing(setup: Setup, report: Report) -> None:
    """Packed rows against each document alone, on the device in bf16, for windowed, eager and
    chunked targets; then the run-start check itself."""
    import transformers
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if setup.dry_run else torch.bfloat16
    tolerance = ISOLATION_TOLERANCE[dtype]
    report.note(f"target dtype {dtype}, tolerance {tolerance:g} (the run-start check's)")
    width = 64 if setup.dry_run else 512
    ran = 0
    for name, class_name, own in _PACKING_FAMILIES:
        config_class = getattr(transformers, class_name, None)
        if config_class is None:
            report.note(f"{name}: skipped, transformers {transformers.__version__} lacks it")
            continue
        config = config_class(
            **{
                "vocab_size": 1024,
                "hidden_size": width,
                "intermediate_size": 2 * width,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": width // 8,
                "max_position_embeddings": 4096,
                "pad_token_id": 0,
                "eos_token_id": 2,
                "bos_token_id": None,
                **own,
            }
        )
        torch.manual_seed(81)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(setup.device).eval()
        last = len(decoder_layers(model)) - 1
        lengths = (40, 29)  # both past the 16-token windows and chunks
        gen = torch.Generator().manual_seed(83)
        docs = [torch.randint(3, 1000, (1, n), generator=gen).to(setup.device) for n in lengths]
        document_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1).to(
            setup.device
        )
        with torch.no_grad():
            packed = target_states(
                model,
                torch.cat(docs, dim=1),
                None,
                [0, last],
                with_logits=True,
                document_ids=document_ids,
            )
            start = 0
            for number, ids in enumerate(docs):
                alone = target_states(model, ids, torch.ones_like(ids), [0, last], with_logits=True)
                part = slice(start, start + ids.shape[1])
                report.rel(
                    f"{name} ({config._attn_implementation}) document {number + 1}: taps",
                    packed.tapped[:, part],
                    alone.tapped,
                    tol=tolerance,
                )
                assert packed.logits is not None and alone.logits is not None
                report.rel(
                    f"{name} document {number + 1}: logits",
                    packed.logits[:, part],
                    alone.logits,
                    tol=tolerance,
                )
                start += ids.shape[1]
        try:
            line = check_packed_isolation(model, [0, last], with_logits=True).describe()
            report.note(f"{name}: {line}")
        except PlanError as exc:
            report._line(f"{name}: check_packed_isolation", False, str(exc))
        ran += 1
        del model
    if not ran:
        report.skipped = "no packing family in this transformers"


def check_run(setup: Setup, report: Report) -> None:
    """``dflash-recipe run`` end to end through ``--nproc-per-node 1`` (torchrun: NCCL on CUDA,
    gloo in a dry run) on the tiny from-scratch recipe: it completes and writes an export."""
    out = setup.workdir / "run-check"
    device = "cuda" if setup.device.type == "cuda" else "cpu"
    argv = [
        sys.executable,
        "-m",
        "dflash_recipes",
        "run",
        str(REPO / "recipes" / "tiny" / "tiny_scratch.yaml"),
        f"training.output_dir={out}",
        f"training.device={device}",
        *RUN_OVERRIDES,
        "--nproc-per-node",
        "1",
        "--no-progress",
    ]
    report.note(
        f"dflash-recipe run recipes/tiny/tiny_scratch.yaml training.device={device} "
        f"{' '.join(RUN_OVERRIDES)} --nproc-per-node 1"
    )
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    started = time.perf_counter()
    done = subprocess.run(
        argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    seconds = time.perf_counter() - started
    lines = done.stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    finished = done.returncode == 0 and last.startswith("done: 2 steps")
    report.note(
        f"{'ok  ' if finished else 'BAD '} exit code {done.returncode} after {seconds:.1f} s; "
        f"last line: {last[:160]!r}"
    )
    report.failed |= not finished
    if not finished:
        report.lines.extend(
            "    " + line for line in (done.stdout + done.stderr).splitlines()[-12:]
        )
    export = out / "export"
    if report.inject:  # the suite's wrong reference: look for an export where there is none
        export, report.inject = out / "no-export", False
    written = [name for name in ("model.safetensors", "config.json") if (export / name).is_file()]
    ok = len(written) == 2
    report.note(
        f"{'ok  ' if ok else 'BAD '} export {export}: "
        + (", ".join(written) if written else "nothing written")
    )
    report.failed |= not ok


CHECK_FUNCTIONS: dict[str, Callable[[Setup, Report], None]] = {
    "flex": check_flex,
    "bf16": check_bf16,
    "chunked": check_chunked,
    "nccl": check_nccl,
    "fsdp": check_fsdp,
    "step": check_step,
    "eval": check_eval,
    "packing": check_packing,
    "run": check_run,
}


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every check on the CPU, tiny")
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    parser.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="step: time each phase of the step and print torch.profiler's top kernels/ops",
    )
    parser.add_argument(
        "--profile-trace", type=Path, default=None, help="with --profile: write the Chrome trace"
    )
    parser.add_argument(
        "--ddp-world",
        type=int,
        default=None,
        help="ranks of the nccl/fsdp checks (default 2, at most the GPUs; 1 in a dry run, where "
        "more are gloo processes on the CPU)",
    )
    # For the test suite: make the named checks compare against a wrong reference.
    parser.add_argument(
        "--inject-mismatch", nargs="+", choices=CHECKS, default=[], help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.ddp_world is None:
        args.ddp_world = 1 if args.dry_run else 2
    if args.steps < 1 or args.ddp_world < 1 or args.peak_tflops <= 0:
        parser.error("--steps and --ddp-world must be >= 1 and --peak-tflops > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); run it "
            "on a GPU machine, or with --dry-run to exercise every check on the CPU",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    if device.type == "cuda":
        # Float32 references mean float32: no TF32 in the checks' matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    print(
        f"gpu_check: torch {torch.__version__}, device "
        + (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)")
    )
    started = time.perf_counter()
    verdicts: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        setup = Setup(
            device=device,
            dry_run=args.dry_run,
            inject=frozenset(args.inject_mismatch),
            workdir=Path(tmp),
            check_dims=TINY_DIMS if args.dry_run else CHECK_DIMS,
            steps=args.steps,
            peak_tflops=args.peak_tflops,
            ddp_world=args.ddp_world,
            profile=args.profile,
            profile_trace=args.profile_trace,
        )
        for name in CHECKS:
            if name not in args.only:
                continue
            report = Report(name, inject=name in setup.inject)
            print(f"== {name}", flush=True)
            check_started = time.perf_counter()
            try:
                CHECK_FUNCTIONS[name](setup, report)
            except Exception as exc:  # a crashing check is a FAIL; the others still run
                report.failed = True
                report.note(f"BAD  {type(exc).__name__}: {exc}")
                report.lines.extend(
                    "    " + line for line in traceback.format_exc().splitlines()[-8:]
                )
            verdict = "SKIP" if report.skipped else ("FAIL" if report.failed else "PASS")
            for line in report.lines:
                print(line)
            reason = f": {report.skipped}" if report.skipped else ""
            print(
                f"{verdict} {name} ({time.perf_counter() - check_started:.1f} s){reason}",
                flush=True,
            )
            verdicts.append((name, verdict))
    failed = [name for name, verdict in verdicts if verdict == "FAIL"]
    summary = ", ".join(f"{name} {verdict}" for name, verdict in verdicts)
    print(f"== summary ({time.perf_counter() - started:.0f} s): {summary}")
    if failed:
        print(f"gpu_check: {len(failed)} check(s) failed: {', '.join(failed)}")
        return 1
    print("gpu_check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
