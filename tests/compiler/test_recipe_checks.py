"""Schema-level checks: cross-field rules on the recipe alone, no file read (what lint runs)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from pathlib import Path

import pytest
from testkit.compiling import codes, only

from dflash_recipes.compiler.compilation import (
    CompileResult,
    compile_recipe,
)
from dflash_recipes.diagnostics import (
    Severity,
)
from dflash_recipes.recipe.sections import Recipe

RecipeFactory = Callable[..., Recipe]


ARCH = "dflash.dflash_architecture_config"


def lint(recipe: Recipe, **kwargs: object) -> CompileResult:
    return compile_recipe(recipe, resolve=False, **kwargs)  # type: ignore[arg-type]


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


@pytest.mark.parametrize(
    ("training", "data", "missing"),
    [
        ({"eval_min_tau": 3.0}, {}, "data.eval_data_path (or data.eval_holdout) is not set"),
        (
            {"eval_min_tau": 3.0, "eval_steps": 10},
            {},
            "data.eval_data_path (or data.eval_holdout) is not set",
        ),
        (
            {"eval_min_tau": 3.0, "eval_steps": 0},
            {"eval_data_path": "train.jsonl"},
            "training.eval_steps is not set (or 0)",
        ),
        (
            {"eval_min_tau": 3.0, "eval_steps": 0},
            {},
            "training.eval_steps and data.eval_data_path (or data.eval_holdout) are not set (or 0)",
        ),
    ],
)
def test_an_acceptance_gate_without_a_measurement_is_an_error(
    make_recipe: RecipeFactory, training: dict[str, object], data: dict[str, object], missing: str
) -> None:
    result = lint(make_recipe(training=training, data=data, dflash={"dflash_mask_token_id": 1}))
    assert not result.ok
    d = only(result, "eval-gate-unmeasured")
    assert d.path == "training.eval_min_tau"
    assert missing in d.message and "would always fail the gate" in d.message
    assert d.hint is not None and "training.eval_min_tau: null" in d.hint
    measured = {"eval_min_tau": 3.0, "eval_steps": 10}
    gated = make_recipe(training=measured, data={"eval_data_path": "train.jsonl"})
    assert "eval-gate-unmeasured" not in codes(lint(gated))
    # eval_steps null with eval data measures by default (every save_steps, and the final step)
    by_default = make_recipe(training={"eval_min_tau": 3.0}, data={"eval_data_path": "t.jsonl"})
    assert "eval-gate-unmeasured" not in codes(lint(by_default))


def test_fsdp_evaluates_during_training_as_without_it(make_recipe: RecipeFactory) -> None:
    """Every rank measures in step under FSDP (issue 51): no refusal, and the default interval
    is every save_steps, as without it."""
    for training in ({"fsdp": True, "eval_steps": 10}, {"fsdp": True, "eval_min_tau": 2.0}):
        result = lint(make_recipe(training=training, data={"eval_data_path": "t.jsonl"}))
        assert result.ok, [(d.code, d.message) for d in result.diagnostics]
    compiled = compile_recipe(
        make_recipe(training={"fsdp": True}, data={"eval_data_path": "t.jsonl"}), resolve=False
    )
    assert compiled.plan is not None, compiled.diagnostics
    assert compiled.plan.training.eval_steps == compiled.plan.training.save_steps


def test_a_held_out_slice_is_eval_data_for_every_eval_rule(make_recipe: RecipeFactory) -> None:
    """data.eval_holdout counts as eval data: the default interval and the gate."""
    holdout = {"eval_holdout": 8}
    plain = lint(make_recipe(training={"eval_steps": 50}, data=holdout))
    assert "eval-data-unset" not in codes(plain)
    default = compile_recipe(make_recipe(data=holdout), resolve=False)
    assert default.plan is not None
    assert default.plan.training.eval_steps == default.plan.training.save_steps
    assert default.plan.data.eval_holdout == 8 and default.plan.data.has_eval_data
    gated = lint(make_recipe(training={"eval_min_tau": 3.0}, data=holdout))
    assert "eval-gate-unmeasured" not in codes(gated)


def test_a_held_out_slice_and_an_eval_file_are_refused_together(
    make_recipe: RecipeFactory,
) -> None:
    result = lint(make_recipe(data={"eval_holdout": 8, "eval_data_path": "held.jsonl"}))
    assert not result.ok
    d = only(result, "eval-data-twice")
    assert d.path == "data.eval_holdout"
    assert d.message == (
        "data.eval_holdout is 8 and data.eval_data_path is set: the run would have two sets of "
        "held-out conversations"
    )
    assert d.hint is not None
    assert "data.eval_holdout: 0" in d.hint and "remove data.eval_data_path" in d.hint


def test_a_held_out_slice_of_a_capture_is_refused(make_recipe: RecipeFactory) -> None:
    result = lint(make_recipe(data={"eval_holdout": 8, "hidden_states_path": "capture"}))
    d = only(result, "eval-holdout-offline")
    assert d.severity is Severity.ERROR and d.path == "data.eval_holdout"
    assert "offline training reads every conversation of the capture" in d.message
    assert d.hint is not None and "set data.eval_data_path" in d.hint


def test_a_slice_smaller_than_the_prompts_of_a_measurement_warns(
    make_recipe: RecipeFactory,
) -> None:
    small = lint(make_recipe(data={"eval_holdout": 2}, training={"eval_num_prompts": 4}))
    assert small.ok
    d = only(small, "eval-holdout-small")
    assert d.message == (
        "data.eval_holdout is 2, fewer than training.eval_num_prompts (4): each measurement "
        "drafts on 2 prompt(s)"
    )
    enough = lint(make_recipe(data={"eval_holdout": 4}, training={"eval_num_prompts": 4}))
    assert "eval-holdout-small" not in codes(enough)
    none = lint(make_recipe(training={"eval_num_prompts": 4}))
    assert not codes(none) & {"eval-holdout-small", "eval-data-twice", "eval-holdout-offline"}


def test_schema_level_mask_is_required_only_without_a_checkpoint(
    make_recipe: RecipeFactory,
) -> None:
    assert lint(make_recipe(init="drafter")).ok  # the checkpoint's config may state it
    result = lint(make_recipe(init=None))
    assert only(result, "mask-token-missing").severity is Severity.ERROR


@pytest.mark.parametrize(("prefix", "ok"), [(0, True), (1, True), (7, True), (8, False)])
def test_pure_draft_prefix_len_must_leave_a_position_to_correct(
    make_recipe: RecipeFactory, prefix: int, ok: bool
) -> None:
    arch = {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8}
    result = lint(
        make_recipe(arch={**arch, "pure_draft_prefix_len": prefix}, dflash={"dflash_block_size": 8})
    )
    codes = [d.code for d in result.diagnostics]
    assert ("pure-draft-prefix-range" not in codes) is ok
    if not ok:
        d = only(result, "pure-draft-prefix-range")
        assert d.severity is Severity.ERROR and d.path == f"{ARCH}.pure_draft_prefix_len"
        assert "must lie in [0, 7] (dflash_block_size 8 minus 1)" in d.message
        assert "set dflash_architecture_config.pure_draft_prefix_len: 1" in d.hint
        assert result.plan is None


def test_pure_draft_prefix_len_is_domino_only(make_recipe: RecipeFactory) -> None:
    """A plain drafter has no head to leave uncorrected: the field changes nothing there."""
    result = lint(make_recipe(arch={"pure_draft_prefix_len": 40}, dflash={"dflash_block_size": 8}))
    assert "pure-draft-prefix-range" not in [d.code for d in result.diagnostics]
