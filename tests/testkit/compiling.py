"""Compiling a recipe in tmp_path and picking diagnostics out of the result, for tests."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dflash_recipes.compiler.compilation import CompileResult, compile_file, compile_recipe
from dflash_recipes.diagnostics import Diagnostic, Severity, registered_codes
from dflash_recipes.files.run_dir import CHECKPOINT_FILES, PLAN_FILE, checkpoint_dir_name
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.recipe.sections import Recipe

#: The shipped from-scratch recipe of the embedded tiny target.
TINY_SCRATCH = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "tiny_scratch.yaml"
#: A batch of two sequences with four blocks of four each: what keeps a run of that recipe small.
SMALL_BLOCKS = (
    "training.per_device_train_batch_size=2",
    "dflash.dflash_num_anchors=4",
    "dflash.dflash_block_size=4",
)
#: What keeps a training test on that recipe small: short sequences, few small blocks.
SMALL_RUN = (*SMALL_BLOCKS, "training.training_seq_len=64", "training.logging_steps=1")

#: The type of conftest's `make_recipe` fixture.
RecipeFactory = Callable[..., Recipe]


def compile_in(tmp_path: Path, recipe: Recipe) -> CompileResult:
    """Compile against tmp_path, checking what every diagnostic must carry."""
    registered = {info.code: info.severity for info in registered_codes()}
    result = compile_recipe(recipe, base_dir=tmp_path)
    for d in result.diagnostics:
        assert registered.get(d.code) is d.severity, d
        assert d.path and d.message and d.hint, d
    assert (result.plan is None) == any(d.severity is Severity.ERROR for d in result.diagnostics)
    return result


def tiny_scratch_plan(output_dir: Path, *overrides: str) -> RunPlan:
    """The tiny from-scratch recipe compiled small (:data:`SMALL_RUN`), then `overrides`."""
    result = compile_file(
        TINY_SCRATCH, overrides=(f"training.output_dir={output_dir}", *SMALL_RUN, *overrides)
    )
    assert result.plan is not None, [str(d) for d in result.diagnostics]
    return result.plan


def only(result: CompileResult, code: str) -> Diagnostic:
    """The one diagnostic with `code` (fails listing every code and message otherwise)."""
    found = [d for d in result.diagnostics if d.code == code]
    assert len(found) == 1, (code, [(d.code, d.message) for d in result.diagnostics])
    return found[0]


def codes(result: CompileResult) -> set[str]:
    return {d.code for d in result.diagnostics}


def text(d: Diagnostic) -> str:
    """What a user reads of a diagnostic: its message and its hint."""
    return f"{d.message}\n{d.hint}"


def make_training_checkpoint(output_dir: Path, step: int, *, complete: bool = True) -> Path:
    """A checkpoint folder of a previous run (placeholder files; the last one left out)."""
    folder = output_dir / checkpoint_dir_name(step)
    folder.mkdir(parents=True)
    for name in CHECKPOINT_FILES if complete else CHECKPOINT_FILES[:-1]:
        (folder / name).write_bytes(b"x")
    return folder


def recompile_after_checkpoint_without_drafter(
    tmp_path: Path, recipe: Recipe, drafter: Path
) -> CompileResult:
    """Compile `recipe`, let a run reach step 10 with that plan, delete the init checkpoint
    `drafter`, and compile again: the resume that must take what it needs from the plan."""
    first = compile_in(tmp_path, recipe)
    assert first.plan is not None
    output_dir = tmp_path / "outputs" / "dflash"
    make_training_checkpoint(output_dir, 10)
    (output_dir / PLAN_FILE).write_text(first.plan.to_json(), encoding="utf-8")
    shutil.rmtree(drafter)
    return compile_in(tmp_path, recipe)


def tiny_served_recipe(
    path: Path,
    urls: Sequence[str] | None,
    storage: Path,
    *,
    target: Path | None = None,
    settings: Mapping[str, object] | None = None,
) -> Path:
    """The tiny from-scratch recipe written to `path` with its paths made absolute (the demo
    target replaced by `target`), and a target_server section of `urls`, `storage` and
    `settings` (no section when `urls` is None); returns `path`."""
    repo = TINY_SCRATCH.parents[2]
    text = TINY_SCRATCH.read_text(encoding="utf-8").replace("../../", f"{repo}/")
    if target is not None:
        text = text.replace(f"{repo}/dflash_recipes/demo_data/target", str(target))
    if urls is not None:
        lines = [f"urls: [{', '.join(urls)}]", f"storage_dir: {storage}"]
        lines += [f"{key}: {value}" for key, value in (settings or {}).items()]
        text += "target_server:\n" + "".join(f"  {line}\n" for line in lines)
    path.write_text(text, encoding="utf-8")
    return path
