"""Offline training from a capture vs online training, on the demo target and a wider one.

    python benchmarks/bench_offline.py [--steps 8] [--rounds 2] [--wide-hidden 512]
        [--wide-layers 8]

For each target (the shipped demo target, then a random Qwen3 target that is wider and deeper,
saved to a temporary folder with the demo tokenizer):

1. ``capture``: the demo data through the target once; prints the capture throughput in tokens/s
   and the bytes on disk per token against the estimate the command checks the disk with;
2. training steps online (the target's decoder every step) and offline (taps read from the
   capture), interleaved round by round in this process; the step figure is the trainer's own
   tokens/s per logged step (median, the first step of each run left out as warm-up).

Prints offline/online speed ratios measured in this run: the ratio grows with the cost of the
target's forward relative to the drafter's step, which is the case offline training is for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _measure import write_wide_target

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.executor.data.capture import capture_plan
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.files.capture_manifest import read_manifest
from dflash_recipes.plan.run_plan import RunPlan

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny" / "tiny_scratch.yaml"
DEMO_TARGET = REPO / "dflash_recipes" / "demo_data" / "target"


def _plan(target: Path, out: Path, steps: int, capture: Path | None) -> RunPlan:
    overrides = [
        f"model.model_name_or_path={target}",
        f"training.output_dir={out}",
        f"training.max_steps={steps}",
        "training.per_device_train_batch_size=4",
        "training.training_seq_len=128",
        f"training.save_steps={steps}",
        "training.logging_steps=1",
        "training.eval_steps=null",
        "dflash.dflash_block_size=8",
        "dflash.dflash_num_anchors=8",
    ]
    if capture is not None:
        overrides.append(f"data.hidden_states_path={capture}")
    result = compile_file(RECIPE, overrides=overrides)
    if result.plan is None:
        raise SystemExit("\n".join(str(d) for d in result.diagnostics))
    return result.plan


def _step_rates(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [float(r["tokens_per_second"]) for r in rows if r["kind"] == "train"]
    return rates[1:]  # the first step pays one-off costs


def _bench(name: str, target: Path, work: Path, steps: int, rounds: int) -> float:
    capture = work / "capture"
    plan = _plan(target, work / "capture-run", steps, None)
    started = time.perf_counter()
    summary = capture_plan(plan, capture, max_shard_bytes=2**20, progress=False)
    seconds = time.perf_counter() - started
    manifest = read_manifest(capture)
    per_token = summary.bytes_on_disk / summary.num_tokens
    estimated = summary.estimated_bytes / summary.num_tokens
    print(f"[{name}] hidden {manifest.hidden_size}, taps {list(manifest.target_layer_ids)}")
    print(
        f"[{name}] capture: {summary.num_tokens} tokens in {seconds:.2f} s "
        f"({summary.num_tokens / seconds:,.0f} tokens/s, model load included)"
    )
    print(
        f"[{name}] bytes on disk per token {per_token:.1f}, estimate {estimated:.1f} "
        f"(on disk / estimate = {per_token / estimated:.4f})"
    )
    online: list[float] = []
    offline: list[float] = []
    for round_ in range(rounds):
        for kind, rates in (("online", online), ("offline", offline)):
            out = work / f"{kind}-{round_}"
            source = capture if kind == "offline" else None
            run_plan(_plan(target, out, steps, source), progress=False)
            rates.extend(_step_rates(out))
    on, off = statistics.median(online), statistics.median(offline)
    print(f"[{name}] step speed: online {on:,.0f} tok/s, offline {off:,.0f} tok/s")
    print(f"[{name}] offline / online = {off / on:.2f}x")
    return off / on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--wide-hidden", type=int, default=512)
    parser.add_argument("--wide-layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import logging

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-offline-") as tmp:
        root = Path(tmp)
        demo = _bench("demo target", DEMO_TARGET, root / "demo", args.steps, args.rounds)
        wide_dir = write_wide_target(root / "wide-target", args.wide_hidden, args.wide_layers)
        wide = _bench(
            f"wide target ({args.wide_hidden} x {args.wide_layers} layers)",
            wide_dir,
            root / "wide",
            args.steps,
            args.rounds,
        )
    print(f"offline / online: demo target {demo:.2f}x, wide target {wide:.2f}x")


if __name__ == "__main__":
    main()
