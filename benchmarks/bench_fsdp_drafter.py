"""Per-rank memory and step time of the drafter replicated (DDP) and sharded (FSDP2), 2 gloo ranks.

Trains the embedded tiny target's recipe with a larger drafter (8 layers, intermediate size
4096: about 13 M parameters, all of it trained) on two CPU ranks, once with
``training.fsdp: false`` (DDP: every rank holds the whole drafter, its gradients and AdamW's
moments) and once with ``training.fsdp: true`` (the target and the drafter sharded), in one
invocation, interleaved round by round. Each rank reports:

- the drafter's training state it holds after the last step: its parameters, gradients and
  AdamW's moments, summed over the tensors this rank stores (its shard under FSDP), exact;
- its peak resident set (``ru_maxrss``: also the target, torch and Python, so the sharded
  state is a smaller part of it);
- the median wall time of an optimiser step (the gaps between consecutive AdamW steps, timed
  by an optimizer step hook, the first left out), checkpoints and evaluation off.

Each rank trains through ``run``'s own ``setup`` and ``fit`` (the step from
``train_step.build_step``, each step one ``optimizer_step``; issue 53); nothing of the step is
replaced (the one patch is the save decision, so that no checkpoint is written).

Prints each figure and its ratio against the DDP baseline of the same invocation (machines
here are noisy and shared: compare ratios, not seconds).

    python benchmarks/bench_fsdp_drafter.py
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _measure  # noqa: F401  (puts tests/ on sys.path for testkit)

STEPS = 12
ROUNDS = 2
DRAFTER = (
    "dflash.dflash_architecture_config.num_hidden_layers=8",
    "dflash.dflash_architecture_config.intermediate_size=4096",
    "dflash.dflash_architecture_config.target_layer_ids=[1,3,5]",
)
RUN = (
    f"training.max_steps={STEPS}",
    f"training.save_steps={STEPS * 10}",
    "training.eval_steps=0",
    "training.logging_steps=4",
    "training.per_device_train_batch_size=2",
)


def _worker(out: str, report: str, *overrides: str) -> None:
    """One rank: set the run up, train STEPS steps without saving, report what it measured."""
    import torch
    from testkit.compiling import tiny_scratch_plan

    from dflash_recipes.executor.dist_env import detect_dist_env, init_distributed
    from dflash_recipes.executor.sharded_drafter import local_tensor
    from dflash_recipes.executor.signals import SignalWatch
    from dflash_recipes.executor.training.fit import fit, setup
    from dflash_recipes.executor.training.save_policy import SavePolicy

    torch.set_num_threads(1)
    plan = tiny_scratch_plan(Path(out), *overrides)
    env = detect_dist_env("cpu")
    init_distributed(env, timeout_s=600)
    SavePolicy.due = lambda self, step, *, asked: False  # type: ignore[method-assign]
    run = setup(plan, env, None, verify_capture=False)
    optimizer = run.optimization.optimizer
    steps: list[float] = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(time.perf_counter()))
    fit(run, SignalWatch(), None, show_progress=False)
    state_bytes = 0
    for param in run.models.trainable:
        state_bytes += local_tensor(param).nbytes
        if param.grad is not None:
            state_bytes += local_tensor(param.grad).nbytes
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor):
                state_bytes += local_tensor(value).nbytes
    gaps = [b - a for a, b in itertools.pairwise(steps)][1:]
    result = {
        "rank": env.rank,
        "state_bytes": state_bytes,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(gaps),
        "parameters": sum(p.numel() for p in run.models.drafter.state_dict().values()),
    }
    Path(report, f"rank{env.rank}.json").write_text(json.dumps(result), encoding="utf-8")
    run.data.close()
    run.trackers.close("finished")
    os._exit(0)  # the process group's teardown is not what is measured


def _launch(kind: str, folder: Path) -> list[dict[str, float]]:
    from testkit.ranks import run_ranks

    report = folder / f"report-{kind}"
    report.mkdir()
    out = folder / f"run-{kind}"
    argv = [sys.executable, __file__, str(out), str(report), *RUN, *DRAFTER, f"training.{kind}"]
    for rank, result in enumerate(run_ranks(argv, what=kind, timeout=900)):
        if result.returncode != 0:
            raise SystemExit(f"{kind} rank {rank} failed:\n{result.stderr[-3000:]}")
    return [json.loads((report / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    kinds = {"DDP": "fsdp=false", "FSDP2": "fsdp=true"}
    runs: dict[str, list[list[dict[str, float]]]] = {name: [] for name in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        for index in range(ROUNDS):
            for name, kind in kinds.items():
                folder = Path(tmp, f"{name}-{index}")
                folder.mkdir()
                runs[name].append(_launch(kind, folder))
    params = int(runs["DDP"][0][0]["parameters"])
    print(
        f"drafter: {params / 1e6:.1f} M parameters (float32 master weights), 2 gloo ranks, "
        f"{STEPS} steps x {ROUNDS} rounds, median step time"
    )
    base: dict[int, dict[str, float]] = {}
    header = f"{'':6} {'rank':>4} {'state MiB':>10} {'x DDP':>6} {'peak RSS MiB':>13} {'x DDP':>6}"
    print(header + f" {'step ms':>8} {'x DDP':>6}")
    for name in kinds:
        for rank in range(2):
            state = statistics.median(r[rank]["state_bytes"] for r in runs[name])
            rss = statistics.median(r[rank]["max_rss_bytes"] for r in runs[name])
            step = statistics.median(r[rank]["step_s"] for r in runs[name])
            if name == "DDP":
                base[rank] = {"state": state, "rss": rss, "step": step}
            ref = base[rank]
            print(
                f"{name:6} {rank:>4} {state / 2**20:>10.1f} {state / ref['state']:>6.2f} "
                f"{rss / 2**20:>13.1f} {rss / ref['rss']:>6.2f} {step * 1e3:>8.1f} "
                f"{step / ref['step']:>6.2f}"
            )


if __name__ == "__main__":
    if "RANK" in os.environ:
        _worker(*sys.argv[1:])
    else:
        main()
