"""The KV-cached eval loop against plain greedy decoding and the old uncached loop (issue 26).

    python benchmarks/bench_eval.py [--lengths 512 2048] [--block-size 8] [--rounds 3]
        [--old-lengths 512 2048] [--batch 4] [--threads 1]

A random tiny Qwen3 target (4 layers x 64, vocab 128, max_position_embeddings 8192; random, so
it never stops early: no eos) and, in one process, for each number of new tokens N:

- ``generate``: ``target.generate`` (transformers' KV-cached greedy decoding), the baseline;
- ``cached``: the product's loop (``speculative_generate``) with a random DFlash drafter
  (every proposal rejected, tau about 1: the worst case, one drafter pass and one target pass
  per token) and with an oracle drafter that proposes the target's own greedy tokens for the
  first 3 of its 7 block positions (tau 4 every step: the loop's own cost with a free
  drafter);
- ``old``: the uncached reference loop (tests/testkit/reference_loop.py) with the same
  drafters, at ``--old-lengths`` (it is quadratic: 2,048 tokens take about a minute).

Every round runs every length and command in turn, so a change of load on a shared machine
hits them alike; figures are the best of ``--rounds`` (one round for the old loop). Printed:
milliseconds per generated token, tokens/s, the ratio to ``generate``, and per loop the
per-token time at the longest length over the shortest (the cached loop's should stay within
1.3x: linear in the generated tokens), also divided by ``generate``'s own growth in the same
run (attention over a longer cache costs every loop more per token; on a loaded machine the
memory traffic grows it further, and the division takes out what all loops share).
``--batch`` adds the cached loop on that many prompts at once (tokens/s of all rows together)
against one at a time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import _measure  # noqa: F401  (puts tests/ on sys.path for testkit)
import torch
from testkit.reference_loop import uncached_speculative_generate
from testkit.tiny import randomize, tiny_plan, tiny_target
from transformers import PreTrainedModel

from dflash_recipes.executor.evaluation.cached_decoding import (
    speculative_generate,
    speculative_generate_batch,
)
from dflash_recipes.executor.evaluation.speculative import DraftContext, is_greedy_decoding
from dflash_recipes.executor.model.draft import DFlashDraftModel

PROMPT = [5, 17, 3, 99, 42, 8, 61, 23]
PROMPTS = [PROMPT, [7, 7, 31, 2, 90], [11, 64, 3, 3, 3, 40, 12, 9, 1, 77, 55], [100, 4]]


class OracleDrafter:
    """Proposes the target's greedy tokens for the first ``correct`` positions, then wrong ones."""

    def __init__(self, continuation: dict[tuple[int, ...], list[int]], correct: int) -> None:
        self.continuation = continuation
        self.correct = correct

    def propose(self, context: DraftContext) -> list[int]:
        committed = list(context.committed)
        prompt = next(p for p in self.continuation if committed[: len(p)] == list(p))
        full = [*prompt, *self.continuation[prompt]]
        right = full[len(committed) : len(committed) + context.block_size - 1]
        right += [0] * (context.block_size - 1 - len(right))
        return [t if k < self.correct else (t + 1) % 128 for k, t in enumerate(right)]


