"""Comparing two float computations of the same value: equal up to rounding, whatever the
thread count, the load or the kernel that summed the terms.

Two correct computations of one tensor differ only by rounding: float32 sums taken in another
order (another thread count splits a reduction differently; another kernel tiles a matmul
differently) differ by a few units in the last place of the values summed. A fixed absolute
tolerance such as 1e-6 is about eight float32 ulps at magnitude 1, so a change of thread count
can break it; a bug (a wrong mask, tap or weight) changes values by far more than rounding.
The tolerance here is therefore a number of ulps of the dtype, at the magnitude of the values.
"""

from __future__ import annotations

import torch

#: Units in the last place allowed between two orders of summation: the terms of the tiny
#: models' reductions number in the tens to hundreds, and rounding errors of a sum grow with
#: the square root of the count in practice. A bug moves values by 1e-3 and more.
DEFAULT_ULPS = 256


def rounding_tolerance(
    expected: torch.Tensor, *, ulps: int = DEFAULT_ULPS, dtype: torch.dtype | None = None
) -> float:
    """The largest difference rounding explains: `ulps` machine epsilons of `dtype` (default:
    `expected`'s) at the magnitude of `expected` (its largest absolute value, at least 1)."""
    eps = torch.finfo(dtype or expected.dtype).eps
    magnitude = max(1.0, float(expected.detach().abs().max())) if expected.numel() else 1.0
    return ulps * eps * magnitude


def assert_equal_up_to_rounding(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    ulps: int = DEFAULT_ULPS,
    what: str = "the values",
) -> None:
    """Fail unless `actual` has `expected`'s shape and differs from it by no more than
    :func:`rounding_tolerance`; the message names `what`, the largest difference and the bound."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    bound = rounding_tolerance(expected, ulps=ulps)
    worst = float((actual.detach().double() - expected.detach().double()).abs().max())
    assert worst <= bound, (
        f"{what} differ by up to {worst:.3g}, more than rounding explains ({ulps} ulps of "
        f"{expected.dtype} at this magnitude: {bound:.3g})"
    )
