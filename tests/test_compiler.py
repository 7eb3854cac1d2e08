"""Schema-level compilation, the run plan it produces, and compile_file (issue 2's part)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from testkit.compiling import only
from testkit.st_fixtures import base_model_config, write_base_model

from dflash_recipes.checkpoint import hfconfig
from dflash_recipes.compiler import codes as compile_codes
from dflash_recipes.compiler.compilation import (
    CompileResult,
    compile_file,
    compile_recipe,
    default_loss_decay_factor,
)
from dflash_recipes.diagnostics import (
    Diagnostic,
    Severity,
    SourceMap,
    code_severity,
    registered_codes,
)
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.recipe.sections import Recipe

RecipeFactory = Callable[..., Recipe]
ARCH = "dflash.dflash_architecture_config"


def lint(recipe: Recipe, **kwargs: object) -> CompileResult:
    return compile_recipe(recipe, resolve=False, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# loss decay default
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_size", "gamma"),
    [
        (16, 7.0),
        (10, 5.0),
        (8, 4.0),
        (9, 4.5),
        (13, 6.0),
        (12, 5 + 2 / 3),
        (32, 7 + 16 / 3),
        (4, 2.0),
        (2, 1.0),
    ],
)
def test_loss_decay_default_follows_the_paper_points(block_size: int, gamma: float) -> None:
    assert default_loss_decay_factor(block_size) == pytest.approx(gamma)


def test_decay_default_never_drops_below_one() -> None:
    assert all(default_loss_decay_factor(b) >= 1.0 for b in range(2, 129))


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


def test_schema_level_compile_touches_no_file(
    monkeypatch: pytest.MonkeyPatch, make_recipe: RecipeFactory
) -> None:
    recipe = make_recipe(
        model="/nowhere/base",
        init="z-lab/Qwen3-8B-DFlash-b16",
        data={"data_path": "/nowhere/train.jsonl"},
    )

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("schema-level compile touched the file system")

    for name in ("exists", "is_dir", "is_file", "iterdir", "stat", "open", "read_bytes"):
        monkeypatch.setattr(pathlib.Path, name, forbidden)
    monkeypatch.setattr("builtins.open", forbidden)
    result = lint(recipe, base_dir=Path("/recipes"))
    assert result.ok, result.diagnostics
    plan = result.plan
    assert plan is not None
    assert not plan.resolved
    assert plan.base_model.facts is None
    assert plan.draft.target_layer_ids is None and plan.draft.mask_token_id is None
    assert plan.init_checkpoint is not None
    assert plan.init_checkpoint.path == "/recipes/z-lab/Qwen3-8B-DFlash-b16"
    assert plan.init_checkpoint.tensor_count is None


def test_missing_dims_are_errors_at_schema_level(make_recipe: RecipeFactory) -> None:
    result = lint(make_recipe(arch={"num_hidden_layers": None, "intermediate_size": None}))
    assert result.plan is None
    paths = sorted(d.path for d in result.errors)
    assert paths == [f"{ARCH}.intermediate_size", f"{ARCH}.num_hidden_layers"]
    for d in result.errors:
        field = d.path.rsplit(".", 1)[1]
        assert d.code == "arch-dim-missing"
        assert f"dims never inherit: set dflash_architecture_config.{field}" in d.message


def test_kv_heads_must_divide_heads(make_recipe: RecipeFactory) -> None:
    result = lint(make_recipe(arch={"num_attention_heads": 12, "num_key_value_heads": 5}))
    d = only(result, "kv-heads-not-divisor")
    assert d.path == f"{ARCH}.num_key_value_heads"
    assert "5" in d.message and "12" in d.message
    assert d.hint is not None and "e.g. 4" in d.hint


@pytest.mark.parametrize(
    ("arch", "missing"),
    [
        ({"projector_type": "domino"}, {"emb_dim", "gru_hidden_dim"}),
        ({"projector_type": "domino", "emb_dim": 8}, {"gru_hidden_dim"}),
        ({"projector_type": "dspark"}, {"markov_rank"}),
    ],
)
def test_head_variants_need_their_sizes(
    make_recipe: RecipeFactory, arch: dict[str, object], missing: set[str]
) -> None:
    result = lint(make_recipe(arch=arch))
    found = {
        d.path.rsplit(".", 1)[1]: d for d in result.diagnostics if d.code == "head-field-missing"
    }
    assert set(found) == missing
    for name, d in found.items():
        assert d.severity is Severity.ERROR
        assert f"set dflash_architecture_config.{name}" in (d.hint or "")


@pytest.mark.parametrize(
    ("arch", "unused"),
    [
        ({"emb_dim": 8, "markov_rank": 2}, {"emb_dim", "markov_rank"}),
        (
            {"projector_type": "domino", "emb_dim": 8, "gru_hidden_dim": 8, "markov_rank": 2},
            {"markov_rank"},
        ),
        ({"projector_type": "dspark", "markov_rank": 2, "gru_hidden_dim": 4}, {"gru_hidden_dim"}),
        ({"use_confidence_head": True}, {"use_confidence_head"}),
    ],
)
def test_head_fields_of_another_projector_warn(
    make_recipe: RecipeFactory, arch: dict[str, object], unused: set[str]
) -> None:
    result = lint(make_recipe(arch=arch, dflash={"dflash_mask_token_id": 1}))
    assert result.ok
    warned = {d.path.rsplit(".", 1)[1] for d in result.diagnostics if d.code == "head-field-unused"}
    assert warned == unused


def test_duplicate_taps_are_an_error(make_recipe: RecipeFactory) -> None:
    result = lint(make_recipe(arch={"target_layer_ids": (1, 5, 1)}))
    d = only(result, "taps-duplicate")
    assert d.path == f"{ARCH}.target_layer_ids"
    assert "[1]" in d.message and d.hint is not None and "[1, 5]" in d.hint


def test_eval_steps_without_eval_data_warns(make_recipe: RecipeFactory) -> None:
    result = lint(make_recipe(training={"eval_steps": 50}, dflash={"dflash_mask_token_id": 1}))
    assert result.ok
    assert only(result, "eval-data-unset").path == "training.eval_steps"


def test_schema_level_mask_is_required_only_without_a_checkpoint(
    make_recipe: RecipeFactory,
) -> None:
    assert lint(make_recipe(init="drafter")).ok  # the checkpoint's config may state it
    result = lint(make_recipe(init=None))
    assert only(result, "mask-token-missing").severity is Severity.ERROR


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


def test_plan_json_has_the_fields_the_cli_promises(
    tmp_path: Path,
    base_model: Path,
    drafter: Path,
    train_file: Path,
    recipe_text: Callable[..., str],
    write_recipe: Callable[..., Path],
) -> None:
    result = compile_file(write_recipe(recipe_text()))
    assert result.ok, result.diagnostics
    assert result.plan is not None
    data = json.loads(result.plan.to_json())
    assert re.fullmatch(r"[0-9a-f]{64}", data["fingerprint"])
    assert data["draft"]["block_size"] == 16
    assert data["draft"]["mask_token_id"] == 250
    assert data["draft"]["target_layer_ids"] == [1, 5]
    assert data["init_checkpoint"]["path"] == str(drafter)
    assert data["base_model"]["facts"]["rope"]["rope_theta"] == 1_000_000.0
    assert data["recipe_file"] == str(tmp_path / "recipe.yaml")
    canonical = result.plan.canonical_json()
    assert data["fingerprint"] == hashlib.sha256(canonical).hexdigest()
    assert RunPlan.from_json(result.plan.to_json()) == result.plan


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


def test_plan_bytes_are_identical_across_processes_and_hash_seeds(
    tmp_path: Path,
    drafter: Path,
    train_file: Path,
    recipe_text: Callable[..., str],
    write_recipe: Callable[..., Path],
) -> None:
    config = base_model_config()
    config["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "attention_factor": None,
    }
    write_base_model(tmp_path / "base", config=config)
    path = write_recipe(
        recipe_text(arch={"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8})
    )
    outputs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", _DETERMINISM_SCRIPT, str(path)],
            capture_output=True,
            env=env,
            check=True,
            timeout=120,
        )
        outputs.append(done.stdout)
    in_process = compile_file(path).plan
    assert in_process is not None
    assert outputs[0] == outputs[1] == in_process.canonical_json()
    assert b'"heads_from_scratch":["prefix_gru","embed_proj"]' in outputs[0]


# ---------------------------------------------------------------------------------------------
# codes
# ---------------------------------------------------------------------------------------------


def test_every_compiler_code_is_registered_kebab_case_with_its_severity() -> None:
    registered = {info.code: info for info in registered_codes()}
    compiler_codes = [getattr(compile_codes, name) for name in compile_codes.__all__]
    assert len(compiler_codes) > 30
    for code in compiler_codes:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)+", code), code
        assert code_severity(code) is registered[code].severity
        assert registered[code].summary
    assert code_severity("heads-from-scratch") is Severity.WARNING
    assert code_severity("checkpoint-layout-mismatch") is Severity.ERROR
    config_codes = [c for c in vars(hfconfig).values() if isinstance(c, str) and c in registered]
    assert len(config_codes) == 8
    assert all(re.fullmatch(r"(target|checkpoint)(-[a-z0-9]+)+", c) for c in config_codes)


def test_compile_result_ok_and_errors() -> None:
    warning = Diagnostic(Severity.WARNING, "data-path-unset", "data.data_path", "m")
    result = CompileResult(plan=None, diagnostics=(warning,))
    assert not result.ok and result.errors == ()
