"""Facts from Hugging Face `config.json` files: the base model's and a drafter checkpoint's.

Both layouts in circulation are read:

- flat (transformers 4, most published checkpoints): `rope_theta`, `rope_scaling`, a top-level
  `block_size`, `mask_token_id` and `target_layer_ids` beside the dims;
- nested (transformers 5 and newer exporters): `rope_parameters: {rope_theta, rope_type, ...}`
  (possibly one dict per layer type), `dflash_config: {block_size, mask_token_id,
  target_layer_ids, ...}`, and `text_config` holding the language model of a multimodal config.

Nothing here falls back to a class default. A config that states no RoPE theta is a problem
the caller reports, never a silent 10000: that fallback is how drafters end up trained with other
positions than the ones they are served with. Readers return problems instead of raising;
the compiler turns them into diagnostics at the recipe path it knows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import attrs

from dflash_recipes.checkpoint.config_bounds import (
    MAX_LAYER_INDEX,
    MAX_LIST_ENTRIES,
    plausible_maximum,
)
from dflash_recipes.checkpoint.config_json import read_json_config
from dflash_recipes.checkpoint.model_files import CONFIG_FILE
from dflash_recipes.checkpoint.target_facts import RopePlan, RopeValue, TargetFacts
from dflash_recipes.checkpoint.target_layers import TargetLayers, read_target_layers
from dflash_recipes.checkpoint.tensor_layout import ARCHITECTURE_FIELDS, SHAPE_FIELDS
from dflash_recipes.diagnostics import Severity, register_code
from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.files.jsonio import shorten
from dflash_recipes.recipe.choices import PROJECTOR_TYPES
from dflash_recipes.records import Record

TARGET_CONFIG_UNREADABLE = register_code(
    "target-config-unreadable",
    Severity.ERROR,
    "the base model's config.json cannot be read or is not a JSON object",
)
TARGET_CONFIG_FIELD = register_code(
    "target-config-field",
    Severity.ERROR,
    "the base model's config.json lacks a field the drafter needs, or states it with a bad value",
)
TARGET_ROPE_MISSING = register_code(
    "target-rope-missing",
    Severity.ERROR,
    "the base model's config.json states no RoPE theta (never replaced by a class default)",
)
TARGET_ROPE_CONFLICT = register_code(
    "target-rope-conflict",
    Severity.WARNING,
    "the base model's config.json states two different RoPE thetas; the nested one is used",
)
TARGET_ROPE_PARAMETER_DROPPED = register_code(
    "target-rope-parameter-dropped",
    Severity.WARNING,
    "a RoPE parameter of the base model is not a scalar and is not carried into the plan",
)
CHECKPOINT_CONFIG_UNREADABLE = register_code(
    "checkpoint-config-unreadable",
    Severity.ERROR,
    "the init checkpoint's config.json exists but cannot be read or is not a JSON object",
)
CHECKPOINT_CONFIG_FIELD = register_code(
    "checkpoint-config-field",
    Severity.WARNING,
    "a field of the init checkpoint's config.json has a bad value and is ignored",
)
CHECKPOINT_CONFIG_CONFLICT = register_code(
    "checkpoint-config-conflict",
    Severity.WARNING,
    "the init checkpoint's config.json states a field twice (flat and nested) with two values",
)


@attrs.frozen(repr=False, eq=False, slots=False)
class ConfigProblem(Record):
    """Something wrong in a config.json, with the key it concerns (dotted, inside the file)."""

    code: str
    severity: Severity
    key: str
    message: str
    hint: str | None = None


@attrs.frozen(repr=False, eq=False, slots=False)
class TargetConfig(Record):
    """What the base model's config.json says, plus the problems found reading it.

    `facts` is None when a field the plan needs is missing. The attention and MLP sizes are
    the *target's*; they are only suggestions for `dflash-recipe init` (a draft never inherits
    them at compile time).
    """

    path: str
    facts: TargetFacts | None
    problems: tuple[ConfigProblem, ...] = ()
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    #: True when the language-model fields came from a multimodal config's `text_config`.
    from_text_config: bool = False
    #: The family, declared layer types and attention implementation (packing and taps).
    layers: TargetLayers = attrs.field(factory=TargetLayers)


@attrs.frozen(repr=False, eq=False, slots=False)
class CheckpointConfigFacts(Record):
    """What a drafter checkpoint's config.json says (every field None when not stated)."""

    path: str
    #: False when the directory has no config.json (then every fact is None).
    present: bool
    problems: tuple[ConfigProblem, ...] = ()
    #: The parsed config.json as read (empty when absent or unreadable), for the checks of
    #: :mod:`dflash_recipes.checkpoint.config_fields`.
    raw: Mapping[str, object] = attrs.field(factory=dict, eq=False, repr=False)
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rms_norm_eps: float | None = None
    vocab_size: int | None = None
    num_target_layers: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float | None = None
    rope_type: str | None = None
    block_size: int | None = None
    mask_token_id: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    projector_type: str | None = None
    emb_dim: int | None = None
    gru_hidden_dim: int | None = None
    markov_rank: int | None = None
    use_confidence_head: bool | None = None
    attention_sink: bool | None = None
    #: `layer_types` (full_attention | sliding_attention per layer), when stated and valid.
    layer_types: tuple[str, ...] | None = None
    #: `sliding_window`, when stated.
    sliding_window: int | None = None

    @property
    def readable(self) -> bool:
        """True when a config.json was present and parsed as a JSON object."""
        return self.present and not any(
            p.code == CHECKPOINT_CONFIG_UNREADABLE for p in self.problems
        )

    def architecture(self) -> dict[str, int]:
        """The draft dims this config states, keyed by recipe field name."""
        stated: dict[str, int] = {}
        for name in ARCHITECTURE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                stated[name] = value
        return stated

    def stated_dims(self) -> dict[str, int]:
        """Every dim stated here that tensor shapes can confirm: hidden_size, the draft dims and
        the head sizes (what :func:`~dflash_recipes.checkpoint.tensor_layout.checkpoint_dims`
        takes)."""
        stated: dict[str, int] = {}
        for name in ("hidden_size", *SHAPE_FIELDS):
            value = getattr(self, name)
            if value is not None:
                stated[name] = value
        return stated


