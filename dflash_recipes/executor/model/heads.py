"""Domino and DSpark heads: corrections on top of the backbone logits, as ModelOpt computes them.

The objective they train with: docs/dflash.md, "The training objective"; the label alignment
of every head, with a worked example: docs/dflash.md, "Label alignment".

**Alignment** (``shift``, the plan's ``shift_label``): with ``shift = 1`` (ModelOpt, SGLang,
the released checkpoints) block position ``k`` predicts the token at ``anchor + k + 1``,
position 0 included; with ``shift = 0`` (earlier dflash-recipes exports) position ``k``
predicts ``anchor + k`` and position 0 (the anchor) is never scored. A head conditions on the
known tokens before the one it predicts. Its ``prev`` input is per block position: index ``k``
holds the token at ``anchor + k + shift - 1``, the token just before position k's target (with
``shift = 1`` index 0 is the anchor; with ``shift = 0`` index 1 is, and index 0 is unused).

Inputs are per block, ``[N, B, ...]`` with ``N`` blocks and ``B`` the block size.

- :class:`DominoHead`: a bias-free GRU runs over the target embeddings of ``prev``; position
  ``k >= prefix`` adds ``embed_proj([h_k ; s_k])`` to the backbone logits, ``s_k`` the GRU
  state after ``prev[first .. k]`` (``first = 1 - shift``; ``embed_proj``: Linear
  ``H+g -> emb_dim``, SiLU, Linear ``emb_dim -> vocab``, no biases). Positions ``< prefix``
  (``pure_draft_prefix_len``) keep the backbone logits: they are proposed uncorrected.
- :class:`DSparkHead`: adds ``markov_w2(z_k)`` with, by ``markov_head_type``, ``z_k = e_k =
  markov_w1(prev_k)`` (vanilla), ``sigmoid(gate_proj([h_k ; e_k])) * e_k`` (gated), or the
  output of a GRU-like recurrence over the block (rnn): ``[g ; c ; o] = joint_proj([s_{k-1} ;
  e_k ; h_k])``, ``s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c)``, ``z_k = tanh(o)``,
  ``s`` starting at zero. With the confidence head it also returns
  ``confidence_proj([h_k ; e_k])``.

The output layers (``embed_proj.2``, ``markov_w2``) start at zero, so a fresh head leaves the
backbone logits unchanged at the first step of a warm start.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
from torch import Tensor, nn

from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.recipe.choices import MARKOV_HEAD_TYPES

#: Standard deviation of the normal initialisation (HF default), as in the backbone.
_INIT_STD = 0.02


def _check_blocks(name: str, tensor: Tensor, hidden: Tensor) -> None:
    if tensor.shape[:2] != hidden.shape[:2]:
        msg = (
            f"{name} must be [N, B, ...] like hidden {tuple(hidden.shape[:2])}, "
            f"got {tuple(tensor.shape)}"
        )
        raise ValueError(msg)


class DominoHead(nn.Module):
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
        nn.init.normal_(first.weight, mean=0.0, std=_INIT_STD, generator=generator)
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
        _check_blocks("prev_embeds", prev_embeds, hidden)
        _check_blocks("base_logits", base_logits, hidden)
        prefix = self.pure_draft_prefix_len
        states = self.prefix_states(prev_embeds.to(hidden.dtype))
        features = torch.cat([hidden[:, prefix:], states[:, prefix:].to(hidden.dtype)], dim=-1)
        correction: Tensor = self.embed_proj(features)
        corrected = base_logits[:, prefix:] + correction.to(base_logits.dtype)
        if prefix == 0:
            return corrected
        return torch.cat([base_logits[:, :prefix], corrected], dim=1)


class DSparkHead(nn.Module):
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
        nn.init.normal_(self.markov_w1.weight, mean=0.0, std=_INIT_STD, generator=generator)
        nn.init.zeros_(self.markov_w2.weight)
        for proj in (self.gate_proj, self.joint_proj, self.confidence_proj):
            if proj is not None:
                nn.init.normal_(proj.weight, std=_INIT_STD, generator=generator)
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
        _check_blocks("prev_tokens", prev_tokens, hidden)
        _check_blocks("base_logits", base_logits, hidden)
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


DraftHead: TypeAlias = DominoHead | DSparkHead


def build_head(spec: ResolvedDraft) -> DraftHead | None:
    """The head of ``spec.projector_type`` (None for plain DFlash); ValueError if unsized."""
    if spec.projector_type == "dflash":
        return None
    if spec.projector_type == "domino":
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


__all__ = ["DSparkHead", "DominoHead", "DraftHead", "build_head"]
