"""The training loop reads nothing back from the device between logging steps (issue 34).

A ``TorchDispatchMode`` on the loop's thread counts every op that makes the host wait for the
device (``aten::_local_scalar_dense``: ``.item()``, ``float()``, ``int()``, ``bool()`` of a
tensor) and every ``Tensor.tolist()`` / ``Tensor.numpy()`` (which read memory without
dispatching), across several optimiser steps of the real trainer. Dispatch modes are per
thread: what the prefetch thread does on the host (anchor counts, the split mask's bounds) is
off the critical path by construction and not counted.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.compiling import tiny_scratch_plan
from testkit.dflash2_fixtures import TINY_DFLASH2_OVERRIDES
from torch.utils._python_dispatch import TorchDispatchMode

import dflash_recipes.executor.training.fit as fit_module
from dflash_recipes.executor.training.metrics import MetricWindow
from dflash_recipes.executor.training.setup.prefetch import Prefetch

pytestmark = pytest.mark.usefixtures("one_thread")

#: The ops that copy a device value to the host and wait for it.
SYNCING = {torch.ops.aten._local_scalar_dense.default}
#: Nothing is excused: the target (the demo's Qwen3, whose config declares its layer types)
#: gets its causal masks built without a host read-back (target_states.causal_attention).
EXCUSED: tuple[str, ...] = ()


class SyncCounter(TorchDispatchMode):
    """Records where each syncing op ran while `counting` is on (this thread only)."""

    def __init__(self) -> None:
        super().__init__()
        #: True inside fit (the mode is entered there), False after the first logging step.
        self.active = False
        self.counting = True
        self.between: list[str] = []
        self.at_logging = 0
        self.excused = 0

    def record(self, what: str) -> None:
        if not self.active:
            return
        stack = traceback.format_stack()[:-2]
        if any(part in "".join(stack) for part in EXCUSED):
            self.excused += 1
        elif self.counting:
            self.between.append(f"{what}\n" + "".join(stack[-6:]))
        else:
            self.at_logging += 1

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in SYNCING:
            self.record(str(func))
        return func(*args, **(kwargs or {}))


def _reading(counter: SyncCounter, loop_thread: threading.Thread, name: str) -> Callable[..., Any]:
    original = getattr(torch.Tensor, name)

    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is loop_thread:
            counter.record(f"Tensor.{name}")
        return original(self, *args, **kwargs)

    return read


def _count_syncs(monkeypatch: pytest.MonkeyPatch, plan_dir: Path, *extra: str) -> SyncCounter:
    """Train the tiny plan (4 optimiser steps of 2 micro-batches, one logging step at the end)
    and count the syncs of the loop's thread before and at the logging step."""
    plan = tiny_scratch_plan(
        plan_dir,
        "training.max_steps=4",
        "training.logging_steps=4",
        "training.gradient_accumulation_steps=2",
        "training.eval_steps=null",
        *extra,
    )
    counter = SyncCounter()
    for name in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, _reading(counter, threading.current_thread(), name))
    fit, log_window = fit_module.fit, fit_module._log_window

    def counted_fit(*args: Any, **kwargs: Any) -> Any:
        counter.active = True
        try:
            with counter:
                return fit(*args, **kwargs)
        finally:
            counter.active = False

    def logging_step(*args: Any, **kwargs: Any) -> None:
        counter.counting = False  # the window's one read, and everything after the last step
        log_window(*args, **kwargs)

    monkeypatch.setattr(fit_module, "fit", counted_fit)
    monkeypatch.setattr(fit_module, "_log_window", logging_step)
    fit_module.run_plan(plan, progress=False)
    return counter


def test_no_host_sync_between_logging_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = _count_syncs(monkeypatch, tmp_path / "run")
    assert counter.between == [], "\n".join(counter.between)
    assert counter.at_logging > 0  # the counter does see the logging step's reads


def test_a_dflash2_drafter_trains_without_a_host_sync_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DFlash 2's objective (unary top-K, selector loss, its per-position hits) and its
    convolutions read nothing back between logging steps, in chunks too."""
    original = fit_module.setup

    def small_chunks(plan: Any, env: Any, max_chunk_logits: int | None, **kwargs: Any) -> Any:
        return original(plan, env, 3000, **kwargs)

    monkeypatch.setattr(fit_module, "setup", small_chunks)
    counter = _count_syncs(
        monkeypatch,
        tmp_path / "run",
        *TINY_DFLASH2_OVERRIDES,
        "dflash.dflash_selector_missing_gold=inject",
    )
    assert counter.between == [], "\n".join(counter.between)
    assert counter.at_logging > 0


def test_chunked_loss_makes_no_host_sync_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunked lm_head/loss (activation checkpointing, combine_losses) adds no sync."""
    original = fit_module.setup

    def small_chunks(plan: Any, env: Any, max_chunk_logits: int | None, **kwargs: Any) -> Any:
        return original(plan, env, 3000, **kwargs)

    monkeypatch.setattr(fit_module, "setup", small_chunks)
    counter = _count_syncs(monkeypatch, tmp_path / "run")
    assert counter.between == [], "\n".join(counter.between)


def test_the_counter_sees_a_read_added_to_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss read back every micro-step (what the window exists to avoid) is caught."""
    add = MetricWindow.add

    def reading_add(self: MetricWindow, out: Any, tokens: torch.Tensor) -> None:
        _ = float(out.loss.detach())
        add(self, out, tokens)

    monkeypatch.setattr(MetricWindow, "add", reading_add)
    counter = _count_syncs(monkeypatch, tmp_path / "run")
    assert len(counter.between) == 8  # 4 steps x 2 micro-batches


def test_the_counter_sees_batches_prepared_on_the_loop_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the prefetch thread the anchors' count is read on the loop's thread."""
    original = Prefetch.__init__

    def synchronous(self: Prefetch[Any], source: Iterator[Any], **kwargs: Any) -> None:
        original(self, source, **{**kwargs, "background": False})

    monkeypatch.setattr(Prefetch, "__init__", synchronous)
    counter = _count_syncs(monkeypatch, tmp_path / "run")
    assert any("anchors.py" in hit for hit in counter.between), counter.between


def test_offline_training_reads_its_states_off_the_loop_thread_without_a_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline (``data.hidden_states_path``), the captured states are read, padded and pinned on
    the prefetch thread: the loop only moves them to the device (issue 49)."""
    from dflash_recipes.executor.data.capture import capture_plan
    from dflash_recipes.executor.training.setup.train_data import TrainData

    capture = tmp_path / "capture"
    source = tiny_scratch_plan(tmp_path / "capture-run", "training.eval_steps=null")
    assert capture_plan(source, capture, progress=False).complete
    readers: list[threading.Thread] = []
    read = TrainData.captured_states

    def recorded(self: TrainData, batch: Any) -> Any:
        readers.append(threading.current_thread())
        return read(self, batch)

    monkeypatch.setattr(TrainData, "captured_states", recorded)
    counter = _count_syncs(monkeypatch, tmp_path / "run", f"data.hidden_states_path={capture}")
    assert counter.between == [], "\n".join(counter.between)
    assert readers and threading.main_thread() not in readers  # the prefetch thread's work


def test_packed_rows_make_no_host_sync_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed rows: the target's per-document masks are built by transformers' mask functions
    with a document mask and no positions, so nothing is read back (issue 49)."""
    counter = _count_syncs(
        monkeypatch, tmp_path / "run", "data.packing=true", "training.training_seq_len=160"
    )
    assert counter.between == [], "\n".join(counter.between)
    assert counter.at_logging > 0
