"""Sampled verification (temperature > 0): draft distributions and the rejection rule.

Speculative sampling keeps the target's own sampling distribution whatever the drafter
proposes (Leviathan et al. 2023; Chen et al. 2023). At temperature ``T`` the target's
distribution at a position is ``p = softmax(logits / T)`` (cut to its top-k and top-p when
those are set). A proposal ``x`` drawn from a draft
distribution ``q`` is accepted with probability ``min(1, p(x) / q(x))``; at the first rejection
the committed token is drawn from ``max(0, p - q)`` (renormalised), and after a fully accepted
block the bonus token is drawn from ``p`` at the position after the block. Every committed
token then has exactly the target's distribution given the tokens before it, so the measured
tau is the one an engine sampling at ``T`` with this drafter sees. A DFlash block's proposals
come from one drafter pass, position ``k``'s distribution conditioned on the context and (for a
head or the DFlash 2 selector) the proposals before it, which is all the rule needs: a
proposal's ``q`` is known before the target judges it.

Two ways to draft at ``T > 0`` (:attr:`Sampling.drafts`):

- ``sampled``: each proposal is drawn from ``softmax(scores / T)`` of what the kind chooses by
  (the backbone's logits, a head's, or DFlash 2's edge scores over its top-K candidates, ``q``
  zero outside them, as vLLM and SGLang sample the selector);
- ``greedy``: each proposal is the argmax, ``q`` the point mass on it (accepted with
  probability ``p(x)``; at a rejection the token is drawn from ``p`` without ``x``), as engines
  do that pass no draft probabilities to their rejection sampler.

The temperature, then top-k, then top-p (:meth:`Sampling.probabilities`) shape ``p`` and ``q``
alike; no penalties: a tau measured here matches an engine run with the same settings and no
penalties. Draws come from one seeded
``torch.Generator`` on the target's device, so a measurement repeats on the same device.
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import Tensor

from dflash_recipes.executor.kinds.protocol import greedy_choice
from dflash_recipes.records import Record

#: How proposals are drawn at T > 0 (see the module doc).
DRAFT_MODES = ("sampled", "greedy")


@attrs.frozen(repr=False, eq=False, slots=False)
class Sampling(Record):
    """Sampled verification: the temperature, the truncation (top-k, top-p), the seed of
    every draw, how drafts are made."""

    temperature: float
    seed: int = 0
    drafts: str = "sampled"
    #: Keep the k most likely tokens of every distribution (0: all).
    top_k: int = 0
    #: Keep the most likely tokens whose probabilities reach this total (1.0: all).
    top_p: float = 1.0

    def __attrs_post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            msg = f"temperature must be a finite number > 0 for sampling, got {self.temperature}"
            raise ValueError(msg)
        if self.drafts not in DRAFT_MODES:
            msg = f"drafts must be one of {', '.join(DRAFT_MODES)}, got {self.drafts!r}"
            raise ValueError(msg)
        if self.top_k < 0:
            msg = f"top_k must be 0 (off) or a number of tokens, got {self.top_k}"
            raise ValueError(msg)
        if not 0 < self.top_p <= 1:
            msg = f"top_p must be in (0, 1] (1: off), got {self.top_p}"
            raise ValueError(msg)

    def generator(self, device: torch.device) -> torch.Generator:
        """A generator on `device` seeded with :attr:`seed` (one per generation)."""
        return torch.Generator(device=device).manual_seed(self.seed)

    def probabilities(self, scores: Tensor) -> Tensor:
        """The sampling distribution (float32, over the last dimension) of `scores`: divided
        by the temperature, then cut to the top-k, then to the top-p, as vLLM and Hugging Face
        apply them; a cut token has probability 0, the most likely is always kept."""
        logits = scores.float() / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if self.top_p < 1:
            ascending, order = logits.sort(dim=-1)
            below = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - self.top_p
            below[..., -1] = False  # the most likely token stays
            logits = logits.masked_fill(below.scatter(-1, order, below), -math.inf)
        return torch.softmax(logits, dim=-1)

    def sample(self, logits: Tensor, generator: torch.Generator) -> Tensor:
        """``[R]`` tokens drawn from :meth:`probabilities` of ``logits [R, V]``."""
        return draw(self.probabilities(logits), generator)


def draw(weights: Tensor, generator: torch.Generator) -> Tensor:
    """``[R]`` column indices drawn in proportion to ``weights [R, N]`` (non-negative, not
    necessarily normalised; every row with some mass), by the inverse of the cumulative sum.

    One uniform draw per row (``torch.multinomial`` draws an exponential per column: over a
    150k vocabulary that is most of a sampled step's time on the CPU). A column of zero weight
    is never drawn: the uniform point stays strictly below the row's total.
    """
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    point = torch.rand(total.shape, dtype=torch.float64, device=cdf.device, generator=generator)
    point = torch.minimum(point * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(-1)


class DraftRecorder:
    """A :class:`~dflash_recipes.executor.kinds.protocol.Chooser` that draws each proposal as
    :attr:`Sampling.drafts` says and records the distribution it was drawn from, position by
    position; one per generation, every draw from its `generator` (:meth:`new_block` forgets
    the last block's record)."""

    def __init__(self, sampling: Sampling, generator: torch.Generator) -> None:
        self.sampling = sampling
        self.generator = generator
        self._rows: list[tuple[Tensor, Tensor | None]] = []

    def new_block(self) -> DraftRecorder:
        """This recorder with no proposal recorded (before drafting a block)."""
        self._rows = []
        return self

    def sample(self, logits: Tensor) -> Tensor:
        """``[R]`` tokens drawn from the target's ``softmax(logits / T)`` (``logits [R, V]``)."""
        return self.sampling.sample(logits, self.generator)

    def __call__(self, scores: Tensor, ids: Tensor | None = None) -> Tensor:
        if self.sampling.drafts == "greedy":  # the point mass on the argmax
            token = greedy_choice(scores, ids)
            column = token.unsqueeze(-1)
            self._rows.append((torch.ones(column.shape, device=token.device), column))
            return token
        probs = self.sampling.probabilities(scores)
        pick = draw(probs, self.generator)
        self._rows.append((probs, ids))
        return pick if ids is None else ids.gather(-1, pick.unsqueeze(-1)).squeeze(-1)

    def distributions(self, vocab_size: int) -> Tensor:
        """``[R, D, V]`` float32: the distribution of every proposal drawn so far, in order."""
        rows: list[Tensor] = []
        for probs, ids in self._rows:
            if ids is None:  # scores over the whole vocabulary
                if probs.shape[-1] != vocab_size:
                    msg = f"draft scores over {probs.shape[-1]} tokens, the target's {vocab_size}"
                    raise ValueError(msg)
                rows.append(probs)
            else:  # scores over candidates: zero elsewhere
                rows.append(probs.new_zeros(probs.shape[0], vocab_size).scatter_(-1, ids, probs))
        return torch.stack(rows, dim=1)

    def verify(self, proposals: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`verify_sampled` of the proposals drawn by this recorder, with its generator."""
        distributions = self.distributions(target_logits.shape[-1])
        return verify_sampled(
            proposals, distributions, target_logits, self.sampling, self.generator
        )


def verify_sampled(
    proposals: Tensor,
    draft_probs: Tensor,
    target_logits: Tensor,
    sampling: Sampling,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """The rejection rule over R blocks at once: ``(accepted [R], next_token [R])``.

    ``proposals [R, D]`` the drafted tokens, ``draft_probs [R, D, V]`` their distributions,
    ``target_logits [R, D + 1, V]`` the target's logits at the block's positions (index ``j``
    the distribution of proposal ``j``; index ``D`` the one after the block). ``accepted[r]``
    is how many proposals row ``r`` keeps (a prefix); ``next_token[r]`` is the token committed
    after them: drawn from the residual ``max(0, p - q)`` at the first rejection, or from ``p``
    after a fully accepted block.
    """
    rows, drafted = proposals.shape
    p = sampling.probabilities(target_logits)
    index = proposals.unsqueeze(-1)
    p_x = p[:, :drafted].gather(-1, index).squeeze(-1)
    q_x = draft_probs.gather(-1, index).squeeze(-1)
    draws = torch.rand(rows, drafted, device=p.device, generator=generator)
    keep = draws * q_x < p_x  # u < p(x) / q(x), without dividing by a zero q(x)
    accepted = keep.long().cumprod(dim=1).sum(dim=1)
    at = accepted.view(rows, 1, 1).expand(rows, 1, p.shape[-1])
    p_at = p.gather(1, at).squeeze(1)
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(rows, 1, p.shape[-1])], dim=1)
    residual = (p_at - q_padded.gather(1, at).squeeze(1)).clamp(min=0)
    # A residual with no mass left (p == q up to rounding) cannot follow a rejection; keep p.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_at, residual)
    next_token = draw(residual, generator)
    return accepted, next_token


__all__ = ["DRAFT_MODES", "DraftRecorder", "Sampling", "draw", "verify_sampled"]
