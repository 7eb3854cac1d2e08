"""DSpark's torch half: the Markov bias head (vanilla, gated, rnn), its objective, proposals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from testkit.tiny import TINY_VOCAB, randomize, tiny_plan

from dflash_recipes.executor.kinds.dflash import dflash_loss
from dflash_recipes.executor.kinds.dspark import DSparkHead, dspark_loss
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.training.loss import decay_weights
from dflash_recipes.plan.run_plan import ObjectivePlan

N, B, H = 3, 5, 64

OBJECTIVE = ObjectivePlan(
    num_anchors=8,
    loss_objective="decay",
    loss_decay_factor=1.0,
    dpace_alpha=0.5,
    self_logit_distillation=False,
    domino_backbone_loss_weight=1.0,
    dspark_tv_weight=1.0,
    dspark_confidence_weight=0.1,
)


def _dspark(kind: str, shift: int = 1) -> DSparkHead:
    torch.manual_seed(2)
    head = DSparkHead(
        H, 4, TINY_VOCAB, use_confidence_head=True, markov_head_type=kind, shift=shift
    )
    randomize(head)
    return head


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_computes_modelopts_markov_bias_and_confidence(kind: str) -> None:
    """ModelOpt 0.47's DSpark heads, written out from their definitions, with prev[k] the token
    at anchor + k (shift_label true): vanilla W2(W1[x]); gated W2(sigmoid(gate_proj([h ; e]))
    * e); rnn the GRU-like recurrence of joint_proj over [s ; e ; h]; confidence
    confidence_proj([h ; W1[x]])."""
    head = _dspark(kind)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    tokens = torch.randint(0, TINY_VOCAB, (N, B))
    with torch.no_grad():
        logits, confidence = head(hidden, tokens, base)
        emb = head.markov_w1.weight[tokens]
        if kind == "vanilla":
            latent = emb
        elif kind == "gated":
            assert head.gate_proj is not None
            gate = torch.sigmoid(
                torch.cat([hidden, emb], -1) @ head.gate_proj.weight.T + head.gate_proj.bias
            )
            latent = gate * emb
        else:
            proj = head.joint_proj
            assert proj is not None
            state = torch.zeros(N, 4)
            steps = []
            for k in range(B):
                z = torch.cat([state, emb[:, k], hidden[:, k]], -1) @ proj.weight.T + proj.bias
                g, c, o = z[:, :4], z[:, 4:8], z[:, 8:]
                state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
                steps.append(torch.tanh(o))
            latent = torch.stack(steps, 1)
        torch.testing.assert_close(logits, base + latent @ head.markov_w2.weight.T)
        assert confidence is not None and head.confidence_proj is not None
        features = torch.cat([hidden, emb], -1)
        want = (features @ head.confidence_proj.weight.T + head.confidence_proj.bias)[..., 0]
        torch.testing.assert_close(confidence, want)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_position_k_sees_the_tokens_before_its_target_only(kind: str) -> None:
    head = _dspark(kind)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    tokens = torch.randint(0, TINY_VOCAB, (N, B))
    with torch.no_grad():
        out, _ = head(hidden, tokens, base)
        for j in range(B):
            moved = tokens.clone()
            moved[:, j] = (moved[:, j] + 1) % TINY_VOCAB
            diff = (head(hidden, moved, base)[0] - out).abs().amax(dim=(0, 2))
            for k in range(B):
                sees = j == k or (kind == "rnn" and j < k)
                assert (diff[k] > 1e-6) == sees, f"{kind}: position {k}, prev index {j}"


def test_dspark_without_shift_ignores_the_unused_index_0() -> None:
    head = _dspark("vanilla", shift=0)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    tokens = torch.randint(0, TINY_VOCAB, (N, B))
    tokens[:, 0] = -100  # index 0 is unused and may hold an ignore id
    with torch.no_grad():
        logits, _ = head(hidden, tokens, base)
        w1, w2 = head.markov_w1.weight, head.markov_w2.weight
        torch.testing.assert_close(logits[:, 1:], base[:, 1:] + w1[tokens[:, 1:]] @ w2.T)


def test_gated_and_rnn_heads_have_modelopts_tensors(tmp_path: Path) -> None:
    for kind, names in (
        ("gated", {"gate_proj.weight": (4, H + 4), "gate_proj.bias": (4,)}),
        ("rnn", {"joint_proj.weight": (12, 2 * 4 + H), "joint_proj.bias": (12,)}),
    ):
        plan = tiny_plan(tmp_path, projector_type="dspark", markov_rank=4, markov_head_type=kind)
        shapes = {
            n: tuple(t.shape)
            for n, t in DFlashDraftModel(plan.resolved_draft()).state_dict().items()
        }
        assert {n: shapes[n] for n in names} == names
        assert not {"gate_proj.weight", "joint_proj.weight"} - set(names) & set(shapes)


def _probs_to_logits(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax is exactly the given distributions."""
    return torch.tensor(rows, dtype=torch.float64).log().float()


