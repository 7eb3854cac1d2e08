"""The recipe: frozen attrs classes a user writes in YAML or constructs in Python.

Only single-field validation applies here (positive sizes, ranges, enumerations: the rules of
:mod:`~dflash_recipes.recipe.validators`). Cross-field checks, file checks and checkpoint checks
belong to the compiler. The `#:` comment above each
field is its documentation; the JSON Schema and the docs are generated from these comments.

Field names follow the layout DFlash users already write (ModelOpt's recipes).

Annotations here are evaluated when the classes are made (no ``from __future__ import
annotations``): the converter then reads type objects instead of compiling a string per field in
every process, part of keeping `dflash-recipe compile` start-up low (issue 15).
"""

from typing import cast

import attrs

from dflash_recipes.recipe.choices import (
    DEVICES,
    DTYPES,
    KEEP_FILES,
    LOSS_OBJECTIVES,
    MARKOV_HEAD_TYPES,
    MASTER_DTYPES,
    PROJECTOR_TYPES,
    REASONING_POLICIES,
    SCHEDULERS,
    SELECTOR_MISSING_GOLD,
    SUPERVISED_PARTS,
    THINKING_MODES,
    UNRENDERABLE_ROWS,
    DeviceChoice,
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
from dflash_recipes.recipe.validators import (
    HUB_LICENSE,
    HUB_REPO_ID,
    INT_FIELD_MAX,
    MAX_LAYER_ID,
    IntRange,
    block_size_range,
    distinct_items,
    env_var_name,
    fraction_half_open,
    fraction_open_closed,
    hub_license,
    hub_repo_id,
    hub_repo_id_list,
    layer_id_list,
    layer_type_list,
    non_empty_distinct_items,
    non_empty_str,
    non_negative_float,
    one_of,
    path_str,
    positive_float,
    positive_int,
    server_url_list,
)
from dflash_recipes.records import Record

#: Optimiser steps, and step intervals (a billion steps is far beyond any run).
_STEPS = IntRange(1, 10**9)
#: Widths of the drafter (hidden widths, heads, ranks).
_WIDTH = IntRange(1, 2**20)
#: Counts of heads and layers.
_COUNT = IntRange(1, 4096)


# ---------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------


@attrs.frozen(repr=False, eq=False, slots=False)
class ModelSection(Record):
    """The frozen target (base) model the drafter is trained against."""

    #: Local Hugging Face model directory (needs config.json; weights are needed only to run).
    model_name_or_path: str = attrs.field(validator=path_str)
    #: Training/compute dtype of the target: bfloat16 | float16 | float32.
    dtype: Dtype = attrs.field(default="bfloat16", validator=one_of(DTYPES))
    #: Allow custom modelling code from the model directory. Never on by default.
    trust_remote_code: bool = False


@attrs.frozen(repr=False, eq=False, slots=False)
class DataSection(Record):
    """Training data: OpenAI `messages` or ShareGPT `conversations`, as JSONL, Parquet, Arrow."""

    #: Conversations: a JSONL (or .jsonl.gz) file, a Parquet or Arrow file, a folder of them, or
    #: a `datasets` save_to_disk folder. Required to run; compile warns when unset.
    data_path: str | None = attrs.field(default=None, validator=path_str)
    #: Optional .jinja chat template file; default: the tokenizer's own template.
    chat_template: str | None = attrs.field(default=None, validator=path_str)
    #: Supervise only assistant tokens (prompt tokens get no loss and open no blocks).
    answer_only_loss: bool = True
    #: With answer_only_loss, the parts of an assistant turn that are supervised, each as the
    #: chat template renders it: answer (its text), tool_calls (the call text), reasoning (the
    #: thinking); the turn's end goes with any of them. Tool results, system and user text
    #: never are.
    supervise: tuple[SupervisedPart, ...] = attrs.field(
        default=cast("tuple[SupervisedPart, ...]", SUPERVISED_PARTS),
        validator=non_empty_distinct_items,
    )
    #: A row the chat template cannot render, or renders without its tools or tool calls:
    #: skip (counted in the data summary) | error (the run stops, naming the row and part).
    unrenderable_rows: UnrenderableRows = attrs.field(
        default="skip", validator=one_of(UNRENDERABLE_ROWS)
    )
    #: Optional held-out conversations (same formats) for `eval` and `training.eval_steps`.
    eval_data_path: str | None = attrs.field(default=None, validator=path_str)
    #: Hold this many conversations of data.data_path out of training (a seeded choice, the
    #: same on every start and world size) and measure held-out acceptance on them, as with
    #: data.eval_data_path (set one of the two); 0: none.
    eval_holdout: int = attrs.field(default=0, validator=IntRange(0, 10**6))
    #: Where the tokenized data is cached (tokenized once, read in place by every run and
    #: rank); null: the per-user cache every run shares, $DFLASH_RECIPES_CACHE/tokenized, else
    #: $XDG_CACHE_HOME/dflash-recipes/tokenized, else ~/.cache/dflash-recipes/tokenized.
    cache_dir: str | None = attrs.field(default=None, validator=path_str)
    #: Processes that tokenize a new cache; null: the cores this process may use. Under
    #: torchrun the node's ranks share them, each tokenizing a slice.
    num_proc: int | None = attrs.field(default=None, validator=IntRange(1, 1024))
    #: Directory written by `dflash-recipe capture`: train offline from its safetensors shards
    #: (the target's decoder is not run); compile checks it against the plan.
    hidden_states_path: str | None = attrs.field(default=None, validator=path_str)
    #: Pack whole conversations into rows of exactly training.training_seq_len tokens (per-document
    #: attention); false: one conversation per row, padded. Online training only.
    packing: bool = False

    @property
    def has_eval_data(self) -> bool:
        """Whether there are held-out conversations: a file of them or a held-out slice."""
        return self.eval_data_path is not None or self.eval_holdout > 0


@attrs.frozen(repr=False, eq=False, slots=False)
class TrainingSection(Record):
    """Optimiser, schedule, checkpointing and logging."""

    #: Where checkpoints, metrics.jsonl and the final export go. A rerun resumes from here.
    output_dir: str = attrs.field(default="outputs/dflash", validator=path_str)
    #: Peak AdamW learning rate (about 6e-4 from scratch, 1e-4 to fine-tune a released drafter).
    learning_rate: float = attrs.field(default=1.0e-4, validator=positive_float)
    #: Passes over the data (ignored when max_steps is set).
    num_train_epochs: int = attrs.field(default=1, validator=IntRange(1, 10**6))
    #: Stop after this many optimiser steps; null: run num_train_epochs.
    max_steps: int | None = attrs.field(default=None, validator=_STEPS)
    #: Sequences per device per micro-batch.
    per_device_train_batch_size: int = attrs.field(default=1, validator=IntRange(1, 2**16))
    #: Micro-batches accumulated into one optimiser step.
    gradient_accumulation_steps: int = attrs.field(default=1, validator=IntRange(1, 2**16))
    #: Tokens per training sequence (longer conversations are truncated).
    training_seq_len: int = attrs.field(default=4096, validator=IntRange(1, 2**24))
    #: Fraction of the steps spent in linear warmup, in [0, 1).
    warmup_ratio: float = attrs.field(default=0.04, validator=fraction_half_open)
    #: Learning-rate schedule after warmup: cosine | linear | constant.
    lr_scheduler_type: SchedulerType = attrs.field(default="cosine", validator=one_of(SCHEDULERS))
    #: Gradient clipping threshold (global L2 norm).
    max_grad_norm: float = attrs.field(default=1.0, validator=positive_float)
    #: A step whose gradient norm is NaN or Inf is skipped (the weights and AdamW's moments
    #: untouched; counted as skipped_steps); this many skipped in a row stop the run, keeping
    #: the last checkpoint written after a finite step. Float16 loss scaling's overflows count.
    max_nonfinite_steps: int = attrs.field(default=20, validator=IntRange(1, 10**6))
    #: AdamW weight decay.
    weight_decay: float = attrs.field(default=0.0, validator=non_negative_float)
    #: Seed for initialisation, anchor sampling and data order.
    seed: int = attrs.field(default=0, validator=IntRange(0, 2**32 - 1))
    #: Save a training checkpoint every this many optimiser steps (and at the end).
    save_steps: int = attrs.field(default=500, validator=_STEPS)
    #: Keep at most this many training checkpoints (oldest deleted first); null: keep all.
    save_total_limit: int | None = attrs.field(default=2, validator=IntRange(1, 10**6))
    #: Log metrics every this many optimiser steps.
    logging_steps: int = attrs.field(default=10, validator=_STEPS)
    #: Measure real acceptance on held-out conversations (data.eval_data_path or
    #: data.eval_holdout). Three modes: N, every N optimiser steps; null (the default), every
    #: save_steps when there is eval data; 0, never (null does not turn it off).
    eval_steps: int | None = attrs.field(default=None, validator=IntRange(0, 10**9))
    #: Acceptance gate: when the last held-out tau the run measured (training.eval_steps) is
    #: below this, `run` says so and exits 1 after saving and exporting; null: no gate. Set,
    #: the run also measures at its final step.
    eval_min_tau: float | None = attrs.field(default=None, validator=positive_float)
    #: How many held-out conversations each training-time measurement drafts on (the first
    #: ones of data.eval_data_path or of the data.eval_holdout slice).
    eval_num_prompts: int = attrs.field(default=4, validator=IntRange(1, 10**5))
    #: How many new tokens each training-time measurement generates per prompt.
    eval_max_new_tokens: int = attrs.field(default=32, validator=IntRange(1, 2**16))
    #: Compute device: auto (CUDA when available) | cpu | cuda.
    device: DeviceChoice = attrs.field(default="auto", validator=one_of(DEVICES))
    #: Shard the frozen target and the trained drafter (its gradients and AdamW states) with
    #: FSDP2 under torchrun; checkpoints are then sharded (torch.distributed.checkpoint).
    fsdp: bool = False
    #: Seconds a rank waits in a collective (barrier, all-reduce, broadcast) for the other
    #: ranks before the job fails with a timeout, e.g. while rank 0 alone saves, exports or
    #: evaluates: the process group's timeout (torchrun). Raise it for very slow saves.
    distributed_timeout_s: int = attrs.field(default=1800, validator=IntRange(1, 7 * 24 * 3600))
    #: Recompute each draft decoder layer's activations in the backward instead of keeping
    #: them (torch.utils.checkpoint, non-reentrant): only each layer's input stays, for about
    #: one more forward of the layers; the losses and gradients are the same. For long
    #: training_seq_len or many anchors; compile's memory advice says when it would fit.
    activation_checkpointing: bool = False
    #: TF32 tensor cores for float32 matmuls and convolutions on CUDA (no effect on CPU).
    tf32: bool = True
    #: The drafter's parameter dtype while it trains: float32 | bfloat16. Its gradients and
    #: AdamW's moments take the same dtype, so bfloat16 halves their memory (ModelOpt's
    #: choice) at the cost of coarser updates. The export is written in model.dtype either way.
    drafter_master_dtype: MasterDtype = attrs.field(
        default="float32", validator=one_of(MASTER_DTYPES)
    )
    #: Experiment trackers that also get every metrics row: tensorboard | mlflow | wandb
    #: (metrics.jsonl is always written). Each needs its library: pip install
    #: 'dflash-recipes[NAME]'.
    report_to: tuple[TrackerName, ...] = attrs.field(default=(), validator=distinct_items)
    #: The run's name in the trackers; null: the output directory's name.
    run_name: str | None = attrs.field(default=None, validator=non_empty_str)
    #: Where TensorBoard event files go; null: <output_dir>/tensorboard.
    logging_dir: str | None = attrs.field(default=None, validator=path_str)


@attrs.frozen(repr=False, eq=False, slots=False)
class DFlashArchitectureConfig(Record):
    """The drafter's own dimensions. They never inherit from the base model."""

    #: Draft decoder layers (must match the init checkpoint).
    num_hidden_layers: int | None = attrs.field(default=None, validator=_COUNT)
    #: Query heads per draft layer.
    num_attention_heads: int | None = attrs.field(default=None, validator=_COUNT)
    #: Key/value heads per draft layer (GQA); must divide num_attention_heads.
    num_key_value_heads: int | None = attrs.field(default=None, validator=_COUNT)
    #: Width of one attention head (even).
    head_dim: int | None = attrs.field(default=None, validator=IntRange(1, 4096, even=True))
    #: SwiGLU MLP width.
    intermediate_size: int | None = attrs.field(default=None, validator=_WIDTH)
    #: RMSNorm epsilon. null: the init checkpoint's (or the resumed run's), else 1e-6.
    rms_norm_eps: float | None = attrs.field(default=None, validator=positive_float)
    #: 0-based target decoder layers whose outputs are tapped (hidden_states[k + 1]; for the
    #: last layer its output before the final norm). null: the checkpoint's taps, else the
    #: default formula.
    target_layer_ids: tuple[int, ...] | None = attrs.field(default=None, validator=layer_id_list)
    #: Head variant: dflash (plain) | domino (GRU correction head) | dspark (Markov bias head)
    #: | dflash2 (DFlash 2: grouped dynamic causal convolutions and a candidate selector).
    projector_type: ProjectorType = attrs.field(default="dflash", validator=one_of(PROJECTOR_TYPES))
    #: Domino: width of the correction embedding.
    emb_dim: int | None = attrs.field(default=None, validator=_WIDTH)
    #: Domino: hidden width of the prefix GRU.
    gru_hidden_dim: int | None = attrs.field(default=None, validator=_WIDTH)
    #: DSpark: rank of the low-rank Markov transition bias.
    markov_rank: int | None = attrs.field(default=None, validator=_WIDTH)
    #: DSpark: add the confidence head (confidence_proj).
    use_confidence_head: bool = False
    #: DSpark: Markov head kind: vanilla (markov_w1/w2) | gated (+ gate_proj) | rnn
    #: (+ joint_proj), as ModelOpt computes them.
    markov_head_type: MarkovHeadType = attrs.field(
        default="vanilla", validator=one_of(MARKOV_HEAD_TYPES)
    )
    #: Domino/DSpark label alignment: true, block position k predicts the token at
    #: anchor + k + 1 (ModelOpt, SGLang); false, anchor + k (earlier dflash-recipes exports).
    shift_label: bool = True
    #: Domino: block positions left uncorrected (backbone logits only), in [0, block_size - 1].
    pure_draft_prefix_len: int = attrs.field(default=1, validator=IntRange(0, 2**10))
    #: Add a learnable attention sink per head (layers.{i}.self_attn.attention_sink_bias).
    attention_sink: bool = False
    #: Attention kind per draft layer: full_attention | sliding_attention (causal, windowed).
    #: null: the init checkpoint's layer_types, else full attention in every layer.
    layer_types: tuple[str, ...] | None = attrs.field(default=None, validator=layer_type_list)
    #: Keys a sliding_attention query sees, itself included (Hugging Face's sliding_window).
    #: null: the init checkpoint's.
    sliding_window: int | None = attrs.field(default=None, validator=positive_int)
    #: DFlash 2: taps K of the grouped dynamic causal convolution around attention and MLP
    #: (1..dflash_block_size; it never reaches across a block). null: the init checkpoint's.
    conv_kernel_size: int | None = attrs.field(default=None, validator=IntRange(1, 128))
    #: DFlash 2: channels that share one dynamic convolution coefficient; must divide the
    #: hidden size. null: the init checkpoint's.
    conv_group_size: int | None = attrs.field(default=None, validator=_WIDTH)
    #: DFlash 2: rank r of the candidate selector's codebooks (2 x vocab x r parameters).
    #: null: the init checkpoint's.
    selector_rank: int | None = attrs.field(default=None, validator=_WIDTH)
    #: DFlash 2: candidates per block position the selector scores (the unary top-K), in
    #: 1..vocab_size. null: the init checkpoint's.
    selector_top_k: int | None = attrs.field(default=None, validator=_WIDTH)
    #: DFlash 2: factor on the unary (target-head) logits. null: the init checkpoint's, else 1.0.
    output_multiplier: float | None = attrs.field(default=None, validator=positive_float)
    #: DFlash 2: tanh soft cap on the unary logits. null: the init checkpoint's, else none.
    final_logit_softcapping: float | None = attrs.field(default=None, validator=positive_float)
    #: DFlash 2: factor on the embeddings of the block's query tokens. null: the init
    #: checkpoint's, else 1.0.
    input_embedding_scale: float | None = attrs.field(default=None, validator=positive_float)


# Paper guidance for the decay gamma, block size -> gamma (docs/dflash.md, "Block size and the
# decay gamma").
_DECAY_POINTS: tuple[tuple[int, float], ...] = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_loss_decay_factor(block_size: int) -> float:
    """gamma for `exp(-(k-1)/gamma)` when `dflash_loss_decay_factor` is null: 4 for B=8, 5 for
    B=10, 7 for B=16.

    Other block sizes interpolate linearly through those points, extrapolating from the
    nearest pair outside them, and never go below 1.0. The compiler writes the value into the
    plan; `init` writes it into a starter recipe.
    """
    (b0, g0), (b1, g1) = _DECAY_POINTS[:2] if block_size <= 10 else _DECAY_POINTS[1:]
    return max(1.0, g0 + (block_size - b0) * (g1 - g0) / (b1 - b0))


@attrs.frozen(repr=False, eq=False, slots=False)
class DFlashSection(Record):
    """DFlash training: block drafting, the warm start and the loss."""

    #: Local directory of an exported drafter (model.safetensors + config.json) to fine-tune.
    #: Hub ids are not fetched: stage it with `hf download <repo> --local-dir <dir>` first.
    dflash_init_checkpoint: str | None = attrs.field(default=None, validator=non_empty_str)
    #: Tokens drafted per block (the anchor plus block_size - 1 masked positions).
    dflash_block_size: int = attrs.field(default=16, validator=block_size_range)
    #: Token id used for masked block positions (Qwen3: 151669). null: the checkpoint's.
    dflash_mask_token_id: int | None = attrs.field(default=None, validator=IntRange(0, 2**31 - 1))
    #: Blocks (anchors) sampled per training sequence each step.
    dflash_num_anchors: int = attrs.field(default=512, validator=IntRange(1, 2**20))
    #: Position weighting of the loss: decay (exp(-(k-1)/gamma)) | dpace (confidence-based).
    dflash_loss_objective: LossObjective = attrs.field(
        default="decay", validator=one_of(LOSS_OBJECTIVES)
    )
    #: gamma of the decay weights; null: 7 for B=16, 5 for B=10, 4 for B=8, otherwise
    #: interpolated linearly through those points (extrapolated from the nearest pair, >= 1).
    dflash_loss_decay_factor: float | None = attrs.field(default=None, validator=positive_float)
    #: D-PACE smoothing alpha, in (0, 1].
    dflash_dpace_alpha: float = attrs.field(default=0.5, validator=fraction_open_closed)
    #: Add soft cross-entropy against the target's own next-token distribution.
    dflash_self_logit_distillation: bool = False
    #: Domino: initial weight of the backbone-logit CE; decays linearly to 0 over training.
    dflash_domino_backbone_loss_weight: float = attrs.field(
        default=1.0, validator=non_negative_float
    )
    #: DSpark: weight of the total-variation distance to the target distribution.
    dflash_dspark_tv_weight: float = attrs.field(default=1.0, validator=non_negative_float)
    #: DSpark: weight of the confidence-head BCE (needs use_confidence_head).
    dflash_dspark_confidence_weight: float = attrs.field(default=0.1, validator=non_negative_float)
    #: DFlash 2: weight alpha of the candidate selector's cross-entropy (over the unary top-K,
    #: with the true previous token) added to the unary loss. speculators found 0.1 better than
    #: 0.25 or 1.0 for a Qwen3-4B target; SpecForge's recipes use 1.0.
    dflash_selector_loss_alpha: float = attrs.field(default=1.0, validator=non_negative_float)
    #: DFlash 2: a position whose gold token is not among the unary top-K: skip (no selector
    #: loss there, as serving never picks it: SpecForge) | inject (it replaces the last
    #: candidate: speculators).
    dflash_selector_missing_gold: SelectorMissingGold = attrs.field(
        default="skip", validator=one_of(SELECTOR_MISSING_GOLD)
    )
    #: The drafter's architecture; must match dflash_init_checkpoint when one is given.
    dflash_architecture_config: DFlashArchitectureConfig = attrs.field(
        factory=DFlashArchitectureConfig
    )


@attrs.frozen(repr=False, eq=False, slots=False)
class RegenerateSection(Record):
    """`dflash-recipe regenerate`: answer the training prompts with the target itself."""

    #: OpenAI-compatible server (vLLM, SGLang), e.g. http://localhost:8000/v1. null: generate
    #: locally with transformers and model.model_name_or_path (small targets only).
    base_url: str | None = attrs.field(default=None, validator=non_empty_str)
    #: Model name sent to the server; null: the first model the server lists (GET /v1/models).
    model: str | None = attrs.field(default=None, validator=non_empty_str)
    #: NAME of the environment variable holding the server's API key (never the key itself).
    api_key_env: str | None = attrs.field(default=None, validator=env_var_name)
    #: Requests in flight at once (server), or conversations per generate batch (local).
    max_concurrency: int = attrs.field(default=32, validator=IntRange(1, 4096))
    #: Sampling temperature; 0: greedy (the answers the target gives most often).
    temperature: float = attrs.field(default=0.0, validator=non_negative_float)
    #: Nucleus sampling threshold, in (0, 1].
    top_p: float = attrs.field(default=1.0, validator=fraction_open_closed)
    #: Most tokens generated per answer (at most training.training_seq_len); null: that length.
    max_new_tokens: int | None = attrs.field(default=None, validator=IntRange(1, 2**24))
    #: Seconds one request may take before it is retried.
    request_timeout_s: float = attrs.field(default=600.0, validator=positive_float)
    #: Retries of a request after 429/5xx/connection errors, with exponential backoff.
    max_retries: int = attrs.field(default=5, validator=IntRange(0, 1000))
    #: keep: the thinking stays in the answer as a <think>...</think> block (how Qwen3 chat
    #: templates read it) | separate: the server's reasoning_content is kept as the turn's
    #: reasoning_content (the chat template renders it; data.supervise can leave it out) |
    #: drop: reasoning_content and <think> blocks are removed.
    reasoning: ReasoningPolicy = attrs.field(default="keep", validator=one_of(REASONING_POLICIES))
    #: template: no thinking switch is sent (the chat template's default) | on | off: the
    #: request sets chat_template_kwargs.enable_thinking | both: two rows per conversation.
    thinking: ThinkingMode = attrs.field(default="template", validator=one_of(THINKING_MODES))
    #: Regenerate only up to the first assistant turn (later turns are dropped).
    first_turn_only: bool = False
    #: Where the regenerated JSONL goes (shards in OUTPUT.parts/); `--output` overrides it.
    output_path: str | None = attrs.field(default=None, validator=path_str)


@attrs.frozen(repr=False, eq=False, slots=False)
class TargetServerSection(Record):
    """The frozen target served by vLLM: the trainer reads its tap states from the server."""

    #: vLLM OpenAI-compatible servers of the same target (replicas), each as http(s)://host:port
    #: (a trailing /v1 is accepted); requests are spread over all of them. Start each with the
    #: command `dflash-recipe serve-target` prints.
    urls: tuple[str, ...] = attrs.field(validator=server_url_list)
    #: The folder vLLM's ExampleHiddenStatesConnector writes the states into
    #: (shared_storage_path), as the trainer sees it: /dev/shm/... when server and trainer share
    #: a node, a shared file system across nodes. It must exist.
    storage_dir: str = attrs.field(validator=path_str)
    #: The model name the servers answer to (--served-model-name); null: the base model
    #: folder's name (OWNER/NAME for a Hugging Face cache folder).
    served_model_name: str | None = attrs.field(default=None, validator=non_empty_str)
    #: Requests in flight at once per training rank (vLLM batches them); each may hold one file
    #: in storage_dir until it is read.
    max_in_flight: int = attrs.field(default=8, validator=IntRange(1, 4096))
    #: Seconds one request may take (each attempt) before it is retried.
    timeout_s: float = attrs.field(default=120.0, validator=positive_float)
    #: Retries of a request on each URL after an error, a timeout or a refused connection, before
    #: its work goes to the other URLs; a token-id mismatch is never retried.
    retries: int = attrs.field(default=3, validator=IntRange(0, 100))
    #: Seconds before the first retry; each further retry waits twice as long.
    backoff_s: float = attrs.field(default=2.0, validator=non_negative_float)
    #: Seconds to wait for the lock vLLM holds on a file until it has written it; a file whose
    #: lock is not acquired by then fails its attempt.
    lock_timeout_s: float = attrs.field(default=30.0, validator=positive_float)
    #: What happens to a file once read and checked: delete | capture (kept in capture_dir,
    #: named by its token ids: later epochs, a resume and a rerun read it there instead of
    #: asking the servers again; a capture for data.hidden_states_path is `dflash-recipe
    #: capture`'s).
    keep_files: KeepFiles = attrs.field(default="delete", validator=one_of(KEEP_FILES))
    #: Where keep_files: capture keeps the files; null: <training.output_dir>/target-states.
    capture_dir: str | None = attrs.field(default=None, validator=path_str)
    #: NAME of the environment variable holding the servers' API key (vLLM's --api-key or
    #: VLLM_API_KEY), never the key itself; null: the servers take no key.
    api_key_env: str | None = attrs.field(default=None, validator=env_var_name)


@attrs.frozen(repr=False, eq=False, slots=False)
class CardSection(Record):
    """The model card (README.md) every export carries: what the recipe adds to it."""

    #: Free text that opens the card (Markdown), e.g. what the drafter is for.
    description: str | None = attrs.field(default=None, validator=non_empty_str)
    #: The license the card states (the Hub's id, e.g. apache-2.0, mit); null: none stated.
    license: str | None = attrs.field(default=None, validator=hub_license)
    #: The target's Hub id for the card's base_model (e.g. Qwen/Qwen3-8B); null: read from a
    #: Hugging Face cache path of the target (models--OWNER--NAME), else left out.
    base_model: str | None = attrs.field(default=None, validator=hub_repo_id)
    #: Hub ids of the training datasets for the card's datasets; null: read from a Hugging
    #: Face cache path of data.data_path (datasets--OWNER--NAME), else left out.
    datasets: tuple[str, ...] | None = attrs.field(default=None, validator=hub_repo_id_list)


@attrs.frozen(repr=False, eq=False, slots=False)
class Recipe(Record):
    """A whole recipe: target model, data, training and DFlash settings."""

    #: The frozen target model.
    model: ModelSection
    #: The DFlash drafter and its warm start.
    dflash: DFlashSection = attrs.field(factory=DFlashSection)
    #: Training data.
    data: DataSection = attrs.field(factory=DataSection)
    #: Optimiser, schedule, checkpoints.
    training: TrainingSection = attrs.field(factory=TrainingSection)
    #: `dflash-recipe regenerate`: the target answers the training prompts itself.
    regenerate: RegenerateSection = attrs.field(factory=RegenerateSection)
    #: The model card each export carries (README.md beside the weights).
    card: CardSection = attrs.field(factory=CardSection)
    #: The target served by vLLM (`dflash-recipe serve-target` prints the command); `run` and
    #: `capture` read its tap states from the server. null: the target runs in the trainer.
    target_server: TargetServerSection | None = None


__all__ = [
    "HUB_LICENSE",
    "HUB_REPO_ID",
    "INT_FIELD_MAX",
    "MAX_LAYER_ID",
    "CardSection",
    "DFlashArchitectureConfig",
    "DFlashSection",
    "DataSection",
    "IntRange",
    "ModelSection",
    "Recipe",
    "RegenerateSection",
    "TargetServerSection",
    "TrainingSection",
    "default_loss_decay_factor",
]
