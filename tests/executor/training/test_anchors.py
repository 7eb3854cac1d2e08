"""Anchor sampling, block inputs, block labels and teacher-logit gathering."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_recipes.executor.training.anchors import (
    IGNORE_INDEX,
    block_inputs,
    block_labels,
    counter_keys,
    eligible_anchor_mask,
    gather_teacher_logits,
    previous_tokens,
    sample_anchors,
    sample_counter_anchors,
)

MASK_ID = 99


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(*masks: list[int], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss masks as a right-padded batch; `length` cuts every row's valid length."""
    width = max(len(m) for m in masks)
    loss = torch.zeros(len(masks), width, dtype=torch.long)
    attention = torch.zeros(len(masks), width, dtype=torch.long)
    for i, m in enumerate(masks):
        n = len(m) if length is None else min(length, len(m))
        loss[i, : len(m)] = torch.tensor(m)
        attention[i, :n] = 1
        loss[i, n:] = 0
    return loss, attention


def test_eligible_positions_follow_the_documented_rule() -> None:
    #           0  1  2  3  4  5  6  7  8  9 10 11
    loss, att = _rows([0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0])
    att[0, 11] = 0  # valid length 11
    eligible = eligible_anchor_mask(loss, att, block_size=3)
    # a needs loss[a] = loss[a+1] = 1 and a + 3 <= 11: 5 fails (6 unsupervised), 9 fails (10).
    assert eligible[0].nonzero().flatten().tolist() == [2, 3, 4, 7, 8]
    # A bigger block must fit too: 8 + 4 > 11.
    eligible4 = eligible_anchor_mask(loss, att, block_size=4)
    assert eligible4[0].nonzero().flatten().tolist() == [2, 3, 4, 7]


def test_padding_never_opens_a_block() -> None:
    loss = torch.ones(1, 10, dtype=torch.long)
    att = torch.zeros(1, 10, dtype=torch.long)
    att[0, :6] = 1
    loss[0, 6:] = 1  # a loss mask that (wrongly) covers padding still cannot open blocks there
    eligible = eligible_anchor_mask(loss, att, block_size=2)
    assert eligible[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]


def test_same_generator_state_gives_the_same_anchors() -> None:
    loss = torch.ones(3, 64, dtype=torch.long)
    att = torch.ones(3, 64, dtype=torch.long)
    a = sample_anchors(loss, att, block_size=4, num_anchors=8, generator=_gen(7))
    b = sample_anchors(loss, att, block_size=4, num_anchors=8, generator=_gen(7))
    c = sample_anchors(loss, att, block_size=4, num_anchors=8, generator=_gen(8))
    assert torch.equal(a.anchors, b.anchors)
    assert torch.equal(a.valid, b.valid)
    assert not torch.equal(a.anchors, c.anchors)


def test_anchors_are_sorted_distinct_eligible_and_padded() -> None:
    long_row = [1] * 40
    short_row = [0] * 30 + [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]  # eligible: 30..33
    empty_row = [0] * 40
    loss, att = _rows(long_row, short_row, empty_row)
    batch = sample_anchors(loss, att, block_size=3, num_anchors=10, generator=_gen(0))
    eligible = eligible_anchor_mask(loss, att, block_size=3)

    assert batch.anchors.shape == (3, 10)
    assert batch.anchors.dtype == torch.long and batch.valid.dtype == torch.bool
    assert batch.valid.sum(dim=1).tolist() == [10, 4, 0]
    assert batch.anchors[1, :4].tolist() == [30, 31, 32, 33]  # fewer eligible than asked: all
    for row in range(3):
        real = batch.anchors[row][batch.valid[row]].tolist()
        assert real == sorted(set(real))  # sorted, no duplicates
        assert all(bool(eligible[row, a]) for a in real)
        assert all(a + 3 <= int(att[row].sum()) for a in real)  # blocks fit
        # valid entries come first; padding is 0
        count = len(real)
        assert batch.valid[row, :count].all() and not batch.valid[row, count:].any()
        assert (batch.anchors[row, count:] == 0).all()


