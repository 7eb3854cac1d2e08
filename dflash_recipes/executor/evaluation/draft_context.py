"""The drafter's context during KV-cached verification, grown position by position.

Each verification step commits a few tokens; their tapped target states come out of the same
target pass that verified them, and only those new positions join the drafter's context. For a
:class:`DFlashBlockDrafter`, :class:`FusedContext` fuses the new positions (``fc`` then
``hidden_norm``, per position) and projects them to every draft layer's keys and values once,
so no step recomputes anything over the whole context. Any other :class:`BlockDrafter` gets
:class:`TapsContext`: the raw tapped states and a :class:`DraftContext` per row, as before.

Rows are the prompts of one batch; a finished row is dropped with :meth:`DraftContextStore.keep`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from dflash_recipes.executor.evaluation.speculative import (
    BlockDrafter,
    DFlashBlockDrafter,
    DraftContext,
)
from dflash_recipes.executor.kinds.protocol import Chooser, greedy_choice
from dflash_recipes.executor.model.layers import DraftDecoderLayer
from dflash_recipes.executor.model.masks import build_dense_block_mask

#: Positions a row's buffer starts with beyond its first fill (it doubles when full).
_SPARE = 256


class GrowingRows:
    """A buffer of R rows that grow at their own pace along one axis (amortised doubling).

    A row's values have the shape of ``extend``'s argument, growing along ``axis`` (0 for
    ``[n, D]`` tapped states; 1 for ``[kv_heads, n, head_dim]`` keys, which stay in the
    layout attention reads, so a step's view is not copied).
    """

    def __init__(self, rows: int, axis: int = 0) -> None:
        self.lengths = [0] * rows
        self.axis = axis
        self._buffer: Tensor | None = None

    def _room(self, values: Tensor, needed: int) -> Tensor:
        """The buffer, allocated or grown so that every row holds ``needed`` entries."""
        grow = self.axis + 1
        if self._buffer is None:
            shape = [len(self.lengths), *values.shape]
            shape[grow] = needed + _SPARE
            self._buffer = values.new_zeros(shape)
        elif needed > self._buffer.shape[grow]:
            shape = list(self._buffer.shape)
            old = shape[grow]
            shape[grow] = max(needed, 2 * old)
            grown = self._buffer.new_zeros(shape)
            grown.narrow(grow, 0, old).copy_(self._buffer)
            self._buffer = grown
        return self._buffer

    def extend(self, row: int, values: Tensor) -> None:
        """Append ``values`` (growing along ``axis``) to row ``row``."""
        n = values.shape[self.axis]
        start = self.lengths[row]
        buffer = self._room(values, start + n)
        buffer[row].narrow(self.axis, start, n).copy_(values)
        self.lengths[row] = start + n

    def view(self, length: int | None = None, tail: Tensor | None = None) -> Tensor:
        """Every row's first ``length`` entries (default: the longest row's length); entries
        past a row's own length are zeros or stale. ``tail`` (every row's values, as
        ``extend`` takes them, batched) is written right after, without changing any length,
        and the view includes it: the context followed by a block, with no copy."""
        if self._buffer is None:
            msg = "the context is empty: extend every row before drafting"
            raise RuntimeError(msg)
        end = max(self.lengths) if length is None else length
        if tail is None:
            return self._buffer.narrow(self.axis + 1, 0, end)
        n = tail.shape[self.axis + 1]
        buffer = self._room(tail[0], end + n)
        buffer.narrow(self.axis + 1, end, n).copy_(tail)
        return buffer.narrow(self.axis + 1, 0, end + n)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order)."""
        self.lengths = [self.lengths[r] for r in rows]
        if self._buffer is not None:
            index = torch.tensor(list(rows), dtype=torch.long, device=self._buffer.device)
            self._buffer = self._buffer.index_select(0, index)


