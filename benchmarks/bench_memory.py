"""The compile-time memory estimate against what a real training step holds (CPU).

    python benchmarks/bench_memory.py [--shapes tiny medium medium512] [--autocast medium ...]

Shapes are the step benchmarks' (benchmarks/bench_step_overhead.py): ``tiny`` = seq 128,
batch 2, 8 anchors, block 8, width 64; ``medium`` = seq 1024, batch 2, 128 anchors, block 16,
width 256; ``medium512`` = medium with 512 anchors. Each builds a random Qwen3 target, compiles
the tiny scratch recipe against it, builds the trainer's modules (converted target, float32
drafter, DraftStep, the trainer's AdamW) and runs one step to create the gradients and the
optimizer states. Then, on a second micro-step (the trainer's own ``step_inputs`` and
``DraftStep``, then backward):

- ``saved``: the bytes autograd saves for backward during the drafter's forward, counted by
  ``torch.autograd.graph.saved_tensors_hooks`` once per storage, parameters excluded, plus the
  step's inputs (tapped states, block embeddings, RoPE tables), against the estimate's
  ``step_inputs + drafter_saved``;
- ``peak``: the peak of the bytes allocated during the whole micro-step (target forward,
  drafter forward, backward), from the profiler's memory events (``profile_memory=True``),
  against the estimate's ``activations``: what is saved plus the peak of the transient tensors.

The medium shapes are measured again with the drafter's step under CPU bfloat16 autocast
(``--autocast``), which makes the bf16 copies of inputs and weights that the CUDA trainer's
autocast makes, against the estimate with ``autocast=True``.

Target: every ratio estimate / measured within 1 +- 0.15. The exact parts (target weights,
drafter weights, gradients, AdamW states) are compared with the built modules' own bytes and
must be equal.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch
from _measure import print_table, verdict
from bench_step_overhead import MASK_TOKEN, RECIPE, SHAPES, _make_target
from torch.profiler import ProfilerActivity, profile

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.executor.data.train_dataset import Batch
from dflash_recipes.executor.model.convert import convert, dflash_module, lm_head, load_base_model
from dflash_recipes.executor.training.anchors import sample_batch_anchors
from dflash_recipes.executor.training.setup.optimizer import build_optimizer
from dflash_recipes.executor.training.step import DraftStep, StepInputs, step_inputs
from dflash_recipes.plan.resources.estimate import estimate_resources

TOLERANCE = 0.15


def _inputs_bytes(inputs: StepInputs, seen: dict[int, int]) -> int:
    """Add the step inputs alive through the drafter's phase (tapped, embeddings, positions,
    labels) to `seen` (storage -> bytes; what autograd saved is already there): the total."""
    for tensor in (inputs.tapped, inputs.block_embeds, inputs.q_positions, inputs.ctx_positions):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    targets = inputs.targets
    for tensor in (targets.labels, targets.label_mask, targets.anchors):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(name: str, folder: Path, *, autocast: bool = False) -> list[list[str]]:
    """Estimate and measurement of one shape: the table rows. `autocast`: the drafter's step
    under CPU bfloat16 autocast (the bf16 copies the CUDA trainer's autocast makes)."""
    seq, batch, anchors, block, width, layers, heads, _ = SHAPES[name]
    target_dir = folder / name
    _make_target(target_dir, width, layers, heads)
    result = compile_file(
        RECIPE,
        overrides=(
            f"model.model_name_or_path={target_dir}",
            "training.output_dir=/tmp/dflash-bench-unused",
            f"training.per_device_train_batch_size={batch}",
            f"training.training_seq_len={seq}",
            f"dflash.dflash_block_size={block}",
            f"dflash.dflash_num_anchors={anchors}",
            f"dflash.dflash_mask_token_id={MASK_TOKEN}",
            "dflash.dflash_architecture_config.num_hidden_layers=2",
            f"dflash.dflash_architecture_config.num_attention_heads={heads}",
            f"dflash.dflash_architecture_config.num_key_value_heads={max(1, heads // 2)}",
            f"dflash.dflash_architecture_config.head_dim={width // heads}",
            f"dflash.dflash_architecture_config.intermediate_size={2 * width}",
        ),
    )
    assert result.plan is not None, result.diagnostics
    plan = result.plan
    estimate = estimate_resources(plan, world_size=1, device="cpu", autocast=autocast)
    spec = plan.resolved_draft()
    model = convert(load_base_model(plan), plan)
    drafter = dflash_module(model)
    drafter.float()
    drafter.train(True)
    step = DraftStep(drafter, lm_head(model), plan.draft.objective)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, lr=1e-4, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, MASK_TOKEN, (batch, seq), generator=gen)
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

    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
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
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)

    target_bytes = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if not n.startswith("dflash_module.") and p not in set(drafter.parameters())
    )
    drafter_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    optim_bytes = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    memory, parts = estimate.memory, estimate.activation_parts
    label = f"{name} bf16" if autocast else name
    rows = []
    for what, est, real in (
        ("target weights", memory.target_weights, target_bytes),
        ("drafter weights", memory.drafter_weights, drafter_bytes),
        ("gradients", estimate.gradient_bytes, grad_bytes),
        ("optimizer states", memory.optimizer_states, optim_bytes),
        ("saved for backward", parts.step_inputs + parts.drafter_saved, saved_bytes),
        ("activations (peak)", memory.activations, peak),
    ):
        ratio = est / real if real else float("nan")
        exact = what in ("target weights", "drafter weights", "gradients", "optimizer states")
        ok = est == real if exact else abs(ratio - 1) <= TOLERANCE
        rows.append(
            [label, what, f"{est / 2**20:.2f}", f"{real / 2**20:.2f}", f"{ratio:.3f}", verdict(ok)]
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny", "medium", "medium512"]
    )
    parser.add_argument(
        "--autocast",
        nargs="*",
        choices=sorted(SHAPES),
        default=["medium", "medium512"],
        help="shapes also measured under CPU bf16 autocast (as the CUDA trainer runs)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        for name in args.shapes:
            rows += measure(name, Path(tmp))
        for name in args.autocast:
            rows += measure(name, Path(tmp) / "bf16", autocast=True)
    print(
        "compile-time estimate vs one real CPU training step (exact parts must be equal; "
        f"activations within +-{TOLERANCE:.0%})"
    )
    print_table(["shape", "part", "estimate MiB", "measured MiB", "est / real", "verdict"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
