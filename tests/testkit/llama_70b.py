"""A Llama-3.3-70B recipe as `dflash-recipe init` writes it, from the target's config.json alone
(no weights): what the resource-plan tests size the largest targets on one node with."""

from __future__ import annotations

import json
from pathlib import Path

from testkit.cli_runner import cli

#: Llama-3.3-70B-Instruct's config.json (the values that size it).
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def write_llama_70b_recipe(out: Path) -> Path:
    """`out/base/config.json`, a one-row `out/train.jsonl` and `out/recipe.yaml` from `init`."""
    (out / "base").mkdir()
    (out / "base" / "config.json").write_text(json.dumps(LLAMA_70B), encoding="utf-8")
    (out / "train.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    result = cli(
        "init",
        "--base-model",
        str(out / "base"),
        "--mask-token-id",
        "128002",
        "--data-path",
        str(out / "train.jsonl"),
        "--output-dir",
        str(out / "run"),
        "-o",
        str(out / "recipe.yaml"),
    )
    assert result.exit_code == 0, result.output
    return out / "recipe.yaml"
