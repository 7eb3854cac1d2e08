"""DFlash 2's torch parts (issue 37, partial; not yet a registered kind).

:class:`GroupedDynamicCausalConv`: the convolution on both sides of a sublayer. From the
normed input u one projection gives per-position coefficient offsets delta[side, tap, group];
side 0 filters u before the sublayer, side 1 filters the sublayer output o. Taps run over
block positions only: a tap t reaching before the block start (``pos % block < t``) reads zero.
Initialised as the identity (tap 0 weight 1, projection 0), so a DFlash 1 backbone computes
what it computed before.

:func:`selector_path`: the candidate selector's greedy single path over the unary top-K.
"""

from __future__ import annotations

import torch
from torch import nn


class GroupedDynamicCausalConv(nn.Module):
    """The grouped dynamic causal convolution (module doc)."""

    def __init__(self, hidden: int, kernel: int, group_size: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.group_size = group_size
        self.groups = hidden // group_size
        base = torch.zeros(2, kernel, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def coefficients(self, u: torch.Tensor) -> torch.Tensor:
        """[batch, seq, 2, K, H] coefficients from the normed input u [batch, seq, H]."""
        b, s, _ = u.shape
        delta = self.kernel_projection(u).view(b, s, 2, self.kernel, self.groups)
        delta = delta.repeat_interleave(self.group_size, dim=-1)
        out: torch.Tensor = self.base_kernel.to(u.dtype) + delta
        return out

    def apply_side(
        self, x: torch.Tensor, coeff: torch.Tensor, side: int, block_size: int
    ) -> torch.Tensor:
        """Filter x [batch, seq, H] (seq a whole number of blocks) with side `side`."""
        pos = torch.arange(x.shape[1], device=x.device) % block_size
        out = coeff[:, :, side, 0] * x
        for t in range(1, self.kernel):
            shifted = torch.nn.functional.pad(x, (0, 0, t, 0))[:, : x.shape[1]]
            keep = (pos >= t).to(x.dtype).view(1, -1, 1)
            out = out + coeff[:, :, side, t] * shifted * keep
        return out


def selector_path(
    unary: torch.Tensor,
    hidden: torch.Tensor,
    anchor: int,
    top_k: int,
    projection: torch.Tensor,
    predecessor: torch.Tensor,
    successor: torch.Tensor,
) -> list[int]:
    """The greedy path over slots 1..B-1 of one block.

    unary [B-1, V] (already scaled/softcapped), hidden [B-1, H], projection [r, H],
    codebooks [V, r]. Edge score S_j(p -> c) = U_j(c) + <A[p] * (W h_j), B[c]>.
    """
    path: list[int] = []
    prev = anchor
    for j in range(unary.shape[0]):
        scores, cands = unary[j].float().topk(top_k)
        query = predecessor[prev].float() * (projection.float() @ hidden[j].float())
        edge = scores + successor[cands].float() @ query
        prev = int(cands[int(edge.argmax())])
        path.append(prev)
    return path
