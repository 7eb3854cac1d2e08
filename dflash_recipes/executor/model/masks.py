"""The drafter's attention masks: dense, split into chunks, flex-attention tiles, sliding windows.

A query in block ``b`` with anchor ``a_b`` sees the context positions ``j < a_b`` and every
position of its own block (bidirectional); nothing of other blocks (docs/dflash.md, "The
training objective", step 3). In a packed row (``document_ids``, several conversations per row)
the context of block ``b`` is further cut to its own document: ``[start_b, a_b)`` with
``start_b`` the first position of the anchor's document (:func:`anchor_starts`). The draft
model (:mod:`~dflash_recipes.executor.model.draft`), the training step and speculative decoding
build their masks here.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from dflash_recipes.plan.attention_chunks import split_chunk_count


class SplitBlockMask:
    """The block mask cut into chunks of consecutive blocks, each with its own small dense mask.

    Chunk ``c`` (blocks ``first .. end-1``) attends to the context prefix its furthest anchor
    can see, ``[0, visible)``, plus the chunk's own blocks: its mask is
    ``[B, 1, (end - first) * bs, visible + (end - first) * bs]``. Anchors are sorted, so early
    chunks see short prefixes and attention costs about ``Q x (T / 2 + Q / chunks)`` instead of
    ``Q x (T + Q)``, through the fused SDPA kernel. Same semantics as
    :func:`build_dense_block_mask` (a test checks outputs and gradients agree); the CPU
    training path uses it. A split into one chunk sees the whole context (``visible = T``), so
    its single call takes K and V as they are.
    """

    __slots__ = ("block_size", "chunks", "masks")

    def __init__(
        self, masks: tuple[Tensor, ...], block_size: int, chunks: tuple[tuple[int, int, int], ...]
    ) -> None:
        #: One boolean mask per chunk (True = may attend): ``[visible context ; chunk blocks]``.
        self.masks = masks
        self.block_size = block_size
        #: (first block, end block, visible context length) per chunk of blocks.
        self.chunks = chunks


#: A dense boolean mask ``[B, 1, Q, T + Q]`` (True = may attend), a :class:`SplitBlockMask`
#: or a flex BlockMask.
DraftMask: TypeAlias = Tensor | SplitBlockMask | BlockMask


_FLEX_TILE = 128


def _check_mask_inputs(anchors: Tensor, block_size: int, ctx_len: int, valid: Tensor) -> None:
    if anchors.dim() != 2 or valid.shape != anchors.shape:
        msg = (
            f"anchors and valid must both be [B, N]; got {tuple(anchors.shape)} and "
            f"{tuple(valid.shape)}"
        )
        raise ValueError(msg)
    if valid.dtype != torch.bool:
        msg = f"valid must be a boolean tensor, got {valid.dtype}"
        raise ValueError(msg)
    if block_size < 1 or ctx_len < 0:
        msg = f"block_size must be >= 1 and ctx_len >= 0, got {block_size} and {ctx_len}"
        raise ValueError(msg)


def document_starts(document_ids: Tensor) -> Tensor:
    """``[B, T]``: per token, the index of the first token of its document (a packed row's
    documents are contiguous runs of one number)."""
    if document_ids.dim() != 2:
        msg = f"document_ids must be [batch, seq_len], got {tuple(document_ids.shape)}"
        raise ValueError(msg)
    seq_len = document_ids.shape[1]
    index = torch.arange(seq_len, device=document_ids.device).expand_as(document_ids)
    first = torch.ones_like(document_ids, dtype=torch.bool)
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values


def anchor_starts(anchors: Tensor, document_ids: Tensor | None) -> Tensor:
    """``[B, N]``: the first context position each block may see, the start of its anchor's
    document (0 everywhere without `document_ids`)."""
    if document_ids is None:
        return torch.zeros_like(anchors)
    if document_ids.shape[0] != anchors.shape[0]:
        msg = f"document_ids {tuple(document_ids.shape)} and anchors {tuple(anchors.shape)}"
        raise ValueError(msg + " must have the same batch size")
    return torch.gather(document_starts(document_ids), 1, anchors.clamp(min=0))


def _visible_context(anchors: Tensor, ctx_len: int, valid: Tensor) -> Tensor:
    """Per block, how many leading context positions it sees: ``a_b`` (valid) or 0 (padded)."""
    limit = anchors.clamp(min=0, max=ctx_len)
    return torch.where(valid, limit, torch.zeros_like(limit))


def build_dense_block_mask(
    anchors: Tensor,
    block_size: int,
    ctx_len: int,
    valid: Tensor,
    *,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Dense mask ``[B, 1, N*bs, ctx_len + N*bs]`` (True = may attend) for packed blocks.

    Key index ``j < ctx_len`` is context position ``j``; ``ctx_len + i`` is packed block
    position ``i``. See the module docstring for the semantics (`document_ids`: a packed row's).
    """
    _check_mask_inputs(anchors, block_size, ctx_len, valid)
    device = anchors.device
    n_blocks = anchors.shape[1]
    q_len = n_blocks * block_size
    q_limit = _visible_context(anchors, ctx_len, valid).repeat_interleave(block_size, dim=1)
    q_block = torch.arange(q_len, device=device) // block_size
    kv_idx = torch.arange(ctx_len + q_len, device=device)
    kv_block = torch.cat([torch.full((ctx_len,), -1, device=device, dtype=torch.long), q_block])
    sees_context = kv_idx.view(1, 1, -1) < q_limit.unsqueeze(-1)
    if document_ids is not None:
        q_start = anchor_starts(anchors, document_ids).repeat_interleave(block_size, dim=1)
        sees_context &= kv_idx.view(1, 1, -1) >= q_start.unsqueeze(-1)
    same_block = kv_block.view(1, 1, -1) == q_block.view(1, -1, 1)
    return (sees_context | same_block).unsqueeze(1)


