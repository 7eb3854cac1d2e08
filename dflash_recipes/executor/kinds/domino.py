"""Domino, its torch half: the GRU correction head, its objective and its proposals.

The head (as ModelOpt computes it; alignment: :mod:`~dflash_recipes.executor.kinds.protocol`):
a bias-free GRU runs over the target embeddings of ``prev``; position ``k >= prefix`` adds
``embed_proj([h_k ; s_k])`` to the backbone logits, ``s_k`` the GRU state after ``prev[first ..
k]`` (``first = 1 - shift``; ``embed_proj``: Linear ``H+g -> emb_dim``, SiLU, Linear ``emb_dim
-> vocab``, no biases). Positions ``< prefix`` (``pure_draft_prefix_len``) keep the backbone
logits: they are proposed uncorrected. ``embed_proj.2`` starts at zero, so a fresh head leaves
the backbone logits unchanged at the first step of a warm start.

The objective: ``CE(corrected) + w * CE(backbone)`` [+ self-distillation], ``w`` decaying from
``domino_backbone_loss_weight`` to 0 over the run (docs/dflash.md, "The training objective").
The torch-free half (tensors, export fields, checks): :mod:`dflash_recipes.checkpoint.kinds.
domino`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dflash_recipes.executor.kinds.protocol import (
    INIT_STD,
    Chooser,
    KindHead,
    check_blocks,
    expect_head,
    greedy_choice,
    plain_layer,
    propose_by_position,
)
from dflash_recipes.executor.model.layers import DraftDecoderLayer
from dflash_recipes.executor.training.anchors import previous_tokens
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


class DominoHead(KindHead):
    """GRU correction head: ``prefix_gru.weight_{ih,hh}_l0``, ``embed_proj.{0,2}.weight``."""

    def __init__(
        self,
        hidden_size: int,
        gru_hidden_dim: int,
        emb_dim: int,
        vocab_size: int,
        *,
        shift: int = 1,
        pure_draft_prefix_len: int = 1,
    ) -> None:
        super().__init__()
        self.gru_hidden_dim = gru_hidden_dim
        self.shift = shift
        self.pure_draft_prefix_len = pure_draft_prefix_len
        self.prefix_gru = nn.GRU(hidden_size, gru_hidden_dim, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden_size + gru_hidden_dim, emb_dim, bias=False),
            nn.SiLU(),
            nn.Linear(emb_dim, vocab_size, bias=False),
        )

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """GRU: uniform(+-1/sqrt(g)) as torch does; embed_proj.0 normal; embed_proj.2 zero."""
        bound = self.gru_hidden_dim**-0.5
        for weight in self.prefix_gru.parameters():
            nn.init.uniform_(weight, -bound, bound, generator=generator)
        first = self.embed_proj[0]
        last = self.embed_proj[2]
        assert isinstance(first, nn.Linear) and isinstance(last, nn.Linear)
        nn.init.normal_(first.weight, mean=0.0, std=INIT_STD, generator=generator)
        nn.init.zeros_(last.weight)

    def prefix_states(self, prev_embeds: Tensor) -> Tensor:
        """``[N, B, H]`` -> ``[N, B, g]``: index k is the GRU state after ``prev[first .. k]``
        (``first = 1 - shift``; with shift 0, index 0 is a zero state)."""
        first = 1 - self.shift
        states: Tensor = self.prefix_gru(prev_embeds[:, first:])[0]
        if first == 0:
            return states
        start = states.new_zeros(prev_embeds.shape[0], first, self.gru_hidden_dim)
        return torch.cat([start, states], dim=1)

    def forward(self, hidden: Tensor, prev_embeds: Tensor, base_logits: Tensor) -> Tensor:
        """Logits ``[N, B, V]``: the backbone's at positions ``< pure_draft_prefix_len``,
        corrected by the GRU from there on."""
        check_blocks("prev_embeds", prev_embeds, hidden)
        check_blocks("base_logits", base_logits, hidden)
        prefix = self.pure_draft_prefix_len
        states = self.prefix_states(prev_embeds.to(hidden.dtype))
        features = torch.cat([hidden[:, prefix:], states[:, prefix:].to(hidden.dtype)], dim=-1)
        correction: Tensor = self.embed_proj(features)
        corrected = base_logits[:, prefix:] + correction.to(base_logits.dtype)
        if prefix == 0:
            return corrected
        return torch.cat([base_logits[:, :prefix], corrected], dim=1)


def domino_head(head: nn.Module | None) -> DominoHead:
    """`head` as a :class:`DominoHead` (a Domino drafter's ``.head``); TypeError otherwise."""
    return expect_head(head, DominoHead, "a Domino head")


def domino_backbone_weight(step: int, total_steps: int, initial: float) -> float:
    """Backbone CE weight of Domino at `step`: `initial` at step 0, linearly to 0 at the end."""
    if total_steps < 1:
        msg = f"total_steps must be >= 1, got {total_steps}"
        raise ValueError(msg)
    if step < 0:
        msg = f"step must be >= 0, got {step}"
        raise ValueError(msg)
    return initial * max(0.0, 1.0 - step / total_steps)


def domino_loss(
    corrected_logits: Tensor,
    backbone_logits: Tensor,
    labels: Tensor,
    label_mask: Tensor,
    *,
    weights: Tensor,
    backbone_weight: float,
    teacher_logits: Tensor | None = None,
    shift: int = 0,
) -> LossOutput:
    """Domino: ``CE(corrected) + backbone_weight * CE(backbone)`` [+ softCE(corrected)].

    Both CEs use the same position `weights` (broadcastable to `labels`, e.g. from
    ``objective_weights``). Accuracy counts are of the corrected logits, the ones served.
    With `teacher_logits` the self-distillation term (``parts["distill"]``) is added on the
    corrected logits; ``parts["backbone_ce"]`` is the backbone's CE before its weight.
    """
    check_shapes(corrected_logits, labels, label_mask)
    check_shapes(backbone_logits, labels, label_mask)
    label_mask = without_anchor(label_mask, shift)
    ce = weighted_mean(token_ce(corrected_logits, labels, label_mask), weights, label_mask)
    backbone_ce = weighted_mean(token_ce(backbone_logits, labels, label_mask), weights, label_mask)
    loss = ce + backbone_weight * backbone_ce
    distill: Tensor | None = None
    if teacher_logits is not None:
        distill = weighted_mean(soft_ce(corrected_logits, teacher_logits), weights, label_mask)
        loss = loss + distill
    return loss_output(
        loss,
        ce,
        corrected_logits,
        labels,
        label_mask,
        weights,
        parts={"distill": distill, "backbone_ce": backbone_ce},
    )


class DominoModules:
    """Domino (module doc)."""

    name = "domino"

    def build_head(self, spec: ResolvedDraft) -> KindHead | None:
        """A :class:`DominoHead` of the plan's sizes and alignment."""
        if spec.emb_dim is None or spec.gru_hidden_dim is None:
            msg = "a domino drafter needs emb_dim and gru_hidden_dim in the plan's architecture"
            raise ValueError(msg)
        return DominoHead(
            spec.hidden_size,
            spec.gru_hidden_dim,
            spec.emb_dim,
            spec.vocab_size,
            shift=spec.label_shift,
            pure_draft_prefix_len=spec.pure_draft_prefix_len,
        )

    def build_layer(self, spec: ResolvedDraft) -> DraftDecoderLayer:
        """The DFlash decoder layer."""
        return plain_layer(spec)

    def head_inputs(
        self, spec: ResolvedDraft, ids: Tensor, anchors: Tensor, embeddings: nn.Module
    ) -> tuple[Tensor, ...]:
        """The target embeddings of ``prev`` (the tokens before each position's target),
        ``[B, N, K, H]`` float32."""
        tokens = previous_tokens(ids, anchors, spec.block_size, shift=spec.label_shift)
        embeds: Tensor = embeddings(tokens.flatten(1)).float()
        return (embeds.view(*tokens.shape, -1),)

    def objective(
        self,
        head: nn.Module | None,
        hidden: Tensor,
        logits: Tensor,
        head_inputs: Sequence[Tensor],
        targets: ObjectiveInputs,
        objective: ObjectivePlan,
    ) -> LossOutput:
        """:func:`domino_loss` of the corrected and the backbone logits."""
        batch, n, block, width = hidden.shape
        (prev_embeds,) = head_inputs
        labels, label_mask, shift = targets.labels, targets.label_mask, targets.shift
        corrected = domino_head(head)(
            hidden.reshape(batch * n, block, width),
            prev_embeds.reshape(batch * n, block, -1),
            logits.reshape(batch * n, block, -1),
        ).view_as(logits)
        return domino_loss(
            corrected,
            logits,
            labels,
            label_mask,
            weights=objective_weights(
                corrected.detach(), labels, label_mask, objective=objective, shift=shift
            ),
            backbone_weight=domino_backbone_weight(
                targets.step, targets.total_steps, objective.domino_backbone_loss_weight
            ),
            teacher_logits=targets.teacher if objective.self_logit_distillation else None,
            shift=shift,
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
        """Position by position: the first ``pure_draft_prefix_len`` proposals are the
        backbone's (uncorrected, as served), the head corrects the rest."""
        domino = domino_head(head)

        def next_token(k: int, prev: Tensor) -> Tensor:
            if k < domino.pure_draft_prefix_len:
                return choose(base_logits[:, k])
            prev_embeds = embeddings(prev).to(hidden.dtype)
            logits: Tensor = domino(hidden[:, : k + 1], prev_embeds, base_logits[:, : k + 1])
            return choose(logits[:, k])

        return propose_by_position(hidden, anchor_tokens, spec, next_token)


MODULES = DominoModules()

__all__ = [
    "MODULES",
    "DominoHead",
    "DominoModules",
    "domino_backbone_weight",
    "domino_head",
    "domino_loss",
]