def greedy_hf(target: PreTrainedModel, prompt: Sequence[int], n: int) -> list[int]:
    out = target.generate(  # type: ignore[operator]
        torch.tensor([list(prompt)]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


def timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--old-lengths", type=int, nargs="*", default=[512, 2048])
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        plan = tiny_plan(Path(tmp), block_size=args.block_size, target_max_position_embeddings=8192)
    spec = plan.resolved_draft()
    target = tiny_target(plan)
    randomize(target, seed=1)
    target.eval()
    drafter = DFlashDraftModel(spec)
    randomize(drafter, seed=2)
    drafter.eval()
    longest = max([*args.lengths, *args.old_lengths])
    continuation = {tuple(p): greedy_hf(target, p, longest + args.block_size) for p in PROMPTS}
    oracle = OracleDrafter(continuation, correct=3)
    drafters: dict[str, object] = {"random dflash drafter": drafter, "oracle (tau 4)": oracle}

    # Warm-up (allocator, first-call costs), and the losslessness of what is timed.
    for name, d in drafters.items():
        result = speculative_generate(
            target, d, spec, PROMPT, max_new_tokens=256, eos_token_id=None
        )
        assert is_greedy_decoding(target, PROMPT, result.tokens, 256, None), name
    greedy_hf(target, PROMPT, 64)

    print(
        f"random tiny Qwen3 target (4 x 64, vocab 128), block size {args.block_size}, "
        f"{args.threads} thread(s), prompt of {len(PROMPT)} tokens, no eos; "
        f"best of {args.rounds} interleaved rounds (old loop: 1 round)"
    )
    per_token: dict[str, dict[int, float]] = {}
    times: dict[tuple[str, int], list[float]] = {}
    # Every round runs every length and command, so a change of load hits all of them alike.
    for round_index in range(args.rounds):
        for n in args.lengths:
            times.setdefault(("generate", n), []).append(
                timed(lambda n=n: greedy_hf(target, PROMPT, n))
            )
            for name, d in drafters.items():
                times.setdefault((f"cached, {name}", n), []).append(
                    timed(
                        lambda n=n, d=d: speculative_generate(
                            target, d, spec, PROMPT, max_new_tokens=n, eos_token_id=None
                        )
                    )
                )
            if round_index == 0 and n in args.old_lengths:
                for name, d in drafters.items():
                    times[(f"old, {name}", n)] = [
                        timed(
                            lambda n=n, d=d: uncached_speculative_generate(
                                target, d, spec, PROMPT, max_new_tokens=n, eos_token_id=None
                            )
                        )
                    ]
    rows: list[tuple[str, int, float]] = []
    for n in args.lengths:
        for (label, length), values in times.items():
            if length == n:
                seconds = min(values)
                rows.append((label, n, seconds))
                per_token.setdefault(label, {})[n] = seconds / n

    base = {n: s for label, n, s in rows if label == "generate"}
    print(f"\n{'loop':<36} {'new tokens':>10} {'ms/token':>9} {'tokens/s':>9} {'vs generate':>12}")
    for label, n, seconds in rows:
        print(
            f"{label:<36} {n:>10} {1000 * seconds / n:>9.3f} {n / seconds:>9.1f} "
            f"{base[n] / seconds:>11.2f}x"
        )
    short, long = min(args.lengths), max(args.lengths)
    if short != long:
        print(f"\nper-token time at {long} over {short} new tokens (linear: about 1.0):")
        generate = per_token["generate"][long] / per_token["generate"][short]
        for label, figures in per_token.items():
            if short in figures and long in figures:
                growth = figures[long] / figures[short]
                print(
                    f"  {label:<34} {growth:.2f}x  ({growth / generate:.2f}x generate's own "
                    "growth in this run)"
                )
        for label in per_token:
            if label.startswith("old") and short in per_token[label]:
                cached = label.replace("old", "cached", 1)
                if long in per_token[label]:
                    print(
                        f"  old / cached at {long}, {label[5:]}: "
                        f"{per_token[label][long] / per_token[cached][long]:.1f}x"
                    )

    if args.batch > 1:
        prompts = PROMPTS[: args.batch]
        n = short
        one = min(
            timed(
                lambda: [
                    speculative_generate(
                        target, drafter, spec, p, max_new_tokens=n, eos_token_id=None
                    )
                    for p in prompts
                ]
            )
            for _ in range(args.rounds)
        )
        together = min(
            timed(
                lambda: speculative_generate_batch(
                    target, drafter, spec, prompts, max_new_tokens=n, eos_token_id=None
                )
            )
            for _ in range(args.rounds)
        )
        total = n * len(prompts)
        print(
            f"\n{len(prompts)} prompts x {n} tokens, random dflash drafter: one at a time "
            f"{total / one:.1f} tokens/s, as one batch {total / together:.1f} tokens/s "
            f"({one / together:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
