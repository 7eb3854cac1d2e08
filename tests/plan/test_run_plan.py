"""The run plan: the fields it promises and bytes that are the same in every process."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from testkit.st_fixtures import base_model_config, write_base_model

from dflash_recipes.compiler.compilation import (
    compile_file,
)
from dflash_recipes.plan.run_plan import RunPlan


def test_plan_json_has_the_fields_the_cli_promises(
    tmp_path: Path,
    base_model: Path,
    drafter: Path,
    train_file: Path,
    recipe_text: Callable[..., str],
    write_recipe: Callable[..., Path],
) -> None:
    result = compile_file(write_recipe(recipe_text()))
    assert result.ok, result.diagnostics
    assert result.plan is not None
    data = json.loads(result.plan.to_json())
    assert re.fullmatch(r"[0-9a-f]{64}", data["fingerprint"])
    assert data["draft"]["block_size"] == 16
    assert data["draft"]["mask_token_id"] == 250
    assert data["draft"]["target_layer_ids"] == [1, 5]
    assert data["init_checkpoint"]["path"] == str(drafter)
    assert data["base_model"]["facts"]["rope"]["rope_theta"] == 1_000_000.0
    assert data["recipe_file"] == str(tmp_path / "recipe.yaml")
    canonical = result.plan.canonical_json()
    assert data["fingerprint"] == hashlib.sha256(canonical).hexdigest()
    assert RunPlan.from_json(result.plan.to_json()) == result.plan


_DETERMINISM_SCRIPT = """
import sys
from dflash_recipes.compiler.compilation import compile_file
result = compile_file(sys.argv[1])
assert result.plan is not None, result.diagnostics
sys.stdout.buffer.write(result.plan.canonical_json())
"""


def test_plan_bytes_are_identical_across_processes_and_hash_seeds(
    tmp_path: Path,
    drafter: Path,
    train_file: Path,
    recipe_text: Callable[..., str],
    write_recipe: Callable[..., Path],
) -> None:
    config = base_model_config()
    config["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "attention_factor": None,
    }
    write_base_model(tmp_path / "base", config=config)
    path = write_recipe(
        recipe_text(arch={"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8})
    )
    outputs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", _DETERMINISM_SCRIPT, str(path)],
            capture_output=True,
            env=env,
            check=True,
            timeout=120,
        )
        outputs.append(done.stdout)
    in_process = compile_file(path).plan
    assert in_process is not None
    assert outputs[0] == outputs[1] == in_process.canonical_json()
    assert b'"heads_from_scratch":["prefix_gru","embed_proj"]' in outputs[0]
