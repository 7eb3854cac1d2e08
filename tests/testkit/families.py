"""The family matrix: one tiny random target per model family the product is used with.

Each :class:`Family` names a transformers config class and the keyword arguments that make it
tiny (4 to 6 layers, hidden 64) while keeping what sets the family apart: mixture-of-experts
routing, sliding windows of 8 tokens (shorter than the 20-40 token conversations of
:func:`write_chat_data`), Llama 4's 8-token attention chunks, DeepSeek-V3's latent attention,
Qwen3-Next's linear-attention layers. Every family shares the demo target's tokenizer
(vocabulary 392: pad 0, eos 2 `<|im_end|>`, no bos, spare special tokens 384-391), so one chat
template and one data file serve the whole matrix.

- :data:`FAMILIES` -- the registry, in the order of the docs table.
- :func:`missing_reason` -- why the installed transformers cannot build a family (or None).
- :func:`build_target` -- the random model, float32, eval mode, weights far from init.
- :func:`write_target` -- that model as a local model directory (config.json,
  model.safetensors, tokenizer files), what `dflash-recipe init --base-model` reads.
- :func:`write_chat_data` -- a chat JSONL of short conversations.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from testkit.tiny import randomize

#: The demo target's tokenizer, shared by every family.
DEMO_TARGET = Path(__file__).resolve().parents[2] / "dflash_recipes" / "demo_data" / "target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB_SIZE = 392
PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 2
#: `<|spare_0|>`: a special token no text produces, the drafter's mask id.
MASK_TOKEN_ID = 384
#: Sliding windows and attention chunks, shorter than every conversation of the data.
WINDOW = 8

_COMMON: Mapping[str, object] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "pad_token_id": PAD_TOKEN_ID,
    "bos_token_id": None,
    "eos_token_id": EOS_TOKEN_ID,
    "tie_word_embeddings": False,
}
_HEAD_DIM: Mapping[str, object] = {"head_dim": 16}
_MOE: Mapping[str, object] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


@attrs.frozen
class Family:
    """A model family of the matrix: its name (the test id), config class and tiny sizes."""

    name: str
    #: The transformers config class, by name (a transformers without it skips the family).
    config_class: str
    #: Keyword arguments over the shared tiny sizes (:data:`_COMMON`).
    kwargs: Mapping[str, object] = attrs.field(factory=dict)

    def config(self) -> PretrainedConfig:
        """The tiny config (AttributeError when transformers lacks the class)."""
        config_type = getattr(transformers, self.config_class)
        config: PretrainedConfig = config_type(**{**_COMMON, **self.kwargs})
        return config


FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaConfig"),
    Family("qwen2", "Qwen2Config"),
    Family("qwen3", "Qwen3Config", _HEAD_DIM),
    Family("qwen3_moe", "Qwen3MoeConfig", {**_HEAD_DIM, **_MOE}),
    Family("mistral", "MistralConfig", {**_HEAD_DIM, "sliding_window": WINDOW}),
    Family(
        "mixtral",
        "MixtralConfig",
        {**_HEAD_DIM, "sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    Family("gemma2", "Gemma2Config", {**_HEAD_DIM, "sliding_window": WINDOW}),
    # six layers: Gemma 3 makes every sixth layer a full-attention one
    Family(
        "gemma3_text",
        "Gemma3TextConfig",
        {**_HEAD_DIM, "sliding_window": WINDOW, "num_hidden_layers": 6},
    ),
    Family("phi3", "Phi3Config"),
    Family(
        "gpt_oss",
        "GptOssConfig",
        {
            **_HEAD_DIM,
            "sliding_window": WINDOW,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            # YaRN as released: 32 x its original 4096 positions
            "max_position_embeddings": 131072,
        },
    ),
    Family("olmo2", "Olmo2Config"),
    Family(
        "deepseek_v3",
        "DeepseekV3Config",
        {
            # multi-head latent attention: one key/value head per query head, as released
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "head_dim": 8,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    Family(
        "qwen3_next",
        "Qwen3NextConfig",
        {
            **_HEAD_DIM,
            **_MOE,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        },
    ),
    Family("glm", "GlmConfig", _HEAD_DIM),
    Family("glm4", "Glm4Config", _HEAD_DIM),
    Family(
        "glm4_moe",
        "Glm4MoeConfig",
        {
            **_HEAD_DIM,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    Family("granite", "GraniteConfig"),
    Family(
        "llama4_text",
        "Llama4TextConfig",
        {
            **_HEAD_DIM,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 128,
            "attention_chunk_size": WINDOW,
        },
    ),
)


def missing_reason(family: Family) -> str | None:
    """Why the installed transformers cannot build `family`, or None when it can."""
    if hasattr(transformers, family.config_class):
        return None
    return f"transformers {transformers.__version__} has no {family.config_class}"


def build_target(family: Family, *, seed: int = 0) -> PreTrainedModel:
    """The family's tiny random model: float32, eval mode, weights far from init (norm
    weights around 1, so every layer changes its input and greedy tokens have clear gaps)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        family.config(), dtype=torch.float32
    )
    assert isinstance(model, PreTrainedModel)
    randomize(model, seed=seed)
    model.train(False)
    return model


def write_target(family: Family, directory: Path, *, seed: int = 0) -> Path:
    """The family's tiny random model saved as a local model directory, with the demo
    target's tokenizer files beside it; returns `directory`."""
    model = build_target(family, seed=seed)
    model.save_pretrained(directory)  # safetensors, the only format transformers 5 writes
    for name in TOKENIZER_FILES:
        shutil.copyfile(DEMO_TARGET / name, directory / name)
    return directory


_PLACES = ("dorven", "rinzune", "belmora", "fenwick", "arvand", "cestia", "dunmark", "elvaria")
_FOODS = ("lamb stew", "plum cake", "honey bread", "salt fish", "rice pie")
_COLOURS = ("white", "red", "green", "gold", "silver")


def write_chat_data(path: Path, count: int = 36, *, seed: int = 0) -> Path:
    """`count` short chat conversations (OpenAI `messages`, one user and one assistant turn:
    20 to 40 tokens with the chat template) as JSONL at `path`; returns `path`."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        place = _PLACES[index % len(_PLACES)]
        if index % 3 == 0:
            user, answer = f"{place} flag?", f"{rng.choice(_COLOURS)}."
        elif index % 3 == 1:
            user, answer = f"{place} food?", f"{rng.choice(_FOODS)}."
        else:
            user, answer = f"{place} bridges?", f"{rng.randint(2, 19)} bridges."
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        rows.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


__all__ = [
    "EOS_TOKEN_ID",
    "FAMILIES",
    "MASK_TOKEN_ID",
    "VOCAB_SIZE",
    "WINDOW",
    "Family",
    "build_target",
    "missing_reason",
    "write_chat_data",
    "write_target",
]
