"""The drafter side of speculative decoding, and the greedy references it is checked against.

A drafter proposes the tokens after ``a`` for a block ``[token at a, mask, ..., mask]`` anchored
at ``a`` (the last committed token), from the target's tapped states at positions ``< a``,
exactly what a block anchored at ``a`` sees in training: block positions ``1 .. B-1`` propose
``a + 1 .. a + B - 1`` (plain DFlash), or, for a Domino or DSpark head with shift_label,
positions ``0 .. B-1`` propose ``a + 1 .. a + B`` (``spec.drafted_tokens``, docs/dflash.md
"Label alignment").
:class:`BlockDrafter` is the protocol (one block from a :class:`DraftContext`);
:class:`DFlashBlockDrafter` wraps a :class:`DFlashDraftModel` with the target's embeddings and
lm_head and also drafts a batch of rows from fused contexts (:meth:`DFlashBlockDrafter.
propose_fused`), which the KV-cached loop grows position by position.

The verification loop itself is :func:`~dflash_recipes.executor.evaluation.cached_decoding.
speculative_generate`. :func:`greedy_generate` (full recompute per token) and
:func:`is_greedy_decoding` (one teacher-forced pass) are the lossless references.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from dflash_recipes.executor.kinds.protocol import (
    Chooser,
    greedy_choice,
    propose_each_position,
)
from dflash_recipes.executor.kinds.registry import kind_modules
from dflash_recipes.executor.model.convert import dflash_module, embed_tokens, lm_head
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.masks import build_dense_block_mask
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.records import Record


@attrs.frozen(repr=False, eq=False, slots=False)
class SpecResult(Record):
    """The output of one speculative generation and its acceptance per verification step."""

    #: Generated tokens (prompt excluded); the eos token is included when generation hit it.
    tokens: list[int]
    #: tau of every verification step: accepted draft tokens + 1 (the bonus), in
    #: ``1 .. drafted_tokens + 1`` (B, or B + 1 for a head with shift_label).
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
    #: anchor (the output of decoder layer ``k`` for each tap ``k``, before any final norm,
    #: concatenated).
    taps: Tensor
    block_size: int

    @property
    def anchor(self) -> int:
        """Position of the anchor token (the last committed token)."""
        return len(self.committed) - 1


@runtime_checkable
class BlockDrafter(Protocol):
    """Anything that proposes the tokens after the anchor for one block."""

    def propose(self, context: DraftContext) -> list[int]:
        """The proposed token ids, ``spec.drafted_tokens`` of them (``block_size - 1``, or
        ``block_size`` for a head with shift_label); index ``i`` is the token at anchor + i + 1."""
        ...


class DFlashBlockDrafter:
    """A :class:`DFlashDraftModel` with the target's embeddings and lm_head: one pass per block.

    The drafter's kind turns the draft states into proposals (``KindModules.propose``): a head
    (domino, dspark) is applied position by position, position ``k`` seeing the greedy tokens
    proposed for positions ``< k`` as its prefix, exactly as in training, where the prefix
    holds the real tokens. The drafter must be on the target's device; dtypes may differ (a
    float32 drafter next to a bfloat16 target).

    ``use_head=False`` switches the head off: the proposals are the backbone logits' argmax at
    the drafting positions, as plain DFlash drafts (DFlash 2: the unary argmax path instead of
    the selector's), so evaluation can show what the head buys (``KindFacts.eval_without_head``).
    """

    def __init__(
        self,
        model: DFlashDraftModel,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        spec: ResolvedDraft,
        *,
        use_head: bool = True,
    ) -> None:
        self.model = model
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.spec = spec
        self.use_head = use_head

    def _dtype(self) -> torch.dtype:
        return self.model.fc.weight.dtype

    def fuse(self, taps: Tensor) -> Tensor:
        """``[R, T, n_taps * H]`` tapped target states -> the fused context ``[R, T, H]``.

        Per position (``fc`` then ``hidden_norm``), so a context grows by fusing only its new
        positions (:mod:`~dflash_recipes.executor.evaluation.draft_context`).
        """
        return self.model.fuse_context(taps.to(self._dtype()))

    def draft_hidden_fused(
        self, fused: Tensor, anchors: Sequence[int], anchor_tokens: Sequence[int]
    ) -> Tensor:
        """[R, B, H] final-normed draft states of R blocks, one per row, in one drafter pass.

        ``fused [R, T, H]``: row ``r`` holds its fused context at positions ``0 ..
        anchors[r] - 1`` (later entries are padding, never seen); ``anchor_tokens[r]`` is the
        token at ``anchors[r]``. Positions and mask are the training ones for a block anchored
        at ``anchors[r]``.
        """
        size = self.spec.block_size
        device = fused.device
        rows = len(anchors)
        ids = torch.full((rows, size), self.spec.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = torch.tensor(list(anchor_tokens), dtype=torch.long, device=device)
        block_embeds = self.embed_tokens(ids).to(self._dtype())
        anchor_t = torch.tensor(list(anchors), dtype=torch.long, device=device).unsqueeze(1)
        ctx_len = fused.shape[1]
        q_positions = anchor_t + torch.arange(size, device=device).unsqueeze(0)
        ctx_positions = torch.arange(ctx_len, device=device).unsqueeze(0).expand(rows, -1)
        mask = build_dense_block_mask(
            anchor_t, size, ctx_len, torch.ones(rows, 1, dtype=torch.bool, device=device)
        )
        hidden: Tensor = self.model(block_embeds, fused, q_positions, ctx_positions, mask)
        return hidden

    def draft_hidden(self, context: DraftContext) -> Tensor:
        """[1, B, H] final-normed draft states of the block anchored at ``context.anchor``."""
        return self.draft_hidden_fused(
            self.fuse(context.taps), [context.anchor], [context.committed[-1]]
        )

    def _logits(self, hidden: Tensor) -> Tensor:
        weight = getattr(self.lm_head, "weight", None)
        if isinstance(weight, Tensor):
            hidden = hidden.to(weight.dtype)
        logits: Tensor = self.lm_head(hidden)
        return logits

    def propose_fused(
        self, fused: Tensor, anchors: Sequence[int], anchor_tokens: Sequence[int]
    ) -> list[list[int]]:
        """Greedy proposals of every row (see :meth:`draft_hidden_fused` for the arguments)."""
        hidden = self.draft_hidden_fused(fused, anchors, anchor_tokens)
        return self.propose_from_hidden(hidden, anchor_tokens)

    def propose_from_hidden(
        self, hidden: Tensor, anchor_tokens: Sequence[int], choose: Chooser = greedy_choice
    ) -> list[list[int]]:
        """Proposals of every row from its draft states ``[R, B, H]`` (lm_head, then the head
        variant position by position, as the serving engine applies it).

        ``spec.drafted_tokens`` per row: positions ``1 .. B-1`` (plain DFlash, or a head without
        shift_label), positions ``0 .. B-1`` with it. Domino's first ``pure_draft_prefix_len``
        proposals are the backbone's; the head corrects the rest. With the head off
        (``use_head=False``) every proposal is the backbone's own. `choose` picks each token
        (greedy: the argmax; a sampled draft records what it drew from).
        """
        base_logits = self._logits(hidden)
        if self.use_head:
            proposals = kind_modules(self.spec.projector_type).propose(
                self.model.head,
                hidden,
                base_logits,
                anchor_tokens,
                self.spec,
                self.embed_tokens,
                choose,
            )
        else:
            first = self.spec.first_drafting_position
            proposals = propose_each_position(base_logits, first, choose)
        return [[int(t) for t in row] for row in proposals.tolist()]

    def propose(self, context: DraftContext) -> list[int]:
        """Greedy proposals (``spec.drafted_tokens`` of them)."""
        fused = self.fuse(context.taps)
        return self.propose_fused(fused, [context.anchor], [context.committed[-1]])[0]


def as_block_drafter(
    drafter: nn.Module | BlockDrafter,
    target: PreTrainedModel,
    spec: ResolvedDraft,
    *,
    use_head: bool | None = None,
) -> BlockDrafter:
    """A :class:`BlockDrafter` as is; a drafter module (or a converted model holding one)
    wrapped with the target's embeddings and lm_head, its head on.

    `use_head` True or False switches a module's head on or off (a
    :class:`DFlashBlockDrafter` is rewrapped, not changed); None leaves a BlockDrafter as it
    drafts. ValueError for ``use_head=False`` with a BlockDrafter that is not a module's: only a
    drafter module's head can be switched off.
    """
    if isinstance(drafter, DFlashBlockDrafter):
        if use_head is None or drafter.use_head == use_head:
            return drafter
        return DFlashBlockDrafter(
            drafter.model, drafter.embed_tokens, drafter.lm_head, drafter.spec, use_head=use_head
        )
    if isinstance(drafter, BlockDrafter):
        if use_head is False:
            msg = (
                f"use_head=False needs a drafter module; {type(drafter).__name__} drafts as it "
                "does, with no head to switch off"
            )
            raise ValueError(msg)
        return drafter
    return DFlashBlockDrafter(
        dflash_module(drafter),
        embed_tokens(target),
        lm_head(target),
        spec,
        use_head=use_head is not False,
    )


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def check_prompt(prompt_ids: Sequence[int]) -> None:
    """ValueError for an empty prompt (a prompt needs at least one token)."""
    if not prompt_ids:
        msg = "prompt_ids is empty; a prompt needs at least one token"
        raise ValueError(msg)


@torch.no_grad()
def greedy_generate(
    target: PreTrainedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | None,
) -> list[int]:
    """Plain greedy decoding of the target (full recompute per token): the lossless reference."""
    check_prompt(prompt_ids)
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
    check_prompt(prompt_ids)
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
    "check_prompt",
    "greedy_generate",
    "is_greedy_decoding",
]
