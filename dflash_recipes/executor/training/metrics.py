"""Training metrics: the window of steps between two logging steps, and its ``train`` row.

:class:`MetricWindow` accumulates a window's loss, per-position accuracy counts and tokens on
the step's device; :func:`log_train_window` reduces it over the ranks, assembles the window's
one ``train`` row (:func:`~dflash_recipes.files.metrics_rows.train_row`) and sends it to the
run's trackers (metrics.jsonl first, :mod:`.trackers`); :func:`progress_line` is the console's
line of that row, built from the row alone. :func:`row_number` reads a figure back from a row
(null as NaN).

The window's clock counts the optimiser steps only: the loop pauses it around evaluation and
checkpoints (:meth:`MetricWindow.paused`), so ``tokens_per_second`` is training throughput.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from dflash_recipes.executor.collectives import all_reduce_sum
from dflash_recipes.executor.dist_env import DistEnv, is_main
from dflash_recipes.executor.training.loss import (
    LossOutput,
    estimated_acceptance_length,
    per_position_accuracy,
)
from dflash_recipes.executor.training.trackers.fanout import TrackerSet
from dflash_recipes.files.metrics_rows import KEY_ACCEPTANCE_LENGTH_ESTIMATE, MetricsRow, train_row

logger = logging.getLogger("dflash_recipes.train")


class MetricWindow:
    """Accumulates loss and per-position counts between logging steps.

    Everything stays a tensor on the step's device until :meth:`settle` (called only at a
    logging step), so a step that logs nothing makes no host sync and no host copy.
    """

    def __init__(
        self, block_size: int, *, shift: int = 0, clock: Callable[[], float] | None = None
    ) -> None:
        self.block_size = block_size
        #: 1 when position 0 drafts too (a head with shift_label), else 0 (module doc).
        self.shift = shift
        self._clock = clock or time.perf_counter
        self.reset()

    def reset(self) -> None:
        self.micro = 0
        self._loss: Tensor | None = None
        self._weight: Tensor | None = None
        self._correct: Tensor | None = None
        self._count: Tensor | None = None
        self._tokens: Tensor | None = None
        self._grad_norm: Tensor | None = None
        self._skipped: Tensor | None = None
        self._named: dict[str, Tensor] = {}
        self.loss_sum = 0.0
        #: The supervised weight the window's losses were weighted by (loss_sum / weight_sum
        #: is its loss).
        self.weight_sum = 0.0
        self.correct = torch.zeros(self.block_size, dtype=torch.long)
        self.count = torch.zeros(self.block_size, dtype=torch.long)
        #: Per-position hits of the objective's other choices (``LossOutput.position_correct``:
        #: DFlash 2's ``selector``), over the same supervised positions as :attr:`count`.
        self.named_correct: dict[str, Tensor] = {}
        self.tokens = 0
        self.grad_norm: float | None = None
        #: Steps of the window skipped for a NaN or Inf gradient norm (:mod:`.nonfinite`).
        self.skipped_steps = 0
        self.started = self._clock()
        self._paused_seconds = 0.0

    def elapsed(self) -> float:
        """Seconds since the window started, less the time it was paused."""
        return self._clock() - self.started - self._paused_seconds

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is not the window's (evaluation, checkpoints)."""
        began = self._clock()
        try:
            yield
        finally:
            self._paused_seconds += self._clock() - began

    def add_grad_norm(self, norm: Tensor) -> None:
        self._grad_norm = norm.detach()

    def add_skipped(self, count: Tensor) -> None:
        """Steps skipped for a non-finite gradient norm (a device tensor)."""
        self._skipped = _accumulate(self._skipped, count)

    def add(self, out: LossOutput, tokens: Tensor) -> None:
        self.micro += 1
        # weighted by its supervised weight, as the gradient is (accumulation, ranks): the
        # window's loss is the weighted mean over every supervised position it trained on
        weight = out.weight_sum.detach().float()
        self._loss = _accumulate(self._loss, out.loss.detach().float() * weight)
        self._weight = _accumulate(self._weight, weight)
        self._correct = _accumulate(self._correct, out.per_position_correct.detach())
        self._count = _accumulate(self._count, out.per_position_count.detach())
        self._tokens = _accumulate(self._tokens, tokens)
        for name, hits in out.position_correct.items():
            self._named[name] = _accumulate(self._named.get(name), hits.detach())

    def add_step(self, micro: Sequence[tuple[LossOutput, Tensor]], grad_norm: Tensor) -> None:
        """One optimiser step: its micro-batches' loss outputs and token counts, and its
        gradient norm."""
        for out, tokens in micro:
            self.add(out, tokens)
        self.add_grad_norm(grad_norm)

    def settle(self) -> None:
        """Bring the accumulated tensors to Python numbers (the one host sync of a window)."""
        if self._loss is not None and self._weight is not None:
            self.loss_sum = float(self._loss)
            self.weight_sum = float(self._weight)
        if self._correct is not None and self._count is not None:
            self.correct = self._correct.cpu().long()
            self.count = self._count.cpu().long()
        self.named_correct = {name: hits.cpu().long() for name, hits in self._named.items()}
        if self._tokens is not None:
            self.tokens = int(self._tokens)
        if self._grad_norm is not None:
            self.grad_norm = float(self._grad_norm)
        if self._skipped is not None:
            self.skipped_steps = int(self._skipped)


