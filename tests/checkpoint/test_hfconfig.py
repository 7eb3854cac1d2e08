"""Reading config.json of base models and drafter checkpoints: flat and nested layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.st_fixtures import base_model_config, drafter_config, write_json

from dflash_recipes.checkpoint.config_bounds import (
    MAX_LAYER_INDEX,
    MAX_LIST_ENTRIES,
    PLAUSIBLE_MAXIMA,
)
from dflash_recipes.checkpoint.hfconfig import (
    checkpoint_config_from_mapping,
    read_checkpoint_config,
    read_target_config,
    target_config_from_mapping,
)
from dflash_recipes.diagnostics import Severity
from dflash_recipes.plan.run_plan import RopePlan


def codes(problems: object) -> list[str]:
    return [p.code for p in problems]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# base model: RoPE in every layout, never a class default
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["flat", "nested"])
def test_rope_theta_is_read_from_flat_and_transformers5_layouts(layout: str) -> None:
    config = base_model_config(rope_theta=1_000_000.0, rope_layout=layout)  # type: ignore[arg-type]
    read = target_config_from_mapping(config, "config.json")
    assert read.problems == ()
    assert read.facts is not None
    assert read.facts.rope == RopePlan(rope_theta=1_000_000.0, rope_type="default")
    assert (read.facts.hidden_size, read.facts.num_hidden_layers, read.facts.vocab_size) == (
        32,
        8,
        256,
    )


def test_missing_rope_theta_is_a_problem_not_10000() -> None:
    config = base_model_config()
    del config["rope_theta"]
    read = target_config_from_mapping(config, "config.json")
    assert read.facts is None
    [problem] = read.problems
    assert problem.code == "target-rope-missing"
    assert problem.severity is Severity.ERROR
    assert "rope_parameters.rope_theta" in problem.message
    assert "10000" in problem.message  # says it will not substitute the class default
    assert problem.hint is not None and "rope_theta" in problem.hint


def test_llama3_scaling_keeps_type_and_parameters() -> None:
    config = base_model_config(rope_theta=500_000.0)
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    read = target_config_from_mapping(config, "config.json")
    assert read.facts is not None
    rope = read.facts.rope
    assert (rope.rope_theta, rope.rope_type) == (500_000.0, "llama3")
    assert rope.rope_scaling == {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_legacy_type_key_names_the_rope_type() -> None:
    config = base_model_config(rope_theta=10_000.0)
    config["rope_scaling"] = {"type": "linear", "factor": 2.0}
    read = target_config_from_mapping(config, "config.json")
    assert read.facts is not None
    assert read.facts.rope == RopePlan(10_000.0, "linear", {"factor": 2.0})


def test_rope_parameters_per_layer_type_use_the_full_attention_entry() -> None:
    config = base_model_config()
    del config["rope_theta"]
    config["layer_types"] = ["sliding_attention", "full_attention"] * 4
    config["rope_parameters"] = {
        "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        "full_attention": {"rope_theta": 1_000_000.0, "rope_type": "default"},
    }
    read = target_config_from_mapping(config, "config.json")
    assert read.facts is not None
    assert read.facts.rope.rope_theta == 1_000_000.0


def test_conflicting_flat_and_nested_theta_warns_and_takes_the_nested_one() -> None:
    config = base_model_config(rope_theta=10_000.0)
    config["rope_parameters"] = {"rope_theta": 1_000_000.0, "rope_type": "default"}
    read = target_config_from_mapping(config, "config.json")
    assert read.facts is not None
    assert read.facts.rope.rope_theta == 1_000_000.0
    [problem] = read.problems
    assert problem.code == "target-rope-conflict"
    assert problem.severity is Severity.WARNING
    assert "1000000.0" in problem.message and "10000.0" in problem.message


def test_non_scalar_rope_parameter_is_left_out_with_a_warning() -> None:
    config = base_model_config()
    config["rope_scaling"] = {"rope_type": "default", "mrope_section": [16, 24, 24]}
    read = target_config_from_mapping(config, "config.json")
    assert read.facts is not None and read.facts.rope.rope_scaling is None
    assert codes(read.problems) == ["target-rope-parameter-dropped"]
    assert "mrope_section" in read.problems[0].message


def test_multimodal_text_config_is_read() -> None:
    text = base_model_config(hidden=64, layers=12, vocab=1000, rope_layout="nested")
    config = {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "text_config": text,
        "vision_config": {"hidden_size": 1152},
    }
    read = target_config_from_mapping(config, "config.json")
    assert read.problems == ()
    assert read.from_text_config
    assert read.facts is not None
    assert (read.facts.hidden_size, read.facts.num_hidden_layers, read.facts.vocab_size) == (
        64,
        12,
        1000,
    )
    assert read.facts.model_type == "qwen3_vl"


@pytest.mark.parametrize(
    ("key", "value"),
    [("hidden_size", None), ("num_hidden_layers", True), ("vocab_size", 0), ("hidden_size", 3.5)],
)
def test_missing_or_bad_required_fields_are_named(key: str, value: object) -> None:
    config = base_model_config()
    if value is None:
        del config[key]
    else:
        config[key] = value
    read = target_config_from_mapping(config, "config.json")
    assert read.facts is None
    assert [p.code for p in read.problems] == ["target-config-field"]
    assert read.problems[0].key == key
    assert key in read.problems[0].message


def test_head_dim_suggestion_follows_transformers_rule_when_absent() -> None:
    config = base_model_config(hidden=64, heads=8)
    del config["head_dim"]
    read = target_config_from_mapping(config, "config.json")
    assert read.head_dim == 8


def test_unreadable_target_config_is_a_problem(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 32,', encoding="utf-8")
    read = read_target_config(tmp_path)
    assert read.facts is None
    assert codes(read.problems) == ["target-config-unreadable"]
    assert read.path == str(tmp_path / "config.json")  # the compiler names the file
    assert "invalid JSON at line 1" in read.problems[0].message


def test_target_config_with_duplicate_keys_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 32, "hidden_size": 64}', encoding="utf-8"
    )
    assert codes(read_target_config(tmp_path).problems) == ["target-config-unreadable"]


# ---------------------------------------------------------------------------------------------
# drafter checkpoint config.json
# ---------------------------------------------------------------------------------------------


def test_exported_layout_nested_dflash_config() -> None:
    config = drafter_config(target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669)
    facts = checkpoint_config_from_mapping(config, "config.json")
    assert facts.problems == ()
    assert facts.target_layer_ids == (1, 9, 17, 25, 33)
    assert facts.mask_token_id == 151669
    assert facts.block_size == 16
    assert facts.rope_theta == 1_000_000.0
    assert facts.rms_norm_eps == 1e-6
    assert facts.num_target_layers == 8
    assert facts.architecture() == {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
    }


def test_flat_layout_without_dflash_config() -> None:
    config = drafter_config()
    del config["dflash_config"]
    config.update({"block_size": 10, "mask_token_id": 7, "target_layer_ids": [2, 4]})
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    facts = checkpoint_config_from_mapping(config, "config.json")
    assert facts.problems == ()
    assert (facts.block_size, facts.mask_token_id, facts.target_layer_ids) == (10, 7, (2, 4))
    assert (facts.rope_theta, facts.rope_type) == (5e5, "default")


def test_nested_block_size_wins_over_a_stale_flat_one_with_a_warning() -> None:
    config = drafter_config(block_size=16)
    config["block_size"] = 10
    facts = checkpoint_config_from_mapping(config, "config.json")
    assert facts.block_size == 16
    assert codes(facts.problems) == ["checkpoint-config-conflict"]
    assert "block_size: 10" in facts.problems[0].message


def test_variant_fields_are_read_from_dflash_config() -> None:
    config = drafter_config(variant={"projector_type": "dspark", "markov_rank": 16})
    facts = checkpoint_config_from_mapping(config, "config.json")
    assert (facts.projector_type, facts.markov_rank) == ("dspark", 16)


def test_bad_checkpoint_fields_are_ignored_with_a_warning() -> None:
    config = drafter_config()
    config["dflash_config"] = {"mask_token_id": "151669", "target_layer_ids": [1, -2]}
    facts = checkpoint_config_from_mapping(config, "config.json")
    assert facts.mask_token_id is None and facts.target_layer_ids is None
    assert sorted(p.key for p in facts.problems) == [
        "dflash_config.mask_token_id",
        "dflash_config.target_layer_ids",
    ]
    assert all(p.severity is Severity.WARNING for p in facts.problems)


def test_missing_and_unreadable_checkpoint_config(tmp_path: Path) -> None:
    missing = read_checkpoint_config(tmp_path)
    assert not missing.present and missing.problems == () and missing.mask_token_id is None
    (tmp_path / "config.json").write_text("[1, 2]", encoding="utf-8")
    broken = read_checkpoint_config(tmp_path)
    assert broken.present and not broken.readable
    assert codes(broken.problems) == ["checkpoint-config-unreadable"]


def test_read_checkpoint_config_from_a_directory(tmp_path: Path) -> None:
    write_json(tmp_path / "config.json", drafter_config(mask_token_id=3))
    facts = read_checkpoint_config(tmp_path)
    assert facts.readable and facts.mask_token_id == 3


# ---------------------------------------------------------------------------------------------
# implausible sizes: refused before anything is sized by them (issue 36)
# ---------------------------------------------------------------------------------------------

TARGET_SIZES = ("hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings")


@pytest.mark.parametrize("key", TARGET_SIZES)
def test_a_target_size_at_its_bound_is_read_and_one_beyond_is_an_error(key: str) -> None:
    bound = PLAUSIBLE_MAXIMA[key]
    at = target_config_from_mapping({**base_model_config(), key: bound}, "config.json")
    assert at.facts is not None and getattr(at.facts, key) == bound
    for beyond in (bound + 1, 10**19):
        read = target_config_from_mapping({**base_model_config(), key: beyond}, "config.json")
        assert read.facts is None
        (problem,) = read.problems
        assert (problem.code, problem.severity, problem.key) == (
            "target-config-field",
            Severity.ERROR,
            key,
        )
        assert problem.message == f"`{key}` must be an integer in [1, {bound}], got {beyond}"


@pytest.mark.parametrize("key", sorted(set(PLAUSIBLE_MAXIMA) - {"block_size", "mask_token_id"}))
def test_a_checkpoint_size_beyond_its_bound_is_ignored_with_a_warning(key: str) -> None:
    bound = PLAUSIBLE_MAXIMA[key]
    config = drafter_config()
    config[key] = bound + 1
    config.setdefault("dflash_config", {})
    config["dflash_config"][key] = bound + 1  # type: ignore[index]
    facts = checkpoint_config_from_mapping(config, "config.json")
    if hasattr(facts, key):
        assert getattr(facts, key) is None
    flagged = [p for p in facts.problems if p.key.endswith(key)]
    assert flagged and all(p.severity is Severity.WARNING for p in flagged)
    assert f"must be an integer in [1, {bound}], got {bound + 1}" in flagged[0].message


def test_taps_and_layer_types_beyond_their_bounds_are_ignored_with_a_warning() -> None:
    config = drafter_config()
    config["dflash_config"] = {"target_layer_ids": [1, MAX_LAYER_INDEX + 1]}
    config["layer_types"] = ["full_attention"] * (MAX_LIST_ENTRIES + 1)
    facts = checkpoint_config_from_mapping(config, "config.json")
    assert facts.target_layer_ids is None and facts.layer_types is None
    messages = sorted(p.message for p in facts.problems)
    assert messages[0].startswith(
        f"`dflash_config.target_layer_ids` must be a list of at most {MAX_LIST_ENTRIES} integers "
        f"in [0, {MAX_LAYER_INDEX}], got [1, {MAX_LAYER_INDEX + 1}]"
    )
    assert messages[1].startswith(
        f"`layer_types` must be a list of at most {MAX_LIST_ENTRIES} entries, got ['full_attention'"
    )
    assert "more characters)" in messages[1]  # the list is echoed clipped


def test_a_megabyte_value_is_echoed_clipped() -> None:
    read = target_config_from_mapping({**base_model_config(), "hidden_size": "x" * 3_000_000}, "c")
    (problem,) = read.problems
    assert problem.message == (
        f"`hidden_size` must be an integer >= 1, got {'x' * 120!r}... (2999880 more characters)"
    )


def test_an_unknown_projector_type_names_every_kind_it_could_be() -> None:
    config = drafter_config(variant={"projector_type": "medusa"})
    facts = checkpoint_config_from_mapping(config, "config.json")
    assert facts.projector_type is None
    (problem,) = [p for p in facts.problems if p.key == "dflash_config.projector_type"]
    assert "one of dflash, domino, dspark, dflash2" in problem.message
    dflash2 = checkpoint_config_from_mapping(
        drafter_config(variant={"projector_type": "dflash2"}), "config.json"
    )
    assert dflash2.projector_type == "dflash2"
