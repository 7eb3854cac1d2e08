"""The resource plan with the drafter sharded (issue 51): under ``training.fsdp`` over several
ranks the drafter's weights, gradients and AdamW states divide by the world size, FSDP2's
gathered parameters and unsharded gradients are counted, autocast makes no weight copies, the
host holds no full target per process, and the advice names the settings that fit: a
Llama-3.3-70B recipe made by ``init`` fits 8 x 80 GiB with ``training.fsdp: true``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from testkit.cli_runner import cli
from testkit.fixture_8b import make_fixture, seed_8b_plan
from testkit.llama_70b import write_llama_70b_recipe

from dflash_recipes.checkpoint.tensor_layout import expected_layout, layout_spec_for
from dflash_recipes.compiler.codes import RESOURCES_EXCEED_DEVICE
from dflash_recipes.plan.resources.estimate import estimate_resources, sharded_numel
from dflash_recipes.plan.run_plan import RunPlan


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_8b_sharded")
    make_fixture(out, target_weights=True)
    return out


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recipe written by `dflash-recipe init` for a Llama-3.3-70B config (no weights)."""
    return write_llama_70b_recipe(tmp_path_factory.mktemp("llama_70b"))


def _compile(recipe: Path, *args: str) -> tuple[int, str]:
    """`dflash-recipe compile RECIPE ARGS -o plan.json`: the exit code and stderr."""
    result = cli("compile", str(recipe), *args, "-o", str(recipe.parent / "plan.json"))
    return result.exit_code, result.stderr


def _layout_numels(plan: RunPlan) -> list[tuple[int, ...]]:
    facts, taps = plan.base_model.facts, plan.draft.target_layer_ids
    assert facts is not None and taps is not None
    spec = layout_spec_for(
        plan.draft.architecture,
        hidden_size=facts.hidden_size,
        n_taps=len(taps),
        vocab_size=facts.vocab_size,
    )
    return list(expected_layout(spec).values())


def test_the_drafter_its_gradients_and_adamw_states_divide_by_the_world_size(
    qwen3_8b: Path,
) -> None:
    plan = seed_8b_plan(qwen3_8b, "training.fsdp=true")
    shapes = _layout_numels(plan)
    local = sum(sharded_numel(shape, 8) for shape in shapes)
    whole = sum(math.prod(shape) for shape in shapes)
    sharded = estimate_resources(plan, world_size=8)
    ddp = estimate_resources(seed_8b_plan(qwen3_8b), world_size=8)
    assert sharded.drafter_sharded and not ddp.drafter_sharded
    assert sharded.memory.drafter_weights == 4 * local < 4 * whole // 7
    assert sharded.memory.optimizer_states == 8 * local + 4 * len(shapes)
    assert sharded.gradient_bytes == 4 * local
    assert ddp.memory.drafter_weights == 4 * whole
    # no DDP buckets: at most this rank's gradients, where DDP holds a whole copy all step
    assert sharded.memory.gradients <= sharded.gradient_bytes < ddp.memory.gradients
    # FSDP2 gathers the root's parameters (fc, the norms) and two of the five draft layers
    layers = plan.draft.architecture.num_hidden_layers
    assert layers == 5
    root = 4096 * 5 * 4096 + 2 * 4096  # fc, hidden_norm, norm
    one_layer = (whole - root) // layers
    assert sharded.activation_parts.fsdp_gathered == (root + 2 * one_layer) * 2  # bf16 on CUDA
    assert ddp.activation_parts.fsdp_gathered == 0
    assert sharded.memory.total < ddp.memory.total
    # one rank: nothing to shard
    assert not estimate_resources(plan, world_size=1).drafter_sharded


def test_gathered_parameters_compute_in_the_autocast_dtype_and_need_no_weight_copies(
    qwen3_8b: Path,
) -> None:
    plan = seed_8b_plan(qwen3_8b, "training.fsdp=true")
    cuda = estimate_resources(plan, world_size=8, device="cuda")
    cpu = estimate_resources(plan, world_size=8, device="cpu")
    # bfloat16 on CUDA (the mixed precision policy), the float32 master on the CPU
    assert cuda.activation_parts.fsdp_gathered * 2 == cpu.activation_parts.fsdp_gathered
    unsharded = estimate_resources(seed_8b_plan(qwen3_8b), world_size=8, device="cuda")
    whole = sum(math.prod(shape) for shape in _layout_numels(plan))
    # autocast's bfloat16 copies of the float32 master weights are gone
    saved_less = unsharded.activation_parts.drafter_saved - cuda.activation_parts.drafter_saved
    assert saved_less >= 2 * whole


