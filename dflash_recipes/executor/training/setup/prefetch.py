"""Batches prepared off the critical path: step N+1's host work runs while step N trains.

What a micro-step needs from the host (the collated batch, its anchors, on CPU the split block
mask, offline the captured target states read from the capture's shards in their stored dtype,
the facts a step would otherwise read back from the device) is a pure function of the
batch: :func:`prepare_batch` computes it, and :class:`Prefetch` runs the stream of batches and
that preparation on a background thread, ``depth`` batches ahead of the loop. On CUDA the
tensors are pinned there, so the loop's copies to the device are ``non_blocking``.

A thread rather than a ``torch.utils.data.DataLoader`` with worker processes: the examples are
read in place from the tokenize cache (memory-mapped; a worker would pickle or reopen them),
the work per batch is a few vectorised torch ops that release the GIL (collate, splitmix64
keys, a top-k, the mask), one batch ahead is all a step needs, and the stream's order and its
data position (what a checkpoint saves for an exact resume) stay those of one generator
consumed in order: the loop still takes each batch's position from the batch it trains on.
The host ops that read a tensor's value (the anchors' count, the mask's chunk bounds) run on
the thread, so the loop itself reads nothing back from the device between logging steps.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

import attrs
import torch

from dflash_recipes.executor.data.train_dataset import Batch
from dflash_recipes.executor.dist_env import DistEnv
from dflash_recipes.executor.model.convert import CapturedStates
from dflash_recipes.executor.model.masks import build_split_block_mask
from dflash_recipes.executor.training.anchors import (
    AnchorBatch,
    batch_positions,
    sample_batch_anchors,
)
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.records import Record

T = TypeVar("T")

#: How many prepared batches wait ahead of the loop (the one being prepared not counted).
PREFETCH_DEPTH = 2
#: How long :meth:`Prefetch.close` waits for the thread to finish the batch it is preparing.
_JOIN_SECONDS = 60.0


@attrs.frozen(eq=False)
class PreparedBatch:
    """One micro-batch as the loop consumes it: everything host-side already done."""

    #: The collated batch on the host (pinned when training on CUDA).
    batch: Batch
    #: Its anchors (:func:`~dflash_recipes.executor.training.anchors.sample_batch_anchors`).
    drawn: AnchorBatch
    #: The split block mask when training on CPU; None elsewhere (the step builds the flex
    #: mask on the device).
    mask: object | None
    #: Offline: the batch's captured target states in host memory (pinned on CUDA), read on
    #: the prefetch thread; None online.
    captured: CapturedStates | None = None

    def to(self, device: torch.device) -> tuple[Batch, AnchorBatch]:
        """The batch and anchors on `device`: ``non_blocking`` copies (asynchronous from
        pinned memory, a no-op on CPU)."""
        return self.batch.to(device, non_blocking=True), self.drawn.to(device, non_blocking=True)

    def captured_on(self, device: torch.device) -> CapturedStates | None:
        """The captured states on `device` (``non_blocking``, as :meth:`to`), or None."""
        if self.captured is None:
            return None
        return self.captured.to(device, non_blocking=True)


def pin_batches(device: torch.device) -> bool:
    """Whether prepared batches are pinned: only for a CUDA device (pinning needs CUDA)."""
    return device.type == "cuda" and torch.cuda.is_available()


def prepare_batch(
    batch: Batch,
    *,
    env: DistEnv,
    seed: int,
    spec: ResolvedDraft,
    num_anchors: int,
    states: Callable[[Batch], CapturedStates | None] | None = None,
) -> PreparedBatch:
    """The host work of one micro-batch: its anchors, the CPU block mask, the captured states
    offline (`states`: what reads them, e.g. ``TrainData.captured_states``), pinned memory."""
    drawn = sample_batch_anchors(
        batch,
        positions=batch_positions(batch, env),
        seed=seed,
        block_size=spec.block_size,
        num_anchors=num_anchors,
    )
    mask: object | None = None
    if env.device.type == "cpu":
        # The split form is the CPU path of step_inputs; built here from the host anchors.
        ctx_len = int(batch.input_ids.shape[1])
        mask = build_split_block_mask(
            drawn.anchors,
            spec.block_size,
            ctx_len,
            drawn.valid,
            heads=spec.num_attention_heads,
            document_ids=batch.document_ids,
        )
    captured = None if states is None else states(batch)
    if pin_batches(env.device):
        batch = batch.pin_memory()
        drawn = AnchorBatch(anchors=drawn.anchors.pin_memory(), valid=drawn.valid.pin_memory())
        captured = None if captured is None else captured.pin_memory()
    return PreparedBatch(batch=batch, drawn=drawn, mask=mask, captured=captured)


@attrs.frozen(repr=False, eq=False, slots=False)
class _Failed(Record):
    error: BaseException


_DONE = object()


class Prefetch(Generic[T]):
    """Iterate `source` on a background thread, at most `depth` items ahead of the consumer.

    Items come out in `source`'s order; an exception `source` raises is raised again by the
    ``next()`` that would have returned the item. With `background` False the items are
    produced on the caller's thread, when asked for (the synchronous baseline the benchmark
    compares with). Use it as a context manager: leaving stops the thread.
    """

    def __init__(
        self, source: Iterator[T], *, depth: int = PREFETCH_DEPTH, background: bool = True
    ):
        self._source = source
        self._closed = threading.Event()
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, depth))
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._produce, name="dflash-prefetch", daemon=True
            )
            self._thread.start()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._thread is None:
            return next(self._source)
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)  # every later next() ends too
            raise StopIteration
        if isinstance(item, _Failed):
            raise item.error
        return item  # type: ignore[return-value]

    def _produce(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    return
            self._put(_DONE)
        except BaseException as exc:  # the consumer raises it
            self._put(_Failed(exc))

    def _put(self, item: object) -> bool:
        """Queue `item` unless the consumer has gone; False when closed."""
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop the thread (it finishes the item it is preparing, then exits)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=_JOIN_SECONDS)

    def __enter__(self) -> Prefetch[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


__all__ = ["PREFETCH_DEPTH", "Prefetch", "PreparedBatch", "pin_batches", "prepare_batch"]
