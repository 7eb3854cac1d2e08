"""DFlash 2 on the demo's tiny target: measured tau with and without the candidate selector.

The demo's story with a DFlash 2 fine-tune beside the DFlash 1 one, all in one run:

1. ``recipes/tiny/tiny_released.yaml``: a DFlash 1 drafter trained from scratch at block size
   8 and exported (the "released" drafter);
2. ``recipes/tiny/tiny_finetune.yaml`` warm-started from it, as the demo does (DFlash 1, the
   baseline);
3. the same recipe with ``projector_type: dflash2`` (the backbone warm-starts from the same
   export; convolutions and selector start as the identity and a zero successor codebook), the
   same data, steps and seed;
4. speculative decoding of the same held-out prompts (greedy verification, lossless): DFlash 1's
   tau, DFlash 2's tau with the selector's greedy path and without it (the unary argmax path);
   with ``--temperature T`` sampled verification at T instead (``eval --temperature``: the
   selector draws among its top-K candidates, the unary path from the whole vocabulary, every
   run from the same seed).

Prints every tau and the ratios against the DFlash 1 fine-tune measured in the same run. The
tiny target's figures say whether the pieces work together, not what DFlash 2 buys at scale
(the published +21% tau is on 4B-27B targets with about a million training conversations).

Usage: ``python benchmarks/bench_dflash2_selector.py [--steps 60] [--prompts 24]
[--alpha 1.0] [--temperature 0] [--out DIR]``
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _measure  # noqa: F401 (puts tests/ on sys.path for testkit)
import torch

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.diagnostics import render_text
from dflash_recipes.executor.evaluation.evaluate import AcceptanceReport, run_eval
from dflash_recipes.executor.evaluation.sampling import Sampling
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.files.run_dir import EXPORT_DIR
from dflash_recipes.plan.run_plan import RunPlan

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny"
PROMPTS = REPO / "dflash_recipes" / "demo_data" / "data" / "eval.jsonl"
ARCH = "dflash.dflash_architecture_config"
#: DFlash 2 sizes for the tiny drafter (hidden 128): the releases' kernel 2, groups of 16 and
#: top-16; rank 32 (the releases' 256 is for a 5120-wide drafter).
DFLASH2 = (
    f"{ARCH}.projector_type=dflash2",
    f"{ARCH}.conv_kernel_size=2",
    f"{ARCH}.conv_group_size=16",
    f"{ARCH}.selector_rank=32",
    f"{ARCH}.selector_top_k=16",
)


def _compile(name: str, overrides: list[str]) -> RunPlan:
    result = compile_file(TINY / name, overrides)
    if result.plan is None:
        raise SystemExit(render_text(list(result.diagnostics)))
    return result.plan


def _eval(plan: RunPlan, prompts: int, temperature: float) -> AcceptanceReport:
    export = Path(plan.training.output_dir) / EXPORT_DIR
    sampling = Sampling(temperature=temperature) if temperature > 0 else None
    return run_eval(plan, export, PROMPTS, num_prompts=prompts, sampling=sampling)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="fine-tune steps (the demo's 60)")
    parser.add_argument(
        "--prompts", type=int, default=12, help="held-out prompts (demo: 12, all of eval.jsonl)"
    )
    parser.add_argument("--alpha", type=float, default=1.0, help="dflash_selector_loss_alpha")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampled verification at T (0: greedy)"
    )
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: temp)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.out or Path(tmp)
        started = time.perf_counter()
        released = _compile("tiny_released.yaml", [f"training.output_dir={runs / 'released'}"])
        run_plan(released, progress=False)
        init = f"dflash.dflash_init_checkpoint={runs / 'released' / EXPORT_DIR}"
        common = [init, f"training.max_steps={args.steps}", f"training.save_steps={args.steps}"]
        dflash1 = _compile(
            "tiny_finetune.yaml", [f"training.output_dir={runs / 'dflash1'}", *common]
        )
        dflash2 = _compile(
            "tiny_finetune.yaml",
            [
                f"training.output_dir={runs / 'dflash2'}",
                *common,
                *DFLASH2,
                f"dflash.dflash_selector_loss_alpha={args.alpha}",
            ],
        )
        one = run_plan(dflash1, progress=False)
        two = run_plan(dflash2, progress=False)
        base = _eval(dflash1, args.prompts, args.temperature)
        report = _eval(dflash2, args.prompts, args.temperature)
        seconds = time.perf_counter() - started
    unary = report.tau_without_head
    assert unary is not None, "a DFlash 2 eval reports the unary argmax path's tau"
    print(f"tiny target, {args.steps} fine-tune steps from the same DFlash 1 export, block 16,")
    how = (
        f"sampled verification at temperature {args.temperature:g}, seed 0"
        if args.temperature > 0
        else "greedy verification"
    )
    print(f"{args.prompts} held-out prompts, {how} ({seconds:.0f} s in all)")
    print(
        f"  final train loss: dflash1 {one.final_loss:.4f}, dflash2 {two.final_loss:.4f} "
        f"(the unary loss + {args.alpha:g} x the selector's)"
    )
    print(f"  dflash1 fine-tune            tau {base.tau:.3f}  lossless {base.lossless}")
    print(
        f"  dflash2, selector path       tau {report.tau:.3f}  lossless {report.lossless}  "
        f"({report.tau / base.tau:.3f}x dflash1)"
    )
    print(
        f"  dflash2, unary path          tau {unary:.3f}  "
        f"({unary / base.tau:.3f}x dflash1; the selector adds {report.tau - unary:+.3f})"
    )


if __name__ == "__main__":
    main()
