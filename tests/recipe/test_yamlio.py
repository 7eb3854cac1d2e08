"""Strict YAML loading: core-schema scalars, marks, and refusal of what recipes must not contain."""

from __future__ import annotations

import math

import pytest
from testkit.recipe_samples import count_composed_nodes

from dflash_recipes.diagnostics import Diagnostic, SourceMark, registered_codes
from dflash_recipes.errors import RecipeError
from dflash_recipes.recipe.loader import recipe_from_text
from dflash_recipes.recipe.yamlio import MAX_DEPTH, load_yaml


def load(text: str) -> object:
    return load_yaml(text, filename="r.yaml")[0]


def problems(text: str) -> tuple[Diagnostic, ...]:
    with pytest.raises(RecipeError) as info:
        load_yaml(text, filename="r.yaml")
    assert info.value.diagnostics, "a RecipeError from loading must carry diagnostics"
    return info.value.diagnostics


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-4", 1e-4),
        ("1.0e-4", 1e-4),
        ("6e-4", 6e-4),
        ("-2.5E+3", -2500.0),
        (".5", 0.5),
        ("1.", 1.0),
        ("16", 16),
        ("-3", -3),
        ("010", 10),  # YAML 1.2: decimal, not octal
        ("0x1F", 31),
        ("true", True),
        ("false", False),
        ("null", None),
        ("~", None),
        ("", None),
    ],
)
def test_core_schema_scalars(text: str, value: object) -> None:
    loaded = load(f"key: {text}\n")
    assert loaded == {"key": value}
    assert isinstance(loaded, dict)
    assert type(loaded["key"]) is type(value)


@pytest.mark.parametrize(
    "text",
    ["yes", "no", "on", "off", "y", "n", "2024-01-01", "1_000", "12:30", "0b101", ".", "nul", "+"],
)
def test_yaml_11_implicit_types_stay_strings(text: str) -> None:
    assert load(f"key: {text}\n") == {"key": text}


@pytest.mark.parametrize("text", ["True", "TRUE", "False", "FALSE", "tRUE"])
def test_only_lowercase_true_and_false_are_booleans(text: str) -> None:
    assert load(f"key: {text}\n") == {"key": text}
    assert load(f"key: [{text}, true]\n") == {"key": [text, True]}


def test_capitalised_boolean_with_an_explicit_bool_tag_is_refused() -> None:
    (found,) = problems("key: !!bool True\n")
    assert found.code == "yaml-tag"
    assert "'True' cannot be read as !!bool" in found.message


@pytest.mark.parametrize(
    ("text", "lower"), [("True", "true"), ("TRUE", "true"), ("False", "false"), ("FALSE", "false")]
)
def test_a_bool_field_rejects_capitalised_booleans_with_the_lowercase_fix(
    text: str, lower: str
) -> None:
    recipe = f"model:\n  model_name_or_path: /m\n  trust_remote_code: {text}\n"
    result = recipe_from_text(recipe, filename="r.yaml")
    assert result.recipe is None
    (found,) = result.diagnostics
    assert (found.code, found.path) == ("wrong-type", "model.trust_remote_code")
    assert (found.file, found.line, found.column) == ("r.yaml", 3, 3)
    assert found.message == f"expected true or false, got the string {text!r}"
    assert found.hint is not None
    assert found.hint.startswith("use true or false")
    assert f"only lowercase {lower} is a boolean" in found.hint


def test_a_quoted_lowercase_boolean_is_told_to_drop_the_quotes() -> None:
    recipe = "model:\n  model_name_or_path: /m\n  trust_remote_code: 'false'\n"
    (found,) = recipe_from_text(recipe, filename="r.yaml").diagnostics
    assert found.code == "wrong-type"
    assert found.hint == "write false without quotes"


def test_infinity_and_quoted_scalars() -> None:
    data = load("a: .inf\nb: -.inf\nc: \"1e-4\"\nd: 'true'\ne: !!str 5\n")
    assert data == {"a": math.inf, "b": -math.inf, "c": "1e-4", "d": "true", "e": "5"}


def test_marks_for_every_dotted_path_and_list_item() -> None:
    text = "dflash:\n  dflash_architecture_config:\n    intermediate_size: 12288\n    ids: [1, 9]\n"
    data, marks = load_yaml(text, filename="r.yaml")
    assert data == {
        "dflash": {"dflash_architecture_config": {"intermediate_size": 12288, "ids": [1, 9]}}
    }
    assert marks["dflash"] == SourceMark(file="r.yaml", line=1, column=1)
    assert marks["dflash.dflash_architecture_config"] == SourceMark("r.yaml", 2, 3)
    assert marks["dflash.dflash_architecture_config.intermediate_size"] == SourceMark(
        "r.yaml", 3, 5
    )
    assert marks["dflash.dflash_architecture_config.ids.0"] == SourceMark("r.yaml", 4, 11)
    assert marks["dflash.dflash_architecture_config.ids.1"] == SourceMark("r.yaml", 4, 14)


