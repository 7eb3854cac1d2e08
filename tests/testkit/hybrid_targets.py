"""Tiny random targets whose caches are not plain KV caches (no downloads).

Each family is built from its transformers config class: linear-attention (recurrent and
convolution state) layers mixed with full attention (Qwen3-Next), and sliding windows
(Gemma 3 text, gpt-oss with its attention sinks, Mistral) narrower than a prompt plus its
answer, so the windows are really exercised. ``hybrid_target(family, window=...)`` builds one
(float32, eval mode, weights from :func:`randomize`); a family whose config class the installed
transformers lacks is skipped with the reason. The tokenizer-free ids: pad 0, bos 1, eos 2.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers
from transformers import PreTrainedModel

from testkit.tiny import TINY_HIDDEN, TINY_VOCAB, randomize

#: The window the sliding families get: far below the tests' prompts plus answers.
TINY_WINDOW = 6

_COMMON: dict[str, object] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": TINY_HIDDEN,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def _qwen3_next(window: int) -> dict[str, object]:
    del window  # its attention layers are full; the linear ones hold a state, not a window
    return {
        "num_hidden_layers": 4,
        # linear, full, linear, linear: a full-attention layer between recurrent ones, and a
        # recurrent layer last (the one a wrong rollback would change the logits through)
        "layer_types": [
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
        ],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    }


def _gemma3_text(window: int) -> dict[str, object]:
    return {
        "num_hidden_layers": 4,
        "layer_types": [
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        "sliding_window": window,
        "query_pre_attn_scalar": 16,
    }


def _gpt_oss(window: int) -> dict[str, object]:
    return {
        "num_hidden_layers": 4,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "sliding_window": window,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }


def _mistral(window: int) -> dict[str, object]:
    # No layer_types: Mistral's window applies to every layer, said by sliding_window alone
    return {"num_hidden_layers": 4, "sliding_window": window}


#: family -> (config class, causal-LM class, the family's fields for a window).
FAMILIES: dict[str, tuple[str, str, Callable[[int], dict[str, object]]]] = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", _qwen3_next),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", _gemma3_text),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", _gpt_oss),
    "mistral": ("MistralConfig", "MistralForCausalLM", _mistral),
}


def hybrid_target(family: str, *, window: int = TINY_WINDOW, seed: int = 1) -> PreTrainedModel:
    """A tiny random target of ``family`` (a key of :data:`FAMILIES`).

    Skips the calling test when the installed transformers has no such config class.
    """
    config_name, model_name, fields = FAMILIES[family]
    config_class = getattr(transformers, config_name, None)
    model_class = getattr(transformers, model_name, None)
    if config_class is None or model_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    config = config_class(**{**_COMMON, **fields(window)})
    torch.manual_seed(0)
    model: PreTrainedModel = model_class(config)
    model.train(False)
    randomize(model, seed=seed)
    return model


__all__ = ["FAMILIES", "TINY_WINDOW", "hybrid_target"]
