"""`dflash-recipe compile | lint | schema | init`, `--version` and `--help`, as a user sees them.

Commands run in-process through click's CliRunner (stdout and stderr apart); one test runs the
real console entry point in a subprocess, because no-traceback-ever is a whole-process promise.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import Result
from testkit.cli_runner import cli
from testkit.st_fixtures import write_json

from dflash_recipes.plan.run_plan import RunPlan

DIAGNOSTIC_KEYS = {"severity", "code", "path", "message", "hint", "file", "line", "column"}


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command runs from tmp_path (where the fixtures are), outside GitHub Actions."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)


def json_out(result: Result) -> dict[str, Any]:
    """stdout parsed as exactly one JSON object (json.loads refuses trailing output)."""
    data = json.loads(result.stdout)
    assert isinstance(data, dict)
    return data


def files_in(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.fixture
def bad_recipe(
    base_model: Path,
    drafter: Path,
    train_file: Path,
    write_recipe: Callable[..., Path],
    recipe_text: Callable[..., str],
) -> Path:
    """A recipe whose intermediate_size disagrees with the checkpoint (line 12 of the file)."""
    return write_recipe(recipe_text(arch={"intermediate_size": 48}), name="bad.yaml")


# ---------------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------------


def test_compile_prints_the_plan_on_stdout_and_a_summary_on_stderr(good_recipe: Path) -> None:
    result = cli("compile", "recipe.yaml")
    assert result.exit_code == 0
    plan = RunPlan.from_json(result.stdout)
    assert plan.draft.target_layer_ids == (1, 5)
    assert plan.draft.mask_token_id == 250
    assert f"compiled recipe.yaml (fingerprint {plan.fingerprint[:16]}; 0 errors" in result.stderr
    # the infos say where taps and mask came from, located in the file
    assert "recipe.yaml:5:1: info[mask-from-checkpoint]" in result.stderr


def test_compile_writes_the_plan_file_and_nothing_else(good_recipe: Path, tmp_path: Path) -> None:
    before = files_in(tmp_path)
    result = cli("compile", "recipe.yaml", "-o", "plans/plan.json")
    assert result.exit_code == 0
    assert result.stdout == ""
    assert "compiled recipe.yaml -> plans/plan.json" in result.stderr
    written = (tmp_path / "plans" / "plan.json").read_text(encoding="utf-8")
    plan = RunPlan.from_json(written)
    assert plan.init_checkpoint is not None
    assert plan.init_checkpoint.path == str(tmp_path / "drafter")
    assert files_in(tmp_path) == before | {"plans"}
    assert files_in(tmp_path / "plans") == {"plan.json"}  # no temporary file left


def test_compile_with_warnings_exits_0_and_writes_the_plan(
    write_recipe: Callable[..., Path],
    recipe_text: Callable[..., str],
    base_model: Path,
    drafter: Path,
    train_file: Path,
    tmp_path: Path,
) -> None:
    write_recipe(recipe_text(dflash={"dflash_mask_token_id": 249}))
    result = cli("compile", "recipe.yaml", "-o", "plan.json")
    assert result.exit_code == 0
    assert "recipe.yaml:7:3: warning[checkpoint-mask-differs]" in result.stderr
    assert "0 errors, 1 warning" in result.stderr
    assert RunPlan.from_json((tmp_path / "plan.json").read_text()).draft.mask_token_id == 249


def test_compile_errors_exit_1_and_write_no_plan(bad_recipe: Path, tmp_path: Path) -> None:
    before = files_in(tmp_path)
    result = cli("compile", "bad.yaml", "-o", "plan.json")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "bad.yaml:7:3: error[checkpoint-layout-mismatch]" in result.stderr
    assert "recipe expects [48, 32], checkpoint has [64, 32]" in result.stderr
    assert "fix: set dflash_architecture_config.intermediate_size: 64" in result.stderr
    assert "compile failed: 1 error" in result.stderr
    assert files_in(tmp_path) == before


def test_a_failed_compile_leaves_an_existing_plan_file_untouched(
    bad_recipe: Path, tmp_path: Path
) -> None:
    (tmp_path / "plan.json").write_text("previous plan", encoding="utf-8")
    assert cli("compile", "bad.yaml", "-o", "plan.json").exit_code == 1
    assert (tmp_path / "plan.json").read_text(encoding="utf-8") == "previous plan"


def test_compile_applies_overrides(good_recipe: Path) -> None:
    result = cli("compile", "recipe.yaml", "training.max_steps=100", "dflash.dflash_block_size=10")
    assert result.exit_code == 0
    plan = RunPlan.from_json(result.stdout)
    assert plan.training.max_steps == 100
    assert plan.draft.block_size == 10
    assert plan.overrides == ("training.max_steps=100", "dflash.dflash_block_size=10")


def test_compile_with_a_bad_override_is_a_recipe_error(good_recipe: Path) -> None:
    result = cli("compile", "recipe.yaml", "training.max_step=100")
    assert result.exit_code == 1
    assert "<override 1>: error[unknown-override-path] training.max_step" in result.stderr
    assert "did you mean training.max_steps?" in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["compile", "recipe.yaml", "--frobnicate"], "No such option '--frobnicate'"),
        (["compile"], "Missing argument 'RECIPE'"),
        (["compile", "recipe.yaml", "--format", "yaml"], "'yaml' is not one of 'text', 'json'"),
        (["compile", "recipe.yaml", "-o"], "Option '-o' requires an argument"),
        (["compile", "recipe.yaml", "-o", "."], "is a directory"),
    ],
)
def test_compile_bad_flags_are_usage_errors(good_recipe: Path, args: list[str], says: str) -> None:
    result = cli(*args)
    assert result.exit_code == 2
    assert says in result.stderr
    assert result.stdout == ""


def test_compile_missing_recipe_is_a_usage_error_with_a_suggestion(good_recipe: Path) -> None:
    result = cli("compile", "recipe.yml")
    assert result.exit_code == 2
    assert "recipe.yml: error[recipe-not-found] recipe file recipe.yml does not exist" in (
        result.stderr
    )
    assert "did you mean recipe.yaml?" in result.stderr


def test_compile_of_a_folder_is_a_usage_error_that_points_at_lint(good_recipe: Path) -> None:
    result = cli("compile", ".")
    assert result.exit_code == 2
    assert "error[recipe-is-directory] . is a folder, not a recipe file" in result.stderr
    assert "dflash-recipe lint ." in result.stderr


def test_compile_to_an_unwritable_place_is_a_usage_error_leaving_nothing(
    good_recipe: Path, tmp_path: Path
) -> None:
    before = files_in(tmp_path)
    # a file where the output's folder should be
    result = cli("compile", "recipe.yaml", "-o", "recipe.yaml/plan.json")
    assert result.exit_code == 2
    assert "error[output-unwritable]" in result.stderr
    assert "cannot write recipe.yaml/plan.json" in result.stderr
    assert "compile failed" in result.stderr
    assert result.stdout == ""
    assert files_in(tmp_path) == before

    as_json = cli("compile", "recipe.yaml", "-o", "recipe.yaml/plan.json", "--format", "json")
    assert as_json.exit_code == 2
    payload = json_out(as_json)
    assert payload["ok"] is False and payload["plan"] is None
    assert "output-unwritable" in [d["code"] for d in payload["diagnostics"]]


def test_plan_file_is_written_atomically(
    good_recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan goes to a temporary sibling first; if the final rename fails, the old file
    stays as it was and no partial or temporary file is left behind."""
    (tmp_path / "plan.json").write_text("previous plan", encoding="utf-8")
    before = files_in(tmp_path)
    renamed: list[tuple[str, str]] = []

    def failing_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        renamed.append((os.fspath(src), os.fspath(dst)))
        assert Path(src).read_text(encoding="utf-8").startswith("{")  # complete before rename
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    result = cli("compile", "recipe.yaml", "-o", "plan.json")
    assert result.exit_code == 2
    assert "cannot write plan.json: No space left on device" in result.stderr
    assert len(renamed) == 1 and renamed[0][1] == "plan.json"
    assert Path(renamed[0][0]).parent == Path(".")
    assert files_in(tmp_path) == before
    assert (tmp_path / "plan.json").read_text(encoding="utf-8") == "previous plan"


