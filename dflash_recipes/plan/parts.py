"""The parts of a run plan, one frozen record per concern: the base model, the data, the
training, the drafter (its architecture and objective), the warm start, a resume, the
`regenerate` settings and the target served by vLLM.

:class:`~dflash_recipes.plan.run_plan.RunPlan` puts them together; the modules that read one
part of a plan (:mod:`~dflash_recipes.plan.draft_spec`, :mod:`~dflash_recipes.plan.value_checks`)
take the parts from here, so none of them imports the plan that imports them.
"""

from __future__ import annotations

from typing import Literal, cast

import attrs

from dflash_recipes.checkpoint.target_facts import TargetFacts
from dflash_recipes.recipe.choices import (
    SUPERVISED_PARTS,
    Dtype,
    KeepFiles,
    LossObjective,
    MarkovHeadType,
    MasterDtype,
    ProjectorType,
    ReasoningPolicy,
    SchedulerType,
    SelectorMissingGold,
    SupervisedPart,
    ThinkingMode,
    TrackerName,
    UnrenderableRows,
)
from dflash_recipes.records import Record


@attrs.frozen(repr=False, eq=False, slots=False)
class BaseModelPlan(Record):
    """The frozen target: where it is and how to load it."""

    path: str
    dtype: Dtype
    trust_remote_code: bool
    #: None until the compiler has read config.json (schema-level compile leaves it None).
    facts: TargetFacts | None = None


@attrs.frozen(repr=False, eq=False, slots=False)
class DataPlan(Record):
    """Training data locations (absolute) and supervision policy."""

    data_path: str | None
    chat_template: str | None
    answer_only_loss: bool
    eval_data_path: str | None = None
    #: A `dflash-recipe capture` directory to train from offline (None: run the target).
    hidden_states_path: str | None = None
    #: Folder of the tokenized-data cache (absolute; compile writes data.cache_dir or the
    #: per-user default of :func:`~dflash_recipes.files.data_cache.default_data_cache_dir`;
    #: None, in a plan made by hand: that default).
    cache_dir: str | None = None
    #: Processes that tokenize a new cache (None: the cores the run may use).
    num_proc: int | None = None
    #: Whole conversations packed into full rows (see executor/data/packing.py).
    packing: bool = False
    #: Conversations of data_path held out of training for the held-out measurement
    #: (executor/data/holdout.py); 0: none (eval_data_path, if any, is the held-out data).
    eval_holdout: int = 0
    #: With answer_only_loss: the parts of an assistant turn supervised (answer, tool_calls,
    #: reasoning), each as the chat template renders it.
    supervise: tuple[SupervisedPart, ...] = cast("tuple[SupervisedPart, ...]", SUPERVISED_PARTS)
    #: skip: a row the template cannot render (or renders without its tools or tool calls)
    #: is counted and left out | error: the run stops naming the row and the part.
    unrenderable_rows: UnrenderableRows = "skip"

    @property
    def has_eval_data(self) -> bool:
        """Whether there are held-out conversations: a file of them or a held-out slice."""
        return self.eval_data_path is not None or self.eval_holdout > 0


@attrs.frozen(repr=False, eq=False, slots=False)
class TrainingPlan(Record):
    """Optimiser, schedule and bookkeeping, with defaults resolved."""

    output_dir: str
    learning_rate: float
    num_train_epochs: int
    max_steps: int | None
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    training_seq_len: int
    warmup_ratio: float
    lr_scheduler_type: SchedulerType
    max_grad_norm: float
    weight_decay: float
    seed: int
    save_steps: int
    save_total_limit: int | None
    logging_steps: int
    eval_steps: int | None
    device: Literal["auto", "cpu", "cuda"]
    fsdp: bool
    #: Experiment trackers that get the metrics rows besides metrics.jsonl.
    report_to: tuple[TrackerName, ...]
    #: The run's name in the trackers (resolved: the output directory's name by default).
    run_name: str
    #: TensorBoard's event directory, absolute (resolved: <output_dir>/tensorboard by default).
    logging_dir: str
    #: The acceptance gate of `run`: the least held-out tau the run must measure (None: none).
    eval_min_tau: float | None = None
    #: Held-out conversations and new tokens per prompt of each training-time measurement.
    eval_num_prompts: int = 4
    eval_max_new_tokens: int = 32
    #: TF32 for float32 matmuls on CUDA (set by the executor at setup; nothing on CPU).
    tf32: bool = True
    #: The drafter's parameter dtype while it trains (gradients and AdamW moments follow).
    drafter_master_dtype: MasterDtype = "float32"
    #: Skipped (non-finite gradient norm) steps in a row that stop the run.
    max_nonfinite_steps: int = 20
    #: The process group's timeout: seconds a rank waits in a collective for the others.
    distributed_timeout_s: int = 1800
    #: Recompute each draft layer in the backward instead of keeping its activations.
    activation_checkpointing: bool = False


