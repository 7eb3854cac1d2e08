"""`dflash-recipe init`: write a starting recipe that compiles cleanly.

With an init checkpoint, every draft fact is read from it: the architecture (config.json, else
the safetensors header), the taps, the mask id and the block size. Nothing is guessed; a
checkpoint that does not state its taps or mask id is an error naming what to pass.

Without one, the recipe describes a new drafter. Only then are the target's attention and MLP
sizes used, as *defaults written into the recipe* where the user can see and change them
(compile never fills draft dims from the base model). The mask id is the tokenizer's mask
token, else its first unused embedding row (Qwen3: 151669), else, when every row is a token, its
first reserved special token (Llama 3's <|reserved_special_token_0|>), read from the tokenizer
files: only what they assign as token ids counts (tokenizer_config.json's `model_max_length` is
not one).

``training_seq_len`` is 4096, or less when the target's (or the checkpoint's)
``max_position_embeddings`` is smaller, so the recipe never trains past the positions they
were built for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import attrs

from dflash_recipes.checkpoint.config_json import read_json_config
from dflash_recipes.checkpoint.hfconfig import (
    TargetConfig,
    read_checkpoint_config,
    read_target_config,
)
from dflash_recipes.checkpoint.kinds.registry import kind_facts, kind_from_tensors
from dflash_recipes.checkpoint.known_layouts import canonical_weights
from dflash_recipes.checkpoint.model_paths import (
    inspect_checkpoint_dir,
    inspect_model_dir,
    resolve_local_path,
)
from dflash_recipes.checkpoint.tensor_layout import (
    ARCHITECTURE_FIELDS,
    checkpoint_dims,
    default_target_layer_ids,
)
from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.diagnostics import Severity
from dflash_recipes.errors import CheckpointError, DFlashRecipeError
from dflash_recipes.files.jsonio import FileReadProblem, read_regular_file
from dflash_recipes.recipe.sections import DFlashArchitectureConfig, default_loss_decay_factor
from dflash_recipes.records import Record

#: Draft layers of a new drafter: the released Qwen3 DFlash drafters use 5.
NEW_DRAFT_LAYERS = 5
#: Block size of a new drafter (and of a checkpoint that does not state one).
DEFAULT_BLOCK_SIZE = 16
#: training_seq_len of a new recipe, when the target and the checkpoint allow as many positions.
DEFAULT_TRAINING_SEQ_LEN = 4096
#: Special tokens whose name says no text holds them: a mask id when no embedding row is unused.
_RESERVED_TOKEN = re.compile(r"reserved|unused|spare", re.IGNORECASE)
#: Peak learning rates, fine-tuning a released drafter vs from scratch (docs/dflash.md,
#: "Learning rate").
FINETUNE_LEARNING_RATE = 1.0e-4
SCRATCH_LEARNING_RATE = 6.0e-4
#: The projector type a recipe gets when it names none (written only when it differs).
_DEFAULT_PROJECTOR: str = DFlashArchitectureConfig().projector_type
#: Tokenizer files larger than this are not read (Qwen3's tokenizer.json is about 11 MB).
_TOKENIZER_MAX_BYTES = 64 * 2**20


@attrs.frozen(repr=False, eq=False, slots=False)
class _Choice(Record):
    """A value written into the recipe and the comment that says where it came from."""

    value: object
    why: str | None


@attrs.frozen(repr=False, eq=False, slots=False)
class _Draft(Record):
    """Everything the `dflash:` section needs, each with its reason."""

    arch: dict[str, _Choice]
    taps: _Choice
    mask: _Choice
    block_size: _Choice
    learning_rate: _Choice
    #: The init checkpoint's max_position_embeddings, when its config.json states one.
    max_positions: int | None = None


def _fail(message: str, hint: str) -> CheckpointError:
    return CheckpointError(f"{message}\nfix: {hint}")


def _target(base_model_dir: Path) -> TargetConfig:
    problem = inspect_model_dir(str(base_model_dir), base_dir=None)
    if problem is not None:
        raise _fail(problem.message, problem.hint)
    read = read_target_config(resolve_local_path(str(base_model_dir), base_dir=None))
    errors = [p for p in read.problems if p.severity is Severity.ERROR]
    if errors or read.facts is None:
        lines = [f"{read.path}: {p.message}" for p in errors] or [f"{read.path} is incomplete"]
        hints = [p.hint for p in errors if p.hint] or ["use the base model's own config.json"]
        raise _fail("\n".join(lines), "\n".join(hints))
    return read


# ---------------------------------------------------------------------------------------------
# from a checkpoint
# ---------------------------------------------------------------------------------------------


def _from_checkpoint(value: Path, target: TargetConfig, mask_token_id: int | None) -> _Draft:
    problem = inspect_checkpoint_dir(str(value), base_dir=None)
    if problem is not None:
        raise _fail(problem.message, problem.hint)
    directory = resolve_local_path(str(value), base_dir=None)
    weights, _ = canonical_weights(read_checkpoint_weights(directory))  # compile reads the same
    config = read_checkpoint_config(directory)
    unreadable = [p for p in config.problems if p.severity is Severity.ERROR]
    if unreadable:
        raise _fail(unreadable[0].message, unreadable[0].hint or "restore config.json")
    dims = checkpoint_dims(config.stated_dims(), weights.shapes)
    # the target's sizes never feed a warm-started drafter; only its width must agree
    assert target.facts is not None
    width = dims.values.get("hidden_size")
    if width is not None and width != target.facts.hidden_size:
        raise _fail(
            f"{directory} holds a drafter {width} wide, but the base model's hidden_size is "
            f"{target.facts.hidden_size}; a drafter is always as wide as its target",
            "pick the base model this drafter was trained for, or another drafter",
        )

    arch: dict[str, _Choice] = {}
    missing = [name for name in ARCHITECTURE_FIELDS if name not in dims.values]
    if missing:
        raise _fail(
            f"{directory}: cannot tell {', '.join(missing)} from its config.json or tensors",
            "write the recipe by hand from the drafter's model card",
        )
    for name in ARCHITECTURE_FIELDS:
        arch[name] = _Choice(dims.values[name], dims.sources[name].removeprefix("as "))

    projector = config.projector_type or kind_from_tensors(weights.shapes)
    if projector != _DEFAULT_PROJECTOR:
        arch["projector_type"] = _Choice(projector, "the checkpoint's head variant")
    kind = kind_facts(projector)
    for name in kind.head_fields:
        if name not in dims.values:
            raise _fail(
                f"{directory}: a {projector} checkpoint that states no {name}",
                "write the recipe by hand from the drafter's model card",
            )
        arch[name] = _Choice(dims.values[name], dims.sources[name].removeprefix("as "))
    for name, (stated, why) in kind.starter_fields(config, weights.tensors).items():
        arch[name] = _Choice(stated, why)
    if any(n.endswith(".self_attn.attention_sink_bias") for n in weights.tensors):
        arch["attention_sink"] = _Choice(True, "the checkpoint has attention_sink_bias tensors")
    if config.rms_norm_eps is not None:
        arch["rms_norm_eps"] = _Choice(config.rms_norm_eps, "the checkpoint's config.json says")

    n_taps = dims.values.get("n_taps")
    if config.target_layer_ids is None:
        count = f" (its fc.weight takes {n_taps} taps)" if n_taps else ""
        raise _fail(
            f"{directory}: config.json does not state target_layer_ids{count}; taps are never "
            "guessed",
            "find the drafter's taps (model card or original config.json) and add them to its "
            "config.json as dflash_config.target_layer_ids",
        )
    taps = _Choice(list(config.target_layer_ids), "the checkpoint's taps (its config.json)")

    if mask_token_id is not None:
        mask = _Choice(mask_token_id, "given on the command line")
    elif config.mask_token_id is not None:
        mask = _Choice(config.mask_token_id, "the checkpoint's mask id (its config.json)")
    else:
        raise _fail(
            f"{directory}: config.json does not state mask_token_id; the mask id is never guessed",
            "pass the mask id the drafter was trained with (Qwen3 drafters: 151669)",
        )

    if config.block_size is not None:
        block = _Choice(config.block_size, "the checkpoint's trained block size (may be changed)")
    else:
        block = _Choice(DEFAULT_BLOCK_SIZE, "the checkpoint states none; 16 is the common size")
    learning_rate = _Choice(
        FINETUNE_LEARNING_RATE, "fine-tuning a released drafter (about 6e-4 from scratch)"
    )
    return _Draft(arch, taps, mask, block, learning_rate, config.max_position_embeddings)


# ---------------------------------------------------------------------------------------------
# a new drafter
# ---------------------------------------------------------------------------------------------


def _new_draft(base_model_dir: Path, target: TargetConfig, mask_token_id: int | None) -> _Draft:
    facts = target.facts
    assert facts is not None
    heads, kv, head_dim = target.num_attention_heads, target.num_key_value_heads, target.head_dim
    inter = target.intermediate_size
    missing = [
        name
        for name, value in (
            ("num_attention_heads", heads),
            ("head_dim", head_dim),
            ("intermediate_size", inter),
        )
        if value is None
    ]
    if missing:
        raise _fail(
            f"{target.path} states no {', '.join(missing)}, so there is no default to start from",
            "write dflash_architecture_config by hand",
        )
    why = "the target's value (a starting default, see above)"
    arch = {
        "num_attention_heads": _Choice(heads, why),
        # transformers' rule: no num_key_value_heads means one kv head per query head
        "num_key_value_heads": _Choice(kv if kv is not None else heads, why),
        "head_dim": _Choice(head_dim, why),
        "intermediate_size": _Choice(inter, why),
    }
    target_layers = facts.num_hidden_layers
    layers, taps = NEW_DRAFT_LAYERS, None
    while taps is None:
        try:
            taps = default_target_layer_ids(target_layers, layers)
        except ValueError:
            layers -= 1  # a shallow target: fewer draft layers keep the taps distinct
    layer_why = (
        "5 like the released Qwen3 DFlash drafters"
        if layers == NEW_DRAFT_LAYERS
        else f"fewer than 5 so that the default taps stay distinct in a {target_layers}-layer "
        "target"
    )
    arch = {"num_hidden_layers": _Choice(layers, layer_why), **arch}
    if facts.rms_norm_eps is not None:
        arch["rms_norm_eps"] = _Choice(facts.rms_norm_eps, "the target's rms_norm_eps")
    taps_choice = _Choice(
        list(taps),
        f"default formula for {target_layers} target and {layers} draft layers",
    )
    if mask_token_id is not None:
        mask = _Choice(mask_token_id, "given on the command line")
    else:
        mask = _mask_from_tokenizer(base_model_dir, facts.vocab_size)
    return _Draft(
        arch=arch,
        taps=taps_choice,
        mask=mask,
        block_size=_Choice(DEFAULT_BLOCK_SIZE, "16 drafted tokens per block"),
        learning_rate=_Choice(
            SCRATCH_LEARNING_RATE, "training from scratch (use about 1e-4 to fine-tune)"
        ),
    )


def _token_ids(name: str, document: Mapping[str, object]) -> list[int]:
    """The token ids the tokenizer file `name` assigns, and nothing else it holds.

    tokenizer.json: its model's vocabulary and `added_tokens`; tokenizer_config.json: the keys
    of `added_tokens_decoder` (transformers 5 writes the file without it: no ids then, and
    `model_max_length` or any other number in it is never one); vocab.json: token -> id.
    """
    ids: list[int] = []
    if name == "vocab.json":
        return [v for v in document.values() if type(v) is int]
    if name == "tokenizer_config.json":
        decoder = document.get("added_tokens_decoder")
        if isinstance(decoder, dict):
            ids += [i for i in map(_token_key, decoder) if i is not None]
        return ids
    model = document.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if type(v) is int]
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
        ids += list(range(len(vocab)))
    ids += list(_added_tokens(name, document))
    return ids


def _added_tokens(name: str, document: Mapping[str, object]) -> dict[int, tuple[str, bool]]:
    """id -> (content, special) of the added tokens tokenizer.json or tokenizer_config.json
    declares."""
    found: dict[int, tuple[str, bool]] = {}
    if name == "tokenizer.json":
        added = document.get("added_tokens")
        for entry in added if isinstance(added, list) else []:
            if isinstance(entry, dict) and type(entry.get("id")) is int:
                found[entry["id"]] = (str(entry.get("content")), entry.get("special") is True)
    elif name == "tokenizer_config.json":
        decoder = document.get("added_tokens_decoder")
        for key, entry in decoder.items() if isinstance(decoder, dict) else ():
            token = _token_key(key)
            if token is not None and isinstance(entry, dict):
                found[token] = (str(entry.get("content")), entry.get("special") is True)
    return found


def _special_token_ids(config: Mapping[str, object]) -> list[int]:
    """The bos/eos/pad/unk ids a config.json states (an id or a list of ids each)."""
    ids: list[int] = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = config.get(key)
        values = value if isinstance(value, list) else [value]
        ids += [v for v in values if type(v) is int]
    return ids


def _reserved_token(
    directory: Path, added: Mapping[int, tuple[str, bool]], vocab_size: int
) -> tuple[int, str] | None:
    """The lowest (id, content) of a special token whose name says it is reserved (Llama 3's
    <|reserved_special_token_0|>, Gemma's <unused0>), that the chat template never writes and
    that is not the tokenizer's bos/eos/pad/unk token; None when there is none."""
    template = ""
    named: set[str] = set()
    path = directory / "tokenizer_config.json"
    config = read_json_config(path, max_bytes=_TOKENIZER_MAX_BYTES) if path.is_file() else {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            named.add(value)
    templates = config.get("chat_template")
    if isinstance(templates, str):
        template += templates
    elif isinstance(templates, list):
        template += "".join(str(t.get("template")) for t in templates if isinstance(t, dict))
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        try:
            template += read_regular_file(jinja, max_bytes=_TOKENIZER_MAX_BYTES).decode(
                "utf-8", "replace"
            )
        except FileReadProblem as exc:
            raise CheckpointError(f"{jinja} cannot be read: {exc.reason}") from None
    for token, (content, special) in sorted(added.items()):
        if (
            special
            and token < vocab_size
            and _RESERVED_TOKEN.search(content)
            and content not in named
            and content not in template
        ):
            return token, content
    return None


def _named_mask_token(directory: Path) -> int | None:
    """The id of the tokenizer's own mask token, when tokenizer_config.json declares one."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    config = read_json_config(path, max_bytes=_TOKENIZER_MAX_BYTES)
    mask = config.get("mask_token")
    if isinstance(mask, dict):
        mask = mask.get("content")
    decoder = config.get("added_tokens_decoder")
    if not isinstance(mask, str) or not isinstance(decoder, dict):
        return None
    for key, entry in decoder.items():
        token = _token_key(key)
        if isinstance(entry, dict) and entry.get("content") == mask and token is not None:
            return token
    return None


def _token_key(key: str) -> int | None:
    """A token id written as a JSON object key ("151669"), or None for anything else.

    str.isdigit() also accepts digits int() refuses ("²") and keys of any length, so only
    short ASCII decimals count.
    """
    if key.isascii() and key.isdigit() and len(key) <= 12:
        return int(key)
    return None


def _mask_from_tokenizer(directory: Path, vocab_size: int) -> _Choice:
    try:
        named = _named_mask_token(directory)
        if named is not None and named < vocab_size:
            return _Choice(named, "the tokenizer's own mask token")
        ids: list[int] = []
        added: dict[int, tuple[str, bool]] = {}
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
            path = directory / name
            if path.is_file():
                document = read_json_config(path, max_bytes=_TOKENIZER_MAX_BYTES)
                ids += _token_ids(name, document)
                added.update(_added_tokens(name, document))
        if ids and (directory / "config.json").is_file():
            ids += _special_token_ids(read_json_config(directory / "config.json"))
        reserved = _reserved_token(directory, added, vocab_size) if ids else None
    except DFlashRecipeError as exc:
        raise _fail(
            f"cannot read the tokenizer files to find a mask id: {exc}",
            "pass the mask id explicitly (an embedding row the tokenizer never produces)",
        ) from exc
    if not ids:
        raise _fail(
            f"{directory} has no tokenizer files, so no unused embedding row can be found for "
            "the mask id; it is never guessed",
            "pass the mask id explicitly (Qwen3: 151669, the first unused embedding row)",
        )
    first_unused = max(ids) + 1
    if first_unused < vocab_size:
        return _Choice(
            first_unused,
            f"first unused embedding row (token ids end at {max(ids)}; no mask token)",
        )
    if reserved is not None:
        token, content = reserved
        return _Choice(
            token,
            f"{content}: a reserved special token the chat template never writes (every "
            "embedding row is a token; no mask token)",
        )
    raise _fail(
        f"the tokenizer uses every embedding row (ids up to {max(ids)}, vocab_size "
        f"{vocab_size}) and declares no mask token and no reserved special token",
        "pass a mask id explicitly, e.g. a special token of this tokenizer that no text holds",
    )


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------


def _training_seq_len(target_positions: int, checkpoint_positions: int | None) -> _Choice:
    """4096, or the fewer positions the target (or the init checkpoint) was built for."""
    limits = [(target_positions, "the target's max_position_embeddings")]
    if checkpoint_positions is not None:
        limits.append((checkpoint_positions, "the init checkpoint's max_position_embeddings"))
    positions, source = min(limits, key=lambda limit: limit[0])
    if positions >= DEFAULT_TRAINING_SEQ_LEN:
        return _Choice(DEFAULT_TRAINING_SEQ_LEN, None)
    return _Choice(positions, f"{source} (no longer sequences than it was built for)")


def _packing_line(target: TargetConfig) -> str:
    """`packing: true`, or false with the reason for a target whose layers carry a state
    across tokens (no mask keeps a packed row's conversations apart there)."""
    blockers = target.layers.packing_blockers()
    if blockers:
        why = f"{' and '.join(blockers)} carry state across a packed row's conversations"
        return _line(1, "packing", False, why)
    return _line(
        1,
        "packing",
        True,
        "whole conversations packed into full training_seq_len rows (per-document attention)",
    )


def _scalar(value: object) -> str:
    """A YAML scalar the strict loader reads back as the same value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        mantissa, _, exponent = text.partition("e")
        if exponent and "." not in mantissa:
            text = f"{mantissa}.0e{exponent}"  # YAML 1.1 wants a dot in `1.0e-06`
        return text
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    # a JSON string is a valid double-quoted YAML scalar (non-ASCII kept as UTF-8)
    return json.dumps(str(value), ensure_ascii=False)


def _line(indent: int, key: str, value: object, why: str | None = None) -> str:
    text = f"{'  ' * indent}{key}: {_scalar(value)}"
    return f"{text}  # {why}" if why else text


def render_init_recipe(
    base_model_dir: Path,
    init_checkpoint: Path | None,
    *,
    output_dir: str | None = None,
    data_path: str | None = None,
    mask_token_id: int | None = None,
    recipe_path: str | None = None,
) -> str:
    """A commented YAML recipe for `base_model_dir`, warm-starting from `init_checkpoint`.

    With a checkpoint, the architecture, taps, mask id and block size are the checkpoint's
    (config.json, else its tensor shapes). Without one, a new 5-layer drafter sized like the
    target, default taps, and the tokenizer's mask token or first unused embedding row.
    `recipe_path` only names the file in the header's commands. Raises CheckpointError (with
    the fix) when a fact cannot be read and must not be guessed.
    """
    target = _target(base_model_dir)
    facts = target.facts
    assert facts is not None
    if init_checkpoint is not None:
        draft = _from_checkpoint(init_checkpoint, target, mask_token_id)
        checkpoint = resolve_local_path(str(init_checkpoint), base_dir=None)
    else:
        checkpoint = None
        draft = _new_draft(base_model_dir, target, mask_token_id)
    model_dir = resolve_local_path(str(base_model_dir), base_dir=None)
    # paths typed on the command line mean the shell's folder, not the recipe's: write them
    # absolute so the recipe means the same wherever it is saved
    if data_path is not None:
        data_path = str(resolve_local_path(data_path, base_dir=None))
    if output_dir is not None:
        output_dir = str(resolve_local_path(output_dir, base_dir=None))
    recipe = recipe_path or "recipe.yaml"
    seq_len = _training_seq_len(facts.max_position_embeddings, draft.max_positions)
    block = draft.block_size.value
    assert isinstance(block, int)

    story = (
        f"# Fine-tunes the DFlash drafter {checkpoint} for {model_dir}."
        if checkpoint is not None
        else f"# Trains a new DFlash drafter from scratch for {model_dir}."
    )
    lines = [
        "# DFlash recipe written by `dflash-recipe init`.",
        story,
        "#",
        "# Check it (reads config.json files and safetensors headers only, no GPU):",
        f"#   dflash-recipe compile {recipe} -o plan.json",
        "# Train (resumes by itself when output_dir already holds a checkpoint):",
        f"#   dflash-recipe run {recipe}",
        "",
        "model:",
        _line(1, "model_name_or_path", str(model_dir), "the frozen target (local directory)"),
        _line(1, "dtype", "bfloat16", "bfloat16 | float16 | float32"),
        _line(1, "trust_remote_code", False, "never run the model folder's own code unasked"),
        "data:",
        _line(
            1,
            "data_path",
            data_path,
            "JSONL conversations" if data_path else "set this before `dflash-recipe run`",
        ),
        _line(1, "chat_template", None, "null: the tokenizer's own template"),
        _line(1, "answer_only_loss", True, "supervise assistant tokens only"),
        _packing_line(target),
        "training:",
        _line(
            1,
            "output_dir",
            output_dir or "outputs/dflash",
            "checkpoints, metrics and the export (a relative path is under this file's folder)",
        ),
        _line(1, "learning_rate", draft.learning_rate.value, draft.learning_rate.why),
        _line(1, "num_train_epochs", 1),
        _line(1, "warmup_ratio", 0.04, "linear warmup over the first 4% of steps"),
        _line(1, "lr_scheduler_type", "cosine"),
        _line(1, "training_seq_len", seq_len.value, seq_len.why),
        _line(1, "save_steps", 500),
        "dflash:",
    ]
    if checkpoint is not None:
        lines.append(
            _line(1, "dflash_init_checkpoint", str(checkpoint), "warm start (local directory)")
        )
    lines += [
        _line(1, "dflash_block_size", block, draft.block_size.why),
        _line(1, "dflash_mask_token_id", draft.mask.value, draft.mask.why),
        _line(
            1,
            "dflash_loss_decay_factor",
            default_loss_decay_factor(block),
            f"gamma of the position weights for block size {block}",
        ),
        "  # The drafter's own dimensions. Compile never fills them from the base model, and",
        "  # they must match the init checkpoint when there is one.",
    ]
    if checkpoint is None:
        lines += [
            "  # A new drafter: attention and MLP sizes start at the target's values. That is a",
            "  # choice made here, in the open; shrink them for a smaller, faster drafter.",
        ]
    lines += [
        "  dflash_architecture_config:",
    ]
    for name, choice in draft.arch.items():
        lines.append(_line(2, name, choice.value, choice.why))
    lines.append(
        _line(2, "target_layer_ids", draft.taps.value, f"{draft.taps.why}; k = output of layer k")
    )
    return "\n".join(lines) + "\n"


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "NEW_DRAFT_LAYERS",
    "render_init_recipe",
]