def _hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block of 3 positions over a vocabulary of 2 (test_loss.py's hand case)."""
    logits = _probs_to_logits([0.01, 0.99], [0.25, 0.75], [0.5, 0.5]).view(1, 1, 3, 2)
    labels = torch.tensor([[[-100, 1, 0]]])
    label_mask = torch.tensor([[[False, True, True]]])
    return logits, labels, label_mask


# -- DSpark ------------------------------------------------------------------------------------


def test_dspark_loss_adds_total_variation_and_confidence_bce() -> None:
    logits, labels, label_mask = _hand_case()
    logits, labels, label_mask = logits.view(1, 3, 2), labels.view(1, 3), label_mask.view(1, 3)
    # target distributions: position 1 equal to the draft (TV 0), position 2 (0.8, 0.2): TV 0.3
    teacher = _probs_to_logits([0.5, 0.5], [0.25, 0.75], [0.8, 0.2]).view(1, 3, 2)
    confidence = torch.tensor([[[0.0], [2.0], [-1.0]]]).view(1, 3, 1)
    weights = decay_weights(3, 1.0)
    out = dspark_loss(
        logits,
        labels,
        label_mask,
        weights=weights,
        teacher_logits=teacher,
        confidence_logit=confidence,
        tv_weight=2.0,
        confidence_weight=0.5,
    )
    w1, w2 = 1.0, math.exp(-1.0)
    ce = (w1 * -math.log(0.75) + w2 * -math.log(0.5)) / (w1 + w2)
    tv = (w1 * 0.0 + w2 * 0.3) / (w1 + w2)
    # both drafts are right -> BCE targets 1: -log sigmoid(x), plain mean over positions 1, 2
    bce = (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(1.0))) / 2
    assert set(out.parts) == {"tv"} and set(out.counted_parts) == {"confidence_bce"}
    assert out.parts["tv"].item() == pytest.approx(tv, rel=1e-5)
    assert out.counted_parts["confidence_bce"].item() == pytest.approx(bce, rel=1e-5)
    assert out.loss.item() == pytest.approx(ce + 2.0 * tv + 0.5 * bce, rel=1e-5)


def test_dspark_without_target_or_confidence_head_is_plain_cross_entropy() -> None:
    logits, labels, label_mask = _hand_case()
    weights = decay_weights(3, 1.0)
    out = dspark_loss(
        logits,
        labels,
        label_mask,
        weights=weights,
        teacher_logits=None,
        confidence_logit=None,
        tv_weight=1.0,
        confidence_weight=1.0,
    )
    assert not out.parts and not out.counted_parts
    assert torch.equal(out.loss, dflash_loss(logits, labels, label_mask, objective=OBJECTIVE).loss)


def test_dspark_confidence_learns_whether_the_draft_is_wrong() -> None:
    # position 1 is drafted wrong (argmax 1, label 0): target 0, BCE = -log(1 - sigmoid(x))
    logits = _probs_to_logits([0.5, 0.5], [0.3, 0.7]).view(1, 2, 2)
    labels = torch.tensor([[-100, 0]])
    mask = torch.tensor([[False, True]])
    confidence = torch.tensor([[0.0, 1.5]], requires_grad=True)
    out = dspark_loss(
        logits,
        labels,
        mask,
        weights=decay_weights(2, 1.0),
        teacher_logits=None,
        confidence_logit=confidence,
        tv_weight=0.0,
        confidence_weight=1.0,
    )
    assert out.counted_parts["confidence_bce"].item() == pytest.approx(
        math.log1p(math.exp(1.5)), rel=1e-5
    )
    torch.autograd.backward(out.loss)
    assert confidence.grad is not None and confidence.grad[0, 1] > 0  # pushes confidence down