# ---------------------------------------------------------------------------------------------
# strict value readers: a JSON value of the wrong kind is a problem, never coerced
# ---------------------------------------------------------------------------------------------


class _Fields:
    """Reads typed fields from one or two config sections and collects the problems."""

    def __init__(self, sections: tuple[Mapping[str, object], ...], prefix: str) -> None:
        self.sections = sections
        self.prefix = prefix
        self.problems: list[ConfigProblem] = []

    def raw(self, key: str) -> tuple[object, str] | None:
        for index, section in enumerate(self.sections):
            if key in section and section[key] is not None:
                where = f"{self.prefix}{key}" if index == 0 and self.prefix else key
                return section[key], where
        return None

    def bad(self, code: str, severity: Severity, where: str, want: str, value: object) -> None:
        message = f"`{where}` must be {want}, got {shorten(value)}"
        if severity is Severity.ERROR:
            hint = f"restore `{where}` from the model's original config.json"
        else:
            message += "; it is ignored"
            hint = f"correct `{where}` in config.json (re-export or re-download the checkpoint)"
        self.problems.append(ConfigProblem(code, severity, where, message, hint))

    def integer(self, key: str, code: str, severity: Severity, *, minimum: int = 1) -> int | None:
        found = self.raw(key)
        if found is None:
            return None
        value, where = found
        if type(value) is not int or value < minimum:
            self.bad(code, severity, where, f"an integer >= {minimum}", value)
            return None
        maximum = plausible_maximum(key)
        if value > maximum:
            # larger is no model's size: refused before anything is sized by it
            self.bad(code, severity, where, f"an integer in [{minimum}, {maximum}]", value)
            return None
        return value

    def positive_float(self, key: str, code: str, severity: Severity) -> float | None:
        found = self.raw(key)
        if found is None:
            return None
        value, where = found
        number = _positive_number(value)
        if number is None:
            self.bad(code, severity, where, "a finite number > 0", value)
        return number


