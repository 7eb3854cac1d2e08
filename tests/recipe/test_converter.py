"""The strict converter: no coercion, unknown keys, validators, every problem at once."""

from __future__ import annotations

import typing

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.recipe_samples import EXAMPLE_YAML, MINIMAL_YAML, column_of, line_of

from dflash_recipes.diagnostics import Diagnostic, Severity, SourceMap, registered_codes
from dflash_recipes.recipe.converter import recipe_field_paths, structure_recipe, unstructure_recipe
from dflash_recipes.recipe.converter import structure as convert
from dflash_recipes.recipe.json_schema import field_types
from dflash_recipes.recipe.sections import (
    DFlashArchitectureConfig,
    ModelSection,
    Recipe,
    TargetServerSection,
)
from dflash_recipes.recipe.yamlio import load_yaml


def structure(text: str) -> tuple[Recipe | None, list[Diagnostic]]:
    data, marks = load_yaml(text, filename="r.yaml")
    return structure_recipe(data, source=SourceMap(file="r.yaml", marks=marks))


def only_problem(text: str) -> Diagnostic:
    recipe, found = structure(text)
    assert recipe is None
    assert len(found) == 1, [d.path for d in found]
    return found[0]


def with_model(body: str) -> str:
    return MINIMAL_YAML + body


def test_example_recipe_is_accepted_as_written() -> None:
    recipe, found = structure(EXAMPLE_YAML)
    assert found == []
    assert recipe is not None
    arch = recipe.dflash.dflash_architecture_config
    assert (recipe.dflash.dflash_block_size, recipe.dflash.dflash_mask_token_id) == (16, 151669)
    assert (arch.num_hidden_layers, arch.head_dim, arch.intermediate_size) == (5, 128, 12288)
    assert recipe.training.learning_rate == pytest.approx(1e-4)
    assert recipe.training.max_steps is None
    assert recipe.data.chat_template is None
    assert recipe.dflash.dflash_loss_objective == "decay"  # default filled in


def test_int_is_accepted_for_a_float_field_and_becomes_a_float() -> None:
    recipe, found = structure(with_model("training:\n  max_grad_norm: 2\n"))
    assert found == [] and recipe is not None
    assert recipe.training.max_grad_norm == 2.0
    assert type(recipe.training.max_grad_norm) is float


def test_yaml_list_becomes_tuple_for_layer_ids() -> None:
    text = with_model("dflash:\n  dflash_architecture_config:\n    target_layer_ids: [1, 9, 17]\n")
    recipe, found = structure(text)
    assert found == [] and recipe is not None
    assert recipe.dflash.dflash_architecture_config.target_layer_ids == (1, 9, 17)


def test_optional_fields_accept_null() -> None:
    text = with_model("data:\n  chat_template: null\ntraining:\n  save_total_limit: null\n")
    recipe, found = structure(text)
    assert found == [] and recipe is not None
    assert recipe.training.save_total_limit is None


@pytest.mark.parametrize(
    ("section", "key", "value", "expected", "hint_part"),
    [
        (
            "data",
            "answer_only_loss",
            '"false"',
            "expected true or false, got the string 'false'",
            "write false without quotes",
        ),
        (
            "training",
            "fsdp",
            "yes",
            "expected true or false, got the string 'yes'",
            "write true",
        ),
        ("training", "fsdp", "1", "expected true or false, got 1", "true or false"),
        ("training", "num_train_epochs", "2.7", "expected an integer, got 2.7", "not rounded"),
        (
            "training",
            "num_train_epochs",
            "3.0",
            "expected an integer, got 3.0",
            "write 3 without the decimal point",
        ),
        (
            "training",
            "num_train_epochs",
            "true",
            "expected an integer, got true (a boolean)",
            "whole number",
        ),
        (
            "training",
            "num_train_epochs",
            '"3"',
            "expected an integer, got the string '3'",
            "without quotes",
        ),
        (
            "training",
            "output_dir",
            "5",
            "expected a string, got 5 (an integer)",
            'quote it to make it text: "5"',
        ),
        (
            "training",
            "output_dir",
            "null",
            "expected a string, got null",
            "default (outputs/dflash)",
        ),
        (
            "training",
            "learning_rate",
            '"1e-4"',
            "expected a number, got the string '1e-4'",
            "without quotes",
        ),
        (
            "training",
            "learning_rate",
            "false",
            "expected a number, got false (a boolean)",
            "number",
        ),
        ("training", "max_steps", "[1]", "expected an integer, got a list", "whole number"),
    ],
)
def test_no_silent_coercion(
    section: str, key: str, value: str, expected: str, hint_part: str
) -> None:
    text = with_model(f"{section}:\n  {key}: {value}\n")
    found = only_problem(text)
    assert found.code == "wrong-type"
    assert found.severity is Severity.ERROR
    assert found.path == f"{section}.{key}"
    assert expected in found.message
    assert found.hint is not None and hint_part in found.hint
    assert (found.file, found.line, found.column) == ("r.yaml", line_of(text, key), 3)


