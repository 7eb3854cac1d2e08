"""Training through a served target (``target_server``) against the target in the trainer.

    python benchmarks/bench_target_server.py [--latency-ms 50] [--rounds 3] [--steps 10]
        [--hidden 768] [--layers 8] [--batch 4] [--seq 128]

A random Qwen3 target of a few hundred MB (``--hidden``, ``--layers``, float32, the demo
tokenizer) is served by the tests' local server that answers as vLLM does
(``tests/testkit/vllm_server.py``: the HTTP answer, the safetensors file and its lock), with
``--latency-ms`` added to every request. Two arms train the same plan shape with the real
``fit``, each in a fresh child process (so its peak RSS is its own, measured with GNU time):

- ``in-process``: the target in the trainer, as without ``target_server``;
- ``served``: the trainer holds only the target's embeddings, final norm and lm_head; each
  batch's conversations are asked for on the prefetch thread, ahead of the step.

Prints the median milliseconds per optimiser step (``fit`` alone, setup excluded) and the peak
RSS of each arm, and their ratios: the requests should hide behind the steps (the served step
within 10% of the in-process step, which also runs the target's forward here, so on a CPU the
served arm is usually faster) and the served trainer's memory should lack the decoder layers.
The arms alternate round by round after one warm-up round.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _measure import Command, print_table, run_child, write_wide_target
from testkit.compiling import tiny_served_recipe

REPO = Path(__file__).resolve().parents[1]
ARMS = ("in-process", "served")


def _recipe(folder: Path, target: Path, url: str | None, storage: Path) -> Path:
    path = folder / f"recipe-{'served' if url else 'local'}.yaml"
    return tiny_served_recipe(path, None if url is None else [url], storage, target=target)


def child(args: argparse.Namespace) -> None:
    """One arm's run in this process: prints ``{"ms_per_step": ...}``."""
    import torch

    from dflash_recipes.compiler.compilation import compile_file
    from dflash_recipes.executor.dist_env import detect_dist_env
    from dflash_recipes.executor.signals import SignalWatch
    from dflash_recipes.executor.training.fit import fit, setup

    torch.set_num_threads(1)
    logging.disable(logging.INFO)
    result = compile_file(
        Path(args.recipe),
        overrides=(
            f"training.output_dir={args.output}",
            f"training.max_steps={args.steps}",
            f"training.logging_steps={args.steps}",
            f"training.save_steps={args.steps}",
            "training.eval_steps=0",
            f"training.per_device_train_batch_size={args.batch}",
            f"training.training_seq_len={args.seq}",
        ),
    )
    assert result.plan is not None, [str(d) for d in result.diagnostics]
    plan = result.plan
    run = setup(plan, detect_dist_env("cpu", {}), None, verify_capture=False)
    try:
        started = time.perf_counter()
        progress = fit(run, SignalWatch(), None, show_progress=False)
        seconds = time.perf_counter() - started
    finally:
        run.trackers.close("finished")
        run.data.close()
    assert progress.done == args.steps
    print(json.dumps({"ms_per_step": seconds / args.steps * 1e3}))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from testkit.vllm_server import launch, wait_for_port

    from dflash_recipes.compiler.compilation import compile_file

    ms: dict[str, list[float]] = {arm: [] for arm in ARMS}
    rss: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        target = write_wide_target(folder / "target", args.hidden, args.layers)
        weights = sum(p.stat().st_size for p in target.glob("*.safetensors"))
        storage = folder / "shm"
        storage.mkdir()
        probe = compile_file(_recipe(folder, target, "http://127.0.0.1:1", storage))
        assert probe.plan is not None, [str(d) for d in probe.diagnostics]
        assert probe.plan.target_server is not None
        served_plan = probe.plan.target_server
        assert served_plan.vllm_layer_ids is not None
        server = wait_for_port(
            launch(
                target,
                storage,
                list(served_plan.vllm_layer_ids),
                dtype="float32",
                served_name=served_plan.served_model_name,
                knobs={"delay_ms": args.latency_ms},
            )
        )
        url = f"http://127.0.0.1:{server.port}"
        recipes = {
            "in-process": _recipe(folder, target, None, storage),
            "served": _recipe(folder, target, url, storage),
        }
        try:
            for index in range(args.rounds + 1):  # round 0 warms up
                for arm in ARMS if index % 2 == 0 else ARMS[::-1]:
                    argv = [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--child",
                        f"--recipe={recipes[arm]}",
                        f"--output={folder / f'{arm}-{index}'}",
                        f"--steps={args.steps}",
                        f"--batch={args.batch}",
                        f"--seq={args.seq}",
                    ]
                    sample = run_child(Command(argv, capture=True), REPO)
                    if sample.returncode != 0:
                        raise SystemExit(f"{arm} exited {sample.returncode}")
                    if index > 0:
                        ms[arm].append(json.loads(sample.stdout.splitlines()[-1])["ms_per_step"])
                        rss[arm].append(sample.max_rss_kb / 1024)
        finally:
            server.stop()
    median_ms = {arm: statistics.median(v) for arm, v in ms.items()}
    median_rss = {arm: statistics.median(v) for arm, v in rss.items()}
    print(
        f"target: Qwen3 {args.layers} layers, hidden {args.hidden}, float32, "
        f"{weights / 2**20:.0f} MiB of weights; batch {args.batch} x {args.seq} tokens, "
        f"{args.steps} steps per run, server latency {args.latency_ms:g} ms per request, "
        f"{args.rounds} interleaved rounds (medians), one torch thread per process"
    )
    rows = [
        [
            arm,
            f"{median_ms[arm]:.1f}",
            f"{median_rss[arm]:.0f}",
            " ".join(f"{v:.0f}" for v in ms[arm]),
        ]
        for arm in ARMS
    ]
    print_table(["arm", "ms / step", "peak RSS MiB", "rounds (ms / step)"], rows)
    print(
        f"served / in-process: step time {median_ms['served'] / median_ms['in-process']:.3f} "
        f"(target <= 1.10), peak RSS {median_rss['served'] / median_rss['in-process']:.3f}, "
        f"{median_rss['in-process'] - median_rss['served']:.0f} MiB less "
        f"(the decoder layers: {weights / 2**20:.0f} MiB of weights)"
    )


if __name__ == "__main__":
    main()
