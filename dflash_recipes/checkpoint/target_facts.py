"""What a plan carries from the base model's config.json: width, depth, vocabulary, positions, RoPE.

The compiler reads these facts (:func:`~dflash_recipes.checkpoint.hfconfig.read_target_config`)
and the plan keeps them (``BaseModelPlan.facts``), so the executor never reads config.json again.
RoPE settings always come from the target, never from a drafter checkpoint or a class default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Union

import attrs

from dflash_recipes.records import Record

#: Scalars allowed inside free-form RoPE scaling mappings (flat, as in HF configs).
RopeValue = Union[float, int, str, bool, None]  # noqa: UP007 (cattrs needs a runtime Union)


@attrs.frozen(repr=False, eq=False, slots=False)
class RopePlan(Record):
    """RoPE settings, always taken from the target model's config.json."""

    rope_theta: float
    #: `default`, `llama3`, `linear`, `yarn`, ... (HF rope_type).
    rope_type: str = "default"
    #: Extra scaling parameters besides rope_type/rope_theta (e.g. llama3 factors), or None.
    rope_scaling: Mapping[str, RopeValue] | None = None


@attrs.frozen(repr=False, eq=False, slots=False)
class TargetFacts(Record):
    """Facts read from the base model's config.json."""

    model_type: str
    architectures: tuple[str, ...]
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int
    rope: RopePlan
    rms_norm_eps: float | None = None


__all__ = ["RopePlan", "RopeValue", "TargetFacts"]
