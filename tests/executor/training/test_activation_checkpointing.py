"""``training.activation_checkpointing``: each draft layer is recomputed in the backward
(non-reentrant ``torch.utils.checkpoint``) and training computes exactly the same (issue 51)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from testkit.compiling import tiny_scratch_plan

import dflash_recipes.executor.model.draft as draft_module
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.files.run_dir import complete_checkpoints
from executor.training.test_no_host_sync import _count_syncs

pytestmark = pytest.mark.usefixtures("one_thread")


def _train(tmp_path: Path, name: str, *extra: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    out = tmp_path / name
    plan = tiny_scratch_plan(out, "training.max_steps=3", "training.eval_steps=null", *extra)
    run_plan(plan, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (_, last), *_ = reversed(complete_checkpoints(out))
    return [r for r in rows if r["kind"] == "train"], load_file(str(last / "model.safetensors"))


def test_checkpointed_layers_train_bit_for_bit_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []
    checkpoint = draft_module.checkpoint

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("use_reentrant"))
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(draft_module, "checkpoint", counted)
    plain_rows, plain = _train(tmp_path, "plain")
    assert calls == []
    rows, weights = _train(tmp_path, "recomputed", "training.activation_checkpointing=true")
    layers = len({name.split(".")[1] for name in weights if name.startswith("layers.")})
    # every layer of every micro-step, non-reentrant
    assert len(calls) == 3 * layers and set(calls) == {False}
    for key in ("loss", "grad_norm", "accuracy_by_position"):
        assert [r[key] for r in rows] == [r[key] for r in plain_rows], key
    assert weights.keys() == plain.keys()
    assert all(torch.equal(weights[name], plain[name]) for name in plain)


def test_checkpointed_layers_read_nothing_back_between_logging_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = _count_syncs(monkeypatch, tmp_path / "run", "training.activation_checkpointing=true")
    assert counter.between == [], "\n".join(counter.between)
    assert counter.at_logging > 0