def document_causal_mask(document_ids: Tensor) -> Tensor:
    """The target's mask for packed rows: ``[B, 1, T, T]`` bool, block-diagonal causal.

    Query ``i`` sees key ``j`` when ``j <= i`` and both lie in the same document
    (`document_ids` ``[B, T]``), the boolean ``attn_mask`` form SDPA takes.
    """
    if document_ids.dim() != 2:
        msg = f"document_ids must be [batch, seq_len], got {tuple(document_ids.shape)}"
        raise ValueError(msg)
    seq_len = document_ids.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)
    return (same & causal).unsqueeze(1)


def document_context_mask(dense: Tensor, context_start: Tensor, block_size: int) -> Tensor:
    """Restrict a dense drafter mask so block ``b`` sees only context ``[context_start_b, a_b)``.

    `dense` is :func:`build_dense_block_mask`'s ``[B, 1, N*bs, T + N*bs]``; `context_start`
    ``[B, N]`` is each anchor's document start in its packed row (0 for an unpacked row).
    """
    batch, _, q_len, kv_len = dense.shape
    if context_start.shape != (batch, q_len // block_size):
        want = (batch, q_len // block_size)
        msg = f"context_start {tuple(context_start.shape)} must be [B, N] = {want}"
        raise ValueError(msg)
    ctx_len = kv_len - q_len
    q_start = context_start.repeat_interleave(block_size, dim=1)
    kv_idx = torch.arange(kv_len, device=dense.device).view(1, 1, -1)
    keep = (kv_idx >= ctx_len) | (kv_idx >= q_start.unsqueeze(-1))
    return dense & keep.unsqueeze(1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """Tile booleans ``[B, 1, QT, KT]`` -> (count ``[B, 1, QT]``, indices ``[B, 1, QT, KT]``)."""
    counts = tiles.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts, indices


def build_flex_block_mask(
    anchors: Tensor,
    block_size: int,
    ctx_len: int,
    valid: Tensor,
    *,
    tile_size: tuple[int, int] = (_FLEX_TILE, _FLEX_TILE),
    document_ids: Tensor | None = None,
) -> BlockMask:
    """The flex-attention :class:`BlockMask` of :func:`build_dense_block_mask`, block-sparse.

    The tile structure (which ``tile_size`` tiles are empty, partial or full) is computed from
    per-tile minima and maxima of the anchors (and, for a packed row's `document_ids`, of the
    anchors' document starts), so memory is ``O(B * tiles)``; the exact mask is applied inside
    partial tiles by the mask_mod, which in a packed row also compares the context position's
    document with the anchor's. Built on ``anchors.device``.
    """
    _check_mask_inputs(anchors, block_size, ctx_len, valid)
    device = anchors.device
    batch, n_blocks = anchors.shape
    q_len = n_blocks * block_size
    kv_len = ctx_len + q_len
    q_tile, kv_tile = tile_size
    q_tiles, kv_tiles = _cdiv(q_len, q_tile), _cdiv(kv_len, kv_tile)
    q_pad, kv_pad = q_tiles * q_tile, kv_tiles * kv_tile

    # Lookup tables padded to whole tiles, so the mask_mod may be called on any padded index.
    limit = _visible_context(anchors, ctx_len, valid).to(torch.int32)
    q_limit = torch.zeros(batch, q_pad, device=device, dtype=torch.int32)
    q_limit[:, :q_len] = limit.repeat_interleave(block_size, dim=1)
    q_block = torch.full((q_pad,), -2, device=device, dtype=torch.int32)
    q_block[:q_len] = torch.arange(q_len, device=device, dtype=torch.int32) // block_size
    kv_block = torch.full((kv_pad,), -3, device=device, dtype=torch.int32)
    kv_block[:ctx_len] = -1
    kv_block[ctx_len:kv_len] = q_block[:q_len]
    starts = anchor_starts(anchors, document_ids).to(torch.int32)
    q_first = torch.zeros(batch, q_pad, device=device, dtype=torch.int32)
    q_first[:, :q_len] = starts.repeat_interleave(block_size, dim=1)

    if document_ids is None:

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx < q_limit[b, q_idx]) | (kv_block[kv_idx] == q_block[q_idx])

    else:
        # Document numbers of the context (-4 past it) and of each query's anchor (-5 for the
        # padded query rows): the context seen is the anchor's own document before it.
        docs = document_ids.to(device=device, dtype=torch.int32)
        kv_doc = torch.full((batch, kv_pad), -4, device=device, dtype=torch.int32)
        kv_doc[:, :ctx_len] = docs[:, :ctx_len]
        q_doc = torch.full((batch, q_pad), -5, device=device, dtype=torch.int32)
        q_doc[:, :q_len] = torch.gather(docs, 1, anchors.clamp(min=0)).repeat_interleave(
            block_size, dim=1
        )

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            own = (kv_idx < q_limit[b, q_idx]) & (kv_doc[b, kv_idx] == q_doc[b, q_idx])
            return own | (kv_block[kv_idx] == q_block[q_idx])

    # Per query tile: the range of visible context and of block ids (real rows only).
    rows = q_limit.view(batch, q_tiles, q_tile)
    real_row = (torch.arange(q_pad, device=device) < q_len).view(1, q_tiles, q_tile)
    max_limit = rows.amax(dim=-1)
    min_limit = torch.where(real_row, rows, torch.iinfo(torch.int32).max).amin(dim=-1)
    first_rows = q_first.view(batch, q_tiles, q_tile)
    max_first = torch.where(real_row, first_rows, 0).amax(dim=-1)
    q_start = torch.arange(q_tiles, device=device) * q_tile
    q_end = torch.clamp(q_start + q_tile, max=q_len)
    q_complete = q_start + q_tile <= q_len
    qb_lo = q_start // block_size
    qb_hi = (q_end - 1) // block_size

    # Per key tile: its context part and its block part.
    kv_start = torch.arange(kv_tiles, device=device) * kv_tile
    kv_end = torch.clamp(kv_start + kv_tile, max=kv_len)
    kv_complete = kv_start + kv_tile <= kv_len
    has_ctx = kv_start < ctx_len
    ctx_end = torch.clamp(kv_end, max=ctx_len)
    has_blk = kv_end > ctx_len
    kb_lo = (torch.clamp(kv_start, min=ctx_len) - ctx_len) // block_size
    kb_hi = (kv_end - 1 - ctx_len) // block_size

    if document_ids is None:
        ctx_any = has_ctx.view(1, 1, -1) & (max_limit.unsqueeze(-1) > kv_start.view(1, 1, -1))
    else:  # per query row: its span [first, limit) must meet the tile's context
        lo = torch.maximum(q_first.unsqueeze(-1), kv_start.view(1, 1, -1))
        hi = torch.minimum(q_limit.unsqueeze(-1), ctx_end.view(1, 1, -1))
        hit = (lo < hi) & real_row.view(1, q_pad, 1)
        ctx_any = has_ctx.view(1, 1, -1) & hit.view(batch, q_tiles, q_tile, -1).any(dim=2)
    overlap = (kb_lo.view(1, -1) <= qb_hi.view(-1, 1)) & (kb_hi.view(1, -1) >= qb_lo.view(-1, 1))
    blk_any = (has_blk.view(1, -1) & overlap).unsqueeze(0)
    any_tile = ctx_any | blk_any

    ctx_full = ~has_ctx.view(1, 1, -1) | (
        (min_limit.unsqueeze(-1) >= ctx_end.view(1, 1, -1))
        & (max_first.unsqueeze(-1) <= kv_start.view(1, 1, -1))
    )
    one_block = (
        (qb_lo == qb_hi).view(-1, 1)
        & (kb_lo == kb_hi).view(1, -1)
        & (kb_lo.view(1, -1) == qb_lo.view(-1, 1))
    )
    blk_full = (~has_blk.view(1, -1) | one_block).unsqueeze(0)
    complete = (q_complete.view(-1, 1) & kv_complete.view(1, -1)).unsqueeze(0)
    full_tile = any_tile & ctx_full & blk_full & complete
    partial_tile = any_tile & ~full_tile

    kv_num, kv_idx = _ordered(partial_tile.unsqueeze(1))
    full_num, full_idx = _ordered(full_tile.unsqueeze(1))
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=tile_size,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )


def _window_keep(q_pos: Tensor, kv_pos: Tensor, window: int, causal: bool = True) -> Tensor:
    """``[B, Q, K]``: key position ``p`` may be seen from query position ``t`` iff
    ``t - p < window`` (the query itself included, as Hugging Face counts) and, when `causal`,
    ``p <= t``."""
    diff = q_pos.unsqueeze(-1) - kv_pos.unsqueeze(-2)
    keep = diff < window
    return keep & (diff >= 0) if causal else keep


def _tile_matrix(num: Tensor, idx: Tensor, kv_tiles: int) -> Tensor:
    """(counts ``[B, H, QT]``, indices ``[B, H, QT, KT]``) -> tile booleans ``[B, H, QT, KT]``."""
    used = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    cols = torch.where(used, idx.long(), kv_tiles)
    tiles = torch.zeros(*num.shape, kv_tiles + 1, dtype=torch.bool, device=num.device)
    tiles.scatter_(-1, cols, True)
    return tiles[..., :kv_tiles]


def _windowed_flex_mask(
    mask: BlockMask, q_positions: Tensor, kv_positions: Tensor, window: int, causal: bool
) -> BlockMask:
    q_len, kv_len = mask.seq_lengths
    q_tile, kv_tile = mask.BLOCK_SIZE
    kv_tiles = _cdiv(kv_len, kv_tile)
    batch = q_positions.shape[0]
    device = q_positions.device
    q_pos = torch.zeros(batch, _cdiv(q_len, q_tile) * q_tile, dtype=torch.long, device=device)
    q_pos[:, :q_len] = q_positions
    kv_pos = torch.zeros(batch, kv_tiles * kv_tile, dtype=torch.long, device=device)
    kv_pos[:, :kv_len] = kv_positions
    base = mask.mask_mod

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        diff = q_pos[b, q_idx] - kv_pos[b, kv_idx]
        keep = base(b, h, q_idx, kv_idx) & (diff < window)
        return keep & (diff >= 0) if causal else keep

    # A tile the full-attention mask fills completely may be cut by the window: every visited
    # tile becomes partial, so the mask_mod decides inside it.
    tiles = _tile_matrix(mask.kv_num_blocks, mask.kv_indices, kv_tiles)
    if mask.full_kv_num_blocks is not None and mask.full_kv_indices is not None:
        tiles |= _tile_matrix(mask.full_kv_num_blocks, mask.full_kv_indices, kv_tiles)
    kv_num, kv_idx = _ordered(tiles)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask_mod, seq_lengths=(q_len, kv_len)
    )


