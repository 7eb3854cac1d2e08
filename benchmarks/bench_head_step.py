"""The training step at the Domino shape: this code against the code before issue 25, one run.

    python benchmarks/bench_head_step.py [--before 58635a8] [--rounds 7] [--steps 3]
        [--threads 1]

Issue 25 changed what a Domino/DSpark step computes (next-token labels, position 0 scored,
the first ``pure_draft_prefix_len`` positions left to the backbone). This measures one training
micro-step (its inputs, the target and drafter forward, backward) of the same drafter, data and
anchors with two versions of the package:

- ``before``: the package at commit ``--before`` (default 58635a8, the commit issue 25 started
  from), unpacked with ``git archive`` into a temporary folder together with its own
  ``tests/testkit``; the micro-step as its trainer called it then (``step_inputs`` +
  ``DraftStep`` forward + backward, the anchors drawn before the clock starts);
- ``after``: this working tree, what ``run`` runs, through the step library (issue 53): the
  step of ``train_step.build_step`` (the in-memory target), each timed micro-step
  ``prepare_rows`` (anchors and the CPU split mask, which ``run`` prepares on its prefetch
  thread: counted here against this version) and ``train_step.micro_step`` (the micro-step
  ``optimizer_step`` runs; the optimiser itself is left out, as the old code cannot run it).

Each version runs in its own worker process (so both import their own ``dflash_recipes``);
rounds alternate between the workers (the order flips every round, so a noisy neighbour slows
both alike) after one discarded warm-up round; figures are medians of the per-round medians.
Both a Domino and a plain DFlash step are measured: the plain step's ratio is the noise floor
(its code did not change), the Domino ratio is the figure. Target: after / before <= 1.05 at
the Domino shape.

Domino shape: sequence 512, batch 2, 64 anchors, block 16, target 4 layers x 256 (vocab 4096),
drafter 2 layers x 256, emb_dim 256, gru_hidden_dim 256, float32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SHAPE = {
    "seq": 512,
    "batch": 2,
    "anchors": 64,
    "block_size": 16,
    "target_hidden_size": 256,
    "target_vocab_size": 4096,
    "emb_dim": 256,
    "gru_hidden_dim": 256,
}
KINDS = ("domino", "dflash")


# ---------------------------------------------------------------------------------------------
# worker: runs inside a process whose sys.path starts with one version's tree
# ---------------------------------------------------------------------------------------------


def _worker(steps: int, threads: int) -> None:
    import torch

    try:  # this tree: the step library (issue 53)
        from dflash_recipes.executor.training import train_step
    except ImportError:  # the package at --before
        _worker_before(steps, threads)
        return
    from testkit.tiny import tiny_plan, tiny_target

    from dflash_recipes.executor.dist_env import detect_dist_env
    from dflash_recipes.executor.model.draft import DFlashDraftModel

    torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-head-"))
    env = detect_dist_env("cpu", {})
    setups = {}
    for kind in KINDS:
        plan = tiny_plan(tmp, **_plan_fields(kind))
        step = train_step.build_step(plan, env=env, target=tiny_target(plan, seed=0))
        torch.manual_seed(1)  # the before worker's drafter, value for value
        step.models.drafter.load_state_dict(DFlashDraftModel(plan.resolved_draft()).state_dict())
        step.models.training_modes()
        gen = torch.Generator().manual_seed(2)
        ids = torch.randint(0, 100, (SHAPE["batch"], SHAPE["seq"]), generator=gen)
        setups[kind] = (step, ids)

    def one(kind: str) -> float:
        step, ids = setups[kind]
        started = time.perf_counter()
        prepared = train_step.prepare_rows(
            step, ids, torch.ones_like(ids), next_index=SHAPE["batch"]
        )
        train_step.micro_step(step, prepared, index=1)
        elapsed = time.perf_counter() - started
        step.models.drafter.zero_grad(set_to_none=True)
        return elapsed

    _serve(one, steps)


def _plan_fields(kind: str) -> dict[str, object]:
    head = (
        {"emb_dim": SHAPE["emb_dim"], "gru_hidden_dim": SHAPE["gru_hidden_dim"]}
        if kind == "domino"
        else {}
    )
    return {
        "projector_type": kind,
        "block_size": SHAPE["block_size"],
        "num_anchors": SHAPE["anchors"],
        "training_seq_len": SHAPE["seq"],
        "target_hidden_size": SHAPE["target_hidden_size"],
        "target_vocab_size": SHAPE["target_vocab_size"],
        "target_max_position_embeddings": 4096,
        "max_steps": 10,
        **head,
    }


def _serve(one: Callable[[str], float], steps: int) -> None:
    """Answer each kind named on stdin with the median seconds of `steps` micro-steps."""
    for line in sys.stdin:
        kind = line.strip()
        if not kind:
            continue
        times = [one(kind) for _ in range(steps)]
        print(json.dumps({"kind": kind, "seconds": statistics.median(times)}), flush=True)


def _worker_before(steps: int, threads: int) -> None:
    """The baseline: the micro-step as the package at --before assembled it."""
    import torch
    from testkit.tiny import tiny_plan, tiny_target

    from dflash_recipes.executor.model.convert import lm_head
    from dflash_recipes.executor.model.draft import DFlashDraftModel
    from dflash_recipes.executor.training.anchors import sample_batch_anchors

    try:
        from dflash_recipes.executor.data.train_dataset import Batch
    except ImportError:  # its name before the executor's split (ee14a11)
        from dflash_recipes.executor.data.conversations import Batch  # type: ignore[no-redef]
    from dflash_recipes.executor.training.step import DraftStep, step_inputs

    torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-head-"))
    setups = {}
    for kind in KINDS:
        plan = tiny_plan(tmp, **_plan_fields(kind))
        spec = plan.resolved_draft()
        target = tiny_target(plan, seed=0)
        torch.manual_seed(1)
        drafter = DFlashDraftModel(spec)
        gen = torch.Generator().manual_seed(2)
        ids = torch.randint(0, 100, (SHAPE["batch"], SHAPE["seq"]), generator=gen)
        ones = torch.ones_like(ids)
        batch = Batch(
            input_ids=ids, attention_mask=ones, loss_mask=ones, epoch=0, next_index=SHAPE["batch"]
        )
        drawn = sample_batch_anchors(
            batch,
            positions=list(range(SHAPE["batch"])),
            seed=0,
            block_size=spec.block_size,
            num_anchors=SHAPE["anchors"],
        )
        step = DraftStep(drafter, lm_head(target), plan.draft.objective)
        setups[kind] = (target, spec, plan.draft.objective, batch, drawn, step)

    def one(kind: str) -> float:
        target, spec, objective, batch, drawn, step = setups[kind]
        started = time.perf_counter()
        inputs = step_inputs(target, spec, objective, batch, drawn, step=1, total_steps=10)
        out = step(inputs)
        out.loss.backward()
        elapsed = time.perf_counter() - started
        step.drafter.zero_grad(set_to_none=True)
        return elapsed

    _serve(one, steps)


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def _unpack(commit: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, "dflash_recipes", "tests"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def _start(root: Path, steps: int, threads: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--worker", str(steps), str(threads)],
        cwd=root,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _ask(worker: subprocess.Popen[str], kind: str) -> float:
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write(kind + "\n")
    worker.stdin.flush()
    reply = json.loads(worker.stdout.readline())
    return float(reply["seconds"])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="58635a8", help="commit of the code before")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steps per round (median)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-head-before-") as folder:
        before_root = Path(folder)
        _unpack(args.before, before_root)
        workers = {
            "before": _start(before_root, args.steps, args.threads),
            "after": _start(REPO, args.steps, args.threads),
        }
        times: dict[tuple[str, str], list[float]] = {}
        try:
            for round_index in range(args.rounds + 1):
                order = ["before", "after"] if round_index % 2 == 0 else ["after", "before"]
                for kind in KINDS:
                    for version in order:
                        seconds = _ask(workers[version], kind)
                        if round_index:  # round 0 warms up
                            times.setdefault((version, kind), []).append(seconds)
        finally:
            for worker in workers.values():
                assert worker.stdin is not None
                worker.stdin.close()
                worker.wait()
    print(
        f"training micro-step at the Domino shape {SHAPE}, {args.rounds} rounds x "
        f"{args.steps} steps, {args.threads} thread(s), before = {args.before}"
    )
    print(f"{'step':<8} {'before s':>10} {'after s':>10} {'after/before':>13}")
    ratios = {}
    for kind in KINDS:
        before = statistics.median(times[("before", kind)])
        after = statistics.median(times[("after", kind)])
        ratios[kind] = after / before
        print(f"{kind:<8} {before:>10.3f} {after:>10.3f} {ratios[kind]:>13.3f}")
    relative = ratios["domino"] / ratios["dflash"]
    print(f"domino ratio relative to the unchanged dflash step's ratio: {relative:.3f}")
    verdict = "PASS" if ratios["domino"] <= 1.05 else "FAIL"
    print(f"{verdict}: domino after/before {ratios['domino']:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
