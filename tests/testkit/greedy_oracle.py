"""A drafter that knows the target's greedy continuations, and rejects where it is told to.

:func:`oracle_for` asks the target (``generate``, greedy) for each prompt's continuation and
returns a :class:`CyclingOracle`, whose step ``i`` of a prompt proposes its first
``pattern[i % len(pattern)]`` tokens right and the rest wrong: the rejection moves through every
block position, so a verification loop rolls its cache back from each of them. It also asserts
that the loop only ever committed greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from dflash_recipes.executor.evaluation.speculative import DraftContext
from testkit.tiny import TINY_VOCAB


def hf_greedy(target: PreTrainedModel, prompt: Sequence[int], n: int) -> list[int]:
    """The ``n`` tokens transformers' own greedy ``generate`` gives after ``prompt``."""
    out = target.generate(  # type: ignore[operator]
        torch.tensor([list(prompt)]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


class CyclingOracle:
    """Knows the greedy continuations; step ``i`` of a prompt proposes its first
    ``pattern[i % len(pattern)]`` tokens right and the rest wrong, so the rejection moves
    through every block position."""

    def __init__(
        self, continuations: dict[tuple[int, ...], list[int]], pattern: Sequence[int]
    ) -> None:
        self.continuations = continuations
        self.pattern = list(pattern)
        self.steps: dict[tuple[int, ...], int] = {}

    def propose(self, context: DraftContext) -> list[int]:
        committed = list(context.committed)
        prompt = next(p for p in self.continuations if committed[: len(p)] == list(p))
        full = [*prompt, *self.continuations[prompt]]
        assert committed == full[: len(committed)], "the loop committed a non-greedy token"
        assert context.taps.shape[:2] == (1, len(committed) - 1)
        step = self.steps.get(prompt, 0)
        self.steps[prompt] = step + 1
        # Prompts are offset so that rows of a batch reject at different positions.
        good = self.pattern[(step + len(prompt)) % len(self.pattern)]
        right = full[len(committed) : len(committed) + context.block_size - 1]
        right += [0] * (context.block_size - 1 - len(right))
        return [t if k < good else (t + 1) % TINY_VOCAB for k, t in enumerate(right)]


def oracle_for(
    target: PreTrainedModel, prompts: Sequence[Sequence[int]], n: int, block_size: int
) -> CyclingOracle:
    """An oracle for ``prompts`` that knows ``n`` greedy tokens (plus a block) of each."""
    continuations = {tuple(p): hf_greedy(target, p, n + block_size) for p in prompts}
    return CyclingOracle(continuations, list(range(block_size)))


__all__ = ["CyclingOracle", "hf_greedy", "oracle_for"]
