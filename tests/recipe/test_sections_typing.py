"""mypy, run as a user would (outside the repository, against the installed package), catches a
wrongly typed recipe built in Python and accepts a correct one.

The package is installed the way the README says (`pip install -e .`): the project's own
pyproject builds the editable wheel (PEP 660, no network), which is unpacked into a fresh
virtual environment. mypy then runs from a directory outside the repository with no MYPYPATH
or PYTHONPATH, so it finds the package only if the editable install is a path entry it can
follow (not an import hook).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

WRONG = """\
from dflash_recipes import DFlashSection, ModelSection, Recipe

recipe = Recipe(
    model=ModelSection(model_name_or_path="/models/target"),
    dflash=DFlashSection(dflash_block_size="16"),
)
scheduler = ModelSection(model_name_or_path="/m", dtype="bf16")
"""

RIGHT = """\
import attrs

from dflash_recipes import DFlashArchitectureConfig, DFlashSection, ModelSection, Recipe

recipe = Recipe(
    model=ModelSection(model_name_or_path="/models/target", dtype="float16"),
    dflash=DFlashSection(
        dflash_block_size=16,
        dflash_architecture_config=DFlashArchitectureConfig(target_layer_ids=(1, 9, 17)),
    ),
)
smaller = attrs.evolve(recipe, dflash=attrs.evolve(recipe.dflash, dflash_block_size=8))
size: int = smaller.dflash.dflash_block_size
"""


def _editable_wheel(project: Path, out: Path) -> Path:
    """Build the project's editable wheel with its own build backend (setuptools, PEP 660)."""
    code = (
        "import sys; from setuptools import build_meta; "
        "print(build_meta.build_editable(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        cwd=project,
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out / done.stdout.strip().splitlines()[-1]


def _clean_env() -> dict[str, str]:
    # The worktree's PYTHONPATH would let mypy find the sources without any install.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}


@pytest.fixture(scope="module")
def installed_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv's python with the project editable-installed, from a copy of the project."""
    root = tmp_path_factory.mktemp("editable")
    project = root / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, project / name)
    shutil.copytree(
        REPO / "dflash_recipes",
        project / "dflash_recipes",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    wheel = _editable_wheel(project, root / "dist")
    with zipfile.ZipFile(wheel) as archive:
        pth = [n for n in archive.namelist() if n.endswith(".pth")]
        assert len(pth) == 1, archive.namelist()
        entries = archive.read(pth[0]).decode().split()
        # A static path entry (not "import __editable___..._finder"): what mypy follows.
        assert entries == [str(project)], (
            f"the editable install is {entries}, not a path entry: mypy cannot follow it; keep "
            '[tool.setuptools.package-dir] "" = "." in pyproject.toml'
        )
        venv = root / "venv"
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
            check=True,
            timeout=60,
        )
        python = venv / "bin" / "python"
        purelib = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            env=_clean_env(),
            timeout=60,
        ).stdout.strip()
        assert purelib != sysconfig.get_paths()["purelib"]
        archive.extractall(purelib)
    return python


def test_mypy_reports_wrong_types_and_accepts_right_ones(
    tmp_path: Path, installed_python: Path
) -> None:
    outside = tmp_path / "user_project"
    outside.mkdir()
    (outside / "wrong_recipe.py").write_text(WRONG)
    (outside / "right_recipe.py").write_text(RIGHT)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--python-executable",
            str(installed_python),
            "--strict",
            "--follow-imports=silent",  # only the snippets' own errors count
            "--cache-dir",
            str(tmp_path / "mypy-cache"),
            "--no-error-summary",
            "wrong_recipe.py",
            "right_recipe.py",
        ],
        cwd=outside,
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
        check=False,
    )
    stdout = done.stdout + done.stderr
    assert "import-not-found" not in stdout, stdout
    assert done.returncode == 1, stdout
    lines = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert all(line.startswith("wrong_recipe.py") for line in lines), stdout  # RIGHT is clean
    assert any(
        ':5: error: Argument "dflash_block_size" to "DFlashSection" has incompatible type "str"; '
        'expected "int"' in line
        for line in lines
    ), stdout
    assert any(':7: error: Argument "dtype" to "ModelSection"' in line for line in lines), stdout
    assert len(lines) == 2, stdout