def _accumulate(total: Tensor | None, value: Tensor) -> Tensor:
    return value.clone() if total is None else total.add_(value)


def log_train_window(
    window: MetricWindow, *, step: int, lr: float, trackers: TrackerSet, env: DistEnv
) -> MetricsRow:
    """Reduce a settled window over the ranks into its ``train`` row; rank 0 sends the row to
    `trackers` (metrics.jsonl first) and logs one line. Returns the row (every rank gets the
    same numbers)."""
    correct = all_reduce_sum(window.correct.to(env.device).float(), env).cpu()
    count = all_reduce_sum(window.count.to(env.device).float(), env).cpu()
    tokens = float(all_reduce_sum(torch.tensor(float(window.tokens), device=env.device), env))
    # the weighted mean over every supervised position of every micro-batch on every rank
    weighted = torch.tensor([window.loss_sum, window.weight_sum], device=env.device)
    loss_sum, weight_sum = (float(v) for v in all_reduce_sum(weighted, env).cpu())
    loss_mean = loss_sum / weight_sum if weight_sum > 0 else 0.0
    acc = per_position_accuracy(correct.long(), count.long())
    first = 1 - window.shift  # the first drafting position (0 with the label shift)
    tau = estimated_acceptance_length(acc, shift=window.shift)
    tokens_per_second = tokens / max(1e-9, window.elapsed())
    selector: list[float | None] | None = None
    hits = window.named_correct.get("selector")
    if hits is not None:  # DFlash 2's selector (LossOutput.position_correct)
        reduced = all_reduce_sum(hits.to(env.device).float(), env).cpu()
        rates = per_position_accuracy(reduced.long(), count.long())
        selector = [None if k < first else a for k, a in enumerate(rates)]
    row = train_row(
        step=step,
        loss=loss_mean,
        lr=lr,
        # Without the label shift position 0 (the anchor) carries no loss: null, not a 0.0
        # accuracy.
        accuracy_by_position=[None if k < first else a for k, a in enumerate(acc)],
        acceptance_length_estimate=tau,
        tokens_per_second=tokens_per_second,
        grad_norm=window.grad_norm,
        selector_accuracy_by_position=selector,
        skipped_steps=window.skipped_steps,
    )
    if is_main(env):
        trackers.log_row(row)
        logger.info("%s", progress_line(row))
    return row


def progress_line(row: Mapping[str, object]) -> str:
    """The console line of a ``train`` row, e.g. ``step 10 loss 4.8900 lr 0.00162 acc[1..] 0.41
    0.22 0.10 train-batch tau~1.75 tok/s 5120``.

    ``acc[k..]`` lists the accuracy of each drafting position from the first one (1, or 0 for
    a head with the label shift: the row's leading nulls are the positions that draft
    nothing); a DFlash 2 row adds ``selector[1..]``, its selector's accuracy. ``train-batch
    tau~`` is the estimate from this window's training batches, not acceptance measured by
    drafting on held-out prompts (the ``eval`` rows).
    """
    raw = row.get("accuracy_by_position")
    accs = list(raw) if isinstance(raw, (list, tuple)) else []
    first = 0
    while first < len(accs) and accs[first] is None:
        first += 1
    shown = " ".join(_figure(a, ".2f") for a in accs[first:])
    raw_selector = row.get("selector_accuracy_by_position")
    selector = ""
    if isinstance(raw_selector, (list, tuple)):
        picked = " ".join(_figure(a, ".2f") for a in list(raw_selector)[first:])
        selector = f"selector[{first}..] {picked} "
    skipped = row.get("skipped_steps")
    skips = (
        f" skipped {skipped} (NaN/Inf grad norm)" if isinstance(skipped, int) and skipped else ""
    )
    return (
        f"step {row.get('step')} loss {_figure(row.get('loss'), '.4f')} "
        f"lr {_figure(row.get('lr'), '.3g')} acc[{first}..] {shown} {selector}"
        f"train-batch tau~{_figure(row.get(KEY_ACCEPTANCE_LENGTH_ESTIMATE), '.2f')} "
        f"tok/s {_figure(row.get('tokens_per_second'), '.0f')}{skips}"
    )


def _figure(value: object, spec: str) -> str:
    """A number of a row as the line shows it (null as nan)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "nan"
    return format(float(value), spec)


def row_number(row: Mapping[str, object], key: str, default: float = math.nan) -> float:
    """A figure of a metrics row: NaN for null (a non-finite value written), `default` when
    the row lacks `key`."""
    if key not in row:
        return default
    value = row[key]
    return float(value) if isinstance(value, (int, float)) else math.nan


def accuracies(value: object) -> list[float]:
    """Accuracy by position from a metrics row (read back, position 0 is null)."""
    if not isinstance(value, (list, tuple)):
        return []
    return [float(a) if isinstance(a, (int, float)) else 0.0 for a in value]


__all__ = [
    "MetricWindow",
    "accuracies",
    "log_train_window",
    "progress_line",
    "row_number",
]
