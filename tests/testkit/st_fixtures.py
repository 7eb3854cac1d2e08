"""Test helpers that write tiny safetensors checkpoints and config.json files, without torch.

Import from any test (`from testkit.st_fixtures import write_drafter_checkpoint`); pytest's
`pythonpath` setting puts tests/ on sys.path. The writer is our own (struct + json), so tests
can also build files the `safetensors` library would refuse to write: see
:func:`write_raw_safetensors`.

- :func:`write_safetensors` -- any tensors, zeros / deterministic random values / sparse.
- :func:`write_sharded_safetensors` -- `model.safetensors.index.json` plus shards.
- :func:`write_drafter_checkpoint` -- an exported drafter (z-lab layout + config.json).
- :func:`drafter_config`, :func:`base_model_config` -- the config.json dicts, to edit first.
"""

from __future__ import annotations

import array
import json
import math
import random
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from dflash_recipes.checkpoint.model_files import WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from dflash_recipes.checkpoint.safetensors_header import DTYPE_BITS
from dflash_recipes.checkpoint.tensor_layout import LayoutSpec, expected_layout

Fill = Literal["zeros", "random", "sparse"]
TensorSpec = tuple[str, Sequence[int]]

# Qwen3-8B, the target of the worked examples in recipes/Qwen/Qwen3-8B.
QWEN3_MASK_TOKEN_ID = 151669


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    bits = DTYPE_BITS[dtype] * int(math.prod(shape))
    if bits % 8:
        msg = f"{dtype} with shape {list(shape)} does not fill whole bytes"
        raise ValueError(msg)
    return bits // 8


def encode_header(
    tensors: Mapping[str, TensorSpec], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, int]:
    """The padded JSON header for `tensors` laid out contiguously, and the data size."""
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = _nbytes(dtype, shape)
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # The reference writer pads with spaces so the data region starts 8-byte aligned.
    raw += b" " * (-len(raw) % 8)
    return raw, offset


def _random_bytes(dtype: str, count: int, rng: random.Random) -> bytes:
    """Finite, deterministic values: floats in [-1, 1), small ints, 0/1 for BOOL."""
    if dtype == "F16":
        return struct.pack(f"<{count}e", *(rng.uniform(-1.0, 1.0) for _ in range(count)))
    if dtype in {"F32", "F64", "BF16", "C64"}:
        n = 2 * count if dtype == "C64" else count
        arr = array.array(
            "d" if dtype == "F64" else "f", (rng.uniform(-1.0, 1.0) for _ in range(n))
        )
        if sys.byteorder == "big":
            arr.byteswap()
        raw = arr.tobytes()
        if dtype == "BF16":  # the upper half of each little-endian float32
            return b"".join(raw[i + 2 : i + 4] for i in range(0, len(raw), 4))
        return raw
    if dtype == "BOOL":
        return bytes(rng.randrange(2) for _ in range(count))
    if dtype.startswith(("F8", "F6", "F4")):
        # Clearing bit 6 keeps every F8 exponent below all-ones (no NaN/Inf); F6/F4 are finite.
        return bytes(rng.randrange(256) & 0xBF for _ in range(_nbytes(dtype, (count,))))
    width = DTYPE_BITS[dtype] // 8
    signed = dtype.startswith("I")
    return b"".join(
        (rng.randrange(-100, 100) if signed else rng.randrange(200)).to_bytes(
            width, "little", signed=signed
        )
        for _ in range(count)
    )


def write_safetensors(
    path: Path,
    tensors: Mapping[str, TensorSpec],
    *,
    fill: Fill = "zeros",
    metadata: Mapping[str, str] | None = None,
    seed: int = 0,
) -> Path:
    """Write a valid safetensors file: `{name: (dtype, shape)}` in the given order.

    fill: "zeros"; "random" (finite values, deterministic for `seed`, per tensor name);
    "sparse" (no data written, the file truncated to full size: cheap GB-scale files).
    """
    raw, data_size = encode_header(tensors, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        if fill == "sparse":
            handle.truncate(8 + len(raw) + data_size)
        else:
            for name, (dtype, shape) in tensors.items():
                count = math.prod(shape)
                if fill == "zeros":
                    handle.write(bytes(_nbytes(dtype, shape)))
                else:
                    rng = random.Random(f"{seed}:{name}")
                    handle.write(_random_bytes(dtype, count, rng))
    return path


def write_raw_safetensors(
    path: Path,
    header: bytes | str | Mapping[str, object],
    *,
    data: bytes | int = b"",
    length: int | None = None,
) -> Path:
    """Write a possibly broken file: an 8-byte length (`length` or the real one), the header
    bytes (a dict is JSON-encoded as is), then `data` (bytes, or that many zero bytes)."""
    if isinstance(header, Mapping):
        raw = json.dumps(header).encode("utf-8")
    elif isinstance(header, str):
        raw = header.encode("utf-8")
    else:
        raw = header
    body = bytes(data) if isinstance(data, int) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + body)
    return path


