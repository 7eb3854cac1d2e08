"""The tracker process's message loop, driven with real messages and a real MLflow store."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from dflash_recipes.executor.training.trackers.worker import _Replies, serve


def _messages(tmp_path: Path, *rows: int, close: str | None) -> io.BytesIO:
    context = {
        "run_dir": str(tmp_path / "run"),
        "run_name": "run",
        "logging_dir": str(tmp_path / "run" / "tensorboard"),
        "resumed_from": None,
        "metrics_path": str(tmp_path / "run" / "metrics.jsonl"),
        "kept": {},
    }
    lines = [{"op": "open", "names": ["mlflow"], "context": context}]
    lines += [{"op": "row", "row": {"kind": "train", "step": s, "loss": 1.0 / s}} for s in rows]
    if close is not None:
        lines += [{"op": "flush"}, {"op": "close", "outcome": close}]
    return io.BytesIO(b"".join(json.dumps(m).encode() + b"\n" for m in lines))


def _run(tmp_path: Path) -> tuple[str, object]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("dflash-recipes")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    history = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    return run.info.status, history


@pytest.fixture(autouse=True)
def _store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    (tmp_path / "run").mkdir()


def test_close_delivers_every_row_and_ends_the_run_with_the_outcome(tmp_path: Path) -> None:
    out = io.StringIO()
    code = serve(_messages(tmp_path, 1, 2, 3, close="stopped"), _Replies(out))
    assert code == 0
    answers = [json.loads(line) for line in out.getvalue().splitlines()]
    keys = [next(iter(a)) for a in answers if "log" not in a]
    assert keys == ["opened", "flushed", "closed"]
    assert answers[0]["opened"]["mlflow"]["run_id"]
    assert [a["flushed"] for a in answers if "flushed" in a] == [[]]
    assert _run(tmp_path) == ("KILLED", [1, 2, 3])


def test_input_ending_without_close_leaves_the_run_open_for_a_resume(tmp_path: Path) -> None:
    out = io.StringIO()
    code = serve(_messages(tmp_path, 1, 2, close=None), _Replies(out))
    assert code == 1  # the trainer was killed: nothing is closed, nothing is marked finished
    status, _history = _run(tmp_path)
    assert status == "RUNNING"