def test_block_list_items_are_marked() -> None:
    _, marks = load_yaml("ids:\n  - 1\n  - 9\n", filename="r.yaml")
    assert marks["ids.1"] == SourceMark("r.yaml", 3, 5)


def test_empty_and_comment_only_documents_are_none() -> None:
    assert load_yaml("", filename="r.yaml") == (None, {})
    assert load_yaml("# nothing here\n\n", filename="r.yaml") == (None, {})


def test_duplicate_keys_report_both_positions_and_every_duplicate() -> None:
    text = "a: 1\nb:\n  c: 1\n  c: 2\na: 3\n"
    found = problems(text)
    assert [(d.code, d.path, d.line, d.column) for d in found] == [
        ("duplicate-key", "b.c", 4, 3),
        ("duplicate-key", "a", 5, 1),
    ]
    assert "first at line 3, column 3" in found[0].message
    assert "again at line 4, column 3" in found[0].message
    assert found[1].hint is not None and "delete" in found[1].hint


def test_syntax_error_has_line_and_column() -> None:
    (found,) = problems("model:\n  dtype: [bfloat16\n  seed: 0\n")
    assert found.code == "yaml-syntax"
    assert found.file == "r.yaml"
    assert found.line is not None and found.line >= 2
    assert found.column is not None
    assert "flow sequence" in found.message  # says which construct is unclosed


def test_tab_indentation_is_a_syntax_error_with_a_hint_about_tabs() -> None:
    (found,) = problems("model:\n\tdtype: float16\n")
    assert (found.code, found.line, found.column) == ("yaml-syntax", 2, 1)
    assert found.hint is not None and "tabs" in found.hint


def test_second_document_is_refused() -> None:
    (found,) = problems("a: 1\n---\nb: 2\n")
    assert (found.code, found.line) == ("yaml-syntax", 2)
    assert "second document" in found.message


def test_alias_is_refused_at_its_position() -> None:
    (found,) = problems("base: &base [1, 2]\nother: *base\n")
    assert (found.code, found.line, found.column) == ("yaml-alias", 2, 8)
    assert "*base" in found.message


def test_merge_key_is_refused() -> None:
    (found,) = problems("a: &a {x: 1}\nb:\n  <<: *a\n")
    assert found.code == "yaml-alias"


@pytest.mark.timing
def test_alias_bomb_is_refused_at_its_first_alias_with_one_diagnostic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ten levels of nine references: expanding it would build 9**10 (3.5 billion) nodes.
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 10):
        refs = ", ".join([f"*l{level - 1}"] * 9)
        lines.append(f"l{level}: &l{level} [{refs}]")
    composed = count_composed_nodes(monkeypatch, fuse=40)
    found = problems("\n".join(lines) + "\n")
    assert [d.code for d in found] == ["yaml-alias"]
    assert (found[0].line, found[0].column) == (2, lines[1].index("*l0") + 1)
    # Nothing past the first alias was read: line 1's 12 nodes, then line 2's key and list.
    assert composed == [14]


@pytest.mark.parametrize(
    ("text", "word"),
    [
        ("1: a\n", "an integer"),
        ("true: a\n", "a boolean"),
        ("null: a\n", "null"),
        ("[a]: b\n", "list"),
    ],
)
def test_non_string_keys_are_refused(text: str, word: str) -> None:
    (found,) = problems(text)
    assert found.code == "non-string-key"
    assert word in found.message
    assert (found.line, found.column) == (1, 1)


def test_python_tags_are_refused_not_executed() -> None:
    (found,) = problems("a: !!python/object/apply:os.system ['echo hacked']\n")
    assert found.code == "yaml-tag"
    assert "!!python/object/apply:os.system" in found.message


def test_core_tag_with_unreadable_value_is_refused() -> None:
    (found,) = problems("a: !!int sixteen\n")
    assert found.code == "yaml-tag"
    assert "'sixteen' cannot be read as !!int" in found.message


def test_integer_beyond_pythons_digit_limit_is_a_diagnostic() -> None:
    (found,) = problems(f"a: {'7' * 5000}\n")
    assert found.code == "yaml-tag"
    assert "cannot be read as !!int" in found.message
    assert len(found.message) < 100


def test_control_character_is_located() -> None:
    (found,) = problems("a: 1\nb: x\x01y\n")
    assert (found.code, found.line, found.column) == ("yaml-syntax", 2, 5)
    assert "U+0001" in found.message


def test_absurd_nesting_is_one_diagnostic_not_a_crash() -> None:
    (found,) = problems("a: " + "[" * 2000 + "]" * 2000 + "\n")
    assert found.code == "yaml-syntax"
    assert "nested" in found.message


def test_nesting_beyond_the_bound_is_refused() -> None:
    deep = "[" * (MAX_DEPTH + 2) + "]" * (MAX_DEPTH + 2)
    (found,) = problems(f"a: {deep}\n")
    assert found.code == "yaml-syntax"


def test_every_emitted_code_is_registered() -> None:
    codes = {info.code for info in registered_codes()}
    assert {"yaml-syntax", "duplicate-key", "yaml-alias", "non-string-key", "yaml-tag"} <= codes
