"""Sliding-window draft layers: one meaning in the dense, split and flex masks and in eval.

A ``sliding_attention`` layer sees key position ``p`` from query position ``t`` when the
full-attention block mask allows it and ``0 <= t - p < window`` (docs/dflash.md,
"Sliding-window layers").
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from testkit.tiny import TINY_HIDDEN, TINY_MASK_TOKEN_ID, randomize, tiny_plan
from torch import Tensor
from torch.nn.attention.flex_attention import create_mask

from dflash_recipes.executor.evaluation.speculative import DFlashBlockDrafter, DraftContext
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.masks import (
    build_dense_block_mask,
    build_flex_block_mask,
    build_split_block_mask,
    sliding_window_mask,
)
from dflash_recipes.executor.training.anchors import block_positions

_ANCHORS = torch.tensor([[3, 7, 10], [0, 5, 0]])
_VALID = torch.tensor([[True, True, True], [True, True, False]])
_BLOCK, _CTX = 4, 14


def _positions(anchors: Tensor, block: int, ctx: int) -> tuple[Tensor, Tensor]:
    batch = anchors.shape[0]
    return block_positions(anchors, block), torch.arange(ctx).expand(batch, ctx)


def test_sliding_dense_mask_by_hand() -> None:
    # ctx 6, one block of 3 anchored at 4, window 3: keys c0..c5 b0 b1 b2 (positions 0..5, 4..6)
    anchors, valid = torch.tensor([[4]]), torch.tensor([[True]])
    full = build_dense_block_mask(anchors, 3, 6, valid)
    q_pos, c_pos = _positions(anchors, 3, 6)
    mask = sliding_window_mask(full, q_pos, c_pos, 3)
    assert isinstance(mask, Tensor)
    expected = torch.tensor(
        [
            # position 4 sees positions 2, 3 of the context and itself
            [0, 0, 1, 1, 0, 0, 1, 0, 0],
            # position 5 sees context position 3, block positions 4 and 5 (causal in the block)
            [0, 0, 0, 1, 0, 0, 1, 1, 0],
            # position 6 sees no context any more (6 - 3 = 3 is outside the window)
            [0, 0, 0, 0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)


def test_window_wider_than_the_sequence_cuts_nothing_of_the_full_mask() -> None:
    """A window longer than the sequence keeps every context key of the full-attention mask;
    what remains of the reference's sliding layer is causality inside the block."""
    q_pos, c_pos = _positions(_ANCHORS, _BLOCK, _CTX)
    full = build_dense_block_mask(_ANCHORS, _BLOCK, _CTX, _VALID)
    wide = sliding_window_mask(full, q_pos, c_pos, 10_000)
    assert isinstance(wide, Tensor)
    assert torch.equal(wide[..., :_CTX], full[..., :_CTX])
    causal = torch.ones(_BLOCK, _BLOCK, dtype=torch.bool).tril()
    own = wide[..., _CTX:].view(2, 1, 3, _BLOCK, 3, _BLOCK)
    for block in range(3):
        assert torch.equal(own[:, 0, block, :, block], causal.expand(2, -1, -1))
    # the longest distance in the sequence is ctx + block - 1: that window equals a wider one
    exact = sliding_window_mask(full, q_pos, c_pos, _CTX + _BLOCK)
    assert torch.equal(exact, wide)
    assert not torch.equal(sliding_window_mask(full, q_pos, c_pos, 3), wide)


