"""Write a Qwen3-8B-scale warm-start fixture without real weights, for benchmarks.

    python benchmarks/make_8b_fixture.py OUT_DIR

OUT_DIR/
  base/config.json            Qwen3-8B's config (36 layers, hidden 4096, vocab 151936)
  base/model-0000k-of-00004.safetensors + index
                              with ``target_weights=True`` only: Qwen3-8B's 399 BF16 tensors
                              as SPARSE shards (real headers, 16.4 GB of holes)
  drafter/model.safetensors   the 58-tensor BF16 layout of Qwen3-8B-DFlash-b16 as a SPARSE
                              file: a real header, then a hole of the full 2.1 GB data size
  drafter/config.json         the exported drafter's config (as `export` writes it)
  data/train.jsonl            one conversation, so the recipe has data to point at
  recipe.yaml                 a fine-tuning recipe using all of the above (absolute paths)

The drafter reads as zeros; it exists to measure compile-time checks, not to train.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.plan.run_plan import RunPlan
from testkit.st_fixtures import (
    QWEN3_MASK_TOKEN_ID,
    base_model_config,
    drafter_config,
    drafter_tensors,
    write_json,
    write_safetensors,
    write_sharded_safetensors,
)

# Qwen3-8B (target) and Qwen3-8B-DFlash-b16 (drafter): their published config.json values.
# Any: splatted into keyword arguments of the fixture writers.
DRAFTER: dict[str, Any] = {
    "hidden": 4096,
    "layers": 5,
    "heads": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "intermediate": 12288,
}
TAPS = [1, 9, 17, 25, 33]
BLOCK_SIZE = 16

RECIPE = """\
# Fine-tune Qwen3-8B-DFlash-b16 (an 8B-scale fixture: sparse weights, compile-only).
#   dflash-recipe compile {recipe}
model:
  model_name_or_path: {base}
  dtype: bfloat16
  trust_remote_code: false
data:
  data_path: {data}
  chat_template: null
  answer_only_loss: true
training:
  output_dir: {output}
  learning_rate: 1.0e-4
  num_train_epochs: 1
  max_steps: null
  per_device_train_batch_size: 1
  gradient_accumulation_steps: 1
  training_seq_len: 4096
  warmup_ratio: 0.04
  lr_scheduler_type: cosine
  max_grad_norm: 1.0
  weight_decay: 0.0
  seed: 0
  save_steps: 5000
  save_total_limit: 2
  logging_steps: 100
dflash:
  dflash_init_checkpoint: {drafter}
  dflash_block_size: {block_size}
  dflash_mask_token_id: {mask}
  # must match the checkpoint's draft architecture (dims do NOT inherit from the base model):
  dflash_architecture_config:
    num_hidden_layers: {layers}
    num_attention_heads: {heads}
    num_key_value_heads: {kv_heads}
    head_dim: {head_dim}
    intermediate_size: {intermediate}
"""


def _yaml_path(path: Path) -> str:
    # JSON strings are valid YAML scalars, and quote anything odd in the path.
    return json.dumps(str(path))


def target_tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    """Qwen3-8B's tensors as its checkpoint stores them (BF16, untied lm_head, q/k norms)."""
    hidden, inter, vocab, q_rows, kv_rows, head_dim = 4096, 12288, 151936, 4096, 1024, 128
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {
        "model.embed_tokens.weight": ("BF16", (vocab, hidden))
    }
    for i in range(36):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": ("BF16", (hidden,)),
                p + "self_attn.q_proj.weight": ("BF16", (q_rows, hidden)),
                p + "self_attn.k_proj.weight": ("BF16", (kv_rows, hidden)),
                p + "self_attn.v_proj.weight": ("BF16", (kv_rows, hidden)),
                p + "self_attn.o_proj.weight": ("BF16", (hidden, q_rows)),
                p + "self_attn.q_norm.weight": ("BF16", (head_dim,)),
                p + "self_attn.k_norm.weight": ("BF16", (head_dim,)),
                p + "post_attention_layernorm.weight": ("BF16", (hidden,)),
                p + "mlp.gate_proj.weight": ("BF16", (inter, hidden)),
                p + "mlp.up_proj.weight": ("BF16", (inter, hidden)),
                p + "mlp.down_proj.weight": ("BF16", (hidden, inter)),
            }
        )
    tensors["model.norm.weight"] = ("BF16", (hidden,))
    tensors["lm_head.weight"] = ("BF16", (vocab, hidden))
    return tensors


