"""A run with `data.eval_holdout` (issue 36): training never sees the held-out conversations,
the held-out measurement drafts on them during training, and `dflash-recipe eval` after the
run measures on the same ones."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import pytest
from testkit.cli_runner import cli
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.data.holdout import plan_held_out_conversations
from dflash_recipes.executor.data.train_dataset import build_dataset
from dflash_recipes.executor.dist_env import detect_dist_env
from dflash_recipes.executor.model.convert import load_tokenizer
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.setup.train_data import build_train_data
from dflash_recipes.files.run_dir import EXPORT_DIR
from dflash_recipes.plan.run_plan import RunPlan


def _unpadded_rows(data_stream: object, count: int) -> set[tuple[int, ...]]:
    rows: set[tuple[int, ...]] = set()
    for _, batch in zip(range(count), data_stream, strict=False):  # type: ignore[call-overload]
        for ids, mask in zip(batch.input_ids.tolist(), batch.attention_mask.tolist(), strict=True):
            rows.add(tuple(i for i, m in zip(ids, mask, strict=True) if m))
    return rows


def _holdout_plan(tmp_path: Path, held: int, *overrides: str) -> RunPlan:
    """The tiny scratch plan training on the demo data less `held` conversations."""
    return tiny_scratch_plan(
        tmp_path / "run",
        "data.eval_data_path=null",
        f"data.eval_holdout={held}",
        *overrides,
        f"data.cache_dir={tmp_path / 'cache'}",
    )


def test_training_batches_never_hold_a_held_out_conversation(tmp_path: Path) -> None:
    plan = _holdout_plan(tmp_path, 6)
    tokenizer = load_tokenizer(plan)
    whole = build_dataset(plan, tokenizer)
    data = build_train_data(plan, tokenizer, detect_dist_env("cpu", {}), verify_capture=False)
    assert len(data.dataset) == len(whole) - 6
    assert len(data.held_out) == 6
    all_rows = {tuple(e.input_ids) for e in whole.examples}
    # two epochs of batches: every training conversation, never a held-out one
    seen = _unpadded_rows(data.stream(0, 0), 2 * data.batches_per_epoch)
    held = all_rows - {tuple(e.input_ids) for e in data.dataset.examples}
    assert len(held) == 6
    assert seen == all_rows - held
    # the held-out conversations are those examples: rendered, they tokenize to them
    assert plan_held_out_conversations(plan, tokenizer, whole) == list(data.held_out)


def test_packed_rows_never_hold_a_held_out_conversation(tmp_path: Path) -> None:
    """With data.packing the rows are planned from the training view's lengths: every
    training conversation is packed whole, a held-out one never."""
    plan = _holdout_plan(tmp_path, 6, "data.packing=true", "training.training_seq_len=256")
    tokenizer = load_tokenizer(plan)
    whole = build_dataset(plan, tokenizer)
    data = build_train_data(plan, tokenizer, detect_dist_env("cpu", {}), verify_capture=False)
    assert data.packed_seq_len == 256
    training = {tuple(e.input_ids[:256]) for e in data.dataset.examples}
    held = {tuple(e.input_ids[:256]) for e in whole.examples} - training
    assert len(held) == 6
    documents: set[tuple[int, ...]] = set()
    for batch in itertools.islice(data.stream(0, 0), data.batches_per_epoch):
        assert batch.epoch == 0 and batch.document_ids is not None
        for ids, docs in zip(batch.input_ids.tolist(), batch.document_ids.tolist(), strict=True):
            for doc in sorted(set(docs) - {-1}):
                documents.add(tuple(i for i, d in zip(ids, docs, strict=True) if d == doc))
    assert documents == training


@pytest.mark.usefixtures("one_thread")
def test_a_holdout_run_measures_on_the_slice_and_eval_measures_on_the_same(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = _holdout_plan(
        tmp_path,
        4,
        "training.max_steps=2",
        "training.save_steps=2",
        "training.eval_steps=null",  # resolved to every save_steps: there is eval data
        "training.eval_num_prompts=2",
        "training.eval_max_new_tokens=4",
    )
    assert plan.training.eval_steps == 2
    with caplog.at_level(logging.INFO, logger="dflash_recipes.train"):
        summary = run_plan(plan, progress=False)
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("data: 4 conversation(s) held out for the held-out measurement")
        for m in messages
    ), messages
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [(r["step"], r["num_prompts"]) for r in evals] == [(2, 2)]
    assert evals[0]["settings"]["prompt_file"] == plan.data.data_path
    assert evals[0]["settings"]["held_out_slice"] == "4 conversations, seed 0"
    assert summary.last_eval_tau == evals[0]["tau"]
    # after the run, `eval` without --prompts measures on the held-out slice too, and says so
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    export = str(tmp_path / "run" / EXPORT_DIR)
    args = ("eval", str(plan_file), "--checkpoint", export, "--max-new-tokens", "4")
    result = cli(*args, "--num-prompts", "2")
    assert result.exit_code == 0, result.output
    assert (
        f"prompts: the data.eval_holdout slice of {plan.data.data_path} (4 conversations, "
        "seed 0), held out of training"
    ) in result.output
    row = json.loads(cli(*args, "--num-prompts", "2", "--json").stdout)
    assert row["settings"]["prompt_file"] == plan.data.data_path
    assert row["settings"]["held_out_slice"] == "4 conversations, seed 0"
    assert row["num_prompts"] == 2
    assert row["tau"] == pytest.approx(evals[0]["tau"])
