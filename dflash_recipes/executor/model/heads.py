"""Domino and DSpark heads: corrections on top of the backbone logits.

The objective they train with: docs/dflash.md, "The training objective".

Alignment convention, shared with the plain backbone so that a backbone warm-started from a
plain DFlash checkpoint stays aligned: block position ``k >= 1`` predicts the token at
``anchor + k``; position 0 (the anchor itself) is never scored. A head additionally conditions
on the known prefix of that prediction, the tokens ``anchor .. anchor + k - 1``, i.e. it
predicts the *next* token after that prefix.

Inputs are per block, ``[N, B, ...]`` with ``N`` blocks and ``B`` the block size. In
``prefix_embeds`` / ``prefix_tokens``, index ``k`` holds the token at ``anchor + k - 1`` (so
index 1 is the anchor token); index 0 is unused (any value; its output is meaningless).

- :class:`DominoHead`: a bias-free GRU runs over the target embeddings of the prefix tokens;
  position ``k`` adds ``embed_proj([h_k ; s_{k-1}])`` to the backbone logits, where
  ``s_{k-1}`` is the GRU state after ``anchor .. anchor + k - 1`` (``embed_proj``: Linear
  ``H+g -> emb_dim``, SiLU, Linear ``emb_dim -> vocab``, no biases).
- :class:`DSparkHead`: adds the low-rank Markov bias ``markov_w2(markov_w1(t_{anchor+k-1}))``
  and optionally returns a confidence logit ``confidence_proj([h_k ; markov_w1(t)])``.

The output layers (``embed_proj.2``, ``markov_w2``) start at zero, so a fresh head leaves the
backbone logits unchanged at the first step of a warm start.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
from torch import Tensor, nn

from dflash_recipes.plan.draft_spec import ResolvedDraft

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
        self, hidden_size: int, gru_hidden_dim: int, emb_dim: int, vocab_size: int
    ) -> None:
        super().__init__()
        self.gru_hidden_dim = gru_hidden_dim
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

    def prefix_states(self, prefix_embeds: Tensor) -> Tensor:
        """``[N, B, H]`` -> ``[N, B, g]``: index k is the GRU state after anchor..anchor+k-1."""
        n_blocks = prefix_embeds.shape[0]
        states, _ = self.prefix_gru(prefix_embeds[:, 1:])
        start = states.new_zeros(n_blocks, 1, self.gru_hidden_dim)
        return torch.cat([start, states], dim=1)

    def forward(self, hidden: Tensor, prefix_embeds: Tensor, base_logits: Tensor) -> Tensor:
        """Corrected logits ``[N, B, V]`` from draft states, prefix embeddings, backbone logits."""
        _check_blocks("prefix_embeds", prefix_embeds, hidden)
        _check_blocks("base_logits", base_logits, hidden)
        states = self.prefix_states(prefix_embeds.to(hidden.dtype))
        correction: Tensor = self.embed_proj(torch.cat([hidden, states.to(hidden.dtype)], dim=-1))
        return base_logits + correction.to(base_logits.dtype)


class DSparkHead(nn.Module):
    """Low-rank Markov bias head. Tensors: ``markov_w1.weight``, ``markov_w2.weight``, and
    ``confidence_proj.{weight,bias}`` when the confidence head is on."""

    def __init__(
        self, hidden_size: int, markov_rank: int, vocab_size: int, *, use_confidence_head: bool
    ) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, vocab_size, bias=False)
        self.confidence_proj: nn.Linear | None = (
            nn.Linear(hidden_size + markov_rank, 1) if use_confidence_head else None
        )

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """markov_w1 and confidence_proj normal (bias 0); markov_w2 zero."""
        nn.init.normal_(self.markov_w1.weight, mean=0.0, std=_INIT_STD, generator=generator)
        nn.init.zeros_(self.markov_w2.weight)
        if self.confidence_proj is not None:
            nn.init.normal_(self.confidence_proj.weight, std=_INIT_STD, generator=generator)
            nn.init.zeros_(self.confidence_proj.bias)

    def forward(
        self, hidden: Tensor, prefix_tokens: Tensor, base_logits: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """(logits ``[N, B, V]``, confidence logit ``[N, B]`` or None)."""
        _check_blocks("prefix_tokens", prefix_tokens, hidden)
        _check_blocks("base_logits", base_logits, hidden)
        # Index 0 is unused and may hold anything (a pad or ignore id): read a valid row instead.
        tokens = prefix_tokens.clone()
        tokens[:, 0] = 0
        state: Tensor = self.markov_w1(tokens)
        bias: Tensor = self.markov_w2(state)
        logits = base_logits + bias.to(base_logits.dtype)
        if self.confidence_proj is None:
            return logits, None
        features = torch.cat([hidden, state.to(hidden.dtype)], dim=-1)
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
        return DominoHead(spec.hidden_size, spec.gru_hidden_dim, spec.emb_dim, spec.vocab_size)
    if spec.markov_rank is None:
        msg = "a dspark drafter needs markov_rank in the plan's architecture"
        raise ValueError(msg)
    return DSparkHead(
        spec.hidden_size,
        spec.markov_rank,
        spec.vocab_size,
        use_confidence_head=spec.use_confidence_head,
    )


__all__ = ["DSparkHead", "DominoHead", "DraftHead", "build_head"]