@pytest.mark.parametrize("window", [1, 2, 5, 9, 100])
@pytest.mark.parametrize("tile", [(4, 4), (5, 7), (16, 8)])
def test_flex_sliding_mask_equals_dense(window: int, tile: tuple[int, int]) -> None:
    q_pos, c_pos = _positions(_ANCHORS, _BLOCK, _CTX)
    dense = sliding_window_mask(
        build_dense_block_mask(_ANCHORS, _BLOCK, _CTX, _VALID), q_pos, c_pos, window
    )
    flex = sliding_window_mask(
        build_flex_block_mask(_ANCHORS, _BLOCK, _CTX, _VALID, tile_size=tile),
        q_pos,
        c_pos,
        window,
    )
    assert isinstance(dense, Tensor)
    assert not isinstance(flex, Tensor)
    batch, _, q_len, kv_len = dense.shape
    materialised = create_mask(flex.mask_mod, batch, 1, q_len, kv_len, device="cpu")
    assert torch.equal(materialised, dense)
    # every key the mask allows lies in a tile the block structure visits
    visited = flex.to_dense()[:, :, :, :]  # [B, 1, q tiles, kv tiles]
    q_tile, kv_tile = tile
    for b, _h, q, k in dense.nonzero().tolist():
        assert visited[b, 0, q // q_tile, k // kv_tile]


def _drafter(tmp_path: Path, layer_types: tuple[str, ...], window: int) -> DFlashDraftModel:
    plan = tiny_plan(tmp_path, layer_types=layer_types, sliding_window=window)
    model = DFlashDraftModel(plan.resolved_draft())
    randomize(model)
    return model


def _inputs(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(2, 3 * _BLOCK, TINY_HIDDEN, generator=gen)
    context = torch.randn(2, _CTX, TINY_HIDDEN, generator=gen)
    q_pos, c_pos = _positions(_ANCHORS, _BLOCK, _CTX)
    return embeds, context, q_pos, c_pos


def test_sliding_layers_dense_split_and_flex_agree_outputs_and_gradients(tmp_path: Path) -> None:
    model = _drafter(tmp_path, ("sliding_attention", "full_attention"), 5)
    embeds, context, q_pos, c_pos = _inputs(seed=7)
    masks = {
        "dense": build_dense_block_mask(_ANCHORS, _BLOCK, _CTX, _VALID),
        "split": build_split_block_mask(_ANCHORS, _BLOCK, _CTX, _VALID),
        "split2": build_split_block_mask(_ANCHORS, _BLOCK, _CTX, _VALID, num_chunks=2),
        "flex": build_flex_block_mask(_ANCHORS, _BLOCK, _CTX, _VALID, tile_size=(4, 8)),
    }
    outputs: dict[str, Tensor] = {}
    grads: dict[str, Tensor] = {}
    for name, mask in masks.items():
        model.zero_grad()
        if name == "flex":  # flex_attention has no backward on the CPU: outputs only
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # flex_attention warns when not compiled
                outputs[name] = model(embeds, context, q_pos, c_pos, mask)
            continue
        out = model(embeds, context, q_pos, c_pos, mask)
        out.square().sum().backward()
        outputs[name] = out.detach()
        weight = model.layers[0].self_attn.q_proj.weight
        assert weight.grad is not None
        grads[name] = weight.grad.clone()
    for name in ("split", "split2", "flex"):
        torch.testing.assert_close(outputs[name], outputs["dense"], rtol=1e-5, atol=1e-5)
    for name in ("split", "split2"):
        torch.testing.assert_close(grads[name], grads["dense"], rtol=1e-4, atol=1e-5)
    # The window matters: the same weights with full attention everywhere compute otherwise.
    full = DFlashDraftModel(tiny_plan(tmp_path).resolved_draft())
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        unwindowed = full(embeds, context, q_pos, c_pos, masks["dense"])
    assert not torch.allclose(unwindowed, outputs["dense"], atol=1e-3)


def test_eval_drafts_with_the_window_it_was_trained_with(tmp_path: Path) -> None:
    """Speculative decoding's block equals the same block inside a packed training batch."""
    model = _drafter(tmp_path, ("sliding_attention", "sliding_attention"), 3)
    model.eval()
    spec = model.spec
    gen = torch.Generator().manual_seed(11)
    embed = torch.nn.Embedding(128, TINY_HIDDEN)
    head = torch.nn.Linear(TINY_HIDDEN, 128, bias=False)
    committed = tuple(int(t) for t in torch.randint(0, 100, (9,), generator=gen))
    anchor = len(committed) - 1
    taps = torch.randn(1, anchor, 2 * TINY_HIDDEN, generator=gen)
    drafter = DFlashBlockDrafter(model, embed, head, spec)
    with torch.no_grad():
        eval_hidden = drafter.draft_hidden(
            DraftContext(committed=committed, taps=taps, block_size=spec.block_size)
        )
        # training: the same block packed after another one, over a longer context
        ctx_len = anchor + 5
        long_taps = torch.cat([taps, torch.randn(1, 5, 2 * TINY_HIDDEN, generator=gen)], dim=1)
        anchors = torch.tensor([[2, anchor]])
        valid = torch.ones(1, 2, dtype=torch.bool)
        ids = [committed[2]] + [TINY_MASK_TOKEN_ID] * (spec.block_size - 1)
        ids += [committed[-1]] + [TINY_MASK_TOKEN_ID] * (spec.block_size - 1)
        block_embeds = embed(torch.tensor([ids]))
        q_pos, c_pos = _positions(anchors, spec.block_size, ctx_len)
        mask = build_split_block_mask(anchors, spec.block_size, ctx_len, valid)
        packed = model(block_embeds, model.fuse_context(long_taps), q_pos, c_pos, mask)
    torch.testing.assert_close(eval_hidden[0], packed[0, spec.block_size :], rtol=1e-5, atol=1e-5)


# --- DFlash 2: sliding layers with is_causal false -----------------------------------------------

_D2 = {
    "projector_type": "dflash2",
    "conv_kernel_size": 2,
    "conv_group_size": 8,
    "selector_rank": 4,
    "selector_top_k": 4,
}


def test_a_non_causal_sliding_mask_by_hand() -> None:
    """The case of test_sliding_dense_mask_by_hand with causal=False: every block position sees
    the whole block; the window still cuts the context."""
    anchors, valid = torch.tensor([[4]]), torch.tensor([[True]])
    full = build_dense_block_mask(anchors, 3, 6, valid)
    q_pos, c_pos = _positions(anchors, 3, 6)
    mask = sliding_window_mask(full, q_pos, c_pos, 3, causal=False)
    assert isinstance(mask, Tensor)
    expected = torch.tensor(
        [
            [0, 0, 1, 1, 0, 0, 1, 1, 1],
            [0, 0, 0, 1, 0, 0, 1, 1, 1],
            [0, 0, 0, 0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize("window", [1, 3, 100])
def test_non_causal_flex_and_split_sliding_masks_equal_dense(window: int) -> None:
    q_pos, c_pos = _positions(_ANCHORS, _BLOCK, _CTX)
    dense = sliding_window_mask(
        build_dense_block_mask(_ANCHORS, _BLOCK, _CTX, _VALID), q_pos, c_pos, window, causal=False
    )
    flex = sliding_window_mask(
        build_flex_block_mask(_ANCHORS, _BLOCK, _CTX, _VALID, tile_size=(4, 8)),
        q_pos,
        c_pos,
        window,
        causal=False,
    )
    assert isinstance(dense, Tensor) and not isinstance(flex, Tensor)
    batch, _, q_len, kv_len = dense.shape
    assert torch.equal(create_mask(flex.mask_mod, batch, 1, q_len, kv_len, device="cpu"), dense)
    # a window of at least the block (releases: 2048) leaves the block part bidirectional
    full = build_dense_block_mask(_ANCHORS, _BLOCK, _CTX, _VALID)
    assert torch.equal(dense[..., _CTX:], full[..., _CTX:]) == (window >= _BLOCK)


def test_dflash2_sliding_layers_see_the_whole_block_and_dflash1_ones_do_not(
    tmp_path: Path,
) -> None:
    """The drafter narrows a sliding layer's mask by its kind (ResolvedDraft.sliding_causal):
    DFlash 2 (is_causal false) keeps the block bidirectional, DFlash 1 makes it causal."""
    types = ("sliding_attention", "full_attention")
    q_pos, c_pos = _positions(_ANCHORS, _BLOCK, _CTX)
    full = build_dense_block_mask(_ANCHORS, _BLOCK, _CTX, _VALID)
    d2 = DFlashDraftModel(
        tiny_plan(tmp_path, layer_types=types, sliding_window=5, **_D2).resolved_draft()
    )
    d1 = DFlashDraftModel(tiny_plan(tmp_path, layer_types=types, sliding_window=5).resolved_draft())
    assert d2.spec.sliding_causal is False and d1.spec.sliding_causal is True
    non_causal = d2.layer_masks(full, q_pos, c_pos)
    causal = d1.layer_masks(full, q_pos, c_pos)
    assert torch.equal(non_causal[0], sliding_window_mask(full, q_pos, c_pos, 5, causal=False))
    assert torch.equal(causal[0], sliding_window_mask(full, q_pos, c_pos, 5))
    assert non_causal[1] is full and causal[1] is full
    # block position 0 sees position 1 of its block only without causality
    first_block = (0, 0, 0, _CTX + 1)
    assert bool(non_causal[0][first_block]) and not bool(causal[0][first_block])
