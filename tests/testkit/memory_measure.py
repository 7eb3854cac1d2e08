"""One real CPU training step measured part by part, for comparison with the compile-time memory
estimate (:mod:`dflash_recipes.plan.resources.estimate`): the shared core of
``benchmarks/bench_memory.py`` and ``tests/executor/training/test_memory_measured.py``.

:func:`measured_step` builds the trainer's modules from a plan (the converted target, the
float32 drafter, ``DraftStep``, the trainer's AdamW), runs one step so that the gradients and
AdamW's states exist as in every later step, then measures a second micro-step:

- ``saved``: the bytes autograd saves for backward during the drafter's forward (counted by
  ``torch.autograd.graph.saved_tensors_hooks`` once per storage, parameters excluded), plus the
  step's inputs. Under activation checkpointing the layers' inputs are kept by the checkpoint,
  not by autograd's hooks: compare ``peak`` there.
- ``peak``: the peak of the bytes allocated during the whole micro-step (target forward,
  drafter forward, backward), from the profiler's memory events.
- the exact parts: the bytes of the target's and the drafter's parameters, the drafter's
  gradients and AdamW's states that this process holds (each storage once: a sharded drafter's
  padded shards).
- sharded only, after that micro-step (as held-out evaluation runs after a step): the whole
  drafter copy ``sharded_drafter.whole_drafter`` gathers on every rank, its parameters' bytes
  (each storage once) and the peak allocated while it is built.

With ``sharded=True`` (inside a joined gloo group) the target is loaded as ``run`` loads it
under ``training.fsdp`` (built on meta, sharded, each rank's rows read) and the drafter is
sharded by the trainer's own ``shard_drafter_fsdp2`` (each draft layer and the step module,
reducing in float32, computing in the master dtype on the CPU).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.profiler import ProfilerActivity, profile

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.executor.data.train_dataset import Batch
from dflash_recipes.executor.model.convert import convert, dflash_module, lm_head, load_base_model
from dflash_recipes.executor.training.anchors import sample_batch_anchors
from dflash_recipes.executor.training.setup.optimizer import build_optimizer
from dflash_recipes.executor.training.step import DraftStep, StepInputs, step_inputs
from dflash_recipes.plan.run_plan import RunPlan

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "tiny_scratch.yaml"
VOCAB = 512
MASK_TOKEN = VOCAB - 1


@attrs.frozen
class Shape:
    """A step's shape: the sequence, the rows, the anchors and blocks, the widths."""

    seq: int
    batch: int
    anchors: int
    block: int
    width: int
    target_layers: int
    heads: int