# -- compile --format json ---------------------------------------------------------------------


def test_compile_json_success_is_one_object_with_the_plan(
    good_recipe: Path, tmp_path: Path
) -> None:
    result = cli("compile", "recipe.yaml", "--format", "json")
    assert result.exit_code == 0
    assert result.stderr == ""
    payload = json_out(result)
    assert set(payload) == {"ok", "diagnostics", "plan", "resources"}
    assert payload["ok"] is True
    plan = payload["plan"]
    assert re.fullmatch(r"[0-9a-f]{64}", plan["fingerprint"])
    assert plan["draft"]["block_size"] == 16
    assert plan["draft"]["mask_token_id"] == 250
    assert plan["draft"]["target_layer_ids"] == [1, 5]
    assert plan["init_checkpoint"]["path"] == str(tmp_path / "drafter")
    # the object is the plan itself: it parses back with the same fingerprint
    assert RunPlan.from_json(json.dumps(plan)).fingerprint == plan["fingerprint"]
    assert [d["code"] for d in payload["diagnostics"]] == [
        "mask-from-checkpoint",
        "rms-norm-eps-from-checkpoint",
        "taps-from-checkpoint",
    ]
    for diagnostic in payload["diagnostics"]:
        assert set(diagnostic) == DIAGNOSTIC_KEYS
        assert diagnostic["severity"] == "info"
        assert diagnostic["file"] == "recipe.yaml"
        assert isinstance(diagnostic["line"], int) and isinstance(diagnostic["column"], int)


