"""What sampled verification (``eval --temperature``) costs against greedy verification.

    python benchmarks/bench_eval_sampling.py [--new-tokens 256] [--vocab 32768] [--batch 4]
        [--block-size 8] [--rounds 5] [--threads 1]

A random tiny Qwen3 target (4 layers x 64, ``--vocab`` tokens, so the per-position softmax
over the vocabulary that sampling adds is what a real vocabulary costs) and a random DFlash
drafter; in one process, every round runs, in turn:

- ``greedy``: the KV-cached loop with greedy verification, the baseline;
- ``sampled``: ``--temperature 1`` with proposals drawn from the drafter (the draft
  distributions recorded, ``[rows, block - 1, vocab]`` per step, then the rejection rule);
- ``sampled, greedy drafts``: ``--draft-sampling greedy`` (a point mass per proposal).

Each on ``--batch`` prompts at once. Printed: milliseconds per verification step and per
generated token (best of ``--rounds``), the ratio to greedy in the same run, and the
measured tau of each (a random drafter: near 1 for all, so the per-step time is the cost of
the loop itself).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import _measure  # noqa: F401  (puts tests/ on sys.path for testkit)
import torch
from testkit.tiny import randomize, tiny_plan, tiny_target

from dflash_recipes.executor.evaluation.cached_decoding import speculative_generate_batch
from dflash_recipes.executor.evaluation.sampling import Sampling
from dflash_recipes.executor.model.draft import DFlashDraftModel

PROMPTS = [[5, 17, 3, 99, 42, 8, 61, 23], [7, 7, 31, 2, 90], [11, 64, 3, 3, 40, 12], [100, 4]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        plan = tiny_plan(
            Path(tmp),
            block_size=args.block_size,
            target_vocab_size=args.vocab,
            mask_token_id=args.vocab - 1,
            target_max_position_embeddings=4096,
        )
    spec = plan.resolved_draft()
    target = tiny_target(plan).eval()
    randomize(target, seed=1)
    drafter = DFlashDraftModel(spec)
    randomize(drafter, seed=2)
    drafter.eval()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    modes: dict[str, Sampling | None] = {
        "greedy": None,
        "sampled": Sampling(temperature=1.0, seed=0),
        "sampled, greedy drafts": Sampling(temperature=1.0, seed=0, drafts="greedy"),
    }

    def run(sampling: Sampling | None) -> tuple[float, int, int]:
        started = time.perf_counter()
        results = speculative_generate_batch(
            target,
            drafter,
            spec,
            prompts,
            max_new_tokens=args.new_tokens,
            eos_token_id=None,
            sampling=sampling,
        )
        seconds = time.perf_counter() - started
        steps = sum(len(r.accepted_per_step) for r in results)
        tokens = sum(len(r.tokens) for r in results)
        return seconds, steps, tokens

    for sampling in modes.values():  # warm-up
        run(sampling)
    best: dict[str, tuple[float, int, int]] = {}
    for _ in range(args.rounds):  # interleaved, so a change of load hits every mode alike
        for name, sampling in modes.items():
            measured = run(sampling)
            if name not in best or measured[0] < best[name][0]:
                best[name] = measured

    print(
        f"random tiny Qwen3 target (4 x 64, vocab {args.vocab}), block size {args.block_size}, "
        f"{args.batch} prompts at once, {args.new_tokens} new tokens each, "
        f"{args.threads} thread(s); best of {args.rounds} interleaved rounds"
    )
    print(f"{'verification':<24} {'ms/step':>8} {'ms/token':>9} {'tau':>6} {'step vs greedy':>15}")
    base_step = best["greedy"][0] / best["greedy"][1]
    for name, (seconds, steps, tokens) in best.items():
        per_step = seconds / steps
        tau = (tokens - len(prompts)) / steps  # the prefill's token is not a step's
        print(
            f"{name:<24} {1000 * per_step:>8.3f} {1000 * seconds / tokens:>9.3f} {tau:>6.2f} "
            f"{per_step / base_step:>14.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
