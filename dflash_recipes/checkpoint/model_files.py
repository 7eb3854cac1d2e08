"""The file names inside a model directory: weights, shard index and config.json (no torch).

One name each for the files a Hugging Face model directory, an exported drafter and a training
checkpoint share, so a reader and a writer can never disagree about a spelling.
"""

from __future__ import annotations

#: The single-file weights of a model, an exported drafter or a training checkpoint.
WEIGHTS_FILE = "model.safetensors"
#: The index of a sharded checkpoint (weight_map: tensor name -> shard file name).
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
#: The configuration file of a model or exported drafter directory.
CONFIG_FILE = "config.json"

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "WEIGHTS_INDEX_FILE"]