@attrs.frozen(repr=False, eq=False, slots=False)
class ArchitecturePlan(Record):
    """The drafter's dimensions. Recipe fields may be None in a schema-level plan."""

    num_hidden_layers: int | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    intermediate_size: int | None
    rms_norm_eps: float
    projector_type: ProjectorType
    emb_dim: int | None
    gru_hidden_dim: int | None
    markov_rank: int | None
    use_confidence_head: bool
    attention_sink: bool
    #: One of full_attention | sliding_attention per draft layer; None: full attention in all.
    layer_types: tuple[str, ...] | None = None
    #: Keys a sliding_attention query sees (itself included); None without sliding layers.
    sliding_window: int | None = None
    #: Domino/DSpark: block position k predicts anchor + k + 1 (true) or anchor + k (false).
    shift_label: bool = True
    #: Domino: block positions left uncorrected (backbone logits only).
    pure_draft_prefix_len: int = 1
    #: DSpark: vanilla | gated | rnn.
    markov_head_type: MarkovHeadType = "vanilla"
    #: DFlash 2 (the recipe's, else the init checkpoint's; None for other kinds): convolution
    #: taps and channels per coefficient group, selector rank and candidates per position.
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    #: DFlash 2: factor and soft cap on the unary logits, factor on the query embeddings
    #: (None: 1.0, none, 1.0).
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None


@attrs.frozen(repr=False, eq=False, slots=False)
class ObjectivePlan(Record):
    """The training loss, with defaults resolved."""

    num_anchors: int
    loss_objective: LossObjective
    #: gamma of exp(-(k-1)/gamma), resolved from the block size when the recipe left it null.
    loss_decay_factor: float
    dpace_alpha: float
    self_logit_distillation: bool
    domino_backbone_loss_weight: float
    dspark_tv_weight: float
    dspark_confidence_weight: float
    #: DFlash 2: weight of the selector's cross-entropy, and what a position whose gold token
    #: is not among the unary top-K does (skip | inject).
    selector_loss_alpha: float = 1.0
    selector_missing_gold: SelectorMissingGold = "skip"


@attrs.frozen(repr=False, eq=False, slots=False)
class DraftPlan(Record):
    """What to build and how to train it."""

    block_size: int
    #: None until resolved (from the recipe, else from the checkpoint's config.json).
    mask_token_id: int | None
    #: None until resolved (recipe, else the checkpoint's, else the default formula).
    target_layer_ids: tuple[int, ...] | None
    architecture: ArchitecturePlan
    objective: ObjectivePlan


@attrs.frozen(repr=False, eq=False, slots=False)
class InitCheckpointPlan(Record):
    """The warm-start checkpoint and what its header and config.json said."""

    path: str
    #: Weight files relative to `path` (one file, or the shards of an index).
    weight_files: tuple[str, ...] = ()
    tensor_count: int | None = None
    #: Safetensors dtypes present, sorted (e.g. ("BF16",)).
    dtypes: tuple[str, ...] = ()
    config_present: bool = False
    #: The block size the checkpoint was trained with (its config.json), if stated.
    trained_block_size: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    #: Head submodules absent from the checkpoint that train from fresh initialisation.
    heads_from_scratch: tuple[str, ...] = ()
    #: The compiler's warnings about this warm start (a degraded start, heads from scratch),
    #: which `run` logs again when it loads the checkpoint instead of deciding anew.
    warnings: tuple[str, ...] = ()


