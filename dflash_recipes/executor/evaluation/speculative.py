"""Block speculative decoding with a DFlash drafter and greedy verification by the target.

This is an *evaluation harness* that measures real acceptance, not a serving engine: there is
no KV cache, and the target runs over the whole sequence at every verification step. That costs
quadratic time, which tiny and held-out evaluation sets can afford, and it keeps the loop
obviously lossless: every committed token is the target's own greedy token given everything
before it, so the output equals :func:`greedy_generate` whatever the drafter proposes.

One step, with ``B`` the block size and ``a`` the position of the last committed token:

1. the drafter gets the block ``[token at a, mask, ..., mask]`` (positions ``a .. a+B-1``) and
   the target's tapped states at positions ``< a`` (exactly what a block anchored at ``a`` sees
   in training) and proposes tokens for block positions ``1 .. B-1`` in one pass;
2. the target runs once over committed + proposed tokens; proposals are accepted while they
   equal the target's greedy token, then the target's token at the first mismatch (or after a
   fully accepted block) is committed as a bonus. The step's acceptance length tau is
   accepted proposals + 1, so ``1 <= tau <= B``.

The verification pass also yields the tapped states of every newly committed position except
the bonus token, which is the next block's anchor and is not part of its context: each step
costs one drafter pass and one target pass (plus one prefill pass per prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from dflash_recipes.executor.model.convert import dflash_module, embed_tokens, lm_head
from dflash_recipes.executor.model.draft import DFlashDraftModel, taps_from_hidden_states
from dflash_recipes.executor.model.heads import DominoHead
from dflash_recipes.executor.model.masks import build_dense_block_mask
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.records import Record


@attrs.frozen(repr=False, eq=False, slots=False)
class SpecResult(Record):
    """The output of one speculative generation and its acceptance per verification step."""

    #: Generated tokens (prompt excluded); the eos token is included when generation hit it.
    tokens: list[int]
    #: tau of every verification step: accepted draft tokens + 1 (the bonus), in ``1..B``.
    #: Counted as the verification decided it: on the last step, max_new_tokens or eos may
    #: commit fewer tokens than its tau.
    accepted_per_step: list[int]
    block_size: int

    @property
    def steps(self) -> int:
        """Number of verification steps (target passes after the prefill)."""
        return len(self.accepted_per_step)


@attrs.frozen(eq=False)
class DraftContext:
    """What a drafter may look at to propose one block."""

    #: Prompt + generated tokens so far; the last one is the block's anchor token.
    committed: tuple[int, ...]
    #: [1, len(committed) - 1, n_taps * H]: the target's tapped states at positions before the
    #: anchor (``output_hidden_states[k + 1]`` for each tap ``k``, concatenated).
    taps: Tensor
    block_size: int

    @property
    def anchor(self) -> int:
        """Position of the anchor token (the last committed token)."""
        return len(self.committed) - 1


@runtime_checkable
class BlockDrafter(Protocol):
    """Anything that proposes the tokens of block positions ``1 .. B-1`` for one block."""

    def propose(self, context: DraftContext) -> list[int]:
        """``block_size - 1`` proposed token ids; index ``k - 1`` is block position ``k``."""
        ...


class DFlashBlockDrafter:
    """A :class:`DFlashDraftModel` with the target's embeddings and lm_head: one pass per block.

    Head variants (domino, dspark) are applied position by position: position ``k`` sees the
    greedy tokens proposed for positions ``< k`` as its prefix, exactly as in training, where
    the prefix holds the real tokens. The drafter must be on the target's device; dtypes may
    differ (a float32 drafter next to a bfloat16 target).
    """

    def __init__(
        self,
        model: DFlashDraftModel,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        spec: ResolvedDraft,
    ) -> None:
        self.model = model
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.spec = spec

    def _dtype(self) -> torch.dtype:
        return self.model.fc.weight.dtype

    def draft_hidden(self, context: DraftContext) -> Tensor:
        """[1, B, H] final-normed draft states of the block anchored at ``context.anchor``."""
        anchor = context.anchor
        size = context.block_size
        device = context.taps.device
        ids = [context.committed[-1]] + [self.spec.mask_token_id] * (size - 1)
        block_ids = torch.tensor([ids], dtype=torch.long, device=device)
        block_embeds = self.embed_tokens(block_ids).to(self._dtype())
        fused = self.model.fuse_context(context.taps.to(self._dtype()))
        q_positions = torch.arange(anchor, anchor + size, device=device).unsqueeze(0)
        ctx_positions = torch.arange(anchor, device=device).unsqueeze(0)
        mask = build_dense_block_mask(
            torch.tensor([[anchor]], dtype=torch.long, device=device),
            size,
            anchor,
            torch.ones(1, 1, dtype=torch.bool, device=device),
        )
        hidden: Tensor = self.model(block_embeds, fused, q_positions, ctx_positions, mask)
        return hidden

    def _logits(self, hidden: Tensor) -> Tensor:
        weight = getattr(self.lm_head, "weight", None)
        if isinstance(weight, Tensor):
            hidden = hidden.to(weight.dtype)
        logits: Tensor = self.lm_head(hidden)
        return logits

    def propose(self, context: DraftContext) -> list[int]:
        """Greedy proposals for block positions ``1 .. B-1``."""
        hidden = self.draft_hidden(context)
        base_logits = self._logits(hidden)
        head = self.model.head
        if head is None:
            return [int(t) for t in base_logits[0, 1:].argmax(dim=-1).tolist()]
        # Prefix index k holds the token at anchor + k - 1: index 1 the anchor, index k >= 2 the
        # proposal for position k - 1 (index 0 is unused). Entries not known yet hold the mask
        # id; position k of either head reads prefix entries <= k only.
        size = context.block_size
        prefix = [context.committed[-1]] * 2 + [self.spec.mask_token_id] * (size - 2)
        proposals: list[int] = []
        for k in range(1, size):
            prefix_tokens = torch.tensor([prefix], dtype=torch.long, device=hidden.device)
            if isinstance(head, DominoHead):
                prefix_embeds = self.embed_tokens(prefix_tokens).to(hidden.dtype)
                logits = head(hidden, prefix_embeds, base_logits)
            else:
                logits, _confidence = head(hidden, prefix_tokens, base_logits)
            token = int(logits[0, k].argmax().item())
            proposals.append(token)
            if k + 1 < size:
                prefix[k + 1] = token
        return proposals


def as_block_drafter(
    drafter: nn.Module | BlockDrafter, target: PreTrainedModel, spec: ResolvedDraft
) -> BlockDrafter:
    """A :class:`BlockDrafter` as is; a drafter module (or a converted model holding one)
    wrapped with the target's embeddings and lm_head."""
    if isinstance(drafter, BlockDrafter):
        return drafter
    return DFlashBlockDrafter(dflash_module(drafter), embed_tokens(target), lm_head(target), spec)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _target_pass(
    target: PreTrainedModel, ids: Sequence[int], spec: ResolvedDraft
) -> tuple[Tensor, Tensor]:
    """Greedy tokens [T] after every position and tapped states [1, T, n_taps * H]."""
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=_device_of(target))
    out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    greedy: Tensor = out.logits[0].argmax(dim=-1)
    taps = taps_from_hidden_states(out.hidden_states, spec.target_layer_ids)
    return greedy, taps