def make_fixture(out_dir: Path, *, target_weights: bool = False) -> list[str]:
    """Write the fixture into `out_dir`; return one line per file written.

    `target_weights` adds the target's sparse safetensors shards (for the resource plan)."""
    out_dir = out_dir.absolute()
    base = out_dir / "base"
    drafter = out_dir / "drafter"
    data = out_dir / "data" / "train.jsonl"
    recipe = out_dir / "recipe.yaml"

    write_json(
        base / "config.json",
        base_model_config(
            hidden=4096,
            layers=36,
            vocab=151936,
            heads=32,
            kv_heads=8,
            head_dim=128,
            intermediate=12288,
            rope_theta=1_000_000.0,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
        ),
    )
    if target_weights:
        write_sharded_safetensors(base, target_tensors(), shards=4, fill="sparse")
    tensors = drafter_tensors(**DRAFTER, n_taps=len(TAPS), vocab=151936, dtype="BF16")
    write_safetensors(
        drafter / "model.safetensors", tensors, fill="sparse", metadata={"format": "pt"}
    )
    write_json(
        drafter / "config.json",
        drafter_config(
            **DRAFTER,
            vocab=151936,
            num_target_layers=36,
            target_layer_ids=TAPS,
            mask_token_id=QWEN3_MASK_TOKEN_ID,
            block_size=BLOCK_SIZE,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=40960,
            dtype="bfloat16",
        ),
    )
    data.parent.mkdir(parents=True, exist_ok=True)
    conversation = {
        "messages": [
            {"role": "user", "content": "What is speculative decoding?"},
            {"role": "assistant", "content": "A small drafter proposes, the target verifies."},
        ]
    }
    data.write_text(json.dumps(conversation) + "\n", encoding="utf-8")
    recipe.write_text(
        RECIPE.format(
            recipe=recipe,
            base=_yaml_path(base),
            data=_yaml_path(data),
            output=_yaml_path(out_dir / "run"),
            drafter=_yaml_path(drafter),
            block_size=BLOCK_SIZE,
            mask=QWEN3_MASK_TOKEN_ID,
            **DRAFTER,
        ),
        encoding="utf-8",
    )

    weights = read_checkpoint_weights(drafter)
    weights_file = drafter / "model.safetensors"
    size = weights_file.stat().st_size
    on_disk = weights_file.stat().st_blocks * 512
    return [
        f"{base / 'config.json'}: Qwen3-8B target config (36 layers, hidden 4096)",
        f"{weights_file}: {len(weights.tensors)} tensors, {', '.join(weights.dtypes)}, "
        f"{size:,} bytes ({on_disk:,} on disk, sparse)",
        f"{drafter / 'config.json'}: drafter config (taps {TAPS}, mask "
        f"{QWEN3_MASK_TOKEN_ID}, block {BLOCK_SIZE})",
        f"{data}: 1 conversation",
        f"{recipe}: fine-tuning recipe",
    ]


#: The Qwen3-8B seed recipe the resource tests compile against the fixture.
SEED_8B = (
    Path(__file__).resolve().parents[2] / "recipes" / "Qwen" / "Qwen3-8B" / "hf_online_dflash.yaml"
)


def seed_8b_plan(fixture: Path, *extra: str) -> RunPlan:
    """The seed recipe compiled against a :func:`make_fixture` folder, then `extra` overrides."""
    overrides = (
        f"model.model_name_or_path={fixture / 'base'}",
        f"data.data_path={fixture / 'data' / 'train.jsonl'}",
        f"training.output_dir={fixture / 'runs' / 'seed'}",
        *extra,
    )
    result = compile_file(SEED_8B, overrides=overrides)
    assert result.plan is not None, [str(d) for d in result.diagnostics]
    return result.plan
