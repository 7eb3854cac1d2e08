"""What would fit (plan/resources/fit.py): a bfloat16 master named when it alone fits, and the
settings that fit together named in order when no single one does (issue 51)."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.fixture_8b import make_fixture, seed_8b_plan

from dflash_recipes.plan.resources.estimate import GIB, estimate_resources
from dflash_recipes.plan.resources.fit import exceed_message, fit_advice

LONG = ("training.training_seq_len=32768", "dflash.dflash_num_anchors=2048")


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_8b_fit")
    make_fixture(out, target_weights=True)
    return out


def test_a_bfloat16_master_is_advised_when_it_alone_fits(qwen3_8b: Path) -> None:
    plan = seed_8b_plan(qwen3_8b)
    f32 = estimate_resources(plan).memory.total
    bf16 = estimate_resources(seed_8b_plan(qwen3_8b, "training.drafter_master_dtype=bfloat16"))
    device = (f32 + bf16.memory.total) // 2
    advice = fit_advice(plan, device, world_size=1)
    assert advice.bfloat16_master_fits is True and advice.together == ()
    _, hint = exceed_message(plan, estimate_resources(plan), device, advice, where="here")
    assert "training.drafter_master_dtype: bfloat16" in hint
    already = seed_8b_plan(qwen3_8b, "training.drafter_master_dtype=bfloat16")
    assert fit_advice(already, device, world_size=1).bfloat16_master_fits is None


def test_the_settings_that_fit_together_are_named_in_order(qwen3_8b: Path) -> None:
    plan = seed_8b_plan(qwen3_8b, *LONG)
    advice = fit_advice(plan, 30 * GIB, world_size=8)
    assert advice.fsdp_fits is False and advice.activation_checkpointing_fits is False
    assert advice.together == ("training.fsdp: true", "training.activation_checkpointing: true")
    together = seed_8b_plan(
        qwen3_8b, *LONG, "training.fsdp=true", "training.activation_checkpointing=true"
    )
    assert estimate_resources(together, world_size=8).memory.total <= 30 * GIB
    resources = estimate_resources(plan, world_size=8)
    _, hint = exceed_message(plan, resources, 30 * GIB, advice, where="here")
    assert hint.startswith("no single change of")
    assert hint.endswith(
        "; these fit together: training.fsdp: true, training.activation_checkpointing: true"
    )
    # too small even for all of them: nothing is named
    assert fit_advice(plan, 25 * GIB, world_size=8).together == ()
    # one rank: sharding is not among them
    assert "training.fsdp: true" not in fit_advice(plan, 30 * GIB, world_size=1).together
