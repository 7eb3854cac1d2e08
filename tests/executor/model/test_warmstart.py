"""Warm start from an exported drafter (mirrors the seed's TestDFlashWarmStart)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.tiny import tiny_plan, tiny_target, with_init_checkpoint

from dflash_recipes.compiler.compilation import CompileResult, compile_recipe
from dflash_recipes.diagnostics import Severity
from dflash_recipes.errors import CheckpointError, WarmStartError
from dflash_recipes.executor.model.convert import convert
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.executor.model.warmstart import load_init_checkpoint, warm_start
from dflash_recipes.executor.training.checkpoints import (
    restore_training_checkpoint,
    save_training_checkpoint,
)
from dflash_recipes.plan.run_plan import ResumePlan, RunPlan
from dflash_recipes.recipe.sections import (
    DataSection,
    DFlashArchitectureConfig,
    DFlashSection,
    ModelSection,
    Recipe,
    TrainingSection,
)

DOMINO = {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8}
DSPARK = {"projector_type": "dspark", "markov_rank": 4, "use_confidence_head": True}


def exported(tmp_path: Path, dtype: str = "bfloat16", **overrides: object) -> tuple[RunPlan, Path]:
    """A trained-looking plain drafter exported to tmp_path/init; returns its plan and path."""
    plan = tiny_plan(tmp_path, **overrides)
    module = DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(7))
    return plan, export_drafter(module, plan, tmp_path / "init", dtype=dtype)


def fresh(plan: RunPlan) -> DFlashDraftModel:
    return DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(99))


def test_round_trip_at_another_block_size_is_bit_exact(tmp_path: Path) -> None:
    _, init = exported(tmp_path, block_size=4)
    plan = with_init_checkpoint(tiny_plan(tmp_path, block_size=8), init)
    model = convert(tiny_target(plan), plan, init=False)
    report = warm_start(model.dflash_module, plan)
    assert report is not None and report.tensors_loaded == 25
    source = load_file(str(init / "model.safetensors"))
    loaded = model.dflash_module.state_dict()
    assert loaded.keys() == source.keys()
    for name, tensor in source.items():
        assert loaded[name].dtype == torch.float32  # master weights; bf16 widens exactly
        assert torch.equal(loaded[name], tensor.to(torch.float32)), name
    # convert's default (init=True) warm-starts the same way; a resume plan loads nothing.
    converted = convert(tiny_target(plan), plan).dflash_module.state_dict()
    assert all(torch.equal(converted[name], loaded[name]) for name in source)
    resuming = attrs.evolve(plan, resume=ResumePlan(checkpoint_dir=str(tmp_path), step=1))
    assert warm_start(fresh(resuming), resuming) is None


def test_float32_checkpoint_loads_bit_exactly(tmp_path: Path) -> None:
    _, init = exported(tmp_path, dtype="float32")
    plan = with_init_checkpoint(tiny_plan(tmp_path), init)
    module = fresh(plan)
    report = load_init_checkpoint(module, plan)
    source = load_file(str(init / "model.safetensors"))
    assert report.tensors_loaded == len(source) == 25
    assert report.dtypes == ("F32",)
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor.view(torch.int32), source[name].view(torch.int32)), name


def test_default_without_init_checkpoint_is_random(tmp_path: Path) -> None:
    _, init = exported(tmp_path)
    plan = tiny_plan(tmp_path)
    model = convert(tiny_target(plan), plan)
    source = load_file(str(init / "model.safetensors"))
    loaded = model.dflash_module.state_dict()
    assert not torch.equal(loaded["fc.weight"], source["fc.weight"].float())
    assert not any(
        torch.equal(loaded[n], source[n].float()) for n in source if n.endswith("proj.weight")
    )


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    plan = with_init_checkpoint(tiny_plan(tmp_path), tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="does not exist") as info:
        convert(tiny_target(plan), plan)
    assert "hf download" in str(info.value)


def test_directory_without_weights_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "init").mkdir()
    (tmp_path / "init" / "config.json").write_text("{}")
    plan = with_init_checkpoint(tiny_plan(tmp_path), tmp_path / "init")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_init_checkpoint(fresh(plan), plan)


def test_one_more_layer_lists_every_missing_tensor(tmp_path: Path) -> None:
    _, init = exported(tmp_path)
    plan = with_init_checkpoint(tiny_plan(tmp_path, num_hidden_layers=3), init)
    module = fresh(plan)
    before = module.fc.weight.clone()
    with pytest.raises(WarmStartError) as info:
        load_init_checkpoint(module, plan)
    text = str(info.value)
    assert "11 missing" in text
    assert "missing: layers.{2}" in text
    assert "num_hidden_layers: 2" in text  # the fix
    assert torch.equal(module.fc.weight, before), "nothing is copied when the layout differs"


def test_wrong_intermediate_size_lists_every_layer(tmp_path: Path) -> None:
    _, init = exported(tmp_path)
    plan = with_init_checkpoint(tiny_plan(tmp_path, intermediate_size=96), init)
    with pytest.raises(WarmStartError) as info:
        convert(tiny_target(plan), plan)
    text = str(info.value)
    assert (
        "layers.{0,1}.mlp.gate_proj.weight: recipe expects [96, 64], checkpoint has [128, 64]"
        in text
    )
    assert (
        "layers.{0,1}.mlp.down_proj.weight: recipe expects [64, 96], checkpoint has [64, 128]"
        in text
    )
    assert "fix: set dflash_architecture_config.intermediate_size: 128" in text


def _compiled_against(tmp_path: Path, init: Path, **dflash: object) -> CompileResult:
    """Compile a recipe for the tiny target (written to disk) warm-starting from `init`."""
    tiny = tiny_plan(tmp_path)
    tiny_target(tiny, save=True)
    data = tmp_path / "data.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    data.write_text(json.dumps({"messages": turns}) + "\n", encoding="utf-8")
    arch = DFlashArchitectureConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        target_layer_ids=dflash.pop("target_layer_ids", None),  # type: ignore[arg-type]
    )
    recipe = Recipe(
        model=ModelSection(model_name_or_path=tiny.base_model.path, dtype="float32"),
        data=DataSection(data_path=str(data)),
        training=TrainingSection(
            output_dir=str(tmp_path / "run"), learning_rate=1e-3, training_seq_len=64
        ),
        dflash=DFlashSection(
            dflash_init_checkpoint=str(init),
            dflash_block_size=4,
            dflash_architecture_config=arch,
            **dflash,  # type: ignore[arg-type]
        ),
    )
    return compile_recipe(recipe, base_dir=tmp_path)


@pytest.mark.parametrize(
    ("exported_with", "recipe_says", "code", "words"),
    [
        ({"mask_token_id": 120}, {"dflash_mask_token_id": 121}, "checkpoint-mask-differs", "120"),
        (
            {"target_layer_ids": (1, 2)},
            {"target_layer_ids": (0, 2)},
            "checkpoint-taps-differ",
            "[1, 2]",
        ),
    ],
)
def test_the_warm_start_says_what_the_compiler_warned_and_loads(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    exported_with: dict[str, object],
    recipe_says: dict[str, object],
    code: str,
    words: str,
) -> None:
    """A degraded warm start: compile warns, the plan carries it, `run` logs those words."""
    _, init = exported(tmp_path, **exported_with)
    result = _compiled_against(tmp_path, init, **recipe_says)
    assert result.plan is not None and result.plan.init_checkpoint is not None, result.diagnostics
    warned = [d for d in result.diagnostics if d.severity is Severity.WARNING]
    assert [d.code for d in warned] == [code]
    assert words in warned[0].message and "degraded" in warned[0].message
    plan = result.plan
    assert plan.init_checkpoint.warnings == (warned[0].message,)
    with caplog.at_level(logging.INFO, logger="dflash_recipes.executor.model.warmstart"):
        report = load_init_checkpoint(fresh(plan), plan)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert logged == [warned[0].message]
    assert report.tensors_loaded == 25 and report.warnings == (warned[0].message,)


def test_a_clean_warm_start_compiles_and_loads_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, init = exported(tmp_path)
    result = _compiled_against(tmp_path, init)
    assert result.plan is not None and result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.warnings == ()
    with caplog.at_level(logging.WARNING):
        load_init_checkpoint(fresh(result.plan), result.plan)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_one_info_line_says_what_was_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, init = exported(tmp_path)
    plan = with_init_checkpoint(tiny_plan(tmp_path), init)
    with caplog.at_level(logging.INFO, logger="dflash_recipes.executor.model.warmstart"):
        load_init_checkpoint(fresh(plan), plan)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [
        f"warm start from {init}: 25 tensors loaded (BF16); heads trained from scratch: none"
    ]


@pytest.mark.parametrize(
    ("variant", "heads"),
    [
        (DOMINO, ("prefix_gru", "embed_proj")),
        (DSPARK, ("markov_w1", "markov_w2", "confidence_proj")),
    ],
)
def test_head_variant_warm_starts_its_backbone_from_plain_dflash(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    variant: dict[str, object],
    heads: tuple[str, ...],
) -> None:
    _, init = exported(tmp_path)
    said = "the compiler's heads-from-scratch warning, as the plan carries it"
    plan = with_init_checkpoint(tiny_plan(tmp_path, **variant), init, warnings=(said,))
    module = fresh(plan)
    untouched = {n: t.clone() for n, t in module.state_dict().items() if n.split(".")[0] in heads}
    with caplog.at_level(logging.INFO):
        report = load_init_checkpoint(module, plan)
    source = load_file(str(init / "model.safetensors"))
    state = module.state_dict()
    for name, tensor in source.items():
        assert torch.equal(state[name], tensor.float()), name
    assert untouched and all(torch.equal(state[n], t) for n, t in untouched.items())
    assert report.heads_from_scratch == heads
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert logged == [said]  # the plan's words, not a decision taken again here
    assert "heads trained from scratch: " + ", ".join(heads) in caplog.text


def test_heads_from_scratch_are_the_plans_decision(tmp_path: Path) -> None:
    # the plan was compiled when the checkpoint held the head: warm start does not quietly
    # start the (now absent) head from scratch, it reports what differs from the plan
    _, init = exported(tmp_path)
    plan = with_init_checkpoint(tiny_plan(tmp_path, **DOMINO), init, heads_from_scratch=())
    with pytest.raises(WarmStartError) as info:
        load_init_checkpoint(fresh(plan), plan)
    text = str(info.value)
    assert "missing: prefix_gru.weight_hh_l0: recipe expects [24, 8], checkpoint has none" in text
    # a plan compiled without reading the header (no tensor_count) leaves it to the header
    unread = attrs.evolve(
        plan,
        init_checkpoint=attrs.evolve(plan.init_checkpoint, tensor_count=None, weight_files=()),
    )
    report = load_init_checkpoint(fresh(unread), unread)
    assert report.heads_from_scratch == ("prefix_gru", "embed_proj")


def test_partly_present_head_is_an_error(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, **DOMINO)
    export_drafter(DFlashDraftModel(plan.resolved_draft()), plan, tmp_path / "init")
    weights = load_file(str(tmp_path / "init" / "model.safetensors"))
    del weights["embed_proj.2.weight"]
    save_file(weights, str(tmp_path / "init" / "model.safetensors"))
    plan = with_init_checkpoint(plan, tmp_path / "init")
    with pytest.raises(WarmStartError, match="only partly present") as info:
        load_init_checkpoint(fresh(plan), plan)
    assert "embed_proj: has embed_proj.0.weight; lacks embed_proj.2.weight" in str(info.value)


def test_sharded_checkpoint_streams_every_shard(tmp_path: Path) -> None:
    _, init = exported(tmp_path, dtype="float32")
    weights = load_file(str(init / "model.safetensors"))
    (init / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file_name, members in shards.items():
        save_file({n: weights[n] for n in members}, str(init / file_name))
        weight_map.update(dict.fromkeys(members, file_name))
    (init / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    plan = with_init_checkpoint(tiny_plan(tmp_path), init)
    module = fresh(plan)
    report = load_init_checkpoint(module, plan)
    assert report.weight_files == tuple(sorted(shards))
    assert all(torch.equal(module.state_dict()[n], weights[n]) for n in names)


def test_loading_after_a_narrowing_cast_is_refused(tmp_path: Path) -> None:
    _, init = exported(tmp_path, dtype="float32")
    plan = with_init_checkpoint(tiny_plan(tmp_path), init)
    module = fresh(plan).to(torch.bfloat16)
    with pytest.raises(WarmStartError, match="would round"):
        load_init_checkpoint(module, plan)


def test_restore_ignores_the_init_checkpoint(tmp_path: Path) -> None:
    _, init = exported(tmp_path)
    plan = with_init_checkpoint(tiny_plan(tmp_path), init)
    model = convert(tiny_target(plan), plan)
    drafter = model.dflash_module
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    drafter.fc.weight.grad = torch.ones_like(drafter.fc.weight)
    optimizer.step()  # the saved weights now differ from the init checkpoint
    saved = {n: t.clone() for n, t in drafter.state_dict().items()}
    checkpoint = save_training_checkpoint(
        Path(plan.training.output_dir), 2, model, optimizer, None, {"epoch": 0}
    )
    shutil.rmtree(init)

    resumed = attrs.evolve(plan, resume=ResumePlan(checkpoint_dir=str(checkpoint), step=2))
    model2 = convert(tiny_target(resumed), resumed)  # must not touch the deleted init dir
    state = restore_training_checkpoint(checkpoint, model2)
    assert state["step"] == 2
    restored = model2.dflash_module.state_dict()
    assert all(torch.equal(restored[n], saved[n]) for n in saved)


# ---------------------------------------------------------------------------------------------
# known checkpoint layouts (dflash_recipes.checkpoint.known_layouts)
# ---------------------------------------------------------------------------------------------

MUSE = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
DSPARK_HEAD = ("markov_w1.weight", "markov_w2.weight", "confidence_proj.weight")
NESTED_HEAD = {n: f"markov_head.{n}" for n in (*DSPARK_HEAD, "confidence_proj.bias")}


def _store_as(init: Path, renames: dict[str, str]) -> dict[str, torch.Tensor]:
    """Rewrite `init`'s weights under `renames` (z-lab name -> stored name); the z-lab tensors."""
    source = load_file(str(init / "model.safetensors"))
    stored = {renames.get(n, n): t for n, t in source.items()}
    save_file(stored, str(init / "model.safetensors"), metadata={"format": "pt"})
    return source


