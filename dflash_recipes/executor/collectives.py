"""The collectives the ranks exchange values with: barrier, rank 0's text, sums, the global loss.

Each is a no-op (or returns its input) for a single process, and every rank must call it at
the same point: a collective one rank skips leaves the others waiting. The decisions built on
them (what to resume, whether the plans agree, when to stop) are in
:mod:`dflash_recipes.executor.coordination`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from dflash_recipes.executor.dist_env import DistEnv, joined


def barrier(env: DistEnv) -> None:
    """Wait for every rank (no-op for a single process)."""
    if not joined(env):
        return
    if env.backend == "nccl":
        dist.barrier(device_ids=[env.local_rank])
    else:
        dist.barrier()


_DIGEST_CHARS = 64

#: The longest text :func:`broadcast_text` carries (a message longer than this is cut).
TEXT_LIMIT = 4096


def _coordination_device(env: DistEnv) -> torch.device:
    return env.device if env.backend == "nccl" else torch.device("cpu")


def broadcast_text(text: str | None, env: DistEnv) -> str | None:
    """Rank 0's `text` (None when it has none) on every rank; the other ranks wait for it.

    UTF-8, cut to :data:`TEXT_LIMIT` bytes (on a character boundary). Returns `text` itself
    for a single process and on rank 0. Every rank takes part whatever rank 0 holds, so none
    is left waiting; nothing is pickled."""
    if not joined(env):
        return text
    device = _coordination_device(env)
    # [has text, length (2 bytes, big-endian), the UTF-8 bytes...]
    buffer = torch.zeros(3 + TEXT_LIMIT, dtype=torch.uint8, device=device)
    if env.rank == 0 and text is not None:
        raw = _cut_utf8(text, TEXT_LIMIT)
        header = bytes([1]) + len(raw).to_bytes(2, "big")
        buffer[: 3 + len(raw)] = torch.tensor(list(header + raw), dtype=torch.uint8)
    dist.broadcast(buffer, src=0)
    if env.rank == 0:
        return text
    values = bytes(buffer.cpu().tolist())
    if values[0] != 1:
        return None
    return values[3 : 3 + int.from_bytes(values[1:3], "big")].decode("utf-8")


def broadcast_digest(digest: str | None, env: DistEnv) -> str | None:
    """Rank 0's sha256 hex digest (None when it has none) on every rank; the other ranks wait
    for it. Returns `digest` itself for a single process. Every rank takes part whatever rank
    0 holds (what is not a 64-character ASCII digest reaches the others as None), so none
    is left waiting."""
    ok = digest is not None and len(digest) == _DIGEST_CHARS and digest.isascii()
    shared = broadcast_text(digest if ok else None, env)
    if env.rank == 0 or not joined(env):
        return digest
    return shared


def first_rank_where(flag: bool, env: DistEnv) -> int | None:
    """The lowest rank whose `flag` is true, on every rank; None when no rank's is. A single
    process: 0 when `flag`, else None."""
    if not joined(env):
        return 0 if flag else None
    mine = env.rank if flag else env.world_size
    lowest = torch.tensor([mine], dtype=torch.int64, device=_coordination_device(env))
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    found = int(lowest.item())
    return found if found < env.world_size else None


def all_reduce_sum(tensor: Tensor, env: DistEnv) -> Tensor:
    """Sum a tensor over all ranks, in place (identity for a single process)."""
    if env.is_distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def global_batch_loss(loss: Tensor, weight_sum: Tensor, env: DistEnv) -> Tensor:
    """`loss` (this rank's, normalised by its own `weight_sum`) renormalised by the weight sum
    of the whole global batch, times the world size: DDP's gradient average then equals the
    single-process gradient over the global batch. One process: `loss` unchanged."""
    if not env.is_distributed:
        return loss  # the scale is local / local = 1 exactly
    total = all_reduce_sum(weight_sum.clone(), env)
    # No host sync: where() instead of a Python test of the total.
    positive = total > 0
    safe_total = torch.where(positive, total, torch.ones_like(total))
    scale = torch.where(positive, weight_sum * env.world_size / safe_total, 1.0)
    return loss * scale


#: The longest text :func:`gather_texts` carries from each rank (longer ones are cut).
GATHER_LIMIT = 256


def gather_texts(text: str, env: DistEnv) -> list[str]:
    """Every rank's `text`, in rank order, on every rank (``[text]`` for a single process).

    UTF-8, each cut to :data:`GATHER_LIMIT` bytes on a character boundary; nothing is pickled.
    """
    if not joined(env):
        return [text]
    device = _coordination_device(env)
    raw = _cut_utf8(text, GATHER_LIMIT)
    mine = torch.zeros(2 + GATHER_LIMIT, dtype=torch.uint8, device=device)
    mine[:2] = torch.tensor(list(len(raw).to_bytes(2, "big")), dtype=torch.uint8)
    if raw:
        mine[2 : 2 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    every = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(every, mine)
    texts = []
    for buffer in every:
        values = bytes(buffer.cpu().tolist())
        texts.append(values[2 : 2 + int.from_bytes(values[:2], "big")].decode("utf-8"))
    return texts


def _cut_utf8(text: str, limit: int) -> bytes:
    """`text` as UTF-8, cut to `limit` bytes without splitting a character."""
    return text.encode("utf-8")[:limit].decode("utf-8", errors="ignore").encode("utf-8")


__all__ = [
    "GATHER_LIMIT",
    "TEXT_LIMIT",
    "all_reduce_sum",
    "barrier",
    "broadcast_digest",
    "broadcast_text",
    "first_rank_where",
    "gather_texts",
    "global_batch_loss",
]
