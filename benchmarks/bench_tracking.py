"""What logging every step to TensorBoard, MLflow and W&B costs a training step (issue 21).

    python benchmarks/bench_tracking.py [--steps 30] [--rounds 3]

The tiny from-scratch recipe (tests' small run: batch 2, four blocks of four, sequences of 64
tokens, a row logged every step) trains `--steps` steps with ``report_to: []`` and with
``report_to: [tensorboard, mlflow, wandb]`` (MLflow on a sqlite store, W&B offline, both in a
temporary folder), interleaved round by round in this one process. The figure is the
trainer's own step time (the summary's tokens per second: the steps and the logging between
them, without setup, checkpoints or export); medians over the rounds. Target: the trackers
cost at most 5% of the step time (with / without <= 1.05).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
from _measure import REPO  # noqa: F401 (puts tests/ on sys.path for testkit)
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.training.trainer import run_plan

CONFIGS = {
    "report_to: []": "training.report_to=[]",
    "report_to: [tensorboard, mlflow, wandb]": "training.report_to=[tensorboard,mlflow,wandb]",
}


def _step_seconds(root: Path, name: str, trackers: str, steps: int) -> float:
    plan = tiny_scratch_plan(
        root / name,
        f"training.max_steps={steps}",
        f"training.save_steps={steps}",
        "training.eval_steps=null",
        trackers,
    )
    summary = run_plan(plan, progress=False)
    tokens_per_step = summary.tokens_per_second  # tokens / (steps and logging) seconds
    return 1.0 / tokens_per_step if tokens_per_step > 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        root = Path(tmp)
        os.environ.update(
            MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}",
            WANDB_MODE="offline",
            WANDB_DIR=str(root / "wandb"),
            WANDB_SILENT="true",
        )
        # Warm-up: first imports and the MLflow store's tables are not a step's cost.
        for label, trackers in CONFIGS.items():
            _step_seconds(root, f"warm-{len(label)}", trackers, 2)
        seconds: dict[str, list[float]] = {label: [] for label in CONFIGS}
        for round_index in range(args.rounds):
            order = list(CONFIGS.items())
            if round_index % 2:
                order.reverse()
            for label, trackers in order:
                name = f"r{round_index}-{len(label)}"
                seconds[label].append(_step_seconds(root, name, trackers, args.steps))
    # Per token, so the two configurations compare whatever the batch's token count.
    base, tracked = (statistics.median(v) for v in seconds.values())
    print(f"tiny shape, {args.steps} steps logged every step, {args.rounds} rounds, medians")
    for label, values in seconds.items():
        per_token_us = statistics.median(values) * 1e6
        print(f"  {label:42s} {per_token_us:8.1f} us per trained token")
    ratio = tracked / base
    verdict = "ok" if ratio <= 1.05 else "over"
    print(f"  with trackers / without: {ratio:.3f} (target <= 1.05): {verdict}")


if __name__ == "__main__":
    main()
