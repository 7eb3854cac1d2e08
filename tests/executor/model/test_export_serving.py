"""What engines read in an export (issues 11, 25 and 37): the sink key, the Domino and DSpark head
fields exactly as ModelOpt writes them, SGLang's Domino config rules, vLLM's and SGLang's DFlash 2
loader rules, and the warnings for heads no engine serves."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from testkit.tiny import tiny_plan

from dflash_recipes.checkpoint.config_fields import unknown_fields
from dflash_recipes.checkpoint.hfconfig import read_checkpoint_config
from dflash_recipes.checkpoint.safetensors_header import read_safetensors_header
from dflash_recipes.compiler.field_checks import check_checkpoint_fields
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def _export(tmp_path: Path, **overrides: object) -> dict[str, object]:
    plan = tiny_plan(tmp_path, **overrides)
    out = export_drafter(DFlashDraftModel(plan.resolved_draft()), plan, tmp_path / "export")
    config: dict[str, object] = json.loads((out / "config.json").read_text(encoding="utf-8"))
    return config


def sglang_domino_config_problems(config: Mapping[str, object]) -> list[str]:
    """SGLang's rules for a Domino drafter's config.json (integration facts): a boolean
    shift_label, pure_draft_prefix_len 1, gru_hidden_dim and emb_dim set, emb_dim agreeing at
    the top level and in dflash_config, block_size > 1 (dflash_config first, then top level)."""
    problems = []
    nested = config.get("dflash_config")
    if not isinstance(nested, Mapping):
        return ["no dflash_config"]
    if type(nested.get("shift_label")) is not bool:
        problems.append("shift_label is not a boolean")
    if nested.get("pure_draft_prefix_len") != 1:
        problems.append("pure_draft_prefix_len is not 1")
    for key in ("gru_hidden_dim", "emb_dim"):
        value = nested.get(key)
        if type(value) is not int or value <= 0:
            problems.append(f"{key} is not a positive int")
    if config.get("emb_dim") != nested.get("emb_dim"):
        problems.append("top-level emb_dim differs from dflash_config.emb_dim")
    block = nested.get("block_size", config.get("block_size"))
    if type(block) is not int or block <= 1:
        problems.append("block_size is not > 1")
    return problems


@pytest.mark.parametrize("sink", [True, False])
def test_the_sink_flag_is_written_as_attention_sink_bias(tmp_path: Path, sink: bool) -> None:
    config = _export(tmp_path, attention_sink=sink)
    dflash = config["dflash_config"]
    assert isinstance(dflash, dict)
    assert dflash["attention_sink_bias"] is sink
    assert "attention_sink" not in dflash
    assert read_checkpoint_config(tmp_path / "export").attention_sink is sink


def test_a_plain_export_logs_no_serving_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        _export(tmp_path)
    assert not caplog.records


def test_a_domino_export_is_modelopts_and_sglang_accepts_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        config = _export(tmp_path, projector_type="domino", emb_dim=16, gru_hidden_dim=8)
    dflash = config["dflash_config"]
    assert isinstance(dflash, dict)
    # ModelOpt 0.47's DominoExporter: these five nested fields and the top-level emb_dim.
    assert {k: dflash[k] for k in ("projector_type", "shift_label", "pure_draft_prefix_len")} == {
        "projector_type": "domino",
        "shift_label": True,
        "pure_draft_prefix_len": 1,
    }
    assert (dflash["gru_hidden_dim"], dflash["emb_dim"], config["emb_dim"]) == (8, 16, 16)
    assert sglang_domino_config_problems(config) == []
    # Served as trained: no "not served as trained" warning any more.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # The export warm-starts the same head kind without a finding about alignment.
    findings = check_checkpoint_fields(
        config, None, where="c", training_seq_len=32, projector_type="domino"
    )
    assert findings == [] and unknown_fields(config) == []


def test_a_domino_export_with_another_prefix_is_refused_by_sglangs_rules_and_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        config = _export(
            tmp_path,
            projector_type="domino",
            emb_dim=16,
            gru_hidden_dim=8,
            pure_draft_prefix_len=0,
        )
    assert sglang_domino_config_problems(config) == ["pure_draft_prefix_len is not 1"]
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1
    assert "not served as trained by any engine" in messages[0]
    assert "pure_draft_prefix_len 0" in messages[0]


def test_sglangs_rules_catch_each_broken_field() -> None:
    """The rule check itself can fail: every rule on a broken copy of a good config."""
    good: dict[str, object] = {
        "emb_dim": 16,
        "block_size": 8,
        "dflash_config": {
            "shift_label": True,
            "pure_draft_prefix_len": 1,
            "gru_hidden_dim": 8,
            "emb_dim": 16,
            "block_size": 8,
        },
    }
    assert sglang_domino_config_problems(good) == []
    broken = [
        ({"shift_label": 1}, "shift_label is not a boolean"),
        ({"pure_draft_prefix_len": 0}, "pure_draft_prefix_len is not 1"),
        ({"gru_hidden_dim": None}, "gru_hidden_dim is not a positive int"),
        ({"emb_dim": 12}, "top-level emb_dim differs from dflash_config.emb_dim"),
        ({"block_size": 1}, "block_size is not > 1"),
    ]
    for change, problem in broken:
        nested = dict(good["dflash_config"])  # type: ignore[call-overload]
        nested.update(change)
        assert problem in sglang_domino_config_problems({**good, "dflash_config": nested})


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_export_is_modelopts_and_warns_that_no_engine_serves_its_head(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    with caplog.at_level(logging.WARNING):
        config = _export(
            tmp_path,
            projector_type="dspark",
            markov_rank=4,
            markov_head_type=kind,
            use_confidence_head=True,
        )
    dflash = config["dflash_config"]
    assert isinstance(dflash, dict)
    assert {
        k: dflash[k]
        for k in (
            "projector_type",
            "shift_label",
            "markov_rank",
            "markov_head_type",
            "use_confidence_head",
        )
    } == {
        "projector_type": "dspark",
        "shift_label": True,
        "markov_rank": 4,
        "markov_head_type": kind,
        "use_confidence_head": True,
    }
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and "no serving engine has a DSpark head" in messages[0]
    assert unknown_fields(config) == []
    findings = check_checkpoint_fields(
        config, None, where="c", training_seq_len=32, projector_type="dspark"
    )
    assert [f.code for f in findings if f.path.endswith("markov_head_type")] == (
        [] if kind == "vanilla" else ["checkpoint-field-differs"]
    )


# --- DFlash 2 -----------------------------------------------------------------------------------

#: The names vLLM's and SGLang's DFlash 2 loaders reject outright or misread as the draft's own.
_DFLASH2_FORBIDDEN = ("mask_hidden", "embed_tokens", "lm_head", "d2t", "t2d")
_DFLASH2_NESTED = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
)
_DFLASH2_LAYER = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "attention_conv.base_kernel",
    "attention_conv.kernel_projection.weight",
    "mlp_conv.base_kernel",
    "mlp_conv.kernel_projection.weight",
)


def dflash2_loader_problems(
    config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """vLLM's (qwen3_dflash2) and SGLang's (DFlash2DraftModel) rules for a DFlash 2 export, from
    the reference (sections 1, 2 and 6): the DFlash 2 architecture string (anything else drafts
    as DFlash 1, without the selector); every DFlash key read as ``dflash_config[key]`` (a
    KeyError at load), the four DFlash 2 sizes positive ints; silu (SGLang's only activation);
    ``is_causal: false`` when a layer slides (else the engines run it causal); no
    ``mask_hidden`` (vLLM asserts), ``embed_tokens``/``lm_head`` (vLLM takes them for the
    draft's own) or ``d2t``/``t2d``; the codebooks bare, without ``.weight``; every tensor name
    known (vLLM raises "There is no module or parameter named"; SGLang skips it and leaves the
    parameter at its init, a random ``kernel_projection``) and present, the DFlash 2 ones in
    the shapes of section 2 (vLLM's weight loader asserts equal sizes)."""
    problems: list[str] = []
    if config.get("architectures") != ["DFlash2DraftModel"]:
        problems.append('architectures is not ["DFlash2DraftModel"]')
    nested = config.get("dflash_config")
    if not isinstance(nested, Mapping):
        return [*problems, "no dflash_config"]
    for key in _DFLASH2_NESTED:
        if key not in nested:
            problems.append(f"dflash_config.{key} is missing (KeyError at load)")
    sizes: dict[str, Any] = {k: nested.get(k) for k in _DFLASH2_NESTED[3:]}
    for key, value in sizes.items():
        if key in nested and (type(value) is not int or value <= 0):
            problems.append(f"dflash_config.{key} is not a positive int")
    if config.get("hidden_act") != "silu":
        problems.append("hidden_act is not silu")
    layer_types = config.get("layer_types") or []
    if "sliding_attention" in layer_types and config.get("is_causal") is not False:
        problems.append("sliding layers without is_causal: false")
    for name in shapes:
        if name.split(".")[0] in _DFLASH2_FORBIDDEN:
            problems.append(f"{name}: engines reject it or load it as the draft's own")
        elif name.endswith("_codebook.weight"):
            problems.append(f"{name}: the codebooks are bare parameters, without .weight")
    layers = config.get("num_hidden_layers")
    if type(layers) is not int or any(type(v) is not int for v in sizes.values()):
        return [*problems, "the sizes to name the tensors by are not ints"]
    known = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    known |= {f"layers.{i}.{n}" for i in range(layers) for n in _DFLASH2_LAYER}
    hidden, vocab = config.get("hidden_size"), config.get("vocab_size")
    kernel, group, rank = (
        sizes[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank")
    )
    new_shapes: dict[str, tuple[Any, ...]] = {
        "candidate_selector.hidden_projection.weight": (rank, hidden),
        "candidate_selector.predecessor_codebook": (vocab, rank),
        "candidate_selector.successor_codebook": (vocab, rank),
    }
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            new_shapes[f"layers.{i}.{conv}.base_kernel"] = (2, kernel, hidden)
            rows = 2 * kernel * (hidden // group) if type(hidden) is int and group else None
            new_shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (rows, hidden)
    known |= set(new_shapes)
    problems += [f"unknown tensor {n}" for n in sorted(shapes) if n not in known]
    problems += [f"missing tensor {n}" for n in sorted(known) if n not in shapes]
    problems += [
        f"{n} is {list(shapes[n])}, the loader's parameter {list(want)}"
        for n, want in new_shapes.items()
        if n in shapes and tuple(shapes[n]) != want
    ]
    return problems


#: A tiny DFlash 2 drafter with a sliding layer (so is_causal matters).
_DFLASH2: dict[str, object] = {
    "projector_type": "dflash2",
    "conv_kernel_size": 2,
    "conv_group_size": 8,
    "selector_rank": 4,
    "selector_top_k": 4,
    "layer_types": ("sliding_attention", "full_attention"),
    "sliding_window": 8,
}


def _dflash2_export(tmp_path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The config.json and the header's name -> shape of a real tiny DFlash 2 export."""
    config = _export(tmp_path, **_DFLASH2)
    header = read_safetensors_header(tmp_path / "export" / "model.safetensors")
    return config, {name: tuple(info.shape) for name, info in header.tensors.items()}


def test_a_dflash2_export_passes_vllms_and_sglangs_dflash2_loader_rules(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        config, shapes = _dflash2_export(tmp_path)
    assert dflash2_loader_problems(config, shapes) == []
    assert len(shapes) == 3 + 2 * len(_DFLASH2_LAYER) + 3  # 2 layers of the released 81
    assert not caplog.records  # both engines serve it: no serving warning
    assert unknown_fields(config) == []


def test_dflash2_loader_rules_refuse_each_broken_export(tmp_path: Path) -> None:
    """Each rule on a broken copy of a real export (the check itself can fail)."""
    config, shapes = _dflash2_export(tmp_path)
    assert dflash2_loader_problems(config, shapes) == []

    def nested(**change: object) -> dict[str, Any]:
        inner = {**config["dflash_config"], **change}
        return {**config, "dflash_config": {k: v for k, v in inner.items() if v is not None}}

    def renamed(old: str, new: str) -> dict[str, tuple[int, ...]]:
        return {new if n == old else n: s for n, s in shapes.items()}

    projection = "layers.0.attention_conv.kernel_projection.weight"
    broken: list[tuple[dict[str, Any], dict[str, tuple[int, ...]], str]] = [
        (
            {**config, "architectures": ["DFlashDraftModel"]},
            shapes,
            'architectures is not ["DFlash2DraftModel"]',
        ),
        *(
            (nested(**{key: None}), shapes, f"dflash_config.{key} is missing (KeyError at load)")
            for key in _DFLASH2_NESTED
        ),
        (nested(selector_top_k=0), shapes, "dflash_config.selector_top_k is not a positive int"),
        ({**config, "hidden_act": "gelu"}, shapes, "hidden_act is not silu"),
        (
            {k: v for k, v in config.items() if k != "is_causal"},
            shapes,
            "sliding layers without is_causal: false",
        ),
        (
            config,
            renamed(projection, "layers.0.attention_conv.kernel_proj.weight"),
            "unknown tensor layers.0.attention_conv.kernel_proj.weight",
        ),
        (
            config,
            renamed(projection, "layers.0.attention_conv.kernel_proj.weight"),
            f"missing tensor {projection}",
        ),
        (
            config,
            {**shapes, "mask_hidden": (1, 64)},
            "mask_hidden: engines reject it or load it as the draft's own",
        ),
        (
            config,
            {**shapes, "embed_tokens.weight": (128, 64)},
            "embed_tokens.weight: engines reject it or load it as the draft's own",
        ),
        (
            config,
            {**shapes, "lm_head.weight": (128, 64)},
            "lm_head.weight: engines reject it or load it as the draft's own",
        ),
        (
            config,
            renamed(
                "candidate_selector.successor_codebook",
                "candidate_selector.successor_codebook.weight",
            ),
            "candidate_selector.successor_codebook.weight: the codebooks are bare parameters, "
            "without .weight",
        ),
        (
            config,
            {**shapes, projection: shapes[projection][::-1]},
            f"{projection} is [64, 32], the loader's parameter [32, 64]",
        ),
    ]
    for bad_config, bad_shapes, problem in broken:
        assert problem in dflash2_loader_problems(bad_config, bad_shapes), problem
