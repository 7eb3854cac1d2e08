"""Resolved compilation: paths, resume, and the cross-checks of a warm start (issue 3).

Each test builds a tiny target and drafter in tmp_path, compiles, and asserts the diagnostic a
user would see: its code, the recipe path it points at, and the facts and fix in its text.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from testkit.compiling import (
    RecipeFactory,
    codes,
    compile_in,
    make_training_checkpoint,
    only,
    recompile_after_checkpoint_without_drafter,
)
from testkit.st_fixtures import (
    base_model_config,
    drafter_config,
    write_base_model,
    write_drafter_checkpoint,
    write_json,
    write_raw_safetensors,
)

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.diagnostics import Severity

ARCH = "dflash.dflash_architecture_config"


# ---------------------------------------------------------------------------------------------
# the happy path and what the plan records (cross-check 7)
# ---------------------------------------------------------------------------------------------


def test_matching_warm_start_compiles_and_records_the_checkpoint(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe())
    assert result.ok, result.diagnostics
    assert not [d for d in result.diagnostics if d.severity is not Severity.INFO]
    plan = result.plan
    assert plan is not None and plan.resolved
    init = plan.init_checkpoint
    assert init is not None
    assert init.path == str(drafter)
    assert init.weight_files == ("model.safetensors",)
    assert init.tensor_count == 3 + 11 * 2
    assert init.dtypes == ("BF16",)
    assert init.config_present
    assert (init.trained_block_size, init.target_layer_ids, init.mask_token_id) == (16, (1, 5), 250)
    assert init.heads_from_scratch == ()
    assert plan.resume is None
    assert plan.base_model.path == str(tmp_path / "base")
    assert plan.data.data_path == str(tmp_path / "train.jsonl")
    assert plan.training.output_dir == str(tmp_path / "outputs" / "dflash")


def test_sharded_checkpoint_is_read_from_its_index(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", shards=3, dtype="F32")
    result = compile_in(tmp_path, make_recipe())
    assert result.ok, result.diagnostics
    init = result.plan.init_checkpoint  # type: ignore[union-attr]
    assert init is not None
    assert init.weight_files == tuple(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
    assert init.tensor_count == 25
    assert init.dtypes == ("F32",)


def test_sharded_checkpoint_with_a_missing_shard_is_an_error(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    ckpt = write_drafter_checkpoint(tmp_path / "drafter", shards=2)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "init-checkpoint-bad-weights")
    assert "model-00002-of-00002.safetensors" in d.message


def test_flat_checkpoint_config_layout_supplies_taps_mask_and_block(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    config = drafter_config()
    del config["dflash_config"]
    config.update({"block_size": 8, "mask_token_id": 201, "target_layer_ids": [2, 6]})
    write_drafter_checkpoint(tmp_path / "drafter", config=config)
    result = compile_in(tmp_path, make_recipe())
    assert result.plan is not None and result.plan.init_checkpoint is not None
    assert result.plan.draft.target_layer_ids == (2, 6)
    assert result.plan.draft.mask_token_id == 201
    assert result.plan.init_checkpoint.trained_block_size == 8
    assert only(result, "checkpoint-block-size-differs").severity is Severity.INFO


def test_base_model_rope_goes_into_the_plan_from_either_layout(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_base_model(tmp_path / "base", rope_theta=250_000.0, rope_layout="nested")
    write_drafter_checkpoint(
        tmp_path / "drafter", config=drafter_config() | {"rope_theta": 250_000.0}
    )
    result = compile_in(tmp_path, make_recipe())
    assert result.ok, result.diagnostics
    facts = result.plan.base_model.facts  # type: ignore[union-attr]
    assert facts is not None and facts.rope.rope_theta == 250_000.0
    assert result.plan.resolved_draft().rope.rope_theta == 250_000.0  # type: ignore[union-attr]


def test_target_without_rope_theta_is_an_error_never_10000(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    config = base_model_config()
    del config["rope_theta"]
    write_base_model(tmp_path / "base", config=config)
    result = compile_in(tmp_path, make_recipe())
    assert result.plan is None
    d = only(result, "target-rope-missing")
    assert d.path == "model.model_name_or_path"
    assert str(tmp_path / "base" / "config.json") in d.message
    assert "rope_theta" in d.message and "10000" in d.message


# ---------------------------------------------------------------------------------------------
# resolving the base model and the init checkpoint
# ---------------------------------------------------------------------------------------------


def test_hub_id_init_checkpoint_says_how_to_stage_it(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    result = compile_in(tmp_path, make_recipe(init="z-lab/Qwen3-8B-DFlash-b16"))
    assert result.plan is None
    d = only(result, "init-checkpoint-hub-id")
    assert d.path == "dflash.dflash_init_checkpoint"
    assert "hub ids are not fetched" in d.message
    assert d.hint is not None
    assert "hf download z-lab/Qwen3-8B-DFlash-b16 --local-dir" in d.hint
    # a checkpoint that cannot be read does not also produce guesses about taps or mask
    assert not codes(result) & {"taps-unknown", "mask-token-missing"}


def test_hub_id_base_model_says_how_to_stage_it(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(model="Qwen/Qwen3-8B"))
    d = only(result, "base-model-hub-id")
    assert d.path == "model.model_name_or_path"
    assert "hf download Qwen/Qwen3-8B --local-dir" in (d.hint or "")


def test_base_model_without_config_lists_the_folder(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    (tmp_path / "base" / "config.json").unlink()
    (tmp_path / "base" / "model.safetensors").write_bytes(b"")
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "base-model-no-config")
    assert "config.json" in d.message and "model.safetensors" in d.message


@pytest.mark.parametrize(
    ("make", "code", "fact"),
    [
        (lambda base: None, "base-model-not-found", "does not exist"),
        (lambda base: base.write_text("{}"), "base-model-not-a-directory", "is a file"),
        (lambda base: base.mkdir(), "base-model-empty-directory", "is empty"),
        (lambda base: base.symlink_to(base.parent / "gone"), "base-model-broken-symlink", "gone"),
    ],
)
def test_unusable_base_model_directory(
    tmp_path: Path,
    make_recipe: RecipeFactory,
    drafter: Path,
    make: Callable[[Path], object],
    code: str,
    fact: str,
) -> None:
    shutil.rmtree(tmp_path / "base")
    make(tmp_path / "base")
    result = compile_in(tmp_path, make_recipe())
    d = only(result, code)
    assert d.path == "model.model_name_or_path"
    assert str(tmp_path / "base") in d.message and fact in d.message


def test_unreadable_base_model_config(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "base-model-unreadable")
    assert "config.json" in d.message and "not readable" in d.message


def test_bad_field_in_checkpoint_config_is_ignored_with_a_warning(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    config = drafter_config()
    config["dflash_config"]["mask_token_id"] = "151669"  # type: ignore[index]
    write_drafter_checkpoint(tmp_path / "drafter", config=config)
    result = compile_in(tmp_path, make_recipe(dflash={"dflash_mask_token_id": 250}))
    assert result.ok
    d = only(result, "checkpoint-config-field")
    assert d.path == "dflash.dflash_init_checkpoint"
    assert "dflash_config.mask_token_id" in d.message and "ignored" in d.message


def test_missing_init_checkpoint(tmp_path: Path, make_recipe: RecipeFactory) -> None:
    write_base_model(tmp_path / "base")
    result = compile_in(tmp_path, make_recipe(init="drafters/qwen3/gone"))
    d = only(result, "init-checkpoint-not-found")
    assert str(tmp_path / "drafters" / "qwen3" / "gone") in d.message


def test_init_checkpoint_that_is_a_file_points_at_its_folder(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(init="drafter/model.safetensors"))
    d = only(result, "init-checkpoint-not-a-directory")
    assert str(drafter) in (d.hint or "")


def test_empty_init_checkpoint_directory(tmp_path: Path, make_recipe: RecipeFactory) -> None:
    (tmp_path / "drafter").mkdir()
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "init-checkpoint-empty-directory")
    assert "model.safetensors" in d.message


def test_init_checkpoint_without_weights_lists_what_it_holds(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_json(tmp_path / "drafter" / "config.json", drafter_config())
    (tmp_path / "drafter" / "README.md").write_text("hi", encoding="utf-8")
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "init-checkpoint-no-weights")
    assert "README.md" in d.message and "config.json" in d.message
    assert "model.safetensors" in d.message


def test_broken_symlink_init_checkpoint(tmp_path: Path, make_recipe: RecipeFactory) -> None:
    (tmp_path / "drafter").symlink_to(tmp_path / "deleted-drafter")
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "init-checkpoint-broken-symlink")
    assert "deleted-drafter" in d.message


def test_unreadable_weights_file(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() == 0:  # root reads any file: make the permission check say no instead
        monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    (drafter / "model.safetensors").chmod(0)
    try:
        result = compile_in(tmp_path, make_recipe())
    finally:
        (drafter / "model.safetensors").chmod(0o644)
    d = only(result, "init-checkpoint-unreadable")
    assert d.path == "dflash.dflash_init_checkpoint"
    assert "not readable" in d.message and "chmod" in (d.hint or "")


def test_malformed_header_is_an_error_not_a_traceback(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    write_raw_safetensors(
        drafter / "model.safetensors", b'{"fc.weight": {"dtype": "BF16"', length=4
    )
    result = compile_in(tmp_path, make_recipe())
    assert result.plan is None
    d = only(result, "init-checkpoint-bad-weights")
    assert "model.safetensors" in d.message


def test_unreadable_checkpoint_config_is_an_error(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    (drafter / "config.json").write_text("{not json", encoding="utf-8")
    result = compile_in(tmp_path, make_recipe(dflash={"dflash_mask_token_id": 250}))
    d = only(result, "checkpoint-config-unreadable")
    assert d.path == "dflash.dflash_init_checkpoint"
    assert "config.json" in d.message


def test_unreadable_target_config_is_an_error(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    (tmp_path / "base" / "config.json").write_bytes(b"\xff\xfe")
    result = compile_in(tmp_path, make_recipe())
    assert only(result, "target-config-unreadable").path == "model.model_name_or_path"


# ---------------------------------------------------------------------------------------------
# data and output paths
# ---------------------------------------------------------------------------------------------


def test_data_path_unset_is_a_warning(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(data={"data_path": None}))
    assert result.ok
    d = only(result, "data-path-unset")
    assert d.severity is Severity.WARNING and d.path == "data.data_path"
    assert "dflash-recipe run" in d.message


@pytest.mark.parametrize("field", ["data_path", "chat_template", "eval_data_path"])
def test_named_data_files_must_exist(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path, field: str
) -> None:
    result = compile_in(tmp_path, make_recipe(data={field: "nope/file.jsonl"}))
    d = only(result, "data-file-missing")
    assert d.path == f"data.{field}"
    assert str(tmp_path / "nope" / "file.jsonl") in d.message and "does not exist" in d.message


def test_chat_template_that_is_a_directory(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    (tmp_path / "templates").mkdir()
    result = compile_in(tmp_path, make_recipe(data={"chat_template": "templates"}))
    assert "is a directory" in only(result, "data-file-missing").message


def test_output_dir_that_is_a_file(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    (tmp_path / "out").write_text("", encoding="utf-8")
    result = compile_in(tmp_path, make_recipe(training={"output_dir": "out"}))
    assert only(result, "output-dir-unusable").path == "training.output_dir"


# ---------------------------------------------------------------------------------------------
# resume
# ---------------------------------------------------------------------------------------------


def test_resume_ignores_a_deleted_init_checkpoint(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    recipe = make_recipe(arch={"target_layer_ids": (1, 5)}, dflash={"dflash_mask_token_id": 250})
    first = compile_in(tmp_path, recipe)
    assert first.ok
    make_training_checkpoint(tmp_path / "outputs" / "dflash", 100)
    newest = make_training_checkpoint(tmp_path / "outputs" / "dflash", 200)
    make_training_checkpoint(tmp_path / "outputs" / "dflash", 300, complete=False)
    shutil.rmtree(drafter)

    result = compile_in(tmp_path, recipe)
    assert result.ok, result.diagnostics
    plan = result.plan
    assert plan is not None
    assert plan.resume is not None
    assert (plan.resume.step, plan.resume.checkpoint_dir) == (200, str(newest))
    assert plan.init_checkpoint is None
    resume = only(result, "resume-from-checkpoint")
    assert resume.severity is Severity.INFO and resume.path == "training.output_dir"
    assert "step 200" in resume.message
    ignored = only(result, "init-checkpoint-ignored")
    assert ignored.severity is Severity.INFO and ignored.path == "dflash.dflash_init_checkpoint"
    assert "need not exist" in ignored.message


def test_resume_takes_unset_taps_and_mask_from_the_previous_plan(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    recipe = make_recipe()
    result = recompile_after_checkpoint_without_drafter(tmp_path, recipe, drafter)
    assert result.ok, result.diagnostics
    assert result.plan is not None
    assert result.plan.draft.target_layer_ids == (1, 5)
    assert result.plan.draft.mask_token_id == 250
    assert "[1, 5]" in only(result, "taps-from-previous-run").message
    assert "250" in only(result, "mask-from-previous-run").message


def test_resume_without_a_previous_plan_never_guesses_the_taps(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    make_training_checkpoint(tmp_path / "outputs" / "dflash", 10)
    shutil.rmtree(drafter)
    result = compile_in(tmp_path, make_recipe(dflash={"dflash_mask_token_id": 250}))
    assert result.plan is None
    assert "the run being resumed" in only(result, "taps-unknown").message


def test_incomplete_training_checkpoint_does_not_resume(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    make_training_checkpoint(tmp_path / "outputs" / "dflash", 10, complete=False)
    result = compile_in(tmp_path, make_recipe())
    assert result.ok and result.plan is not None
    assert result.plan.resume is None and result.plan.init_checkpoint is not None
    assert "resume-from-checkpoint" not in codes(result)


# ---------------------------------------------------------------------------------------------
# 1. expected layout vs the header
# ---------------------------------------------------------------------------------------------


def test_shape_mismatch_is_one_grouped_error_with_the_fix(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_base_model(tmp_path / "base")
    write_drafter_checkpoint(tmp_path / "drafter", layers=5, intermediate=96, n_taps=5)
    recipe = make_recipe(arch={"num_hidden_layers": 5, "intermediate_size": 80})
    result = compile_in(tmp_path, recipe)
    assert result.plan is None
    d = only(result, "checkpoint-layout-mismatch")
    assert d.path == ARCH
    assert (
        "layers.{0..4}.mlp.gate_proj.weight: recipe expects [80, 32], checkpoint has [96, 32]"
        in (d.message)
    )
    assert (
        "layers.{0..4}.mlp.down_proj.weight: recipe expects [32, 80], checkpoint has [32, 96]"
        in (d.message)
    )
    assert d.hint == (
        "set dflash_architecture_config.intermediate_size: 96, as the checkpoint's config.json says"
    )


def test_missing_and_unexpected_tensors_are_listed(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(
        tmp_path / "drafter",
        drop=["layers.1.self_attn.q_norm.weight"],
        extra={"lm_head.weight": [256, 32]},
    )
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "checkpoint-layout-mismatch")
    assert "1 missing" in d.message and "1 unexpected" in d.message
    assert (
        "missing: layers.{1}.self_attn.q_norm.weight: recipe expects [8], checkpoint has none"
        in d.message
    )
    assert "unexpected: lm_head.weight: checkpoint has [256, 32], recipe expects none" in d.message


def test_extra_checkpoint_layer_suggests_the_layer_count(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", layers=3)
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "checkpoint-layout-mismatch")
    assert "layers.{2}.*" in d.message
    assert "set dflash_architecture_config.num_hidden_layers: 3" in (d.hint or "")


def test_fixes_come_from_the_header_when_config_json_is_missing(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", heads=8, head_dim=4, write_config=False)
    recipe = make_recipe(
        arch={"target_layer_ids": (1, 5), "num_key_value_heads": 2},
        dflash={"dflash_mask_token_id": 250},
    )
    result = compile_in(tmp_path, recipe)
    d = only(result, "checkpoint-layout-mismatch")
    hint = d.hint or ""
    assert (
        "set dflash_architecture_config.num_attention_heads: 8, as the checkpoint's tensor" in hint
    )
    assert "set dflash_architecture_config.head_dim: 4, as the checkpoint's tensor" in hint
    assert only(result, "checkpoint-config-missing").severity is Severity.WARNING


def test_tensors_win_over_a_stale_config_json(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(
        tmp_path / "drafter", intermediate=96, config=drafter_config(intermediate=64)
    )
    result = compile_in(tmp_path, make_recipe())
    hint = only(result, "checkpoint-layout-mismatch").hint or ""
    assert "intermediate_size: 96, as the checkpoint's tensors show" in hint
    assert "config.json says 64" in hint


def test_tap_count_is_checked_against_fc_width(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(arch={"target_layer_ids": (1, 3, 5)}))
    d = only(result, "checkpoint-layout-mismatch")
    assert "fc.weight: recipe expects [32, 96], checkpoint has [32, 64]" in d.message
    assert "set dflash_architecture_config.target_layer_ids: [1, 5]" in (d.hint or "")


def test_attention_sink_in_the_checkpoint_suggests_enabling_it(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", attention_sink=True)
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "checkpoint-layout-mismatch")
    assert "attention_sink_bias" in d.message
    assert "set dflash_architecture_config.attention_sink: true" in (d.hint or "")
    enabled = compile_in(tmp_path, make_recipe(arch={"attention_sink": True}))
    assert enabled.ok, enabled.diagnostics


def test_hidden_size_mismatch_is_named_instead_of_listing_every_tensor(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", hidden=48)
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "hidden-size-mismatch")
    assert d.path == "dflash.dflash_init_checkpoint"
    assert "48" in d.message and "hidden_size is 32" in d.message
    assert "checkpoint-layout-mismatch" not in codes(result)


# ---------------------------------------------------------------------------------------------
# 2. dims never inherit
# ---------------------------------------------------------------------------------------------


def test_missing_dims_show_the_checkpoint_values(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(arch={"intermediate_size": None, "head_dim": None}))
    assert result.plan is None
    missing = {d.path: d for d in result.diagnostics if d.code == "arch-dim-missing"}
    assert set(missing) == {f"{ARCH}.intermediate_size", f"{ARCH}.head_dim"}
    inter = missing[f"{ARCH}.intermediate_size"]
    assert "dims never inherit: set dflash_architecture_config.intermediate_size" in inter.message
    assert inter.hint == (
        "set dflash_architecture_config.intermediate_size: 64, as the checkpoint's config.json says"
    )
    assert "head_dim: 8, as the checkpoint's config.json says" in (
        missing[f"{ARCH}.head_dim"].hint or ""
    )


def test_missing_dims_without_checkpoint_are_not_taken_from_the_target(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    result = compile_in(
        tmp_path,
        make_recipe(
            init=None, arch={"num_attention_heads": None}, dflash={"dflash_mask_token_id": 1}
        ),
    )
    assert result.plan is None
    d = only(result, "arch-dim-missing")
    assert d.path == f"{ARCH}.num_attention_heads"
    assert "dflash-recipe init" in (d.hint or "")


# ---------------------------------------------------------------------------------------------
# 3. base model config.json
# ---------------------------------------------------------------------------------------------


def test_taps_beyond_the_target_are_an_error(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    result = compile_in(
        tmp_path,
        make_recipe(
            init=None, arch={"target_layer_ids": (1, 8)}, dflash={"dflash_mask_token_id": 1}
        ),
    )
    d = only(result, "taps-out-of-range")
    assert d.path == f"{ARCH}.target_layer_ids"
    assert "[8]" in d.message and "8 decoder layers" in d.message and "0..7" in d.message


def test_checkpoint_taps_beyond_the_target_are_an_error(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_base_model(tmp_path / "base", layers=4)
    write_drafter_checkpoint(tmp_path / "drafter")  # taps [1, 5] for an 8-layer target
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "taps-out-of-range")
    assert "not set in the recipe" in d.message
    assert "check that model.model_name_or_path" in (d.hint or "")


def test_mask_id_must_be_inside_the_vocabulary(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(dflash={"dflash_mask_token_id": 256}))
    d = only(result, "mask-token-out-of-range")
    assert d.path == "dflash.dflash_mask_token_id"
    assert "vocab_size 256" in d.message


def test_checkpoint_trained_for_another_target_warns(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", config=drafter_config(num_target_layers=36))
    result = compile_in(tmp_path, make_recipe(arch={"target_layer_ids": (1, 5)}))
    d = only(result, "checkpoint-target-differs")
    assert "num_target_layers 36 (base model: 8)" in d.message


# ---------------------------------------------------------------------------------------------
# 4. checkpoint config.json
# ---------------------------------------------------------------------------------------------


def test_mask_mismatch_warns_of_a_degraded_warm_start(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(dflash={"dflash_mask_token_id": 7}))
    assert result.ok
    d = only(result, "checkpoint-mask-differs")
    assert d.severity is Severity.WARNING and d.path == "dflash.dflash_mask_token_id"
    assert "7" in d.message and "250" in d.message and "degraded" in d.message
    assert result.plan is not None and result.plan.draft.mask_token_id == 7


def test_taps_mismatch_warns_of_a_degraded_warm_start(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(arch={"target_layer_ids": (2, 6)}))
    assert result.ok
    d = only(result, "checkpoint-taps-differ")
    assert d.path == f"{ARCH}.target_layer_ids"
    assert "[2, 6]" in d.message and "[1, 5]" in d.message and "degraded" in d.message
    assert result.plan is not None and result.plan.draft.target_layer_ids == (2, 6)


def test_rope_mismatch_warns_and_the_plan_keeps_the_targets(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", config=drafter_config(rope_theta=10_000.0))
    result = compile_in(tmp_path, make_recipe())
    assert result.ok
    d = only(result, "checkpoint-rope-differs")
    assert "10000.0" in d.message and "1000000.0" in d.message
    assert result.plan is not None and result.plan.base_model.facts is not None
    assert result.plan.base_model.facts.rope.rope_theta == 1_000_000.0


def test_rms_norm_eps_the_recipe_states_and_the_checkpoint_contradicts_warns_with_the_fix(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", config=drafter_config(rms_norm_eps=1e-5))
    result = compile_in(tmp_path, make_recipe(arch={"rms_norm_eps": 1e-6}))
    d = only(result, "checkpoint-rms-norm-eps-differs")
    assert d.severity is Severity.WARNING and d.path == f"{ARCH}.rms_norm_eps"
    assert "1e-06" in d.message and "1e-05" in d.message
    assert d.hint is not None and "rms_norm_eps: 1e-05" in d.hint
    assert "rms-norm-eps-from-checkpoint" not in codes(result)
    assert result.plan is not None and result.plan.draft.architecture.rms_norm_eps == 1e-6


def test_other_block_size_is_allowed_with_an_info(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(dflash={"dflash_block_size": 10}))
    assert result.ok
    d = only(result, "checkpoint-block-size-differs")
    assert d.severity is Severity.INFO and d.path == "dflash.dflash_block_size"
    assert "16" in d.message and "10" in d.message
    assert result.plan is not None
    assert result.plan.draft.block_size == 10
    assert result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.trained_block_size == 16


def test_missing_checkpoint_config_warns_that_checks_were_skipped(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", write_config=False)
    recipe = make_recipe(arch={"target_layer_ids": (1, 5)}, dflash={"dflash_mask_token_id": 250})
    result = compile_in(tmp_path, recipe)
    assert result.ok
    d = only(result, "checkpoint-config-missing")
    assert d.severity is Severity.WARNING
    assert "no config.json" in d.message and "cannot be checked" in d.message
    assert result.plan is not None and result.plan.init_checkpoint is not None
    assert not result.plan.init_checkpoint.config_present


# ---------------------------------------------------------------------------------------------
# 5. taps and mask are never guessed
# ---------------------------------------------------------------------------------------------


def test_unset_taps_and_mask_come_from_the_checkpoint(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(
        tmp_path / "drafter", config=drafter_config(target_layer_ids=[0, 7], mask_token_id=200)
    )
    result = compile_in(tmp_path, make_recipe())
    assert result.plan is not None
    assert result.plan.draft.target_layer_ids == (0, 7)  # not the formula's [1, 5]
    assert result.plan.draft.mask_token_id == 200
    taps = only(result, "taps-from-checkpoint")
    assert taps.severity is Severity.INFO and "[0, 7]" in taps.message
    assert "200" in only(result, "mask-from-checkpoint").message


def test_without_checkpoint_taps_follow_the_default_formula(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(init=None, dflash={"dflash_mask_token_id": 255}))
    assert result.plan is not None
    assert result.plan.draft.target_layer_ids == (1, 5)
    d = only(result, "taps-default")
    assert "8-layer target and 2 draft layers" in d.message


def test_without_checkpoint_a_missing_mask_is_an_error(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(init=None))
    assert result.plan is None
    d = only(result, "mask-token-missing")
    assert d.path == "dflash.dflash_mask_token_id"
    assert "never guessed" in d.message
    hint = d.hint or ""
    assert "151669" in hint and "first unused embedding row" in hint
    assert "no mask token" in hint and "below the target's vocab_size 256" in hint


def test_checkpoint_config_without_mask_is_an_error(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    config = drafter_config()
    del config["dflash_config"]["mask_token_id"]  # type: ignore[attr-defined]
    write_drafter_checkpoint(tmp_path / "drafter", config=config)
    result = compile_in(tmp_path, make_recipe())
    assert "does not state one" in only(result, "mask-token-missing").message


def test_checkpoint_without_taps_is_an_error_naming_the_tap_count(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", n_taps=3, write_config=False)
    result = compile_in(tmp_path, make_recipe(dflash={"dflash_mask_token_id": 250}))
    assert result.plan is None
    d = only(result, "taps-unknown")
    assert "fc.weight takes 3 taps" in d.message and "never guessed" in d.message


# ---------------------------------------------------------------------------------------------
# 6. head variants
# ---------------------------------------------------------------------------------------------

DOMINO = {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8}
DSPARK = {"projector_type": "dspark", "markov_rank": 4, "use_confidence_head": True}


@pytest.mark.parametrize(
    ("arch", "heads"),
    [
        (DOMINO, ("prefix_gru", "embed_proj")),
        (DSPARK, ("markov_w1", "markov_w2", "confidence_proj")),
    ],
)
def test_head_variant_from_a_plain_checkpoint_trains_heads_from_scratch(
    tmp_path: Path,
    make_recipe: RecipeFactory,
    base_model: Path,
    drafter: Path,
    arch: dict[str, object],
    heads: tuple[str, ...],
) -> None:
    result = compile_in(tmp_path, make_recipe(arch=arch))
    assert result.ok, result.diagnostics
    d = only(result, "heads-from-scratch")
    assert d.severity is Severity.WARNING and d.path == f"{ARCH}.projector_type"
    assert all(head in d.message for head in heads)
    assert result.plan is not None and result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.heads_from_scratch == heads


def test_backbone_must_still_match_exactly_for_a_head_variant(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(arch={**DOMINO, "intermediate_size": 32}))
    assert result.plan is None
    assert "mlp.gate_proj.weight" in only(result, "checkpoint-layout-mismatch").message


def test_complete_head_in_the_checkpoint_loads(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(
        tmp_path / "drafter", projector_type="domino", emb_dim=16, gru_hidden_dim=8
    )
    result = compile_in(tmp_path, make_recipe(arch=DOMINO))
    assert result.ok, result.diagnostics
    assert "heads-from-scratch" not in codes(result)
    assert result.plan is not None and result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.tensor_count == 25 + 4


def test_partly_present_head_is_an_error(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(
        tmp_path / "drafter",
        projector_type="domino",
        emb_dim=16,
        gru_hidden_dim=8,
        drop=["prefix_gru.weight_hh_l0"],
    )
    result = compile_in(tmp_path, make_recipe(arch=DOMINO))
    assert result.plan is None
    d = only(result, "head-partly-present")
    assert "prefix_gru: has prefix_gru.weight_ih_l0; lacks prefix_gru.weight_hh_l0" in d.message
    assert "heads-from-scratch" not in codes(result)


def test_head_checkpoint_into_a_plain_recipe_suggests_the_projector(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", projector_type="dspark", markov_rank=4)
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "checkpoint-layout-mismatch")
    assert "unexpected: markov_w1.weight" in d.message
    assert "set dflash_architecture_config.projector_type: dspark" in (d.hint or "")


def test_missing_head_size_is_taken_from_the_checkpoint_in_the_hint(
    tmp_path: Path, make_recipe: RecipeFactory, base_model: Path
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", projector_type="dspark", markov_rank=4)
    result = compile_in(tmp_path, make_recipe(arch={"projector_type": "dspark"}))
    d = only(result, "head-field-missing")
    assert d.path == f"{ARCH}.markov_rank"
    assert d.hint == (
        "set dflash_architecture_config.markov_rank: 4, as the checkpoint's config.json says"
    )


# ---------------------------------------------------------------------------------------------
# diagnostics are located in the recipe file
# ---------------------------------------------------------------------------------------------


def test_diagnostics_point_at_the_recipe_lines(
    tmp_path: Path,
    base_model: Path,
    drafter: Path,
    train_file: Path,
    recipe_text: Callable[..., str],
    write_recipe: Callable[..., Path],
) -> None:
    text = recipe_text(arch={"intermediate_size": 80, "target_layer_ids": [2, 6]})
    path = write_recipe(text)
    result = compile_file(path)
    lines = text.splitlines()
    taps = only(result, "checkpoint-taps-differ")
    assert taps.file == str(path)
    assert taps.line is not None and lines[taps.line - 1].strip().startswith("target_layer_ids:")
    layout = only(result, "checkpoint-layout-mismatch")
    assert layout.line is not None
    assert lines[layout.line - 1].strip() == "dflash_architecture_config:"
