"""Peak memory and time of one training step at a 152k vocabulary: chunked vs whole-batch loss.

    python benchmarks/bench_chunked_loss.py [--blocks 128] [--block 16] [--vocab 151936]

The drafter's logits ``[B, N, K, vocab]`` are the largest tensors of a DFlash step (512 blocks
of 16 at Qwen3's 151936 rows: 5 GB in float32, plus the copies the loss keeps for backward).
`DraftStep` computes lm_head, head and loss per chunk of blocks under activation checkpointing
when they exceed `MAX_CHUNK_LOGITS`. This script builds a small random target with Qwen3's
vocabulary (hidden 64, so the logits dominate), runs one step in a fresh process per variant and
reports the growth of the process's peak resident memory during that step, and the step's time,
both variants measured in the same run. A check first confirms both give the same loss.

The step is what ``run`` runs (issue 53): ``train_step.build_step`` with the variant's
``max_chunk_logits`` (``run --max-chunk-logits``), the rows through ``prepare_rows`` (before
the clock starts: ``run`` prepares them on its prefetch thread) and one ``optimizer_step``
(target forward, draft forward, loss, backward, clipping, AdamW). The ``bmm lm_head`` baseline
swaps the one phase function it is about (``step._lm_head_logits``) for its old form.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny" / "tiny_scratch.yaml"


def _make_target(directory: Path, vocab: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)


def _child(
    target: Path, blocks: int, block: int, seq: int, budget: int | None, as_is: bool
) -> None:
    import torch

    from dflash_recipes.compiler.compilation import compile_file
    from dflash_recipes.executor.dist_env import detect_dist_env
    from dflash_recipes.executor.training import step as step_module
    from dflash_recipes.executor.training.step import DraftStep
    from dflash_recipes.executor.training.train_step import (
        build_step,
        optimizer_step,
        prepare_rows,
    )

    if as_is:
        # The lm_head as it ran before it was made one 2-D GEMM: a chunk's strided
        # [B, n, K, H] view straight into nn.Linear (matmul falls back to a batched matmul).
        def batched(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
            weight = next(head.parameters())
            out: torch.Tensor = head(hidden.to(weight.dtype))
            return out.float()

        step_module._lm_head_logits = batched  # type: ignore[assignment]
    torch.set_num_threads(1)
    vocab = json.loads((target / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    mask_id = min(151669, vocab - 1)  # Qwen3's mask token, or the last id of a smaller vocabulary
    result = compile_file(
        RECIPE,
        overrides=(
            f"model.model_name_or_path={target}",
            "training.output_dir=/tmp/dflash-bench-unused",
            f"dflash.dflash_block_size={block}",
            f"dflash.dflash_num_anchors={blocks}",
            f"dflash.dflash_mask_token_id={mask_id}",
            "training.per_device_train_batch_size=1",
            f"training.training_seq_len={seq}",
        ),
    )
    assert result.plan is not None, result.diagnostics
    plan = result.plan
    spec = plan.resolved_draft()
    train = build_step(plan, env=detect_dist_env("cpu", {}), max_chunk_logits=budget)
    module = train.models.step
    assert isinstance(module, DraftStep)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, mask_id, (1, seq), generator=gen)
    prepared = prepare_rows(train, ids, torch.ones_like(ids), next_index=1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    out = optimizer_step(train, [prepared], index=0)
    elapsed = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    n_blocks = prepared.drawn.anchors.shape[1]
    print(
        json.dumps(
            {
                "loss": float(out.loss),
                "growth_mb": (peak - before) / 1024,
                "seconds": elapsed,
                "chunks": -(-n_blocks // module.blocks_per_chunk(1, n_blocks)),
                "logits_mb": n_blocks * block * spec.vocab_size * 4 / 2**20,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--child", nargs=3, metavar=("TARGET", "BUDGET", "AS_IS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        target, budget, as_is = args.child
        _child(Path(target), args.blocks, args.block, args.seq, int(budget) or None, as_is == "1")
        return

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "target"
        _make_target(target, args.vocab)
        # Whole batch: a budget larger than the logits. Chunked: the default budget. The third
        # is the chunked step with its lm_head as a batched matmul over blocks (as it was).
        variants = {
            "whole batch": (str(2**62), "0"),
            "chunked (default)": ("0", "0"),
            "chunked, bmm lm_head": ("0", "1"),
        }
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, (budget, as_is) in variants.items():
                command = [
                    sys.executable,
                    __file__,
                    "--child",
                    str(target),
                    budget,
                    as_is,
                    *("--blocks", str(args.blocks), "--block", str(args.block)),
                    *("--seq", str(args.seq)),
                ]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    first = runs["whole batch"][0]
    print(
        f"config: 1 sequence of {args.seq}, {args.blocks} blocks of {args.block}, vocab "
        f"{args.vocab}: the logits alone are {first['logits_mb']:.0f} MiB in float32; "
        f"target and drafter hidden 64; best of {args.repeats} fresh processes per variant"
    )
    losses = [run["loss"] for name in runs for run in runs[name]]
    same = max(losses) - min(losses) <= 1e-4 * max(1.0, abs(losses[0]))
    print(f"same loss: {same} ({', '.join(f'{v:.6f}' for v in losses)})")
    print(f"{'variant':20s} {'chunks':>6s} {'peak growth MiB':>16s} {'s/step':>8s}")
    best = {
        name: (min(r["growth_mb"] for r in rs), min(r["seconds"] for r in rs), rs[0]["chunks"])
        for name, rs in runs.items()
    }
    for name, (growth, seconds, chunks) in best.items():
        print(f"{name:20s} {chunks:6.0f} {growth:16.0f} {seconds:8.3f}")
    whole, chunked = best["whole batch"], best["chunked (default)"]
    batched = best["chunked, bmm lm_head"]
    print(
        f"chunked: {whole[0] / chunked[0]:.1f}x less peak memory growth, "
        f"{chunked[1] / whole[1]:.2f}x the step time (the recomputed lm_head and loss)"
    )
    print(
        f"chunked lm_head as one GEMM: {batched[1] / chunked[1]:.2f}x faster than as a batched "
        "matmul over blocks (> 1: the GEMM is faster)"
    )


if __name__ == "__main__":
    main()