def sliding_window_mask(
    mask: DraftMask,
    q_positions: Tensor,
    ctx_positions: Tensor,
    window: int,
    *,
    causal: bool = True,
) -> DraftMask:
    """The mask of a ``sliding_attention`` layer: `mask` (any of the three forms) narrowed to
    keys whose position ``p`` satisfies ``p <= t`` and ``t - p < window`` for a query at
    position ``t``; with ``causal=False`` (DFlash 2, ``is_causal: false``) only ``t - p <
    window``, so the block stays bidirectional and the window cuts the context alone.

    Positions are the RoPE positions the drafter gets (context ``j`` at ``j``, block position
    ``k`` of a block anchored at ``a`` at ``a + k``), which are the key indices of the
    reference's ``[context ; block]`` sequence at inference. So a sliding layer is causal inside
    the block, and a block sees at most the last ``window - 1 - k`` context positions from block
    position ``k``. See docs/dflash.md, "Sliding-window layers".
    """
    if window < 1:
        msg = f"sliding window must be a positive number of keys, got {window}"
        raise ValueError(msg)
    kv_positions = torch.cat([ctx_positions, q_positions], dim=1)
    if isinstance(mask, BlockMask):
        return _windowed_flex_mask(mask, q_positions, kv_positions, window, causal)
    if isinstance(mask, SplitBlockMask):
        bs = mask.block_size
        masks = []
        for (first, end, visible), chunk_mask in zip(mask.chunks, mask.masks, strict=True):
            q_pos = q_positions[:, first * bs : end * bs]
            kv_pos = torch.cat([ctx_positions[:, :visible], q_pos], dim=1)
            keep = _window_keep(q_pos, kv_pos, window, causal)
            masks.append(chunk_mask & keep.unsqueeze(1))
        return SplitBlockMask(tuple(masks), bs, mask.chunks)
    return mask & _window_keep(q_positions, kv_positions, window, causal).unsqueeze(1)


