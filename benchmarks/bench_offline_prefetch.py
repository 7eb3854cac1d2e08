"""Offline training: captured states read on the prefetch thread against read on the loop's.

    python benchmarks/bench_offline_prefetch.py [--rounds 4] [--steps 12] [--threads 1]
        [--hidden 512] [--layers 8] [--batch 8]

One capture of the demo data from a random Qwen3 target (``--hidden``, ``--layers``, bf16,
the demo tokenizer; wide enough that the taps are most of a micro-batch's bytes) feeds both
arms, same shards, same steps; both are the real
:func:`~dflash_recipes.executor.training.fit.fit` over the run that ``setup`` builds (its step
from :func:`~dflash_recipes.executor.training.train_step.build_step`, each step one
:func:`~dflash_recipes.executor.training.train_step.optimizer_step`), nothing patched:

- ``prefetch`` (the product, issue 49): the prefetch thread reads each micro-batch's states
  from the shards and pads them in the stored dtype (bf16) in host memory (pinned on CUDA);
  the shards are hashed by a background thread ahead of the reads; the loop only moves them
  to the device;
- ``on the loop`` (the baseline): ``fit(..., prefetch=False)``, the same preparation on the
  loop's thread at every micro-step, in the middle of the step. (Before issue 53 this arm also
  upcast the states to float32 on the host and hashed each shard on first touch, by patching
  the loop's micro-step; that copy of the loop is gone, so the ratio now isolates the thread.)

Each round sets up a fresh run of each arm (untimed) and times ``fit`` alone; the arms
alternate and swap order every round; figures are medians of the per-step time. On a CPU the
prefetch thread competes with the step for the same cores, so what shows here is the work
taken off the loop; on a GPU it also overlaps with the device.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

import torch
from _measure import fit_seconds_per_step, print_table, write_wide_target

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.executor.data.capture import capture_plan
from dflash_recipes.plan.run_plan import RunPlan

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny" / "tiny_scratch.yaml"
DEMO = REPO / "dflash_recipes" / "demo_data"
ARMS = ("prefetch", "on the loop")


def _plan(folder: Path, target: Path, args: argparse.Namespace, *extra: str) -> RunPlan:
    result = compile_file(
        RECIPE,
        overrides=(
            f"model.model_name_or_path={target}",
            "model.dtype=bfloat16",
            f"data.data_path={DEMO / 'data' / 'domain.jsonl'}",
            f"training.output_dir={folder}",
            f"training.max_steps={args.steps}",
            f"training.logging_steps={args.steps}",
            f"training.save_steps={args.steps}",
            "training.eval_steps=null",
            f"training.per_device_train_batch_size={args.batch}",
            "training.training_seq_len=256",
            *extra,
        ),
    )
    assert result.plan is not None, [str(d) for d in result.diagnostics]
    return result.plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.disable(logging.INFO)
    samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        target = write_wide_target(
            Path(tmp) / "target", args.hidden, args.layers, intermediate=2 * args.hidden
        )
        capture = Path(tmp) / "capture"
        source = _plan(Path(tmp) / "capture-run", target, args)
        assert capture_plan(source, capture, progress=False).complete
        for index in range(args.rounds + 1):  # round 0 warms up
            order = ARMS if index % 2 == 0 else ARMS[::-1]
            for arm in order:
                folder = Path(tmp) / f"{arm.replace(' ', '-')}-{index}"
                plan = _plan(folder, target, args, f"data.hidden_states_path={capture}")
                seconds = fit_seconds_per_step(plan, prefetch=arm == "prefetch")
                if index > 0:
                    samples[arm].append(seconds)
    median = {arm: statistics.median(s) for arm, s in samples.items()}
    print(
        f"offline, bf16 capture of a {args.layers}-layer hidden-{args.hidden} Qwen3 target, "
        f"batch {args.batch}, {args.steps} optimiser steps per fit, {args.threads} torch "
        f"thread(s), {args.rounds} interleaved rounds (medians)"
    )
    rows = [
        [arm, f"{median[arm] * 1e3:.2f}", " ".join(f"{s * 1e3:.1f}" for s in samples[arm])]
        for arm in ARMS
    ]
    print_table(["arm", "ms / step", "rounds (ms / step)"], rows)
    print(f"prefetch / on the loop = {median['prefetch'] / median['on the loop']:.3f}")


if __name__ == "__main__":
    main()
