"""Domino and DSpark heads: tensor names, the next-token alignment, fresh heads are neutral."""

from __future__ import annotations

from pathlib import Path

import torch
from testkit.tiny import TINY_VOCAB, randomize, tiny_plan

from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.heads import DominoHead, DSparkHead

N, B, H = 3, 5, 64


def test_head_submodules_sit_at_the_top_level(tmp_path: Path) -> None:
    domino = DFlashDraftModel(
        tiny_plan(tmp_path, projector_type="domino", emb_dim=16, gru_hidden_dim=8).resolved_draft()
    )
    shapes = {n: tuple(t.shape) for n, t in domino.state_dict().items()}
    assert shapes["prefix_gru.weight_ih_l0"] == (24, H)
    assert shapes["prefix_gru.weight_hh_l0"] == (24, 8)
    assert shapes["embed_proj.0.weight"] == (16, H + 8)
    assert shapes["embed_proj.2.weight"] == (TINY_VOCAB, 16)
    assert not any(n.startswith(("head.", "_head.")) for n in shapes)
    # The head object shares the module's parameters (one copy, moved and trained together).
    assert domino.domino_head.prefix_gru is domino.prefix_gru

    dspark = DFlashDraftModel(
        tiny_plan(
            tmp_path, projector_type="dspark", markov_rank=4, use_confidence_head=True
        ).resolved_draft()
    )
    shapes = {n: tuple(t.shape) for n, t in dspark.state_dict().items()}
    assert shapes["markov_w1.weight"] == (TINY_VOCAB, 4)
    assert shapes["markov_w2.weight"] == (TINY_VOCAB, 4)
    assert shapes["confidence_proj.weight"] == (1, H + 4)
    assert shapes["confidence_proj.bias"] == (1,)


def test_fresh_heads_leave_backbone_logits_unchanged() -> None:
    torch.manual_seed(0)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    domino = DominoHead(H, 8, 16, TINY_VOCAB)
    domino.reset_parameters()
    assert torch.equal(domino(hidden, torch.randn(N, B, H), base), base)
    dspark = DSparkHead(H, 4, TINY_VOCAB, use_confidence_head=False)
    dspark.reset_parameters()
    logits, confidence = dspark(hidden, torch.randint(0, TINY_VOCAB, (N, B)), base)
    assert torch.equal(logits, base) and confidence is None


def test_domino_position_k_conditions_on_tokens_anchor_to_anchor_plus_k_minus_1() -> None:
    torch.manual_seed(0)
    head = DominoHead(H, 8, 16, TINY_VOCAB)
    randomize(head)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    prefix = torch.randn(N, B, H)
    with torch.no_grad():
        out = head(hidden, prefix, base)
        for j in range(B):  # perturb the token at anchor + j - 1
            moved = prefix.clone()
            moved[:, j] += 1.0
            diff = (head(hidden, moved, base) - out).abs().amax(dim=(0, 2))
            for k in range(B):
                sees = 1 <= j <= k
                assert (diff[k] > 1e-6) == sees, f"position {k}, prefix index {j}"


def test_dspark_bias_is_the_markov_transition_of_the_previous_token() -> None:
    torch.manual_seed(0)
    head = DSparkHead(H, 4, TINY_VOCAB, use_confidence_head=True)
    randomize(head)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    tokens = torch.randint(0, TINY_VOCAB, (N, B))
    tokens[:, 0] = -100  # index 0 is unused and may hold an ignore id
    with torch.no_grad():
        logits, confidence = head(hidden, tokens, base)
        w1, w2 = head.markov_w1.weight, head.markov_w2.weight
        expected = base[:, 1:] + w1[tokens[:, 1:]] @ w2.T
        torch.testing.assert_close(logits[:, 1:], expected)
        assert confidence is not None and confidence.shape == (N, B)
        assert head.confidence_proj is not None
        features = torch.cat([hidden, w1[tokens.clamp(min=0)]], -1)
        want = (features @ head.confidence_proj.weight.T + head.confidence_proj.bias)[..., 0]
        torch.testing.assert_close(confidence[:, 1:], want[:, 1:])
