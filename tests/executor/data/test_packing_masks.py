"""Per-document attention pieces for packed rows: anchors, the drafter's context, the target."""

from __future__ import annotations

from pathlib import Path

import torch
from testkit.numerics import assert_equal_up_to_rounding
from testkit.tiny import tiny_plan, tiny_target

from dflash_recipes.executor.model.convert import document_position_ids, target_forward
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


def test_packed_target_forward_equals_each_document_alone(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path)
    model = tiny_target(plan)
    assert model.config._attn_implementation == "sdpa"  # the implementation the mask goes to
    gen = torch.Generator().manual_seed(1)
    lengths = [7, 4, 5]
    vocab = model.config.vocab_size
    docs = [torch.randint(0, vocab, (1, n), generator=gen) for n in lengths]
    ids = torch.cat(docs, dim=1)
    doc_ids = torch.cat([torch.full((1, n), d) for d, n in enumerate(lengths)], dim=1)
    with torch.no_grad():
        packed = target_forward(
            model, ids, torch.ones_like(ids), with_logits=True, document_ids=doc_ids
        )
        start = 0
        for d, tokens in enumerate(docs):
            alone = target_forward(model, tokens, torch.ones_like(tokens), with_logits=True)
            part = slice(start, start + lengths[d])
            pairs = zip(packed.hidden_states, alone.hidden_states, strict=True)
            for layer, (p, a) in enumerate(pairs):
                assert_equal_up_to_rounding(p[:, part], a, what=f"doc {d} layer {layer}")
            assert packed.logits is not None and alone.logits is not None
            assert_equal_up_to_rounding(packed.logits[:, part], alone.logits, what="logits")
            start += lengths[d]


def test_a_token_of_one_document_changes_nothing_in_another(tmp_path: Path) -> None:
    model = tiny_target(tiny_plan(tmp_path))
    ids = torch.arange(12).unsqueeze(0) % model.config.vocab_size
    doc_ids = torch.tensor([[0] * 6 + [1] * 6])
    changed = ids.clone()
    changed[0, 2] = (changed[0, 2] + 1) % model.config.vocab_size
    with torch.no_grad():
        a = target_forward(
            model, ids, torch.ones_like(ids), with_logits=False, document_ids=doc_ids
        )
        b = target_forward(
            model, changed, torch.ones_like(ids), with_logits=False, document_ids=doc_ids
        )
    assert torch.equal(a.hidden_states[-1][:, 6:], b.hidden_states[-1][:, 6:])
    assert not torch.equal(a.hidden_states[-1][:, 2:6], b.hidden_states[-1][:, 2:6])


def test_position_ids_restart_at_every_document() -> None:
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    assert document_position_ids(docs).tolist() == [
        [0, 1, 2, 0, 1, 0, 1, 2, 3],
        list(range(9)),
    ]
