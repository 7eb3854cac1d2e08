"""A tiny DFlash 2 drafter checkpoint (``DFlash2DraftModel``), header and sparse data only.

The tiny drafter of :mod:`testkit.st_fixtures` (hidden 32, 2 layers, 2 taps, vocabulary 256)
with DFlash 2's 23-tensor-per-5-layers additions at tiny sizes: per layer ``attention_conv``
and ``mlp_conv`` (``base_kernel`` ``[2, K, 32]``, ``kernel_projection.weight``
``[2 * K * 32 / group, 32]``) and one ``candidate_selector`` (``hidden_projection.weight``
``[rank, 32]``, codebooks ``[256, rank]`` without ``.weight``), as z-lab stores them. Its
config.json is the DFlash 1 one of the same dims with the DFlash 2 architecture, ``is_causal:
false`` and the four ``dflash_config`` keys of :data:`TINY_DFLASH2`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from dflash_recipes.checkpoint.tensor_layout import LayoutSpec, expected_layout
from testkit.st_fixtures import TensorSpec, drafter_config, write_json, write_safetensors

#: The DFlash 2 keys of the tiny checkpoint's dflash_config (hidden 32: 4 groups of 8).
TINY_DFLASH2: dict[str, int] = {
    "conv_kernel_size": 2,
    "conv_group_size": 8,
    "selector_rank": 4,
    "selector_top_k": 4,
}

#: The same drafter as recipe overrides (``dflash.dflash_architecture_config.*``).
TINY_DFLASH2_OVERRIDES: tuple[str, ...] = (
    "dflash.dflash_architecture_config.projector_type=dflash2",
    *(f"dflash.dflash_architecture_config.{key}={value}" for key, value in TINY_DFLASH2.items()),
)

#: The parameters DFlash 2 adds to the tiny drafter, counted by hand: per convolution a base
#: kernel 2 x 2 x 32 and a projection (2 * 2 * 4) x 32; two per layer, two layers; then the
#: selector's projection 4 x 32 and two codebooks 256 x 4.
TINY_DFLASH2_EXTRA_PARAMETERS = 4 * (2 * 2 * 32 + 16 * 32) + 4 * 32 + 2 * 256 * 4


def dflash2_config(**dflash_config: object) -> dict[str, object]:
    """The tiny DFlash 2 config.json; `dflash_config` keys replace (None: remove) the tiny ones."""
    config = drafter_config()
    config["architectures"] = ["DFlash2DraftModel"]
    config["is_causal"] = False
    nested = config["dflash_config"]
    assert isinstance(nested, dict)
    nested.update(TINY_DFLASH2)
    for key, value in dflash_config.items():
        if value is None:
            nested.pop(key, None)
        else:
            nested[key] = value
    return config


def dflash2_tensors(*, drop: Iterable[str] = ()) -> dict[str, TensorSpec]:
    """The tiny DFlash 2 drafter's tensors (backbone, convolutions, selector), BF16."""
    spec = LayoutSpec(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        n_taps=2,
        vocab_size=256,
        projector_type="dflash2",
        conv_kernel_size=TINY_DFLASH2["conv_kernel_size"],
        conv_group_size=TINY_DFLASH2["conv_group_size"],
        selector_rank=TINY_DFLASH2["selector_rank"],
    )
    dropped = set(drop)
    return {n: ("BF16", s) for n, s in expected_layout(spec).items() if n not in dropped}


def write_tiny_dflash2_checkpoint(
    directory: Path,
    *,
    config: Mapping[str, object] | None = None,
    drop: Iterable[str] = (),
) -> Path:
    """model.safetensors (a real header, then a hole) and config.json (:func:`dflash2_config`
    unless `config` is given) in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / "model.safetensors", dflash2_tensors(drop=drop), fill="sparse")
    write_json(directory / "config.json", dict(config) if config is not None else dflash2_config())
    return directory


__all__ = [
    "TINY_DFLASH2",
    "TINY_DFLASH2_EXTRA_PARAMETERS",
    "dflash2_config",
    "dflash2_tensors",
    "write_tiny_dflash2_checkpoint",
]
