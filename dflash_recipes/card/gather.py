"""Gather a card's facts at export time: the plan, the exported files and the run directory.

:func:`export_card_facts` reads the export being written (config.json, the safetensors header),
the plan, and what the run directory holds (the checkpoint behind the weights, the tokenized
data cache's stats, the last held-out measurement in ``metrics.jsonl``), and hashes the data
files. Every path becomes a name: the result holds no path of this machine.

What the weights are is decided by what the export reads (``sources``): a training checkpoint
``checkpoint-N`` of the plan's run directory (`dflash-recipe export`), or nothing, which is the
export at the end of `run` (the run's newest checkpoint holds the same weights). Any other
source (another export, a foreign directory) records no step and no measurement: nothing ties
those weights to the run's metrics. Torch-free.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

from dflash_recipes import __version__
from dflash_recipes.card.acceptance import file_name, last_training_measurement
from dflash_recipes.card.facts import (
    CARD_DATA_FILE,
    CardDataError,
    CardFacts,
    DataFile,
    DrafterFacts,
    Measurement,
    TrainingFacts,
    parse_card_data,
)
from dflash_recipes.checkpoint.kinds.registry import kind_facts
from dflash_recipes.checkpoint.model_files import CONFIG_FILE, WEIGHTS_FILE
from dflash_recipes.checkpoint.model_paths import hub_id_from_cache_path
from dflash_recipes.checkpoint.safetensors_header import read_safetensors_header
from dflash_recipes.data.sources import content_sha256, resolve_source
from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.files.jsonio import FileReadProblem, JsonProblem, parse_json, read_regular_file
from dflash_recipes.files.run_dir import TRAINER_STATE, checkpoint_step, latest_complete_checkpoint
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.recipe.choices import SUPERVISED_PARTS

#: Data files are hashed up to this many bytes in all (an export waits for the hashing; past
#: the limit a file is listed with its size and a note instead of its sha256).
HASH_LIMIT_BYTES = 16 * 2**30
#: The stats file of a tokenized-data cache entry (executor.data.token_cache.META_FILE; that
#: module imports numpy and transformers, which the card does not).
CACHE_META_FILE = "meta.json"
#: Small JSON files read here (trainer_state.json, config.json, cache meta) stay under this.
_JSON_LIMIT = 4 * 2**20


def _read_json_dict(path: Path) -> dict[str, object] | None:
    try:
        data = parse_json(read_regular_file(path, max_bytes=_JSON_LIMIT))
    except (FileReadProblem, JsonProblem):
        return None
    return data if isinstance(data, dict) else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# the drafter
# ---------------------------------------------------------------------------------------------


def drafter_facts(plan: RunPlan, export_dir: Path) -> DrafterFacts:
    """What the export in `export_dir` is (its header and config.json, the plan's drafter)."""
    spec = plan.resolved_draft()
    header = read_safetensors_header(export_dir / WEIGHTS_FILE)
    config = _read_json_dict(export_dir / CONFIG_FILE) or {}
    dtype = config.get("torch_dtype")
    return DrafterFacts(
        kind=spec.projector_type,
        head=spec.head_description,
        block_size=spec.block_size,
        drafted_tokens=spec.drafted_tokens,
        num_hidden_layers=spec.num_hidden_layers,
        layer_types=tuple(spec.layer_type(i) for i in range(spec.num_hidden_layers)),
        sliding_window=spec.sliding_window,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        target_layer_ids=spec.target_layer_ids,
        mask_token_id=spec.mask_token_id,
        vocab_size=spec.vocab_size,
        num_target_layers=spec.num_target_layers,
        parameters=sum(math.prod(info.shape) for info in header.tensors.values()),
        tensors=len(header.tensors),
        dtype=dtype if isinstance(dtype, str) else plan.base_model.dtype,
        weights_bytes=header.file_size,
    )


# ---------------------------------------------------------------------------------------------
# the training
# ---------------------------------------------------------------------------------------------


def data_files(path: str | None, role: str, setting: str, budget: list[int]) -> list[DataFile]:
    """The files of a data input with their sizes and sha256 (`budget`: bytes left to hash)."""
    if path is None:
        return []
    try:
        source = resolve_source(Path(path), setting=setting)
    except DFlashRecipeError:
        return [DataFile(role=role, name=file_name(path) or path, note="not readable at export")]
    found: list[DataFile] = []
    for file, _ in source.files:
        name = file.name if source.kind == "file" else f"{source.path.name}/{file.name}"
        try:
            size = file.stat().st_size
            if size > budget[0]:
                found.append(DataFile(role, name, size, note="too large to hash at export"))
                continue
            budget[0] -= size
            found.append(DataFile(role, name, size, _sha256(file)))
        except OSError:
            found.append(DataFile(role, name, note="not readable at export"))
    return found


def _cache_stats(plan: RunPlan) -> tuple[int | None, int | None, int | None]:
    """(tokens, supervised tokens, conversations) of the plan's tokenized-data cache entry."""
    data, cache = plan.data, plan.data.cache_dir
    if cache is None or data.data_path is None:
        return None, None, None
    wanted: dict[str, object] = {
        "answer_only_loss": data.answer_only_loss,
        "training_seq_len": plan.training.training_seq_len,
        "block_size": plan.draft.block_size,
    }
    if tuple(data.supervise) != SUPERVISED_PARTS:  # an entry without the key has the default
        wanted["supervise"] = list(data.supervise)
    best: tuple[float, dict[str, object]] | None = None
    try:
        entries = [p for p in Path(cache).iterdir() if p.is_dir()]
    except OSError:
        return None, None, None
    # The cache is shared by every run and keyed by content: an entry another run built from
    # another path to the same data is this run's too. The data is hashed only when no entry
    # names this path, and only within the export's hashing limit.
    by_path: list[tuple[Path, dict[str, object]]] = []
    by_content: list[tuple[Path, dict[str, object], object]] = []
    for entry in entries:
        meta = _read_json_dict(entry / CACHE_META_FILE)
        key = meta.get("key") if meta is not None else None
        stats = meta.get("stats") if meta is not None else None
        if (
            meta is None
            or not isinstance(key, dict)
            or not isinstance(stats, dict)
            or any(key.get(k) != v for k, v in wanted.items())
        ):
            continue
        if meta.get("source") == data.data_path:
            by_path.append((entry, stats))
        else:
            by_content.append((entry, stats, key.get("data_sha256")))
    matches = by_path
    if not matches and by_content:
        data_sha256 = _bounded_content_sha256(data.data_path)
        if data_sha256 is not None:
            matches = [(e, stats) for e, stats, sha in by_content if sha == data_sha256]
    for entry, stats in matches:
        mtime = (entry / CACHE_META_FILE).stat().st_mtime
        if best is None or mtime > best[0]:
            best = (mtime, stats)
    if best is None:
        return None, None, None

    def count(name: str) -> int | None:
        value = best[1].get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return count("num_tokens"), count("num_supervised_tokens"), count("conversations_used")


def _bounded_content_sha256(data_path: str) -> str | None:
    """The data's content hash as the token cache keys it, or None when it cannot be read or is
    larger than the export hashes (:data:`HASH_LIMIT_BYTES`)."""
    try:
        source = resolve_source(Path(data_path), setting="data.data_path")
        if sum(path.stat().st_size for path, _ in source.files) > HASH_LIMIT_BYTES:
            return None
        return content_sha256(source)
    except (DFlashRecipeError, OSError):
        return None


def _warm_start(plan: RunPlan) -> str | None:
    init = plan.init_checkpoint
    if init is None:
        return None
    name = hub_id_from_cache_path(init.path, "models") or file_name(init.path)
    said = [f"{init.tensor_count} tensors"] if init.tensor_count is not None else []
    if init.trained_block_size is not None:
        said.append(f"trained at block size {init.trained_block_size}")
    try:
        earlier = parse_card_data(
            read_regular_file(Path(init.path) / CARD_DATA_FILE, max_bytes=_JSON_LIMIT)
        )
    except (FileReadProblem, CardDataError):
        earlier = None
    if earlier is not None:
        said.append(
            f"exported by dflash-recipes from plan {earlier.training.plan_fingerprint[:12]}"
        )
    if init.heads_from_scratch:
        said.append("heads trained from scratch: " + ", ".join(init.heads_from_scratch))
    return f"`{name}`" + (f" ({'; '.join(said)})" if said else "")


def _objective(plan: RunPlan) -> str:
    objective, kind = plan.draft.objective, plan.draft.architecture.projector_type
    if objective.loss_objective == "dpace":
        weights = f"D-PACE position weights (alpha {objective.dpace_alpha:g})"
    else:
        weights = f"decay position weights exp(-(k-1)/{objective.loss_decay_factor:g})"
    parts = [f"cross-entropy with {weights}", f"{objective.num_anchors} blocks per sequence"]
    if objective.self_logit_distillation:
        parts.append("plus soft cross-entropy against the target's distribution")
    # The kind's own loss terms (Domino's and DSpark's weights, DFlash 2's selector settings).
    for name in kind_facts(kind).objective_fields:
        value = getattr(objective, name)
        parts.append(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}")
    return "; ".join(parts)


def _steps(plan: RunPlan, sources: Sequence[Path]) -> tuple[int | None, int | None, bool]:
    """(step of the exported weights, processes, whether the run's metrics describe them)."""
    run_dir = Path(plan.training.output_dir)
    checkpoint: Path | None = None
    if not sources:  # the export at the end of `run`: its newest checkpoint holds the weights
        latest = latest_complete_checkpoint(run_dir)
        checkpoint = latest[1] if latest is not None else None
        ours = True
    else:
        source = Path(sources[0])
        is_checkpoint = checkpoint_step(source) is not None and (source / TRAINER_STATE).is_file()
        checkpoint = source if is_checkpoint else None
        ours = is_checkpoint and source.resolve().parent == run_dir.resolve()
    if checkpoint is None:
        return None, None, ours and not sources
    state = _read_json_dict(checkpoint / TRAINER_STATE) or {}
    world = state.get("world_size")
    processes = world if isinstance(world, int) and not isinstance(world, bool) else None
    return checkpoint_step(checkpoint), processes, ours


def training_facts(
    plan: RunPlan, sources: Sequence[Path] = ()
) -> tuple[TrainingFacts, Measurement | None]:
    """How the drafter was trained, and the run's last held-out measurement of these weights."""
    training, data, card = plan.training, plan.data, plan.card
    base_model = (card.base_model if card is not None else None) or hub_id_from_cache_path(
        plan.base_model.path, "models"
    )
    datasets = (card.datasets if card is not None else None) or tuple(
        found for found in [hub_id_from_cache_path(data.data_path, "datasets")] if found
    )
    budget = [HASH_LIMIT_BYTES]
    role = "training"
    if data.eval_holdout:  # the held-out conversations are in this file, never trained on
        role = (
            f"training, less {data.eval_holdout} conversations held out for the held-out "
            f"measurement (data.eval_holdout, seed {training.seed})"
        )
    files = data_files(data.data_path, role, "data.data_path", budget)
    files += data_files(data.eval_data_path, "held-out", "data.eval_data_path", budget)
    step, processes, ours = _steps(plan, sources)
    per_step = training.per_device_train_batch_size * training.gradient_accumulation_steps
    tokens, supervised, conversations = _cache_stats(plan)
    planned = (
        f"max_steps {training.max_steps}"
        if training.max_steps is not None
        else f"{training.num_train_epochs} epoch{'s' if training.num_train_epochs != 1 else ''}"
    )
    facts = TrainingFacts(
        target=base_model or file_name(plan.base_model.path) or "the target",
        base_model=base_model,
        target_dtype=plan.base_model.dtype,
        warm_start=_warm_start(plan),
        resumed_from_step=plan.resume.step if plan.resume is not None else None,
        data_files=tuple(files),
        capture=file_name(data.hidden_states_path),
        datasets=datasets,
        steps=step,
        planned=planned,
        sequences_per_step=per_step * processes if processes is not None else None,
        batch=(
            f"{training.per_device_train_batch_size} per device x "
            f"{training.gradient_accumulation_steps} accumulated"
            + (
                f" x {processes} process{'es' if processes != 1 else ''}"
                if processes is not None
                else " per process"
            )
        ),
        training_seq_len=training.training_seq_len,
        dataset_tokens=tokens,
        supervised_tokens=supervised,
        conversations=conversations,
        answer_only_loss=data.answer_only_loss,
        supervised_parts=tuple(data.supervise),
        objective=_objective(plan),
        optimiser=(
            f"AdamW, learning rate {training.learning_rate:g}, {training.lr_scheduler_type} "
            f"schedule, warmup ratio {training.warmup_ratio:g}, weight decay "
            f"{training.weight_decay:g}, gradient clipping {training.max_grad_norm:g}"
        ),
        seed=training.seed,
        plan_fingerprint=plan.fingerprint,
    )
    measured = last_training_measurement(Path(training.output_dir), step) if ours else None
    return facts, measured


def export_card_facts(
    plan: RunPlan,
    export_dir: Path,
    *,
    sources: Sequence[Path] = (),
    serving_notes: Sequence[str] = (),
) -> CardFacts:
    """The facts of the card of the export being written in `export_dir` (see the module)."""
    training, measured = training_facts(plan, sources)
    card = plan.card
    return CardFacts(
        drafter=drafter_facts(plan, export_dir),
        training=training,
        measurement=measured,
        description=card.description if card is not None else None,
        license=card.license if card is not None else None,
        serving_notes=tuple(serving_notes),
        tool_version=__version__,
    )


__all__ = [
    "CACHE_META_FILE",
    "HASH_LIMIT_BYTES",
    "data_files",
    "drafter_facts",
    "export_card_facts",
    "hub_id_from_cache_path",
    "training_facts",
]
