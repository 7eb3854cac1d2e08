"""The trackers' own variables for a test, pointing into its tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def tracker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Each tracker's own variables, pointing into tmp_path (W&B offline: no server)."""
    env = {
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}",
        "MLFLOW_EXPERIMENT_NAME": "drafters",
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb-dir"),
        "WANDB_PROJECT": "dflash-tests",
        "WANDB_SILENT": "true",
    }
    (tmp_path / "store").mkdir()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield env
