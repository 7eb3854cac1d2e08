"""The resource plan of a served target (``target_server``): the trainer holds no decoder layer."""

from __future__ import annotations

from pathlib import Path

from testkit.compiling import tiny_served_recipe

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.plan.resources.estimate import estimate_resources
from dflash_recipes.plan.run_plan import RunPlan


def _plan(tmp_path: Path, *, served: bool, eval_steps: str = "0") -> RunPlan:
    (tmp_path / "shm").mkdir(exist_ok=True)
    urls = ["http://127.0.0.1:8000"] if served else None
    recipe = tiny_served_recipe(tmp_path / f"recipe-{served}.yaml", urls, tmp_path / "shm")
    result = compile_file(
        recipe,
        overrides=(f"training.output_dir={tmp_path / 'run'}", f"training.eval_steps={eval_steps}"),
    )
    assert result.plan is not None, [str(d) for d in result.diagnostics]
    return result.plan


def test_a_served_target_is_counted_without_its_decoder_layers(tmp_path: Path) -> None:
    local = estimate_resources(_plan(tmp_path, served=False))
    served = estimate_resources(_plan(tmp_path, served=True))
    # the demo target (vocabulary 392, hidden 128, untied, float32): embeddings, lm_head, norm
    assert served.memory.target_weights == (2 * 392 * 128 + 128) * 4
    assert local.memory.target_weights > 10 * served.memory.target_weights
    # no target forward in the trainer: its phase holds only the step's inputs
    peak = served.activation_parts
    assert peak.target_forward_peak == peak.step_inputs
    assert peak.target_forward_peak < local.activation_parts.target_forward_peak


def test_a_measured_evaluation_brings_the_whole_target_back(tmp_path: Path) -> None:
    local = estimate_resources(_plan(tmp_path, served=False, eval_steps="30")).memory
    served = estimate_resources(_plan(tmp_path, served=True, eval_steps="30")).memory
    assert served.target_weights == local.target_weights  # speculative decoding runs it