@attrs.frozen(repr=False, eq=False, slots=False)
class ResumePlan(Record):
    """A complete training checkpoint found in output_dir: the run continues from it."""

    checkpoint_dir: str
    step: int


@attrs.frozen(repr=False, eq=False, slots=False)
class RegeneratePlan(Record):
    """`dflash-recipe regenerate` settings (the recipe's `regenerate:` section, resolved)."""

    #: OpenAI-compatible base URL (server backend), or None: local transformers generation.
    base_url: str | None
    model: str | None
    #: Name of the environment variable holding the API key (the key is never in a plan).
    api_key_env: str | None
    max_concurrency: int
    temperature: float
    top_p: float
    max_new_tokens: int
    request_timeout_s: float
    max_retries: int
    reasoning: ReasoningPolicy
    first_turn_only: bool
    #: Absolute path of the regenerated JSONL, or None (then `--output` is required).
    output_path: str | None
    #: template (no switch sent) | on | off (chat_template_kwargs.enable_thinking) | both
    #: (two rows per conversation, thinking on and off).
    thinking: ThinkingMode = "template"


@attrs.frozen(repr=False, eq=False, slots=False)
class TargetServerPlan(Record):
    """The target served by vLLM (the recipe's `target_server:` section, resolved), and what the
    client and `serve-target` derive from the rest of the plan
    (:mod:`~dflash_recipes.plan.target_server_settings`)."""

    #: Server roots, normalised: scheme://host[:port][/prefix], no trailing slash and no /v1
    #: (the client appends /v1/completions, /v1/models and /health).
    urls: tuple[str, ...]
    #: Absolute folder vLLM's connector writes into, as the trainer sees it.
    storage_dir: str
    #: The name requests send as `model` (the server's --served-model-name).
    served_model_name: str
    #: Requests in flight per training rank.
    max_in_flight: int
    #: Seconds per attempt; retries per URL; the first backoff in seconds (doubling).
    timeout_s: float
    retries: int
    backoff_s: float
    #: Seconds to acquire a file's lock before its attempt fails.
    lock_timeout_s: float
    #: delete | capture (each read file kept as a verified capture shard in capture_dir).
    keep_files: KeepFiles
    #: Absolute folder of the kept shards (keep_files: capture), else None.
    capture_dir: str | None
    #: Name of the environment variable holding the servers' API key (never the key).
    api_key_env: str | None
    #: vLLM's eagle_aux_hidden_state_layer_ids, ascending and unique: each tap t as t + 1, and
    #: num_hidden_layers (the last layer before the final norm) when the objective needs the
    #: target's logits. The file's layer axis holds them in this order. None until resolved.
    vllm_layer_ids: tuple[int, ...] | None
    #: Each DFlash tap, in draft.target_layer_ids' order, as its row on the file's layer axis.
    tap_rows: tuple[int, ...] | None
    #: The row of id num_hidden_layers (normed and projected by the trainer into the target's
    #: logits) when the objective needs them, else None. It may also be a tap's row.
    final_row: int | None
    #: The served dtype: the plan's base_model.dtype (vLLM's `auto` is never used).
    dtype: Dtype
    #: --max-model-len: training.training_seq_len plus the one token the server generates.
    max_model_len: int


@attrs.frozen(repr=False, eq=False, slots=False)
class CardPlan(Record):
    """What the recipe's `card:` section adds to the model card of every export."""

    description: str | None = None
    license: str | None = None
    #: The target's Hub id (OWNER/NAME), or None: inferred from the target's path, if it can be.
    base_model: str | None = None
    datasets: tuple[str, ...] | None = None


__all__ = [
    "ArchitecturePlan",
    "BaseModelPlan",
    "CardPlan",
    "DataPlan",
    "DraftPlan",
    "InitCheckpointPlan",
    "ObjectivePlan",
    "RegeneratePlan",
    "ResumePlan",
    "TargetServerPlan",
    "TrainingPlan",
]