def test_null_for_a_required_string_is_wrong_type() -> None:
    found = only_problem("model:\n  model_name_or_path: null\n")
    assert (found.code, found.path, found.line) == ("wrong-type", "model.model_name_or_path", 2)
    assert "got null" in found.message


def test_literal_lists_allowed_values_and_guesses() -> None:
    text = with_model("training:\n  lr_scheduler_type: cosin\n")
    found = only_problem(text)
    assert (found.code, found.path) == ("invalid-value", "training.lr_scheduler_type")
    assert "cosine, linear, constant" in found.message
    assert found.hint == "did you mean cosine?"


def test_a_master_dtype_outside_the_choices_is_refused_with_them() -> None:
    found = only_problem(with_model("training:\n  drafter_master_dtype: float16\n"))
    assert (found.code, found.path) == ("invalid-value", "training.drafter_master_dtype")
    assert "float32, bfloat16" in found.message


def test_the_precision_fields_default_to_tf32_and_float32_master_weights() -> None:
    recipe, found = structure(with_model(""))
    assert found == [] and recipe is not None
    assert recipe.training.tf32 is True
    assert recipe.training.drafter_master_dtype == "float32"
    recipe, found = structure(
        with_model("training:\n  tf32: false\n  drafter_master_dtype: bfloat16\n")
    )
    assert found == [] and recipe is not None
    assert (recipe.training.tf32, recipe.training.drafter_master_dtype) == (False, "bfloat16")


def test_literal_of_wrong_type_lists_allowed_values() -> None:
    found = only_problem(
        with_model("dflash:\n  dflash_architecture_config:\n    projector_type: 3\n")
    )
    assert found.code == "wrong-type"
    assert found.hint == "use one of: dflash, domino, dspark, dflash2"


def test_unknown_nested_key_has_did_you_mean_and_position() -> None:
    text = with_model("dflash:\n  dflash_blok_size: 16\n")
    found = only_problem(text)
    assert (found.code, found.path) == ("unknown-key", "dflash.dflash_blok_size")
    assert found.hint == "did you mean dflash_block_size?"
    assert (found.line, found.column) == (line_of(text, "dflash_blok_size"), 3)


def test_unknown_top_level_key_has_did_you_mean() -> None:
    text = "modle:\n  model_name_or_path: /m\nmodel:\n  model_name_or_path: /m\n"
    found = only_problem(text)
    assert (found.code, found.path, found.line, found.column) == ("unknown-key", "modle", 1, 1)
    assert "top level" in found.message
    assert found.hint == "did you mean model?"


def test_unknown_key_in_the_deepest_section() -> None:
    text = with_model("dflash:\n  dflash_architecture_config:\n    num_hiden_layers: 5\n")
    found = only_problem(text)
    assert found.path == "dflash.dflash_architecture_config.num_hiden_layers"
    assert found.hint == "did you mean num_hidden_layers?"


def test_key_in_the_wrong_section_says_where_it_belongs() -> None:
    found = only_problem(with_model("dflash:\n  learning_rate: 1e-4\n"))
    assert found.code == "unknown-key"
    assert found.hint is not None and "training.learning_rate" in found.hint


def test_unrelated_unknown_key_lists_the_valid_keys() -> None:
    found = only_problem(with_model("data:\n  zzz: 1\n"))
    assert found.hint is not None
    assert "data_path" in found.hint and "answer_only_loss" in found.hint


@pytest.mark.parametrize(
    ("body", "path", "message_part"),
    [
        ("dflash:\n  dflash_block_size: 1\n", "dflash.dflash_block_size", "[2, 128]"),
        ("dflash:\n  dflash_dpace_alpha: 0\n", "dflash.dflash_dpace_alpha", "(0, 1]"),
        ("training:\n  warmup_ratio: 1.5\n", "training.warmup_ratio", "[0, 1)"),
        ("training:\n  learning_rate: -1\n", "training.learning_rate", "> 0"),
        ("training:\n  learning_rate: .nan\n", "training.learning_rate", "finite"),
        (
            "dflash:\n  dflash_architecture_config:\n    head_dim: 127\n",
            "dflash.dflash_architecture_config.head_dim",
            "even",
        ),
        (
            "dflash:\n  dflash_architecture_config:\n    target_layer_ids: [1, -9]\n",
            "dflash.dflash_architecture_config.target_layer_ids",
            "integers in [0, 4095], got -9",
        ),
        ("model:\n  model_name_or_path: '  '\n", "model.model_name_or_path", "non-empty"),
    ],
)
def test_validator_failures_are_diagnostics_at_the_field(
    body: str, path: str, message_part: str
) -> None:
    text = body if body.startswith("model:") else with_model(body)
    found = only_problem(text)
    assert (found.code, found.path) == ("invalid-value", path)
    assert message_part in found.message
    assert found.line == line_of(text, path.rpartition(".")[2])
    assert found.hint is not None and "change the value" in found.hint


