"""The export's remote code: `AutoModel.from_pretrained(export, trust_remote_code=True)` in a
fresh, offline interpreter returns the drafter, every tensor loaded, computing what the
project's drafter computes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.numerics import assert_equal_up_to_rounding
from testkit.tiny import TINY_HIDDEN, randomize, tiny_plan
from transformers import Qwen3Config

from dflash_recipes.executor.model import export
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.executor.model.masks import build_dense_block_mask

_LOADER = r"""
import json, sys
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

inputs = load_file(sys.argv[1])
outputs, report = {}, {}
for export in sys.argv[3:]:
    model, info = AutoModel.from_pretrained(
        export, trust_remote_code=True, output_loading_info=True, dtype=torch.float32
    )
    model.eval()
    with torch.no_grad():
        outputs[export] = model(**inputs).contiguous()
    report[export] = {
        "class": type(model).__name__,
        "module": type(model).__module__,
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "mismatched": [str(m) for m in info["mismatched_keys"]],
        "windows": model.windows,
    }
save_file(outputs, sys.argv[2])
report["dflash_recipes imported"] = any(m.startswith("dflash_recipes") for m in sys.modules)
print(json.dumps(report))
"""

_CTX, _BLOCK = 9, 4


def _export(tmp_path: Path, name: str, **overrides: object) -> tuple[DFlashDraftModel, Path]:
    plan = tiny_plan(tmp_path / name, block_size=_BLOCK, **overrides)
    model = DFlashDraftModel(plan.resolved_draft())
    randomize(model, seed=len(name))
    return model, export_drafter(model, plan, tmp_path / name / "export", dtype="float32")


@pytest.mark.usefixtures("one_thread")  # the loader runs with one thread too
@pytest.mark.timing
def test_automodel_with_remote_code_loads_the_drafter_and_computes_the_same(
    tmp_path: Path,
) -> None:
    drafters = dict(
        [
            ("plain", _export(tmp_path, "plain")),
            (
                "sliding",
                _export(
                    tmp_path,
                    "sliding",
                    layer_types=("sliding_attention", "full_attention"),
                    sliding_window=3,
                    attention_sink=True,
                ),
            ),
        ]
    )
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "noise_embedding": torch.randn(1, _BLOCK, TINY_HIDDEN, generator=gen),
        "target_hidden": torch.randn(1, _CTX, 2 * TINY_HIDDEN, generator=gen),
        "position_ids": torch.arange(_CTX + _BLOCK).unsqueeze(0),
    }
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    (tmp_path / "load.py").write_text(_LOADER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHONPATH"))}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
        HF_MODULES_CACHE=str(tmp_path / "hf-modules"),
        OMP_NUM_THREADS="1",
    )
    exports = [str(path) for _, path in drafters.values()]
    done = subprocess.run(
        [sys.executable, "load.py", "inputs.safetensors", "out.safetensors", *exports],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["dflash_recipes imported"] is False
    outputs = load_file(str(tmp_path / "out.safetensors"))
    for name, (model, path) in drafters.items():
        loaded = report[str(path)]
        assert loaded["class"] == "DFlashDraftModel", name
        assert loaded["module"].endswith("dflash"), name
        assert (loaded["missing"], loaded["unexpected"], loaded["mismatched"]) == ([], [], [])
        expected_windows = [3, None] if name == "sliding" else [None, None]
        assert loaded["windows"] == expected_windows
        # The project's drafter on the same block: context 0..T-1, block T..T+B-1.
        mask = build_dense_block_mask(
            torch.tensor([[_CTX]]), _BLOCK, _CTX, torch.ones(1, 1, dtype=torch.bool)
        )
        with torch.no_grad():
            ours = model(
                inputs["noise_embedding"],
                model.fuse_context(inputs["target_hidden"]),
                inputs["position_ids"][:, _CTX:],
                inputs["position_ids"][:, :_CTX],
                mask,
            )
        # Two implementations of one computation: equal up to float32 rounding (a wrong mask,
        # window or weight moves the output by far more).
        assert_equal_up_to_rounding(outputs[str(path)], ours, what=f"the {name} outputs")


def test_remote_code_refuses_a_head_it_does_not_implement() -> None:
    path = Path(export.__file__).parent / "remote_code" / "dflash.py"
    spec = importlib.util.spec_from_file_location("dflash_remote_code_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = Qwen3Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=64,
    )
    config.dflash_config = {"target_layer_ids": [0], "projector_type": "domino"}
    with pytest.raises(ValueError, match=r"domino head, which dflash\.py does not implement"):
        module.DFlashDraftModel(config)
    config.dflash_config = {"target_layer_ids": [0]}
    assert sorted(module.DFlashDraftModel(config).state_dict()) == sorted(
        ["fc.weight", "hidden_norm.weight", "norm.weight"]
        + [f"layers.0.{name}.weight" for name in _LAYER_TENSORS]
    )


_LAYER_TENSORS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