def write_sharded_safetensors(
    directory: Path,
    tensors: Mapping[str, TensorSpec],
    *,
    shards: int | Sequence[Iterable[str]] = 2,
    fill: Fill = "zeros",
    index_extra: Mapping[str, object] | None = None,
) -> dict[str, str]:
    """Write `model-0000k-of-0000n.safetensors` shards and the index; return the weight_map.

    `shards`: a count (tensors dealt round-robin in order) or explicit name groups.
    """
    names = list(tensors)
    if isinstance(shards, int):
        groups: list[list[str]] = [names[i::shards] for i in range(shards)]
    else:
        groups = [list(group) for group in shards]
    weight_map: dict[str, str] = {}
    total = len(groups)
    for number, group in enumerate(groups, start=1):
        shard = f"model-{number:05d}-of-{total:05d}.safetensors"
        write_safetensors(directory / shard, {n: tensors[n] for n in group}, fill=fill)
        for name in group:
            weight_map[name] = shard
    size = sum(_nbytes(*tensors[n]) for n in weight_map)
    index: dict[str, object] = {"metadata": {"total_size": size}, "weight_map": weight_map}
    index.update(index_extra or {})
    write_json(directory / WEIGHTS_INDEX_FILE, index)
    return weight_map


def write_json(path: Path, value: object) -> Path:
    """Write `value` as indented JSON (creating parent folders)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    return path


def default_taps(num_target_layers: int, count: int) -> list[int]:
    """The reference's default taps, so fixtures agree with the compiler's formula."""
    if count == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count)]


def base_model_config(
    *,
    hidden: int = 32,
    layers: int = 8,
    vocab: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    intermediate: int = 64,
    rope_theta: float = 1_000_000.0,
    rope_layout: Literal["flat", "nested"] = "flat",
    max_position_embeddings: int = 4096,
    rms_norm_eps: float = 1e-6,
) -> dict[str, object]:
    """A Qwen3 target's config.json; `rope_layout="nested"` writes transformers-5
    `rope_parameters` instead of the flat `rope_theta`."""
    config: dict[str, object] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if rope_layout == "flat":
        config["rope_theta"] = rope_theta
        config["rope_scaling"] = None
    else:
        config["rope_parameters"] = {"rope_theta": rope_theta, "rope_type": "default"}
    return config


def drafter_config(
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    intermediate: int = 64,
    vocab: int = 256,
    num_target_layers: int = 8,
    target_layer_ids: Sequence[int] | None = None,
    n_taps: int | None = None,
    mask_token_id: int = 250,
    block_size: int = 16,
    rope_theta: float = 1_000_000.0,
    rms_norm_eps: float = 1e-6,
    max_position_embeddings: int = 4096,
    dtype: str = "bfloat16",
    variant: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """An exported drafter's config.json (docs/dflash.md, "Serving the export"), tiny by default.

    Taps default to the formula for `n_taps` (default: one per draft layer). `variant`
    fields (projector_type, emb_dim, ...) are added to `dflash_config`.
    """
    taps = (
        list(target_layer_ids)
        if target_layer_ids is not None
        else default_taps(num_target_layers, n_taps if n_taps is not None else layers)
    )
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * layers,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "num_target_layers": num_target_layers,
        "block_size": block_size,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": taps,
            "block_size": block_size,
            **(variant or {}),
        },
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def drafter_tensors(
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    intermediate: int = 64,
    n_taps: int = 2,
    vocab: int = 256,
    dtype: str = "BF16",
    projector_type: Literal["dflash", "domino", "dspark"] = "dflash",
    emb_dim: int | None = None,
    gru_hidden_dim: int | None = None,
    markov_rank: int | None = None,
    use_confidence_head: bool = False,
    attention_sink: bool = False,
    extra: Mapping[str, Sequence[int]] | None = None,
    drop: Iterable[str] = (),
) -> dict[str, TensorSpec]:
    """The `{name: (dtype, shape)}` table of a drafter, edited by `extra` and `drop`.

    `extra` adds tensors or replaces the shape of existing ones; `drop` removes names.
    """
    spec = LayoutSpec(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        n_taps=n_taps,
        vocab_size=vocab,
        projector_type=projector_type,
        emb_dim=emb_dim,
        gru_hidden_dim=gru_hidden_dim,
        markov_rank=markov_rank,
        use_confidence_head=use_confidence_head,
        attention_sink=attention_sink,
    )
    table: dict[str, TensorSpec] = {n: (dtype, s) for n, s in expected_layout(spec).items()}
    for name, shape in (extra or {}).items():
        table[name] = (dtype, tuple(shape))
    dropped = set(drop)
    unknown = dropped - set(table)
    if unknown:
        msg = f"drop names tensors the layout does not have: {sorted(unknown)}"
        raise ValueError(msg)
    return {n: v for n, v in table.items() if n not in dropped}


def _variant_fields(
    projector_type: str,
    emb_dim: int | None,
    gru_hidden_dim: int | None,
    markov_rank: int | None,
    use_confidence_head: bool,
) -> dict[str, object]:
    if projector_type == "domino":
        return {"projector_type": "domino", "emb_dim": emb_dim, "gru_hidden_dim": gru_hidden_dim}
    if projector_type == "dspark":
        return {
            "projector_type": "dspark",
            "markov_rank": markov_rank,
            "use_confidence_head": use_confidence_head,
        }
    return {}


def write_drafter_checkpoint(
    directory: Path,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    intermediate: int = 64,
    n_taps: int = 2,
    vocab: int = 256,
    num_target_layers: int = 8,
    dtype: str = "BF16",
    projector_type: Literal["dflash", "domino", "dspark"] = "dflash",
    emb_dim: int | None = None,
    gru_hidden_dim: int | None = None,
    markov_rank: int | None = None,
    use_confidence_head: bool = False,
    attention_sink: bool = False,
    extra: Mapping[str, Sequence[int]] | None = None,
    drop: Iterable[str] = (),
    config: Mapping[str, object] | None = None,
    write_config: bool = True,
    fill: Fill = "zeros",
    seed: int = 0,
    shards: int | None = None,
) -> Path:
    """Write an exported drafter into `directory`: model.safetensors + config.json.

    Tiny dims by default. `config=None` writes :func:`drafter_config` for the same dims;
    a dict is written exactly as given; `write_config=False` writes none. `shards=n` writes
    an index and n shards instead of one file. Returns `directory`.
    """
    tensors = drafter_tensors(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        n_taps=n_taps,
        vocab=vocab,
        dtype=dtype,
        projector_type=projector_type,
        emb_dim=emb_dim,
        gru_hidden_dim=gru_hidden_dim,
        markov_rank=markov_rank,
        use_confidence_head=use_confidence_head,
        attention_sink=attention_sink,
        extra=extra,
        drop=drop,
    )
    directory.mkdir(parents=True, exist_ok=True)
    if shards is None:
        write_safetensors(directory / WEIGHTS_FILE, tensors, fill=fill, seed=seed)
    else:
        write_sharded_safetensors(directory, tensors, shards=shards, fill=fill)
    if write_config:
        if config is None:
            config = drafter_config(
                hidden=hidden,
                layers=layers,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                intermediate=intermediate,
                vocab=vocab,
                num_target_layers=num_target_layers,
                n_taps=n_taps,
                dtype={"BF16": "bfloat16", "F16": "float16"}.get(dtype, "float32"),
                variant=_variant_fields(
                    projector_type, emb_dim, gru_hidden_dim, markov_rank, use_confidence_head
                ),
            )
        write_json(directory / "config.json", config)
    return directory


def write_base_model(
    directory: Path, *, config: Mapping[str, object] | None = None, **dims: Any
) -> Path:
    """A base-model directory holding only config.json (enough to compile against).

    `config` is written as given; otherwise :func:`base_model_config` with `dims`.
    """
    write_json(directory / "config.json", dict(config) if config else base_model_config(**dims))
    return directory


__all__ = [
    "QWEN3_MASK_TOKEN_ID",
    "base_model_config",
    "default_taps",
    "drafter_config",
    "drafter_tensors",
    "encode_header",
    "write_base_model",
    "write_drafter_checkpoint",
    "write_json",
    "write_raw_safetensors",
    "write_safetensors",
    "write_sharded_safetensors",
]
