"""How the CPU split attention cuts a step's blocks into chunks: pure shape arithmetic (no torch).

The executor's split block mask (:mod:`dflash_recipes.executor.model.masks`) and the compile-time
resource estimate (:mod:`dflash_recipes.plan.resources.estimate`) both count chunks here, so
the memory the estimate predicts is the memory the step allocates.
"""

from __future__ import annotations

#: Most queries (block positions) one chunk of the CPU split attention holds: its dense
#: blocks x blocks part is then at most 128 x 128 per row and head. Measured on CPU
#: (benchmarks/bench_step_overhead.py, bench_train_throughput.py): chunks of about 100-128
#: queries are the fastest from 512 to 1024 context positions and 64 to 512 blocks of 16 per
#: row; larger chunks redo more of the blocks x blocks part, far smaller ones pay a per-call
#: cost and copy the visible context's K and V once per chunk. A step of at most this many
#: block positions (issue 15's tiny shape: 8 blocks of 8) is one chunk, one call per layer.
MAX_CHUNK_QUERIES = 128


#: Most attention-score elements (``batch x heads x chunk queries x chunk keys``) one chunk may
#: hold: 2**24 = 64 MiB in float32 (the attention-sink path materialises them).
MAX_SPLIT_SCORES = 2**24


def split_chunk_count(
    batch: int,
    n_blocks: int,
    block_size: int,
    ctx_len: int,
    *,
    heads: int = 1,
    max_queries: int = MAX_CHUNK_QUERIES,
    max_scores: int = MAX_SPLIT_SCORES,
) -> int:
    """Fewest chunks of consecutive blocks such that each holds at most `max_queries` block
    positions and at most `max_scores` attention scores.

    A chunk of ``n`` blocks attends ``q = n * block_size`` queries to at most ``ctx_len``
    context keys plus its own ``q`` keys: ``batch * heads * q * (ctx_len + q)`` scores, of
    which ``q x q`` per row and head is the blocks x blocks part the split exists to avoid.
    One chunk when everything fits; never less than one block per chunk. Depends on the shapes
    only, so every step of a run with the same shapes makes the same calls.
    """
    if n_blocks <= 0:
        return 1
    per_query = max(1, batch * heads)

    def fits(blocks: int) -> bool:
        q = blocks * block_size
        return q <= max_queries and per_query * q * (ctx_len + q) <= max_scores

    if fits(n_blocks):
        return 1
    # Largest chunk that fits (binary search over blocks per chunk, at least one).
    low, high = 1, n_blocks
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return -(-n_blocks // low)
