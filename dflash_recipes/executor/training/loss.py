"""What every drafter kind's objective is made of: position weights, weighted means, the loss
output and how chunks combine; and the acceptance metrics.

Each kind's objective is in its kind module (:mod:`dflash_recipes.executor.kinds`: plain
DFlash's ``dflash_loss``, Domino's and DSpark's head terms); it reads one chunk of blocks as
:class:`ObjectiveInputs` and returns a :class:`LossOutput`.

Shapes: logits ``[..., K, V]`` with labels and label_mask ``[..., K]``, where ``K`` is the block
size and the leading dims are anything (``[B, N]`` for the packed blocks of a batch, ``[N*B]``
for a head's flattened blocks). Labels come from
:func:`~dflash_recipes.executor.training.anchors.block_labels`: position k predicts the token at
``anchor + k + shift``; with ``shift`` 0 (plain DFlash) position 0 is never supervised, with
``shift`` 1 (Domino and DSpark with shift_label, as ModelOpt trains them) it is. Below, the
``j``-th drafted position is ``k = j - shift`` (j = 1, 2, ...).

Every term is a weighted mean over supervised positions, ``sum(w * term) / sum(w)`` with the
sum over positions where ``label_mask`` is true; a batch with no supervised position gives a
zero loss that still back-propagates (zeros), never NaN. Log-probabilities are computed in
float32 whatever the logits' dtype.

**Position weights** (``objective.loss_objective``):

- ``decay``: ``w = exp(-(j-1)/gamma)`` for the j-th drafted position (gamma =
  ``loss_decay_factor``): ``w_k = exp(-(k-1)/gamma)`` and ``w_0 = 0`` without the shift,
  ``w_k = exp(-k/gamma)`` with it (ModelOpt's weights).
- ``dpace``: a drafted token at position k is only accepted if positions 1..k-1 were, so its
  loss is weighted by the probability that the draft survives to k, estimated from the model's
  own detached probabilities of the correct tokens: ``S_k = prod_{j=1}^{k-1} p_j`` (``S_1 = 1``;
  an unsupervised position contributes ``p_j = 1``), smoothed towards uniform so no position
  ever loses its gradient: ``w_k = (1 - alpha) + alpha * S_k``, ``w_0 = 0`` (with the shift
  the product starts at position 0 and ``w_0 = 1``). Weights lie in ``[1 - alpha, 1]``, the
  first drafted position's is 1, are non-increasing in k, carry no gradient and, like the
  decay weights, are normalised by their sum.

**Self-distillation** (``objective.self_logit_distillation``, every kind): the loss becomes
``weighted_mean(CE(draft, label)) + weighted_mean(softCE(target, draft))`` with the same
weights, where ``softCE = -sum_v q_v log p_v``, q the target's softmax at ``anchor + k - 1``
(see :func:`~dflash_recipes.executor.training.anchors.gather_teacher_logits`). Its gradient equals
that
of KL(q || p); the reported value includes the target's entropy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_recipes.executor.training.anchors import IGNORE_INDEX
from dflash_recipes.plan.run_plan import ObjectivePlan


@attrs.frozen(eq=False)
class LossOutput:
    """A differentiable loss, its detached parts and the per-position accuracy counts."""

    #: Scalar to back-propagate.
    loss: Tensor
    #: Detached weighted cross-entropy on the labels (of the final logits).
    ce: Tensor
    #: [K] long: supervised positions whose top-1 prediction equals the label.
    per_position_correct: Tensor
    #: [K] long: supervised positions (entry 0 is 0 unless the labels are shifted).
    per_position_count: Tensor
    #: Detached sum of the position weights over supervised positions: the denominator of
    #: the weighted means (a data-parallel trainer normalises by its global sum).
    weight_sum: Tensor
    #: The objective's other terms, detached, each a weighted mean like `ce` (before its
    #: weight): ``distill`` (soft cross-entropy against the target, with self-distillation),
    #: and the kind's own (Domino's ``backbone_ce``, DSpark's ``tv``).
    parts: Mapping[str, Tensor] = attrs.field(factory=dict)
    #: Detached terms that are plain means over supervised positions (DSpark's
    #: ``confidence_bce``), before their weight.
    counted_parts: Mapping[str, Tensor] = attrs.field(factory=dict)
    #: The differentiable part of `loss` that is a mean over supervised positions rather than
    #: a weighted mean (DSpark's weighted confidence BCE); None when there is none. Lets
    #: :func:`combine_losses` rebuild the exact loss of a whole batch from its chunks.
    count_normalized: Tensor | None = None
    #: ``[K]`` long per name: supervised positions where another choice than the top-1 of
    #: the final logits equals the label (DFlash 2's ``selector``: its greedy choice among the
    #: unary top-K from the true previous token), for accuracy beside the unary one.
    position_correct: Mapping[str, Tensor] = attrs.field(factory=dict)


@attrs.frozen(eq=False)
class ObjectiveInputs:
    """What a kind's objective compares one chunk of blocks with (``[B, n, K, ...]``)."""

    #: ``[B, n, K]`` labels and supervision mask (``block_labels``).
    labels: Tensor
    label_mask: Tensor
    #: ``[B, n, K, V]`` float32 target logits for each block position (``gather_teacher_logits``)
    #: when the objective needs a teacher (``needs_teacher``), else None.
    teacher: Tensor | None
    #: Optimiser step and the run's total (Domino's decaying backbone weight).
    step: int
    total_steps: int
    #: 1 when block position k predicts anchor + k + 1 (a head with shift_label), else 0.
    shift: int = 0


