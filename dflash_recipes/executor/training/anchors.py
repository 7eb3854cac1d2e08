"""Anchor sampling and the per-block inputs and labels of DFlash training.

An anchor is a position ``a`` of a training sequence that opens one block: the drafter sees the
target's states strictly before ``a``, the token at ``a`` and ``block_size - 1`` mask tokens, and
block position ``k`` predicts the token at ``a + k`` (position 0, the anchor itself, gets no
loss); a Domino or DSpark head with ``shift_label`` predicts ``a + k + 1`` at position k,
position 0 included (:func:`block_labels`, docs/dflash.md "Label alignment").

**Eligibility rule.** With ``L`` the sequence's valid length (the number of ones in its
attention mask; sequences are right-padded), position ``a`` may open a block when

1. ``a + block_size <= L``: the whole block lies inside the sequence;
2. ``loss_mask[a] == 1``: the anchor is itself a supervised token (prompt tokens open no
   blocks; at inference the anchor is always a token the model produced);
3. ``loss_mask[a + 1] == 1``: the block's first drafted token is supervised, so every block
   carries at least one label.
4. in a packed row (several conversations, ``document_ids``), the whole block lies inside the
   anchor's document.

With answer-only loss this means the first token of each answer is never a label (nothing of
the answer precedes it to anchor on), exactly as at inference, where the target produces it.

**Training batches.** :func:`sample_batch_anchors` draws a batch's anchors from counters: the
key is :func:`anchor_key` ``(seed, epoch)`` and each row's counter is the sequence's position
in the epoch's order (:func:`batch_positions`), so a resumed or data-parallel run draws exactly
the anchors a single uninterrupted run would.
"""

from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING

import attrs
import torch
from torch import Tensor

if TYPE_CHECKING:
    from dflash_recipes.executor.data.train_dataset import Batch
    from dflash_recipes.executor.dist_env import DistEnv

#: Label value at positions that get no loss (PyTorch's cross-entropy ignore_index).
IGNORE_INDEX = -100


@attrs.frozen(eq=False)
class AnchorBatch:
    """Sampled anchors per sequence, sorted ascending, padded with ``valid=False``."""

    #: [B, N] long; padding entries are 0 and must be ignored via `valid`.
    anchors: Tensor
    #: [B, N] bool; True for real anchors (a prefix of each row).
    valid: Tensor

    def to(self, device: torch.device, *, non_blocking: bool = False) -> AnchorBatch:
        """The same anchors on `device`."""
        return AnchorBatch(
            anchors=self.anchors.to(device, non_blocking=non_blocking),
            valid=self.valid.to(device, non_blocking=non_blocking),
        )


def eligible_anchor_mask(
    loss_mask: Tensor,
    attention_mask: Tensor,
    *,
    block_size: int,
    document_ids: Tensor | None = None,
) -> Tensor:
    """[B, T] bool: positions allowed to open a block (the rule in the module docstring).

    With `document_ids` ([B, T], a packed row's document number per token) a block must also
    lie inside one document: the anchor's document is the block's last position's document.
    """
    if loss_mask.shape != attention_mask.shape or loss_mask.dim() != 2:
        msg = (
            f"loss_mask {tuple(loss_mask.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be [batch, seq_len]"
        )
        raise ValueError(msg)
    if block_size < 2:
        msg = f"block_size must be >= 2, got {block_size}"
        raise ValueError(msg)
    _, seq_len = loss_mask.shape
    supervised = loss_mask != 0
    valid_len = (attention_mask != 0).sum(dim=1, keepdim=True)
    positions = torch.arange(seq_len, device=loss_mask.device).unsqueeze(0)
    fits = positions + block_size <= valid_len
    next_supervised = torch.zeros_like(supervised)
    next_supervised[:, :-1] = supervised[:, 1:]
    eligible = fits & supervised & next_supervised
    if document_ids is not None:
        if document_ids.shape != loss_mask.shape:
            msg = f"document_ids {tuple(document_ids.shape)} must be {tuple(loss_mask.shape)}"
            raise ValueError(msg)
        same = torch.zeros_like(supervised)
        if block_size <= seq_len:
            last = document_ids[:, block_size - 1 :]
            same[:, : seq_len - block_size + 1] = last == document_ids[:, : last.shape[1]]
        eligible = eligible & same
    return eligible