def _as_assistant_config(init: Path) -> None:
    """config.json as the MuseGlimmer assistant writes it: DFlash fields at the top level."""
    config = json.loads((init / "config.json").read_text(encoding="utf-8"))
    nested = config.pop("dflash_config")
    for key in ("auto_map", "num_target_layers", "vocab_size", "rope_theta", "rope_scaling"):
        config.pop(key, None)
    config.update(
        architectures=["MuseGlimmerAssistantModel"],
        model_type="muse_glimmer_assistant",
        mask_token_id=nested["mask_token_id"],
        target_layer_ids=nested["target_layer_ids"],
        block_size=nested["block_size"],
    )
    (init / "config.json").write_text(json.dumps(config), encoding="utf-8")


def test_a_museglimmer_layout_warm_starts_bit_exactly_and_exports_the_z_lab_layout(
    tmp_path: Path,
) -> None:
    _, init = exported(tmp_path, mask_token_id=120, target_layer_ids=(1, 2))
    source = _store_as(init, MUSE)
    _as_assistant_config(init)
    result = _compiled_against(tmp_path, init)
    plan = result.plan
    assert plan is not None, [(d.code, d.message) for d in result.diagnostics]
    assert "checkpoint-layout-renamed" in {d.code for d in result.diagnostics}
    assert (plan.draft.mask_token_id, plan.draft.target_layer_ids) == (120, (1, 2))
    module = fresh(plan)
    report = load_init_checkpoint(module, plan)
    assert report.tensors_loaded == len(source) == 25
    state = module.state_dict()
    for name, tensor in source.items():
        assert torch.equal(state[name], tensor.to(torch.float32)), name
    out = export_drafter(module, plan, tmp_path / "export")
    written = load_file(str(out / "model.safetensors"))
    assert written.keys() == source.keys()  # fc.weight, hidden_norm.weight: the z-lab names
    assert all(torch.equal(written[n], source[n]) for n in source)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] == 120