def _check_prompt(prompt_ids: Sequence[int]) -> None:
    if not prompt_ids:
        msg = "prompt_ids is empty; a prompt needs at least one token"
        raise ValueError(msg)


@torch.no_grad()
def speculative_generate(
    target: PreTrainedModel,
    drafter: nn.Module | BlockDrafter,
    spec: ResolvedDraft,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
) -> SpecResult:
    """Generate up to ``max_new_tokens`` tokens (stopping after eos) by block drafting.

    ``target`` is a Hugging Face causal LM (called with ``output_hidden_states=True``);
    ``drafter`` a :class:`DFlashDraftModel` (wrapped with the target's embeddings and lm_head)
    or any :class:`BlockDrafter`. The tokens equal :func:`greedy_generate`'s.
    """
    _check_prompt(prompt_ids)
    size = spec.block_size
    block_drafter = as_block_drafter(drafter, target, spec)
    committed = list(prompt_ids)
    generated: list[int] = []
    taus: list[int] = []

    def commit(tokens: Sequence[int]) -> bool:
        """Append tokens until a stop; True when generation is finished."""
        for token in tokens:
            committed.append(token)
            generated.append(token)
            if len(generated) >= max_new_tokens or token == eos_token_id:
                return True
        return False

    if max_new_tokens <= 0:
        return SpecResult(tokens=[], accepted_per_step=[], block_size=size)
    greedy, taps = _target_pass(target, committed, spec)
    done = commit([int(greedy[-1].item())])
    while not done:
        anchor = len(committed) - 1
        context = DraftContext(committed=tuple(committed), taps=taps[:, :anchor], block_size=size)
        proposals = block_drafter.propose(context)
        if len(proposals) != size - 1:
            msg = f"the drafter proposed {len(proposals)} tokens, not block_size - 1 = {size - 1}"
            raise ValueError(msg)
        greedy, taps = _target_pass(target, committed + proposals, spec)
        # greedy[anchor + j] is the target's token for position anchor + j + 1 (proposal j).
        verified = [int(t) for t in greedy[anchor : anchor + size].tolist()]
        accepted = 0
        while accepted < size - 1 and proposals[accepted] == verified[accepted]:
            accepted += 1
        taus.append(accepted + 1)
        done = commit(verified[: accepted + 1])
    return SpecResult(tokens=generated, accepted_per_step=taus, block_size=size)


