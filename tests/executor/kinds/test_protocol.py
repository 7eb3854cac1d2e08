"""What heads share: the position-by-position greedy walk and the per-block shape check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testkit.tiny import tiny_plan

from dflash_recipes.executor.kinds.protocol import check_blocks, propose_by_position


@pytest.mark.parametrize("shift_label", [True, False])
def test_each_position_sees_the_anchor_then_the_proposals_before_it(
    tmp_path: Path, shift_label: bool
) -> None:
    spec = tiny_plan(
        tmp_path,
        projector_type="dspark",
        markov_rank=4,
        block_size=4,
        shift_label=shift_label,
    ).resolved_draft()
    first = spec.first_drafting_position
    seen: list[list[list[int]]] = []

    def next_token(k: int, prev: torch.Tensor) -> torch.Tensor:
        seen.append(prev.tolist())
        return torch.tensor([100 + k, 200 + k])

    out = propose_by_position(torch.zeros(2, 4, 8), [7, 9], spec, next_token)
    assert out.tolist() == [[100 + k for k in range(first, 4)], [200 + k for k in range(first, 4)]]
    # index `first` is the anchor, index j > first the proposal of position j - 1
    lead = [[7] * (first + 1), [9] * (first + 1)]
    assert seen[0] == lead
    assert seen[-1][0] == [*lead[0], *(100 + k for k in range(first, 3))]


def test_a_head_input_of_another_block_shape_is_named() -> None:
    with pytest.raises(ValueError, match=r"prev_tokens must be \[N, B, \.\.\.\] like hidden"):
        check_blocks("prev_tokens", torch.zeros(2, 3), torch.zeros(2, 4, 8))
