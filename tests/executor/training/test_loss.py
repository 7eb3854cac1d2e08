"""Loss objectives and acceptance metrics, checked against hand-computed values."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from dflash_recipes.executor.kinds.dflash import dflash_loss
from dflash_recipes.executor.kinds.domino import domino_loss
from dflash_recipes.executor.kinds.dspark import dspark_loss
from dflash_recipes.executor.training.loss import (
    decay_weights,
    dpace_weights,
    estimated_acceptance_length,
    objective_weights,
    per_position_accuracy,
)
from dflash_recipes.plan.run_plan import ObjectivePlan

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


def _probs_to_logits(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax is exactly the given distributions."""
    return torch.tensor(rows, dtype=torch.float64).log().float()


def _hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block of 3 positions over a vocabulary of 2.

    Position 0 (anchor): garbage logits, label_mask false. Position 1: p(label 1) = 3/4.
    Position 2: p(label 0) = 1/2.
    """
    logits = _probs_to_logits([0.01, 0.99], [0.25, 0.75], [0.5, 0.5]).view(1, 1, 3, 2)
    labels = torch.tensor([[[-100, 1, 0]]])
    label_mask = torch.tensor([[[False, True, True]]])
    return logits, labels, label_mask


def test_decay_weights_start_at_zero_then_exp_decay() -> None:
    w = decay_weights(4, 2.0)
    expected = [0.0, 1.0, math.exp(-0.5), math.exp(-1.0)]
    assert w.tolist() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("block_size", "gamma", "message"),
    [
        (1, 1.0, r"block_size must be >= 2, got 1"),
        (4, 0.0, r"gamma \(loss_decay_factor\) must be a finite number > 0, got 0.0"),
        (4, -1.0, r"gamma \(loss_decay_factor\) must be a finite number > 0, got -1.0"),
    ],
)
def test_decay_weights_reject_meaningless_settings(
    block_size: int, gamma: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        decay_weights(block_size, gamma)


def test_dflash_loss_equals_the_hand_computed_weighted_cross_entropy() -> None:
    logits, labels, label_mask = _hand_case()
    out = dflash_loss(logits.requires_grad_(), labels, label_mask, objective=OBJECTIVE)
    # gamma = 1: w1 = 1, w2 = e^-1
    w1, w2 = 1.0, math.exp(-1.0)
    expected = (w1 * -math.log(0.75) + w2 * -math.log(0.5)) / (w1 + w2)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.ce.item() == pytest.approx(expected, rel=1e-5)
    assert not out.parts  # no self-distillation term
    # The denominator, for a data-parallel trainer's global normalisation.
    assert out.weight_sum.item() == pytest.approx(w1 + w2, rel=1e-6)
    assert not out.weight_sum.requires_grad
    torch.autograd.backward(out.loss)
    assert logits.grad is not None
    assert logits.grad[0, 0, 0].abs().sum() == 0  # the anchor position gets no gradient
    # position 1 predicted 1 (right), position 2 ties -> argmax 0 (right); position 0 not counted
    assert out.per_position_count.tolist() == [0, 1, 1]
    assert out.per_position_correct.tolist() == [0, 1, 1]


def test_positions_outside_the_label_mask_change_nothing() -> None:
    logits, labels, label_mask = _hand_case()
    extended = torch.cat([logits, _probs_to_logits([0.9, 0.1]).view(1, 1, 1, 2)], dim=2)
    ext_labels = torch.cat([labels, torch.tensor([[[1]]])], dim=2)
    ext_mask = torch.cat([label_mask, torch.tensor([[[False]]])], dim=2)
    base = dflash_loss(extended, ext_labels, ext_mask, objective=OBJECTIVE).loss
    scrambled_logits = extended.clone()
    scrambled_logits[0, 0, 3] = torch.tensor([5.0, -5.0])
    scrambled_labels = ext_labels.clone()
    scrambled_labels[0, 0, 3] = 0
    other = dflash_loss(scrambled_logits, scrambled_labels, ext_mask, objective=OBJECTIVE).loss
    assert torch.equal(base, other)


def test_position_zero_never_counts_even_if_the_caller_marks_it() -> None:
    logits, labels, label_mask = _hand_case()
    labels = labels.clone()
    labels[0, 0, 0] = 0
    marked = label_mask.clone()
    marked[0, 0, 0] = True
    a = dflash_loss(logits, labels, label_mask, objective=OBJECTIVE)
    b = dflash_loss(logits, labels, marked, objective=OBJECTIVE)
    assert torch.equal(a.loss, b.loss)
    assert b.per_position_count[0] == 0


def test_nothing_supervised_gives_a_zero_loss_that_backpropagates() -> None:
    logits = torch.randn(2, 3, 4, 7, requires_grad=True)
    labels = torch.zeros(2, 3, 4, dtype=torch.long)
    out = dflash_loss(logits, labels, torch.zeros(2, 3, 4, dtype=torch.bool), objective=OBJECTIVE)
    assert out.loss.item() == 0.0
    torch.autograd.backward(out.loss)
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert out.per_position_count.sum() == 0


def test_all_correct_logits_give_accuracy_one_and_tau_equal_to_block_size() -> None:
    block_size, vocab = 5, 11
    labels = torch.randint(0, vocab, (2, 3, block_size), generator=torch.Generator().manual_seed(0))
    logits = torch.nn.functional.one_hot(labels, vocab).float() * 20.0
    label_mask = torch.ones_like(labels, dtype=torch.bool)
    out = dflash_loss(logits, labels, label_mask, objective=OBJECTIVE)
    acc = per_position_accuracy(out.per_position_correct, out.per_position_count)
    assert acc == [0.0, 1.0, 1.0, 1.0, 1.0]  # position 0 is never drafted
    assert out.per_position_count.tolist() == [0, 6, 6, 6, 6]
    assert estimated_acceptance_length(acc) == block_size


def test_bfloat16_logits_are_scored_in_float32() -> None:
    logits = torch.randn(1, 2, 4, 50, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 50, (1, 2, 4), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(1, 2, 4, dtype=torch.bool)
    low = logits.bfloat16()
    out = dflash_loss(low, labels, mask, objective=OBJECTIVE)
    ref = dflash_loss(low.float(), labels, mask, objective=OBJECTIVE)
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)


# -- D-PACE ------------------------------------------------------------------------------------


def _dpace_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p(correct) = 1/2 at position 1, 1/4 at position 2, 0.8 at position 3."""
    logits = _probs_to_logits([0.5, 0.5], [0.5, 0.5], [0.75, 0.25], [0.2, 0.8]).view(1, 4, 2)
    labels = torch.tensor([[-100, 0, 1, 1]])
    mask = torch.tensor([[False, True, True, True]])
    return logits, labels, mask


