"""DSpark, its torch half: the low-rank Markov bias head, its objective and proposals.

The head (as ModelOpt computes it; alignment: :mod:`~dflash_recipes.executor.kinds.protocol`)
adds ``markov_w2(z_k)`` to the backbone logits with, by ``markov_head_type``, ``z_k = e_k =
markov_w1(prev_k)`` (vanilla), ``sigmoid(gate_proj([h_k ; e_k])) * e_k`` (gated), or the output
of a GRU-like recurrence over the block (rnn): ``[g ; c ; o] = joint_proj([s_{k-1} ; e_k ;
h_k])``, ``s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c)``, ``z_k = tanh(o)``, ``s``
starting at zero. With the confidence head it also returns ``confidence_proj([h_k ; e_k])``.
``markov_w2`` starts at zero, so a fresh head leaves the backbone logits unchanged.

The objective: ``CE + tv_weight * TV(p, q) + confidence_weight * BCE`` (:func:`dspark_loss`).
The torch-free half (tensors, export fields, checks): :mod:`dflash_recipes.checkpoint.kinds.
dspark`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
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
    token_ce,
    weighted_mean,
    without_anchor,
)
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import ObjectivePlan
from dflash_recipes.recipe.choices import MARKOV_HEAD_TYPES


class DSparkHead(KindHead):
    """Low-rank Markov bias head. Tensors: ``markov_w1.weight``, ``markov_w2.weight``;
    ``gate_proj.{weight,bias}`` (gated) or ``joint_proj.{weight,bias}`` (rnn); and
    ``confidence_proj.{weight,bias}`` when the confidence head is on."""

    def __init__(
        self,
        hidden_size: int,
        markov_rank: int,
        vocab_size: int,
        *,
        use_confidence_head: bool,
        markov_head_type: str = "vanilla",
        shift: int = 1,
    ) -> None:
        super().__init__()
        if markov_head_type not in MARKOV_HEAD_TYPES:
            msg = (
                f"markov_head_type must be one of {', '.join(MARKOV_HEAD_TYPES)}, "
                f"got {markov_head_type!r}"
            )
            raise ValueError(msg)
        self.markov_rank = markov_rank
        self.markov_head_type = markov_head_type
        self.shift = shift
        self.markov_w1 = nn.Embedding(vocab_size, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, vocab_size, bias=False)
        self.gate_proj: nn.Linear | None = (
            nn.Linear(hidden_size + markov_rank, markov_rank)
            if markov_head_type == "gated"
            else None
        )
        self.joint_proj: nn.Linear | None = (
            nn.Linear(2 * markov_rank + hidden_size, 3 * markov_rank)
            if markov_head_type == "rnn"
            else None
        )
        self.confidence_proj: nn.Linear | None = (
            nn.Linear(hidden_size + markov_rank, 1) if use_confidence_head else None
        )

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """markov_w1, gate/joint/confidence projections normal (biases 0); markov_w2 zero."""
        nn.init.normal_(self.markov_w1.weight, mean=0.0, std=INIT_STD, generator=generator)
        nn.init.zeros_(self.markov_w2.weight)
        for proj in (self.gate_proj, self.joint_proj, self.confidence_proj):
            if proj is not None:
                nn.init.normal_(proj.weight, std=INIT_STD, generator=generator)
                nn.init.zeros_(proj.bias)

    def latent(self, hidden: Tensor, prev_emb: Tensor) -> Tensor:
        """``[N, B, r]``: the rank-r state ``markov_w2`` turns into the bias (module doc)."""
        if self.gate_proj is not None:
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1)))
            return gate.to(prev_emb.dtype) * prev_emb
        if self.joint_proj is None:
            return prev_emb
        first = 1 - self.shift  # with shift 0, position 0 (the anchor) has no previous token
        state = hidden.new_zeros(hidden.shape[0], self.markov_rank)
        latents = [hidden.new_zeros(hidden.shape[0], self.markov_rank)] * first
        for k in range(first, hidden.shape[1]):
            joint = self.joint_proj(torch.cat([state, prev_emb[:, k], hidden[:, k]], dim=-1))
            gate_raw, candidate_raw, output_raw = joint.chunk(3, dim=-1)
            gate = torch.sigmoid(gate_raw)
            state = gate * state + (1.0 - gate) * torch.tanh(candidate_raw)
            latents.append(torch.tanh(output_raw))
        return torch.stack(latents, dim=1)

    def forward(
        self, hidden: Tensor, prev_tokens: Tensor, base_logits: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """(logits ``[N, B, V]``, confidence logit ``[N, B]`` or None)."""
        check_blocks("prev_tokens", prev_tokens, hidden)
        check_blocks("base_logits", base_logits, hidden)
        tokens = prev_tokens
        if self.shift == 0:
            # Index 0 is unused and may hold anything (a pad or ignore id): read a valid row.
            tokens = prev_tokens.clone()
            tokens[:, 0] = 0
        prev_emb: Tensor = self.markov_w1(tokens)
        if self.gate_proj is not None or self.joint_proj is not None:
            prev_emb = prev_emb.to(hidden.dtype)
        bias: Tensor = self.markov_w2(self.latent(hidden, prev_emb))
        logits = base_logits + bias.to(base_logits.dtype)
        if self.confidence_proj is None:
            return logits, None
        features = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)
        confidence: Tensor = self.confidence_proj(features).squeeze(-1)
        return logits, confidence


def dspark_head(head: nn.Module | None) -> DSparkHead:
    """`head` as a :class:`DSparkHead` (a DSpark drafter's ``.head``); TypeError otherwise."""
    return expect_head(head, DSparkHead, "a DSpark head")


def dspark_loss(
    logits: Tensor,
    labels: Tensor,
    label_mask: Tensor,
    *,
    weights: Tensor,
    teacher_logits: Tensor | None,
    confidence_logit: Tensor | None,
    tv_weight: float,
    confidence_weight: float,
    shift: int = 0,
) -> LossOutput:
    """DSpark: ``CE + tv_weight * TV(p, q) + confidence_weight * BCE(confidence, correct)``.

    - CE and TV (``0.5 * sum_v |p_v - q_v|``, p the draft's softmax, q the target's) are
      weighted means with the position `weights`; TV (``parts["tv"]``) is present only with
      `teacher_logits`.
    - The confidence head learns whether the draft's top-1 token equals the label; its BCE
      (``counted_parts["confidence_bce"]``) is a plain mean over supervised positions (a
      confidence must be calibrated at every position, also those the decay weights play
      down). `confidence_logit` is ``[..., K]`` or ``[..., K, 1]``; present only when the head
      has one.
    """
    check_shapes(logits, labels, label_mask)
    label_mask = without_anchor(label_mask, shift)
    ce = weighted_mean(token_ce(logits, labels, label_mask), weights, label_mask)
    loss = ce
    tv: Tensor | None = None
    if teacher_logits is not None:
        if teacher_logits.shape != logits.shape:
            msg = (
                f"teacher_logits {tuple(teacher_logits.shape)} must have the shape of the "
                f"logits {tuple(logits.shape)}"
            )
            raise ValueError(msg)
        p = torch.softmax(logits.float(), dim=-1)
        q = torch.softmax(teacher_logits.detach().float(), dim=-1)
        per_token_tv = 0.5 * (p - q).abs().sum(dim=-1)
        tv = weighted_mean(per_token_tv, weights, label_mask)
        loss = loss + tv_weight * tv
    confidence_bce: Tensor | None = None
    if confidence_logit is not None:
        conf = confidence_logit
        if conf.shape == (*labels.shape, 1):
            conf = conf.squeeze(-1)
        if conf.shape != labels.shape:
            msg = (
                f"confidence_logit {tuple(confidence_logit.shape)} must have the shape of the "
                f"labels {tuple(labels.shape)} (optionally with a trailing 1)"
            )
            raise ValueError(msg)
        with torch.no_grad():
            is_correct = (logits.argmax(dim=-1) == labels).float()
        per_token_bce = F.binary_cross_entropy_with_logits(
            conf.float(), is_correct, reduction="none"
        )
        confidence_bce = weighted_mean(per_token_bce, torch.ones_like(per_token_bce), label_mask)
        loss = loss + confidence_weight * confidence_bce
    return loss_output(
        loss,
        ce,
        logits,
        labels,
        label_mask,
        weights,
        parts={"tv": tv},
        counted_parts={"confidence_bce": confidence_bce},
        count_normalized=(None if confidence_bce is None else confidence_weight * confidence_bce),
    )


class DSparkModules:
    """DSpark (module doc)."""

    name = "dspark"

    def build_head(self, spec: ResolvedDraft) -> KindHead | None:
        """A :class:`DSparkHead` of the plan's rank, head kind and alignment."""
        if spec.markov_rank is None:
            msg = "a dspark drafter needs markov_rank in the plan's architecture"
            raise ValueError(msg)
        return DSparkHead(
            spec.hidden_size,
            spec.markov_rank,
            spec.vocab_size,
            use_confidence_head=spec.use_confidence_head,
            markov_head_type=spec.markov_head_type,
            shift=spec.label_shift,
        )

    def build_layer(self, spec: ResolvedDraft) -> DraftDecoderLayer:
        """The DFlash decoder layer."""
        return plain_layer(spec)

    def head_inputs(
        self, spec: ResolvedDraft, ids: Tensor, anchors: Tensor, embeddings: nn.Module
    ) -> tuple[Tensor, ...]:
        """``prev`` (the token before each position's target), ``[B, N, K]``."""
        return (previous_tokens(ids, anchors, spec.block_size, shift=spec.label_shift),)

    def objective(
        self,
        head: nn.Module | None,
        hidden: Tensor,
        logits: Tensor,
        head_inputs: Sequence[Tensor],
        targets: ObjectiveInputs,
        objective: ObjectivePlan,
    ) -> LossOutput:
        """:func:`dspark_loss` of the biased logits (TV whenever the teacher is there)."""
        batch, n, block, width = hidden.shape
        (prev_tokens,) = head_inputs
        labels, label_mask, shift = targets.labels, targets.label_mask, targets.shift
        out, confidence = dspark_head(head)(
            hidden.reshape(batch * n, block, width),
            prev_tokens.reshape(batch * n, block),
            logits.reshape(batch * n, block, -1),
        )
        out = out.view_as(logits)
        return dspark_loss(
            out,
            labels,
            label_mask,
            weights=objective_weights(
                out.detach(), labels, label_mask, objective=objective, shift=shift
            ),
            teacher_logits=targets.teacher,
            confidence_logit=None if confidence is None else confidence.view(batch, n, block),
            tv_weight=objective.dspark_tv_weight,
            confidence_weight=objective.dspark_confidence_weight,
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
        """Position by position: each proposal biased by the one before it."""
        dspark = dspark_head(head)

        def next_token(k: int, prev: Tensor) -> Tensor:
            logits: Tensor = dspark(hidden[:, : k + 1], prev, base_logits[:, : k + 1])[0]
            return choose(logits[:, k])

        return propose_by_position(hidden, anchor_tokens, spec, next_token)


MODULES = DSparkModules()

__all__ = ["MODULES", "DSparkHead", "DSparkModules", "dspark_head", "dspark_loss"]
