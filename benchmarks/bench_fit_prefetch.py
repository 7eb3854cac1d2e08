"""The trainer's loop with batches prepared on the prefetch thread against on the loop's thread.

    python benchmarks/bench_fit_prefetch.py [--rounds 5] [--steps 12] [--threads 1]
        [--batch 8] [--seq 128] [--anchors 16]

Trains the shipped tiny target (``recipes/tiny/tiny_scratch.yaml``, CPU) with the real
:func:`~dflash_recipes.executor.training.fit.fit`: ``prefetch`` (the default: collate, anchors
and the split block mask of step N+1 on a background thread while step N trains) against
``synchronous`` (the same work on the loop's thread, when the loop asks for the batch: the
baseline). Each round sets up a fresh run of each variant (untimed) and times ``fit`` alone;
the variants alternate and swap order every round, so a noisy neighbour slows both alike.
Figures are medians of the per-step time. Target: prefetch / synchronous <= 1.05 (no slower,
within the noise of a shared CPU); on a GPU the preparation overlaps the device's work, on a
CPU it competes with the step for the same cores, so parity is what a CPU can show.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

import torch
from _measure import fit_seconds_per_step, print_table, verdict

from dflash_recipes.compiler.compilation import compile_file

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny" / "tiny_scratch.yaml"
VARIANTS = {"prefetch": True, "synchronous": False}


def one_fit(folder: Path, args: argparse.Namespace, *, prefetch: bool) -> float:
    """Seconds per optimiser step of one fresh run's ``fit`` (setup not timed)."""
    result = compile_file(
        RECIPE,
        overrides=(
            f"training.output_dir={folder}",
            f"training.max_steps={args.steps}",
            f"training.logging_steps={args.steps}",
            f"training.save_steps={args.steps}",
            "training.eval_steps=null",
            f"training.per_device_train_batch_size={args.batch}",
            f"training.training_seq_len={args.seq}",
            f"dflash.dflash_num_anchors={args.anchors}",
        ),
    )
    assert result.plan is not None, [str(d) for d in result.diagnostics]
    return fit_seconds_per_step(result.plan, prefetch=prefetch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--anchors", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.disable(logging.INFO)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds + 1):  # round 0 warms up
            order = names if index % 2 == 0 else names[::-1]
            for name in order:
                folder = Path(tmp) / f"{name}-{index}"
                seconds = one_fit(folder, args, prefetch=VARIANTS[name])
                if index > 0:
                    samples[name].append(seconds)
    median = {v: statistics.median(s) for v, s in samples.items()}
    print(
        f"tiny target, batch {args.batch}, seq {args.seq}, {args.anchors} anchors, "
        f"{args.steps} optimiser steps per fit, {args.threads} torch thread(s), "
        f"{args.rounds} interleaved rounds (medians)"
    )
    rows = [
        [name, f"{median[name] * 1e3:.2f}", " ".join(f"{s * 1e3:.1f}" for s in samples[name])]
        for name in names
    ]
    print_table(["variant", "ms / step", "rounds (ms / step)"], rows)
    ratio = median["prefetch"] / median["synchronous"]
    ok = verdict(ratio <= 1.05)
    print(f"prefetch / synchronous = {ratio:.3f} (target <= 1.05, no slower: {ok})")


if __name__ == "__main__":
    main()