def test_compile_json_without_init_checkpoint_has_null_init_checkpoint(
    write_recipe: Callable[..., Path],
    recipe_text: Callable[..., str],
    base_model: Path,
    train_file: Path,
) -> None:
    write_recipe(recipe_text(init=None, dflash={"dflash_mask_token_id": 250}))
    result = cli("compile", "recipe.yaml", "--format", "json")
    assert result.exit_code == 0
    payload = json_out(result)
    assert payload["plan"]["init_checkpoint"] is None
    assert payload["plan"]["draft"]["target_layer_ids"] == [1, 5]  # default formula, 8 layers


def test_compile_json_failure_has_null_plan_and_located_errors(bad_recipe: Path) -> None:
    result = cli("compile", "bad.yaml", "--format", "json", "-o", "plan.json")
    assert result.exit_code == 1
    assert result.stderr == ""
    payload = json_out(result)
    assert payload["ok"] is False
    assert payload["plan"] is None
    errors = [d for d in payload["diagnostics"] if d["severity"] == "error"]
    assert len(errors) == 1
    error = errors[0]
    assert set(error) == DIAGNOSTIC_KEYS
    assert error["code"] == "checkpoint-layout-mismatch"
    assert error["path"] == "dflash.dflash_architecture_config"
    assert (error["file"], error["line"], error["column"]) == ("bad.yaml", 7, 3)
    assert "intermediate_size: 64" in error["hint"]
    assert not Path("plan.json").exists()


def test_compile_json_for_a_missing_file_exits_2_with_one_diagnostic() -> None:
    result = cli("compile", "nowhere/recipe.yaml", "--format", "json")
    assert result.exit_code == 2
    payload = json_out(result)
    assert payload["ok"] is False and payload["plan"] is None
    (only,) = payload["diagnostics"]
    assert only["code"] == "recipe-not-found"
    assert only["file"] == "nowhere/recipe.yaml"
    assert "does not exist" in only["hint"]


ALIAS_BOMB = "\n".join(
    ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]" for i in range(9)]
)


ENTRY_POINT = "from dflash_recipes.cli import run_cli; run_cli()"


# ---------------------------------------------------------------------------------------------
# lint
# ---------------------------------------------------------------------------------------------

TINY_SCHEMA_RECIPE = """\
model:
  model_name_or_path: /models/not/read/by/lint
dflash:
  dflash_mask_token_id: 250
  dflash_architecture_config:
    num_hidden_layers: 2
    num_attention_heads: 4
    num_key_value_heads: 2
    head_dim: 8
    intermediate_size: 64
"""
#: Unknown key on line 3, column 3; the wrong type on line 4, column 3.
TWO_ERRORS = """\
model:
  model_name_or_path: /m
  trust_remote_cod: false
  dtype: 16
"""
#: A head field for another projector: a warning (line 5, column 5), no error.
ONE_WARNING = TINY_SCHEMA_RECIPE + "    emb_dim: 64\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_lint_clean_folder_exits_0_without_reading_model_files(tmp_path: Path) -> None:
    write(tmp_path / "recipes" / "a.yaml", TINY_SCHEMA_RECIPE)
    result = cli("lint", "recipes")
    assert result.exit_code == 0
    assert result.stdout == "linted 1 recipe file(s): 0 errors, 0 warnings, 0 infos\n"


