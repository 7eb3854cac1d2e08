"""training.output_dir may not hold a drafter export: the run would make it a run directory
that `dflash-recipe export` can never replace (issue 49)."""

from __future__ import annotations

import json
from pathlib import Path

from testkit.compiling import RecipeFactory, codes, compile_in, only
from testkit.st_fixtures import write_base_model, write_drafter_checkpoint

from dflash_recipes.files.export_target import EXPORT_MARKER, export_evidence


def _hint(folder: Path, reuse: str) -> str:
    return (
        f"point training.output_dir at a new directory (e.g. {folder}-run; the run exports into "
        f"its export/ folder); {reuse}"
    )


def test_an_export_folder_as_output_dir_is_refused_with_where_the_run_should_go(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    exported = write_drafter_checkpoint(tmp_path / "drafter-step5000")
    result = compile_in(tmp_path, make_recipe(training={"output_dir": "drafter-step5000"}))
    d = only(result, "output-dir-holds-export")
    assert result.plan is None
    assert d.path == "training.output_dir"
    assert d.message == (
        f"training.output_dir {exported} holds a drafter export (model.safetensors and a "
        "config.json of architectures DFlashDraftModel): the run would write its plan, "
        "checkpoints and metrics beside it, and `dflash-recipe export` would refuse that "
        "folder from then on as a run directory"
    )
    assert d.hint == _hint(
        exported, "to fine-tune that drafter, set dflash.dflash_init_checkpoint to it"
    )


def test_the_init_checkpoint_as_output_dir_is_refused(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(training={"output_dir": "drafter"}))
    d = only(result, "output-dir-holds-export")
    assert d.hint == _hint(drafter, "it stays the warm start (dflash.dflash_init_checkpoint)")


def test_what_counts_as_an_export(tmp_path: Path) -> None:
    marked = tmp_path / "marked"
    marked.mkdir()
    (marked / EXPORT_MARKER).write_text("{}", encoding="utf-8")
    assert export_evidence(marked) == f"its {EXPORT_MARKER}"
    # a sharded drafter with the files a run would add beside it: still an export
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    config = {"architectures": ["Qwen3ForCausalLM"], "dflash_config": {"mask_token_id": 3}}
    (sharded / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (sharded / "model.safetensors.index.json").write_text("{}", encoding="utf-8")
    (sharded / "plan.json").write_text("{}", encoding="utf-8")
    assert export_evidence(sharded) == (
        "model.safetensors.index.json and a config.json with a dflash_config"
    )
    dflash2 = write_drafter_checkpoint(tmp_path / "dflash2")
    config = json.loads((dflash2 / "config.json").read_text(encoding="utf-8"))
    config["architectures"] = ["DFlash2DraftModel"]
    (dflash2 / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert export_evidence(dflash2) == (
        "model.safetensors and a config.json of architectures DFlash2DraftModel"
    )
    # not an export: a base model, weights without a config, a config without weights,
    # a missing folder, a file
    base = write_base_model(tmp_path / "base")
    (base / "model.safetensors").write_bytes(b"x")
    assert export_evidence(base) is None
    (dflash2 / "config.json").unlink()
    assert export_evidence(dflash2) is None
    (sharded / "model.safetensors.index.json").unlink()
    assert export_evidence(sharded) is None
    assert export_evidence(tmp_path / "missing") is None
    assert export_evidence(marked / EXPORT_MARKER) is None


def test_a_finished_run_with_its_export_folder_still_resumes_and_compiles(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    run = tmp_path / "run"
    write_drafter_checkpoint(run / "export")  # the run's own export/, one level down
    result = compile_in(tmp_path, make_recipe(training={"output_dir": "run"}))
    assert result.plan is not None
    assert "output-dir-holds-export" not in codes(result)
