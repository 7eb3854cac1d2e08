"""A missing model folder's fix is the recipe header's own download step for it (issue 49;
recipe/headers.py finds it, CompileInputs.folder_fix uses it)."""

from __future__ import annotations

import shutil
from pathlib import Path

from testkit.compiling import only

from dflash_recipes.compiler.compilation import compile_file

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_the_fix_quotes_the_headers_step_for_that_folder(tmp_path: Path) -> None:
    recipe = RECIPES / "Qwen" / "Qwen3-8B" / "hf_online_dflash_finetune.yaml"
    assert not Path("/hf-local/Qwen/Qwen3-8B").exists()
    result = compile_file(recipe)
    base = only(result, "base-model-not-found")
    assert base.hint == (
        "stage it as the recipe's header says: "
        "hf download Qwen/Qwen3-8B --local-dir /hf-local/Qwen/Qwen3-8B"
    )
    init = only(result, "init-checkpoint-not-found")
    assert init.hint == (
        "stage it as the recipe's header says: "
        "hf download z-lab/Qwen3-8B-DFlash-b16 --local-dir /hf-local/z-lab/Qwen3-8B-DFlash-b16"
    )


def test_a_folder_the_header_does_not_stage_gets_the_plain_fix(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    shutil.copy(RECIPES / "Qwen" / "Qwen3-8B" / "hf_online_dflash_finetune.yaml", recipe)
    other = tmp_path / "elsewhere" / "Qwen3-8B"
    result = compile_file(recipe, overrides=(f"model.model_name_or_path={other}",))
    assert only(result, "base-model-not-found").hint == (
        f"check the path, or stage the base model there: hf download <repo> --local-dir {other}"
    )