def sample_anchors(
    loss_mask: Tensor,
    attention_mask: Tensor,
    *,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator,
) -> AnchorBatch:
    """Sample up to `num_anchors` eligible anchors per sequence, uniformly without replacement.

    Every eligible position of a row is equally likely and each subset of the same size is
    equally likely (random keys, smallest `num_anchors` kept). Rows are sorted ascending and
    padded to N = the largest count in the batch (N may be 0). Random numbers come from
    `generator` on its own device, so a CPU generator gives the same anchors on any device
    and the same generator state always gives the same anchors.
    """
    eligible, n = _eligible_and_count(loss_mask, attention_mask, block_size, num_anchors)
    batch, seq_len = eligible.shape
    if n == 0:
        return _no_anchors(batch, loss_mask.device)
    keys = torch.rand(batch, seq_len, generator=generator, device=generator.device)
    keys = keys.to(loss_mask.device)
    return _smallest_keys(eligible, keys, n, 2.0)


def sample_counter_anchors(
    loss_mask: Tensor,
    attention_mask: Tensor,
    *,
    block_size: int,
    num_anchors: int,
    key: int,
    rows: Tensor,
    document_ids: Tensor | None = None,
) -> AnchorBatch:
    """:func:`sample_anchors` with counter-based random keys: row ``r`` of the batch draws
    :func:`counter_keys` ``(key, rows[r], ...)``.

    The anchors of a row depend only on `key`, its counter ``rows[r]`` and its own masks, never
    on the other rows or on earlier draws, so the row drawn again in another batch, another
    process or a resumed run gets the same anchors. One vectorised pass over the whole batch.
    A packed row (`document_ids`) draws from every document's eligible positions at once: the
    row's budget is shared by its supervised positions, and no block crosses a document end.
    """
    eligible, n = _eligible_and_count(
        loss_mask, attention_mask, block_size, num_anchors, document_ids
    )
    batch, seq_len = eligible.shape
    if rows.shape != (batch,):
        msg = f"rows must hold one counter per sequence ({batch}), got {tuple(rows.shape)}"
        raise ValueError(msg)
    if n == 0:
        return _no_anchors(batch, loss_mask.device)
    keys = counter_keys(key, rows, seq_len).to(loss_mask.device)
    # int64 keys: ineligible positions get the largest value (an eligible key equal to it, one
    # in 2**64, merely ranks last).
    return _smallest_keys(eligible, keys, n, torch.iinfo(torch.int64).max)


def _eligible_and_count(
    loss_mask: Tensor,
    attention_mask: Tensor,
    block_size: int,
    num_anchors: int,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, int]:
    """The eligible positions ``[B, T]`` and how many anchors the fullest row gets."""
    if num_anchors < 1:
        msg = f"num_anchors must be >= 1, got {num_anchors}"
        raise ValueError(msg)
    eligible = eligible_anchor_mask(
        loss_mask, attention_mask, block_size=block_size, document_ids=document_ids
    )
    if eligible.shape[0] == 0:
        return eligible, 0
    return eligible, min(num_anchors, int(eligible.sum(dim=1).max().item()))


def _no_anchors(batch: int, device: torch.device) -> AnchorBatch:
    empty = torch.zeros(batch, 0, dtype=torch.long, device=device)
    return AnchorBatch(anchors=empty, valid=empty.bool())


def _smallest_keys(eligible: Tensor, keys: Tensor, n: int, above: float) -> AnchorBatch:
    """Per row, the eligible positions of the `n` smallest keys, sorted ascending; `above` is
    larger than every random key."""
    seq_len = eligible.shape[1]
    # Ineligible positions get a key above every random one, so they are picked last.
    keys = torch.where(eligible, keys, torch.full_like(keys, above))
    _, chosen = torch.topk(keys, n, dim=1, largest=False, sorted=True)
    valid = torch.gather(eligible, 1, chosen)
    # Sort real anchors ascending and push padding to the end of each row.
    order_key = torch.where(valid, chosen, torch.full_like(chosen, seq_len))
    sorted_pos, _ = torch.sort(order_key, dim=1)
    valid = sorted_pos < seq_len
    anchors = torch.where(valid, sorted_pos, torch.zeros_like(sorted_pos))
    return AnchorBatch(anchors=anchors.long(), valid=valid)


# splitmix64 (Steele, Lea & Flood 2014) on int64 tensors: products wrap modulo 2**64 and the
# logical right shift is an arithmetic shift with the sign bits masked off.
def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN_GAMMA = _signed(0x9E3779B97F4A7C15)
_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)


