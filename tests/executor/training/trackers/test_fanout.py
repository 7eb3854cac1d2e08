"""training.report_to with the real libraries: TensorBoard, MLflow (sqlite store, a real
tracking server) and W&B (offline), read back and compared with metrics.jsonl.

No library is mocked. TensorBoard is read with its EventAccumulator, MLflow with MlflowClient,
W&B's offline run file with the framing reader in testkit.wandb_records.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit.cli_runner import cli
from testkit.compiling import SMALL_RUN, TINY_SCRATCH, tiny_scratch_plan
from testkit.tracking import child_env, metrics_rows, run_acting_at_step
from testkit.wandb_records import offline_run_files, read_wandb_run

from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.summary import summary_line
from dflash_recipes.executor.training.trackers.fanout import TRACKERS_FILE
from dflash_recipes.plan.run_plan import RunPlan

pytestmark = pytest.mark.usefixtures("one_thread")

ALL = "training.report_to=[tensorboard,mlflow,wandb]"


def _tensorboard(logging_dir: Path) -> object:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logging_dir))
    accumulator.Reload()
    return accumulator


def _mlflow_runs(env: dict[str, str]) -> list[object]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(env["MLFLOW_EXPERIMENT_NAME"])
    assert experiment is not None
    return list(client.search_runs([experiment.experiment_id]))


def _history(env: dict[str, str], run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_every_tracker_gets_what_metrics_jsonl_has(
    tmp_path: Path, tracker_env: dict[str, str]
) -> None:
    plan = tiny_scratch_plan(tmp_path / "run", "training.max_steps=2", "training.eval_steps=2", ALL)
    run_plan(plan, progress=False)
    out = tmp_path / "run"
    train, evals = metrics_rows(out, "train"), metrics_rows(out, "eval")
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [2]
    summary = metrics_rows(out, "summary")[0]

    # TensorBoard: under <output_dir>/tensorboard by default; float32 scalars.
    tb = _tensorboard(out / "tensorboard")
    for key in ("loss", "lr", "grad_norm", "train_batch_tau_estimate", "tokens_per_second"):
        got = [(e.step, e.value) for e in tb.Scalars(f"train/{key}")]  # type: ignore[attr-defined]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in train], key
    accuracy = [(e.step, e.value) for e in tb.Scalars("train/accuracy_by_position/3")]  # type: ignore[attr-defined]
    assert accuracy == [(r["step"], pytest.approx(r["accuracy_by_position"][3])) for r in train]  # type: ignore[index]
    for key in ("tau", "tau_pooled", "tau_per_prompt_mean"):
        got = [(e.step, e.value) for e in tb.Scalars(f"eval/{key}")]  # type: ignore[attr-defined]
        assert got == [(2, pytest.approx(evals[0][key], rel=1e-6))], key
    (fingerprint,) = tb.Tensors("plan_fingerprint/text_summary")  # type: ignore[attr-defined]
    assert fingerprint.tensor_proto.string_val == [plan.fingerprint.encode()]
    (plan_text,) = tb.Tensors("plan/text_summary")  # type: ignore[attr-defined]
    assert b"| training.learning_rate | 0.003 |" in plan_text.tensor_proto.string_val[0]
    assert "summary/text_summary" in tb.Tags()["tensors"]  # type: ignore[attr-defined]

    # MLflow: the experiment MLFLOW_EXPERIMENT_NAME names, one run, FINISHED.
    (run,) = _mlflow_runs(tracker_env)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"  # type: ignore[attr-defined]
    run_id = run.info.run_id  # type: ignore[attr-defined]
    assert _history(tracker_env, run_id, "train/loss") == [
        (r["step"], pytest.approx(r["loss"])) for r in train
    ]
    assert _history(tracker_env, run_id, "eval/tau") == [(2, pytest.approx(evals[0]["tau"]))]
    assert _history(tracker_env, run_id, "summary/final_loss") == [
        (2, pytest.approx(summary["final_loss"]))
    ]
    params, tags = run.data.params, run.data.tags  # type: ignore[attr-defined]
    assert params["training.learning_rate"] == str(plan.training.learning_rate)
    assert params["draft.block_size"] == "4"
    assert tags["plan_fingerprint"] == plan.fingerprint

    # W&B offline: one run file under WANDB_DIR, its history, config, tags and summary.
    (run_file,) = offline_run_files(Path(tracker_env["WANDB_DIR"]))
    wb = read_wandb_run(run_file)
    assert sorted(wb.history) == [1, 2]
    for r in train:
        row = wb.history[r["step"]]  # type: ignore[index]
        assert row["train/loss"] == pytest.approx(r["loss"])
        assert row["train/accuracy_by_position/1"] == pytest.approx(r["accuracy_by_position"][1])  # type: ignore[index]
    assert wb.history[2]["eval/tau"] == pytest.approx(evals[0]["tau"])
    assert wb.config["training.learning_rate"] == plan.training.learning_rate
    assert wb.config["plan_fingerprint"] == plan.fingerprint
    assert plan.fingerprint in wb.tags
    assert wb.summary["summary/steps"] == 2 and wb.exit_code == 0

    kept = json.loads((out / TRACKERS_FILE).read_text())
    assert kept["mlflow"]["run_id"] == run_id and kept["wandb"]["id"] == wb.run_id


#: The killed training: after the row of step 3 is logged (the checkpoint is at step 2), the
#: process kills itself with SIGKILL, as `kill -9` would.
KILLED_CHILD = """
import logging, os, signal, sys
from pathlib import Path
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.plan.run_plan import RunPlan

