"""The tool-calling example end to end on the tiny target (issue 52): recipes/tiny/tiny_tools.yaml
compiles, its tool rows render through the target's own template (every row used, the calls and
answers supervised, the tool results not), it trains and exports, and `eval` on its tagged
prompts reports tau per workload."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.plan.run_plan import RunPlan

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "tiny" / "tiny_tools.yaml"


def _plan(tmp_path: Path) -> RunPlan:
    overrides = [
        f"training.output_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "training.max_steps=2",
        "training.save_steps=2",
        "training.logging_steps=1",
    ]
    result = compile_file(RECIPE, overrides)
    assert result.plan is not None, result.diagnostics
    return result.plan


def test_every_tool_row_renders_and_only_calls_and_answers_are_supervised(
    tmp_path: Path,
) -> None:
    from dflash_recipes.executor.data.train_dataset import build_dataset
    from dflash_recipes.executor.model.convert import load_tokenizer

    plan = _plan(tmp_path)
    tokenizer = load_tokenizer(plan)
    dataset = build_dataset(plan, tokenizer)
    assert dataset.stats.conversations_used == 30 and not dataset.stats.skipped
    example = dataset.examples[0]
    pairs = zip(example.input_ids, example.loss_mask, strict=True)
    supervised = tokenizer.decode([token for token, kept in pairs if kept])
    call = '<call>{"name": "city_facts", "arguments": {"city": "mibelsa"}}</call><|im_end|>'
    answer = "the silver river runs through mibelsa, arvand, under 19 bridges.<|im_end|>"
    assert supervised == call + answer
    text = tokenizer.decode(example.input_ids)
    assert '<|im_start|>tool\n{"bridges": 19, "country": "arvand", "river": "silver"}' in text
    assert "You may call these tools:" in text


@pytest.mark.usefixtures("one_thread")
def test_the_example_trains_and_eval_reports_tau_per_workload(tmp_path: Path) -> None:
    from dflash_recipes.executor.evaluation.evaluate import run_eval
    from dflash_recipes.executor.training.fit import run_plan

    plan = _plan(tmp_path)
    assert run_plan(plan, progress=False).steps == 2
    export = Path(plan.training.output_dir) / "export"
    report = run_eval(plan, export, None, max_new_tokens=8, num_prompts=12)
    assert [(t.tag, t.num_prompts) for t in report.tau_per_tag] == [("chat", 6), ("tool", 6)]
    assert all(1.0 <= t.tau <= plan.draft.block_size for t in report.tau_per_tag)