# ---------------------------------------------------------------------------------------------
# position weights
# ---------------------------------------------------------------------------------------------


def decay_weights(
    block_size: int,
    gamma: float,
    *,
    device: torch.device | str | None = None,
    shift: int = 0,
) -> Tensor:
    """[block_size] float32: ``w_k = exp(-(k - 1 + shift)/gamma)``; ``w_0 = 0`` without shift."""
    if block_size < 2:
        msg = f"block_size must be >= 2, got {block_size}"
        raise ValueError(msg)
    if not gamma > 0 or not math.isfinite(gamma):
        msg = f"gamma (loss_decay_factor) must be a finite number > 0, got {gamma}"
        raise ValueError(msg)
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    weights = torch.exp(-(k - 1 + shift) / gamma)
    if shift == 0:
        weights[0] = 0.0
    return weights


def dpace_weights(
    logits: Tensor, labels: Tensor, label_mask: Tensor, *, alpha: float, shift: int = 0
) -> Tensor:
    """[..., K] detached D-PACE weights ``(1 - alpha) + alpha * prod_{j<k} p_j`` (module doc)."""
    if not 0 < alpha <= 1:
        msg = f"dpace_alpha must be in (0, 1], got {alpha}"
        raise ValueError(msg)
    check_shapes(logits, labels, label_mask)
    label_mask = without_anchor(label_mask, shift)
    with torch.no_grad():
        p_correct = torch.exp(-token_ce(logits, labels, label_mask))
        p_correct = torch.where(label_mask, p_correct, torch.ones_like(p_correct))
        reach = torch.cumprod(p_correct, dim=-1)
        # S_k is the product over positions strictly before k (S_0 = 1; without the shift
        # position 0 is unsupervised, p_0 = 1, so S_1 = 1 too).
        survival = torch.cat([torch.ones_like(reach[..., :1]), reach[..., :-1]], dim=-1)
        weights = (1.0 - alpha) + alpha * survival
        if shift == 0:
            weights[..., 0] = 0.0
    return weights


def objective_weights(
    logits: Tensor,
    labels: Tensor,
    label_mask: Tensor,
    *,
    objective: ObjectivePlan,
    shift: int = 0,
) -> Tensor:
    """The position weights `objective` asks for, broadcastable to `labels` (module doc)."""
    if objective.loss_objective == "dpace":
        return dpace_weights(logits, labels, label_mask, alpha=objective.dpace_alpha, shift=shift)
    return decay_weights(
        labels.shape[-1], objective.loss_decay_factor, device=logits.device, shift=shift
    )


# ---------------------------------------------------------------------------------------------
# combining chunks
# ---------------------------------------------------------------------------------------------