def _positive_number(value: object) -> float | None:
    """`value` as a float when it is a finite JSON number > 0 (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) and number > 0 else None


def _as_mapping(value: object) -> dict[str, object] | None:
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return value
    return None


def _language_sections(
    config: Mapping[str, object],
) -> tuple[tuple[Mapping[str, object], ...], str]:
    """The sections to read language-model fields from: `text_config` first when present."""
    text = _as_mapping(config.get("text_config"))
    if text is not None:
        return (text, config), "text_config."
    return (config,), ""


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------

_ROPE_NAMING_KEYS = frozenset({"rope_theta", "rope_type", "type"})


@attrs.frozen(repr=False, eq=False, slots=False)
class _RopeRead(Record):
    theta: float | None
    rope_type: str
    extras: dict[str, RopeValue]
    problems: tuple[ConfigProblem, ...]


def _rope_dict(
    section: Mapping[str, object], layer_types: object, prefix: str
) -> tuple[dict[str, object] | None, str]:
    """The RoPE parameter dict a model runs with, and its dotted key.

    transformers 5 gives a non-null `rope_scaling` priority over `rope_parameters`, and a
    `rope_parameters` keyed by layer type holds one dict per attention kind: a drafter's
    layers are full attention, so that entry is the one that applies.
    """
    for key in ("rope_scaling", "rope_parameters"):
        params = _as_mapping(section.get(key))
        if params is None:
            continue
        listed = layer_types if isinstance(layer_types, list) else []
        labels = {label for label in listed if isinstance(label, str)}
        labels |= {"full_attention", "sliding_attention"}
        nested = [k for k, v in params.items() if k in labels and isinstance(v, dict)]
        if nested and not (_ROPE_NAMING_KEYS & params.keys()):
            chosen = "full_attention" if "full_attention" in nested else sorted(nested)[0]
            inner = _as_mapping(params[chosen])
            return inner, f"{prefix}{key}.{chosen}."
        return params, f"{prefix}{key}."
    return None, prefix


def _read_rope(
    section: Mapping[str, object],
    prefix: str,
    *,
    conflict_code: str | None,
    field_code: str,
    field_severity: Severity,
) -> _RopeRead:
    problems: list[ConfigProblem] = []
    layer_types = section.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types)
    ):
        key = f"{prefix}layer_types"
        odd = (
            layer_types
            if not isinstance(layer_types, list)
            else next(t for t in layer_types if not isinstance(t, str))
        )
        message = (
            f'`{key}` must be a list of attention kinds (strings such as "full_attention"), '
            f"got {shorten(odd)}"
        )
        hint = f"correct `{key}` in config.json (or remove it: every layer is then full attention)"
        problems.append(ConfigProblem(field_code, field_severity, key, message, hint))
    params, where = _rope_dict(section, layer_types, prefix)
    flat = section.get("rope_theta")
    nested = params.get("rope_theta") if params is not None else None

    theta: float | None = None
    for value, key in ((nested, f"{where}rope_theta"), (flat, f"{prefix}rope_theta")):
        if value is None:
            continue
        number = _positive_number(value)
        if number is None:
            message = f"`{key}` must be a finite number > 0, got {shorten(value)}"
            hint = f"correct `{key}` in config.json"
            problems.append(ConfigProblem(field_code, field_severity, key, message, hint))
            continue
        if theta is None:
            theta = number
        elif conflict_code is not None and number != theta:
            message = (
                f"config.json states `{where}rope_theta: {shorten(nested)}` and `{key}: "
                f"{shorten(value)}`; transformers uses the nested value, so the plan takes "
                f"{theta!r}"
            )
            hint = f"delete the stale `{key}` from config.json so both readers agree"
            problems.append(ConfigProblem(conflict_code, Severity.WARNING, key, message, hint))

    rope_type = "default"
    extras: dict[str, RopeValue] = {}
    if params is not None:
        stated_type = params.get("rope_type", params.get("type"))
        if isinstance(stated_type, str) and stated_type:
            rope_type = stated_type
        elif stated_type is not None:
            key = f"{where}rope_type"
            message = f"`{key}` must be a string, got {shorten(stated_type)}; `default` is assumed"
            hint = f"correct `{key}` in config.json"
            problems.append(ConfigProblem(field_code, field_severity, key, message, hint))
        for key in sorted(params):
            if key in _ROPE_NAMING_KEYS:
                continue
            value = params[key]
            if value is None or isinstance(value, (bool, int, float, str)):
                extras[key] = value
            elif conflict_code is not None:
                message = (
                    f"RoPE parameter `{where}{key}` is {type(value).__name__} {shorten(value)}; "
                    "the run plan carries scalar RoPE parameters only, so it is left out"
                )
                hint = "check that the drafter's positions do not depend on it (text-only RoPE)"
                problems.append(
                    ConfigProblem(
                        TARGET_ROPE_PARAMETER_DROPPED,
                        Severity.WARNING,
                        f"{where}{key}",
                        message,
                        hint,
                    )
                )
    return _RopeRead(theta, rope_type, extras, tuple(problems))


# ---------------------------------------------------------------------------------------------
# base model
# ---------------------------------------------------------------------------------------------


def target_config_from_mapping(config: Mapping[str, object], path: str) -> TargetConfig:
    """Interpret a base model's parsed config.json (see :func:`read_target_config`)."""
    sections, prefix = _language_sections(config)
    language = sections[0]
    fields = _Fields(sections, prefix)
    code, severity = TARGET_CONFIG_FIELD, Severity.ERROR

    hidden_size = fields.integer("hidden_size", code, severity)
    num_hidden_layers = fields.integer("num_hidden_layers", code, severity)
    vocab_size = fields.integer("vocab_size", code, severity)
    max_positions = fields.integer("max_position_embeddings", code, severity)
    # the target's epsilon is informational (the draft has its own): a bad one only warns
    rms_norm_eps = fields.positive_float("rms_norm_eps", code, Severity.WARNING)
    heads = fields.integer("num_attention_heads", code, Severity.WARNING)
    kv_heads = fields.integer("num_key_value_heads", code, Severity.WARNING)
    head_dim = fields.integer("head_dim", code, Severity.WARNING)
    intermediate = fields.integer("intermediate_size", code, Severity.WARNING)
    problems = list(fields.problems)

    required = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_positions,
    }
    for key, value in required.items():
        if value is None and fields.raw(key) is None:
            message = f"config.json states no `{prefix}{key}`; the drafter needs the target's value"
            hint = (
                f"point model.model_name_or_path at the model's own directory; its config.json "
                f"must state `{key}`"
            )
            problems.append(ConfigProblem(code, severity, f"{prefix}{key}", message, hint))

    rope = _read_rope(
        language,
        prefix,
        conflict_code=TARGET_ROPE_CONFLICT,
        field_code=code,
        field_severity=severity,
    )
    problems.extend(rope.problems)
    if rope.theta is None and not any(p.key.endswith("rope_theta") for p in rope.problems):
        message = (
            "config.json states no RoPE theta (neither `rope_theta` nor "
            "`rope_parameters.rope_theta`); dflash-recipes never substitutes a class default "
            "such as 10000, because a drafter trained with other positions than the target's "
            "is served wrongly"
        )
        hint = (
            "add the model's documented value to config.json, e.g. "
            '`"rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}`'
        )
        problems.append(
            ConfigProblem(TARGET_ROPE_MISSING, Severity.ERROR, f"{prefix}rope_theta", message, hint)
        )

    architectures = config.get("architectures")
    arch_names: tuple[str, ...] = ()
    if isinstance(architectures, list) and all(isinstance(a, str) for a in architectures):
        arch_names = tuple(architectures)
    model_type = config.get("model_type")

    facts: TargetFacts | None = None
    if (
        hidden_size is not None
        and num_hidden_layers is not None
        and vocab_size is not None
        and max_positions is not None
        and rope.theta is not None
    ):
        facts = TargetFacts(
            model_type=model_type if isinstance(model_type, str) else "",
            architectures=arch_names,
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            vocab_size=vocab_size,
            max_position_embeddings=max_positions,
            rope=RopePlan(
                rope_theta=rope.theta,
                rope_type=rope.rope_type,
                rope_scaling=dict(rope.extras) or None,
            ),
            rms_norm_eps=rms_norm_eps,
        )
    if head_dim is None and hidden_size is not None and heads is not None:
        # transformers' own rule for configs without head_dim (used only as an init suggestion)
        head_dim = hidden_size // heads if hidden_size % heads == 0 else None
    return TargetConfig(
        path=path,
        facts=facts,
        problems=tuple(problems),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        from_text_config=bool(prefix),
        layers=read_target_layers(config),
    )


