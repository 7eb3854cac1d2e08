"""The label alignment rules every head kind with ``shift_label`` shares (Domino, DSpark).

A head checkpoint's ``dflash_config.shift_label`` says how its block positions were trained:
true, position k predicts anchor + k + 1 (ModelOpt's labels, SGLang); false, anchor + k
(earlier dflash-recipes exports). The compiler compares it with the recipe
(:func:`shift_label_findings`); loading the weights says what the checkpoint was trained for
(:func:`trained_for_note`). A kind adds its own alignment fields through `detail` (Domino's
uncorrected prefix).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from dflash_recipes.checkpoint.config_fields import _DC
from dflash_recipes.checkpoint.kinds.protocol import AlignmentSettings, KindFinding
from dflash_recipes.records import Record

#: The compiler's codes for these findings (registered in compiler/field_checks.py).
FIELD_DIFFERS = "checkpoint-field-differs"
TRAINED_FOR = "checkpoint-trained-for"


@attrs.frozen(repr=False, eq=False, slots=False)
class TrainedDetail(Record):
    """A kind's own alignment field as the checkpoint states it (Domino's prefix)."""

    #: The dflash_config field and recipe field (same name).
    field: str
    #: What the checkpoint states, and what the plan drafts with.
    value: int
    planned: int


def stated_int(nested: Mapping[str, object], key: str) -> int | None:
    """``dflash_config[key]`` when it is an integer (not a bool), else None."""
    value = nested.get(key)
    return value if type(value) is int else None


def _stated_shift(nested: Mapping[str, object]) -> bool | None:
    value = nested.get("shift_label")
    return value if type(value) is bool else None


def _bool(value: bool) -> str:
    return "true" if value else "false"


def shift_label_findings(
    kind: str,
    nested: Mapping[str, object],
    recipe: AlignmentSettings,
    *,
    corrects_every_proposal: bool = False,
) -> list[KindFinding]:
    """What a head checkpoint's ``shift_label`` says against the recipe's.

    An info when it was trained with shift_label false (an earlier export; with
    `corrects_every_proposal` it was a Domino head with pure_draft_prefix_len 0), a warning
    when the recipe trains the other alignment.
    """
    said = _stated_shift(nested)
    findings: list[KindFinding] = []
    if said is False:
        trained = "position k predicts the token at anchor + k, position 0 unscored"
        if corrects_every_proposal:
            trained += ", every proposal corrected (pure_draft_prefix_len 0)"
        findings.append(
            KindFinding(
                TRAINED_FOR,
                "shift_label",
                f"the checkpoint's {kind} head was trained with shift_label false ({trained}), "
                "as earlier dflash-recipes exports were",
                "set dflash_architecture_config.shift_label: false"
                + (", pure_draft_prefix_len: 0" if corrects_every_proposal else "")
                + " to keep training it as it was trained; true (the default) retrains it "
                "with next-token labels as ModelOpt and SGLang use them",
            )
        )
    if said is not None and said != recipe.shift_label:
        theirs = "anchor + k + 1" if said else "anchor + k"
        mine = "anchor + k + 1" if recipe.shift_label else "anchor + k"
        findings.append(
            KindFinding(
                FIELD_DIFFERS,
                "shift_label",
                f"`{_DC}shift_label: {_bool(said)}`: the checkpoint's head predicts {theirs} at "
                f"block position k; the recipe's shift_label {_bool(recipe.shift_label)} trains "
                f"{mine}, so the warm-started head starts misaligned",
                f"set dflash_architecture_config.shift_label: {_bool(said)} to train the "
                "checkpoint's alignment, unless retraining it is intended",
            )
        )
    return findings


def trained_for_note(
    where: str,
    nested: Mapping[str, object],
    draft: AlignmentSettings,
    description: str,
    *,
    detail: TrainedDetail | None = None,
) -> tuple[str, bool] | None:
    """(one line, whether the plan differs) for a head checkpoint `where` whose config.json
    says ``shift_label`` false or another alignment than `draft` (drafting as `description`);
    None when it states none, or the alignment the plan drafts with ModelOpt's labels."""
    shift = _stated_shift(nested)
    if shift is None:
        return None
    differs = shift != draft.shift_label or (detail is not None and detail.value != detail.planned)
    if shift and not differs:
        return None
    target = "anchor + k + 1" if shift else "anchor + k"
    trained = f"shift_label {_bool(shift)} (block position k predicts {target}"
    trained += f", {detail.field} {detail.value})" if detail is not None else ")"
    if not shift:
        trained += ", as earlier dflash-recipes exports were"
    if differs:
        fix = f"set dflash_architecture_config.shift_label: {_bool(shift)}"
        if detail is not None:
            fix += f" and {detail.field}: {detail.value}"
        return (
            f"note: {where} was trained for {trained}; the plan drafts it as {description}, "
            f"which it was not trained for: {fix} to use it as trained",
            True,
        )
    return f"note: {where} was trained for {trained}; the plan drafts it so", False


__all__ = [
    "FIELD_DIFFERS",
    "TRAINED_FOR",
    "TrainedDetail",
    "shift_label_findings",
    "stated_int",
    "trained_for_note",
]
