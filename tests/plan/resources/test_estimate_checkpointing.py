"""Activation checkpointing in the resource plan: each draft layer keeps only its input, plus
one layer's activations while its backward recomputes it, and the advice names it when it makes
a plan fit (issue 51)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from testkit.fixture_8b import make_fixture, seed_8b_plan

from dflash_recipes.compiler.resource_report import render_resources
from dflash_recipes.plan.resources.estimate import estimate_resources
from dflash_recipes.plan.resources.fit import exceed_message, fit_advice
from dflash_recipes.plan.run_plan import RunPlan

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_8b_checkpointing")
    make_fixture(out, target_weights=True)
    return out


def _plan(fixture: Path, *extra: str) -> RunPlan:
    return seed_8b_plan(fixture, *extra)


def _layers(plan: RunPlan, count: int) -> RunPlan:
    arch = attrs.evolve(plan.draft.architecture, num_hidden_layers=count)
    return attrs.evolve(plan, draft=attrs.evolve(plan.draft, architecture=arch))


def test_checkpointed_layers_keep_only_their_inputs_plus_one_layer(qwen3_8b: Path) -> None:
    plain = _plan(qwen3_8b)
    recomputed = _plan(qwen3_8b, "training.activation_checkpointing=true")
    assert recomputed.training.activation_checkpointing
    layers = plain.draft.architecture.num_hidden_layers
    assert layers is not None and layers > 1
    off = estimate_resources(plain, device="cpu")
    on = estimate_resources(recomputed, device="cpu")
    assert on.activation_parts.drafter_saved < off.activation_parts.drafter_saved
    assert on.memory.activations < off.memory.activations
    # one layer's attention (the layer being recomputed), not every layer's
    assert on.activation_parts.attention * layers == off.activation_parts.attention
    # each further layer adds only its input: [B, Q, H] in the master dtype (float32 here)
    facts = plain.base_model.facts
    assert facts is not None
    b, anchors = plain.training.per_device_train_batch_size, plain.draft.objective.num_anchors
    layer_input = b * anchors * plain.draft.block_size * facts.hidden_size * 4
    more = estimate_resources(_layers(recomputed, 2 * layers), device="cpu")
    assert more.activation_parts.drafter_saved - on.activation_parts.drafter_saved == (
        layers * layer_input
    )
    # without it each further layer adds everything it saves
    more_off = estimate_resources(_layers(plain, 2 * layers), device="cpu")
    grown = more_off.activation_parts.drafter_saved - off.activation_parts.drafter_saved
    assert grown > 10 * layers * layer_input
    # the price: the layers' forward once more
    assert on.step.drafter_flops > off.step.drafter_flops
    assert on.to_dict()["activation_checkpointing"] is True
    assert "draft layers recomputed (activation_checkpointing)" in render_resources(on)


def test_the_advice_names_activation_checkpointing_when_it_makes_the_plan_fit(
    qwen3_8b: Path,
) -> None:
    plan = _plan(qwen3_8b, "dflash.dflash_num_anchors=2048")
    off = estimate_resources(plan)
    on = estimate_resources(
        _plan(qwen3_8b, "dflash.dflash_num_anchors=2048", "training.activation_checkpointing=true")
    )
    device = (off.memory.total + on.memory.total) // 2
    advice = fit_advice(plan, device, world_size=1)
    assert advice.activation_checkpointing_fits is True
    _, hint = exceed_message(plan, off, device, advice, where="--device-memory X")
    assert "training.activation_checkpointing: true" in hint
    # already on: not searched, not named
    already = _plan(
        qwen3_8b, "dflash.dflash_num_anchors=4096", "training.activation_checkpointing=true"
    )
    resources = estimate_resources(already)
    small = resources.memory.total - 1
    kept = fit_advice(already, small, world_size=1)
    assert kept.activation_checkpointing_fits is None
    _, hint = exceed_message(already, resources, small, kept, where="--device-memory X")
    assert "activation_checkpointing" not in hint
    # too small even with it: not named as a fix
    tight = on.memory.total - 1
    none = fit_advice(plan, tight, world_size=1)
    assert none.activation_checkpointing_fits is False
    _, hint = exceed_message(plan, off, tight, none, where="--device-memory X")
    assert "training.activation_checkpointing: true" not in hint
