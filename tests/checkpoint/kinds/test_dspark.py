"""DSpark's torch-free half: its tensors by head kind, the teacher rule, checks, init fields."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from dflash_recipes.checkpoint.kinds.alignment import FIELD_DIFFERS
from dflash_recipes.checkpoint.kinds.dspark import FACTS
from dflash_recipes.checkpoint.kinds.protocol import ObjectiveTerms
from dflash_recipes.checkpoint.tensor_layout import LayoutSpec, expected_layout, head_submodules
from dflash_recipes.recipe.sections import DFlashArchitectureConfig

RECIPE = DFlashArchitectureConfig(projector_type="dspark", markov_rank=16)


def _spec(**changes: Any) -> LayoutSpec:
    fields: dict[str, Any] = {
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "n_taps": 2,
        "vocab_size": 256,
        "projector_type": "dspark",
        "markov_rank": 16,
        **changes,
    }
    return LayoutSpec(**fields)


def test_dspark_head_tensors_with_and_without_confidence() -> None:
    spec = _spec()
    layout = expected_layout(spec)
    assert layout["markov_w1.weight"] == (256, 16)
    assert layout["markov_w2.weight"] == (256, 16)
    assert "confidence_proj.weight" not in layout
    assert head_submodules(spec) == {
        "markov_w1": ("markov_w1.weight",),
        "markov_w2": ("markov_w2.weight",),
    }
    confident = expected_layout(_spec(use_confidence_head=True))
    assert confident["confidence_proj.weight"] == (1, 48)
    assert confident["confidence_proj.bias"] == (1,)
    assert FACTS.infer_dims(confident) == {"vocab_size": 256, "markov_rank": 16}


@pytest.mark.parametrize(
    ("kind", "added"),
    [
        ("vanilla", {}),
        ("gated", {"gate_proj.weight": (16, 48), "gate_proj.bias": (16,)}),
        ("rnn", {"joint_proj.weight": (48, 64), "joint_proj.bias": (48,)}),
    ],
)
def test_each_markov_head_kind_adds_its_projection(
    kind: str, added: dict[str, tuple[int, ...]]
) -> None:
    layout = FACTS.layout(_spec(markov_head_type=kind))
    assert {n: s for n, s in layout.items() if not n.startswith("markov_w")} == added


def test_the_tv_term_needs_the_teacher_only_with_a_weight() -> None:
    assert FACTS.needs_teacher(ObjectiveTerms(self_logit_distillation=False, dspark_tv_weight=0.1))
    assert not FACTS.needs_teacher(
        ObjectiveTerms(self_logit_distillation=True, dspark_tv_weight=0.0)
    )


def test_a_checkpoints_other_known_head_kind_warns_and_an_unknown_one_is_left_to_refusals() -> None:
    (finding,) = FACTS.checkpoint_findings({"markov_head_type": "gated"}, RECIPE)
    assert (finding.code, finding.field) == (FIELD_DIFFERS, "markov_head_type")
    assert "the checkpoint's DSpark head is gated, the recipe's markov_head_type is vanilla" in (
        finding.message
    )
    assert FACTS.checkpoint_findings({"markov_head_type": "lstm"}, RECIPE) == []
    assert FACTS.checkpoint_findings({"markov_head_type": "vanilla"}, RECIPE) == []


@attrs.frozen
class _Stated:
    use_confidence_head: bool | None


def test_init_writes_the_confidence_head_when_the_checkpoint_has_it() -> None:
    because = {"use_confidence_head": (True, "the checkpoint has confidence_proj")}
    assert FACTS.starter_fields(_Stated(None), {"confidence_proj.weight"}) == because
    assert FACTS.starter_fields(_Stated(True), set()) == because
    assert FACTS.starter_fields(_Stated(False), {"markov_w1.weight"}) == {}


def test_describe_names_the_head_kind_and_the_confidence_head() -> None:
    assert FACTS.describe(RECIPE) == "dspark vanilla (shift_label true)"
    confident = attrs.evolve(
        RECIPE, markov_head_type="rnn", shift_label=False, use_confidence_head=True
    )
    assert FACTS.describe(confident) == "dspark rnn (shift_label false, confidence head)"
