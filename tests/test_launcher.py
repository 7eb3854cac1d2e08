"""tools/launcher/launch.py renders a Slurm script for a compiled plan and never submits
without --yes."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def _launcher() -> ModuleType:
    spec = importlib.util.spec_from_file_location("launch", REPO / "tools/launcher/launch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_renders_without_submitting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    launch = _launcher()

    def no_submit(*args: object, **kwargs: object) -> None:
        raise AssertionError("sbatch must not run without --yes")

    monkeypatch.setattr(subprocess, "run", no_submit)
    recipe = REPO / "recipes" / "tiny" / "tiny_scratch.yaml"
    script = tmp_path / "job.sbatch"
    code = launch.main(
        [
            "--yaml",
            str(recipe),
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--partition",
            "gpu",
            "--output",
            str(script),
            f"training.output_dir={tmp_path / 'out'}",
        ]
    )
    assert code == 0
    text = script.read_text()
    plan_text = (tmp_path / "job.plan.json").read_text()
    import json

    fingerprint = json.loads(plan_text)["fingerprint"]
    assert f"#SBATCH --job-name=dflash-{fingerprint[:12]}" in text
    assert "#SBATCH --nodes=2" in text and "#SBATCH --partition=gpu" in text
    assert "srun" in text and "--nproc-per-node 8 --nnodes 2" in text
    assert '--rdzv-endpoint "$HEAD_NODE:29500" --rdzv-id "$SLURM_JOB_ID"' in text
    assert str(tmp_path / "job.plan.json") in text
    captured = capsys.readouterr()
    assert text in captured.out and "sbatch " in captured.err


def test_recipe_errors_stop_before_anything_is_written(tmp_path: Path) -> None:
    launch = _launcher()
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  model_name_or_path: /nonexistent\n", encoding="utf-8")
    code = launch.main(["--yaml", str(bad), "--output", str(tmp_path / "job.sbatch")])
    assert code == 1
    assert not (tmp_path / "job.sbatch").exists()
