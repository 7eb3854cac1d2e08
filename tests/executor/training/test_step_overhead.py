"""The trainer's per-step pieces that issue 15 made cheaper compute what the slow forms did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.compiling import TINY_SCRATCH
from torch import nn

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.executor.data.train_dataset import Batch
from dflash_recipes.executor.training.anchors import anchor_key, sample_batch_anchors
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.metrics import MetricWindow, log_train_window
from dflash_recipes.executor.training.setup.optimizer import build_optimizer, clip_gradients


def _params(seed: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8,), (4, 4, 3), (32,)]
    params = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 3
    return params


def test_fused_adamw_and_foreach_clipping_equal_the_per_tensor_loop() -> None:
    fast, slow = _params(0), _params(0)
    optimizer = build_optimizer(fast, lr=1e-2, weight_decay=0.1)
    assert optimizer.defaults["fused"] is True  # CPU float32: the fused kernel
    loop = torch.optim.AdamW(slow, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(4):
        gen = torch.Generator().manual_seed(100 + step)
        for a, b in zip(fast, slow, strict=True):
            grad = torch.randn(a.shape, generator=gen) * 3
            a.grad, b.grad = grad.clone(), grad.clone()
        norm = clip_gradients(fast, 1.0)
        reference = torch.nn.utils.clip_grad_norm_(slow, 1.0, foreach=False)
        assert isinstance(norm, torch.Tensor)
        torch.testing.assert_close(norm, reference)
        optimizer.step()
        loop.step()
    for a, b, start in zip(fast, slow, _params(0), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(a, start)  # the steps did move every tensor


def test_parameters_off_cpu_and_cuda_fall_back_to_foreach() -> None:
    meta = [nn.Parameter(torch.zeros(3, device="meta"))]
    optimizer = build_optimizer(meta, lr=1e-3, weight_decay=0.0)
    assert not optimizer.defaults["fused"] and optimizer.defaults["foreach"] is True


def _batch(lengths: list[int], width: int = 24, epoch: int = 0) -> Batch:
    ids = torch.arange(width).repeat(len(lengths), 1)
    attention = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        attention[row, :n] = 1
    return Batch(ids, attention, attention.clone(), epoch=epoch, next_index=len(lengths))


def test_batch_anchors_are_a_function_of_seed_epoch_and_position() -> None:
    batch = _batch([24, 16, 20])
    drawn = sample_batch_anchors(batch, positions=[10, 11, 12], seed=3, block_size=4, num_anchors=5)
    anchors, valid = drawn.anchors, drawn.valid
    assert anchors.shape == valid.shape == (3, 5)
    # The same sequence at the same position of the epoch, in another batch: same anchors.
    alone = _batch([16])
    one = sample_batch_anchors(alone, positions=[11], seed=3, block_size=4, num_anchors=5)
    assert torch.equal(one.anchors[0], anchors[1]) and torch.equal(one.valid[0], valid[1])
    # Another epoch or seed: other anchors.
    moved = sample_batch_anchors(
        _batch([24, 16, 20], epoch=1), positions=[10, 11, 12], seed=3, block_size=4, num_anchors=5
    )
    assert not torch.equal(moved.anchors, anchors)
    assert anchor_key(3, 0) != anchor_key(3, 1) != anchor_key(4, 1)


def test_batch_without_any_anchor_gets_one_padding_block() -> None:
    drawn = sample_batch_anchors(
        _batch([3, 2]), positions=[0, 1], seed=0, block_size=4, num_anchors=5
    )
    assert drawn.anchors.shape == drawn.valid.shape == (2, 1)
    assert not drawn.valid.any()


def test_accuracy_counts_keep_argmax_first_maximum_rule() -> None:
    from dflash_recipes.executor.training.loss import _position_counts

    # Row 0: the label (2) ties the maximum with index 1, which comes first: a miss, as with
    # argmax. Row 1: the label is the unique maximum: a hit. Row 2: not supervised.
    logits = torch.tensor([[[0.0, 5.0, 5.0], [1.0, 0.0, 3.0], [9.0, 0.0, 0.0]]])
    labels = torch.tensor([[2, 2, 0]])
    mask = torch.tensor([[True, True, False]])
    correct, count = _position_counts(logits, labels, mask)
    assert correct.tolist() == [0, 1, 0]
    assert count.tolist() == [1, 1, 0]
    expected = (logits.argmax(dim=-1) == labels) & mask
    assert correct.tolist() == expected.long()[0].tolist()


def _train_rows(
    tmp_path: Path, name: str, logging_steps: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[dict[str, object]], list[float]]:
    """The run's ``train`` rows and, for each, the supervised weight its window summed."""
    weights: list[float] = []
    real = log_train_window

    def spy(window: MetricWindow, **kwargs: Any) -> Any:
        weights.append(window.weight_sum)
        return real(window, **kwargs)

    result = compile_file(
        TINY_SCRATCH,
        overrides=(
            f"training.output_dir={tmp_path / name}",
            "training.max_steps=2",
            "training.per_device_train_batch_size=2",
            "training.training_seq_len=64",
            "training.save_steps=2",
            f"training.logging_steps={logging_steps}",
            "training.eval_steps=null",
            "dflash.dflash_num_anchors=4",
            "dflash.dflash_block_size=4",
        ),
    )
    assert result.plan is not None, result.diagnostics
    with monkeypatch.context() as patched:
        patched.setattr("dflash_recipes.executor.training.fit.log_train_window", spy)
        run_plan(result.plan, progress=False)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["kind"] == "train"], weights


@pytest.mark.usefixtures("one_thread")
def test_metrics_kept_on_device_report_the_whole_logging_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps that log nothing still count: a row covers every step since the last one."""
    each, weights = _train_rows(tmp_path, "each", 1, monkeypatch)
    pooled, pooled_weight = _train_rows(tmp_path, "pooled", 2, monkeypatch)
    assert [r["step"] for r in each] == [1, 2] and [r["step"] for r in pooled] == [2]
    row = pooled[0]
    # Same seed, same data, same anchors: the window covers both steps' supervised weight ...
    assert pooled_weight == [pytest.approx(weights[0] + weights[1], rel=1e-6)]
    # ... and its loss is the two steps' losses weighted by it, as the gradient weighs them
    # (the steps carry different weights, so the plain mean of the two would be a different
    # number) ...
    assert weights[0] != pytest.approx(weights[1], rel=1e-3)
    losses = [float(str(r["loss"])) for r in each]
    expected = (losses[0] * weights[0] + losses[1] * weights[1]) / sum(weights)
    assert row["loss"] == pytest.approx(expected, rel=1e-6)
    # ... and the gradient norm is the last step's.
    assert row["grad_norm"] == pytest.approx(each[1]["grad_norm"], rel=1e-6)
    assert each[0]["grad_norm"] != pytest.approx(each[1]["grad_norm"], rel=1e-6)
