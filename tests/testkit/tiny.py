"""Tiny, resolved run plans and tiny random targets for executor tests (no downloads).

``tiny_plan(tmp_path, **overrides)`` builds a resolved :class:`RunPlan` for a 4-layer,
hidden-64 Qwen3 target (vocab 128) and a 2-layer drafter. An override names a plan field by
its attribute name; the first section that has it wins, in this order:

    RunPlan (init_checkpoint, resume, ...) -> DraftPlan (block_size, mask_token_id,
    target_layer_ids) -> ArchitecturePlan (num_hidden_layers, projector_type, ...) ->
    ObjectivePlan -> TrainingPlan -> DataPlan -> BaseModelPlan (dtype, ...) -> RopePlan
    (rope_theta, rope_type, rope_scaling)

Target facts take a ``target_`` prefix (``target_layer_ids`` stays the draft's taps):
``target_num_hidden_layers=6``, ``target_model_type="llama"``, ``target_hidden_size=32``,
``target_vocab_size=256``.
``tiny_target(plan)`` builds a random model matching the plan's target facts (Qwen3, or
Llama when ``target_model_type="llama"``); ``save=True`` also writes it to the plan's
base-model path so :func:`load_base_model` can read it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflash_recipes.checkpoint.hfconfig import read_checkpoint_config
from dflash_recipes.checkpoint.known_layouts import canonical_weights
from dflash_recipes.checkpoint.tensor_layout import head_presence
from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.executor.model.draft import rope_parameters
from dflash_recipes.executor.model.warmstart import layout_spec
from dflash_recipes.plan.run_plan import (
    ArchitecturePlan,
    BaseModelPlan,
    DataPlan,
    DraftPlan,
    InitCheckpointPlan,
    ObjectivePlan,
    RopePlan,
    RunPlan,
    TargetFacts,
    TrainingPlan,
)

TINY_HIDDEN = 64
TINY_VOCAB = 128
TINY_TARGET_LAYERS = 4
#: The mask id: an embedding row no text produces (like Qwen3's 151669).
TINY_MASK_TOKEN_ID = 120

_SECTION_ORDER = ("run", "draft", "architecture", "objective", "training", "data", "base", "rope")


def _defaults(tmp_path: Path) -> dict[str, dict[str, object]]:
    return {
        "run": {"init_checkpoint": None, "resume": None, "recipe_file": None, "overrides": ()},
        "draft": {
            "block_size": 4,
            "mask_token_id": TINY_MASK_TOKEN_ID,
            "target_layer_ids": (1, 2),
        },
        "architecture": {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 128,
            "rms_norm_eps": 1e-6,
            "projector_type": "dflash",
            "emb_dim": None,
            "gru_hidden_dim": None,
            "markov_rank": None,
            "use_confidence_head": False,
            "attention_sink": False,
            "layer_types": None,
            "sliding_window": None,
            "shift_label": True,
            "pure_draft_prefix_len": 1,
            "markov_head_type": "vanilla",
            "conv_kernel_size": None,
            "conv_group_size": None,
            "selector_rank": None,
            "selector_top_k": None,
            "output_multiplier": None,
            "final_logit_softcapping": None,
            "input_embedding_scale": None,
        },
        "objective": {
            "num_anchors": 4,
            "loss_objective": "decay",
            "loss_decay_factor": 4.0,
            "dpace_alpha": 0.5,
            "self_logit_distillation": False,
            "domino_backbone_loss_weight": 1.0,
            "dspark_tv_weight": 1.0,
            "dspark_confidence_weight": 0.1,
            "selector_loss_alpha": 1.0,
            "selector_missing_gold": "skip",
        },
        "training": {
            "output_dir": str(tmp_path / "out"),
            "learning_rate": 1e-3,
            "num_train_epochs": 1,
            "max_steps": 4,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "training_seq_len": 32,
            "warmup_ratio": 0.0,
            "lr_scheduler_type": "constant",
            "max_grad_norm": 1.0,
            "weight_decay": 0.0,
            "seed": 0,
            "save_steps": 2,
            "save_total_limit": 2,
            "logging_steps": 1,
            "eval_steps": None,
            "device": "cpu",
            "fsdp": False,
            "report_to": (),
            "run_name": "out",
            "logging_dir": str(tmp_path / "out" / "tensorboard"),
        },
        "data": {
            "data_path": str(tmp_path / "data.jsonl"),
            "chat_template": None,
            "answer_only_loss": True,
            "eval_data_path": None,
            "eval_holdout": 0,
            "cache_dir": None,
            "num_proc": 1,
        },
        "base": {
            "path": str(tmp_path / "target"),
            "dtype": "float32",
            "trust_remote_code": False,
        },
        "rope": {"rope_theta": 1_000_000.0, "rope_type": "default", "rope_scaling": None},
        "target": {
            "model_type": "qwen3",
            "architectures": ("Qwen3ForCausalLM",),
            "hidden_size": TINY_HIDDEN,
            "num_hidden_layers": TINY_TARGET_LAYERS,
            "vocab_size": TINY_VOCAB,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
        },
    }


def tiny_plan(tmp_path: Path, **overrides: object) -> RunPlan:
    """A resolved plan for a tiny target and drafter; see the module docstring for overrides."""
    values = _defaults(tmp_path)
    for key, value in overrides.items():
        section = next((s for s in _SECTION_ORDER if key in values[s]), None)
        if section is not None:
            values[section][key] = value
            continue
        fact = key.removeprefix("target_")
        if key.startswith("target_") and fact in values["target"]:
            values["target"][fact] = value
            continue
        msg = f"tiny_plan: no plan field named {key!r}"
        raise TypeError(msg)
    target = values["target"]
    if "target_model_type" in overrides and "target_architectures" not in overrides:
        target["architectures"] = (
            ("LlamaForCausalLM",) if target["model_type"] == "llama" else ("Qwen3ForCausalLM",)
        )
    facts = TargetFacts(rope=RopePlan(**values["rope"]), **target)  # type: ignore[arg-type]
    return RunPlan(
        base_model=BaseModelPlan(facts=facts, **values["base"]),  # type: ignore[arg-type]
        data=DataPlan(**values["data"]),  # type: ignore[arg-type]
        training=TrainingPlan(**values["training"]),  # type: ignore[arg-type]
        draft=DraftPlan(
            architecture=ArchitecturePlan(**values["architecture"]),  # type: ignore[arg-type]
            objective=ObjectivePlan(**values["objective"]),  # type: ignore[arg-type]
            **values["draft"],  # type: ignore[arg-type]
        ),
        resolved=True,
        **values["run"],  # type: ignore[arg-type]
    )


def tiny_target(plan: RunPlan, *, save: bool = False, seed: int = 0) -> PreTrainedModel:
    """A random causal LM matching the plan's target facts (float32, eval mode).

    ``save=True`` also writes it (config.json + model.safetensors) to ``plan.base_model.path``.
    """
    facts = plan.base_model.facts
    assert facts is not None
    config_class = LlamaConfig if facts.model_type == "llama" else Qwen3Config
    config = config_class(
        hidden_size=facts.hidden_size,
        num_hidden_layers=facts.num_hidden_layers,
        vocab_size=facts.vocab_size,
        max_position_embeddings=facts.max_position_embeddings,
        rms_norm_eps=facts.rms_norm_eps or 1e-6,
        intermediate_size=2 * facts.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=facts.hidden_size // 4,
        rope_parameters=dict(rope_parameters(facts.rope)),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model: PreTrainedModel
    if isinstance(config, LlamaConfig):
        model = LlamaForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(config)
    model.train(False)
    if save:
        model.save_pretrained(plan.base_model.path)
    return model


def with_init_checkpoint(plan: RunPlan, directory: Path, **facts: object) -> RunPlan:
    """The plan with ``init_checkpoint`` filled from ``directory`` as the compiler would.

    Reads the weight files and the config.json facts; keyword ``facts`` override fields of the
    :class:`InitCheckpointPlan` (e.g. ``heads_from_scratch=("prefix_gru", "embed_proj")``).
    """
    fields: dict[str, object] = {"path": str(directory)}
    if (directory / "model.safetensors").is_file() or (
        directory / "model.safetensors.index.json"
    ).is_file():
        weights, _ = canonical_weights(read_checkpoint_weights(directory))  # as compile reads
        fields.update(
            weight_files=tuple(weights.weight_files),
            tensor_count=len(weights.tensors),
            dtypes=tuple(weights.dtypes),
            # the compiler's decision: head submodules the checkpoint lacks train from scratch
            heads_from_scratch=head_presence(
                layout_spec(plan.resolved_draft()), weights.shapes
            ).absent,
        )
    config = read_checkpoint_config(directory)
    if config.present:
        fields.update(
            config_present=True,
            trained_block_size=config.block_size,
            target_layer_ids=config.target_layer_ids,
            mask_token_id=config.mask_token_id,
        )
    fields.update(facts)
    init = InitCheckpointPlan(**fields)  # type: ignore[arg-type]
    return attrs.evolve(plan, init_checkpoint=init)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights far from their init (norm weights around 1), so every term matters and greedy
    tokens are decided by clear logit gaps."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]) if p.dim() > 1 else noise)


#: Prompts and a generation length for the greedy / speculative decoding tests.
MAX_NEW = 14
PROMPTS: tuple[tuple[int, ...], ...] = ((5, 17, 3, 99, 42, 7), (64, 2, 2, 81), (11,))


def saved_eval_setup(
    root: Path,
    texts: list[str],
    *,
    drafter_init: Callable[[torch.nn.Module], None] | None = None,
    **overrides: object,
) -> tuple[RunPlan, Path]:
    """What `eval` reads from disk: a tiny target (random, seed 4) saved with a tokenizer
    trained on `texts` (vocabulary 300), and a random drafter (seed 2, then `drafter_init`)
    exported to ``root/export``; `overrides` go to :func:`tiny_plan`. Returns the plan and the
    export directory."""
    from dflash_recipes.executor.demo.tiny_tokenizer import build_tiny_tokenizer, spare_token_ids
    from dflash_recipes.executor.model.draft import DFlashDraftModel
    from dflash_recipes.executor.model.export import export_drafter

    tokenizer = build_tiny_tokenizer(texts, vocab_size=300)
    plan = tiny_plan(
        root,
        target_vocab_size=len(tokenizer),
        mask_token_id=spare_token_ids(tokenizer)[0],
        **overrides,
    )
    model = tiny_target(plan)
    randomize(model, seed=4)
    model.save_pretrained(plan.base_model.path)
    tokenizer.save_pretrained(plan.base_model.path)
    drafter = DFlashDraftModel(plan.resolved_draft())
    randomize(drafter, 2)
    if drafter_init is not None:
        with torch.no_grad():
            drafter_init(drafter)
    export_drafter(drafter.eval(), plan, root / "export")
    return plan, root / "export"
