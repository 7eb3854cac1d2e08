"""Sequence packing (issue 40): supervised tokens per second packed vs padded, same conversations.

    python benchmarks/bench_packing.py [--conversations 48] [--batch-size 2 8] [--threads 2]

Lengths are synthetic and long-tailed: log-normal with median 600 tokens and sigma 0.978, so
about 5% of conversations are over 3,000 tokens (the printed sample says how many were), cut
at ``training_seq_len`` 4096 like the tokenizer cuts them; token ids are random, the first
fifth of each conversation is an unsupervised prompt. The model is the tests' tiny Qwen3
target (4 layers, hidden 64, vocabulary 128) with a 2-layer drafter, block size 8, 64 anchors
per row, on the CPU.

Both arms run what ``run`` runs, through the step library (issue 53), on the same
conversations in one process, their steps interleaved (each arm kept at the same fraction of
its epoch, each step timed alone), so a machine whose load changes slows both alike: the
epoch's batches (padded: :func:`~dflash_recipes.executor.data.train_dataset.batches`, each
batch as long as its longest conversation; packed: :func:`~dflash_recipes.executor.data.
packing.packed_batches` over :func:`~dflash_recipes.executor.data.packing.pack_epoch`, rows of
exactly 4096), each through ``train_step.prepare_rows`` (anchors, the CPU split mask) and one
``optimizer_step`` of the step ``build_step`` makes from the plan and the in-memory target
(``step_inputs``: the target forward, SDPA, with the block-diagonal mask when packed;
``DraftStep``, backward, clipping, AdamW).
The headline is supervised conversation tokens per second (the same total both ways, so the
ratio is the ratio of epoch times); also shown: drafter label positions per second and the
number of distinct step shapes ``[batch, seq_len]`` (packed: 1).

What packing can give depends on how much the padded arm pads, which grows with the batch: a
padded batch is as long as its longest conversation, so the more rows, the likelier a long one
is among them. Each ``--batch-size`` is measured as its own pair of arms and printed with the
padded arm's fill, whose inverse (times the packed fill) bounds the token-count saving.
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
from dflash_recipes.executor.training.setup.prefetch import PreparedBatch
from dflash_recipes.executor.training.train_step import build_step, optimizer_step, prepare_rows

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


class Arm:
    """One arm's model, step and epoch of batches; :meth:`run_step` times one step."""

    def __init__(self, name: str, dataset: TrainDataset, batch_size: int, tmp: Path) -> None:
        self.name = name
        self.plan = tiny_plan(tmp, block_size=BLOCK, training_seq_len=SEQ_LEN, num_anchors=ANCHORS)
        self.step = build_step(
            self.plan, env=detect_dist_env("cpu", {}), target=tiny_target(self.plan)
        )
        randomize(self.step.models.drafter)
        self.step.models.training_modes()
        if name == "packed":
            packing = pack_epoch(
                example_lengths(dataset.examples), seq_len=SEQ_LEN, seed=0, epoch=0
            )
            self.stream = list(packed_batches(dataset, packing, batch_size=batch_size, epoch=0))
        else:
            self.stream = list(batches(dataset, batch_size=batch_size, seed=0, epoch=0))
        self.done = 0
        self.seconds = 0.0
        self.supervised = self.labels = 0

    @property
    def progress(self) -> float:
        return self.done / len(self.stream)

    def prepare(self, batch: Batch) -> PreparedBatch:
        """The batch's rows through ``prepare_rows`` with the masks the epoch's stream gave
        them (a packed row's document ids, a padded row's attention)."""
        return prepare_rows(
            self.step,
            batch.input_ids,
            batch.loss_mask,
            attention_mask=batch.attention_mask,
            document_ids=batch.document_ids,
            epoch=batch.epoch,
            next_index=batch.next_index,
        )

    def run_step(self) -> None:
        """The next batch through the trainer's step (anchors and masks, target, drafter,
        backward, optimiser), its time added to the arm's."""
        batch = self.stream[self.done]
        start = time.perf_counter()
        prepared = self.prepare(batch)
        out = optimizer_step(self.step, [prepared], index=self.done)
        self.seconds += time.perf_counter() - start
        self.supervised += int(batch.loss_mask.sum())
        # the supervised label positions of the drafted blocks, as the loss counted them
        self.labels += sum(int(result.per_position_count.sum()) for result, _ in out.micro)
        self.done += 1

    def figures(self) -> dict[str, float]:
        tokens = sum(int(b.input_ids.numel()) for b in self.stream)
        return {
            "steps": len(self.stream),
            "shapes": len({tuple(b.input_ids.shape) for b in self.stream}),
            "rows": sum(int(b.input_ids.shape[0]) for b in self.stream),
            "seconds": self.seconds,
            "supervised": self.supervised,
            "supervised_per_s": self.supervised / self.seconds,
            "labels_per_s": self.labels / self.seconds,
            "fill": sum(int(b.attention_mask.sum()) for b in self.stream) / max(1, tokens),
        }


def run_interleaved(
    dataset: TrainDataset, batch_size: int, tmp: Path
) -> dict[str, dict[str, float]]:
    """Both arms' epochs, their steps interleaved so that each arm is at the same fraction of
    its epoch: a machine whose load changes during the run slows both arms alike."""
    arms = [Arm(name, dataset, batch_size, tmp / name) for name in ("padded", "packed")]
    while any(arm.done < len(arm.stream) for arm in arms):
        behind = min((a for a in arms if a.done < len(a.stream)), key=lambda a: a.progress)
        behind.run_step()
    return {arm.name: arm.figures() for arm in arms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument(
        "--batch-size", type=int, nargs="+", default=[2, 8], help="one pair of arms per size"
    )
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
    for batch_size in args.batch_size:
        compare(dataset, batch_size, args.threads)


def compare(dataset: TrainDataset, batch_size: int, threads: int) -> None:
    """Both arms at one batch size, printed as a table and the ratio."""
    print(
        f"model: tiny Qwen3 target 4 x 64, drafter 2 x 64, block {BLOCK}, {ANCHORS} anchors per "
        f"row, batch {batch_size}, CPU, {threads} threads, training_seq_len {SEQ_LEN}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        results = run_interleaved(dataset, batch_size, Path(tmp))
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
        f"batch {batch_size}: packed / padded supervised tokens per second: "
        f"{packed['supervised_per_s'] / padded['supervised_per_s']:.2f}x; fill packed / padded "
        f"{packed['fill'] / padded['fill']:.2f}x (supervised tokens trained: padded "
        f"{padded['supervised']}, packed {packed['supervised']}; packing drops an incomplete "
        "last batch of rows)"
    )


if __name__ == "__main__":
    main()
