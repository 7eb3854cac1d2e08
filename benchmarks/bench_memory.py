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
autocast makes, against the estimate with ``autocast=True``; with
``training.activation_checkpointing`` (``--checkpointing``); and with the target and the drafter
sharded over 2 gloo ranks (``--sharded``, rank 0's figures; the "saved" row is left out of
those two, whose layer inputs and gathered weights autograd's hooks do not see). The sharded
run also measures held-out evaluation's whole drafter copy (``sharded_drafter.whole_drafter``,
built after the step as the trainer builds it): its parameters' bytes against the estimate's
``eval_parts.drafter_copy`` (exact), and the peak allocated while it is built against the copy
plus the one gathered tensor in flight the estimate allows. The measuring
core is ``tests/testkit/memory_measure.py``, shared with
``tests/executor/training/test_memory_measured.py``.

Target: every ratio estimate / measured within 1 +- 0.15. The exact parts (target weights,
drafter weights, gradients, AdamW states) are compared with the built modules' own bytes and
must be equal.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import attrs
import torch
from _measure import print_table, verdict
from bench_step_overhead import SHAPES
from testkit.memory_measure import Shape, measure_sharded_rank, measured_step, measurement_plan

from dflash_recipes.plan.resources.estimate import estimate_resources

TOLERANCE = 0.15


def _shape(name: str) -> Shape:
    seq, batch, anchors, block, width, layers, heads, _ = SHAPES[name]
    return Shape(seq, batch, anchors, block, width, layers, heads)


def _sharded_worker(folder: Path, name: str) -> None:
    """One rank of the sharded measurement (this script started by testkit.ranks)."""
    measure_sharded_rank(folder, _shape(name))


def measure(
    name: str,
    folder: Path,
    *,
    autocast: bool = False,
    checkpointing: bool = False,
    sharded: bool = False,
) -> list[list[str]]:
    """Estimate and measurement of one shape: the table rows. `autocast`: the drafter's step
    under CPU bfloat16 autocast (the bf16 copies the CUDA trainer's autocast makes);
    `checkpointing`: training.activation_checkpointing; `sharded`: training.fsdp over 2 gloo
    ranks (rank 0's figures; every rank's are alike)."""
    extra = ["training.activation_checkpointing=true"] if checkpointing else []
    if sharded:
        extra.append("training.fsdp=true")
    plan = measurement_plan(folder, _shape(name), *extra)
    ranks = 2 if sharded else 1
    estimate = estimate_resources(plan, world_size=ranks, device="cpu", autocast=autocast)
    if sharded:
        from testkit.ranks import run_ranks

        argv = [sys.executable, __file__, "--sharded-worker", str(folder), name]
        for done in run_ranks(argv, what="the sharded measurement"):
            assert done.returncode == 0, done.stderr
        found = json.loads((folder / "rank0.json").read_text())
    else:
        found = attrs.asdict(measured_step(plan, autocast=autocast))
    keys = ("target_bytes", "drafter_bytes", "grad_bytes", "optimizer_bytes", "saved_bytes")
    real = [found[k] for k in (*keys, "peak_bytes")]
    # the training step's figures (a plan that evaluates under fsdp may peak at evaluation)
    memory, parts = estimate.step_memory or estimate.memory, estimate.activation_parts
    label = name + (" bf16" if autocast else "") + (" ckpt" if checkpointing else "")
    label += " fsdp x2" if sharded else ""
    rows = []
    for (what, est), value in zip(
        (
            ("target weights", memory.target_weights),
            ("drafter weights", memory.drafter_weights),
            ("gradients", estimate.gradient_bytes),
            ("optimizer states", memory.optimizer_states),
            ("saved for backward", parts.step_inputs + parts.drafter_saved),
            ("activations (peak)", memory.activations),
        ),
        real,
        strict=True,
    ):
        if what == "saved for backward" and (checkpointing or sharded):
            continue  # kept by the checkpoint / gathered by FSDP2 outside autograd's hooks
        exact = what in ("target weights", "drafter weights", "gradients", "optimizer states")
        rows.append(_row(label, what, est, value, exact=exact))
    held = estimate.eval_parts
    if sharded and held is not None:  # held-out evaluation's whole drafter copy (issue 51)
        copy, peak = found["eval_copy_bytes"], found["eval_copy_peak_bytes"]
        rows.append(_row(label, "eval: whole drafter copy", held.drafter_copy, copy, exact=True))
        built = held.drafter_copy + held.in_flight
        rows.append(_row(label, "eval: copy + tensor in flight", built, peak, exact=False))
    return rows


def _row(label: str, what: str, est: int, value: int, *, exact: bool) -> list[str]:
    """One table row: equal when `exact`, else within the tolerance."""
    ratio = est / value if value else float("nan")
    ok = est == value if exact else abs(ratio - 1) <= TOLERANCE
    return [label, what, f"{est / 2**20:.2f}", f"{value / 2**20:.2f}", f"{ratio:.3f}", verdict(ok)]


def main() -> int:
    if sys.argv[1:2] == ["--sharded-worker"]:
        _sharded_worker(Path(sys.argv[2]), sys.argv[3])
        return 0
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
    parser.add_argument(
        "--checkpointing",
        nargs="*",
        choices=sorted(SHAPES),
        default=["medium"],
        help="shapes also measured with training.activation_checkpointing",
    )
    parser.add_argument(
        "--sharded",
        nargs="*",
        choices=sorted(SHAPES),
        default=["medium"],
        help="shapes also measured with the target and drafter sharded over 2 gloo ranks",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        for name in args.shapes:
            rows += measure(name, Path(tmp) / name)
        for name in args.autocast:
            rows += measure(name, Path(tmp) / "bf16" / name, autocast=True)
        for name in args.checkpointing:
            rows += measure(name, Path(tmp) / "ckpt" / name, checkpointing=True)
        for name in args.sharded:
            rows += measure(name, Path(tmp) / "fsdp" / name, sharded=True)
    print(
        "compile-time estimate vs one real CPU training step (exact parts must be equal; "
        f"activations within +-{TOLERANCE:.0%})"
    )
    print_table(["shape", "part", "estimate MiB", "measured MiB", "est / real", "verdict"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
