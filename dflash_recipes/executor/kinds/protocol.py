"""What a drafter kind's torch half provides: :class:`KindModules`, and what heads share.

A drafter kind (``projector_type``) has two halves, each a module named after the kind: its
torch-free facts in ``dflash_recipes/checkpoint/kinds/<kind>.py`` (tensor layout, recipe and
export fields, checks; :class:`~dflash_recipes.checkpoint.kinds.protocol.KindFacts`) and its
torch parts in ``dflash_recipes/executor/kinds/<kind>.py`` (a :class:`KindModules`):

- its modules (:meth:`KindModules.build_head`): a :class:`KindHead` whose submodules the
  drafter registers at its top level, so their keys are the export's (``markov_w1.weight``);
- its decoder layer (:meth:`KindModules.build_layer`): plain DFlash's
  :class:`~dflash_recipes.executor.model.layers.DraftDecoderLayer`, or a subclass with what the
  kind adds inside every layer (DFlash 2's convolutions, ``layers.{i}.attention_conv.*``);
- what the head reads per block beyond the draft states (:meth:`KindModules.head_inputs`);
- its objective over one chunk of blocks (:meth:`KindModules.objective`);
- its proposals in evaluation (:meth:`KindModules.propose`): at every drafting position a
  :class:`Chooser` picks the token from the kind's scores, the argmax (:func:`greedy_choice`)
  or, for sampled verification, a draw that records the draft distribution.

The training step, the drafter and the evaluation call these by the plan's projector type
(:mod:`~dflash_recipes.executor.kinds.registry`) and never name a kind.

**Alignment** (``shift``, the plan's ``shift_label``; docs/dflash.md, "Label alignment"): with
``shift = 1`` (ModelOpt, SGLang, the released Domino and DSpark checkpoints) block position
``k`` predicts the token at ``anchor + k + 1``, position 0 included; with ``shift = 0`` (plain
DFlash, and earlier dflash-recipes head exports) position ``k`` predicts ``anchor + k`` and
position 0 (the anchor) is never scored. A head conditions on the known tokens before the one it
predicts. Its ``prev`` input is per block position: index ``k`` holds the token at ``anchor + k
+ shift - 1``, the token just before position k's target (with ``shift = 1`` index 0 is the
anchor; with ``shift = 0`` index 1 is, and index 0 is unused). Head inputs are per block,
``[N, B, ...]`` with ``N`` blocks and ``B`` the block size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch
from torch import Tensor, nn

from dflash_recipes.executor.model.layers import DraftDecoderLayer
from dflash_recipes.executor.training.loss import LossOutput, ObjectiveInputs
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import ObjectivePlan

#: Standard deviation of the normal initialisation (HF default), as in the backbone.
INIT_STD = 0.02


class KindHead(nn.Module):
    """A kind's head: modules on top of the backbone's draft states and logits.

    The drafter registers the head's children at its own top level (their keys carry no
    prefix, as the kind's exports do) and calls :meth:`reset_parameters` after its own
    initialisation.
    """

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """The head's initialisation (output layers at zero: a fresh head changes nothing)."""
        raise NotImplementedError


class Chooser(Protocol):
    """Picks each row's token at one drafting position from its scores."""

    def __call__(self, scores: Tensor, ids: Tensor | None = None) -> Tensor:
        """``[R]`` tokens from ``scores [R, N]``; ``ids [R, N]`` is the token of each column
        (None: column ``n`` is token ``n``, scores over the whole vocabulary)."""
        ...


def greedy_choice(scores: Tensor, ids: Tensor | None = None) -> Tensor:
    """The :class:`Chooser` of greedy drafting: each row's highest-scoring token."""
    best = scores.argmax(dim=-1)
    return best if ids is None else ids.gather(-1, best.unsqueeze(-1)).squeeze(-1)


def propose_each_position(base_logits: Tensor, first: int, choose: Chooser) -> Tensor:
    """``[R, B - first]`` proposals of the backbone alone: `choose` over its logits
    ``[R, B, V]`` at every drafting position ``first .. B-1`` (no head, nothing between them)."""
    size = base_logits.shape[1]
    return torch.stack([choose(base_logits[:, k]) for k in range(first, size)], dim=1)


