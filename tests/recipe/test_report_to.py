"""training.report_to, run_name and logging_dir at compile time: names checked, defaults
resolved into the plan, and no tracker library (nor torch) imported by the compile path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testkit.compiling import TINY_SCRATCH, only

from dflash_recipes.compiler.compilation import compile_file


def _compile(tmp_path: Path, *overrides: str):  # type: ignore[no-untyped-def]
    return compile_file(
        TINY_SCRATCH, overrides=(f"training.output_dir={tmp_path / 'run'}", *overrides)
    )


def test_an_unknown_tracker_is_a_compile_error_offering_the_closest_name(tmp_path: Path) -> None:
    result = _compile(tmp_path, "training.report_to=[tensorbord, mlflow]")
    assert not result.ok and result.plan is None
    found = only(result, "invalid-value")
    assert found.path == "training.report_to.0"
    assert found.message == "'tensorbord' is not one of tensorboard, mlflow, wandb"
    assert found.hint == "did you mean tensorboard?"


def test_a_tracker_named_twice_is_a_compile_error(tmp_path: Path) -> None:
    result = _compile(tmp_path, "training.report_to=[wandb, wandb]")
    found = only(result, "invalid-value")
    assert found.path == "training.report_to"
    assert "names 'wandb' twice" in found.message


def test_the_plan_carries_the_trackers_with_resolved_name_and_event_directory(
    tmp_path: Path,
) -> None:
    defaults = _compile(tmp_path).plan
    assert defaults is not None
    assert defaults.training.report_to == ()
    assert defaults.training.run_name == "run"  # the output directory's name
    assert defaults.training.logging_dir == str(tmp_path / "run" / "tensorboard")

    chosen = _compile(
        tmp_path,
        "training.report_to=[mlflow, tensorboard]",
        "training.run_name=drafter-a",
        f"training.logging_dir={tmp_path / 'tb'}",
    ).plan
    assert chosen is not None
    training = json.loads(chosen.to_json())["training"]
    assert training["report_to"] == ["mlflow", "tensorboard"]
    assert (training["run_name"], training["logging_dir"]) == ("drafter-a", str(tmp_path / "tb"))
    assert chosen.fingerprint != defaults.fingerprint


_SCRIPT = """
import json, sys
from dflash_recipes.compiler.compilation import compile_file
trackers = "training.report_to=[tensorboard,mlflow,wandb]"
result = compile_file(sys.argv[1], overrides=(sys.argv[2], trackers))
heavy = ("torch", "tensorboard", "mlflow", "wandb")
loaded = sorted(
    m for m in sys.modules
    if m.split(".")[0] in heavy or m.startswith("dflash_recipes.executor")
)
print(json.dumps({"ok": result.ok, "loaded": loaded}))
"""


def test_compiling_a_recipe_with_trackers_imports_neither_them_nor_torch(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(TINY_SCRATCH), f"training.output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(done.stdout) == {"ok": True, "loaded": []}