def test_validator_hint_names_the_default() -> None:
    found = only_problem(with_model("dflash:\n  dflash_block_size: 200\n"))
    assert found.hint == "change the value, or delete the key to use the default (16)"


def test_missing_required_key_is_located_at_its_section() -> None:
    found = only_problem("model:\n  dtype: bfloat16\n")
    assert (found.code, found.path, found.line, found.column) == (
        "missing-field",
        "model.model_name_or_path",
        1,
        1,
    )
    assert found.hint is not None and "model_name_or_path:" in found.hint


def test_missing_model_section() -> None:
    text = "training:\n  seed: 1\n"
    found = only_problem(text)
    assert (found.code, found.path) == ("missing-field", "model")
    assert found.hint is not None and "model:\n  model_name_or_path:" in found.hint


def test_empty_section_is_not_a_mapping() -> None:
    found = only_problem(with_model("data:\n"))
    assert (found.code, found.path, found.line) == ("not-a-mapping", "data", 3)
    assert found.hint is not None and "delete the empty section" in found.hint


def test_section_that_is_a_list_is_not_a_mapping() -> None:
    found = only_problem(with_model("training:\n  - seed\n"))
    assert (found.code, found.path) == ("not-a-mapping", "training")
    assert "got a list" in found.message


@pytest.mark.parametrize(("data", "word"), [([1, 2], "a list"), ("text", "the string"), (5, "5")])
def test_top_level_that_is_not_a_mapping(data: object, word: str) -> None:
    recipe, found = structure_recipe(data, source=SourceMap(file="r.yaml"))
    assert recipe is None
    assert [(d.code, d.path, d.file) for d in found] == [("not-a-mapping", "", "r.yaml")]
    assert word in found[0].message


def test_three_problems_are_reported_at_once_in_file_order() -> None:
    text = (
        "model:\n"
        "  model_name_or_path: /m\n"
        "  trust_remote_code: yes\n"
        "training:\n"
        "  num_train_epochs: 2.7\n"
        "dflash:\n"
        "  dflash_blok_size: 8\n"
    )
    recipe, found = structure(text)
    assert recipe is None
    assert [(d.code, d.path, d.line) for d in found] == [
        ("wrong-type", "model.trust_remote_code", 3),
        ("wrong-type", "training.num_train_epochs", 5),
        ("unknown-key", "dflash.dflash_blok_size", 7),
    ]


def test_dotted_key_written_flat_is_explained() -> None:
    found = only_problem(with_model("dflash.dflash_block_size: 8\n"))
    assert (found.code, found.path) == ("unknown-key", "dflash.dflash_block_size")
    assert (
        found.hint == "YAML keys are not split at dots; nest it:\ndflash:\n  dflash_block_size: ..."
    )


def test_integer_too_large_for_a_float_field() -> None:
    found = only_problem(with_model(f"training:\n  learning_rate: {'9' * 400}\n"))
    assert (found.code, found.path) == ("invalid-value", "training.learning_rate")
    assert "400 digits" in found.message


def test_every_bad_list_item_is_located() -> None:
    text = with_model("dflash:\n  dflash_architecture_config:\n    target_layer_ids: [1, x, 2.5]\n")
    recipe, found = structure(text)
    assert recipe is None
    prefix = "dflash.dflash_architecture_config.target_layer_ids"
    assert [(d.path, d.column) for d in found] == [
        (f"{prefix}.1", column_of(text, "x,")),
        (f"{prefix}.2", column_of(text, "2.5")),
    ]


def test_every_diagnostic_code_is_registered_as_an_error() -> None:
    text = (
        "modle: 1\nmodel:\n  dtype: float8\n  trust_remote_code: 1\ndata: 3\n"
        "dflash:\n  dflash_block_size: 0\n"
    )
    _, found = structure(text)
    registered = {info.code: info for info in registered_codes()}
    assert {d.code for d in found} == {
        "unknown-key",
        "invalid-value",
        "wrong-type",
        "not-a-mapping",
        "missing-field",
    }
    for diagnostic in found:
        assert registered[diagnostic.code].severity is Severity.ERROR
        assert diagnostic.hint, f"{diagnostic.code} at {diagnostic.path} has no fix"


