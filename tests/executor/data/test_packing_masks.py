"""Per-document attention pieces for packed rows: anchors, the drafter's context, the target."""

from __future__ import annotations

import torch
from testkit.numerics import assert_equal_up_to_rounding

from dflash_recipes.executor.model.masks import (
    build_dense_block_mask,
    document_causal_mask,
    document_context_mask,
)
from dflash_recipes.executor.training.anchors import eligible_anchor_mask


def test_no_anchor_opens_a_block_that_crosses_a_document_boundary() -> None:
    docs = torch.tensor([[0] * 6 + [1] * 5 + [2] * 3])
    ones = torch.ones_like(docs)
    packed = eligible_anchor_mask(ones, ones, block_size=4, document_ids=docs)
    plain = eligible_anchor_mask(ones, ones, block_size=4)
    assert packed[0].nonzero().flatten().tolist() == [0, 1, 2, 6, 7]
    assert plain[0, 3] and plain[0, 8]  # without documents those blocks would cross


def test_the_target_mask_is_block_diagonal_causal() -> None:
    docs = torch.tensor([[0, 0, 0, 1, 1, 2]])
    mask = document_causal_mask(docs)[0, 0]
    for i in range(6):
        for j in range(6):
            assert bool(mask[i, j]) == (j <= i and docs[0, i] == docs[0, j])


def test_sdpa_with_the_document_mask_equals_each_document_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 3, 4]
    q, k, v = (torch.randn(1, 2, sum(lengths), 8, generator=gen) for _ in range(3))
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]).unsqueeze(0)
    packed = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=document_causal_mask(docs)
    )
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, part], k[:, :, part], v[:, :, part], is_causal=True
        )
        assert_equal_up_to_rounding(packed[:, :, part], alone, what="a document's output")
        start += n


def test_a_block_sees_only_its_own_document_before_its_anchor() -> None:
    anchors = torch.tensor([[2, 7]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    dense = build_dense_block_mask(anchors, 2, 10, valid)
    mask = document_context_mask(dense, torch.tensor([[0, 5]]), 2)[0, 0]
    ctx = mask[:, :10]
    assert ctx[0].nonzero().flatten().tolist() == [0, 1]
    assert ctx[2].nonzero().flatten().tolist() == [5, 6]
    assert torch.equal(mask[:, 10:], dense[0, 0, :, 10:])  # own-block attention unchanged
