"""A DFlash 2 export is a z-lab release (issue 37): the released layout's names, shapes, dtypes
and config keys, no remote code, names checked before anything is written, and a valid
``dflash_init_checkpoint`` of the next DFlash 2 run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from testkit.compiling import RecipeFactory, codes, compile_in
from testkit.dflash2_fixtures import dflash2_config, write_tiny_dflash2_checkpoint
from testkit.released_layouts import DFLASH2_CONFIG, DIMS, HIDDEN, TAPS, VOCAB, dflash2_tensors
from testkit.tiny import randomize, tiny_plan
from torch import nn

from dflash_recipes.checkpoint.safetensors_header import read_safetensors_header
from dflash_recipes.diagnostics import Severity
from dflash_recipes.errors import PlanError
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import REMOTE_CODE_FILE, export_drafter
from dflash_recipes.executor.model.warmstart import load_init_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

#: A tiny drafter shaped like the released Muse-Glimmer-30B-DFlash2 one (5 sliding layers, 5
#: taps, the same optional keys), every size distinct so a shape read on the wrong axis shows.
TINY: dict[str, object] = {
    "projector_type": "dflash2",
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "layer_types": ("sliding_attention",) * 5,
    "sliding_window": 16,
    "conv_kernel_size": 2,
    "conv_group_size": 8,
    "selector_rank": 4,
    "selector_top_k": 4,
    "output_multiplier": 0.19611613513818404,
    "final_logit_softcapping": 20.0,
    "target_num_hidden_layers": 8,
    "target_layer_ids": (1, 2, 4, 5, 6),
}

#: Keys of z-lab's dflash2-config.json a training SDK cannot know, so the export leaves them
#: out: the tokenizer's special ids (the plan carries no tokenizer facts), transformers'
#: housekeeping (use_cache, initializer_range, transformers_version), and max_window_layers,
#: which layer_types supersedes (and whose meaning, "layers using full attention" in Qwen3Config,
#: contradicts the release's 5 of 5 sliding layers).
ZLAB_ONLY = {
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "transformers_version",
    "max_window_layers",
}
#: Keys every export writes beside their transformers-5 spelling (rope_parameters, dtype), so
#: loaders on transformers 4 read the same RoPE and dtype; the model card reads torch_dtype.
OURS_ONLY = {"rope_theta", "rope_scaling", "torch_dtype"}


def _tiny_export(tmp_path: Path, **overrides: object) -> tuple[Path, DFlashDraftModel]:
    plan = tiny_plan(tmp_path, **{**TINY, **overrides})
    drafter = DFlashDraftModel(plan.resolved_draft())
    randomize(drafter)  # trained weights, far from the identity convolutions
    out = export_drafter(drafter, plan, tmp_path / "export", dtype="bfloat16")
    return out, drafter


def _config(export: Path) -> dict[str, object]:
    config: dict[str, object] = json.loads((export / "config.json").read_text(encoding="utf-8"))
    return config


def test_an_export_has_exactly_the_released_names_shapes_dtypes_and_config_keys(
    tmp_path: Path,
) -> None:
    out, drafter = _tiny_export(tmp_path)
    header = read_safetensors_header(out / "model.safetensors").tensors
    released = dflash2_tensors()
    assert len(released) == 81 and set(header) == set(released)
    assert {info.dtype for info in header.values()} == {"BF16"}
    # every released size mapped to the tiny drafter's: the same axes in the same order
    spec = drafter.spec
    tiny_size = {
        HIDDEN: spec.hidden_size,
        DIMS["intermediate_size"]: spec.intermediate_size,
        32 * 128: spec.num_attention_heads * spec.head_dim,
        8 * 128: spec.num_key_value_heads * spec.head_dim,
        128: spec.head_dim,
        len(TAPS) * HIDDEN: len(spec.target_layer_ids) * spec.hidden_size,
        2 * 2 * HIDDEN // 16: 2 * 2 * spec.hidden_size // 8,  # 2 sides x K taps x groups
        2: 2,  # sides, and K
        256: 4,  # selector rank
        VOCAB: spec.vocab_size,
    }
    for name, (_, shape) in released.items():
        assert header[name].shape == tuple(tiny_size[d] for d in shape), name

    config = _config(out)
    assert set(config) - OURS_ONLY == set(DFLASH2_CONFIG) - ZLAB_ONLY
    nested, released_nested = config["dflash_config"], DFLASH2_CONFIG["dflash_config"]
    assert isinstance(nested, dict) and isinstance(released_nested, dict)
    assert set(nested) == set(released_nested)
    for ours, theirs in ((config, DFLASH2_CONFIG), (nested, released_nested)):
        for key in set(ours) & set(theirs):
            assert type(ours[key]) is type(theirs[key]), key
    for key in ("architectures", "model_type", "is_causal", "use_sliding_window", "dtype"):
        assert config[key] == DFLASH2_CONFIG[key], key
    assert config["layer_types"] == ["sliding_attention"] * 5
    assert nested["block_size"] == 4 and nested["target_layer_ids"] == [1, 2, 4, 5, 6]
    assert not (out / REMOTE_CODE_FILE).exists()  # no auto_map, so no remote code


@pytest.mark.parametrize("sink", [True, False])
def test_the_sink_flag_is_written_only_when_true(tmp_path: Path, sink: bool) -> None:
    out, _ = _tiny_export(tmp_path, attention_sink=sink)
    nested = _config(out)["dflash_config"]
    assert isinstance(nested, dict)
    assert nested.get("attention_sink_bias") is (True if sink else None)


def _rename_kernel_projection(drafter: DFlashDraftModel) -> None:
    conv = drafter.get_submodule("layers.0.attention_conv")
    projection = conv.get_submodule("kernel_projection")
    del conv.kernel_projection
    conv.add_module("kernel_proj", projection)


def _codebook_as_embedding(drafter: DFlashDraftModel) -> None:
    # z-lab's HF class holds the codebooks as nn.Embedding: `....predecessor_codebook.weight`
    selector = drafter.get_submodule("candidate_selector")
    vocab, rank = selector.get_parameter("predecessor_codebook").shape
    del selector.predecessor_codebook
    selector.add_module("predecessor_codebook", nn.Embedding(vocab, rank))


@pytest.mark.parametrize(
    ("break_names", "named", "said"),
    [
        (
            _rename_kernel_projection,
            "layers.0.attention_conv.kernel_proj.weight",
            "unexpected: layers.{0}.attention_conv.kernel_proj.weight",
        ),
        (
            _codebook_as_embedding,
            "candidate_selector.predecessor_codebook.weight",
            "unexpected: candidate_selector.predecessor_codebook.weight",
        ),
    ],
)
def test_an_export_whose_names_differ_from_the_layout_is_refused_before_anything_is_written(
    tmp_path: Path, break_names: object, named: str, said: str
) -> None:
    # SGLang would skip the unknown name and serve a random kernel_projection (or a zero
    # codebook) without a word, so the export must not write it
    plan = tiny_plan(tmp_path, **TINY)
    drafter = DFlashDraftModel(plan.resolved_draft())
    break_names(drafter)  # type: ignore[operator]
    assert named in drafter.state_dict()
    with pytest.raises(PlanError, match="does not match the plan") as raised:
        export_drafter(drafter, plan, tmp_path / "export", dtype="bfloat16")
    assert said in str(raised.value)
    assert not (tmp_path / "export").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("export")] == []


def test_a_dflash2_recipe_warm_starts_from_a_dflash2_export_and_inherits_its_fields(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    config = dflash2_config(output_multiplier=0.5)
    config.update(layer_types=["sliding_attention"] * 2, sliding_window=64, use_sliding_window=True)
    write_tiny_dflash2_checkpoint(tmp_path / "d2", config=config)
    first = compile_in(tmp_path, make_recipe(init="d2", arch={"projector_type": "dflash2"}))
    assert first.plan is not None, [(d.code, d.message) for d in first.diagnostics]
    drafter = DFlashDraftModel(first.plan.resolved_draft())
    randomize(drafter, seed=3)
    export_drafter(drafter, first.plan, tmp_path / "export", dtype="bfloat16")

    again = compile_in(tmp_path, make_recipe(init="export", arch={"projector_type": "dflash2"}))
    assert not again.errors and again.plan is not None
    assert not [d for d in again.diagnostics if d.severity is Severity.WARNING]
    taken = sorted(
        d.path.rsplit(".", 1)[1]
        for d in again.diagnostics
        if d.code == "kind-field-from-checkpoint"
    )
    assert taken == [
        "conv_group_size",
        "conv_kernel_size",
        "output_multiplier",
        "selector_rank",
        "selector_top_k",
    ]
    for code in ("taps-from-checkpoint", "mask-from-checkpoint", "layer-types-from-checkpoint"):
        assert code in codes(again), code
    arch = again.plan.draft.architecture
    assert (arch.conv_kernel_size, arch.conv_group_size, arch.selector_rank) == (2, 8, 4)
    assert (arch.selector_top_k, arch.output_multiplier) == (4, 0.5)
    assert arch.layer_types == ("sliding_attention",) * 2 and arch.sliding_window == 64
    assert again.plan.draft.block_size == 16  # the recipe's, stated only in dflash_config
    init = again.plan.init_checkpoint
    assert init is not None and init.heads_from_scratch == () and init.tensor_count == 36
    # and the weights load, every one of them
    model = DFlashDraftModel(again.plan.resolved_draft())
    assert load_init_checkpoint(model, again.plan).tensors_loaded == 36
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor.to(torch.bfloat16).float()), name
