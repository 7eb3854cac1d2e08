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

from dflash_recipes.executor.draft import (
    DFlashDraftModel,
    block_positions,
    build_dense_block_mask,
    build_flex_block_mask,
    build_split_block_mask,
)


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
