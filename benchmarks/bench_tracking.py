"""What logging every step to TensorBoard, MLflow and W&B costs a training step (issue 21).

    python benchmarks/bench_tracking.py [--steps 60] [--rounds 5]

The tiny from-scratch recipe (tests' small run: batch 2, four blocks of four, sequences of 64
tokens, a row logged every step) trains `--steps` steps with ``report_to: []`` and with
``report_to: [tensorboard, mlflow, wandb]`` (MLflow on a sqlite store, W&B offline, both in a
temporary folder), interleaved round by round (the order flips every round) in this one
process, one torch thread in both arms, after one warm-up run of each.

What is timed: from the row of step 1 until every row of the last step has been delivered
to every tracker (the benchmark flushes the trackers right after the last row: work a tracker
still holds back is counted, not left to run after the clock stops), per step after the first.
The trackers' one-off cost (starting the tracker process, opening and closing the runs) is not
a step's cost and is printed on its own line. Beside the wall time, the CPU time per step of
this process (the trainer, all its threads) and of its child processes (the tracker process and
W&B's service, which use another core when one is free): the part of the cost that a busy
machine's noise does not blur. Figures are medians over the rounds; each round's ratio is
printed too, because the machine may be shared. Target: the trackers cost at most 5% of the
step time (with / without <= 1.05).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from _measure import REPO  # noqa: F401 (puts tests/ on sys.path for testkit)
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.trackers.fanout import TrackerSet

CONFIGS = {
    "report_to: []": "training.report_to=[]",
    "report_to: [tensorboard, mlflow, wandb]": "training.report_to=[tensorboard,mlflow,wandb]",
}


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds used so far by this process (all its threads) and by its live descendants
    (the tracker process and W&B's service), from /proc."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
            used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    mine, children = {os.getpid()}, 0.0
    changed = True
    while changed:
        changed = False
        for pid, parent in parents.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                children += used[pid]
                changed = True
    return own.ru_utime + own.ru_stime, children


class _Clock:
    """Times a run's steps from the train row of step 1 to the last row's full delivery."""

    def __init__(self, last_step: int) -> None:
        self.last_step = last_step
        self.started = self.delivered = float("nan")
        self.cpu_started = self.cpu_delivered = (0.0, 0.0)

    def __enter__(self) -> _Clock:
        log_row = TrackerSet.log_row
        clock = self

        def timed(trackers: TrackerSet, row: Mapping[str, object]) -> None:
            log_row(trackers, row)
            if row.get("kind") == "train" and row.get("step") == 1:
                clock.started = time.perf_counter()
                clock.cpu_started = _cpu_seconds()
            if row.get("kind") == "train" and row.get("step") == clock.last_step:
                trackers.flush()  # the trackers' backlog is part of the steps' cost
                clock.delivered = time.perf_counter()
                clock.cpu_delivered = _cpu_seconds()

        self._original = log_row
        TrackerSet.log_row = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        TrackerSet.log_row = self._original  # type: ignore[method-assign]


def _run(root: Path, name: str, trackers: str, steps: int) -> tuple[float, float, float, float]:
    """Per step after the first: wall seconds, this process's CPU seconds, its descendants'
    CPU seconds; and the seconds of the whole run_plan call."""
    plan = tiny_scratch_plan(
        root / name,
        f"training.max_steps={steps}",
        f"training.save_steps={steps}",
        "training.eval_steps=null",
        trackers,
    )
    started = time.perf_counter()
    with _Clock(steps) as clock:
        summary = run_plan(plan, progress=False)
    total = time.perf_counter() - started
    assert summary.steps == steps and summary.tracker_problems == (), summary.tracker_problems
    own = (clock.cpu_delivered[0] - clock.cpu_started[0]) / (steps - 1)
    children = (clock.cpu_delivered[1] - clock.cpu_started[1]) / (steps - 1)
    return (clock.delivered - clock.started) / (steps - 1), own, children, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both arms)")
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
        for index, trackers in enumerate(CONFIGS.values()):
            _run(root, f"warm-{index}", trackers, 3)
        step: dict[str, list[float]] = {label: [] for label in CONFIGS}
        whole: dict[str, list[float]] = {label: [] for label in CONFIGS}
        cpu: dict[str, list[tuple[float, float]]] = {label: [] for label in CONFIGS}
        for round_index in range(args.rounds):
            order = list(CONFIGS.items())
            if round_index % 2:
                order.reverse()
            for label, trackers in order:
                name = f"r{round_index}-{len(label)}"
                seconds, own, children, total = _run(root, name, trackers, args.steps)
                step[label].append(seconds)
                whole[label].append(total)
                cpu[label].append((own, children))
    base_label, tracked_label = CONFIGS
    print(
        f"tiny shape, {args.steps} steps logged every step, {args.rounds} rounds "
        f"(torch threads {args.threads}, {os.cpu_count()} cores), medians"
    )
    for label, values in step.items():
        own = statistics.median(c[0] for c in cpu[label]) * 1e3
        children = statistics.median(c[1] for c in cpu[label]) * 1e3
        print(
            f"  {label:42s} {statistics.median(values) * 1e3:8.2f} ms per step "
            f"(CPU per step: trainer process {own:.2f} ms, its child processes {children:.2f} ms)"
        )
    rounds = [t / b for b, t in zip(step[base_label], step[tracked_label], strict=True)]
    print("  ratio per round: " + " ".join(f"{r:.3f}" for r in rounds))
    one_off = statistics.median(
        (w - s * (args.steps - 1)) - (wb - sb * (args.steps - 1))
        for w, s, wb, sb in zip(
            whole[tracked_label],
            step[tracked_label],
            whole[base_label],
            step[base_label],
            strict=True,
        )
    )
    print(
        f"  one-off per run (start the tracker process, open and close the runs): {one_off:.1f} s"
    )
    ratio = statistics.median(step[tracked_label]) / statistics.median(step[base_label])
    verdict = "ok" if ratio <= 1.05 else "over"
    print(f"  with trackers / without: {ratio:.3f} (target <= 1.05): {verdict}")


if __name__ == "__main__":
    main()