@torch.no_grad()
def greedy_generate(
    target: PreTrainedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | None,
) -> list[int]:
    """Plain greedy decoding of the target (full recompute per token): the lossless reference."""
    _check_prompt(prompt_ids)
    device = _device_of(target)
    sequence = list(prompt_ids)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        input_ids = torch.tensor([sequence], dtype=torch.long, device=device)
        logits = target(input_ids=input_ids, use_cache=False).logits
        token = int(logits[0, -1].argmax().item())
        sequence.append(token)
        generated.append(token)
        if token == eos_token_id:
            break
    return generated


@torch.no_grad()
def is_greedy_decoding(
    target: PreTrainedModel,
    prompt_ids: Sequence[int],
    generated: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | None,
) -> bool:
    """Whether `generated` is what :func:`greedy_generate` returns, checked in ONE target pass.

    The target is causal, so its logits at position ``i`` of ``prompt + generated`` depend only
    on the tokens before ``i``: one forward pass gives the greedy token after every prefix, and
    `generated` is the greedy decoding exactly when each of its tokens is the argmax after its
    prefix and it stops where greedy decoding stops (at `eos_token_id`, or after
    `max_new_tokens`). Costs one pass instead of one per token.
    """
    _check_prompt(prompt_ids)
    tokens = list(generated)
    if len(tokens) > max_new_tokens:
        return False
    if eos_token_id is not None and eos_token_id in tokens[:-1]:
        return False  # greedy decoding stops at the first eos
    ended = bool(tokens) and tokens[-1] == eos_token_id
    if len(tokens) < max_new_tokens and not ended:
        return False  # stopped early without an eos
    if not tokens:
        return True
    ids = [*prompt_ids, *tokens[:-1]]
    input_ids = torch.tensor([ids], dtype=torch.long, device=_device_of(target))
    logits = target(input_ids=input_ids, use_cache=False).logits
    predicted = logits[0, len(prompt_ids) - 1 :].argmax(dim=-1)
    return bool(predicted.tolist() == tokens)


__all__ = [
    "BlockDrafter",
    "DFlashBlockDrafter",
    "DraftContext",
    "SpecResult",
    "as_block_drafter",
    "greedy_generate",
    "is_greedy_decoding",
    "speculative_generate",
]
