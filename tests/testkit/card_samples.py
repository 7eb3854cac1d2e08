"""Card facts for tests: a tiny drafter's card without any file behind it."""

from __future__ import annotations

from dflash_recipes.card.facts import (
    CardFacts,
    DataFile,
    DrafterFacts,
    Measurement,
    TrainingFacts,
)


def sample_facts(measurement: Measurement | None = None) -> CardFacts:
    """Card facts of a 2-layer drafter for a Qwen3-8B target (no file behind them)."""
    drafter = DrafterFacts(
        kind="dflash",
        head="dflash (no head)",
        block_size=16,
        drafted_tokens=15,
        num_hidden_layers=2,
        layer_types=("full_attention", "full_attention"),
        sliding_window=None,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        target_layer_ids=(1, 2),
        mask_token_id=120,
        vocab_size=128,
        num_target_layers=4,
        parameters=82_368,
        tensors=25,
        dtype="bfloat16",
        weights_bytes=170_000,
    )
    training = TrainingFacts(
        target="Qwen/Qwen3-8B",
        base_model="Qwen/Qwen3-8B",
        target_dtype="bfloat16",
        warm_start=None,
        resumed_from_step=None,
        data_files=(DataFile("training", "train.jsonl", 50, "c" * 64),),
        capture=None,
        datasets=(),
        steps=60,
        planned="max_steps 60",
        sequences_per_step=8,
        batch="8 per device x 1 accumulated x 1 processes",
        training_seq_len=128,
        dataset_tokens=1000,
        supervised_tokens=600,
        conversations=20,
        answer_only_loss=True,
        objective="cross-entropy",
        optimiser="AdamW",
        seed=0,
        plan_fingerprint="f" * 64,
    )
    return CardFacts(
        drafter=drafter,
        training=training,
        measurement=measurement,
        description=None,
        license="mit",
        serving_notes=(),
        tool_version="0.1.0",
    )