def test_dpace_weights_are_the_smoothed_survival_probability() -> None:
    logits, labels, mask = _dpace_case()
    pure = dpace_weights(logits, labels, mask, alpha=1.0)
    # S_1 = 1, S_2 = p_1 = 1/2, S_3 = p_1 * p_2 = 1/8
    assert pure[0].tolist() == pytest.approx([0.0, 1.0, 0.5, 0.125])
    half = dpace_weights(logits, labels, mask, alpha=0.5)
    assert half[0].tolist() == pytest.approx([0.0, 1.0, 0.75, 0.5625])


def test_dpace_weights_are_bounded_non_increasing_and_detached() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, 8, 13, generator=gen, requires_grad=True)
    labels = torch.randint(0, 13, (4, 6, 8), generator=gen)
    mask = torch.rand(4, 6, 8, generator=gen) > 0.3
    alpha = 0.7
    w = dpace_weights(logits, labels, mask, alpha=alpha)
    assert not w.requires_grad
    assert (w[..., 0] == 0).all()
    assert torch.allclose(w[..., 1], torch.ones_like(w[..., 1]))
    assert (w[..., 1:] >= 1 - alpha - 1e-6).all() and (w[..., 1:] <= 1 + 1e-6).all()
    assert (w[..., 2:] <= w[..., 1:-1] + 1e-6).all()