def _read_config(path: Path, code: str, hint: str) -> Mapping[str, object] | ConfigProblem:
    """The parsed config.json at `path`, or the one `code` problem saying why it cannot be read."""
    try:
        return read_json_config(path)
    except (DFlashRecipeError, OSError, ValueError) as exc:
        # the reader's text starts with `path: `; the problem is shown next to the path already
        message = f"cannot be read: {str(exc).removeprefix(f'{path}: ')}"
        return ConfigProblem(code, Severity.ERROR, "", message, hint)


def read_target_config(model_dir: Path) -> TargetConfig:
    """Read `model_dir/config.json` into :class:`TargetFacts` plus problems (never raises).

    The caller checks that the directory and file exist first; a file that cannot be read or
    parsed comes back as a `target-config-unreadable` problem with `facts` None.
    """
    path = model_dir / CONFIG_FILE
    hint = "restore config.json from the model's original download"
    config = _read_config(path, TARGET_CONFIG_UNREADABLE, hint)
    if isinstance(config, ConfigProblem):
        return TargetConfig(path=str(path), facts=None, problems=(config,))
    return target_config_from_mapping(config, str(path))


# ---------------------------------------------------------------------------------------------
# drafter checkpoint
# ---------------------------------------------------------------------------------------------


def _stated_twice(
    config: Mapping[str, object], nested: Mapping[str, object], key: str
) -> ConfigProblem | None:
    flat = config.get(key)
    inner = nested.get(key)
    if flat is None or inner is None or flat == inner:
        return None
    message = (
        f"config.json states `{key}: {shorten(flat)}` and `dflash_config.{key}: "
        f"{shorten(inner)}`; the nested value {shorten(inner)} is used"
    )
    hint = "re-export the checkpoint so both places agree"
    return ConfigProblem(CHECKPOINT_CONFIG_CONFLICT, Severity.WARNING, key, message, hint)