def measurement_plan(folder: Path, shape: Shape, *overrides: str) -> RunPlan:
    """The tiny scratch recipe compiled against a random Qwen3 target of `shape` (written to
    ``folder/target`` unless there), with a 2-layer drafter of the target's width."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    target = folder / "target"
    if not (target / "config.json").is_file():
        torch.manual_seed(0)
        config = Qwen3Config(
            hidden_size=shape.width,
            intermediate_size=2 * shape.width,
            num_hidden_layers=shape.target_layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=max(1, shape.heads // 2),
            head_dim=shape.width // shape.heads,
            vocab_size=VOCAB,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
        Qwen3ForCausalLM(config).save_pretrained(target)
    arch = "dflash.dflash_architecture_config"
    result = compile_file(
        RECIPE,
        overrides=(
            f"model.model_name_or_path={target}",
            f"training.output_dir={folder / 'unused'}",
            f"training.per_device_train_batch_size={shape.batch}",
            f"training.training_seq_len={shape.seq}",
            f"dflash.dflash_block_size={shape.block}",
            f"dflash.dflash_num_anchors={shape.anchors}",
            f"dflash.dflash_mask_token_id={MASK_TOKEN}",
            f"{arch}.num_hidden_layers=2",
            f"{arch}.num_attention_heads={shape.heads}",
            f"{arch}.num_key_value_heads={max(1, shape.heads // 2)}",
            f"{arch}.head_dim={shape.width // shape.heads}",
            f"{arch}.intermediate_size={2 * shape.width}",
            *overrides,
        ),
    )
    assert result.plan is not None, [str(d) for d in result.diagnostics]
    return result.plan


@attrs.frozen
class MeasuredStep:
    """Bytes one process holds, by part, around one real micro-step."""

    target_bytes: int
    drafter_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    #: What autograd saved for backward plus the step's inputs.
    saved_bytes: int
    #: The peak of the bytes allocated during the micro-step.
    peak_bytes: int
    #: Sharded only: the whole drafter copy held-out evaluation gathers on every rank
    #: (``sharded_drafter.whole_drafter``, after the step as in training): the bytes its
    #: parameters hold, and the peak allocated while it is built (from the profiler).
    eval_copy_bytes: int = 0
    eval_copy_peak_bytes: int = 0


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes this process holds for `tensors`: a plain tensor's own elements, a DTensor's local
    storage (FSDP2's padded shard, or the reduce-scatter buffer its gradient views), each once."""
    from torch.distributed.tensor import DTensor

    plain: dict[int, int] = {}
    storages: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            storage = tensor.to_local().untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        else:
            plain[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(plain.values()) + sum(storages.values())


def _inputs_bytes(inputs: StepInputs, seen: dict[int, int]) -> int:
    """Add the step inputs alive through the drafter's phase (tapped, embeddings, positions,
    labels) to `seen` (storage -> bytes; what autograd saved is already there): the total."""
    targets = inputs.targets
    for tensor in (
        inputs.tapped,
        inputs.block_embeds,
        inputs.q_positions,
        inputs.ctx_positions,
        targets.labels,
        targets.label_mask,
        targets.anchors,
    ):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measured_step(
    plan: RunPlan, *, mask_token: int = MASK_TOKEN, autocast: bool = False, sharded: bool = False
) -> MeasuredStep:
    """Measure one micro-step of `plan` on the CPU (see the module docstring).

    `mask_token`: the ids are drawn below it. `autocast`: the drafter's step under CPU
    bfloat16 autocast (the copies the CUDA trainer's autocast makes). `sharded`: the target and
    the drafter sharded over the joined process group, as under ``training.fsdp``.
    """
    training = plan.training
    batch, seq = training.per_device_train_batch_size, training.training_seq_len
    spec = plan.resolved_draft()
    if sharded:
        from dflash_recipes.executor.dist_env import detect_dist_env
        from dflash_recipes.executor.model.meta_load import load_target_on_meta, materialize_target
        from dflash_recipes.executor.parallel_wrappers import shard_target_fsdp2
        from dflash_recipes.executor.sharded_drafter import shard_drafter_fsdp2

        env = detect_dist_env("cpu")
        model = convert(load_target_on_meta(plan), plan)
        shard_target_fsdp2(model, env)
        materialize_target(model, plan, env.device)
    else:
        model = convert(load_base_model(plan), plan)
    drafter = dflash_module(model)
    drafter.float()
    drafter.train(True)
    drafter.activation_checkpointing = training.activation_checkpointing
    step = DraftStep(drafter, lm_head(model), plan.draft.objective)
    if sharded:  # the trainer's own sharding (computing in the master dtype on the CPU)
        shard_drafter_fsdp2(step, drafter.layers, env, param_dtype=None)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, lr=1e-4, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, mask_token, (batch, seq), generator=gen)
    ones = torch.ones_like(ids)
    data = Batch(ids, ones, ones.clone(), epoch=0, next_index=batch)

    def inputs_of() -> StepInputs:
        drawn = sample_batch_anchors(
            data,
            positions=list(range(batch)),
            seed=0,
            block_size=spec.block_size,
            num_anchors=plan.draft.objective.num_anchors,
        )
        return step_inputs(model, spec, plan.draft.objective, data, drawn)

    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        first = step(inputs_of())
    first.loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()  # gradients and AdamW states now exist, as in every later step
    del first

    from torch.distributed.tensor import DTensor

    param_storages = {
        (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
        for p in model.parameters()
    }
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        inputs = inputs_of()
        with context, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = step(inputs).loss
        loss.backward()  # type: ignore[no-untyped-call]
        del loss
    saved_bytes = _inputs_bytes(inputs, saved)
    del inputs
    peak = _peak_of(prof)
    copy_bytes = copy_peak = 0
    if sharded:  # held-out evaluation's whole copy, with the gradients and AdamW states alive
        from dflash_recipes.executor.sharded_drafter import whole_drafter

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            copy = whole_drafter(drafter, torch.device("cpu"))
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in copy.parameters()}
        copy_bytes = sum(storage.nbytes() for storage in storages.values())
        copy_peak = _peak_of(prof)
        del copy
    own = {id(p) for p in drafter.parameters()}
    return MeasuredStep(
        target_bytes=_storage_bytes([p for p in model.parameters() if id(p) not in own]),
        drafter_bytes=_storage_bytes(list(drafter.parameters())),
        grad_bytes=_storage_bytes([p.grad for p in params if p.grad is not None]),
        optimizer_bytes=_storage_bytes(
            [
                value
                for state in optimizer.state.values()
                for value in state.values()
                if isinstance(value, torch.Tensor)
            ]
        ),
        saved_bytes=saved_bytes,
        peak_bytes=peak,
        eval_copy_bytes=copy_bytes,
        eval_copy_peak_bytes=copy_peak,
    )


def measure_sharded_rank(folder: Path, shape: Shape) -> None:
    """One rank (started by :func:`testkit.ranks.run_ranks`) of the sharded measurement: joins
    the process group, measures `shape`'s step under training.fsdp and writes its
    :class:`MeasuredStep` to ``folder/rank<N>.json``."""
    import json

    from dflash_recipes.executor.dist_env import (
        detect_dist_env,
        init_distributed,
        shutdown_distributed,
    )

    env = detect_dist_env("cpu")
    init_distributed(env)
    try:
        plan = measurement_plan(folder, shape, "training.fsdp=true")
        measured = measured_step(plan, sharded=True)
    finally:
        shutdown_distributed()
    figures = json.dumps(attrs.asdict(measured))
    (folder / f"rank{env.rank}.json").write_text(figures, encoding="utf-8")


def _peak_of(prof: Any) -> int:
    """The peak of the bytes allocated over a profiled block (its memory events in order)."""
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


__all__ = [
    "MASK_TOKEN",
    "MeasuredStep",
    "Shape",
    "measure_sharded_rank",
    "measured_step",
    "measurement_plan",
]