def test_a_dspark_head_under_markov_head_warm_starts_bit_exactly(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, **DSPARK)
    module = DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(7))
    init = export_drafter(module, plan, tmp_path / "init")
    source = _store_as(init, NESTED_HEAD)
    plan = with_init_checkpoint(plan, init)
    assert plan.init_checkpoint is not None and plan.init_checkpoint.heads_from_scratch == ()
    loaded = fresh(plan)
    report = load_init_checkpoint(loaded, plan)
    assert report.heads_from_scratch == () and report.tensors_loaded == len(source)
    state = loaded.state_dict()
    for name in (*DSPARK_HEAD, "confidence_proj.bias", "fc.weight"):
        assert torch.equal(state[name], source[name].to(torch.float32)), name


def test_a_partly_present_head_under_markov_head_is_an_error(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, **DSPARK)
    init = export_drafter(DFlashDraftModel(plan.resolved_draft()), plan, tmp_path / "init")
    _store_as(init, NESTED_HEAD)
    weights = load_file(str(init / "model.safetensors"))
    del weights["markov_head.confidence_proj.bias"]
    save_file(weights, str(init / "model.safetensors"))
    plan = with_init_checkpoint(plan, init)
    with pytest.raises(WarmStartError, match="only partly present") as info:
        load_init_checkpoint(fresh(plan), plan)
    assert "confidence_proj: has confidence_proj.weight; lacks confidence_proj.bias" in str(
        info.value
    )


def test_two_stored_tensors_for_one_parameter_are_refused_before_any_copy(
    tmp_path: Path,
) -> None:
    _, init = exported(tmp_path)
    weights = load_file(str(init / "model.safetensors"))
    weights["encoder.fc.weight"] = torch.zeros_like(weights["fc.weight"])
    save_file(weights, str(init / "model.safetensors"))
    plan = with_init_checkpoint(tiny_plan(tmp_path), init)
    module = fresh(plan)
    before = module.fc.weight.clone()
    with pytest.raises(WarmStartError, match="same drafter parameter") as info:
        load_init_checkpoint(module, plan)
    assert "fc.weight: stored as encoder.fc.weight and fc.weight" in str(info.value)
    assert torch.equal(module.fc.weight, before)
