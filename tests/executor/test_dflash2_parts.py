"""DFlash 2's convolution and selector against references written from the formulas."""

from __future__ import annotations

import torch

from dflash_recipes.executor.kinds.dflash2 import GroupedDynamicCausalConv, selector_path


def _reference(x: torch.Tensor, coeff: torch.Tensor, side: int, block: int) -> torch.Tensor:
    b, s, _ = x.shape
    out = torch.zeros_like(x)
    for i in range(b):
        for j in range(s):
            for t in range(coeff.shape[3]):
                if j % block >= t:
                    out[i, j] += coeff[i, j, side, t] * x[i, j - t]
    return out


def test_conv_matches_the_formula_and_never_crosses_a_block() -> None:
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(hidden=8, kernel=3, group_size=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    u = torch.randn(2, 8, 8)
    coeff = conv.coefficients(u)
    for side in (0, 1):
        got = conv.apply_side(u, coeff, side, block_size=4)
        torch.testing.assert_close(got, _reference(u, coeff, side, 4))
    got = conv.apply_side(u, coeff, 0, block_size=4)
    # position 0 of each block sees only itself; position 1 sees the anchor.
    torch.testing.assert_close(got[:, 4], coeff[:, 4, 0, 0] * u[:, 4])
    torch.testing.assert_close(got[:, 5], coeff[:, 5, 0, 0] * u[:, 5] + coeff[:, 5, 0, 1] * u[:, 4])


def test_fresh_conv_is_the_identity() -> None:
    conv = GroupedDynamicCausalConv(hidden=8, kernel=2, group_size=2)
    u = torch.randn(1, 8, 8)
    coeff = conv.coefficients(u)
    assert torch.equal(conv.apply_side(u, coeff, 1, block_size=4), u)


def test_selector_path_follows_edge_scores() -> None:
    torch.manual_seed(1)
    vocab, hid, rank = 6, 4, 3
    unary = torch.randn(2, vocab)
    hidden = torch.randn(2, hid)
    proj, pred, succ = torch.randn(rank, hid), torch.randn(vocab, rank), torch.randn(vocab, rank)
    path = selector_path(unary, hidden, 0, 3, proj, pred, succ)
    prev = 0
    for j in range(2):
        cands = unary[j].topk(3).indices.tolist()
        best = max(
            cands, key=lambda c: float(unary[j, c] + (pred[prev] * (proj @ hidden[j])) @ succ[c])
        )
        assert path[j] == best
        prev = best
    # a zero successor codebook reduces to the unary argmax path (DFlash 1)
    zero = selector_path(unary, hidden, 0, 3, proj, pred, torch.zeros(vocab, rank))
    assert zero == unary.argmax(-1).tolist()
