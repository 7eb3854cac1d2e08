"""`dflash-recipe report` (and `eval`'s command line): runs in, a PNG out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from testkit.metrics_runs import PNG_SIGNATURE, _write_run

from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.report import render_report


def test_report_of_two_runs_is_a_png(tmp_path: Path) -> None:
    warm = _write_run(tmp_path / "warm", [0.8, 0.6, 0.4], with_eval=True)
    scratch = _write_run(tmp_path / "scratch", [0.3, 0.2, 0.1], with_eval=False)
    out = render_report([warm, scratch], tmp_path / "cmp.png", labels=["warm", "scratch"])
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    import matplotlib.image

    height, width = matplotlib.image.imread(str(out)).shape[:2]
    assert (width, height) == (1500, 420)
    assert not list(tmp_path.glob(".cmp.png.tmp-*"))


def test_missing_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _write_run(tmp_path / "run", [0.5], with_eval=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(DFlashRecipeError, match=r"pip install 'dflash-recipes\[plot\]'"):
        render_report([run], tmp_path / "r.png")
    assert not (tmp_path / "r.png").exists()