class KillAtStep3(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("step 3 "):
            os.kill(os.getpid(), signal.SIGKILL)

logging.getLogger("dflash_recipes.train").addHandler(KillAtStep3())
logging.getLogger("dflash_recipes.train").setLevel(logging.INFO)
run_plan(RunPlan.from_json(Path(sys.argv[1]).read_text()), progress=False)
"""


def _resumable_plan(tmp_path: Path) -> RunPlan:
    return tiny_scratch_plan(
        tmp_path / "run",
        "training.max_steps=5",
        "training.save_steps=2",
        "training.report_to=[tensorboard,mlflow,wandb]",
    )


@pytest.mark.slow
def test_kill_9_then_resume_continues_the_same_tracker_runs(
    tmp_path: Path, tracker_env: dict[str, str]
) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(_resumable_plan(tmp_path).to_json(), encoding="utf-8")
    child = subprocess.run(
        [sys.executable, "-c", KILLED_CHILD, str(plan_file)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    out = tmp_path / "run"
    assert [r["step"] for r in metrics_rows(out, "train")] == [1, 2, 3]
    first_ids = json.loads((out / TRACKERS_FILE).read_text())
    (killed,) = _mlflow_runs(tracker_env)
    assert killed.info.status == "RUNNING"  # type: ignore[attr-defined]

    resumed = _resumable_plan(tmp_path)  # recompiled: resumes from the step-2 checkpoint
    assert resumed.resume is not None and resumed.resume.step == 2
    summary = run_plan(resumed, progress=False)
    assert summary.steps == 5 and summary.tracker_problems == ()
    train = metrics_rows(out, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]  # step 3 redone, logged once
    assert json.loads((out / TRACKERS_FILE).read_text()) == first_ids

    # MLflow: the same run, FINISHED, each step once with the values metrics.jsonl has.
    (run,) = _mlflow_runs(tracker_env)
    assert run.info.run_id == first_ids["mlflow"]["run_id"]  # type: ignore[attr-defined]
    assert run.info.status == "FINISHED"  # type: ignore[attr-defined]
    assert _history(tracker_env, first_ids["mlflow"]["run_id"], "train/loss") == [
        (r["step"], pytest.approx(r["loss"], rel=1e-5)) for r in train
    ]

    # W&B: two offline files of one run id. The killed process's W&B service went with it
    # and lost what it had buffered; the resumed run sent the rows metrics.jsonl kept, then
    # went on: the run's history is every step once, with metrics.jsonl's values.
    files = offline_run_files(Path(tracker_env["WANDB_DIR"]))
    assert len(files) == 2
    killed_part, resumed_part = (read_wandb_run(f) for f in files)
    assert resumed_part.run_id == first_ids["wandb"]["id"]
    assert killed_part.run_id in ("", first_ids["wandb"]["id"])  # "" : nothing was flushed
    assert sorted(resumed_part.history) == [1, 2, 3, 4, 5]
    loss = {r["step"]: r["loss"] for r in train}
    for part in (killed_part, resumed_part):
        for step, row in part.history.items():  # a step in both files has the same value
            assert row["train/loss"] == pytest.approx(loss[step], rel=1e-5), step
    assert resumed_part.exit_code == 0

    # TensorBoard: the resumed run purged the earlier events and wrote the kept rows again.
    tb = _tensorboard(out / "tensorboard")
    losses = [(e.step, e.value) for e in tb.Scalars("train/loss")]  # type: ignore[attr-defined]
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-5)) for r in train]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


#: MLflow's own tracking server (its Flask app) over a sqlite store, in a subprocess.
MLFLOW_SERVER = """
import sys
from mlflow.server import app
app.run(host="127.0.0.1", port=int(sys.argv[1]))
"""


@pytest.mark.slow
def test_a_tracker_failing_mid_run_is_warned_about_once_and_training_goes_on(
    tmp_path: Path,
    tracker_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = _free_port()
    server_env = {
        **os.environ,
        "_MLFLOW_SERVER_FILE_STORE": f"sqlite:///{tmp_path / 'server.db'}",
        "_MLFLOW_SERVER_ARTIFACT_ROOT": str(tmp_path / "artifacts"),
    }
    server = subprocess.Popen(
        [sys.executable, "-c", MLFLOW_SERVER, str(port)],
        env=server_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_http(f"http://127.0.0.1:{port}/health", server)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
        from mlflow.tracking import MlflowClient

        # The server creates its store's tables on the first request: not part of the test.
        MlflowClient().create_experiment(tracker_env["MLFLOW_EXPERIMENT_NAME"])
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")

        def stop_server() -> None:
            server.kill()
            server.wait(timeout=30)

        plan = tiny_scratch_plan(
            tmp_path / "run", "training.max_steps=4", "training.report_to=[mlflow,tensorboard]"
        )
        summary = run_acting_at_step(plan, 2, stop_server, caplog)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)
    out = tmp_path / "run"
    assert summary.steps == 4 and (out / "export" / "model.safetensors").is_file()
    assert [r["step"] for r in metrics_rows(out, "train")] == [1, 2, 3, 4]
    warnings = [r.getMessage() for r in caplog.records if "tracker mlflow failed" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "training goes on and metrics.jsonl keeps every row" in warnings[0]
    # MLflow sends in the background, about a second of rows per call: the failure shows at a
    # later row or when the run flushes at its end, and counts exactly the train rows that
    # never reached the server's store. TensorBoard got everything.
    (problem,) = summary.tracker_problems
    pattern = r"mlflow missed (\d) row\(s\) after failing at (step \d|the end of the run) \("
    found = re.match(pattern, problem)
    assert found is not None, problem
    from mlflow.tracking import MlflowClient

    store = MlflowClient(tracking_uri=server_env["_MLFLOW_SERVER_FILE_STORE"])
    (run,) = store.search_runs([store.get_experiment_by_name("drafters").experiment_id])  # type: ignore[union-attr]
    arrived = [m.step for m in store.get_metric_history(run.info.run_id, "train/loss")]
    assert arrived == list(range(1, len(arrived) + 1)) and len(arrived) <= 2
    assert int(found[1]) == 4 - len(arrived), (problem, arrived)
    assert summary_line(summary).startswith("done: 4 steps, ")
    assert f"; trackers: {problem} (metrics.jsonl has all)" in summary_line(summary)
    tb = _tensorboard(out / "tensorboard")
    assert [e.step for e in tb.Scalars("train/loss")] == [1, 2, 3, 4]  # type: ignore[attr-defined]


def _wait_for_http(url: str, proc: subprocess.Popen[bytes]) -> None:
    import urllib.request

    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, "the MLflow server exited"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the MLflow server did not come up"
        time.sleep(0.2)


def test_a_missing_tracker_library_stops_run_before_the_model_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees without it
    out = tmp_path / "run"
    result = cli(
        "run",
        str(TINY_SCRATCH),
        "--no-progress",
        f"training.output_dir={out}",
        *SMALL_RUN,
        "training.report_to=[tensorboard,wandb]",
    )
    assert result.exit_code == 1
    # the recipe is compiled on the spot: compile refuses it (issue 36), the fix named
    assert "error[tracker-library-missing] training.report_to: training.report_to names wandb" in (
        result.output
    )
    assert "fix: pip install 'dflash-recipes[wandb]', or remove wandb from training.report_to" in (
        result.output
    )
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {TINY_SCRATCH} did not compile (1 error, 0 warnings, 1 info)"]
    assert not out.exists()  # nothing loaded, nothing written


@pytest.mark.slow
def test_two_ranks_under_torchrun_give_one_writer_per_tracker(
    tmp_path: Path, tracker_env: dict[str, str]
) -> None:
    plan = tiny_scratch_plan(
        tmp_path / "ddp", "training.max_steps=2", "training.per_device_train_batch_size=1", ALL
    )
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    env = {
        key: value
        for key, value in child_env().items()
        if key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    argv = ["run", str(plan_file), "--nproc-per-node", "2", "--no-progress"]
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_recipes", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "ddp"
    assert [r["step"] for r in metrics_rows(out, "train")] == [1, 2]
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    tb = _tensorboard(out / "tensorboard")
    assert [e.step for e in tb.Scalars("train/loss")] == [1, 2]  # type: ignore[attr-defined]
    (run,) = _mlflow_runs(tracker_env)
    assert run.info.status == "FINISHED"  # type: ignore[attr-defined]
    assert [s for s, _ in _history(tracker_env, run.info.run_id, "train/loss")] == [1, 2]  # type: ignore[attr-defined]
    (run_file,) = offline_run_files(Path(tracker_env["WANDB_DIR"]))
    assert sorted(read_wandb_run(run_file).history) == [1, 2]
