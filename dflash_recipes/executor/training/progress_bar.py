"""The progress bar of `run`: one tqdm bar on rank 0 in a terminal, nothing anywhere else.

Shown only when asked (``run_plan(progress=True)``, no ``--no-progress``), only on rank 0, and
only when stderr is a terminal (tqdm's ``disable=None``): CI logs and log files get the log
lines alone. Every method is a no-op when the bar is not shown.
"""

from __future__ import annotations

from typing import Protocol


class _Tqdm(Protocol):
    """The part of tqdm the bar uses (for typing)."""

    def update(self, n: int) -> object: ...
    def set_postfix(self, **kwargs: str) -> None: ...
    def close(self) -> None: ...


class ProgressBar:
    """Optimiser steps done out of the run's total, with the last logged loss and tau."""

    def __init__(self, *, total: int, start: int, show: bool) -> None:
        self._bar: _Tqdm | None = None
        if show:
            from tqdm.auto import tqdm

            # disable=None: no bar when stderr is not a terminal (CI logs, files).
            self._bar = tqdm(
                total=total, initial=start, desc="train", unit="step", leave=False, disable=None
            )

    def advance(self) -> None:
        """One more optimiser step done."""
        if self._bar is not None:
            self._bar.update(1)

    def show_figures(self, *, loss: float, tau: float) -> None:
        """The last logged loss and training-batch tau estimate beside the bar."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.3f}", train_batch_tau=f"{tau:.2f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


__all__ = ["ProgressBar"]