def test_lint_searches_folders_recursively_for_yaml_and_yml(tmp_path: Path) -> None:
    root = tmp_path / "recipes"
    write(root / "a.yaml", TINY_SCHEMA_RECIPE)
    write(root / "Qwen" / "Qwen3-8B" / "b.yml", TINY_SCHEMA_RECIPE)
    write(root / "Qwen" / "deep" / "er" / "c.yaml", TWO_ERRORS)
    write(root / "notes.txt", "not: [a recipe")
    write(root / "README.md", "# recipes")
    write(root / ".hidden" / "workflow.yaml", "on: push\n")  # hidden folders are skipped
    write(root / ".pre-commit-config.yaml", "repos: []\n")  # and hidden files
    result = cli("lint", "recipes", "--format", "json")
    assert result.exit_code == 1
    payload = json_out(result)
    assert payload["files"] == [
        "recipes/a.yaml",
        "recipes/Qwen/Qwen3-8B/b.yml",
        "recipes/Qwen/deep/er/c.yaml",
    ]
    assert {d["file"] for d in payload["diagnostics"]} == {"recipes/Qwen/deep/er/c.yaml"}


def test_lint_takes_files_and_folders_and_lints_each_file_once(tmp_path: Path) -> None:
    write(tmp_path / "recipes" / "a.yaml", TINY_SCHEMA_RECIPE)
    write(tmp_path / "other.yaml", TINY_SCHEMA_RECIPE)
    result = cli("lint", "recipes", "recipes/a.yaml", "other.yaml", "./other.yaml")
    assert result.exit_code == 0
    assert "linted 2 recipe file(s)" in result.stdout


def test_lint_findings_exit_1_with_located_fixes(tmp_path: Path) -> None:
    write(tmp_path / "bad.yaml", TWO_ERRORS)
    result = cli("lint", "bad.yaml")
    assert result.exit_code == 1
    out = result.stdout
    assert "bad.yaml:3:3: error[unknown-key] model.trust_remote_cod" in out
    assert "did you mean trust_remote_code?" in out
    assert "bad.yaml:4:3: error[wrong-type] model.dtype" in out
    assert out.rstrip().endswith("linted 1 recipe file(s): 2 errors, 0 warnings, 0 infos")


def test_lint_warnings_fail_only_with_strict(tmp_path: Path) -> None:
    write(tmp_path / "warn.yaml", ONE_WARNING)
    relaxed = cli("lint", "warn.yaml")
    assert relaxed.exit_code == 0
    assert "warn.yaml:11:5: warning[head-field-unused]" in relaxed.stdout
    strict = cli("lint", "warn.yaml", "--strict")
    assert strict.exit_code == 1
    assert "1 warning" in strict.stdout
    as_json = cli("lint", "warn.yaml", "--strict", "--format", "json")
    assert as_json.exit_code == 1
    assert json_out(as_json)["ok"] is False
    assert json_out(cli("lint", "warn.yaml", "--format", "json"))["ok"] is True


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["lint", "missing.yaml"], "error: missing.yaml: no such file or directory"),
        (["lint", "ok.yaml", "missing/"], "error: missing/: no such file or directory"),
        (["lint", "empty"], "error: empty: no recipe files (*.yaml, *.yml) in this folder"),
        (["lint"], "Missing argument 'PATHS...'"),
        (["lint", "ok.yaml", "--format", "sarif"], "'sarif' is not one of"),
    ],
)
def test_lint_usage_problems_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    write(tmp_path / "ok.yaml", TINY_SCHEMA_RECIPE)
    (tmp_path / "empty").mkdir()
    result = cli(*args)
    assert result.exit_code == 2
    assert says in result.stderr
    assert result.stdout == ""