def test_width_is_the_largest_count_not_num_anchors() -> None:
    loss, att = _rows([1] * 6, [1] * 4)
    batch = sample_anchors(loss, att, block_size=2, num_anchors=100, generator=_gen(0))
    # row 0: anchors 0..4 (a + 2 <= 6); row 1: 0..2
    assert batch.anchors.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]
    assert batch.valid.tolist() == [[True] * 5, [True, True, True, False, False]]


def test_no_eligible_position_gives_empty_blocks() -> None:
    loss, att = _rows([0, 1, 0, 1, 0, 1])
    batch = sample_anchors(loss, att, block_size=2, num_anchors=4, generator=_gen(0))
    assert batch.anchors.shape == (1, 0)
    assert batch.valid.shape == (1, 0)


def test_each_eligible_position_is_equally_likely() -> None:
    # 3000 independent rows in one call: 12 eligible positions (2..13), 3 anchors each.
    rows = 3000
    loss = torch.zeros(rows, 20, dtype=torch.long)
    loss[:, 2:15] = 1
    att = torch.ones(rows, 20, dtype=torch.long)
    batch = sample_anchors(loss, att, block_size=2, num_anchors=3, generator=_gen(123))
    picked = batch.anchors[batch.valid]
    counts = torch.bincount(picked, minlength=20)
    assert counts[:2].sum() == 0 and counts[14:].sum() == 0
    expected = rows * 3 / 12  # 750 per position; binomial sd about 24
    assert ((counts[2:14].float() - expected).abs() < 100).all(), counts.tolist()


@settings(max_examples=40, deadline=None)
@given(
    masks=st.lists(st.lists(st.integers(0, 1), min_size=2, max_size=24), min_size=1, max_size=4),
    block_size=st.integers(2, 6),
    num_anchors=st.integers(1, 8),
    seed=st.integers(0, 2**31),
)
def test_every_sampled_block_carries_a_label(
    masks: list[list[int]], block_size: int, num_anchors: int, seed: int
) -> None:
    loss, att = _rows(*masks)
    ids = torch.arange(loss.numel()).view_as(loss) + 1000
    batch = sample_anchors(
        loss, att, block_size=block_size, num_anchors=num_anchors, generator=_gen(seed)
    )
    _, label_mask = block_labels(ids, loss, batch.anchors, batch.valid, block_size=block_size)
    # Position 1 of every real block is supervised; padding blocks carry nothing.
    assert bool((label_mask[..., 1] == batch.valid).all())
    assert not label_mask[~batch.valid].any()
    eligible = eligible_anchor_mask(loss, att, block_size=block_size)
    assert batch.valid.sum(dim=1).tolist() == [
        min(num_anchors, int(n)) for n in eligible.sum(dim=1)
    ]


def test_block_inputs_are_anchor_token_then_masks_at_consecutive_positions() -> None:
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    anchors = torch.tensor([[1, 4, 0]])
    valid = torch.tensor([[True, True, False]])
    block_ids, positions = block_inputs(ids, anchors, valid, block_size=3, mask_token_id=MASK_ID)
    assert block_ids.tolist() == [[11, MASK_ID, MASK_ID, 14, MASK_ID, MASK_ID] + [MASK_ID] * 3]
    assert positions.tolist() == [[1, 2, 3, 4, 5, 6, 0, 1, 2]]