class KindModules(Protocol):
    """The torch half of a drafter kind (module doc); one instance per kind module."""

    #: The ``projector_type`` value.
    name: str

    def build_head(self, spec: ResolvedDraft) -> KindHead | None:
        """The kind's head for `spec` (None: the backbone alone); ValueError if unsized."""
        ...

    def build_layer(self, spec: ResolvedDraft) -> DraftDecoderLayer:
        """One decoder layer of the kind's drafter (:func:`plain_layer` for a kind that adds
        nothing inside the layers)."""
        ...

    def head_inputs(
        self, spec: ResolvedDraft, ids: Tensor, anchors: Tensor, embeddings: nn.Module
    ) -> tuple[Tensor, ...]:
        """What the head reads per block beyond the draft states, each ``[B, N, K, ...]``
        (sliced per chunk of blocks on dim 1), from the batch's ``ids [B, S]`` and ``anchors
        [B, N]``; the target's `embeddings` are shared. Built under ``no_grad``."""
        ...

    def objective(
        self,
        head: nn.Module | None,
        hidden: Tensor,
        logits: Tensor,
        head_inputs: Sequence[Tensor],
        targets: ObjectiveInputs,
        objective: ObjectivePlan,
    ) -> LossOutput:
        """The loss of one chunk of blocks: draft states ``hidden [B, n, K, H]``, the
        backbone's float32 ``logits [B, n, K, V]`` (the target's lm_head), the chunk's
        `head_inputs`. Returns a :class:`LossOutput` whose weighted means use the position
        weights of `objective`, so chunks combine exactly (``combine_losses``)."""
        ...

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
        """Proposals ``[R, spec.drafted_tokens]`` of R blocks from their final-normed draft
        states ``hidden [R, B, H]`` and backbone logits ``base_logits [R, B, V]``, as the
        serving engine drafts them; ``anchor_tokens[r]`` is row r's anchor token. `choose` picks
        the token at every drafting position, in position order (the argmax by default)."""
        ...


HeadT = TypeVar("HeadT", bound=KindHead)


def expect_head(head: nn.Module | None, kind: type[HeadT], name: str) -> HeadT:
    """`head` as the kind's head class `kind` (a drafter's ``.head``); TypeError naming `name`
    (``a Domino head``) for anything else: a drafter built for another kind."""
    if not isinstance(head, kind):
        msg = f"expected {name}, got {type(head).__name__}"
        raise TypeError(msg)
    return head


def plain_layer(spec: ResolvedDraft) -> DraftDecoderLayer:
    """A DFlash decoder layer (attention with KV injection, then the MLP): the layer of every
    kind that adds nothing inside the layers."""
    return DraftDecoderLayer(spec)


def check_blocks(name: str, tensor: Tensor, hidden: Tensor) -> None:
    """ValueError unless `tensor` is ``[N, B, ...]`` like `hidden`."""
    if tensor.shape[:2] != hidden.shape[:2]:
        msg = (
            f"{name} must be [N, B, ...] like hidden {tuple(hidden.shape[:2])}, "
            f"got {tuple(tensor.shape)}"
        )
        raise ValueError(msg)


def propose_by_position(
    hidden: Tensor,
    anchor_tokens: Sequence[int],
    spec: ResolvedDraft,
    next_token: Callable[[int, Tensor], Tensor],
) -> Tensor:
    """``[R, drafted]`` proposals of a head, one block position at a time.

    Position ``k`` sees the tokens proposed for the positions before it as its prefix, as in
    training, where the prefix holds the real tokens: ``next_token(k, prev)`` gets ``prev [R,
    k + 1]`` (index ``j`` the token before position j's target: the anchor at index
    ``first``, then the proposals; entries not known yet hold the mask id) and returns the
    ``[R]`` tokens position k proposes. Position k of a head reads entries ``<= k`` only.
    """
    first = spec.first_drafting_position
    size = spec.block_size
    rows = len(anchor_tokens)
    prev = torch.full((rows, size), spec.mask_token_id, dtype=torch.long, device=hidden.device)
    anchor = torch.tensor(list(anchor_tokens), dtype=torch.long, device=hidden.device)
    prev[:, : first + 1] = anchor.unsqueeze(1)
    columns: list[Tensor] = []
    for k in range(first, size):
        token = next_token(k, prev[:, : k + 1])
        columns.append(token)
        if k + 1 < size:
            prev = prev.clone()
            prev[:, k + 1] = token
    return torch.stack(columns, dim=1)


__all__ = [
    "INIT_STD",
    "Chooser",
    "KindHead",
    "KindModules",
    "check_blocks",
    "expect_head",
    "greedy_choice",
    "plain_layer",
    "propose_by_position",
    "propose_each_position",
]