def test_lint_json_is_one_object_with_files_and_diagnostics(tmp_path: Path) -> None:
    write(tmp_path / "bad.yaml", TWO_ERRORS)
    result = cli("lint", "bad.yaml", "--format", "json")
    assert result.exit_code == 1
    payload = json_out(result)
    assert set(payload) == {"ok", "files", "diagnostics"}
    assert payload["ok"] is False
    assert payload["files"] == ["bad.yaml"]
    assert [(d["code"], d["line"], d["column"]) for d in payload["diagnostics"]] == [
        ("unknown-key", 3, 3),
        ("wrong-type", 4, 3),
    ]
    assert all(set(d) == DIAGNOSTIC_KEYS for d in payload["diagnostics"])


def _workflow_commands(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("::")]


def test_lint_github_prints_workflow_commands_and_the_text_report(tmp_path: Path) -> None:
    write(tmp_path / "bad.yaml", TWO_ERRORS)
    write(tmp_path / "warn.yaml", ONE_WARNING)
    result = cli("lint", "bad.yaml", "warn.yaml", "--format", "github")
    assert result.exit_code == 1
    commands = _workflow_commands(result.stdout)
    assert len(commands) == 3  # one line per diagnostic: newlines inside are escaped
    assert commands[0].startswith("::error file=bad.yaml,line=3,col=3,title=unknown-key::")
    assert "model.trust_remote_cod: unknown key" in commands[0]
    assert "%0Afix: did you mean trust_remote_code?" in commands[0]
    assert commands[1].startswith("::error file=bad.yaml,line=4,col=3,title=wrong-type::")
    assert commands[2].startswith(
        "::warning file=warn.yaml,line=11,col=5,title=head-field-unused::"
    )
    # the full text report follows, for people reading the log
    assert "bad.yaml:3:3: error[unknown-key]" in result.stdout
    assert "warn.yaml:11:5: warning[head-field-unused]" in result.stdout
    assert result.stdout.rstrip().endswith("2 errors, 1 warning, 0 infos")


def test_lint_github_escapes_properties_and_message(tmp_path: Path) -> None:
    # a file name with the property separators, and a key with % in the message
    write(tmp_path / "odd,name:50%.yaml", TWO_ERRORS.replace("trust_remote_cod", "ratio_50%"))
    result = cli("lint", "odd,name:50%.yaml", "--format", "github")
    assert result.exit_code == 1
    first = _workflow_commands(result.stdout)[0]
    properties, _, message = first[len("::error ") :].partition("::")
    assert properties == "file=odd%2Cname%3A50%25.yaml,line=3,col=3,title=unknown-key"
    assert "ratio_50%25" in message
    assert "%0Afix: " in message
    assert "\n" not in first and "ratio_50%'" not in message


def test_github_format_is_chosen_by_github_actions(tmp_path: Path) -> None:
    write(tmp_path / "bad.yaml", TWO_ERRORS)
    on_ci = cli("lint", "bad.yaml", env={"GITHUB_ACTIONS": "true"})
    assert len(_workflow_commands(on_ci.stdout)) == 2
    assert "bad.yaml:3:3: error[unknown-key]" in on_ci.stdout
    explicit = cli("lint", "bad.yaml", "--format", "text", env={"GITHUB_ACTIONS": "true"})
    assert _workflow_commands(explicit.stdout) == []
    elsewhere = cli("lint", "bad.yaml", env={"GITHUB_ACTIONS": "false"})
    assert _workflow_commands(elsewhere.stdout) == []
    as_json = cli("lint", "bad.yaml", "--format", "json", env={"GITHUB_ACTIONS": "true"})
    assert json_out(as_json)["ok"] is False


def test_lint_reports_unreadable_recipes_as_findings(tmp_path: Path) -> None:
    write(tmp_path / "recipes" / "good.yaml", TINY_SCHEMA_RECIPE)
    (tmp_path / "recipes" / "latin1.yaml").write_bytes(b"model:\n  dtype: caf\xe9\n")
    result = cli("lint", "recipes")
    assert result.exit_code == 1
    assert "recipes/latin1.yaml:2:13: error[invalid-utf8]" in result.stdout
    assert "linted 2 recipe file(s): 1 error" in result.stdout


# ---------------------------------------------------------------------------------------------
# schema
# ---------------------------------------------------------------------------------------------


