"""The target's dims and tensor table that the resource estimate sizes it by.

From its config.json and, when present, its safetensors headers (header bytes only; never
tensor data, never torch); without weight files, the Qwen3/Llama tensor set of the config's dims.
Which tensors FSDP shards (the decoder layers') and how it pads them are here too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import attrs

from dflash_recipes.checkpoint.config_bounds import plausible_maximum
from dflash_recipes.checkpoint.model_files import CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from dflash_recipes.errors import CheckpointError, ResourceError
from dflash_recipes.files.jsonio import read_json_object_file, shorten
from dflash_recipes.records import Record

_LAYER_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@attrs.frozen(repr=False, eq=False, slots=False)
class TargetDims(Record):
    """The target's dims that the estimate needs (config.json), and its tensor shapes."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    #: Tensor name -> shape (from the safetensors headers, else derived from the dims).
    shapes: Mapping[str, tuple[int, ...]]
    source: Literal["safetensors", "config.json"]


def _int_field(config: Mapping[str, object], name: str, where: str) -> int:
    value = config.get(name)
    maximum = plausible_maximum(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= maximum:
        # the bound first: the tensor table below has one entry per layer
        msg = (
            f"{where}: {name} must be an integer in [1, {maximum}] to estimate resources, "
            f"got {shorten(value)}"
        )
        raise ResourceError(msg)
    return value


def read_target_dims(model_dir: Path) -> TargetDims:
    """The target's dims from config.json and its tensor table from the safetensors headers
    (header bytes only); without weight files, the Qwen3/Llama tensor set of the dims."""
    where = model_dir / CONFIG_FILE
    config = read_json_object_file(where, max_bytes=4 * 2**20, what="config", error=ResourceError)
    shapes: dict[str, tuple[int, ...]] | None = None
    if (model_dir / WEIGHTS_FILE).exists() or (model_dir / WEIGHTS_INDEX_FILE).exists():
        from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights

        try:
            weights = read_checkpoint_weights(model_dir)
        except CheckpointError as exc:
            msg = f"cannot size the target from its safetensors headers: {exc}"
            raise ResourceError(msg) from exc
        shapes = {name: info.shape for name, info in weights.tensors.items()}
    return target_dims(config, shapes=shapes, where=str(where))


def target_dims(
    config: Mapping[str, object],
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    where: str = CONFIG_FILE,
) -> TargetDims:
    """:class:`TargetDims` of a config.json mapping; `shapes` (the tensor table of the weight
    files) when known, else the Qwen3/Llama tensor set of the config's dims."""
    text = config.get("text_config")
    if isinstance(text, dict):  # multimodal wrappers nest the language model's config
        config = {**config, **text}
    hidden = _int_field(config, "hidden_size", where)
    layers = _int_field(config, "num_hidden_layers", where)
    heads = _int_field(config, "num_attention_heads", where)
    # absent or null: what transformers assumes (one kv head per head, hidden // heads)
    stated = {key: config.get(key) is not None for key in ("num_key_value_heads", "head_dim")}
    kv_heads = (
        _int_field(config, "num_key_value_heads", where) if stated["num_key_value_heads"] else heads
    )
    head_dim = _int_field(config, "head_dim", where) if stated["head_dim"] else hidden // heads
    inter = _int_field(config, "intermediate_size", where)
    vocab = _int_field(config, "vocab_size", where)
    if shapes is None:
        tied = config.get("tie_word_embeddings") is True
        shapes = _qwen3_shapes(hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied=tied)
        source: Literal["safetensors", "config.json"] = "config.json"
    else:
        source = "safetensors"
    return TargetDims(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=vocab,
        shapes=shapes,
        source=source,
    )


def _qwen3_shapes(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    vocab: int,
    *,
    tied: bool,
) -> dict[str, tuple[int, ...]]:
    """The tensors of a Qwen3-style decoder (Llama's, plus q/k norms) of these dims."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def is_decoder_layer_tensor(name: str) -> bool:
    """True for a tensor of the target's decoder layers (what FSDP shards)."""
    return _LAYER_TENSOR.search(name) is not None


def decoder_layer_index(name: str) -> int | None:
    """The decoder layer a target tensor belongs to (``...layers.<i>.``), else None."""
    found = _LAYER_TENSOR.search(name)
    return None if found is None else int(found.group(1))


def sharded_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements one rank holds of a tensor FSDP2 shards on dim 0 (padded up to the world)."""
    if not shape:
        return 1
    rest = math.prod(shape[1:])
    return -(-shape[0] // world_size) * rest


__all__ = [
    "TargetDims",
    "decoder_layer_index",
    "is_decoder_layer_tensor",
    "read_target_dims",
    "sharded_numel",
    "target_dims",
]
