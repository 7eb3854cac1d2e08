"""The drafter-kind registry, torch-free: one kind per projector type, and the rules it owns."""

from __future__ import annotations

import ast
from pathlib import Path

import attrs
import pytest

from dflash_recipes.checkpoint.kinds import alignment, dflash2, domino
from dflash_recipes.checkpoint.kinds.protocol import ObjectiveTerms
from dflash_recipes.checkpoint.kinds.registry import (
    HEAD_FIELD_OWNERS,
    HEAD_FIELDS,
    KIND_FIELD_OWNERS,
    KINDS,
    kind_facts,
    kind_from_tensors,
    needs_teacher,
)
from dflash_recipes.diagnostics import Severity, code_severity
from dflash_recipes.plan.run_plan import ObjectivePlan
from dflash_recipes.recipe.choices import PROJECTOR_TYPES
from dflash_recipes.recipe.sections import DFlashArchitectureConfig

PACKAGE = Path(__file__).resolve().parents[3] / "dflash_recipes"


def test_the_registry_holds_exactly_the_recipes_projector_types_in_order() -> None:
    assert tuple(KINDS) == PROJECTOR_TYPES
    assert all(kind.name == name for name, kind in KINDS.items())


def test_an_unknown_projector_type_names_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match="projector_type must be one of dflash, domino, dspark, dflash2"
    ):
        kind_facts("medusa")


@pytest.mark.parametrize("name", PROJECTOR_TYPES)
def test_each_kind_module_and_its_torch_half_point_at_each_other(name: str) -> None:
    # a newcomer who finds one half of a kind finds the other by name, from either docstring
    free = PACKAGE / "checkpoint" / "kinds" / f"{name}.py"
    torch_half = PACKAGE / "executor" / "kinds" / f"{name}.py"
    for here, there in ((free, torch_half), (torch_half, free)):
        doc = ast.get_docstring(ast.parse(here.read_text(encoding="utf-8"))) or ""
        dotted = ".".join(there.relative_to(PACKAGE.parent).with_suffix("").parts)
        assert dotted in " ".join(doc.split()).replace(". ", "."), (here, dotted)


def _objective(*, distill: bool = False, tv: float = 0.0) -> ObjectiveTerms:
    return ObjectiveTerms(self_logit_distillation=distill, dspark_tv_weight=tv)


def test_teacher_is_needed_by_self_distillation_and_by_dspark_with_a_tv_weight() -> None:
    assert needs_teacher("dflash", _objective(distill=True))
    assert needs_teacher("domino", _objective(distill=True))
    assert needs_teacher("dspark", _objective(tv=0.5))
    assert not needs_teacher("dspark", _objective())
    assert not needs_teacher("dflash", _objective(tv=0.5))
    assert not needs_teacher("domino", _objective(tv=0.5))


def test_a_plans_objective_is_asked_the_same_question() -> None:
    objective = ObjectivePlan(
        num_anchors=8,
        loss_objective="decay",
        loss_decay_factor=7.0,
        dpace_alpha=0.5,
        self_logit_distillation=False,
        domino_backbone_loss_weight=1.0,
        dspark_tv_weight=1.0,
        dspark_confidence_weight=0.1,
    )
    assert needs_teacher("dspark", objective)
    assert not needs_teacher("dspark", attrs.evolve(objective, dspark_tv_weight=0.0))
    assert needs_teacher("dflash", attrs.evolve(objective, self_logit_distillation=True))


def test_a_checkpoints_kind_is_read_from_its_marker_tensors() -> None:
    assert kind_from_tensors(["fc.weight", "prefix_gru.weight_ih_l0"]) == "domino"
    assert kind_from_tensors(["fc.weight", "embed_proj.2.weight"]) == "domino"
    assert kind_from_tensors(["fc.weight", "markov_w2.weight"]) == "dspark"
    assert kind_from_tensors(["fc.weight", "norm.weight"]) == "dflash"
    assert kind_from_tensors([]) == "dflash"


def test_field_tables_are_derived_from_the_kinds() -> None:
    assert HEAD_FIELDS == {
        "dflash": (),
        "domino": ("emb_dim", "gru_hidden_dim"),
        "dspark": ("markov_rank",),
        "dflash2": (),
    }
    assert HEAD_FIELD_OWNERS == {
        "emb_dim": "domino",
        "gru_hidden_dim": "domino",
        "markov_rank": "dspark",
    }
    # switches a kind alone reads warn when set for another kind, after the head sizes, then
    # the fields a checkpoint of the kind may give (DFlash 2's)
    assert list(KIND_FIELD_OWNERS) == [
        *HEAD_FIELD_OWNERS,
        "use_confidence_head",
        *dflash2.FACTS.inherited_fields,
    ]
    assert KIND_FIELD_OWNERS["use_confidence_head"] == "dspark"
    assert KIND_FIELD_OWNERS["selector_top_k"] == "dflash2"
    fields = attrs.fields_dict(DFlashArchitectureConfig)
    assert set(KIND_FIELD_OWNERS) <= set(fields), "a kind field the recipe cannot set"


def test_the_codes_kind_findings_carry_are_the_compilers() -> None:
    from dflash_recipes.compiler import codes, field_checks

    assert alignment.FIELD_DIFFERS == field_checks.CHECKPOINT_FIELD_DIFFERS
    assert alignment.TRAINED_FOR == field_checks.CHECKPOINT_TRAINED_FOR
    assert domino.PURE_DRAFT_PREFIX_RANGE == codes.PURE_DRAFT_PREFIX_RANGE
    assert code_severity(domino.PURE_DRAFT_PREFIX_RANGE) is Severity.ERROR
    assert dflash2.DFLASH2_NOT_YET == codes.DFLASH2_NOT_YET
    assert dflash2.DFLASH2_SETTING_INVALID == codes.DFLASH2_SETTING_INVALID
    assert field_checks.CHECKPOINT_CAUSAL_UNSTATED == codes.CHECKPOINT_CAUSAL_UNSTATED
    for code in (dflash2.DFLASH2_NOT_YET, dflash2.DFLASH2_SETTING_INVALID):
        assert code_severity(code) is Severity.ERROR
