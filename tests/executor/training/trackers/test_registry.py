"""A tracker whose library is missing or broken is refused before anything trains (issue 36):
compile finds it missing without importing it, `run` checks again at start and imports it as
the tracker process would. Each case runs the real command in a subprocess whose Python cannot
import mlflow (a sitecustomize that blocks it, or a shadow package that fails), no check mocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.compiling import SMALL_RUN, TINY_SCRATCH, tiny_scratch_plan

from dflash_recipes.executor.training.trackers.registry import import_problem

#: A sitecustomize that makes mlflow look uninstalled: neither found nor importable.
BLOCK_MLFLOW = """
import importlib.abc, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mlflow" or name.startswith("mlflow."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""
PIP = "pip install 'dflash-recipes[mlflow]'"


def _env(extra_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dflash_recipes.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
        check=False,
    )


@pytest.fixture
def blocked(tmp_path: Path) -> Path:
    folder = tmp_path / "no-mlflow"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(BLOCK_MLFLOW, encoding="utf-8")
    return folder


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    folder = tmp_path / "broken-mlflow"
    (folder / "mlflow").mkdir(parents=True)
    (folder / "mlflow" / "__init__.py").write_text(
        'raise ImportError("this mlflow is broken: no module named mlflow.protos")\n',
        encoding="utf-8",
    )
    return folder


def _recipe_args(output_dir: Path) -> list[str]:
    return [
        str(TINY_SCRATCH),
        f"training.output_dir={output_dir}",
        "training.report_to=[mlflow]",
        *SMALL_RUN,
        "training.max_steps=2",
    ]


def test_compile_refuses_a_tracker_whose_library_is_not_installed(
    tmp_path: Path, blocked: Path
) -> None:
    done = _cli(
        "compile",
        *_recipe_args(tmp_path / "run"),
        "-o",
        "plan.json",
        env=_env(blocked),
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    assert (
        "error[tracker-library-missing] training.report_to: training.report_to names mlflow, but "
        f"the mlflow package is not installed in this Python ({sys.executable}): the run would "
        "train without tracking"
    ) in done.stderr
    assert f"fix: {PIP}, or remove mlflow from training.report_to" in done.stderr
    assert not (tmp_path / "plan.json").exists()


def test_run_of_a_compiled_plan_refuses_before_anything_trains(
    tmp_path: Path, blocked: Path
) -> None:
    # compiled where mlflow is installed, run where it is not
    plan = tiny_scratch_plan(
        tmp_path / "run", "training.report_to=[mlflow]", "training.max_steps=2"
    )
    (tmp_path / "plan.json").write_text(plan.to_json(), encoding="utf-8")
    done = _cli("run", "plan.json", env=_env(blocked), cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert (
        "error: training.report_to names mlflow, but the mlflow package is not installed: "
        f"{PIP} (or remove it from training.report_to)"
    ) in done.stderr
    run_dir = tmp_path / "run"
    assert not run_dir.exists() or not any(run_dir.iterdir())  # nothing trained, nothing written


def test_run_refuses_a_library_that_is_installed_but_fails_to_import(
    tmp_path: Path, broken: Path
) -> None:
    done = _cli("run", *_recipe_args(tmp_path / "run"), env=_env(broken), cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert (
        "error: training.report_to names mlflow, but importing mlflow fails: ImportError: this "
        f"mlflow is broken: no module named mlflow.protos: {PIP} (or remove it from "
        "training.report_to)"
    ) in done.stderr
    assert "step 1 " not in done.stderr
    run_dir = tmp_path / "run"
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_the_import_probe_passes_an_installed_library_and_names_a_missing_one() -> None:
    assert import_problem("json") is None
    problem = import_problem("no_such_module_for_dflash_tests")
    assert problem == (
        "importing no_such_module_for_dflash_tests fails: ModuleNotFoundError: No module named "
        "'no_such_module_for_dflash_tests'"
    )
