"""The tracker process: the trackers run beside the trainer, and its end is contained.

Real processes and real libraries: the training runs in this process, the trackers in the
worker process it starts, which the tests kill or signal as an operator (or the kernel) would.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from testkit.compiling import tiny_scratch_plan
from testkit.tracking import child_env, metrics_rows, run_acting_at_step
from testkit.wandb_records import offline_run_files, read_wandb_run

from dflash_recipes.executor.training.summary import summary_line
from dflash_recipes.executor.training.trackers import process as process_module
from dflash_recipes.executor.training.trackers.process import WORKER_MODULE, TrackerProcess, gather
from dflash_recipes.executor.training.trackers.worker import NICE_INCREMENT

pytestmark = pytest.mark.usefixtures("one_thread")


def _worker_pids(parent: int) -> list[int]:
    """The tracker processes `parent` started (read from /proc, as `ps` would)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and WORKER_MODULE.encode() in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_the_tracker_process_killed_mid_run_is_warned_about_once_and_training_goes_on(
    tmp_path: Path, tracker_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    killed: list[int] = []
    loaded: list[bool] = []

    def kill_trackers() -> None:
        (pid,) = _worker_pids(os.getpid())
        # The trackers need no torch: the process does not load it (start-up, memory).
        loaded.append("libtorch" in Path(f"/proc/{pid}/maps").read_text())
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    plan = tiny_scratch_plan(
        tmp_path / "run", "training.max_steps=4", "training.report_to=[tensorboard,mlflow]"
    )
    summary = run_acting_at_step(plan, 2, kill_trackers, caplog)
    assert killed, "the tracker process was not found"
    assert loaded == [False]
    out = tmp_path / "run"
    assert summary.steps == 4 and (out / "export" / "model.safetensors").is_file()
    assert [r["step"] for r in metrics_rows(out, "train")] == [1, 2, 3, 4]
    warnings = [r.getMessage() for r in caplog.records if "tracker process" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("tracker process (tensorboard, mlflow) ended with exit code -9")
    assert "training goes on without them and metrics.jsonl keeps every row" in warnings[0]
    # The trainer notices the end when its reader thread sees the pipe close: at step 2 or a
    # later one on a busy machine; the rows logged after that are the ones counted missed.
    assert len(summary.tracker_problems) == 2
    for name, problem in zip(("tensorboard", "mlflow"), summary.tracker_problems, strict=True):
        pattern = rf"{name} missed (\d) row\(s\) after failing at step ([234]) \(the tracker "
        found = re.match(pattern, problem)
        assert found is not None, problem
        assert int(found[1]) == 4 - int(found[2]), problem
        assert problem.endswith("process ended with exit code -9)")
    assert "(metrics.jsonl has all)" in summary_line(summary)
    assert not _worker_pids(os.getpid())


#: The training, in a process group of its own: SIGINT to the whole group (what Ctrl-C in a
#: terminal does) at step 2.
INTERRUPTED_CHILD = """
import logging, os, signal, sys
from pathlib import Path
from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.plan.run_plan import RunPlan

class CtrlCAtStep2(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("step 2 "):
            os.killpg(os.getpgid(0), signal.SIGINT)

logging.getLogger("dflash_recipes.train").addHandler(CtrlCAtStep2())
logging.getLogger("dflash_recipes.train").setLevel(logging.INFO)
try:
    run_plan(RunPlan.from_json(Path(sys.argv[1]).read_text()), progress=False)
except DFlashRecipeError as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
"""


@pytest.mark.slow
def test_ctrl_c_stops_training_and_the_tracker_process_closes_the_runs_as_stopped(
    tmp_path: Path, tracker_env: dict[str, str]
) -> None:
    plan = tiny_scratch_plan(
        tmp_path / "run", "training.max_steps=6", "training.report_to=[mlflow,wandb]"
    )
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    child = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_CHILD, str(plan_file)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        start_new_session=True,  # its own group: the SIGINT reaches it and its children only
    )
    assert child.returncode == 3, child.stderr[-3000:]
    out = tmp_path / "run"
    steps = [r["step"] for r in metrics_rows(out, "train")]
    assert 2 <= steps[-1] < 6  # stopped early, at a step boundary
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracker_env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("drafters")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    # The tracker process outlived the signal: it closed the run (stopped -> KILLED), with
    # every row the trainer logged.
    assert run.info.status == "KILLED"
    history = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(history) == steps
    (run_file,) = offline_run_files(Path(tracker_env["WANDB_DIR"]))
    wb = read_wandb_run(run_file)
    assert sorted(wb.history) == steps and wb.exit_code == 0


def _context(run_dir: Path) -> dict[str, object]:
    """What rank 0 opens the tracker process with, for a fresh run in `run_dir`."""
    return {
        "run_dir": str(run_dir),
        "run_name": "run",
        "logging_dir": str(run_dir / "tensorboard"),
        "resumed_from": None,
        "metrics_path": str(run_dir / "metrics.jsonl"),
        "kept": {},
    }


def test_rows_are_gathered_into_one_chunk_and_a_message_that_waits_goes_at_once() -> None:
    lines: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    urgent = threading.Event()
    chunks: list[list[bytes | None]] = []
    writer = threading.Thread(target=lambda: chunks.append(gather(lines, urgent, 60.0)))
    lines.put(b"row 1\n")
    writer.start()
    for step in (2, 3):  # rows later than the first wake nobody: they join its chunk
        time.sleep(0.05)
        lines.put(f"row {step}\n".encode())
    lines.put(b"flush\n")  # a message that waits for an answer does not wait for the deadline
    urgent.set()
    writer.join(timeout=30)
    assert not writer.is_alive(), "a waiting message was held back until the deadline"
    assert chunks == [[b"row 1\n", b"row 2\n", b"row 3\n", b"flush\n"]]


def test_without_an_urgent_message_the_rows_of_gather_seconds_go_together() -> None:
    lines: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    for step in (1, 2):
        lines.put(f"row {step}\n".encode())
    started = time.monotonic()
    assert gather(lines, threading.Event(), 0.2) == [b"row 1\n", b"row 2\n"]
    assert time.monotonic() - started >= 0.2  # it waited for later rows before writing
    lines.put(None)  # the end goes like any line
    assert gather(lines, threading.Event(), 0.0) == [None]


def test_the_tracker_process_runs_below_the_trainers_priority(tmp_path: Path) -> None:
    process = TrackerProcess((), _context(tmp_path))
    try:
        (worker,) = _worker_pids(os.getpid())
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, worker) == min(19, own + NICE_INCREMENT)
    finally:
        process.close("finished")


def test_flush_delivers_the_gathered_rows_without_waiting_for_the_deadline(
    tmp_path: Path, tracker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setattr(process_module, "GATHER_SECONDS", 600.0)
    process = TrackerProcess(("mlflow",), _context(tmp_path))
    try:
        for step in (1, 2, 3):
            process.log_line(json.dumps({"kind": "train", "step": step, "loss": 1.0}), step)
        done = threading.Thread(target=process.flush)
        done.start()
        done.join(timeout=120)
        assert not done.is_alive(), "flush waited for the gathering deadline"
        client = MlflowClient(tracking_uri=tracker_env["MLFLOW_TRACKING_URI"])
        (run,) = client.search_runs([client.get_experiment_by_name("drafters").experiment_id])
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert sorted(m.step for m in history) == [1, 2, 3]
    finally:
        process.close("finished")