def test_dpace_loss_gradient_treats_the_weights_as_constants() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 5, 9, generator=gen)
    labels = torch.randint(0, 9, (2, 3, 5), generator=gen)
    mask = torch.rand(2, 3, 5, generator=gen) > 0.2
    dpace = attrs.evolve(OBJECTIVE, loss_objective="dpace", dpace_alpha=0.6)

    x = logits.clone().requires_grad_()
    torch.autograd.backward(dflash_loss(x, labels, mask, objective=dpace).loss)

    y = logits.clone().requires_grad_()
    w = dpace_weights(logits, labels, mask, alpha=0.6)  # constants
    mask0 = mask.clone()
    mask0[..., 0] = False
    ce = torch.nn.functional.cross_entropy(
        y.reshape(-1, 9), labels.clamp_min(0).reshape(-1), reduction="none"
    ).view_as(w)
    torch.autograd.backward((w * ce * mask0).sum() / (w * mask0).sum())
    assert x.grad is not None and y.grad is not None
    assert torch.allclose(x.grad, y.grad, atol=1e-6)


def test_dpace_with_perfect_predictions_is_the_unweighted_mean() -> None:
    labels = torch.tensor([[[-100, 2, 0, 1]]])
    sharp = torch.nn.functional.one_hot(labels.clamp_min(0), 3).float() * 50.0
    mask = torch.tensor([[[False, True, True, True]]])
    w = dpace_weights(sharp, labels, mask, alpha=1.0)
    assert w[0, 0].tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0])


def test_an_unsupervised_position_does_not_lower_the_survival_of_later_ones() -> None:
    logits, labels, mask = _dpace_case()
    hole = mask.clone()
    hole[0, 2] = False  # position 2 not supervised: counts as p = 1
    w = dpace_weights(logits, labels, hole, alpha=1.0)
    assert w[0].tolist() == pytest.approx([0.0, 1.0, 0.5, 0.5])


def test_objective_weights_follow_the_plan() -> None:
    logits, labels, mask = _dpace_case()
    decay = objective_weights(logits, labels, mask, objective=OBJECTIVE)
    assert decay.tolist() == pytest.approx(decay_weights(4, 1.0).tolist())
    dpace = objective_weights(
        logits, labels, mask, objective=attrs.evolve(OBJECTIVE, loss_objective="dpace")
    )
    assert dpace[0].tolist() == pytest.approx([0.0, 1.0, 0.75, 0.5625])


# -- self-distillation -------------------------------------------------------------------------


def test_self_distillation_adds_the_soft_cross_entropy_with_the_same_weights() -> None:
    logits, labels, label_mask = _hand_case()
    # target: p(1) = 0.9 at position 1, uniform at position 2
    teacher = _probs_to_logits([0.5, 0.5], [0.1, 0.9], [0.5, 0.5]).view(1, 1, 3, 2)
    objective = attrs.evolve(OBJECTIVE, self_logit_distillation=True)
    out = dflash_loss(logits, labels, label_mask, objective=objective, teacher_logits=teacher)
    w1, w2 = 1.0, math.exp(-1.0)
    soft1 = -(0.1 * math.log(0.25) + 0.9 * math.log(0.75))
    soft2 = -(0.5 * math.log(0.5) + 0.5 * math.log(0.5))
    ce = (w1 * -math.log(0.75) + w2 * -math.log(0.5)) / (w1 + w2)
    distill = (w1 * soft1 + w2 * soft2) / (w1 + w2)
    assert out.parts["distill"].item() == pytest.approx(distill, rel=1e-5)
    assert out.loss.item() == pytest.approx(ce + distill, rel=1e-5)


def test_self_distillation_needs_teacher_logits_and_only_when_enabled() -> None:
    logits, labels, label_mask = _hand_case()
    with pytest.raises(ValueError, match="self_logit_distillation is on but no teacher_logits"):
        dflash_loss(
            logits,
            labels,
            label_mask,
            objective=attrs.evolve(OBJECTIVE, self_logit_distillation=True),
        )
    with pytest.raises(ValueError, match="self_logit_distillation is off"):
        dflash_loss(logits, labels, label_mask, objective=OBJECTIVE, teacher_logits=logits)