class DraftContextStore(Protocol):
    """What the verification loop needs from a drafter: grow contexts, draft every row."""

    def extend(self, row: int, taps: Tensor) -> None:
        """Append the tapped states ``[n, n_taps * H]`` of row ``row``'s next ``n`` positions."""
        ...

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order); the others finished."""
        ...

    def propose(
        self, committed: Sequence[Sequence[int]], choose: Chooser | None = None
    ) -> list[list[int]]:
        """``spec.drafted_tokens`` proposals per row; ``committed[r]`` is row r's prompt + tokens,
        and its context covers every position before its last token. `choose` picks each
        token (None: the drafter's greedy proposals)."""
        ...


class FusedContext:
    """A :class:`DFlashBlockDrafter`'s contexts, kept as every draft layer's keys and values.

    In a DFlash drafter every layer reads the same fused context, and its keys and values are
    per position (``k_norm(k_proj(.))`` rotated at the position, ``v_proj(.)``): new positions
    are fused and projected once, when they are committed, and each step computes the block's
    queries, keys and values only. One drafter pass drafts every row.
    """

    def __init__(self, drafter: DFlashBlockDrafter, rows: int) -> None:
        self.drafter = drafter
        self.model = drafter.model
        # [R, kv_heads, positions, head_dim] per layer: the layout attention reads.
        self.keys = [GrowingRows(rows, axis=1) for _ in self.model.layers]
        self.values = [GrowingRows(rows, axis=1) for _ in self.model.layers]

    def extend(self, row: int, taps: Tensor) -> None:
        fused = self.drafter.fuse(taps.unsqueeze(0))
        start = self.keys[0].lengths[row]
        positions = torch.arange(start, start + fused.shape[1], device=fused.device).unsqueeze(0)
        cos, sin = self.model.rotary_emb(fused, positions)
        for layer, keys, values in zip(self.model.layers, self.keys, self.values, strict=True):
            assert isinstance(layer, DraftDecoderLayer)
            k, v = layer.self_attn.context_kv(fused, cos, sin)
            keys.extend(row, k[0])
            values.extend(row, v[0])

    def keep(self, rows: Sequence[int]) -> None:
        for buffer in (*self.keys, *self.values):
            buffer.keep(rows)

    def hidden(self, anchors: Sequence[int], anchor_tokens: Sequence[int]) -> Tensor:
        """``[R, B, H]`` final-normed draft states, as :meth:`DFlashBlockDrafter.draft_hidden`
        gives them, from the kept keys and values."""
        model, spec = self.model, self.drafter.spec
        size = spec.block_size
        rows = len(anchors)
        device = model.fc.weight.device
        ids = torch.full((rows, size), spec.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = torch.tensor(list(anchor_tokens), dtype=torch.long, device=device)
        x = model.block_states(self.drafter.embed_tokens(ids))
        anchor_t = torch.tensor(list(anchors), dtype=torch.long, device=device).unsqueeze(1)
        q_positions = anchor_t + torch.arange(size, device=device).unsqueeze(0)
        ctx_len = max(anchors)
        ctx_positions = torch.arange(ctx_len, device=device).unsqueeze(0).expand(rows, -1)
        cos, sin = model.rotary_emb(x, q_positions)
        valid = torch.ones(rows, 1, dtype=torch.bool, device=device)
        full = build_dense_block_mask(anchor_t, size, ctx_len, valid)
        layer_masks = model.layer_masks(full, q_positions, ctx_positions)
        for index, layer in enumerate(model.layers):
            layer_mask = layer_masks[index]
            assert isinstance(layer, DraftDecoderLayer) and isinstance(layer_mask, Tensor)
            keys, values = self.keys[index], self.values[index]

            def join(
                block_k: Tensor,
                block_v: Tensor,
                keys: GrowingRows = keys,
                values: GrowingRows = values,
            ) -> tuple[Tensor, Tensor]:
                return keys.view(ctx_len, block_k), values.view(ctx_len, block_v)

            x = layer.forward_cached(x, join, cos, sin, layer_mask)
        hidden: Tensor = model.norm(x)
        return hidden

    def propose(
        self, committed: Sequence[Sequence[int]], choose: Chooser | None = None
    ) -> list[list[int]]:
        anchors = [len(c) - 1 for c in committed]
        tokens = [c[-1] for c in committed]
        hidden = self.hidden(anchors, tokens)
        return self.drafter.propose_from_hidden(hidden, tokens, choose or greedy_choice)


class TapsContext:
    """Any other :class:`BlockDrafter`: raw tapped states, one :class:`DraftContext` per row."""

    def __init__(self, drafter: BlockDrafter, rows: int, block_size: int) -> None:
        self.drafter = drafter
        self.block_size = block_size
        self.rows = GrowingRows(rows)

    def extend(self, row: int, taps: Tensor) -> None:
        self.rows.extend(row, taps)

    def keep(self, rows: Sequence[int]) -> None:
        self.rows.keep(rows)

    def propose(
        self, committed: Sequence[Sequence[int]], choose: Chooser | None = None
    ) -> list[list[int]]:
        if choose is not None:
            msg = (
                f"{type(self.drafter).__name__} proposes tokens only; sampled verification "
                "needs the draft distributions: pass the drafter module"
            )
            raise ValueError(msg)
        taps = self.rows.view()
        proposals: list[list[int]] = []
        for row, tokens in enumerate(committed):
            anchor = len(tokens) - 1
            context = DraftContext(
                committed=tuple(tokens),
                taps=taps[row : row + 1, :anchor],
                block_size=self.block_size,
            )
            proposals.append(list(self.drafter.propose(context)))
        return proposals


def context_store(drafter: BlockDrafter, rows: int, block_size: int) -> DraftContextStore:
    """The store that suits ``drafter``: fused for a DFlash drafter, raw taps otherwise."""
    if isinstance(drafter, DFlashBlockDrafter):
        return FusedContext(drafter, rows)
    return TapsContext(drafter, rows, block_size)


__all__ = [
    "DraftContextStore",
    "FusedContext",
    "GrowingRows",
    "TapsContext",
    "context_store",
]
