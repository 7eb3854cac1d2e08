"""A warm start from a sliding-window drafter keeps its windows through compile, training,
export and eval (the CLI, in process, on the embedded tiny target)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from testkit.compiling import SMALL_BLOCKS, TINY_SCRATCH

from dflash_recipes.cli import main
from dflash_recipes.plan.run_plan import RunPlan

REPO = Path(__file__).resolve().parents[3]
FINETUNE = REPO / "recipes" / "tiny" / "tiny_finetune.yaml"
ARCH = "dflash.dflash_architecture_config"
SHORT = [
    "training.max_steps=2",
    "training.save_steps=2",
    "training.eval_steps=null",
    *SMALL_BLOCKS,
    "--no-progress",
]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_warm_start_from_a_sliding_window_drafter_keeps_its_windows(tmp_path: Path) -> None:
    runner = CliRunner()
    # 1. A "released" drafter whose first layer is a sliding-window layer.
    released = tmp_path / "released"
    args = [
        "run",
        str(TINY_SCRATCH),
        f"training.output_dir={released}",
        f"{ARCH}.layer_types=[sliding_attention, full_attention]",
        f"{ARCH}.sliding_window=6",
        *SHORT,
    ]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    config = json.loads((released / "export" / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert (config["sliding_window"], config["use_sliding_window"]) == (6, True)

    # 2. Fine-tune it with the recipe silent about attention kinds: they come from its config.
    finetune = tmp_path / "finetune"
    args = [
        "run",
        str(FINETUNE),
        f"training.output_dir={finetune}",
        f"dflash.dflash_init_checkpoint={released / 'export'}",
        *SHORT,
    ]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "layer-types-from-checkpoint" in result.output
    plan = RunPlan.from_json((finetune / "plan.json").read_text())
    spec = plan.resolved_draft()
    assert [spec.layer_window(i) for i in range(2)] == [6, None]
    config = json.loads((finetune / "export" / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == 6
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert (finetune / "export" / "dflash.py").is_file()

    # 3. eval drafts with the plan's windows and stays lossless.
    prompts = REPO / "dflash_recipes" / "demo_data" / "data" / "eval.jsonl"
    args = [
        "eval",
        str(finetune / "plan.json"),
        "--checkpoint",
        str(finetune / "export"),
        "--prompts",
        str(prompts),
        "--num-prompts",
        "1",
        "--max-new-tokens",
        "8",
        "--json",
    ]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    assert report["lossless"] is True
    assert 1.0 <= report["tau"] <= 4.0