def test_unstructure_gives_lists_and_round_trips() -> None:
    recipe = Recipe(
        model=ModelSection(model_name_or_path="/m"),
    )
    recipe = attrs.evolve(
        recipe,
        dflash=attrs.evolve(
            recipe.dflash,
            dflash_architecture_config=DFlashArchitectureConfig(target_layer_ids=(1, 9, 17)),
        ),
    )
    data = unstructure_recipe(recipe)
    dflash = data["dflash"]
    assert isinstance(dflash, dict)
    assert dflash["dflash_architecture_config"]["target_layer_ids"] == [1, 9, 17]
    again, found = structure_recipe(data, source=SourceMap())
    assert found == [] and again == recipe


def _dotted(data: object, prefix: str = "") -> set[str]:
    if not isinstance(data, dict):
        return set()
    paths: set[str] = set()
    for key, value in data.items():
        paths.add(prefix + key)
        paths |= _dotted(value, f"{prefix}{key}.")
    return paths


def test_field_paths_are_exactly_the_keys_a_full_recipe_has() -> None:
    paths = recipe_field_paths()
    served = TargetServerSection(urls=("http://gpu0:8000",), storage_dir="/dev/shm/hs")
    full = Recipe(model=ModelSection(model_name_or_path="/m"), target_server=served)
    assert paths == _dotted(unstructure_recipe(full))  # an optional section's fields too
    assert "target_server.urls" in paths
    assert {"model", "dflash", "dflash.dflash_architecture_config"} <= paths
    assert "dflash.dflash_architecture_config.target_layer_ids" in paths
    assert "dflash.learning_rate" not in paths


_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_junk = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_field_names = st.sampled_from(sorted({p.rpartition(".")[2] for p in recipe_field_paths()}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(["model", "data", "training", "dflash", "extra"]),
        st.dictionaries(_field_names, _junk, max_size=4) | _junk,
        max_size=4,
    )
)
def test_any_data_gives_a_recipe_or_located_errors_never_an_exception(
    data: dict[str, object],
) -> None:
    recipe, found = structure_recipe(data, source=SourceMap(file="r.yaml"))
    assert (recipe is None) == bool(found)
    codes = {info.code for info in registered_codes()}
    for diagnostic in found:
        assert diagnostic.severity is Severity.ERROR
        assert diagnostic.code in codes
        assert diagnostic.message and diagnostic.hint
        assert diagnostic.file == "r.yaml"


def _sample(tp: object) -> object:
    """A plain-data value of type `tp`, as YAML would give it."""
    member = tp
    args = typing.get_args(tp)
    if type(None) in args:  # X | None
        (member,) = [arg for arg in args if arg is not type(None)]
    origin = typing.get_origin(member)
    if origin is typing.Literal:
        return typing.get_args(member)[0]
    if origin is tuple:
        return [_sample(typing.get_args(member)[0])]
    samples: dict[object, object] = {str: "x", int: 1, float: 0.5, bool: True}
    assert member in samples, f"no sample for {member!r}: teach this test the new field type"
    return samples[member]


def test_every_field_type_of_the_recipe_has_a_structuring_rule() -> None:
    # The converter dispatches by kind of type itself; a field of a new kind must get a rule
    # (this fails with "no structuring rule" for one that has none), not reach users as a crash.
    seen = 0

    def walk(cls: type) -> None:
        nonlocal seen
        hints = field_types(cls)
        for field in attrs.fields(cls):
            tp = hints[field.name]
            section = _optional_section(tp)
            if section is not None:
                walk(section)
                continue
            value = convert(_sample(tp), tp)
            assert value is not None and not isinstance(value, list), (field.name, value)
            seen += 1

    walk(Recipe)
    leaves = [path for path in recipe_field_paths() if _optional_section(_section_at(path)) is None]
    assert seen == len(leaves) > 50


def _optional_section(tp: object) -> type | None:
    """The section class of `tp` or of `tp | None` (target_server), else None."""
    members = [arg for arg in typing.get_args(tp) if arg is not type(None)] or [tp]
    member = members[0]
    if len(members) == 1 and isinstance(member, type) and attrs.has(member):
        return member
    return None


def _section_at(path: str) -> object:
    cls: object = Recipe
    for name in path.split("."):
        cls = _optional_section(cls) or cls
        assert isinstance(cls, type)
        cls = field_types(cls)[name]
    return cls