def test_accumulated_micro_steps_keep_the_unsharded_gradients_in_float32(qwen3_8b: Path) -> None:
    plan = seed_8b_plan(qwen3_8b, "training.fsdp=true", "training.gradient_accumulation_steps=2")
    found = estimate_resources(plan, world_size=8, device="cpu")
    whole = sum(math.prod(shape) for shape in _layout_numels(plan))
    assert found.memory.gradients >= 4 * whole


def test_the_host_holds_no_full_target_per_process_under_fsdp(qwen3_8b: Path) -> None:
    whole_load = estimate_resources(seed_8b_plan(qwen3_8b), world_size=8).host_memory
    sharded_load = estimate_resources(
        seed_8b_plan(qwen3_8b, "training.fsdp=true"), world_size=8
    ).host_memory
    assert not whole_load.sharded_load and sharded_load.sharded_load
    assert whole_load.target == 16_381_470_720  # the target's bytes in bf16
    embeddings_and_head = 2 * 151936 * 4096 * 2 + 4096 * 2
    largest_layer_tensor = 12288 * 4096 * 2
    assert sharded_load.target == embeddings_and_head + largest_layer_tensor
    assert sharded_load.drafter == whole_load.drafter == 4 * 1_048_626_432
    # a sharded drafter is whole on rank 0 only; every other rank builds it on meta
    assert whole_load.drafter_other_ranks is None
    assert sharded_load.drafter_other_ranks == -(-4 * 1_048_626_432 // 8)
    # one process, fsdp or not, reads the whole target
    alone = estimate_resources(seed_8b_plan(qwen3_8b, "training.fsdp=true"), world_size=1)
    assert not alone.host_memory.sharded_load


def test_a_70b_recipe_from_init_fits_8_x_80_gib_with_fsdp(llama_70b: Path) -> None:
    code, err = _compile(llama_70b, "--world-size", "8", "--device-memory", "80")
    assert code == 1
    assert f"error[{RESOURCES_EXCEED_DEVICE}]" in err
    assert "any one of these fits (the others as planned): training.fsdp: true (over 8 ranks" in err
    code, err = _compile(
        llama_70b, "training.fsdp=true", "--world-size", "8", "--device-memory", "80"
    )
    assert code == 0, err
    assert "target and drafter sharded (fsdp)" in err
    assert "decoder layers read shard by shard" in err
    assert "built whole on rank 0 only, 2.15 on each other rank" in err
    total = next(line for line in err.splitlines() if line.strip().startswith("total"))
    assert float(total.split()[-1]) < 80


def test_a_long_context_70b_recipe_names_the_settings_that_fit_together(llama_70b: Path) -> None:
    long = ("training.training_seq_len=32768", "dflash.dflash_num_anchors=2048")
    code, err = _compile(llama_70b, *long, "--world-size", "8", "--device-memory", "80")
    assert code == 1
    assert "no single change of" in err and "or fsdp (over 8 ranks) fits" in err
    assert "these fit together: training.fsdp: true, training.activation_checkpointing: true" in err
    code, err = _compile(
        llama_70b,
        *long,
        "training.fsdp=true",
        "training.activation_checkpointing=true",
        "--world-size",
        "8",
        "--device-memory",
        "80",
    )
    assert code == 0, err


def test_the_json_carries_the_sharding_and_the_host_memory(qwen3_8b: Path) -> None:
    plan = seed_8b_plan(qwen3_8b, "training.fsdp=true")
    found = estimate_resources(plan, world_size=8).to_dict()
    assert found["drafter_sharded"] is True
    host = found["host_memory_per_rank"]
    assert isinstance(host, dict) and host["total"] == host["target"] + host["drafter"]
    parts = found["activations"]
    assert isinstance(parts, dict) and parts["fsdp_gathered"] > 0
