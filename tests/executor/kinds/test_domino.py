"""Domino's torch half: the head's tensors and alignment, its objective, its greedy proposals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from testkit.tiny import TINY_VOCAB, randomize, tiny_plan

from dflash_recipes.executor.kinds.domino import (
    DominoHead,
    domino_backbone_weight,
    domino_head,
    domino_loss,
)
from dflash_recipes.executor.kinds.dspark import DSparkHead
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.training.loss import decay_weights

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
    assert domino_head(domino.head).prefix_gru is domino.prefix_gru

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


@pytest.mark.parametrize(("shift", "prefix"), [(1, 1), (1, 0), (1, 3), (0, 0), (0, 2)])
def test_domino_prefix_is_uncorrected_and_position_k_sees_the_tokens_before_its_target(
    shift: int, prefix: int
) -> None:
    """Positions < pure_draft_prefix_len keep the backbone logits exactly; position k >= it is
    corrected from the GRU state over prev[first .. k] (the tokens anchor .. anchor + k + shift
    - 1) and nothing later."""
    torch.manual_seed(0)
    head = DominoHead(H, 8, 16, TINY_VOCAB, shift=shift, pure_draft_prefix_len=prefix)
    randomize(head)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    prev = torch.randn(N, B, H)
    first = 1 - shift
    with torch.no_grad():
        out = head(hidden, prev, base)
        assert torch.equal(out[:, :prefix], base[:, :prefix])
        for k in range(prefix, B):
            assert (out[:, k] - base[:, k]).abs().amax() > 1e-6, f"position {k} uncorrected"
        for j in range(B):  # perturb prev[j], the token at anchor + j + shift - 1
            moved = prev.clone()
            moved[:, j] += 1.0
            diff = (head(hidden, moved, base) - out).abs().amax(dim=(0, 2))
            for k in range(B):
                sees = k >= prefix and first <= j <= k
                assert (diff[k] > 1e-6) == sees, f"position {k}, prev index {j}"


def test_domino_computes_modelopts_correction() -> None:
    """ModelOpt 0.47 (shift_label true): gru_out = GRU(embeds of anchor + 0 .. B-1); position
    p >= prefix gets base + embed_proj([h_p ; gru_out[p]])."""
    torch.manual_seed(1)
    head = DominoHead(H, 8, 16, TINY_VOCAB, shift=1, pure_draft_prefix_len=1)
    randomize(head)
    hidden, base, prev = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB), torch.randn(N, B, H)
    with torch.no_grad():
        gru_out, _ = head.prefix_gru(prev)
        want = base[:, 1:] + head.embed_proj(torch.cat([hidden[:, 1:], gru_out[:, 1:]], -1))
        torch.testing.assert_close(head(hidden, prev, base)[:, 1:], want)


def _probs_to_logits(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax is exactly the given distributions."""
    return torch.tensor(rows, dtype=torch.float64).log().float()


def _hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block of 3 positions over a vocabulary of 2 (test_loss.py's hand case)."""
    logits = _probs_to_logits([0.01, 0.99], [0.25, 0.75], [0.5, 0.5]).view(1, 1, 3, 2)
    labels = torch.tensor([[[-100, 1, 0]]])
    label_mask = torch.tensor([[[False, True, True]]])
    return logits, labels, label_mask


# -- Domino ------------------------------------------------------------------------------------


def test_domino_loss_mixes_corrected_and_backbone_cross_entropy() -> None:
    logits, labels, label_mask = _hand_case()
    corrected = logits.view(1, 3, 2)
    backbone = _probs_to_logits([0.5, 0.5], [0.5, 0.5], [0.2, 0.8]).view(1, 3, 2)
    weights = decay_weights(3, 1.0)
    out = domino_loss(
        corrected,
        backbone,
        labels.view(1, 3),
        label_mask.view(1, 3),
        weights=weights,
        backbone_weight=0.5,
    )
    w1, w2 = 1.0, math.exp(-1.0)
    ce = (w1 * -math.log(0.75) + w2 * -math.log(0.5)) / (w1 + w2)
    backbone_ce = (w1 * -math.log(0.5) + w2 * -math.log(0.2)) / (w1 + w2)
    assert out.ce.item() == pytest.approx(ce, rel=1e-5)
    assert "backbone_ce" in out.parts
    assert out.parts["backbone_ce"].item() == pytest.approx(backbone_ce, rel=1e-5)
    assert out.loss.item() == pytest.approx(ce + 0.5 * backbone_ce, rel=1e-5)
    # accuracy is the corrected logits': both right (the backbone gets position 2 wrong)
    assert out.per_position_correct.tolist() == [0, 1, 1]


def test_domino_backbone_weight_decays_linearly_to_zero() -> None:
    assert domino_backbone_weight(0, 100, 2.0) == 2.0
    assert domino_backbone_weight(25, 100, 2.0) == pytest.approx(1.5)
    assert domino_backbone_weight(100, 100, 2.0) == 0.0
    assert domino_backbone_weight(150, 100, 2.0) == 0.0
    with pytest.raises(ValueError, match="total_steps"):
        domino_backbone_weight(0, 0, 1.0)
