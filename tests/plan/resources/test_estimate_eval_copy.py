"""Held-out evaluation's whole drafter copy in the resource plan (issue 51): under
``training.fsdp`` over several ranks every rank measures on an unsharded copy of the drafter
(``sharded_drafter.whole_drafter``), so the peak per rank is the larger of the training step and
that evaluation; the advice names what lowers an evaluation peak; and the copy the estimate
counts is what a rank allocates (measured on 2 gloo ranks)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import pytest
from testkit.cli_runner import cli
from testkit.llama_70b import write_llama_70b_recipe

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.plan.resources.estimate import GIB, estimate_resources, gib, sharded_numel
from dflash_recipes.plan.resources.fit import exceed_message, fit_advice
from dflash_recipes.plan.resources.rank_memory import EVAL_COPY, evaluates_whole_drafter
from dflash_recipes.plan.resources.target_dims import read_target_dims
from dflash_recipes.plan.run_plan import RunPlan

if TYPE_CHECKING:
    from testkit.memory_measure import Shape

TESTS = Path(__file__).resolve().parents[2]
#: Held-out evaluation every save_steps on 8 conversations held out of the training data.
EVAL = ("data.eval_holdout=8",)
#: A short-context run whose training step (40.28 GiB) fits 45 GiB and whose evaluation
#: (50.64 GiB) does not.
SHORT = ("training.training_seq_len=1024", "dflash.dflash_num_anchors=128")


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recipe written by `dflash-recipe init` for a Llama-3.3-70B config (no weights)."""
    return write_llama_70b_recipe(tmp_path_factory.mktemp("llama_70b_eval"))


def _plan(recipe: Path, *overrides: str) -> RunPlan:
    result = compile_file(recipe, overrides=overrides)
    assert result.plan is not None, [str(d) for d in result.diagnostics]
    return result.plan


def _compile(recipe: Path, *args: str) -> tuple[int, str]:
    result = cli("compile", str(recipe), *args, "-o", str(recipe.parent / "plan.json"))
    return result.exit_code, result.stderr


def test_the_copy_is_counted_only_under_fsdp_with_evaluation_on_several_ranks(
    llama_70b: Path,
) -> None:
    sharded = _plan(llama_70b, "training.fsdp=true", *EVAL)
    found = estimate_resources(sharded, world_size=8)
    assert found.eval_memory is not None and found.eval_parts is not None
    # the whole drafter in its float32 master dtype, on every rank
    assert found.eval_parts.drafter_copy == 4 * found.drafter_parameters
    assert found.eval_memory.eval_drafter_copy == found.eval_parts.drafter_copy
    bf16 = _plan(llama_70b, "training.fsdp=true", "training.drafter_master_dtype=bfloat16", *EVAL)
    bf16_parts = estimate_resources(bf16, world_size=8).eval_parts
    assert bf16_parts is not None and bf16_parts.drafter_copy == 2 * found.drafter_parameters
    for plan, ranks in (
        (sharded, 1),  # one rank: nothing is sharded, the drafter itself is measured
        (_plan(llama_70b, *EVAL), 8),  # DDP: rank 0 measures its own drafter
        (_plan(llama_70b, "training.fsdp=true", "training.eval_steps=100"), 8),  # no eval data
        (_plan(llama_70b, "training.fsdp=true", *EVAL, "training.eval_steps=0"), 8),  # never
    ):
        none = estimate_resources(plan, world_size=ranks)
        assert none.eval_memory is None and none.eval_parts is None, (ranks, plan.training)
        assert none.memory.eval_drafter_copy == 0
        assert none.memory == none.step_memory
        assert none.to_dict()["phases"] == {
            "training_step": none.memory.total,
            "held_out_eval": None,
        }
    # the final measurement training.eval_min_tau asks for evaluates too
    gate = attrs.evolve(sharded, training=attrs.evolve(sharded.training, eval_steps=None))
    assert not evaluates_whole_drafter(gate, drafter_sharded=True)
    gate = attrs.evolve(gate, training=attrs.evolve(gate.training, eval_min_tau=2.0))
    assert evaluates_whole_drafter(gate, drafter_sharded=True)
    assert not evaluates_whole_drafter(gate, drafter_sharded=False)


