"""Two released checkpoints' layouts, rebuilt as sparse files behind a matching target (no torch).

The public z-lab/dflash repository ships, as test fixtures, verbatim copies of two real
checkpoints' `config.json` and safetensors headers (`tests/fixtures/assistant-*` and
`tests/fixtures/dflash2-*`). Their facts (config values, tensor names, shapes, dtypes) are copied
here; the files are rebuilt the way :mod:`testkit.fixture_8b` builds its drafter: a real header,
then a hole of the full data size.

- :func:`write_assistant_checkpoint` -- the `MuseGlimmerAssistantModel` drafter (5 sliding-window
  layers, fusion tensors under `encoder.`, DFlash fields at the top level of config.json), 5.1 GB
  sparse (the data size is the real header's, 5,111,970,304 bytes);
- :func:`write_dflash2_checkpoint` -- the `DFlash2DraftModel` drafter, 5.5 GB sparse;
- :func:`write_target` -- a base model matching both: 52 layers, 6656 wide, vocabulary 202048.
"""

from __future__ import annotations

from pathlib import Path

from testkit.st_fixtures import TensorSpec, base_model_config, write_json, write_safetensors

HIDDEN = 6656
TARGET_LAYERS = 52
#: The DFlash 2 config's vocab_size (the assistant's config states none).
VOCAB = 202048
DRAFT_LAYERS = 5
TAPS = [1, 13, 25, 37, 49]
MASK_TOKEN_ID = 201818
BLOCK_SIZE = 16
SLIDING_WINDOW = 2048
RMS_NORM_EPS = 1e-05
ROPE_THETA = 500000.0
MAX_POSITIONS = 131072
#: The draft dims both configs state (recipe names).
DIMS: dict[str, int] = {
    "num_hidden_layers": DRAFT_LAYERS,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 19968,
}

#: z-lab/dflash tests/fixtures/assistant-config.json, value for value.
ASSISTANT_CONFIG: dict[str, object] = {
    "architectures": ["MuseGlimmerAssistantModel"],
    "attention_dropout": 0,
    "block_size": BLOCK_SIZE,
    "bos_token_id": 200000,
    "dtype": "bfloat16",
    "eos_token_id": 200001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "intermediate_size": 19968,
    "layer_types": ["sliding_attention"] * DRAFT_LAYERS,
    "mask_token_id": MASK_TOKEN_ID,
    "max_position_embeddings": MAX_POSITIONS,
    "model_type": "muse_glimmer_assistant",
    "num_attention_heads": 32,
    "num_hidden_layers": DRAFT_LAYERS,
    "num_key_value_heads": 8,
    "pad_token_id": 200018,
    "rms_norm_eps": RMS_NORM_EPS,
    "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
    "sliding_window": SLIDING_WINDOW,
    "target_layer_ids": TAPS,
    "transformers_version": "5.15.0.dev0",
}