def checkpoint_config_from_mapping(
    config: Mapping[str, object], path: str
) -> CheckpointConfigFacts:
    """Interpret a drafter's parsed config.json (see :func:`read_checkpoint_config`)."""
    nested = _as_mapping(config.get("dflash_config")) or {}
    sections, prefix = _language_sections(config)
    code, severity = CHECKPOINT_CONFIG_FIELD, Severity.WARNING
    dims = _Fields(sections, prefix)
    # DFlash fields: the nested `dflash_config` wins (newer loaders read it), flat as fallback.
    dflash = _Fields((nested, config), "dflash_config.")

    problems: list[ConfigProblem] = []
    for key in ("block_size", "mask_token_id", "target_layer_ids"):
        conflict = _stated_twice(config, nested, key)
        if conflict is not None:
            problems.append(conflict)

    taps: tuple[int, ...] | None = None
    raw_taps = dflash.raw("target_layer_ids")
    if raw_taps is not None:
        value, where = raw_taps
        if (
            isinstance(value, list)
            and 0 < len(value) <= MAX_LIST_ENTRIES
            and all(type(item) is int and 0 <= item <= MAX_LAYER_INDEX for item in value)
        ):
            taps = tuple(value)
        else:
            want = "a non-empty list of integers >= 0"
            if isinstance(value, list) and (
                len(value) > MAX_LIST_ENTRIES
                or any(type(item) is int and item > MAX_LAYER_INDEX for item in value)
            ):
                want = f"a list of at most {MAX_LIST_ENTRIES} integers in [0, {MAX_LAYER_INDEX}]"
            dflash.bad(code, severity, where, want, value)

    projector: str | None = None
    raw_projector = dflash.raw("projector_type")
    if raw_projector is not None:
        value, where = raw_projector
        if value in PROJECTOR_TYPES:
            projector = str(value)
        else:
            dflash.bad(code, severity, where, "one of " + ", ".join(PROJECTOR_TYPES), value)

    flags: dict[str, bool | None] = {}
    # The sink flag is `attention_sink_bias` (what vLLM and SGLang read); exports written before
    # that fix say `attention_sink`, which is still read when the new key is absent.
    for key in ("use_confidence_head", "attention_sink_bias", "attention_sink"):
        raw_flag = dflash.raw(key)
        flags[key] = None
        if raw_flag is not None:
            value, where = raw_flag
            if isinstance(value, bool):
                flags[key] = value
            else:
                dflash.bad(code, severity, where, "true or false", value)

    layer_types, sliding_window = _read_layer_types(dims, code, severity)

    rope = _read_rope(
        sections[0], prefix, conflict_code=None, field_code=code, field_severity=severity
    )
    stated_rope = rope.theta is not None or _rope_dict(sections[0], None, prefix)[0] is not None
    rope_type = rope.rope_type if stated_rope else None

    facts = CheckpointConfigFacts(
        path=path,
        present=True,
        hidden_size=dims.integer("hidden_size", code, severity),
        num_hidden_layers=dims.integer("num_hidden_layers", code, severity),
        num_attention_heads=dims.integer("num_attention_heads", code, severity),
        num_key_value_heads=dims.integer("num_key_value_heads", code, severity),
        head_dim=dims.integer("head_dim", code, severity),
        intermediate_size=dims.integer("intermediate_size", code, severity),
        rms_norm_eps=dims.positive_float("rms_norm_eps", code, severity),
        vocab_size=dims.integer("vocab_size", code, severity),
        num_target_layers=dflash.integer("num_target_layers", code, severity),
        max_position_embeddings=dims.integer("max_position_embeddings", code, severity),
        rope_theta=rope.theta,
        rope_type=rope_type,
        block_size=dflash.integer("block_size", code, severity, minimum=2),
        mask_token_id=dflash.integer("mask_token_id", code, severity, minimum=0),
        target_layer_ids=taps,
        projector_type=projector,
        emb_dim=dflash.integer("emb_dim", code, severity),
        gru_hidden_dim=dflash.integer("gru_hidden_dim", code, severity),
        markov_rank=dflash.integer("markov_rank", code, severity),
        use_confidence_head=flags["use_confidence_head"],
        attention_sink=(
            flags["attention_sink_bias"]
            if flags["attention_sink_bias"] is not None
            else flags["attention_sink"]
        ),
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    all_problems = tuple(problems + dims.problems + dflash.problems + list(rope.problems))
    return attrs.evolve(facts, problems=all_problems, raw=dict(config))


def _read_layer_types(
    dims: _Fields, code: str, severity: Severity
) -> tuple[tuple[str, ...] | None, int | None]:
    """`layer_types` and `sliding_window` of a drafter config (None when not stated or bad)."""
    layer_types: tuple[str, ...] | None = None
    raw = dims.raw("layer_types")
    if raw is not None:
        value, where = raw
        kinds = ("full_attention", "sliding_attention")
        if (
            isinstance(value, list)
            and 0 < len(value) <= MAX_LIST_ENTRIES
            and all(item in kinds for item in value)
        ):
            layer_types = tuple(str(item) for item in value)
        else:
            want = "a non-empty list of " + " | ".join(kinds)
            if isinstance(value, list) and len(value) > MAX_LIST_ENTRIES:
                want = f"a list of at most {MAX_LIST_ENTRIES} entries"
            dims.bad(code, severity, where, want, value)
    return layer_types, dims.integer("sliding_window", code, severity)


def read_checkpoint_config(directory: Path) -> CheckpointConfigFacts:
    """Read a drafter checkpoint's config.json (never raises).

    No config.json: `present` is False and nothing is stated. A file that cannot be parsed:
    one `checkpoint-config-unreadable` problem and nothing stated.
    """
    path = directory / CONFIG_FILE
    if not path.exists() and not path.is_symlink():
        return CheckpointConfigFacts(path=str(path), present=False)
    hint = "restore config.json from the drafter's original download, or delete it"
    config = _read_config(path, CHECKPOINT_CONFIG_UNREADABLE, hint)
    if isinstance(config, ConfigProblem):
        return CheckpointConfigFacts(path=str(path), present=True, problems=(config,))
    return checkpoint_config_from_mapping(config, str(path))


__all__ = [
    "ARCHITECTURE_FIELDS",
    "CheckpointConfigFacts",
    "ConfigProblem",
    "TargetConfig",
    "checkpoint_config_from_mapping",
    "read_checkpoint_config",
    "read_target_config",
    "target_config_from_mapping",
]
