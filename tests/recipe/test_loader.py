"""Loading recipe files and overrides: one clear diagnostic per bad input, never a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
from testkit.recipe_samples import EXAMPLE_YAML, MINIMAL_YAML, count_composed_nodes, line_of

from dflash_recipes.diagnostics import Diagnostic, SourceMark, registered_codes
from dflash_recipes.errors import RecipeError
from dflash_recipes.recipe.loader import (
    LoadResult,
    load_recipe,
    load_recipe_with_diagnostics,
    recipe_from_text,
)
from dflash_recipes.recipe.sections import (
    DFlashArchitectureConfig,
    DFlashSection,
    ModelSection,
    Recipe,
)


def write(tmp_path: Path, text: str | bytes, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def only(result: LoadResult) -> Diagnostic:
    assert result.recipe is None
    assert not result.ok
    assert len(result.diagnostics) == 1, [d.code for d in result.diagnostics]
    return result.diagnostics[0]


def test_example_recipe_file_loads(tmp_path: Path) -> None:
    path = write(tmp_path, EXAMPLE_YAML)
    result = load_recipe_with_diagnostics(path)
    assert result.ok and result.diagnostics == ()
    assert result.file == str(path.resolve())
    assert result.overrides == ()
    recipe = result.recipe
    assert recipe is not None
    # Paths are taken as written: loading never looks at the model or checkpoint folders.
    assert recipe.model.model_name_or_path == "/hf-local/Qwen/Qwen3-8B"
    assert recipe.dflash.dflash_init_checkpoint == "/hf-local/z-lab/Qwen3-8B-DFlash-b16"
    assert recipe.dflash.dflash_architecture_config.intermediate_size == 12288
    assert result.source.locate("dflash.dflash_block_size") == SourceMark(
        file=str(path), line=line_of(EXAMPLE_YAML, "dflash_block_size"), column=3
    )


def test_loaded_recipe_equals_the_python_built_one(tmp_path: Path) -> None:
    built = Recipe(
        model=ModelSection(model_name_or_path="/models/target"),
        dflash=DFlashSection(
            dflash_block_size=10,
            dflash_architecture_config=DFlashArchitectureConfig(target_layer_ids=(1, 7)),
        ),
    )
    text = MINIMAL_YAML + (
        "dflash:\n  dflash_block_size: 10\n"
        "  dflash_architecture_config:\n    target_layer_ids: [1, 7]\n"
    )
    assert load_recipe(write(tmp_path, text)) == built


def test_relative_path_is_shown_as_given_and_stored_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, "model: 5\n")
    monkeypatch.chdir(tmp_path)
    result = load_recipe_with_diagnostics("recipe.yaml")
    assert result.file == os.path.join(str(tmp_path), "recipe.yaml")
    assert only(result).file == "recipe.yaml"


def test_load_recipe_raises_with_every_diagnostic(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL_YAML + "training:\n  seed: -1\n  fsdp: yes\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert [d.code for d in info.value.diagnostics] == ["invalid-value", "wrong-type"]
    text = str(info.value)
    assert "has 2 errors" in text
    assert f"{path}:4:3: error[invalid-value] training.seed" in text
    assert "fix: write true ('yes' is a string in recipes, not a boolean)" in text


def test_missing_file_suggests_the_sibling_recipe(tmp_path: Path) -> None:
    write(tmp_path, MINIMAL_YAML, name="qwen3_8b.yaml")
    found = only(load_recipe_with_diagnostics(tmp_path / "qwen3-8b.yaml"))
    assert (found.code, found.file) == ("recipe-not-found", str(tmp_path / "qwen3-8b.yaml"))
    assert "does not exist" in found.message
    assert found.hint == f"did you mean {tmp_path / 'qwen3_8b.yaml'}?"


def test_missing_folder_is_named(tmp_path: Path) -> None:
    found = only(load_recipe_with_diagnostics(tmp_path / "nope" / "r.yaml"))
    assert found.code == "recipe-not-found"
    assert found.hint is not None and "nope does not exist either" in found.hint


def test_directory_points_to_a_recipe_inside_it(tmp_path: Path) -> None:
    write(tmp_path, MINIMAL_YAML, name="a.yaml")
    found = only(load_recipe_with_diagnostics(tmp_path))
    assert found.code == "recipe-is-directory"
    assert "is a folder" in found.message
    assert found.hint is not None and str(tmp_path / "a.yaml") in found.hint


def test_a_fifo_is_refused_without_reading_it(tmp_path: Path) -> None:
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    found = only(load_recipe_with_diagnostics(fifo))
    assert (found.code, found.message, found.hint) == (
        "recipe-not-a-file",
        f"recipe path {fifo}: it is a FIFO (named pipe), not a regular file",
        "pass the path of a recipe .yaml file (nothing was read from this one)",
    )


def test_a_file_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    big = write(tmp_path, "a: 1\n" * (2**20 // 5 + 1))
    found = only(load_recipe_with_diagnostics(big))
    assert (found.code, found.message, found.hint) == (
        "recipe-too-large",
        f"recipe file {big}: it is larger than the limit of 1048576 bytes",
        "a recipe is a short YAML file; check that this is the file you meant",
    )


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file_is_one_diagnostic(tmp_path: Path, text: str) -> None:
    found = only(load_recipe_with_diagnostics(write(tmp_path, text)))
    assert found.code == "empty-recipe"
    assert found.hint is not None and "model_name_or_path" in found.hint


@pytest.mark.parametrize(("text", "word"), [("- a\n- b\n", "a list"), ("just text\n", "string")])
def test_non_mapping_top_level_is_one_diagnostic(tmp_path: Path, text: str, word: str) -> None:
    found = only(load_recipe_with_diagnostics(write(tmp_path, text)))
    assert (found.code, found.path) == ("not-a-mapping", "")
    assert word in found.message


def test_invalid_utf8_is_located(tmp_path: Path) -> None:
    before = "  model_name_or_path: /m  # caf"
    raw = b"model:\n" + before.encode() + b"\xe9\n"
    found = only(load_recipe_with_diagnostics(write(tmp_path, raw)))
    assert (found.code, found.line, found.column) == ("invalid-utf8", 2, len(before) + 1)
    assert "0xe9" in found.message
    assert found.hint is not None and "UTF-8" in found.hint


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    result = load_recipe_with_diagnostics(write(tmp_path, b"\xef\xbb\xbf" + MINIMAL_YAML.encode()))
    assert result.ok


def test_yaml_syntax_error_is_one_located_diagnostic(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  model_name_or_path: /m\n  dtype: [bfloat16\n")
    found = only(load_recipe_with_diagnostics(path))
    assert found.code == "yaml-syntax"
    assert found.file == str(path) and found.line is not None and found.column is not None


@pytest.mark.timing
def test_alias_bomb_file_is_one_diagnostic_at_its_first_alias(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [
        f"{chr(97 + i)}: &{chr(97 + i)} [{', '.join([f'*{chr(96 + i)}'] * 9)}]"
        for i in range(1, 12)
    ]
    path = write(tmp_path, "\n".join(lines) + "\n")
    composed = count_composed_nodes(monkeypatch, fuse=40)
    found = only(load_recipe_with_diagnostics(path))
    assert found.code == "yaml-alias"
    assert (found.file, found.line, found.column) == (str(path), 2, lines[1].index("*a") + 1)
    assert composed == [14]  # nothing past the first alias was read


def test_duplicate_keys_in_a_file(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL_YAML + "training:\n  seed: 1\n  seed: 2\n")
    found = only(load_recipe_with_diagnostics(path))
    assert (found.code, found.path, found.line) == ("duplicate-key", "training.seed", 5)
    assert "first at line 4" in found.message


def test_unreadable_file(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL_YAML)
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("running as a user that can read any file")
        found = only(load_recipe_with_diagnostics(path))
        assert found.code == "recipe-unreadable"
    finally:
        path.chmod(0o644)


# --------------------------------------------------------------------------------------------
# overrides
# --------------------------------------------------------------------------------------------


def test_overrides_set_values_through_the_same_schema(tmp_path: Path) -> None:
    path = write(tmp_path, EXAMPLE_YAML)
    result = load_recipe_with_diagnostics(
        path,
        overrides=[
            "training.learning_rate=6e-4",
            "dflash.dflash_architecture_config.target_layer_ids=[1,9,17]",
            "training.max_steps=1000",
            "data.eval_data_path=/data/eval.jsonl",  # the file has no such key yet
        ],
    )
    assert result.ok, result.diagnostics
    recipe = result.recipe
    assert recipe is not None
    assert recipe.training.learning_rate == pytest.approx(6e-4)
    assert recipe.dflash.dflash_architecture_config.target_layer_ids == (1, 9, 17)
    assert recipe.training.max_steps == 1000
    assert recipe.data.eval_data_path == "/data/eval.jsonl"
    assert result.overrides[0] == "training.learning_rate=6e-4"
    assert result.source.locate("training.learning_rate") == SourceMark(file="<override 1>")
    assert result.source.locate("dflash.dflash_architecture_config.target_layer_ids.2") == (
        SourceMark(file="<override 2>")
    )


def test_override_null_and_later_override_wins() -> None:
    text = MINIMAL_YAML + "training:\n  max_steps: 5\n"
    result = recipe_from_text(text, overrides=["training.max_steps=7", "training.max_steps=null"])
    assert result.recipe is not None and result.recipe.training.max_steps is None


def test_override_unknown_path_has_did_you_mean_and_location() -> None:
    result = recipe_from_text(
        MINIMAL_YAML, overrides=["training.seed=1", "dflash.dflash_blok_size=8"]
    )
    found = only(result)
    assert (found.code, found.path, found.file) == (
        "unknown-override-path",
        "dflash.dflash_blok_size",
        "<override 2>",
    )
    assert found.hint == "did you mean dflash.dflash_block_size?"


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("learning_rate=1e-4", "did you mean training.learning_rate?"),
        ("dflsh.dflash_block_size=8", "did you mean dflash.dflash_block_size?"),
        (
            "dflash.dflash_architecture_config.target_layer_ids.0=3",
            "dflash.dflash_architecture_config.target_layer_ids is set as a whole",
        ),
    ],
)
def test_override_path_hints(override: str, hint: str) -> None:
    found = only(recipe_from_text(MINIMAL_YAML, overrides=[override]))
    assert found.code == "unknown-override-path"
    assert found.hint is not None and found.hint.startswith(hint)


def test_override_of_the_wrong_type_is_located_at_the_override(tmp_path: Path) -> None:
    result = load_recipe_with_diagnostics(
        write(tmp_path, EXAMPLE_YAML), overrides=["training.max_steps=abc"]
    )
    found = only(result)
    assert (found.code, found.path, found.file, found.line) == (
        "wrong-type",
        "training.max_steps",
        "<override 1>",
        None,
    )
    assert "expected an integer, got the string 'abc'" in found.message


def test_override_values_use_the_strict_resolver() -> None:
    result = recipe_from_text(MINIMAL_YAML, overrides=["training.learning_rate=1e-4"])
    assert result.recipe is not None and result.recipe.training.learning_rate == 1e-4
    found = only(recipe_from_text(MINIMAL_YAML, overrides=["model.trust_remote_code=yes"]))
    assert (found.code, found.file) == ("wrong-type", "<override 1>")
    assert "the string 'yes'" in found.message


def test_override_list_replaces_the_file_list_and_its_marks() -> None:
    text = (
        MINIMAL_YAML + "dflash:\n  dflash_architecture_config:\n    target_layer_ids: [1, 2, 3]\n"
    )
    result = recipe_from_text(
        text, overrides=["dflash.dflash_architecture_config.target_layer_ids=[4, x]"]
    )
    found = only(result)
    assert found.path == "dflash.dflash_architecture_config.target_layer_ids.1"
    assert found.file == "<override 1>"


@pytest.mark.parametrize(
    ("override", "message_part"),
    [
        ("training.seed", "not of the form path=value"),
        ("=3", "not of the form path=value"),
        ("dflash=1", "is a section"),
        ("training.max_steps={a: 1}", "mapping or nested list"),
        ("training.max_steps=[1", "cannot read the value"),
        ("training.max_steps=1\n2", "one line"),
    ],
)
def test_bad_overrides(override: str, message_part: str) -> None:
    found = only(recipe_from_text(MINIMAL_YAML, overrides=[override]))
    assert (found.code, found.file) == ("bad-override", "<override 1>")
    assert message_part in found.message
    assert found.hint


def test_section_override_suggests_one_of_its_fields() -> None:
    found = only(recipe_from_text(MINIMAL_YAML, overrides=["dflash.dflash_architecture_config=5"]))
    assert found.hint is not None
    assert "dflash.dflash_architecture_config." in found.hint


def test_override_problems_and_file_problems_come_together() -> None:
    text = MINIMAL_YAML + "training:\n  seed: x\n"
    result = recipe_from_text(text, overrides=["training.sed=1"])
    assert result.recipe is None
    assert [(d.code, d.file) for d in result.diagnostics] == [
        ("wrong-type", "<string>"),
        ("unknown-override-path", "<override 1>"),
    ]


def test_overrides_are_checked_even_when_the_file_is_missing(tmp_path: Path) -> None:
    result = load_recipe_with_diagnostics(tmp_path / "none.yaml", overrides=["nope=1"])
    assert [d.code for d in result.diagnostics] == ["recipe-not-found", "unknown-override-path"]


def test_overrides_alone_cannot_fill_an_empty_file() -> None:
    found = only(recipe_from_text("", overrides=["model.model_name_or_path=/m"]))
    assert found.code == "empty-recipe"


def test_overrides_can_create_a_missing_required_field() -> None:
    result = recipe_from_text(
        "model:\n  dtype: float16\n", overrides=["model.model_name_or_path=/m"]
    )
    assert result.recipe is not None
    assert result.recipe.model == ModelSection(model_name_or_path="/m", dtype="float16")


def test_recipe_from_text_names_the_source() -> None:
    result = recipe_from_text("model: []\n")
    assert result.file == "<string>"
    assert only(result).file == "<string>"
    named = recipe_from_text("model: []\n", filename="inline.yaml")
    assert only(named).file == "inline.yaml"


def test_load_result_is_frozen() -> None:
    result = recipe_from_text(MINIMAL_YAML)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        result.recipe = None  # type: ignore[misc]


def test_loader_codes_are_registered() -> None:
    codes = {info.code for info in registered_codes()}
    assert {
        "empty-recipe",
        "recipe-not-found",
        "recipe-is-directory",
        "recipe-unreadable",
        "invalid-utf8",
        "bad-override",
        "unknown-override-path",
    } <= codes
