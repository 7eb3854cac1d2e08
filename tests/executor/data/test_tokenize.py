"""The one-example block rule agrees with the training batches' anchor rule."""

from __future__ import annotations

import random

import torch

from dflash_recipes.executor.data.tokenize import opens_a_block
from dflash_recipes.executor.training.anchors import eligible_anchor_mask


def test_opens_a_block_agrees_with_the_anchor_eligibility_rule() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        length = rng.randint(0, 12)
        mask = [int(rng.random() < 0.6) for _ in range(length)]
        block = rng.randint(2, 6)
        if length:
            loss = torch.tensor([mask])
            expected = bool(
                eligible_anchor_mask(loss, torch.ones_like(loss), block_size=block).any()
            )
        else:
            expected = False
        assert opens_a_block(mask, block) == expected, (mask, block)