def test_mismatched_shapes_are_reported() -> None:
    with pytest.raises(ValueError, match=r"\[\.\.\., K, V\]"):
        dflash_loss(
            torch.zeros(1, 2, 4, 5),
            torch.zeros(1, 2, 3, dtype=torch.long),
            torch.zeros(1, 2, 3, dtype=torch.bool),
            objective=OBJECTIVE,
        )


# -- metrics -----------------------------------------------------------------------------------


def test_per_position_accuracy_divides_and_reports_zero_where_nothing_was_seen() -> None:
    assert per_position_accuracy([0, 3, 1, 0], [0, 4, 2, 0]) == [0.0, 0.75, 0.5, 0.0]
    assert per_position_accuracy(torch.tensor([0, 2]), torch.tensor([0, 2])) == [0.0, 1.0]
    with pytest.raises(ValueError, match="positions"):
        per_position_accuracy([1, 2], [1])


def test_estimated_acceptance_length_is_the_expected_prefix_plus_the_bonus_token() -> None:
    # 1 + 0.5 + 0.5*0.5 + 0.5*0.5*0 ; acc[0] (the anchor) is ignored
    assert estimated_acceptance_length([0.123, 0.5, 0.5, 0.0]) == pytest.approx(1.75)
    assert estimated_acceptance_length([0.0, 0.0, 1.0, 1.0]) == 1.0
    assert estimated_acceptance_length([0.0, 1.0, 1.0, 1.0]) == 4.0


def test_shifted_decay_weights_score_position_0_like_modelopt() -> None:
    """With shift_label, the j-th drafted position is k = j - 1: w_k = exp(-k/gamma), w_0 = 1."""
    w = decay_weights(4, 2.0, shift=1)
    assert w.tolist() == pytest.approx([1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)])


def test_shifted_losses_score_position_0_and_unshifted_ones_never_do() -> None:
    logits = _probs_to_logits([0.25, 0.75], [0.5, 0.5]).view(1, 1, 2, 2)
    labels = torch.tensor([[[1, 0]]])
    mask = torch.tensor([[[True, True]]])
    weights = decay_weights(2, 1.0, shift=1)
    out = domino_loss(logits, logits, labels, mask, weights=weights, backbone_weight=0.0, shift=1)
    expected = (-math.log(0.75) * 1.0 + -math.log(0.5) * math.exp(-1.0)) / (1 + math.exp(-1.0))
    assert float(out.ce) == pytest.approx(expected, rel=1e-5)
    assert out.per_position_count.tolist() == [1, 1]
    unshifted = domino_loss(
        logits, logits, labels, mask, weights=decay_weights(2, 1.0), backbone_weight=0.0
    )
    assert unshifted.per_position_count.tolist() == [0, 1]
    assert float(unshifted.ce) == pytest.approx(-math.log(0.5), rel=1e-5)
    dspark = dspark_loss(
        logits,
        labels,
        mask,
        weights=weights,
        teacher_logits=None,
        confidence_logit=None,
        tv_weight=1.0,
        confidence_weight=0.0,
        shift=1,
    )
    assert float(dspark.ce) == pytest.approx(expected, rel=1e-5)


def test_shifted_dpace_weights_start_the_survival_at_position_0() -> None:
    logits = _probs_to_logits([0.5, 0.5], [0.5, 0.5], [0.5, 0.5]).view(1, 3, 2)
    labels = torch.tensor([[0, 0, 0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    w = dpace_weights(logits, labels, mask, alpha=1.0, shift=1)
    assert w[0].tolist() == pytest.approx([1.0, 0.5, 0.25])


def test_shifted_acceptance_estimate_counts_position_0_as_a_draft() -> None:
    assert estimated_acceptance_length([0.5, 0.5, 0.0], shift=1) == pytest.approx(1.75)
    assert estimated_acceptance_length([1.0, 1.0, 1.0, 1.0], shift=1) == 5.0