def test_schema_prints_a_valid_json_schema_of_the_recipe() -> None:
    result = cli("schema")
    assert result.exit_code == 0
    schema = json_out(result)
    jsonschema.Draft202012Validator.check_schema(schema)
    dflash = schema["properties"]["dflash"]["properties"]
    assert "dflash_block_size" in dflash
    assert dflash["dflash_architecture_config"]["additionalProperties"] is False


def test_schema_output_file_matches_stdout(tmp_path: Path) -> None:
    result = cli("schema", "-o", "schemas/recipe.schema.json")
    assert result.exit_code == 0
    assert result.stdout == ""
    assert "wrote schemas/recipe.schema.json" in result.stderr
    written = (tmp_path / "schemas" / "recipe.schema.json").read_text(encoding="utf-8")
    assert written == cli("schema").stdout
    validator = jsonschema.Draft202012Validator(json.loads(written))
    assert not validator.is_valid({"model": {"model_name_or_path": "/m", "dtype": "int8"}})
    assert validator.is_valid({"model": {"model_name_or_path": "/m"}})


def test_schema_to_an_unwritable_place_is_a_usage_error(tmp_path: Path) -> None:
    write(tmp_path / "file", "x")
    result = cli("schema", "-o", "file/schema.json")
    assert result.exit_code == 2
    assert "error: cannot write file/schema.json" in result.stderr


# ---------------------------------------------------------------------------------------------
# init
# ---------------------------------------------------------------------------------------------


def _compile_clean(path: str) -> RunPlan:
    result = cli("compile", path, "--format", "json")
    payload = json_out(result)
    problems = [d for d in payload["diagnostics"] if d["severity"] != "info"]
    assert result.exit_code == 0 and problems == [], payload["diagnostics"]
    return RunPlan.from_json(json.dumps(payload["plan"]))


def test_init_from_a_checkpoint_writes_a_recipe_that_compiles_cleanly(
    base_model: Path, drafter: Path, train_file: Path, tmp_path: Path
) -> None:
    result = cli(
        "init",
        "--base-model",
        "base",
        "--init-checkpoint",
        "drafter",
        "--data-path",
        "train.jsonl",
        "--output-dir",
        "runs/ft",
        "-o",
        "recipes/finetune.yaml",
    )
    assert result.exit_code == 0
    assert result.stdout == ""
    assert (
        "wrote recipes/finetune.yaml; check it with: dflash-recipe compile recipes/finetune.yaml"
        in (result.stderr)
    )
    text = (tmp_path / "recipes" / "finetune.yaml").read_text(encoding="utf-8")
    # the header's commands name the file that was written
    assert "#   dflash-recipe compile recipes/finetune.yaml -o plan.json" in text
    assert "#   dflash-recipe run recipes/finetune.yaml" in text
    plan = _compile_clean("recipes/finetune.yaml")
    assert plan.init_checkpoint is not None
    assert plan.init_checkpoint.path == str(tmp_path / "drafter")
    assert plan.draft.architecture.num_hidden_layers == 2
    assert plan.draft.target_layer_ids == (1, 5)
    assert plan.draft.mask_token_id == 250
    assert plan.training.output_dir == str(tmp_path / "runs" / "ft")


def test_init_without_a_checkpoint_takes_the_mask_id_from_the_command_line(
    base_model: Path, train_file: Path, tmp_path: Path
) -> None:
    result = cli(
        "init",
        "--base-model",
        "base",
        "--mask-token-id",
        "255",
        "--data-path",
        "train.jsonl",
        "-o",
        "scratch.yaml",
    )
    assert result.exit_code == 0
    text = (tmp_path / "scratch.yaml").read_text(encoding="utf-8")
    assert "dflash_init_checkpoint" not in text
    assert "dflash_mask_token_id: 255  # given on the command line" in text
    plan = _compile_clean("scratch.yaml")
    assert plan.init_checkpoint is None
    assert plan.draft.mask_token_id == 255


def test_init_without_a_mask_source_fails_cleanly_and_writes_nothing(
    base_model: Path, tmp_path: Path
) -> None:
    before = files_in(tmp_path)
    result = cli("init", "--base-model", "base", "-o", "scratch.yaml")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ")
    assert "the mask id" in result.stderr and "never guessed" in result.stderr
    assert files_in(tmp_path) == before


