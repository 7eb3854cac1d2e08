"""Recipe texts shared by the loading, converter and schema tests, and what they need to look
at how the YAML reader read them."""

# ruff: noqa: E501 (the issue's example is kept verbatim, long comments included)

from __future__ import annotations

from typing import Any

import pytest
import yaml

#: The example of issue 2, verbatim (comments included); its `dflash:` block must load as written.
EXAMPLE_YAML = """\
model:
  model_name_or_path: /hf-local/Qwen/Qwen3-8B   # local HF model dir (config.json; weights needed only to run)
  dtype: bfloat16                               # bfloat16 | float16 | float32
  trust_remote_code: false
data:
  data_path: /data/train.jsonl                  # JSONL conversations
  chat_template: null                           # optional .jinja file; default: the tokenizer's
  answer_only_loss: true
training:
  output_dir: /scratch/dflash_bs16_finetune
  learning_rate: 1.0e-4
  num_train_epochs: 1
  max_steps: null
  per_device_train_batch_size: 1
  gradient_accumulation_steps: 1
  training_seq_len: 4096
  warmup_ratio: 0.04
  lr_scheduler_type: cosine                     # cosine | linear | constant
  max_grad_norm: 1.0
  weight_decay: 0.0
  seed: 0
  save_steps: 5000
  save_total_limit: 2
  logging_steps: 100
dflash:
  dflash_init_checkpoint: /hf-local/z-lab/Qwen3-8B-DFlash-b16  # local dir with model.safetensors
  dflash_block_size: 16
  dflash_mask_token_id: 151669
  # must match the checkpoint's draft architecture (dims do NOT inherit from the base model):
  dflash_architecture_config:
    num_hidden_layers: 5
    num_attention_heads: 32
    num_key_value_heads: 8
    head_dim: 128
    intermediate_size: 12288
"""

MINIMAL_YAML = """\
model:
  model_name_or_path: /models/target
"""


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line containing `needle` (so tests do not hard-code numbers)."""
    for number, line in enumerate(text.splitlines(), start=1):
        if needle in line:
            return number
    msg = f"{needle!r} not in text"
    raise AssertionError(msg)


def column_of(text: str, needle: str) -> int:
    """1-based column where `needle` starts on its line."""
    line = text.splitlines()[line_of(text, needle) - 1]
    return line.index(needle) + 1


def count_composed_nodes(monkeypatch: pytest.MonkeyPatch, *, fuse: int) -> list[int]:
    """Count the YAML nodes the reader composes from now on (the one-item list returned holds
    the count). More than `fuse` fails the test on the spot: a reader that goes on past an
    alias would expand an alias bomb, so the test stops it before it takes the machine."""
    composed = [0]
    plain = yaml.composer.Composer.compose_node

    def counting(self: Any, parent: Any, index: Any) -> Any:
        composed[0] += 1
        if composed[0] > fuse:
            pytest.fail(f"the YAML reader composed more than {fuse} nodes: it read past an alias")
        return plain(self, parent, index)

    monkeypatch.setattr(yaml.composer.Composer, "compose_node", counting)
    return composed
