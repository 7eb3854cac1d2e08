"""The drafter kinds, torch-free, by ``projector_type``: the one registry of this half.

Adding a kind: its module beside this one (a :class:`~dflash_recipes.checkpoint.kinds.protocol.
KindFacts`), one entry in :data:`KINDS`, its name in ``recipe/choices.py``'s ``ProjectorType``,
and its torch half in ``dflash_recipes/executor/kinds/`` (registered there the same way).
The tables below are derived from the kinds; nothing else lists a kind's fields.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from dflash_recipes.checkpoint.kinds import dflash, dflash2, domino, dspark
from dflash_recipes.checkpoint.kinds.protocol import KindFacts, ObjectiveSettings

#: projector_type -> the kind's torch-free facts, in the recipe's order.
KINDS: Mapping[str, KindFacts] = {
    kind.name: kind
    for kind in (
        dflash.FACTS,
        domino.FACTS,
        dspark.FACTS,
        dflash2.FACTS,
    )
}

#: The family's name as serving engines and the Hub know it: vLLM's speculative ``method``,
#: SGLang's algorithm (upper case) and the tag every card carries, whatever the kind.
FAMILY = "dflash"

#: The head sizes each projector type needs (recipe names under dflash_architecture_config).
HEAD_FIELDS: Mapping[str, tuple[str, ...]] = {
    name: kind.head_fields for name, kind in KINDS.items()
}

#: Head size -> the projector type that uses it.
HEAD_FIELD_OWNERS: Mapping[str, str] = {
    field: name for name, kind in KINDS.items() for field in kind.head_fields
}

#: What each head size means, for messages.
HEAD_FIELD_MEANING: Mapping[str, str] = {
    field: meaning for kind in KINDS.values() for field, meaning in kind.field_meaning.items()
}

#: Every recipe field only one kind reads (head sizes, switches, then fields a checkpoint of
#: the kind may give) -> that kind.
KIND_FIELD_OWNERS: Mapping[str, str] = {
    **HEAD_FIELD_OWNERS,
    **{field: name for name, kind in KINDS.items() for field in kind.switch_fields},
    **{field: name for name, kind in KINDS.items() for field in kind.inherited_fields},
}


def kind_facts(projector_type: str) -> KindFacts:
    """The torch-free half of the kind `projector_type` names; ValueError for an unknown one."""
    kind = KINDS.get(projector_type)
    if kind is None:
        msg = f"projector_type must be one of {', '.join(KINDS)}, got {projector_type!r}"
        raise ValueError(msg)
    return kind


def needs_teacher(projector_type: str, objective: ObjectiveSettings) -> bool:
    """Whether the objective compares the drafter with the target's logits: the one rule.

    Self-distillation does for every kind; a kind's own terms may too (DSpark's TV term). The
    training step, capture, offline reading, the resource estimate and the compiler's capture
    checks all ask here.
    """
    return objective.self_logit_distillation or kind_facts(projector_type).needs_teacher(objective)


def kind_from_tensors(names: Collection[str]) -> str:
    """The kind whose marker tensors `names` holds (the first in :data:`KINDS` order), else
    plain ``dflash``: how ``dflash-recipe init`` reads a checkpoint that states no kind."""
    for name, kind in KINDS.items():
        if kind.marker_prefixes and any(n.startswith(kind.marker_prefixes) for n in names):
            return name
    return dflash.FACTS.name


__all__ = [
    "FAMILY",
    "HEAD_FIELDS",
    "HEAD_FIELD_MEANING",
    "HEAD_FIELD_OWNERS",
    "KINDS",
    "KIND_FIELD_OWNERS",
    "kind_facts",
    "kind_from_tensors",
    "needs_teacher",
]
