"""Export: z-lab tensors and config.json (docs/dflash.md, "Serving the export"), atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from testkit.tiny import TINY_MASK_TOKEN_ID, TINY_VOCAB, tiny_plan, tiny_target

from dflash_recipes.checkpoint.hfconfig import read_checkpoint_config
from dflash_recipes.executor.model import export as export_module
from dflash_recipes.executor.model.convert import convert
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.files import crashsafe


def test_five_layer_export_has_58_unprefixed_tensors(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, num_hidden_layers=5)
    model = convert(tiny_target(plan), plan)
    out = export_drafter(model, plan, tmp_path / "export", dtype="bfloat16")
    tensors = load_file(str(out / "model.safetensors"))
    assert len(tensors) == 58
    assert "fc.weight" in tensors and "layers.4.mlp.down_proj.weight" in tensors
    assert not any(n.startswith("dflash_module") or "embed" in n or "lm_head" in n for n in tensors)
    assert not any("inv_freq" in n for n in tensors)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    source = model.dflash_module.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(tensor, source[name].to(torch.bfloat16)), name


def test_config_json_describes_the_drafter_and_its_target(tmp_path: Path) -> None:
    plan = tiny_plan(
        tmp_path, rope_theta=1_000_000.0, block_size=8, target_max_position_embeddings=512
    )
    out = export_drafter(
        DFlashDraftModel(plan.resolved_draft()), plan, tmp_path / "export", dtype="bfloat16"
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    expected = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention", "full_attention"],
        "tie_word_embeddings": False,
        "vocab_size": TINY_VOCAB,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "max_position_embeddings": 512,
        "num_target_layers": 4,
        "block_size": 8,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }
    assert {k: config[k] for k in expected} == expected
    dflash = config["dflash_config"]
    assert dflash["block_size"] == 8
    assert dflash["mask_token_id"] == TINY_MASK_TOKEN_ID
    assert dflash["target_layer_ids"] == [1, 2]
    # The compiler's reader sees the same facts.
    facts = read_checkpoint_config(out)
    assert (facts.block_size, facts.mask_token_id, facts.target_layer_ids) == (
        8,
        TINY_MASK_TOKEN_ID,
        (1, 2),
    )
    assert facts.rope_theta == 1_000_000.0
    assert not facts.problems


def test_config_json_carries_rope_scaling_and_head_fields(tmp_path: Path) -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    plan = tiny_plan(
        tmp_path,
        rope_type="llama3",
        rope_theta=500_000.0,
        rope_scaling=scaling,
        projector_type="dspark",
        markov_rank=4,
        use_confidence_head=True,
    )
    out = export_drafter(DFlashDraftModel(plan.resolved_draft()), plan, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500_000.0, **scaling}
    assert config["rope_scaling"] == {"rope_type": "llama3", **scaling}
    dflash = config["dflash_config"]
    assert dflash["projector_type"] == "dspark"
    assert (dflash["markov_rank"], dflash["use_confidence_head"]) == (4, True)
    assert config["dtype"] == "float32"  # the plan's dtype when none is given

    plan = tiny_plan(tmp_path, projector_type="domino", emb_dim=16, gru_hidden_dim=8)
    out = export_drafter(DFlashDraftModel(plan.resolved_draft()), plan, tmp_path / "domino")
    dflash = json.loads((out / "config.json").read_text())["dflash_config"]
    assert (dflash["projector_type"], dflash["emb_dim"], dflash["gru_hidden_dim"]) == (
        "domino",
        16,
        8,
    )


def test_failed_export_leaves_no_partial_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = tiny_plan(tmp_path)
    module = DFlashDraftModel(plan.resolved_draft())

    def crash(*_args: object, **_kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        export_drafter(module, plan, tmp_path / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_failed_export_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = tiny_plan(tmp_path)
    first = DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(1))
    out = export_drafter(first, plan, tmp_path / "export")
    before = load_file(str(out / "model.safetensors"))
    second = DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(2))

    def crash(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("killed before the rename")

    with monkeypatch.context() as patch:
        patch.setattr(crashsafe, "publish_directory", crash)
        with pytest.raises(RuntimeError, match="killed"):
            export_drafter(second, plan, tmp_path / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    after = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(before[n], after[n]) for n in before)

    export_drafter(second, plan, tmp_path / "export")
    replaced = load_file(str(out / "model.safetensors"))
    assert torch.equal(replaced["fc.weight"], second.fc.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_export_files_are_readable_by_other_users(tmp_path: Path) -> None:
    """An engine running as another user must be able to read the export (umask 022)."""
    import os
    import stat

    plan = tiny_plan(tmp_path)
    old = os.umask(0o022)
    try:
        out = export_drafter(DFlashDraftModel(plan.resolved_draft()), plan, tmp_path / "export")
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        mode = stat.S_IMODE((out / name).stat().st_mode)
        assert mode == 0o644, (name, oct(mode))


def test_the_remote_code_is_written_only_when_the_kinds_config_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a kind whose engines load it without remote code (DFlash 2) drops auto_map from its
    # config.json; the export then ships no dflash.py for it to name
    plan = tiny_plan(tmp_path)
    module = DFlashDraftModel(plan.resolved_draft())
    with_code = export_drafter(module, plan, tmp_path / "with")
    assert (with_code / export_module.REMOTE_CODE_FILE).is_file()
    kind = export_module.kind_facts("dflash")

    def without_auto_map(draft: object, config: dict[str, object]) -> dict[str, object]:
        return {k: v for k, v in config.items() if k != "auto_map"}

    monkeypatch.setattr(type(kind), "export_config", lambda _self, d, c: without_auto_map(d, c))
    out = export_drafter(module, plan, tmp_path / "without")
    names = {p.name for p in out.iterdir()}
    assert export_module.REMOTE_CODE_FILE not in names
    assert {"config.json", "model.safetensors"} <= names
    assert "auto_map" not in json.loads((out / "config.json").read_text())
