"""Re-validating a run plan's values with the recipe's own single-field validators.

A plan is machine-written, but it is a file: it can be edited, truncated or forged. Before the
executor trusts one, :func:`plan_value_problems` runs every value that came from a recipe field
through that field's validator (the same rule, the same bounds), and checks the facts the
compiler read (target config, checkpoint header, resume step) against plain bounds. Each
problem names the plan's dotted path, so a tampered `draft.block_size: 1` is refused before a
model is loaded rather than crashing at the first training step.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import attrs

from dflash_recipes.checkpoint.config_bounds import plausible_maximum
from dflash_recipes.files.jsonio import shorten
from dflash_recipes.plan.parts import (
    BaseModelPlan,
    CardPlan,
    DataPlan,
    DraftPlan,
    InitCheckpointPlan,
    RegeneratePlan,
    ResumePlan,
    TargetServerPlan,
    TrainingPlan,
)
from dflash_recipes.recipe import validators as recipe_rules
from dflash_recipes.recipe.sections import (
    CardSection,
    DataSection,
    DFlashArchitectureConfig,
    DFlashSection,
    IntRange,
    ModelSection,
    RegenerateSection,
    TargetServerSection,
    TrainingSection,
)

_Rule = Any  # an attrs validator: (instance, attribute, value) -> None, raising ValueError

#: Counts that may be zero.
_COUNT0 = IntRange(0, 2**31 - 1)
#: A resume step (checkpoint directories hold up to 12 digits).
_STEP = IntRange(0, 10**12 - 1)
#: A served target's --max-model-len (training_seq_len + 1).
_MODEL_LEN = IntRange(2, 2**24 + 1)
#: vLLM layer ids: a tap's id (tap + 1) or the layer count.
_LAYER_IDS = recipe_rules.layer_id_list


def _recipe_rule(cls: type, name: str) -> _Rule:
    return attrs.fields_dict(cls)[name].validator


def _section_rules(plan_obj: object, recipe_cls: type, prefix: str = "") -> dict[str, _Rule]:
    """Plan field -> validator of the recipe field `prefix + name` (same name otherwise)."""
    known = attrs.fields_dict(recipe_cls)
    rules: dict[str, _Rule] = {}
    for field in attrs.fields(type(plan_obj)):  # type: ignore[arg-type]
        name = prefix + field.name
        if name in known and known[name].validator is not None:
            rules[field.name] = known[name].validator
    return rules


def _run(
    path: str, rule: _Rule, value: object, label: str, *, optional: bool = False
) -> Iterator[str]:
    if value is None and optional:
        return
    # The recipe's validators read only the attribute's name, for their messages.
    attribute = SimpleNamespace(name=label)
    try:
        rule(None, attribute, value)
    except (ValueError, TypeError) as exc:
        yield f"{path}: {exc}"


def _check_section(path: str, obj: object, rules: dict[str, _Rule]) -> Iterator[str]:
    for name, rule in rules.items():
        yield from _run(f"{path}.{name}", rule, getattr(obj, name), name)


def plan_value_problems(
    base_model: BaseModelPlan,
    data: DataPlan,
    training: TrainingPlan,
    draft: DraftPlan,
    *,
    init_checkpoint: InitCheckpointPlan | None,
    regenerate: RegeneratePlan | None,
    resume: ResumePlan | None,
    card: CardPlan | None,
    target_server: TargetServerPlan | None = None,
) -> list[str]:
    """Every value of a plan's parts that breaks its rule, as `dotted.path: message` (empty:
    fine); ``RunPlan.from_dict`` passes its parts."""
    problems: list[str] = []
    base = base_model
    model_path_rule = _recipe_rule(ModelSection, "model_name_or_path")
    dtype_rule = _recipe_rule(ModelSection, "dtype")
    problems += _run("base_model.path", model_path_rule, base.path, "path")
    problems += _run("base_model.dtype", dtype_rule, base.dtype, "dtype")
    if base.facts is not None:
        facts = base.facts
        for name in ("hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings"):
            rule = IntRange(1, plausible_maximum(name))  # the bound compile read it with
            problems += _run(f"base_model.facts.{name}", rule, getattr(facts, name), name)
        positive = recipe_rules.positive_float
        rope_theta = facts.rope.rope_theta
        problems += _run("base_model.facts.rope.rope_theta", positive, rope_theta, "rope_theta")
        problems += _run(
            "base_model.facts.rms_norm_eps",
            positive,
            facts.rms_norm_eps,
            "rms_norm_eps",
            optional=True,
        )
    problems += _check_section("data", data, _section_rules(data, DataSection))
    problems += _check_section("training", training, _section_rules(training, TrainingSection))
    draft_rules = {
        "block_size": attrs.fields_dict(DFlashSection)["dflash_block_size"].validator,
        "mask_token_id": attrs.fields_dict(DFlashSection)["dflash_mask_token_id"].validator,
        "target_layer_ids": attrs.fields_dict(DFlashArchitectureConfig)[
            "target_layer_ids"
        ].validator,
    }
    problems += _check_section("draft", draft, draft_rules)
    problems += _check_section(
        "draft.architecture",
        draft.architecture,
        _section_rules(draft.architecture, DFlashArchitectureConfig),
    )
    problems += _check_section(
        "draft.objective",
        draft.objective,
        _section_rules(draft.objective, DFlashSection, prefix="dflash_"),
    )
    init = init_checkpoint
    if init is not None:
        problems += _run("init_checkpoint.path", model_path_rule, init.path, "path")
        init_rules: dict[str, _Rule] = {
            "tensor_count": _COUNT0,
            "trained_block_size": draft_rules["block_size"],
            "target_layer_ids": draft_rules["target_layer_ids"],
            "mask_token_id": draft_rules["mask_token_id"],
        }
        for name, rule in init_rules.items():
            value = getattr(init, name)
            problems += _run(f"init_checkpoint.{name}", rule, value, name, optional=True)
    if regenerate is not None:
        problems += _check_section(
            "regenerate", regenerate, _section_rules(regenerate, RegenerateSection)
        )
    if card is not None:
        problems += _check_section("card", card, _section_rules(card, CardSection))
    if target_server is not None:
        problems += _target_server_problems(target_server, dtype_rule, model_path_rule)
    if resume is not None:
        problems += _run("resume.step", _STEP, resume.step, "step")
        problems += _run(
            "resume.checkpoint_dir", model_path_rule, resume.checkpoint_dir, "checkpoint_dir"
        )
    return problems


def _target_server_problems(
    server: TargetServerPlan, dtype_rule: _Rule, path_rule: _Rule
) -> Iterator[str]:
    """The served target's values: the recipe's rules, each URL's form, the derived ids."""
    from dflash_recipes.plan.target_server_settings import server_url_problem

    yield from _check_section("target_server", server, _section_rules(server, TargetServerSection))
    for index, url in enumerate(server.urls):
        why = server_url_problem(url) if isinstance(url, str) else "is not a string"
        if why is not None:
            yield f"target_server.urls.{index}: {shorten(url)} {why}"
    yield from _run("target_server.dtype", dtype_rule, server.dtype, "dtype")
    yield from _run(
        "target_server.max_model_len", _MODEL_LEN, server.max_model_len, "max_model_len"
    )
    ids = server.vllm_layer_ids
    yield from _run(
        "target_server.vllm_layer_ids", _LAYER_IDS, ids, "vllm_layer_ids", optional=True
    )
    rows = len(ids) if ids is not None else 0
    final = () if server.final_row is None else (server.final_row,)
    for row in (*(server.tap_rows or ()), *final):
        if not 0 <= row < rows:
            yield f"target_server: row {row} is not on the file's layer axis of {rows} ids"


__all__ = ["plan_value_problems"]
