"""The tracker process never outlives a failed setup and never hangs a finished run's end.

A stand-in worker (the real process protocol, no tracker library) answers as the real one
does, except where a test makes it hang.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.training import fit as fit_module
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.trackers import process as process_module
from dflash_recipes.executor.training.trackers.process import TrackerProcess

pytestmark = pytest.mark.usefixtures("one_thread")

#: The worker's protocol: one JSON message per line in, answers out; `hang` names the one op
#: it never answers (it sleeps until stopped).
_STAND_IN = """
import json, sys, time
hang = {hang!r}
for raw in sys.stdin:
    op = json.loads(raw)["op"]
    if op == hang:
        time.sleep(3600)
    answer = {{"open": {{"opened": {{}}}}, "flush": {{"flushed": []}}, "close": {{"closed": True}}}}
    if op in answer:
        sys.stdout.write(json.dumps(answer[op]) + "\\n")
        sys.stdout.flush()
    if op == "close":
        break
"""


def _stand_in(monkeypatch: pytest.MonkeyPatch, *, hang: str | None) -> list[TrackerProcess]:
    """Every TrackerProcess started runs the stand-in; returns the list of those started."""
    monkeypatch.setattr(process_module, "_BOOTSTRAP", _STAND_IN.format(hang=hang))
    started: list[TrackerProcess] = []
    init = TrackerProcess.__init__

    def recording(self: TrackerProcess, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        started.append(self)

    monkeypatch.setattr(TrackerProcess, "__init__", recording)
    return started


def test_a_close_that_hangs_is_bounded_said_and_the_process_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    started = _stand_in(monkeypatch, hang="close")
    monkeypatch.setattr(process_module, "END_SECONDS", 0.2)
    plan = tiny_scratch_plan(
        tmp_path / "run", "training.max_steps=2", "training.report_to=[tensorboard]"
    )
    outcome: list[object] = []

    def train() -> None:
        outcome.append(run_plan(plan, progress=False))

    with caplog.at_level(logging.INFO, logger="dflash_recipes.train"):
        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        thread.join(timeout=300)  # generous: the bound is END_SECONDS, far below
    assert not thread.is_alive(), "the end of the run hung on the tracker's close"
    (summary,) = outcome
    assert summary.steps == 2  # type: ignore[attr-defined]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    kinds = [json.loads(row)["kind"] for row in rows]
    assert kinds == ["train", "train", "summary"]
    said = [r.getMessage() for r in caplog.records if "did not finish closing" in r.getMessage()]
    assert said == [
        "the trackers (tensorboard) did not finish closing within 0.2 s; stopped their process "
        "so the run can end (their runs may lack the end; metrics.jsonl has every row)"
    ]
    (process,) = started
    assert process._process.poll() is not None  # stopped, not left behind


def test_a_flush_that_hangs_is_bounded_and_named_in_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stand_in(monkeypatch, hang="flush")
    monkeypatch.setattr(process_module, "END_SECONDS", 0.2)
    process = TrackerProcess(("mlflow",), {})
    try:
        done: list[tuple[str, ...]] = []
        thread = threading.Thread(target=lambda: done.append(process.flush()), daemon=True)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), "flush hung"
        assert done == [("mlflow had not confirmed delivering every row after 0.2 s",)]
    finally:
        process.close("finished")  # its close hangs behind the flush: bounded too
    assert process._process.poll() is not None


def test_a_setup_failure_after_the_trackers_started_ends_their_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = _stand_in(monkeypatch, hang=None)
    closed: list[str] = []
    close = TrackerProcess.close

    def recording_close(self: TrackerProcess, outcome: str) -> None:
        closed.append(outcome)
        close(self, outcome)  # type: ignore[arg-type]

    monkeypatch.setattr(TrackerProcess, "close", recording_close)

    def failing_wait(env: object, what: str, *, timeout_s: float | None) -> None:
        raise RuntimeError("rank 1 failed its setup")

    monkeypatch.setattr(fit_module, "wait_for_rank0", failing_wait)
    plan = tiny_scratch_plan(
        tmp_path / "run", "training.max_steps=2", "training.report_to=[tensorboard]"
    )
    with pytest.raises(RuntimeError, match="rank 1 failed its setup"):
        run_plan(plan, progress=False)
    assert closed == ["failed"]
    (process,) = started
    assert process._process.poll() is not None
