"""How large a size in a config.json may plausibly be (pure data).

A config.json is a file: corrupt, edited or hostile. The resource estimate, the default taps and
the tensor layout are sized by its integer fields (one tensor-table entry per decoder layer, bytes
per layer and token), so a value of 10**19 would take minutes and all memory before anything
failed. Every reader of config.json sizes (:mod:`~dflash_recipes.checkpoint.hfconfig`, the
resource estimate) and the plan's value checks refuse a value above its bound here first.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The largest plausible value of each integer field of a config.json. Far above any released
#: model, far below what would exhaust memory or time: the resource estimate, the default taps
#: and the tensor layout are sized by these fields, so a larger value (a corrupt or hostile
#: file) is refused before anything is sized by it. Fields not named here: :data:`INT_MAXIMUM`.
PLAUSIBLE_MAXIMA: Mapping[str, int] = {
    "hidden_size": 2**20,
    "num_hidden_layers": 4096,
    "num_target_layers": 4096,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 2**16,
    "intermediate_size": 2**20,
    "vocab_size": 2**24,
    "max_position_embeddings": 2**30,
    "sliding_window": 2**30,
    "block_size": 1024,
    "mask_token_id": 2**24 - 1,
    "emb_dim": 2**20,
    "gru_hidden_dim": 2**20,
    "markov_rank": 2**20,
}
#: The bound of an integer field without its own entry in :data:`PLAUSIBLE_MAXIMA` (int32).
INT_MAXIMUM = 2**31 - 1
#: Most entries of a per-layer list (`target_layer_ids`, `layer_types`).
MAX_LIST_ENTRIES = 4096
#: The largest layer index a `target_layer_ids` entry may name.
MAX_LAYER_INDEX = PLAUSIBLE_MAXIMA["num_hidden_layers"] - 1


def plausible_maximum(key: str) -> int:
    """The largest value integer config field `key` may state (see :data:`PLAUSIBLE_MAXIMA`)."""
    return PLAUSIBLE_MAXIMA.get(key.rpartition(".")[2], INT_MAXIMUM)


__all__ = [
    "INT_MAXIMUM",
    "MAX_LAYER_INDEX",
    "MAX_LIST_ENTRIES",
    "PLAUSIBLE_MAXIMA",
    "plausible_maximum",
]
