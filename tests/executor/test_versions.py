"""The executor refuses a torch or transformers older than it runs on, in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from testkit.compiling import TINY_SCRATCH

from dflash_recipes.errors import LaunchError
from dflash_recipes.executor.versions import REQUIRED, check_versions, release

REPO = Path(__file__).resolve().parents[2]


def _installed(**versions: str | None) -> dict[str, str | None]:
    return {"torch": "2.13.0+cpu", "transformers": "5.25.0", **versions}


@pytest.mark.parametrize(
    "found",
    ["2.10.0", "2.11.0+cu130", "2.10.0a0+50eac811a6.nv25.11", "3.0.0", "2.10"],
)
def test_supported_torch_releases_pass(found: str) -> None:
    check_versions(_installed(torch=found).get)


def test_an_old_torch_is_refused_in_one_line_naming_both_versions() -> None:
    with pytest.raises(LaunchError) as info:
        check_versions(_installed(torch="2.9.1+cu128").get)
    assert str(info.value) == (
        "torch 2.9.1+cu128 installed, but dflash-recipes needs torch >= 2.10: upgrade "
        "(pip install 'torch>=2.10'), or install dflash-recipes into an environment that has "
        "them"
    )


def test_both_too_old_are_named_together() -> None:
    with pytest.raises(LaunchError) as info:
        check_versions(_installed(torch="2.4.1", transformers="5.2.0").get)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("torch 2.4.1, transformers 5.2.0 installed, but dflash-recipes ")
    assert "needs torch >= 2.10, transformers >= 5.17" in message


def test_a_library_not_installed_or_unreadable_is_left_to_its_import() -> None:
    check_versions(_installed(transformers=None, torch="a-local-build").get)


def test_release_reads_the_numbers_at_the_start() -> None:
    assert release("2.11.0+cu130") == (2, 11, 0)
    assert release("5.17.0.dev0") == (5, 17, 0)
    assert release("nightly") is None


def test_the_floors_are_the_ones_pyproject_declares() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {}
    for requirement in project["dependencies"]:
        match = re.match(r"^([A-Za-z0-9_.\-]+)>=([0-9.]+)", requirement)
        if match and match.group(1) in REQUIRED:
            declared[match.group(1)] = release(match.group(2))
    assert declared == REQUIRED


@pytest.mark.slow
def test_run_refuses_an_old_torch_before_anything_is_written(tmp_path: Path) -> None:
    # a torch 2.8.0 as importlib.metadata sees it: a dist-info ahead of the real one
    fake = tmp_path / "site" / "torch-2.8.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.8.0\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fake.parent), env.get("PYTHONPATH")]))
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_recipes",
            "run",
            str(TINY_SCRATCH),
            f"training.output_dir={out}",
            "training.max_steps=1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "error: torch 2.8.0 installed, but dflash-recipes needs torch >= 2.10: upgrade "
        "(pip install 'torch>=2.10'), or install dflash-recipes into an environment that has "
        "them"
    )
    assert "Traceback" not in done.stderr
    assert not out.exists()
