"""Sequence packing (issue 40): supervised tokens per second packed vs padded, same conversations.

    python benchmarks/bench_packing.py [--conversations 48] [--batch-size 2] [--threads 2]

Lengths are synthetic and long-tailed: log-normal with median 600 tokens and sigma 0.978, so
about 5% of conversations are over 3,000 tokens (the printed sample says how many were), cut
at ``training_seq_len`` 4096 like the tokenizer cuts them; token ids are random, the first
fifth of each conversation is an unsupervised prompt. The model is the tests' tiny Qwen3
target (4 layers, hidden 64, vocabulary 128) with a 2-layer drafter, block size 8, 64 anchors
per row, on the CPU.

Both arms run the trainer's own code on the same conversations in one process: the epoch's
batches (padded: :func:`~dflash_recipes.executor.data.train_dataset.batches`, each batch as
long as its longest conversation; packed: :func:`~dflash_recipes.executor.data.packing.
packed_batches` over :func:`~dflash_recipes.executor.data.packing.pack_epoch`, rows of exactly
4096), ``prepare_batch`` (anchors, the CPU split mask), ``step_inputs`` (the target forward:
SDPA, with the block-diagonal mask when packed), ``DraftStep`` and backward; no optimiser.
The headline is supervised conversation tokens per second (the same total both ways, so the
ratio is the ratio of epoch times); also shown: drafter label positions per second and the
number of distinct step shapes ``[batch, seq_len]`` (packed: 1).
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from pathlib import Path

import _measure  # noqa: F401  (puts tests/ on sys.path for testkit)
import torch
from testkit.tiny import randomize, tiny_plan, tiny_target

from dflash_recipes.executor.data.packing import example_lengths, pack_epoch, packed_batches
from dflash_recipes.executor.data.tokenize import DatasetStats, TokenizedExample
from dflash_recipes.executor.data.train_dataset import Batch, TrainDataset, batches
from dflash_recipes.executor.dist_env import detect_dist_env
from dflash_recipes.executor.model.convert import convert, dflash_module, lm_head
from dflash_recipes.executor.training.setup.prefetch import prepare_batch
from dflash_recipes.executor.training.step import DraftStep, step_inputs

SEQ_LEN = 4096
MEDIAN = 600
SIGMA = math.log(3000 / MEDIAN) / 1.6449  # P(length > 3000) = 5%
ANCHORS = 64
BLOCK = 8


def conversations(n: int, seed: int = 0) -> list[TokenizedExample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = min(SEQ_LEN, max(16, int(rng.lognormvariate(math.log(MEDIAN), SIGMA))))
        prompt = length // 5
        ids = [rng.randrange(100) for _ in range(length)]
        out.append(TokenizedExample(ids, [0] * prompt + [1] * (length - prompt)))
    return out


def run_epoch(arm: str, dataset: TrainDataset, batch_size: int, tmp: Path) -> dict[str, float]:
    plan = tiny_plan(tmp, block_size=BLOCK, training_seq_len=SEQ_LEN, num_anchors=ANCHORS)
    model = convert(tiny_target(plan), plan)
    drafter = dflash_module(model)
    randomize(drafter)
    spec = plan.resolved_draft()
    step = DraftStep(drafter, lm_head(model), plan.draft.objective)
    env = detect_dist_env("cpu", {})
    stream: list[Batch]
    if arm == "packed":
        packing = pack_epoch(example_lengths(dataset.examples), seq_len=SEQ_LEN, seed=0, epoch=0)
        stream = list(packed_batches(dataset, packing, batch_size=batch_size, epoch=0))
    else:
        stream = list(batches(dataset, batch_size=batch_size, seed=0, epoch=0))
    shapes = {tuple(b.input_ids.shape) for b in stream}
    supervised = labels = tokens = 0
    start = time.perf_counter()
    for batch in stream:
        prepared = prepare_batch(batch, env=env, seed=0, spec=spec, num_anchors=ANCHORS)
        inputs = step_inputs(
            model, spec, plan.draft.objective, batch, prepared.drawn, mask=prepared.mask
        )
        drafter.zero_grad(set_to_none=True)
        result = step(inputs)
        result.loss.backward()
        supervised += int(batch.loss_mask.sum())
        labels += int(inputs.targets.label_mask.sum())
        tokens += int(batch.input_ids.numel())
    seconds = time.perf_counter() - start
    return {
        "steps": len(stream),
        "shapes": len(shapes),
        "rows": sum(int(b.input_ids.shape[0]) for b in stream),
        "seconds": seconds,
        "supervised": supervised,
        "supervised_per_s": supervised / seconds,
        "labels_per_s": labels / seconds,
        "fill": int(sum(int(b.attention_mask.sum()) for b in stream)) / max(1, tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    examples = conversations(args.conversations)
    lengths = [len(e.input_ids) for e in examples]
    stats = DatasetStats(len(examples), (), sum(lengths), 0, 0)
    dataset = TrainDataset(tuple(examples), 0, stats, Path("synthetic.jsonl"))
    long = sum(n > 3000 for n in lengths)
    print(
        f"lengths: log-normal, median {MEDIAN}, sigma {SIGMA:.3f} (5% expected over 3000); "
        f"sample of {len(lengths)}: median {sorted(lengths)[len(lengths) // 2]}, "
        f"{long} over 3000 ({100 * long / len(lengths):.0f}%), {sum(lengths)} tokens, "
        f"cut at {SEQ_LEN}"
    )
    print(
        f"model: tiny Qwen3 target 4 x 64, drafter 2 x 64, block {BLOCK}, {ANCHORS} anchors per "
        f"row, batch {args.batch_size}, CPU, {args.threads} threads, training_seq_len {SEQ_LEN}"
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in ("padded", "packed"):
            results[arm] = run_epoch(arm, dataset, args.batch_size, Path(tmp) / arm)
    print(
        f"{'arm':8} {'steps':>5} {'rows':>5} {'shapes':>6} {'fill':>6} {'seconds':>8} "
        f"{'sup tok/s':>10} {'labels/s':>9}"
    )
    for arm, r in results.items():
        print(
            f"{arm:8} {r['steps']:>5} {r['rows']:>5} {r['shapes']:>6} {r['fill']:>6.1%} "
            f"{r['seconds']:>8.1f} {r['supervised_per_s']:>10.0f} {r['labels_per_s']:>9.0f}"
        )
    packed, padded = results["packed"], results["padded"]
    print(
        "packed / padded supervised tokens per second: "
        f"{packed['supervised_per_s'] / padded['supervised_per_s']:.2f}x "
        f"(supervised tokens trained: padded {padded['supervised']}, packed "
        f"{packed['supervised']}; packing drops an incomplete last batch of rows)"
    )


if __name__ == "__main__":
    main()
