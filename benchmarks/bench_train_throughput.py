"""Training throughput: the packed multi-block step vs a naive per-block loop, same run.

    python benchmarks/bench_train_throughput.py [--steps 6] [--anchors 32] [--block 16]

Both variants compute the same thing on the same batch and anchors: the frozen target's
forward, the drafter over every block, the target's lm_head, the decay-weighted loss and
the backward pass. The packed step runs all blocks of a batch in ONE draft forward under the
block mask (what `dflash-recipe run` does); the naive loop runs one draft forward per block
over [context before the anchor ; block]. Reported: drafted block tokens per second, median
over repeated, interleaved steps, and the ratio (target >= 5x). A check first confirms the
two give the same loss.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dflash_recipes.compiler import compile_file
from dflash_recipes.executor.anchors import block_inputs, block_labels, sample_anchors
from dflash_recipes.executor.convert import (
    convert,
    dflash_module,
    embed_tokens,
    lm_head,
    load_base_model,
)
from dflash_recipes.executor.draft import build_split_block_mask, taps_from_hidden_states
from dflash_recipes.executor.loss import dflash_loss

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    result = compile_file(
        REPO / "recipes" / "tiny" / "tiny_scratch.yaml",
        overrides=(
            "training.output_dir=/tmp/dflash-bench-unused",
            f"dflash.dflash_block_size={args.block}",
            f"dflash.dflash_num_anchors={args.anchors}",
            f"training.per_device_train_batch_size={args.batch}",
        ),
    )
    assert result.plan is not None, result.diagnostics
    plan = result.plan
    spec = plan.resolved_draft()
    # Synthetic, fully supervised sequences: the regime of real training (long sequences,
    # many anchors per sequence) at a CPU-sized width.
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, spec.mask_token_id, (args.batch, args.seq), generator=gen)
    attention = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids)
    model = convert(load_base_model(plan), plan)
    drafter = dflash_module(model)
    embed, head = embed_tokens(model), lm_head(model)
    objective = plan.draft.objective
    drawn = sample_anchors(
        loss_mask,
        attention,
        block_size=spec.block_size,
        num_anchors=args.anchors,
        generator=torch.Generator().manual_seed(0),
    )
    anchors, valid = drawn.anchors, drawn.valid
    size = spec.block_size
    labels, label_mask = block_labels(ids, loss_mask, anchors, valid, block_size=size)
    n_blocks = int(valid.sum())
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    taps = taps_from_hidden_states(out.hidden_states, spec.target_layer_ids).float()

    def packed() -> float:
        drafter.zero_grad(set_to_none=True)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        block_ids, q_pos = block_inputs(
            ids, anchors, valid, block_size=size, mask_token_id=spec.mask_token_id
        )
        ctx = drafter.fuse_context(taps)
        seq = ids.shape[1]
        mask = build_split_block_mask(anchors, size, seq, valid)
        hidden = drafter(
            embed(block_ids).float(), ctx, q_pos, torch.arange(seq).expand(ids.shape[0], seq), mask
        )
        logits = head(hidden).view(ids.shape[0], anchors.shape[1], size, -1)
        loss = dflash_loss(logits, labels, label_mask, objective=objective).loss
        loss.backward()  # type: ignore[no-untyped-call]
        return float(loss)

    def naive() -> float:
        drafter.zero_grad(set_to_none=True)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        ctx = drafter.fuse_context(taps)
        all_logits = torch.zeros(ids.shape[0], anchors.shape[1], size, spec.vocab_size)
        for row in range(ids.shape[0]):
            for col in range(anchors.shape[1]):
                if not bool(valid[row, col]):
                    continue
                a = int(anchors[row, col])
                block = torch.full((1, size), spec.mask_token_id, dtype=torch.long)
                block[0, 0] = ids[row, a]
                context = ctx[row : row + 1, :a]
                q_pos = torch.arange(a, a + size).unsqueeze(0)
                mask = torch.ones(1, 1, size, a + size, dtype=torch.bool)
                hidden = drafter(
                    embed(block).float(), context, q_pos, torch.arange(a).unsqueeze(0), mask
                )
                all_logits[row, col] = head(hidden)[0]
        loss = dflash_loss(all_logits, labels, label_mask, objective=objective).loss
        loss.backward()  # type: ignore[no-untyped-call]
        return float(loss)

    loss_packed, loss_naive = packed(), naive()
    same = abs(loss_packed - loss_naive) <= 1e-4 * max(1.0, abs(loss_packed))

    def target_only() -> float:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        return 0.0

    times: dict[str, list[float]] = {"packed": [], "naive": [], "target": []}
    for _ in range(args.steps):
        for name, fn in (("packed", packed), ("naive", naive), ("target", target_only)):
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    tokens = n_blocks * size
    print(
        f"config: batch {args.batch}, seq {ids.shape[1]}, {n_blocks} blocks of {size} "
        f"({tokens} drafted tokens per step), target {spec.num_target_layers} layers x "
        f"{spec.hidden_size}, drafter {spec.num_hidden_layers} layers, {args.threads} thread(s)"
    )
    print(f"same loss: {same} (packed {loss_packed:.6f}, naive {loss_naive:.6f})")
    print(f"{'variant':10s} {'median s/step':>14s} {'tokens/s':>10s} {'ratio':>7s}")
    base = statistics.median(times["naive"])
    for name in ("naive", "packed"):
        med = statistics.median(times[name])
        print(f"{name:10s} {med:14.4f} {tokens / med:10.0f} {base / med:6.2f}x")
    frozen = statistics.median(times["target"])
    draft_ratio = (base - frozen) / (statistics.median(times["packed"]) - frozen)
    print(f"frozen target forward alone: {frozen:.4f} s/step (in both variants)")
    print(f"draft part only (step minus target forward): packed {draft_ratio:.1f}x naive")
    ratio = base / statistics.median(times["packed"])
    verdict = "PASS" if ratio >= 5 else "MISS"
    print(
        f"packed multi-block step: {ratio:.1f}x the naive per-block loop (target >= 5x: {verdict})"
    )


if __name__ == "__main__":
    main()