def build_split_block_mask(
    anchors: Tensor,
    block_size: int,
    ctx_len: int,
    valid: Tensor,
    *,
    num_chunks: int | None = None,
    heads: int = 1,
    document_ids: Tensor | None = None,
) -> SplitBlockMask:
    """:class:`SplitBlockMask` of packed blocks (semantics of :func:`build_dense_block_mask`;
    with a packed row's `document_ids` a block sees only its own document's context).

    Blocks are grouped into up to `num_chunks` chunks, by default as few as
    :func:`split_chunk_count` allows for `heads` attention heads; each chunk attends to the
    context prefix its furthest anchor can see (exact for any anchor order, cheapest when
    sorted).
    """
    _check_mask_inputs(anchors, block_size, ctx_len, valid)
    limit = _visible_context(anchors, ctx_len, valid)
    starts = None if document_ids is None else anchor_starts(anchors, document_ids)
    batch, n_blocks = anchors.shape
    if num_chunks is None:
        num_chunks = split_chunk_count(batch, n_blocks, block_size, ctx_len, heads=heads)
    per_chunk = max(1, -(-n_blocks // max(1, num_chunks)))
    count = -(-n_blocks // per_chunk)
    if count == 1:
        # One chunk sees the whole context: the keys are then K and V themselves, no copy.
        visibles = [ctx_len] if n_blocks else []
    else:
        # The furthest anchor of each chunk, in one reduction (no Python loop over blocks).
        furthest = limit.amax(dim=0)
        padded = F.pad(furthest, (0, count * per_chunk - n_blocks))
        visibles = [int(v) for v in padded.view(count, per_chunk).amax(dim=1).tolist()]
    chunks: list[tuple[int, int, int]] = []
    masks: list[Tensor] = []
    for first, visible in zip(range(0, n_blocks, per_chunk), visibles, strict=True):
        end = min(n_blocks, first + per_chunk)
        n_q = (end - first) * block_size
        q_limit = limit[:, first:end].repeat_interleave(block_size, dim=1)
        kv_ctx = torch.arange(visible, device=anchors.device)
        sees_context = kv_ctx.view(1, 1, -1) < q_limit.unsqueeze(-1)
        if starts is not None:
            q_first = starts[:, first:end].repeat_interleave(block_size, dim=1)
            sees_context &= kv_ctx.view(1, 1, -1) >= q_first.unsqueeze(-1)
        q_block = torch.arange(n_q, device=anchors.device) // block_size
        same_block = (q_block.view(-1, 1) == q_block.view(1, -1)).expand(batch, -1, -1)
        masks.append(torch.cat([sees_context, same_block], dim=-1).unsqueeze(1))
        chunks.append((first, end, visible))
    return SplitBlockMask(tuple(masks), block_size, tuple(chunks))