#: z-lab/dflash tests/fixtures/dflash2-config.json, value for value.
DFLASH2_CONFIG: dict[str, object] = {
    "architectures": ["DFlash2DraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 200000,
    "is_causal": False,
    "dflash_config": {
        "block_size": BLOCK_SIZE,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "final_logit_softcapping": 20.0,
        "mask_token_id": MASK_TOKEN_ID,
        "output_multiplier": 0.19611613513818404,
        "selector_rank": 256,
        "selector_top_k": 16,
        "target_layer_ids": TAPS,
    },
    "dtype": "bfloat16",
    "eos_token_id": 200001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": 19968,
    "layer_types": ["sliding_attention"] * DRAFT_LAYERS,
    "max_position_embeddings": MAX_POSITIONS,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": DRAFT_LAYERS,
    "num_key_value_heads": 8,
    "num_target_layers": TARGET_LAYERS,
    "pad_token_id": 200018,
    "rms_norm_eps": RMS_NORM_EPS,
    "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
    "sliding_window": SLIDING_WINDOW,
    "tie_word_embeddings": False,
    "transformers_version": "5.15.0",
    "use_cache": False,
    "use_sliding_window": True,
    "vocab_size": VOCAB,
}


def _layer(index: int) -> dict[str, TensorSpec]:
    """One decoder layer as both headers store it (names sorted as in the files)."""
    p = f"layers.{index}."
    return {
        p + "input_layernorm.weight": ("BF16", (HIDDEN,)),
        p + "mlp.down_proj.weight": ("BF16", (HIDDEN, 19968)),
        p + "mlp.gate_proj.weight": ("BF16", (19968, HIDDEN)),
        p + "mlp.up_proj.weight": ("BF16", (19968, HIDDEN)),
        p + "post_attention_layernorm.weight": ("BF16", (HIDDEN,)),
        p + "self_attn.k_norm.weight": ("BF16", (128,)),
        p + "self_attn.k_proj.weight": ("BF16", (1024, HIDDEN)),
        p + "self_attn.o_proj.weight": ("BF16", (HIDDEN, 4096)),
        p + "self_attn.q_norm.weight": ("BF16", (128,)),
        p + "self_attn.q_proj.weight": ("BF16", (4096, HIDDEN)),
        p + "self_attn.v_proj.weight": ("BF16", (1024, HIDDEN)),
    }


def assistant_tensors() -> dict[str, TensorSpec]:
    """The 58 tensors of z-lab/dflash tests/fixtures/assistant-safetensors-header.json."""
    tensors: dict[str, TensorSpec] = {
        "encoder.fc.weight": ("BF16", (HIDDEN, len(TAPS) * HIDDEN)),
        "encoder.output_norm_enc.weight": ("BF16", (HIDDEN,)),
    }
    for index in range(DRAFT_LAYERS):
        tensors.update(_layer(index))
    tensors["norm.weight"] = ("BF16", (HIDDEN,))
    return tensors


def dflash2_tensors() -> dict[str, TensorSpec]:
    """The 81 tensors of z-lab/dflash tests/fixtures/dflash2-safetensors-header.json."""
    tensors: dict[str, TensorSpec] = {
        "candidate_selector.hidden_projection.weight": ("BF16", (256, HIDDEN)),
        "candidate_selector.predecessor_codebook": ("BF16", (VOCAB, 256)),
        "candidate_selector.successor_codebook": ("BF16", (VOCAB, 256)),
        "fc.weight": ("BF16", (HIDDEN, len(TAPS) * HIDDEN)),
        "hidden_norm.weight": ("BF16", (HIDDEN,)),
    }
    for index in range(DRAFT_LAYERS):
        layer = _layer(index)
        p = f"layers.{index}."
        conv = {
            p + "attention_conv.base_kernel": ("BF16", (2, 2, HIDDEN)),
            p + "attention_conv.kernel_projection.weight": ("BF16", (1664, HIDDEN)),
            p + "mlp_conv.base_kernel": ("BF16", (2, 2, HIDDEN)),
            p + "mlp_conv.kernel_projection.weight": ("BF16", (1664, HIDDEN)),
        }
        tensors.update(dict(sorted({**layer, **conv}.items())))
    tensors["norm.weight"] = ("BF16", (HIDDEN,))
    return tensors


def write_target(directory: Path) -> Path:
    """A base model both drafters fit: 52 layers, 6656 wide, vocabulary 202048 (config only).

    Width, layer count, vocabulary, RoPE, positions and eps are what the drafters' configs
    say of their target; the attention and MLP sizes only feed `init` suggestions.
    """
    config = base_model_config(
        hidden=HIDDEN,
        layers=TARGET_LAYERS,
        vocab=VOCAB,
        heads=64,
        kv_heads=8,
        head_dim=128,
        intermediate=4 * HIDDEN,
        rope_theta=ROPE_THETA,
        rope_layout="nested",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=RMS_NORM_EPS,
    )
    write_json(directory / "config.json", config)
    return directory


def write_assistant_checkpoint(directory: Path) -> Path:
    """The MuseGlimmer assistant drafter: its config.json and a sparse model.safetensors."""
    write_safetensors(
        directory / "model.safetensors",
        assistant_tensors(),
        fill="sparse",
        metadata={"format": "pt"},
    )
    write_json(directory / "config.json", ASSISTANT_CONFIG)
    return directory


def write_dflash2_checkpoint(directory: Path) -> Path:
    """The DFlash 2 drafter: its config.json and a sparse model.safetensors."""
    write_safetensors(directory / "model.safetensors", dflash2_tensors(), fill="sparse")
    write_json(directory / "config.json", DFLASH2_CONFIG)
    return directory


__all__ = [
    "ASSISTANT_CONFIG",
    "DFLASH2_CONFIG",
    "DIMS",
    "assistant_tensors",
    "dflash2_tensors",
    "write_assistant_checkpoint",
    "write_dflash2_checkpoint",
    "write_target",
]
