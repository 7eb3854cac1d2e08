"""The step module on several ranks: DDP, or the drafter sharded with FSDP2 (issue 51)."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from dflash_recipes.executor.training.setup.models import Models


class _ShardedStep(nn.Module):
    """Records FSDP2's gradient-sync switch, as a ``fully_shard``-ed step would take it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bool] = []

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self.calls.append(requires)

    def no_sync(self) -> Any:
        raise AssertionError("a sharded step has no DDP no_sync")


def _models(step: nn.Module, *, sharded: bool, distributed: bool = True) -> Models:
    return Models(
        target=None,  # type: ignore[arg-type]
        drafter=None,  # type: ignore[arg-type]
        step=step,
        trainable=[],
        warm=None,
        distributed=distributed,
        sharded=sharded,
    )


def test_a_sharded_step_skips_the_reduction_before_the_last_micro_batch() -> None:
    step = _ShardedStep()
    models = _models(step, sharded=True)
    with models.gradient_sync(last_micro_batch=False):
        assert step.calls == [False]  # the micro-batch's backward keeps its gradients whole
    assert step.calls == [False, True]  # and the next one reduces again
    with models.gradient_sync(last_micro_batch=True):
        pass
    assert step.calls == [False, True]


def test_the_switch_is_restored_when_the_micro_batch_fails() -> None:
    step = _ShardedStep()
    with (
        pytest.raises(RuntimeError),
        _models(step, sharded=True).gradient_sync(last_micro_batch=False),
    ):
        raise RuntimeError("backward failed")
    assert step.calls == [False, True]


def test_a_sharded_step_is_not_wrapped_in_ddp() -> None:
    step = _ShardedStep()
    models = _models(step, sharded=True)
    models.wrap_for_ranks(None)  # type: ignore[arg-type]  (DDP would need the process group)
    assert models.step is step
