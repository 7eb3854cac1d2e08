"""Schema-level compilation, the run plan it produces, and compile_file (issue 2's part)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from testkit.compiling import only

from dflash_recipes.compiler.compilation import (
    CompileResult,
    compile_file,
    compile_recipe,
)
from dflash_recipes.diagnostics import (
    Diagnostic,
    Severity,
    SourceMap,
)
from dflash_recipes.recipe.sections import Recipe

RecipeFactory = Callable[..., Recipe]
ARCH = "dflash.dflash_architecture_config"


def lint(recipe: Recipe, **kwargs: object) -> CompileResult:
    return compile_recipe(recipe, resolve=False, **kwargs)  # type: ignore[arg-type]


def test_plan_resolves_the_decay_from_the_block_size_unless_given(
    make_recipe: RecipeFactory,
) -> None:
    plan = lint(make_recipe(dflash={"dflash_block_size": 10, "dflash_mask_token_id": 1})).plan
    assert plan is not None and plan.draft.objective.loss_decay_factor == 5.0
    explicit = make_recipe(
        dflash={"dflash_block_size": 10, "dflash_loss_decay_factor": 3, "dflash_mask_token_id": 1}
    )
    plan = lint(explicit).plan
    assert plan is not None and plan.draft.objective.loss_decay_factor == 3.0


# ---------------------------------------------------------------------------------------------
# schema level (lint): no file access, cross-field checks only
# ---------------------------------------------------------------------------------------------


def test_diagnostics_are_located_through_the_source_map(make_recipe: RecipeFactory) -> None:
    from dflash_recipes.diagnostics import SourceMark

    source = SourceMap(
        file="r.yaml",
        marks={
            f"{ARCH}": SourceMark("r.yaml", 9, 3),
            f"{ARCH}.head_dim": SourceMark("r.yaml", 12, 5),
        },
    )
    result = lint(make_recipe(arch={"head_dim": None, "intermediate_size": None}), source=source)
    located = {d.path: (d.file, d.line, d.column) for d in result.errors}
    assert located[f"{ARCH}.head_dim"] == ("r.yaml", 12, 5)
    assert located[f"{ARCH}.intermediate_size"] == ("r.yaml", 9, 3)  # nearest marked ancestor


# ---------------------------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_recipe_folder(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    recipe_file = tmp_path / "recipes" / "r.yaml"
    plan = lint(make_recipe(dflash={"dflash_mask_token_id": 1}), recipe_file=str(recipe_file)).plan
    assert plan is not None
    assert plan.base_model.path == str(tmp_path / "recipes" / "base")
    assert plan.training.output_dir == str(tmp_path / "recipes" / "outputs" / "dflash")
    assert plan.recipe_file == str(recipe_file)


def test_relative_paths_of_a_python_recipe_resolve_against_cwd(
    tmp_path: Path, make_recipe: RecipeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    plan = lint(make_recipe(model="../elsewhere/base", dflash={"dflash_mask_token_id": 1})).plan
    assert plan is not None
    assert plan.base_model.path == str(tmp_path.parent / "elsewhere" / "base")
    assert plan.recipe_file is None


def test_home_is_expanded(make_recipe: RecipeFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/someone")
    plan = lint(make_recipe(model="~/models/base", dflash={"dflash_mask_token_id": 1})).plan
    assert plan is not None and plan.base_model.path == "/home/someone/models/base"


# ---------------------------------------------------------------------------------------------
# the plan: JSON fields, round trip, fingerprint, determinism
# ---------------------------------------------------------------------------------------------


def test_overrides_are_applied_and_recorded(
    base_model: Path,
    drafter: Path,
    train_file: Path,
    recipe_text: Callable[..., str],
    write_recipe: Callable[..., Path],
) -> None:
    path = write_recipe(recipe_text())
    result = compile_file(path, ["dflash.dflash_block_size=10"])
    assert result.plan is not None
    assert result.plan.draft.block_size == 10
    assert result.plan.draft.objective.loss_decay_factor == 5.0
    assert result.plan.overrides == ("dflash.dflash_block_size=10",)
    assert only(result, "checkpoint-block-size-differs").severity is Severity.INFO


def test_load_problems_come_back_as_diagnostics(tmp_path: Path) -> None:
    result = compile_file(tmp_path / "missing.yaml")
    assert result.plan is None
    assert [d.severity for d in result.diagnostics] == [Severity.ERROR]
    assert "missing.yaml" in result.diagnostics[0].message


def test_compile_file_lint_mode_needs_no_model(
    recipe_text: Callable[..., str], write_recipe: Callable[..., Path]
) -> None:
    path = write_recipe(recipe_text(dflash={"dflash_mask_token_id": 3}))  # nothing on disk
    result = compile_file(path, resolve=False)
    assert result.ok, result.diagnostics
    assert result.plan is not None and not result.plan.resolved


_DETERMINISM_SCRIPT = """
import sys
from dflash_recipes.compiler.compilation import compile_file
result = compile_file(sys.argv[1])
assert result.plan is not None, result.diagnostics
sys.stdout.buffer.write(result.plan.canonical_json())
"""


# ---------------------------------------------------------------------------------------------
# codes
# ---------------------------------------------------------------------------------------------


def test_compile_result_ok_and_errors() -> None:
    warning = Diagnostic(Severity.WARNING, "data-path-unset", "data.data_path", "m")
    result = CompileResult(plan=None, diagnostics=(warning,))
    assert not result.ok and result.errors == ()


def test_packing_is_recorded_in_the_plan_and_refused_only_offline(
    tmp_path: Path,
    base_model: Path,
    drafter: Path,
    train_file: Path,
    recipe_text: Callable[..., str],
    write_recipe: Callable[..., Path],
) -> None:
    path = write_recipe(recipe_text())
    result = compile_file(path)
    assert result.plan is not None and result.plan.data.packing is False
    packed = compile_file(path, ["data.packing=true"])
    assert packed.ok and packed.plan is not None and packed.plan.data.packing is True
    offline = tmp_path / "capture"
    refused = compile_file(
        path, ["data.packing=true", f"data.hidden_states_path={offline}", "data.data_path=null"]
    )
    found = only(refused, "packing-offline")
    assert found.severity is Severity.ERROR and found.path == "data.packing"
    assert "data.packing: false" in (found.hint or "")
