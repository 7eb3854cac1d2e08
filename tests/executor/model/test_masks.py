"""Dense and flex block masks: the semantics of docs/dflash.md ("The training objective", step 3),
and that both agree.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from testkit.tiny import randomize, tiny_plan
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.masks import (
    SplitBlockMask,
    build_dense_block_mask,
    build_flex_block_mask,
    build_split_block_mask,
)
from dflash_recipes.executor.training.anchors import block_positions, sample_anchors
from dflash_recipes.plan.attention_chunks import split_chunk_count


def test_dense_mask_by_hand() -> None:
    # ctx_len 4, block size 2; block 0 anchored at 2, block 1 at 3; keys: c0 c1 c2 c3 b0 b0 b1 b1
    mask = build_dense_block_mask(torch.tensor([[2, 3]]), 2, 4, torch.tensor([[True, True]]))
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 1, 1],
            [1, 1, 1, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 4, 8)
    assert torch.equal(mask[0, 0], expected)


def test_padded_block_sees_only_itself() -> None:
    mask = build_dense_block_mask(torch.tensor([[3, 9]]), 2, 10, torch.tensor([[True, False]]))
    padded_rows = mask[0, 0, 2:]
    assert not padded_rows[:, :10].any()
    assert padded_rows[:, 12:].all() and not padded_rows[:, 10:12].any()


def _tile_sets(mask: BlockMask) -> tuple[set[tuple[int, int, int]], set[tuple[int, int, int]]]:
    """(partial, full) tiles as (batch, q tile, kv tile) triples."""

    def collect(num: Tensor | None, idx: Tensor | None) -> set[tuple[int, int, int]]:
        found: set[tuple[int, int, int]] = set()
        if num is None or idx is None:
            return found
        for b in range(num.shape[0]):
            for q in range(num.shape[2]):
                for j in range(int(num[b, 0, q])):
                    found.add((b, q, int(idx[b, 0, q, j])))
        return found

    return (
        collect(mask.kv_num_blocks, mask.kv_indices),
        collect(mask.full_kv_num_blocks, mask.full_kv_indices),
    )


CASES = [
    # anchors, valid, block size, ctx len, tile size
    ([[3, 7, 10], [0, 5, 0]], [[True, True, True], [True, True, False]], 4, 14, (4, 4)),
    ([[1, 2, 30, 31]], [[True, True, True, True]], 8, 40, (16, 8)),
    ([[20, 50], [9, 0]], [[True, True], [True, False]], 16, 64, (16, 16)),
    ([[5, 6, 7]], [[True, True, True]], 3, 9, (5, 7)),
]


@pytest.mark.parametrize(("anchors", "valid", "block", "ctx", "tile"), CASES)
def test_flex_mask_equals_dense_mask(
    anchors: list[list[int]],
    valid: list[list[bool]],
    block: int,
    ctx: int,
    tile: tuple[int, int],
) -> None:
    a, v = torch.tensor(anchors), torch.tensor(valid)
    dense = build_dense_block_mask(a, block, ctx, v)
    flex = build_flex_block_mask(a, block, ctx, v, tile_size=tile)
    batch, _, q_len, kv_len = dense.shape
    materialised = create_mask(flex.mask_mod, batch, 1, q_len, kv_len, device="cpu")
    assert torch.equal(materialised, dense)
    assert flex.seq_lengths == (q_len, kv_len)
    # The tile structure computed from anchors equals the one torch derives from the full mask.
    reference = create_block_mask(
        flex.mask_mod, batch, 1, q_len, kv_len, device="cpu", BLOCK_SIZE=tile
    )
    assert _tile_sets(flex) == _tile_sets(reference)


#: Two sequences of three blocks of 4 over 14 context positions; the last block of the second
#: sequence is padding.
_ANCHORS = torch.tensor([[3, 7, 10], [0, 5, 0]])
_VALID = torch.tensor([[True, True, True], [True, True, False]])
_BLOCK, _CTX = 4, 14


def _random_drafter_and_inputs(
    tmp_path: Path, *, sink: bool, seed: int
) -> tuple[DFlashDraftModel, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """A drafter with random weights and (block embeds, context, q positions, ctx positions)."""
    model = DFlashDraftModel(tiny_plan(tmp_path, attention_sink=sink).resolved_draft())
    randomize(model)
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(2, 3 * _BLOCK, 64, generator=gen)
    context = torch.randn(2, _CTX, 64, generator=gen)
    q_pos = block_positions(_ANCHORS, _BLOCK)
    c_pos = torch.arange(_CTX).expand(2, _CTX)
    return model, (embeds, context, q_pos, c_pos)


def test_flex_attention_output_equals_dense_on_cpu(tmp_path: Path) -> None:
    anchors, valid, block, ctx = _ANCHORS, _VALID, _BLOCK, _CTX
    for sink in (False, True):
        model, (embeds, context, q_pos, c_pos) = _random_drafter_and_inputs(
            tmp_path, sink=sink, seed=3
        )
        dense_mask = build_dense_block_mask(anchors, block, ctx, valid)
        flex_mask = build_flex_block_mask(anchors, block, ctx, valid, tile_size=(4, 8))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex_attention warns when not compiled
            dense = model(embeds, context, q_pos, c_pos, dense_mask)
            flex = model(embeds, context, q_pos, c_pos, flex_mask)
        torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_mask_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="valid must be a boolean"):
        build_dense_block_mask(torch.tensor([[1]]), 2, 3, torch.tensor([[1]]))
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        build_flex_block_mask(torch.tensor([1]), 2, 3, torch.tensor([True]))


def test_split_attention_output_and_gradients_equal_dense(tmp_path: Path) -> None:
    """The CPU training path (per chunk: visible context + the chunk's blocks) equals dense."""
    anchors, valid, block, ctx = _ANCHORS, _VALID, _BLOCK, _CTX
    for sink in (False, True):
        model, (embeds, context, q_pos, c_pos) = _random_drafter_and_inputs(
            tmp_path, sink=sink, seed=5
        )
        outputs = []
        grads = []
        for mask in (
            build_dense_block_mask(anchors, block, ctx, valid),
            build_split_block_mask(anchors, block, ctx, valid),  # one block per chunk
            build_split_block_mask(anchors, block, ctx, valid, num_chunks=2),  # 2 + 1 blocks
        ):
            model.zero_grad()
            out = model(embeds, context, q_pos, c_pos, mask)
            out.square().sum().backward()
            outputs.append(out.detach())
            grads.append(model.layers[0].self_attn.q_proj.weight.grad.clone())
        for split in (1, 2):
            torch.testing.assert_close(outputs[split], outputs[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(grads[split], grads[0], rtol=1e-4, atol=1e-5)
        # The check can fail: a split mask that hides the context changes the output.
        blind = build_split_block_mask(anchors, block, ctx, valid, num_chunks=2)
        assert [c[1] - c[0] for c in blind.chunks] == [2, 1]
        for (_, _, visible), chunk_mask in zip(blind.chunks, blind.masks, strict=True):
            chunk_mask[..., :visible] = False
        with torch.no_grad():
            assert not torch.allclose(model(embeds, context, q_pos, c_pos, blind), outputs[0])


def test_split_chunk_count_is_one_when_the_blocks_fit_and_minimal_otherwise() -> None:
    # Issue 15's tiny shape: 8 blocks of 8 = 64 queries, one chunk (one call per layer).
    assert split_chunk_count(2, 8, 8, 128, heads=4) == 1
    # Its medium shapes: 128 and 512 blocks of 16 = 2048 and 8192 queries, chunks of 8 blocks.
    assert split_chunk_count(2, 128, 16, 1024, heads=4) == 16
    assert split_chunk_count(2, 512, 16, 1024, heads=4) == 64
    for batch, blocks, block, ctx, heads, queries, budget in [
        (2, 128, 16, 1024, 4, 128, 2**24),
        (2, 37, 5, 300, 2, 128, 2**24),
        (3, 37, 5, 300, 2, 10_000, 20_000),  # the score budget binds
        (1, 50, 3, 10, 1, 100, 2**24),  # the query cap binds, not a multiple of the block
    ]:
        count = split_chunk_count(
            batch, blocks, block, ctx, heads=heads, max_queries=queries, max_scores=budget
        )
        per_chunk = -(-blocks // count)

        def fits(
            n: int, batch: int = batch, block: int = block, heads: int = heads, ctx: int = ctx
        ) -> bool:
            q = n * block
            return q <= queries and batch * heads * q * (ctx + q) <= budget  # noqa: B023

        assert fits(per_chunk)
        # Minimal: one chunk fewer would need a chunk over a limit.
        assert not fits(-(-blocks // (count - 1)))
    # A single block over the limits still gets its own chunk, never zero blocks.
    assert split_chunk_count(1, 4, 16, 10_000, max_scores=10) == 4
    assert split_chunk_count(1, 4, 256, 10) == 4
    assert split_chunk_count(2, 0, 16, 128) == 1


_ISSUE_SHAPES = [
    # seq, batch, anchors, block, forced chunk counts (None: chosen from the work)
    pytest.param(128, 2, 8, 8, (None, 3), id="tiny"),
    pytest.param(1024, 1, 128, 16, (None, 5), id="medium"),
]


@pytest.mark.parametrize(("seq", "batch", "anchors", "block", "forced"), _ISSUE_SHAPES)
def test_split_attention_equals_dense_at_the_issue_shapes(
    tmp_path: Path, seq: int, batch: int, anchors: int, block: int, forced: tuple[int | None, ...]
) -> None:
    """Issue 15's shapes (real sampled anchors, padding included): any chunking equals dense."""
    model = DFlashDraftModel(tiny_plan(tmp_path).resolved_draft())
    randomize(model)
    gen = torch.Generator().manual_seed(7)
    loss_mask = torch.ones(batch, seq, dtype=torch.long)
    attention = torch.ones_like(loss_mask)
    attention[0, seq - seq // 4 :] = 0  # a shorter first row: fewer eligible anchors
    drawn = sample_anchors(
        loss_mask, attention, block_size=block, num_anchors=anchors, generator=gen
    )
    a, v = drawn.anchors, drawn.valid
    embeds = torch.randn(batch, a.shape[1] * block, 64, generator=gen)
    context = torch.randn(batch, seq, 64, generator=gen)
    q_pos = block_positions(a, block)
    c_pos = torch.arange(seq).expand(batch, seq)
    heads = model.spec.num_attention_heads
    masks = [build_dense_block_mask(a, block, seq, v)]
    for chunks in forced:
        masks.append(build_split_block_mask(a, block, seq, v, num_chunks=chunks, heads=heads))
    # The chosen count: one chunk at the tiny shape, several at the medium one.
    chosen = masks[1]
    assert isinstance(chosen, SplitBlockMask)
    assert len(chosen.chunks) == split_chunk_count(batch, a.shape[1], block, seq, heads=heads)
    assert (len(chosen.chunks) == 1) == (seq == 128)
    assert len(masks[2].chunks) == forced[1]  # type: ignore[union-attr]
    outputs, grads = [], []
    for mask in masks:
        model.zero_grad()
        out = model(embeds, context, q_pos, c_pos, mask)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append(model.layers[0].self_attn.k_proj.weight.grad.clone())
    # Gradients sum over thousands of positions: float32 noise scales with their size.
    grad_atol = 1e-6 * float(grads[0].abs().max())
    for index in range(1, len(masks)):
        torch.testing.assert_close(outputs[index], outputs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[index], grads[0], rtol=1e-4, atol=grad_atol)
