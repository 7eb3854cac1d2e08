"""Per-document attention pieces for packed rows: anchors, the drafter's context, the target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testkit.numerics import assert_equal_up_to_rounding
from testkit.tiny import tiny_plan, tiny_target
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from dflash_recipes.executor.model.masks import (
    SplitBlockMask,
    anchor_starts,
    build_dense_block_mask,
    build_flex_block_mask,
    build_split_block_mask,
    document_causal_mask,
    document_context_mask,
)
from dflash_recipes.executor.model.target_states import document_position_ids, target_states
from dflash_recipes.executor.training.anchors import (
    IGNORE_INDEX,
    block_labels,
    eligible_anchor_mask,
    sample_counter_anchors,
)


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


def test_packed_target_forward_equals_each_document_alone(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path)
    model = tiny_target(plan)
    gen = torch.Generator().manual_seed(1)
    lengths = [7, 4, 5]
    vocab = model.config.vocab_size
    docs = [torch.randint(0, vocab, (1, n), generator=gen) for n in lengths]
    ids = torch.cat(docs, dim=1)
    doc_ids = torch.cat([torch.full((1, n), d) for d, n in enumerate(lengths)], dim=1)
    every = list(range(model.config.num_hidden_layers))
    with torch.no_grad():
        packed = target_states(model, ids, None, every, with_logits=True, document_ids=doc_ids)
        start = 0
        for d, tokens in enumerate(docs):
            alone = target_states(model, tokens, torch.ones_like(tokens), every, with_logits=True)
            part = slice(start, start + lengths[d])
            p, a = packed.tapped[:, part], alone.tapped
            assert_equal_up_to_rounding(p, a, what=f"doc {d}, every layer")
            assert packed.logits is not None and alone.logits is not None
            assert_equal_up_to_rounding(packed.logits[:, part], alone.logits, what="logits")
            start += lengths[d]


def test_a_token_of_one_document_changes_nothing_in_another(tmp_path: Path) -> None:
    model = tiny_target(tiny_plan(tmp_path))
    ids = torch.arange(12).unsqueeze(0) % model.config.vocab_size
    doc_ids = torch.tensor([[0] * 6 + [1] * 6])
    changed = ids.clone()
    changed[0, 2] = (changed[0, 2] + 1) % model.config.vocab_size
    last = [model.config.num_hidden_layers - 1]
    with torch.no_grad():
        a = target_states(model, ids, None, last, with_logits=False, document_ids=doc_ids)
        b = target_states(model, changed, None, last, with_logits=False, document_ids=doc_ids)
    assert torch.equal(a.tapped[:, 6:], b.tapped[:, 6:])
    assert not torch.equal(a.tapped[:, 2:6], b.tapped[:, 2:6])


def test_position_ids_restart_at_every_document() -> None:
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    assert document_position_ids(docs).tolist() == [
        [0, 1, 2, 0, 1, 0, 1, 2, 3],
        list(range(9)),
    ]


def _tile_sets(mask: BlockMask) -> tuple[set[tuple[int, int, int]], set[tuple[int, int, int]]]:
    """(partial, full) tiles as (batch, q tile, kv tile) triples."""

    def collect(num: Tensor | None, idx: Tensor | None) -> set[tuple[int, int, int]]:
        if num is None or idx is None:
            return set()
        return {
            (b, q, int(idx[b, 0, q, j]))
            for b in range(num.shape[0])
            for q in range(num.shape[2])
            for j in range(int(num[b, 0, q]))
        }

    return (
        collect(mask.kv_num_blocks, mask.kv_indices),
        collect(mask.full_kv_num_blocks, mask.full_kv_indices),
    )


# -- the drafter's masks of a packed row: dense, split (CPU) and flex (CUDA) agree -------------

#: Two packed rows of 20 tokens: documents of 7, 6 and 5 tokens then filler; 9, 11.
_DOCS = torch.tensor([[0] * 7 + [1] * 6 + [2] * 5 + [-1] * 2, [0] * 9 + [1] * 11])
_ANCHORS = torch.tensor([[1, 4, 8, 13, 14], [2, 5, 10, 12, 0]])
_VALID = torch.tensor([[True] * 5, [True] * 4 + [False]])


def _split_as_dense(split: SplitBlockMask, ctx_len: int, q_len: int) -> torch.Tensor:
    batch = split.masks[0].shape[0]
    dense = torch.zeros(batch, 1, q_len, ctx_len + q_len, dtype=torch.bool)
    bs = split.block_size
    for (first, end, visible), part in zip(split.chunks, split.masks, strict=True):
        rows = slice(first * bs, end * bs)
        dense[:, :, rows, :visible] = part[..., :visible]
        dense[:, :, rows, ctx_len + first * bs : ctx_len + end * bs] = part[..., visible:]
    return dense


def test_the_dense_mask_of_a_packed_row_cuts_each_blocks_context_to_its_document() -> None:
    plain = build_dense_block_mask(_ANCHORS, 2, 20, _VALID)
    packed = build_dense_block_mask(_ANCHORS, 2, 20, _VALID, document_ids=_DOCS)
    starts = torch.tensor([[0, 0, 7, 13, 13], [0, 0, 9, 9, 0]])
    assert torch.equal(anchor_starts(_ANCHORS, _DOCS), starts)
    assert torch.equal(packed, document_context_mask(plain, starts, 2))
    assert not torch.equal(packed, plain)


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_the_split_mask_of_a_packed_row_equals_the_dense_one(chunks: int) -> None:
    dense = build_dense_block_mask(_ANCHORS, 2, 20, _VALID, document_ids=_DOCS)
    split = build_split_block_mask(_ANCHORS, 2, 20, _VALID, num_chunks=chunks, document_ids=_DOCS)
    assert torch.equal(_split_as_dense(split, 20, 10), dense)
    unpacked = build_split_block_mask(_ANCHORS, 2, 20, _VALID, num_chunks=chunks)
    assert not torch.equal(_split_as_dense(unpacked, 20, 10), dense)


@pytest.mark.parametrize("tile", [(2, 4), (4, 4), (3, 5), (128, 128)])
def test_the_flex_mask_of_a_packed_row_materialises_to_the_dense_one_on_cpu(
    tile: tuple[int, int],
) -> None:
    # flex's create_mask / create_block_mask run on the CPU in this torch: the mask_mod (which
    # compares document ids) is checked element by element, and the tile structure built from
    # the anchors equals the one torch derives from the mask_mod.
    dense = build_dense_block_mask(_ANCHORS, 2, 20, _VALID, document_ids=_DOCS)
    flex = build_flex_block_mask(_ANCHORS, 2, 20, _VALID, tile_size=tile, document_ids=_DOCS)
    materialised = create_mask(flex.mask_mod, 2, 1, 10, 30, device="cpu")
    assert torch.equal(materialised, dense)
    reference = create_block_mask(flex.mask_mod, 2, 1, 10, 30, device="cpu", BLOCK_SIZE=tile)
    assert _tile_sets(flex) == _tile_sets(reference)


def test_block_labels_never_reach_into_the_next_document() -> None:
    docs = torch.tensor([[0] * 4 + [1] * 4])
    ids = torch.arange(8).unsqueeze(0)
    ones = torch.ones_like(ids)
    anchors, valid = torch.tensor([[0]]), torch.tensor([[True]])
    labels, _ = block_labels(ids, ones, anchors, valid, block_size=4, shift=1, document_ids=docs)
    assert labels[0, 0].tolist() == [1, 2, 3, IGNORE_INDEX]  # anchor + 4 is document 1's
    plain, _ = block_labels(ids, ones, anchors, valid, block_size=4, shift=1)
    assert plain[0, 0].tolist() == [1, 2, 3, 4]


def test_packed_anchors_never_open_a_block_across_documents_and_share_the_row_budget() -> None:
    docs = torch.tensor([[0] * 10 + [1] * 30 + [-1] * 8])
    attention = (docs >= 0).long()
    drawn = sample_counter_anchors(
        attention, attention, block_size=4, num_anchors=12, key=5, rows=torch.tensor([0]),
        document_ids=docs,
    )  # fmt: skip
    anchors = drawn.anchors[0][drawn.valid[0]]
    assert len(anchors) == 12
    assert all(int(docs[0, a]) == int(docs[0, a + 3]) >= 0 for a in anchors)