def test_evaluation_holds_what_training_left_with_the_copy(llama_70b: Path) -> None:
    plan = _plan(llama_70b, "training.fsdp=true", *EVAL)
    found = estimate_resources(plan, world_size=8)
    step, held, parts = found.step_memory, found.eval_memory, found.eval_parts
    assert step is not None and held is not None and parts is not None
    # weights and AdamW states as in training; the sharded gradients stay (set to None only at
    # the start of the next step)
    assert held.target_weights == step.target_weights
    assert held.drafter_weights == step.drafter_weights
    assert held.optimizer_states == step.optimizer_states
    assert held.gradients == found.gradient_bytes > 0
    # the sharded target's two gathered decoder layers (bf16) outweigh one tensor in flight
    dims = read_target_dims(llama_70b.parent / "base")
    layer = sum(math.prod(shape) for name, shape in dims.shapes.items() if ".layers.0." in name)
    assert layer > 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    assert parts.target_gathered == 2 * layer * 2
    facts = plan.base_model.facts
    assert facts is not None
    largest = max(
        sharded_numel(shape, 8) * 8
        for shape in ((facts.vocab_size, 8192), (8192, 5 * 8192), (28672, 8192))
    )
    assert parts.in_flight <= largest * 4
    assert held.activations == max(parts.in_flight, parts.target_gathered)
    assert held.allowance == 3 * GIB // 2 + int(0.10 * held.activations)
    assert held.total == sum(value for _, value in held.rows())
    assert (EVAL_COPY, parts.drafter_copy) in held.rows()
    assert EVAL_COPY not in dict(step.rows())


def test_the_peak_is_the_larger_phase(llama_70b: Path) -> None:
    # long sequences: the training step is the peak (57.07 GiB against evaluation's 50.64)
    long = estimate_resources(_plan(llama_70b, "training.fsdp=true", *EVAL), world_size=8)
    assert long.step_memory is not None and long.eval_memory is not None
    assert long.memory is long.step_memory
    assert gib(long.memory.total) == "57.07" and gib(long.eval_memory.total) == "50.64"
    # short ones: evaluation is
    short = estimate_resources(_plan(llama_70b, "training.fsdp=true", *EVAL, *SHORT), world_size=8)
    assert short.step_memory is not None and short.eval_memory is not None
    assert short.memory is short.eval_memory
    assert gib(short.step_memory.total) == "40.28" and gib(short.memory.total) == "50.64"
    assert short.memory.total == max(short.step_memory.total, short.eval_memory.total)
    phases = short.to_dict()["phases"]
    assert isinstance(phases, dict) and phases["training_step"] == short.step_memory.total
    assert phases["held_out_eval"]["total"] == short.memory.total
    per_rank = short.to_dict()["memory_per_rank"]
    assert isinstance(per_rank, dict)
    assert per_rank["eval_drafter_copy"] == 4 * short.drafter_parameters


def test_only_the_evaluation_peak_is_too_big_and_the_advice_says_what_lowers_it(
    llama_70b: Path,
) -> None:
    plan = _plan(llama_70b, "training.fsdp=true", *EVAL, *SHORT)
    found = estimate_resources(plan, world_size=8)
    device = 45 * GIB
    advice = fit_advice(plan, device, world_size=8)
    assert advice.without_eval_fits is True
    # no knob of the training step lowers evaluation's peak
    assert advice.num_anchors is None and advice.training_seq_len is None
    message, hint = exceed_message(plan, found, device, advice, where="--device-memory 45")
    assert "per rank on 8 rank(s) while it measures the held-out acceptance" in message
    assert "the training step needs 40.28 GiB" in message
    assert f"{EVAL_COPY} 17.19" in message
    assert "training.eval_steps: 0 (no held-out evaluation during training" in hint
    assert hint.endswith(
        "; or a device with at least 50.64 GiB per rank (evaluating less often or on fewer "
        "prompts is no fix: each measurement holds the whole 17.19 GiB copy)"
    )
    # docs/dflash.md quotes what compile prints
    code, err = _compile(
        llama_70b, "training.fsdp=true", *EVAL, *SHORT, "--world-size", "8", "--device-memory", "45"
    )
    assert code == 1
    docs = (TESTS.parent / "docs" / "dflash.md").read_text(encoding="utf-8")
    quoted = [line.replace(str(llama_70b), "llama70b.yaml") for line in err.splitlines()[:2]]
    assert quoted[0].startswith("llama70b.yaml: error[resources-exceed-device]")
    assert quoted[1].startswith("  fix: ")
    assert all(line in docs.splitlines() for line in quoted), quoted
    # a gate (training.eval_min_tau) needs a measurement: unset it with evaluation
    code, err = _compile(
        llama_70b,
        "training.fsdp=true",
        *EVAL,
        *SHORT,
        "training.eval_min_tau=2.0",
        "--world-size",
        "8",
        "--device-memory",
        "45",
    )
    assert code == 1
    assert "training.eval_steps: 0 with training.eval_min_tau: null (no held-out" in err
    # where the training step does not fit either, turning evaluation off is no fix
    tight = fit_advice(plan, 40 * GIB, world_size=8)
    assert tight.without_eval_fits is False
    _, hint = exceed_message(plan, found, 40 * GIB, tight, where="--device-memory 40")
    assert "training.eval_steps: 0" not in hint
    assert "training.drafter_master_dtype: bfloat16" in hint  # half the copy: it fits
    # and the same recipe with evaluation off fits 45 GiB
    code, err = _compile(
        llama_70b,
        "training.fsdp=true",
        *EVAL,
        *SHORT,
        "training.eval_steps=0",
        "--world-size",
        "8",
        "--device-memory",
        "45",
    )
    assert code == 0, err