def combine_losses(parts: Sequence[LossOutput]) -> LossOutput:
    """The :class:`LossOutput` of a whole batch from those of disjoint chunks of its blocks.

    Exact, gradients included, because every term is a sum over positions divided by a
    normaliser: each chunk's weighted means are scaled back to sums with its ``weight_sum``
    (and its count-normalised part with its supervised count), summed, and divided by the
    totals. Chunks must come from the same objective call pattern (the same optional parts).
    """
    if not parts:
        msg = "combine_losses needs at least one chunk"
        raise ValueError(msg)
    if len(parts) == 1:
        return parts[0]
    weights = [part.weight_sum for part in parts]
    counts = [part.per_position_count.sum().float() for part in parts]
    w_total = torch.stack(weights).sum()
    n_total = torch.stack(counts).sum()
    w_norm = w_total.clamp_min(torch.finfo(w_total.dtype).tiny)
    n_norm = n_total.clamp_min(1.0)

    def weighted(values: Sequence[Tensor]) -> Tensor:
        return torch.stack([v * w for v, w in zip(values, weights, strict=True)]).sum() / w_norm

    def counted(values: Sequence[Tensor]) -> Tensor:
        return torch.stack([v * n for v, n in zip(values, counts, strict=True)]).sum() / n_norm

    def optional(name: str, combine: Callable[[Sequence[Tensor]], Tensor]) -> Tensor | None:
        values = [getattr(part, name) for part in parts]
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            msg = f"combine_losses: chunk outputs disagree on whether {name} is present"
            raise ValueError(msg)
        return combine(values)

    def named(field: str, combine: Callable[[Sequence[Tensor]], Tensor]) -> dict[str, Tensor]:
        terms: list[Mapping[str, Tensor]] = [getattr(part, field) for part in parts]
        names = list(dict.fromkeys(name for term in terms for name in term))
        for name in names:
            if any(name not in term for term in terms):
                msg = f"combine_losses: chunk outputs disagree on whether {name} is present"
                raise ValueError(msg)
        return {name: combine([term[name] for term in terms]) for name in names}

    count_loss = optional("count_normalized", counted)
    weighted_loss = weighted(
        [p.loss if p.count_normalized is None else p.loss - p.count_normalized for p in parts]
    )
    return LossOutput(
        loss=weighted_loss if count_loss is None else weighted_loss + count_loss,
        ce=weighted([p.ce for p in parts]),
        per_position_correct=torch.stack([p.per_position_correct for p in parts]).sum(dim=0),
        per_position_count=torch.stack([p.per_position_count for p in parts]).sum(dim=0),
        weight_sum=w_total,
        parts=named("parts", weighted),
        counted_parts=named("counted_parts", counted),
        count_normalized=count_loss,
        position_correct=named(
            "position_correct", lambda values: torch.stack(list(values)).sum(dim=0)
        ),
    )


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------


def per_position_accuracy(
    correct: Tensor | Sequence[int], count: Tensor | Sequence[int]
) -> list[float]:
    """Top-1 accuracy per block position; 0.0 where nothing was supervised (always position 0).

    Counts may be summed over steps or processes before calling.
    """
    correct_list = [int(c) for c in (correct.tolist() if isinstance(correct, Tensor) else correct)]
    count_list = [int(c) for c in (count.tolist() if isinstance(count, Tensor) else count)]
    if len(correct_list) != len(count_list):
        msg = f"correct has {len(correct_list)} positions but count has {len(count_list)}"
        raise ValueError(msg)
    return [c / n if n > 0 else 0.0 for c, n in zip(correct_list, count_list, strict=True)]


def estimated_acceptance_length(acc: Sequence[float], *, shift: int = 0) -> float:
    """``1 + sum_{k=f}^{K-1} prod_{j=f}^{k} acc_j`` for per-position accuracies ``acc[0..K-1]``,
    ``f = 1 - shift`` the first drafted position.

    The drafted tokens are accepted up to the first mistake, so the expected accepted prefix is
    the sum of the probabilities that positions f..k are all right (treating positions as
    independent); verification always commits one more token (the target's bonus or
    correction). Without the shift ``acc[0]`` (the anchor, never drafted) is ignored and
    all-correct gives K; with it position 0 drafts too and all-correct gives K + 1.
    """
    tau = 1.0
    survive = 1.0
    for a in list(acc)[1 - shift :]:
        survive *= a
        tau += survive
    return tau


# ---------------------------------------------------------------------------------------------
# the pieces every kind's objective is built from
# ---------------------------------------------------------------------------------------------


