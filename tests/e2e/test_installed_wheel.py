"""`dflash-recipe demo` after a plain (not editable) install: the wheel carries everything the
demo reads, and the demo's recipes compile and train from the installed package, run outside
the checkout with only the installed copy importable (issue 36)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_DATA = ROOT / "dflash_recipes" / "demo_data"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=600, cwd=out,
    )  # fmt: skip
    (built,) = out.glob("dflash_recipes-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed into a folder of its own (its dependencies: this environment's)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return target


def test_the_wheel_holds_every_file_the_demo_reads(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    # demo_data/recipes is the repository's recipes/tiny (a link): its files are in the wheel
    expected = {
        "dflash_recipes/demo_data/" + str((Path(folder) / name).relative_to(DEMO_DATA))
        for folder, _, files in os.walk(DEMO_DATA, followlinks=True)
        for name in files
        if "__pycache__" not in folder
    }
    assert {
        "dflash_recipes/demo_data/recipes/tiny_released.yaml",
        "dflash_recipes/demo_data/recipes/tiny_finetune.yaml",
        "dflash_recipes/demo_data/recipes/tiny_scratch.yaml",
        "dflash_recipes/demo_data/target/model.safetensors",
        "dflash_recipes/demo_data/data/eval.jsonl",
    } <= expected
    assert expected <= names, sorted(expected - names)
    recipes = sorted(p.name for p in (ROOT / "recipes" / "tiny").glob("*.yaml"))
    assert sorted(p.name for p in (DEMO_DATA / "recipes").glob("*.yaml")) == recipes


#: The demo's stages from the installed package, small: stage 1 trains two steps and exports,
#: stage 2 compiles the warm start from that export (its checks included), stage 3 trains.
_STAGES = """
import sys
from pathlib import Path
import dflash_recipes
from dflash_recipes.executor.demo import runner
from dflash_recipes.executor.training.fit import run_plan

print("package:", dflash_recipes.__file__)
runs = Path(sys.argv[1])
small = ["training.max_steps=2", "training.eval_steps=null", "training.save_steps=2"]
released = runner._compile(
    "tiny_released.yaml", [f"training.output_dir={runs / 'released'}", *small], print
)
run_plan(released, progress=False)
finetune = runner._compile("tiny_finetune.yaml", [
    f"training.output_dir={runs / 'finetune'}",
    f"dflash.dflash_init_checkpoint={runs / 'released' / 'export'}", *small], print)
checked, equal = runner._bit_exact(finetune)
print(f"bit-exact {equal}/{checked}")
scratch = runner._compile(
    "tiny_scratch.yaml", [f"training.output_dir={runs / 'scratch'}", *small], print
)
print("scratch steps", run_plan(scratch, progress=False).steps)
"""


def test_the_demo_stages_run_from_the_installed_package_outside_the_checkout(
    installed: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(installed), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-P", "-c", _STAGES, str(tmp_path / "runs")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert f"package: {installed / 'dflash_recipes' / '__init__.py'}" in out
    assert str(ROOT) not in out  # nothing read from the checkout
    assert (
        f"model.model_name_or_path={installed / 'dflash_recipes' / 'demo_data' / 'target'}" in out
    )
    assert "taps-from-checkpoint" in out and "checkpoint-block-size-differs" in out
    bit_exact = next(line for line in out.splitlines() if line.startswith("bit-exact "))
    equal, checked = bit_exact.removeprefix("bit-exact ").split("/")
    assert int(checked) > 0 and equal == checked
    assert "scratch steps 2" in out