def test_settings_that_fit_together_turn_evaluation_off_last(llama_70b: Path) -> None:
    # DDP over 8 ranks with evaluation (219.74 GiB): sharding brings the copy (50.64), a
    # bfloat16 master halves it (37.75 with the rest), and on 37 GiB only evaluation off as
    # well fits (35.98)
    plan = _plan(llama_70b, *EVAL, *SHORT)
    advice = fit_advice(plan, 37 * GIB, world_size=8)
    assert advice.without_eval_fits is None  # not sharded: the plan itself holds no copy
    assert advice.together == (
        "training.fsdp: true",
        "training.activation_checkpointing: true",
        "training.drafter_master_dtype: bfloat16",
        "training.eval_steps: 0",
    )
    # 38 GiB takes it with evaluation
    assert fit_advice(plan, 38 * GIB, world_size=8).together[-1] != "training.eval_steps: 0"


@pytest.mark.slow
def test_the_copy_is_what_a_rank_allocates(tmp_path: Path) -> None:
    """2 gloo ranks at the tiny measurement shape: whole_drafter's parameters hold exactly the
    estimate's copy, and the peak while it is built is the copy plus at most one tensor."""
    from testkit.memory_measure import measurement_plan
    from testkit.ranks import run_ranks

    plan = measurement_plan(tmp_path, _tiny(), "training.fsdp=true")
    found = estimate_resources(plan, world_size=2, device="cpu")
    assert found.eval_parts is not None  # the tiny recipe evaluates
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, __file__, str(tmp_path)]
    for rank, done in enumerate(run_ranks(argv, env=env, what="the eval copy measurement")):
        assert done.returncode == 0, f"rank {rank} failed:\n{done.stdout}{done.stderr}"
    parts = found.eval_parts
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert measured["eval_copy_bytes"] == parts.drafter_copy, f"rank {rank}"
        assert parts.drafter_copy < measured["eval_copy_peak_bytes"], f"rank {rank}"
        assert measured["eval_copy_peak_bytes"] <= parts.drafter_copy + parts.in_flight


def test_compiles_table_shows_the_copy_when_evaluation_is_the_peak(llama_70b: Path) -> None:
    """The table compile prints names the copy and where the peak is, and its rows add up to
    its total; without an evaluation peak it has no such row."""
    code, err = _compile(
        llama_70b, "training.fsdp=true", *EVAL, *SHORT, "--world-size", "8", "--device-memory", "80"
    )
    assert code == 0, err
    assert "peak at held-out evaluation (training step 40.28 GiB)" in err
    rows = {}
    for line in err.splitlines():
        name, _, value = line.strip().rpartition(" ")
        if name and value.replace(".", "", 1).isdigit():
            rows[name.strip()] = float(value)
    assert rows[EVAL_COPY] == pytest.approx(17.19)
    total = rows.pop("total")
    assert total == pytest.approx(50.64)
    assert sum(rows.values()) == pytest.approx(total, abs=0.05)  # each row rounded to 0.01
    code, err = _compile(llama_70b, "training.fsdp=true", *SHORT, "--world-size", "8")
    assert code == 0, err
    assert EVAL_COPY not in err and "peak at held-out evaluation" not in err


def _worker(folder: Path) -> None:
    from testkit.memory_measure import measure_sharded_rank

    measure_sharded_rank(folder, _tiny())


def _tiny() -> Shape:
    """bench_memory's tiny shape: seq 128, batch 2, 8 anchors, block 8, width 64."""
    from testkit.memory_measure import Shape

    return Shape(seq=128, batch=2, anchors=8, block=8, width=64, target_layers=8, heads=4)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
