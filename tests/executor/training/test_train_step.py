"""The training step as a library (issue 53): `run` and a loop of `optimizer_step` calls over the
same plan and batches train the same thing, bit for bit; the docs' example runs as written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor import build_step, optimizer_step, prepare_rows
from dflash_recipes.executor.dist_env import detect_dist_env
from dflash_recipes.executor.model.convert import load_base_model, load_tokenizer
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.setup.train_data import build_train_data
from dflash_recipes.plan.run_plan import RunPlan

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs" / "dflash.md"
STEPS = 3

pytestmark = pytest.mark.usefixtures("one_thread")


def _plan(output: Path, *overrides: str) -> RunPlan:
    return tiny_scratch_plan(
        output,
        f"training.max_steps={STEPS}",
        f"training.save_steps={STEPS}",
        "training.eval_steps=0",
        *overrides,
    )


def _run_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [float(r["loss"]) for r in rows if r["kind"] == "train"]


@pytest.mark.parametrize(
    "overrides",
    [(), ("training.gradient_accumulation_steps=2",), ("data.packing=true",)],
    ids=["one-micro-batch", "accumulation", "packed"],
)
def test_a_loop_of_optimizer_steps_trains_what_run_trains(
    tmp_path: Path, overrides: tuple[str, ...]
) -> None:
    plan = _plan(tmp_path / "run", *overrides)
    run_plan(plan, progress=False)

    own = _plan(tmp_path / "own", *overrides)
    env = detect_dist_env(own.training.device)
    data = build_train_data(own, load_tokenizer(own), env, verify_capture=False)
    try:
        step = build_step(own, env=env, batches_per_epoch=data.batches_per_epoch)
        stream = data.stream(0, 0)
        losses = []
        for index in range(STEPS):
            batches = []
            for _ in range(step.micro_batches):
                batch = next(stream)
                batches.append(
                    prepare_rows(
                        step,
                        batch.input_ids,
                        batch.loss_mask,
                        attention_mask=batch.attention_mask,
                        document_ids=batch.document_ids,
                        epoch=batch.epoch,
                        next_index=batch.next_index,
                    )
                )
            losses.append(float(optimizer_step(step, batches, index=index).loss))
    finally:
        data.close()
    assert losses == _run_losses(tmp_path / "run")
    export_drafter(step.models.drafter, own, tmp_path / "own" / "export")
    ours = load_file(str(tmp_path / "own" / "export" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "run" / "export" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_build_step_takes_a_target_in_memory_and_touches_no_file(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "never-written")
    target = load_base_model(plan)
    step = build_step(plan, target=target)
    assert step.models.target is target  # the drafter attached to the given model
    rows = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25]]
    masks = [[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]
    prepared = prepare_rows(step, rows, masks, pad_token_id=0)
    assert prepared.batch.attention_mask.tolist()[1] == [1] * 6 + [0] * 4
    before = [p.detach().clone() for p in step.models.trainable]
    out = optimizer_step(step, [prepared], index=0)
    assert torch.isfinite(out.grad_norm) and len(out.micro) == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, step.models.trainable, strict=True))
    assert not (tmp_path / "never-written").exists()


def test_optimizer_step_takes_exactly_its_micro_batches(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "run", "training.gradient_accumulation_steps=2")
    step = build_step(plan)
    prepared = prepare_rows(step, [[5, 6, 7, 8, 9, 10, 11, 12]], [[0, 1, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="takes 2 micro-batch\\(es\\) per step, got 1"):
        optimizer_step(step, [prepared], index=0)
    with pytest.raises(ValueError, match="takes 2 micro-batch\\(es\\) per step, got more"):
        optimizer_step(step, [prepared] * 3, index=0)


def _docs_example() -> str:
    text = DOCS.read_text(encoding="utf-8")
    section = text.index("## Driving the step yourself")
    start = text.index("```python\n", section) + len("```python\n")
    return text[start : text.index("```\n", start)]


def test_the_docs_example_runs_and_type_checks(tmp_path: Path) -> None:
    example = tmp_path / "example.py"
    example.write_text(_docs_example(), encoding="utf-8")
    assert len(_docs_example().splitlines()) <= 26  # the short example the docs promise
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ran = subprocess.run(
        [sys.executable, str(example)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1", "step 2"]
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in lines]
    assert losses[-1] < losses[0]  # it trains
    # Incremental, in the repo's cache: .ci/run's `mypy --strict dflash_recipes` (run before the
    # tests) leaves the package's modules checked, so only the example is (seconds, not a minute).
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(example)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout
