"""Plain DFlash, its torch half: no head, the weighted cross-entropy, argmax proposals.

Block position k predicts anchor + k (position 0, the anchor, is never scored); the drafter's
proposals are the backbone's greedy tokens at positions ``1 .. B-1``. The torch-free half (its
tensors and export fields): :mod:`dflash_recipes.checkpoint.kinds.dflash`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from dflash_recipes.executor.kinds.protocol import (
    Chooser,
    KindHead,
    greedy_choice,
    plain_layer,
    propose_each_position,
)
from dflash_recipes.executor.model.layers import DraftDecoderLayer
from dflash_recipes.executor.training.loss import (
    LossOutput,
    ObjectiveInputs,
    check_shapes,
    loss_output,
    objective_weights,
    soft_ce,
    token_ce,
    weighted_mean,
    without_anchor,
)
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import ObjectivePlan


def dflash_loss(
    logits: Tensor,
    labels: Tensor,
    label_mask: Tensor,
    *,
    objective: ObjectivePlan,
    teacher_logits: Tensor | None = None,
    weights: Tensor | None = None,
) -> LossOutput:
    """Weighted cross-entropy of a plain DFlash drafter, plus optional self-distillation
    (``parts["distill"]``; docs in :mod:`~dflash_recipes.executor.training.loss`).

    `teacher_logits` (same shape as `logits`) is required exactly when
    ``objective.self_logit_distillation`` is on. `weights`: the position weights of `objective`
    when the caller already computed them for these logits (``objective_weights``; D-PACE's
    are a cross-entropy over the vocabulary), else computed here.
    """
    check_shapes(logits, labels, label_mask)
    label_mask = without_anchor(label_mask)
    if objective.self_logit_distillation and teacher_logits is None:
        msg = "self_logit_distillation is on but no teacher_logits were passed"
        raise ValueError(msg)
    if not objective.self_logit_distillation and teacher_logits is not None:
        msg = "teacher_logits were passed but self_logit_distillation is off"
        raise ValueError(msg)
    if weights is None:
        weights = objective_weights(logits, labels, label_mask, objective=objective)
    ce = weighted_mean(token_ce(logits, labels, label_mask), weights, label_mask)
    loss = ce
    distill: Tensor | None = None
    if teacher_logits is not None:
        distill = weighted_mean(soft_ce(logits, teacher_logits), weights, label_mask)
        loss = loss + distill
    return loss_output(loss, ce, logits, labels, label_mask, weights, parts={"distill": distill})


class DFlashModules:
    """Plain DFlash (module doc)."""

    name = "dflash"

    def build_head(self, spec: ResolvedDraft) -> KindHead | None:
        """No head."""
        return None

    def build_layer(self, spec: ResolvedDraft) -> DraftDecoderLayer:
        """The DFlash decoder layer."""
        return plain_layer(spec)

    def head_inputs(
        self, spec: ResolvedDraft, ids: Tensor, anchors: Tensor, embeddings: nn.Module
    ) -> tuple[Tensor, ...]:
        """Nothing beyond the draft states."""
        return ()

    def objective(
        self,
        head: nn.Module | None,
        hidden: Tensor,
        logits: Tensor,
        head_inputs: Sequence[Tensor],
        targets: ObjectiveInputs,
        objective: ObjectivePlan,
    ) -> LossOutput:
        """:func:`dflash_loss` of the backbone logits."""
        teacher = targets.teacher if objective.self_logit_distillation else None
        return dflash_loss(
            logits, targets.labels, targets.label_mask, objective=objective, teacher_logits=teacher
        )

    def propose(
        self,
        head: nn.Module | None,
        hidden: Tensor,
        base_logits: Tensor,
        anchor_tokens: Sequence[int],
        spec: ResolvedDraft,
        embeddings: nn.Module,
        choose: Chooser = greedy_choice,
    ) -> Tensor:
        """The backbone's choice at each drafting position (the argmax by default)."""
        return propose_each_position(base_logits, spec.first_drafting_position, choose)


MODULES = DFlashModules()

__all__ = ["MODULES", "DFlashModules", "dflash_loss"]