def _shift_right(z: Tensor, bits: int) -> Tensor:
    return (z >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """splitmix64's output function, in place on `z` (a fresh tensor)."""
    z.bitwise_xor_(_shift_right(z, 30)).mul_(_MIX_1)
    z.bitwise_xor_(_shift_right(z, 27)).mul_(_MIX_2)
    return z.bitwise_xor_(_shift_right(z, 31))


def counter_keys(key: int, rows: Tensor, width: int) -> Tensor:
    """``[len(rows), width]`` uniformly random int64 keys, a pure function of the counters.

    Entry ``(r, j)`` is output ``j + 1`` of a splitmix64 stream whose seed is output
    ``rows[r] + 1`` of the stream seeded by `key`: no generator state, so any row or column is
    computed on its own and a whole batch in one vectorised pass. Only the keys' order is used
    (the smallest ones win), so they stay integers.
    """
    base = _signed(key % (1 << 64))
    counters = rows.to(device="cpu", dtype=torch.int64).view(-1, 1)
    row_seed = _mix64((counters + 1).mul_(_GOLDEN_GAMMA).add_(base))
    columns = torch.arange(1, width + 1, dtype=torch.int64).mul_(_GOLDEN_GAMMA)
    return _mix64(columns + row_seed)


# Training batches: anchors keyed by (seed, epoch) and the sequence's position in the epoch.


@functools.lru_cache(maxsize=64)
def anchor_key(seed: int, epoch: int) -> int:
    """The counter-based key of one epoch's anchors: a pure function of (seed, epoch)."""
    digest = hashlib.sha256(f"dflash-anchors:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def sample_batch_anchors(
    batch: Batch,
    *,
    positions: list[int],
    seed: int,
    block_size: int,
    num_anchors: int,
) -> AnchorBatch:
    """The anchors of a training batch, ``[B, N]`` with N >= 1; row ``r`` is drawn from the
    counter ``positions[r]`` under :func:`anchor_key` ``(seed, epoch)``, all rows in one pass
    (a packed batch: per document, :func:`sample_counter_anchors`)."""
    drawn = sample_counter_anchors(
        batch.loss_mask,
        batch.attention_mask,
        block_size=block_size,
        num_anchors=num_anchors,
        key=anchor_key(seed, batch.epoch),
        rows=torch.tensor(positions, dtype=torch.int64),
        document_ids=batch.document_ids,
    )
    if drawn.anchors.shape[1] == 0:
        # No row has an eligible position: one padding block, so every shape stays non-empty.
        rows = drawn.anchors.shape[0]
        return AnchorBatch(
            anchors=torch.zeros(rows, 1, dtype=torch.long),
            valid=torch.zeros(rows, 1, dtype=torch.bool),
        )
    return drawn


def batch_positions(batch: Batch, env: DistEnv) -> list[int]:
    """Positions in the epoch's order of this rank's rows of the batch (their anchor counters)."""
    local = int(batch.input_ids.shape[0])
    global_rows = local * env.world_size
    start = batch.next_index - global_rows + env.rank * local
    return [start + row for row in range(local)]


def _block_grid(anchors: Tensor, block_size: int) -> Tensor:
    """``[B, N, block_size]``: entry k of a block is anchor + k."""
    offsets = torch.arange(block_size, device=anchors.device, dtype=anchors.dtype)
    return anchors.unsqueeze(-1) + offsets


def block_positions(anchors: Tensor, block_size: int) -> Tensor:
    """Packed positions of the blocks: ``anchors [B, N]`` -> ``[B, N * block_size]`` (the
    drafter's query positions; block n fills columns ``n*block_size ..``)."""
    return _block_grid(anchors, block_size).flatten(1)


def block_inputs(
    input_ids: Tensor,
    anchors: Tensor,
    valid: Tensor,
    *,
    block_size: int,
    mask_token_id: int,
) -> tuple[Tensor, Tensor]:
    """Block token ids and positions, packed along the sequence axis.

    Returns ``(block_ids [B, N*block_size], q_positions [B, N*block_size])``: block ``n``
    occupies columns ``n*block_size .. (n+1)*block_size - 1`` with ids
    ``[input_ids[anchor], mask, ..., mask]`` and positions ``anchor .. anchor+block_size-1``.
    Padding blocks (``valid=False``) are all mask tokens at positions ``0 ..``; the caller's
    attention mask and labels must ignore them.
    """
    batch, n = anchors.shape
    anchor_ids = torch.gather(input_ids, 1, anchors)
    anchor_ids = torch.where(valid, anchor_ids, torch.full_like(anchor_ids, mask_token_id))
    ids = torch.full(
        (batch, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device
    )
    ids[:, :, 0] = anchor_ids
    return ids.reshape(batch, n * block_size), block_positions(anchors, block_size)


def block_labels(
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    valid: Tensor,
    *,
    block_size: int,
    shift: int = 0,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Labels of every block position: position k predicts the token at ``anchor + k + shift``.

    ``shift`` is 0 for plain DFlash (and heads trained with shift_label false): position 0, the
    anchor itself, is never supervised. With ``shift`` 1 (Domino and DSpark as ModelOpt trains
    them) position 0 predicts ``anchor + 1`` and is supervised like every other position.

    Returns ``(labels [B, N, block_size] long, label_mask [B, N, block_size] bool)``. A position
    is supervised when its block is valid, its target ``anchor + k + shift`` is inside the
    sequence and ``loss_mask`` there is 1 (and ``k >= 1`` without the shift). Unsupervised
    labels are ``IGNORE_INDEX`` (-100). In a packed row (`document_ids`) a target in another
    document than the anchor's is not supervised either (the last position of a block that
    ends its document, with the shift).
    """
    if shift not in (0, 1):
        msg = f"shift must be 0 or 1, got {shift}"
        raise ValueError(msg)
    _, seq_len = input_ids.shape
    positions = _block_grid(anchors, block_size) + shift
    inside = positions < seq_len
    flat = positions.clamp(max=seq_len - 1).flatten(1)
    tokens = torch.gather(input_ids, 1, flat).view_as(positions)
    supervised = torch.gather(loss_mask, 1, flat).view_as(positions) != 0
    not_anchor = torch.arange(block_size, device=anchors.device) + shift >= 1
    label_mask = valid.unsqueeze(-1) & inside & supervised & not_anchor
    if document_ids is not None:
        target_doc = torch.gather(document_ids, 1, flat).view_as(positions)
        anchor_doc = torch.gather(document_ids, 1, anchors.clamp(min=0)).unsqueeze(-1)
        label_mask &= target_doc == anchor_doc
    labels = torch.where(label_mask, tokens.long(), torch.full_like(tokens.long(), IGNORE_INDEX))
    return labels, label_mask


def previous_tokens(ids: Tensor, anchors: Tensor, block_size: int, *, shift: int) -> Tensor:
    """``[B, N, K]``: index k holds the token at ``anchor + k + shift - 1``, the known token
    just before the one block position k predicts (what a head conditions on); positions
    outside the sequence are clamped into it (their labels are masked)."""
    offsets = torch.arange(block_size, device=anchors.device) + (shift - 1)
    positions = (anchors.unsqueeze(-1) + offsets).clamp(min=0, max=ids.shape[1] - 1)
    flat = torch.gather(ids, 1, positions.flatten(1))
    return flat.view_as(positions)


def gather_teacher_logits(
    target_logits: Tensor, anchors: Tensor, *, block_size: int, shift: int = 0
) -> Tensor:
    """The target's next-token logits for every block position: [B, N, block_size, V].

    Entry k is ``target_logits[:, anchor + k + shift - 1]``, the target's distribution for the
    token at ``anchor + k + shift`` (the same token block position k predicts). Rows outside
    the sequence (entry 0 of an anchor at 0 without the shift, positions past the end) are
    clamped into range; `label_mask` from :func:`block_labels` excludes them.
    """
    batch, seq_len, _ = target_logits.shape
    grid = _block_grid(anchors, block_size) + (shift - 1)
    positions = grid.clamp(min=0, max=seq_len - 1)
    rows = torch.arange(batch, device=anchors.device).view(batch, 1, 1)
    return target_logits[rows, positions]


__all__ = [
    "IGNORE_INDEX",
    "AnchorBatch",
    "anchor_key",
    "batch_positions",
    "block_inputs",
    "block_labels",
    "block_positions",
    "counter_keys",
    "eligible_anchor_mask",
    "gather_teacher_logits",
    "previous_tokens",
    "sample_anchors",
    "sample_batch_anchors",
    "sample_counter_anchors",
]
