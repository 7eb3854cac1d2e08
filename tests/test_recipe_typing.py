"""mypy catches a wrongly typed recipe built in Python, and accepts a correct one."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api as mypy_api

REPO = Path(__file__).resolve().parents[1]

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


def test_mypy_reports_wrong_types_and_accepts_right_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = tmp_path / "wrong_recipe.py"
    right = tmp_path / "right_recipe.py"
    wrong.write_text(WRONG)
    right.write_text(RIGHT)
    # The editable install uses an import hook mypy cannot follow; point it at the source tree.
    monkeypatch.setenv("MYPYPATH", str(REPO))
    stdout, stderr, status = mypy_api.run(
        [
            "--strict",
            "--follow-imports=silent",  # only the snippets' own errors count
            "--cache-dir",
            str(tmp_path / "mypy-cache"),
            "--no-error-summary",
            str(wrong),
            str(right),
        ]
    )
    assert status == 1, stdout + stderr
    lines = [line for line in stdout.splitlines() if ": error:" in line]
    assert all(line.startswith(str(wrong)) for line in lines), stdout  # RIGHT is clean
    assert any(
        ':5: error: Argument "dflash_block_size" to "DFlashSection" has incompatible type "str"; '
        'expected "int"' in line
        for line in lines
    ), stdout
    assert any(':7: error: Argument "dtype" to "ModelSection"' in line for line in lines), stdout
    assert len(lines) == 2, stdout
