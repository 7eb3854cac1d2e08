"""Training throughput: the packed multi-block step vs naive per-block loops, same run.

    python benchmarks/bench_train_throughput.py [--steps 5] [--seq 512] [--anchors 64]
        [--threads 1 2]

Every variant computes the same training step on the same batch and anchors: the frozen
target's forward (as the trainer runs it), the drafter over every block, the target's lm_head,
the decay-weighted loss and the backward pass. They differ only in how the drafter runs:

- ``naive``: one call of the drafter's whole forward per block, over that block's context
  (the tapped target states before its anchor, fused by ``fc`` + ``hidden_norm``, as the
  z-lab module's forward does) plus the block: the straightforward per-block loop;
- ``naive, shared fusion``: the same loop with the context fused once per sequence and sliced
  per block: a smarter loop that still projects the context's K/V once per block;
- ``packed``: all blocks of the batch in ONE draft forward under the block mask: what
  `dflash-recipe run` runs, through the step library (issue 53): the step of
  ``train_step.build_step``, the rows through ``prepare_rows`` (the split mask, per chunk of
  blocks through SDPA on the CPU; its anchors are the ones every variant uses) and one
  ``optimizer_step``. That is a whole optimiser step (clipping, AdamW, the schedule), which
  the two loops do not run, so the ratio is, if anything, conservative.

Reported per torch thread count (default: 1, then every core): drafted block tokens per
second, median over repeated, interleaved steps, and the ratio against ``naive`` (target
>= 5x). A check first confirms all three give the same loss. On one thread the packed step is
bound by the FLOPs every variant shares (the drafter's MLP and projections over the block
tokens, the target's forward), so the gain there is only the per-block context K/V work and
call overhead; with every core, the packed step's few large matmuls use the cores and the
loop's thousands of small ones cannot, which is the regime of real accelerators.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.executor.dist_env import detect_dist_env
from dflash_recipes.executor.kinds.dflash import dflash_loss
from dflash_recipes.executor.model.convert import embed_tokens, lm_head
from dflash_recipes.executor.model.target_states import target_states
from dflash_recipes.executor.training.anchors import block_labels
from dflash_recipes.executor.training.train_step import build_step, optimizer_step, prepare_rows

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="torch thread counts to measure (default: 1 and every core)",
    )
    args = parser.parse_args()
    cores = torch.get_num_threads()
    thread_counts = args.threads or sorted({1, cores})
    torch.set_num_threads(thread_counts[0])

    result = compile_file(
        REPO / "recipes" / "tiny" / "tiny_scratch.yaml",
        overrides=(
            "training.output_dir=/tmp/dflash-bench-unused",
            "training.max_steps=1000",
            f"dflash.dflash_block_size={args.block}",
            f"dflash.dflash_num_anchors={args.anchors}",
            f"training.per_device_train_batch_size={args.batch}",
        ),
    )
    assert result.plan is not None, result.diagnostics
    plan = result.plan
    spec = plan.resolved_draft()
    # Synthetic, fully supervised sequences: the regime of real training (long sequences, about
    # one anchor per 8 positions like 512 anchors in 4096) at a CPU-sized width.
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, spec.mask_token_id, (args.batch, args.seq), generator=gen)
    attention = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids)
    # The measured step, built as run builds it (the target loaded from the plan).
    train = build_step(plan, env=detect_dist_env("cpu", {}))
    train.models.training_modes()
    model, drafter = train.models.target, train.models.drafter
    embed, head = embed_tokens(model), lm_head(model)
    objective = plan.draft.objective
    # The rows as run's prefetch thread prepares them; the loops reuse their anchors.
    prepared = prepare_rows(train, ids, loss_mask, next_index=args.batch)
    anchors, valid = prepared.drawn.anchors, prepared.drawn.valid
    size = spec.block_size
    batch, seq = ids.shape
    labels, label_mask = block_labels(ids, loss_mask, anchors, valid, block_size=size)
    n_blocks = int(valid.sum())

    def target_taps() -> torch.Tensor:
        # The trainer's target forward (the default objective needs no target logits).
        with torch.no_grad():
            taps = spec.target_layer_ids
            return target_states(model, ids, attention, taps, with_logits=False).tapped.float()

    done = [0]

    def packed() -> float:
        # What run runs: one optimiser step over the prepared rows (target forward included).
        out = optimizer_step(train, [prepared], index=done[0])
        done[0] += 1
        return float(out.loss)

    def per_block(shared_fusion: bool) -> float:
        drafter.zero_grad(set_to_none=True)
        taps = target_taps()
        fused = drafter.fuse_context(taps) if shared_fusion else None
        all_logits = torch.zeros(batch, anchors.shape[1], size, spec.vocab_size)
        for row in range(batch):
            for col in range(anchors.shape[1]):
                if not bool(valid[row, col]):
                    continue
                a = int(anchors[row, col])
                block = torch.full((1, size), spec.mask_token_id, dtype=torch.long)
                block[0, 0] = ids[row, a]
                if fused is None:
                    context = drafter.fuse_context(taps[row : row + 1, :a])
                else:
                    context = fused[row : row + 1, :a]
                q_pos = torch.arange(a, a + size).unsqueeze(0)
                mask = torch.ones(1, 1, size, a + size, dtype=torch.bool)
                hidden = drafter(
                    embed(block).float(), context, q_pos, torch.arange(a).unsqueeze(0), mask
                )
                all_logits[row, col] = head(hidden)[0]
        loss = dflash_loss(all_logits, labels, label_mask, objective=objective).loss
        loss.backward()  # type: ignore[no-untyped-call]
        return float(loss.detach())

    def target_only() -> float:
        target_taps()
        return 0.0

    variants: dict[str, Callable[[], float]] = {
        "naive": lambda: per_block(shared_fusion=False),
        "naive, shared fusion": lambda: per_block(shared_fusion=True),
        "packed": packed,
    }
    losses = {name: fn() for name, fn in variants.items()}
    reference = losses["naive"]
    same = all(abs(v - reference) <= 1e-4 * max(1.0, abs(reference)) for v in losses.values())
    tokens = n_blocks * size

    print(
        f"config: batch {batch}, seq {seq}, {n_blocks} blocks of {size} "
        f"({tokens} drafted tokens per step), target {spec.num_target_layers} layers x "
        f"{spec.hidden_size}, drafter {spec.num_hidden_layers} layers "
        f"({spec.num_attention_heads} heads, {spec.num_key_value_heads} kv heads x "
        f"{spec.head_dim}, {len(spec.target_layer_ids)} taps), {args.steps} interleaved steps"
    )
    print(
        "same loss: "
        + str(same)
        + " ("
        + ", ".join(f"{name} {value:.6f}" for name, value in losses.items())
        + ")"
    )
    verdicts = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        median = _measure(variants, target_only, args.steps)
        verdicts.append((threads, _report(median, tokens, threads)))
    for threads, ratio in verdicts:
        verdict = "PASS" if ratio >= 5 else "MISS"
        print(
            f"packed multi-block step, {threads} thread(s): {ratio:.1f}x the naive per-block "
            f"loop (target >= 5x: {verdict})"
        )


def _measure(
    variants: dict[str, Callable[[], float]], target_only: Callable[[], float], steps: int
) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in (*variants, "target")}
    for _ in range(steps):
        for name, fn in (*variants.items(), ("target", target_only)):
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def _report(median: dict[str, float], tokens: int, threads: int) -> float:
    print(f"\n{threads} thread(s)")
    print(f"{'variant':22s} {'median s/step':>14s} {'tokens/s':>10s} {'vs naive':>9s}")
    base = median["naive"]
    for name in ("naive", "naive, shared fusion", "packed"):
        print(
            f"{name:22s} {median[name]:14.4f} {tokens / median[name]:10.0f} "
            f"{base / median[name]:8.2f}x"
        )
    frozen = median["target"]
    draft = median["packed"] - frozen
    print(f"frozen target forward alone: {frozen:.4f} s/step (the same in every variant)")
    print(
        f"draft part only (step minus target forward): packed {(base - frozen) / draft:.1f}x "
        f"naive, {(median['naive, shared fusion'] - frozen) / draft:.1f}x naive with shared "
        "fusion"
    )
    return base / median["packed"]


if __name__ == "__main__":
    main()