def test_init_prints_the_recipe_on_stdout_without_o(base_model: Path, drafter: Path) -> None:
    result = cli("init", "--base-model", "base", "--init-checkpoint", "drafter")
    assert result.exit_code == 0
    assert result.stdout.startswith("# DFlash recipe written by `dflash-recipe init`.")
    assert "dflash_mask_token_id: 250" in result.stdout
    assert "target_layer_ids: [1, 5]" in result.stdout


def test_init_refuses_to_overwrite(base_model: Path, drafter: Path, tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("# my edits\n", encoding="utf-8")
    result = cli("init", "--base-model", "base", "--init-checkpoint", "drafter", "-o", "mine.yaml")
    assert result.exit_code == 2
    assert "error: mine.yaml already exists; choose another -o path or delete it first" in (
        result.stderr
    )
    assert (tmp_path / "mine.yaml").read_text(encoding="utf-8") == "# my edits\n"


def test_init_refuses_to_overwrite_a_file_that_appears_while_it_works(
    base_model: Path, drafter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The existence check and the write are not one step: a file created in between (another
    `init`, an editor) still wins, because the recipe is linked into place, never replaced."""
    import dflash_recipes.recipe.starter as init_recipe

    real = init_recipe.render_init_recipe

    def render_then_race(*args: Any, **kwargs: Any) -> str:
        text = real(*args, **kwargs)
        (tmp_path / "race.yaml").write_text("# the other writer\n", encoding="utf-8")
        return text

    monkeypatch.setattr(init_recipe, "render_init_recipe", render_then_race)
    result = cli("init", "--base-model", "base", "--init-checkpoint", "drafter", "-o", "race.yaml")
    assert result.exit_code == 2
    assert "race.yaml already exists" in result.stderr
    assert (tmp_path / "race.yaml").read_text(encoding="utf-8") == "# the other writer\n"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--base-model", "nowhere"], 1, "base model"),
        (["--base-model", "Qwen/Qwen3-8B"], 1, "hf download Qwen/Qwen3-8B --local-dir"),
        (["--base-model", "base", "--init-checkpoint", "nowhere"], 1, "nowhere"),
        (["--base-model", "base", "--mask-token-id", "-1"], 2, "-1 is not in the range x>=0"),
        (["--init-checkpoint", "drafter"], 2, "Missing option '--base-model'"),
        (["--base-model", "base", "-o", "."], 2, "is a directory"),
    ],
)
def test_init_problems_are_clean_errors(
    base_model: Path, drafter: Path, args: list[str], code: int, says: str
) -> None:
    result = cli("init", *args)
    assert result.exit_code == code
    assert says in result.stderr
    assert result.stdout == ""


def test_init_with_a_checkpoint_and_another_mask_id_warns_at_compile(
    base_model: Path, drafter: Path, train_file: Path, tmp_path: Path
) -> None:
    result = cli(
        "init",
        "--base-model",
        "base",
        "--init-checkpoint",
        "drafter",
        "--mask-token-id",
        "249",
        "--data-path",
        "train.jsonl",
        "-o",
        "r.yaml",
    )
    assert result.exit_code == 0
    compiled = cli("compile", "r.yaml", "--format", "json")
    assert compiled.exit_code == 0
    payload = json_out(compiled)
    assert payload["plan"]["draft"]["mask_token_id"] == 249
    warnings = [d["code"] for d in payload["diagnostics"] if d["severity"] == "warning"]
    assert warnings == ["checkpoint-mask-differs"]


# ---------------------------------------------------------------------------------------------
# --version, --help
# ---------------------------------------------------------------------------------------------


def test_writing_a_recipe_file_keeps_its_mask_and_taps(
    base_model: Path, drafter: Path, tmp_path: Path
) -> None:
    """init reads the facts from the checkpoint's config.json, not from defaults."""
    write_json(
        tmp_path / "drafter" / "config.json",
        {
            **json.loads((tmp_path / "drafter" / "config.json").read_text()),
            "dflash_config": {"mask_token_id": 201, "target_layer_ids": [2, 6], "block_size": 8},
        },
    )
    result = cli("init", "--base-model", "base", "--init-checkpoint", "drafter")
    assert result.exit_code == 0
    assert "dflash_mask_token_id: 201" in result.stdout
    assert "target_layer_ids: [2, 6]" in result.stdout
    assert "dflash_block_size: 8" in result.stdout