def test_block_labels_predict_anchor_plus_k_and_drop_what_is_not_supervised() -> None:
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    loss = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1]])
    anchors = torch.tensor([[1, 6, 2]])
    valid = torch.tensor([[True, True, False]])
    labels, label_mask = block_labels(ids, loss, anchors, valid, block_size=3)
    assert labels.shape == (1, 3, 3)
    # block at 1: k=0 never; k=1 -> 12 (supervised); k=2 -> 13 (loss mask 0): dropped
    assert labels[0, 0].tolist() == [IGNORE_INDEX, 12, IGNORE_INDEX]
    assert label_mask[0, 0].tolist() == [False, True, False]
    # block at 6 runs past the sequence: 7 -> 17 kept, 8 does not exist
    assert labels[0, 1].tolist() == [IGNORE_INDEX, 17, IGNORE_INDEX]
    assert label_mask[0, 1].tolist() == [False, True, False]
    # invalid block: nothing
    assert not label_mask[0, 2].any()
    assert (labels[0, 2] == IGNORE_INDEX).all()


def test_shifted_labels_predict_the_next_token_at_every_position_position_0_included() -> None:
    """The worked example of docs/dflash.md "Label alignment": tokens t0..t7 = 10..17, block
    size 4, anchor 2. Plain DFlash (shift 0): positions 1, 2, 3 predict t3, t4, t5 and position
    0 (the anchor t2) nothing. A Domino/DSpark head with shift_label (shift 1): positions 0, 1,
    2, 3 predict t3, t4, t5, t6, and a head conditions position k on t2 .. t(2 + k)."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    loss = torch.ones(1, 8, dtype=torch.long)
    anchors, valid = torch.tensor([[2]]), torch.tensor([[True]])
    plain, plain_mask = block_labels(ids, loss, anchors, valid, block_size=4)
    assert plain[0, 0].tolist() == [IGNORE_INDEX, 13, 14, 15]
    assert plain_mask[0, 0].tolist() == [False, True, True, True]
    shifted, shifted_mask = block_labels(ids, loss, anchors, valid, block_size=4, shift=1)
    assert shifted[0, 0].tolist() == [13, 14, 15, 16]
    assert shifted_mask[0, 0].tolist() == [True, True, True, True]
    # What each position's head conditions on: the token just before its target.
    assert previous_tokens(ids, anchors, 4, shift=1)[0, 0].tolist() == [12, 13, 14, 15]
    assert previous_tokens(ids, anchors, 4, shift=0)[0, 0].tolist()[1:] == [12, 13, 14]
    # The loss mask and the sequence end apply to the shifted target: anchor 5 reaches t8.
    loss[0, 7] = 0
    late, late_mask = block_labels(ids, loss, torch.tensor([[4]]), valid, block_size=4, shift=1)
    assert late[0, 0].tolist() == [15, 16, IGNORE_INDEX, IGNORE_INDEX]
    assert late_mask[0, 0].tolist() == [True, True, False, False]


def test_shifted_teacher_logits_for_position_k_come_from_anchor_plus_k() -> None:
    seq_len, vocab = 9, 3
    target_logits = (
        torch.arange(seq_len, dtype=torch.float32).view(1, seq_len, 1).expand(1, seq_len, vocab)
    )
    gathered = gather_teacher_logits(target_logits, torch.tensor([[2]]), block_size=4, shift=1)
    # the target's distribution for the token at anchor + k + 1 sits at anchor + k
    assert gathered[0, 0, :, 0].tolist() == [2, 3, 4, 5]


def test_teacher_logits_for_position_k_come_from_anchor_plus_k_minus_1() -> None:
    seq_len, vocab = 9, 5
    # logits[b, t, :] = 100*b + t, so every gathered row says where it came from
    base = torch.arange(seq_len, dtype=torch.float32).view(1, seq_len, 1) + torch.tensor(
        [0.0, 100.0]
    ).view(2, 1, 1)
    target_logits = base.expand(2, seq_len, vocab).contiguous()
    anchors = torch.tensor([[2, 5], [0, 6]])
    gathered = gather_teacher_logits(target_logits, anchors, block_size=4)
    assert gathered.shape == (2, 2, 4, vocab)
    sources = gathered[..., 0]
    # k reads anchor + k - 1 (k = 0, never supervised, is clamped at the sequence start)
    assert sources[0].tolist() == [[1, 2, 3, 4], [4, 5, 6, 7]]
    assert sources[1].tolist() == [[100, 100, 101, 102], [105, 106, 107, 108]]
    # past the end of the sequence the last row is repeated (label_mask drops those positions)
    late = gather_teacher_logits(target_logits, torch.tensor([[7], [7]]), block_size=4)
    assert late[0, 0, :, 0].tolist() == [6, 7, 8, 8]


_U64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix_output(state: int) -> int:
    """splitmix64's output function on Python integers (the published algorithm)."""
    z = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9 & _U64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _U64
    return z ^ (z >> 31)


