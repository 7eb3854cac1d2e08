"""What the compiler's checks are given: the recipe's paths resolved against its folder, what was
read (nothing at schema level), and a report that keeps findings in the order they were made."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflash_recipes.compiler.codes import (
    CHECKPOINT_TAPS_DIFFER,
    HEADS_FROM_SCRATCH,
    TAPS_DEFAULT,
)
from dflash_recipes.compiler.state import NOTHING_READ, CompileInputs, InitCheckpoint, Report
from dflash_recipes.diagnostics import Severity, SourceMap, SourceMark
from dflash_recipes.recipe.sections import Recipe


def test_the_report_keeps_emission_order_and_each_code_s_severity() -> None:
    marks = {"dflash.dflash_architecture_config": SourceMark(file="r.yaml", line=7, column=3)}
    report = Report(SourceMap(file="r.yaml", marks=marks))
    taps = "dflash.dflash_architecture_config.target_layer_ids"
    report.emit(HEADS_FROM_SCRATCH, taps, "second in the file, first said")
    report.emit(TAPS_DEFAULT, "training.seed", "first")
    report.emit(CHECKPOINT_TAPS_DIFFER, taps, "third", "fix")
    said = report.diagnostics
    assert [d.message for d in said] == ["second in the file, first said", "first", "third"]
    assert [d.severity for d in said] == [Severity.WARNING, Severity.INFO, Severity.WARNING]
    assert (said[0].file, said[0].line, said[0].column) == ("r.yaml", 7, 3)  # nearest mark
    assert (said[1].file, said[1].line) == ("r.yaml", None)
    assert report.messages_of({CHECKPOINT_TAPS_DIFFER, HEADS_FROM_SCRATCH}) == (
        "second in the file, first said",
        "third",
    )


def test_inputs_resolve_recipe_paths_against_the_recipe_folder(
    tmp_path: Path, make_recipe: Callable[..., Recipe]
) -> None:
    inputs = CompileInputs(recipe=make_recipe(), base_dir=tmp_path)
    assert inputs.absolute("data/train.jsonl") == tmp_path / "data" / "train.jsonl"
    assert inputs.arch is inputs.recipe.dflash.dflash_architecture_config


def test_a_schema_level_compile_has_read_nothing() -> None:
    assert NOTHING_READ.facts is None and NOTHING_READ.resume is None
    assert NOTHING_READ.checkpoint == InitCheckpoint()
    assert NOTHING_READ.checkpoint.dims.values == {} and not NOTHING_READ.checkpoint.broken
    assert NOTHING_READ.checkpoint.readable_config is None
