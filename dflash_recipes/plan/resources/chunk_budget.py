"""How many logits one chunk of blocks may hold, sized from the device's free memory.

The drafter's logits ``[B, N, K, vocab]`` are the largest tensors of a step. When they exceed
the budget, :class:`~dflash_recipes.executor.training.step.DraftStep` runs lm_head, head and
loss per chunk of blocks under activation checkpointing, which costs a second lm_head/loss
forward. A fixed budget (:data:`MAX_CHUNK_LOGITS`, 256 MiB of float32 logits) suits a small
GPU but makes a 139 GiB one pay that second forward for memory it has: on CUDA the budget is
:func:`logits_budget` of the memory free at the step (a :data:`SAFETY_FRACTION` of it, never
below the fixed floor); on CPU, or when the caller gives one, the fixed budget stands.

Pure arithmetic, no torch, so it lives below the executor: the step
(:meth:`~dflash_recipes.executor.training.step.DraftStep.blocks_per_chunk`) and the memory estimate
(:mod:`~dflash_recipes.plan.resources.estimate`) size the same chunks with it.
"""

from __future__ import annotations

#: Most logits one chunk of blocks may hold when nothing else decides it (elements; 2**26 =
#: 256 MiB in float32). Also the floor of :func:`logits_budget`.
MAX_CHUNK_LOGITS = 2**26
#: The share of the free device memory one chunk's logits and loss may take; the rest is left
#: for the drafter's backward, which starts while the chunk's gradients are alive.
SAFETY_FRACTION = 0.5
#: float32 copies of a logit that a chunk holds at its peak: the float32 logits, the loss's
#: saved log-probabilities, and in backward their gradient and the logits' gradient.
_FLOAT32_COPIES = 4
#: More float32 copies when the objective reads the target's distribution (the gathered
#: teacher logits, their softmax and the drafter's log-softmax).
_TEACHER_COPIES = 3


def bytes_per_row(*, vocab: int, hidden: int, dtype_bytes: int, teacher: bool = False) -> int:
    """Peak bytes one row (one block position) of a chunk holds: its logits in the lm_head's
    dtype and in float32 with the loss's copies and gradients, and its contiguous hidden state
    with its gradient."""
    copies = _FLOAT32_COPIES + (_TEACHER_COPIES if teacher else 0)
    logits = vocab * (4 * copies + 2 * dtype_bytes)
    states = hidden * (dtype_bytes + 4)
    return logits + states


def chunk_rows(
    free_bytes: int,
    *,
    vocab: int,
    hidden: int,
    dtype_bytes: int,
    teacher: bool = False,
    fraction: float = SAFETY_FRACTION,
    floor: int = MAX_CHUNK_LOGITS,
) -> int:
    """Rows (block positions) one chunk may hold with `free_bytes` free on the device: a
    `fraction` of them over :func:`bytes_per_row`, and never fewer than `floor` logits' worth
    (today's fixed budget). At least 1."""
    if vocab < 1 or hidden < 1 or dtype_bytes < 1:
        msg = f"vocab, hidden and dtype_bytes must be >= 1, got {vocab}, {hidden}, {dtype_bytes}"
        raise ValueError(msg)
    per_row = bytes_per_row(vocab=vocab, hidden=hidden, dtype_bytes=dtype_bytes, teacher=teacher)
    sized = int(max(0, free_bytes) * fraction) // per_row
    return max(1, sized, floor // vocab)


def logits_budget(
    free_bytes: int | None,
    *,
    vocab: int,
    hidden: int,
    dtype_bytes: int,
    teacher: bool = False,
    override: int | None = None,
) -> int:
    """Most logits (elements) one chunk may hold: `override` when given, the fixed
    :data:`MAX_CHUNK_LOGITS` when the free memory is unknown (CPU), else :func:`chunk_rows`
    of `free_bytes` times `vocab`."""
    if override is not None:
        return override
    if free_bytes is None:
        return MAX_CHUNK_LOGITS
    rows = chunk_rows(
        free_bytes, vocab=vocab, hidden=hidden, dtype_bytes=dtype_bytes, teacher=teacher
    )
    return rows * vocab


__all__ = [
    "MAX_CHUNK_LOGITS",
    "SAFETY_FRACTION",
    "bytes_per_row",
    "chunk_rows",
    "logits_budget",
]