def test_counter_keys_are_splitmix64_streams() -> None:
    key = 0xDEADBEEF12345678
    rows = [0, 5, 1_000_003]
    keys = counter_keys(key, torch.tensor(rows), 6)
    assert keys.shape == (3, 6) and keys.dtype == torch.int64
    for r, counter in enumerate(rows):
        seed = _splitmix_output((key + (counter + 1) * _GAMMA) & _U64)
        expected = [_splitmix_output((seed + (j + 1) * _GAMMA) & _U64) for j in range(6)]
        assert [int(k) & _U64 for k in keys[r]] == expected


def test_counter_anchors_of_a_row_depend_only_on_its_counter() -> None:
    loss = torch.ones(3, 40, dtype=torch.long)
    att = torch.ones_like(loss)
    att[1, 25:] = 0  # rows differ in length: the batch pads to the longest count
    together = sample_counter_anchors(
        loss, att, block_size=4, num_anchors=5, key=11, rows=torch.tensor([7, 8, 9])
    )
    for row, counter in enumerate([7, 8, 9]):
        alone = sample_counter_anchors(
            loss[row : row + 1],
            att[row : row + 1],
            block_size=4,
            num_anchors=5,
            key=11,
            rows=torch.tensor([counter]),
        )
        assert torch.equal(together.anchors[row], alone.anchors[0])
        assert torch.equal(together.valid[row], alone.valid[0])
    # Another key or another counter draws other anchors.
    other_key = sample_counter_anchors(
        loss, att, block_size=4, num_anchors=5, key=12, rows=torch.tensor([7, 8, 9])
    )
    assert not torch.equal(other_key.anchors, together.anchors)
    # Same masks in every row: counters 8, 9 moved to rows 0, 1 keep their anchors there.
    full = torch.ones(3, 40, dtype=torch.long)
    first = sample_counter_anchors(
        full, full, block_size=4, num_anchors=5, key=11, rows=torch.tensor([7, 8, 9])
    )
    shifted = sample_counter_anchors(
        full, full, block_size=4, num_anchors=5, key=11, rows=torch.tensor([8, 9, 10])
    )
    assert torch.equal(shifted.anchors[:2], first.anchors[1:])
    assert not torch.equal(shifted.anchors[2], first.anchors[2])


def test_counter_anchors_are_uniform_distinct_and_eligible() -> None:
    rows = 3000
    loss = torch.zeros(rows, 20, dtype=torch.long)
    loss[:, 2:15] = 1
    att = torch.ones(rows, 20, dtype=torch.long)
    batch = sample_counter_anchors(
        loss, att, block_size=2, num_anchors=3, key=2024, rows=torch.arange(rows)
    )
    assert batch.valid.all()
    assert (batch.anchors[:, 1:] > batch.anchors[:, :-1]).all()  # sorted and distinct
    counts = torch.bincount(batch.anchors.flatten(), minlength=20)
    assert counts[:2].sum() == 0 and counts[14:].sum() == 0
    expected = rows * 3 / 12  # 750 per eligible position; binomial sd about 24
    assert ((counts[2:14].float() - expected).abs() < 100).all(), counts.tolist()