def loss_output(
    loss: Tensor,
    ce: Tensor,
    served_logits: Tensor,
    labels: Tensor,
    label_mask: Tensor,
    weights: Tensor,
    *,
    parts: Mapping[str, Tensor | None] | None = None,
    counted_parts: Mapping[str, Tensor | None] | None = None,
    count_normalized: Tensor | None = None,
) -> LossOutput:
    """A :class:`LossOutput`: accuracy counts of `served_logits` (the logits a server drafts
    from), every reported part detached; parts that are None are left out."""
    correct, count = _position_counts(served_logits, labels, label_mask)

    def detached(terms: Mapping[str, Tensor | None] | None) -> dict[str, Tensor]:
        return {name: t.detach() for name, t in (terms or {}).items() if t is not None}

    return LossOutput(
        loss=loss,
        ce=ce.detach(),
        per_position_correct=correct,
        per_position_count=count,
        weight_sum=_weight_sum(weights, label_mask),
        parts=detached(parts),
        counted_parts=detached(counted_parts),
        count_normalized=count_normalized,
    )


def check_shapes(logits: Tensor, labels: Tensor, label_mask: Tensor) -> None:
    if logits.dim() < 2 or logits.shape[:-1] != labels.shape or labels.shape != label_mask.shape:
        msg = (
            f"logits {tuple(logits.shape)} must be [..., K, V] with labels and label_mask "
            f"[..., K]; got labels {tuple(labels.shape)}, label_mask {tuple(label_mask.shape)}"
        )
        raise ValueError(msg)
    if label_mask.dtype != torch.bool:
        msg = f"label_mask must be a bool tensor, got {label_mask.dtype}"
        raise ValueError(msg)


def without_anchor(label_mask: Tensor, shift: int = 0) -> Tensor:
    """Without the shift, block position 0 (the given anchor) is never supervised, whatever
    the caller's mask; with it, the mask is the caller's."""
    if shift:
        return label_mask
    keep = torch.ones(label_mask.shape[-1], dtype=torch.bool, device=label_mask.device)
    keep[0] = False
    return label_mask & keep


def token_ce(logits: Tensor, labels: Tensor, label_mask: Tensor) -> Tensor:
    """[..., K] float32 cross-entropy per position; 0 where label_mask is false."""
    # cross_entropy is log_softmax + the label's negative log-probability in one call; ignored
    # positions come out as exactly 0.
    ignored = torch.where(label_mask, labels, IGNORE_INDEX)
    flat = logits.float().flatten(0, -2)
    nll = F.cross_entropy(flat, ignored.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    return nll.view(labels.shape)


def soft_ce(logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """[..., K] float32 ``-sum_v q_v log p_v``, q the (detached) teacher softmax."""
    if teacher_logits.shape != logits.shape:
        msg = (
            f"teacher_logits {tuple(teacher_logits.shape)} must have the shape of the logits "
            f"{tuple(logits.shape)}"
        )
        raise ValueError(msg)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.softmax(teacher_logits.detach().float(), dim=-1)
    return -(target * log_probs).sum(dim=-1)


def _weight_sum(weights: Tensor, label_mask: Tensor) -> Tensor:
    """Detached ``sum(w)`` over supervised positions, the weighted means' denominator."""
    w = torch.broadcast_to(weights.detach().float(), label_mask.shape) * label_mask
    return w.sum()


def weighted_mean(values: Tensor, weights: Tensor, label_mask: Tensor) -> Tensor:
    """``sum(w * v) / sum(w)`` over supervised positions; 0 (with zero gradient) if none."""
    w = torch.broadcast_to(weights.to(values.dtype), values.shape) * label_mask
    total = (torch.where(label_mask, values, torch.zeros_like(values)) * w).sum()
    return total / w.sum().clamp_min(torch.finfo(values.dtype).tiny)


def _position_counts(logits: Tensor, labels: Tensor, label_mask: Tensor) -> tuple[Tensor, Tensor]:
    """[K] correct and [K] supervised counts, summed over every leading dim."""
    with torch.no_grad():
        # max().indices: argmax's first-maximum rule, several times faster than argmax on CPU.
        hit = (logits.max(dim=-1).indices == labels) & label_mask
        k = labels.shape[-1]
        correct = hit.reshape(-1, k).sum(dim=0)
        count = label_mask.reshape(-1, k).sum(dim=0)
    return correct.long(), count.long()


__all__ = [
    "LossOutput",
    "ObjectiveInputs",
    "check_shapes",
    "combine_losses",
    "decay_weights",
    "dpace_weights",
    "estimated_acceptance_length",
    "loss_output",
    "objective_weights",
    "per_position_accuracy",
    "soft_ce",
    "token_ce",
    "weighted_mean",
    "without_anchor",
]
