"""Signals to a real `dflash-recipe run`: SIGTERM / SIGINT stop at a step boundary with a
checkpoint and the rerun continues exactly; SIGUSR1 checkpoints and training goes on; a second
signal during the save leaves the previous checkpoint the newest valid one; under torchrun a
SIGTERM to the launcher stops both ranks the same way.

The runs are separate interpreters. A ``sitecustomize`` in a folder put on their PYTHONPATH
holds an optimiser step until the test releases it (so that a signal lands mid-run, whatever
the load: no race against the end of the run) and, when asked, holds a checkpoint's or a
shard's write once its weights are on disk (so that a second signal lands during the save);
it patches the trainer's modules as they are imported, in those processes only. Nothing here
times the runs: a stop that did not happen leaves a held process, which the test's generous
deadline turns into a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.signals import (
    DUPLICATE_WINDOW_S,
    Abandoned,
    SignalWatch,
    child_pids,
)
from dflash_recipes.files.capture_manifest import read_manifest
from dflash_recipes.files.run_dir import METRICS_FILE, checkpoint_dir_name, complete_checkpoints

pytestmark = pytest.mark.timing

STEPS = 12
#: How long a test waits for a run to reach a point or to exit: a deadline that only catches a
#: run that never gets there (a stop that did not happen), never a slow machine.
DEADLINE_S = 300.0

#: How long a hook holds a run at most (the tests release it, or stop the run, long before).
HOLD_S = 600.0

_HOOKS = """
import importlib.abc
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _hold(gate, every=None):
    # Held until the test creates `gate` (or `every`); a signal's handler runs in the sleeps.
    Path(gate + ".held").touch()
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        if Path(gate).exists() or (every is not None and Path(every).exists()):
            return
        time.sleep(0.05)


def _patch_trainer(module):
    clip = module.clip_gradients
    # DFLASH_TEST_HOLD="/tmp/x/gate:4": step 4 and every later one wait in their gradient
    # clipping (after the backward: under DDP both ranks are in that step) for /tmp/x/gate-<step>,
    # or for /tmp/x/gate-all.
    prefix, _, first = os.environ.get("DFLASH_TEST_HOLD", "").rpartition(":")
    calls = [0]

    def held_clip(params, max_norm):
        calls[0] += 1
        if prefix and calls[0] >= int(first):
            _hold(f"{prefix}-{calls[0]}", every=f"{prefix}-all")
        return clip(params, max_norm)

    module.clip_gradients = held_clip


def _patch_checkpoints(module):
    marker = os.environ.get("DFLASH_TEST_SAVE_MARKER")
    if not marker:
        return
    save = module.save_file
    after = int(os.environ["DFLASH_TEST_SLOW_SAVES_AFTER"])

    def held_save(tensors, path, metadata=None):
        save(tensors, path, metadata=metadata)
        staging = Path(path).parent.name  # .tmp-checkpoint-00000003-...
        if staging.startswith(".tmp-checkpoint-") and int(staging.split("-")[2]) > after:
            Path(marker).touch()  # the weights of a staged checkpoint are on disk
            _hold(marker + ".release")  # never released: only a second signal ends it

    module.save_file = held_save


def _patch_capture(module):
    marker = os.environ.get("DFLASH_TEST_SHARD_MARKER")
    if not marker:
        return
    save = module.save_file

    def held_save(tensors, path, metadata=None):
        save(tensors, path, metadata=metadata)
        if not Path(marker).exists():  # the first shard only
            Path(marker).touch()  # a shard is being written: its temporary file is complete
            _hold(marker + ".release")

    module.save_file = held_save


_PATCHES = {
    "dflash_recipes.executor.data.capture": _patch_capture,
    "dflash_recipes.executor.training.train_step": _patch_trainer,
    "dflash_recipes.executor.training.checkpoints": _patch_checkpoints,
}


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
""".replace("HOLD_S", repr(HOLD_S))


def _env(
    tmp_path: Path,
    *,
    hold_from: int | None = None,
    save_marker: Path | None = None,
    slow_saves_after: int = 0,
) -> dict[str, str]:
    """The runs' environment: with `hold_from`, that step and every later one wait for the
    test's :func:`_gate` (:func:`_held` says when one waits); `save_marker` is touched when a
    checkpoint after `slow_saves_after` has its weights on disk, and that save is held."""
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(_HOOKS, encoding="utf-8")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hooks), env.get("PYTHONPATH")]))
    if hold_from is not None:
        env["DFLASH_TEST_HOLD"] = f"{tmp_path / 'gate'}:{hold_from}"
    if save_marker is not None:
        env["DFLASH_TEST_SAVE_MARKER"] = str(save_marker)
        env["DFLASH_TEST_SLOW_SAVES_AFTER"] = str(slow_saves_after)
    return env


def _plan_file(tmp_path: Path, name: str, *extra: str) -> Path:
    plan = tiny_scratch_plan(
        tmp_path / name,
        f"training.max_steps={STEPS}",
        "training.save_steps=1000",  # no periodic checkpoint is ever due
        "training.save_total_limit=null",
        *extra,
    )
    path = tmp_path / f"{name}.json"
    path.write_text(plan.to_json(), encoding="utf-8")
    return path


def _command(plan_file: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dflash_recipes", "run", str(plan_file), "--no-progress", *extra]


def _train_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        return []
    steps = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a row being written
            continue
        if row.get("kind") == "train":
            steps.append(int(row["step"]))
    return steps


def _final_loss(run_dir: Path) -> float:
    rows = [json.loads(x) for x in (run_dir / METRICS_FILE).read_text().splitlines()]
    assert rows[-1]["kind"] == "summary"
    return float(rows[-1]["final_loss"])


class _Run:
    """A started command whose stderr goes into a file, read whole once it ended: never a pipe
    that fills up (and blocks the command) while the test waits for something else."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as stderr:
            self.process = subprocess.Popen(command, env=env, stderr=stderr)

    def stderr(self) -> str:
        return self.log.read_bytes().decode("utf-8", errors="replace")

    def poll(self) -> int | None:
        return self.process.poll()

    def send_signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self) -> tuple[int, str]:
        """The exit status and stderr; a run still going after the deadline fails the test."""
        try:
            code = self.process.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not end: {self.stderr()[-3000:]}")
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        return code, self.stderr()


def _wait_for(condition: object, process: _Run, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():  # type: ignore[operator]
        if process.poll() is not None:
            pytest.fail(f"the run ended before {what}: {process.stderr()[-3000:]}")
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.05)


def _gate(tmp_path: Path, step: int | str) -> Path:
    """The file that lets a held run (:func:`_env`) go on with `step` ("all": every step)."""
    return tmp_path / f"gate-{step}"


def _held(gate: Path) -> Callable[[], bool]:
    """True once a run waits at `gate`."""
    return Path(f"{gate}.held").exists


def _step_on(process: _Run, tmp_path: Path, step: int) -> None:
    """Let a run held at `step` go on one step at a time until it exits or the last step is
    released. One process stops at the boundary of the step the signal reached; ranks agree on
    a signal at the next boundary, and one sent to the launcher reaches them in its own time."""
    while True:
        _gate(tmp_path, step).touch()
        if step == STEPS:
            return
        step += 1
        deadline = time.monotonic() + DEADLINE_S
        while process.poll() is None and not _held(_gate(tmp_path, step))():
            assert time.monotonic() < deadline, f"the run neither ended nor reached step {step}"
            time.sleep(0.05)
        if process.poll() is not None:
            return


def _stop(process: _Run, signum: int, go_on: Callable[[], None] | None = None) -> tuple[int, str]:
    """Send `signum`, then let a held run go on (`go_on`): the signal's handler has run by the
    time the run sees its gate. Return the exit status and stderr. A run that does not stop
    stays held: it fails at the deadline, and is killed."""
    process.send_signal(signum)
    if go_on is not None:
        go_on()
    return process.wait()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> float:
    """The final loss of the same run without a signal."""
    tmp_path = tmp_path_factory.mktemp("straight")
    plan_file = _plan_file(tmp_path, "straight")
    done = subprocess.run(
        _command(plan_file), env=_env(tmp_path), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _train_steps(tmp_path / "straight") == list(range(1, STEPS + 1))
    return _final_loss(tmp_path / "straight")


def _assert_resumes_exactly(
    tmp_path: Path, plan_file: Path, run_dir: Path, expected: float
) -> None:
    rerun = subprocess.run(
        _command(plan_file), env=_env(tmp_path), capture_output=True, text=True, check=False
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _final_loss(run_dir) == expected
    assert _train_steps(run_dir) == list(range(1, STEPS + 1))  # one row per step


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_checkpoints_the_step_reached_and_the_rerun_continues_exactly(
    tmp_path: Path, signum: signal.Signals, uninterrupted: float
) -> None:
    plan_file = _plan_file(tmp_path, "run")
    run_dir = tmp_path / "run"
    process = _Run(_command(plan_file), _env(tmp_path, hold_from=4), tmp_path / "stderr")
    _wait_for(_held(_gate(tmp_path, 4)), process, "step 4")
    code, err = _stop(process, signum, lambda: _step_on(process, tmp_path, 4))

    assert code == 128 + signum, err[-3000:]
    saved = [step for step, _ in complete_checkpoints(run_dir)]
    assert saved == [4], (saved, err[-2000:])  # the step in progress, finished
    step = saved[0]
    last = err.strip().splitlines()[-1]
    assert last == (
        f"stopped by {signum.name} after step {step} of {STEPS}: saved "
        f"{run_dir / checkpoint_dir_name(step)}; rerun the same command to resume"
    )
    assert _train_steps(run_dir) == list(range(1, step + 1))
    assert not (run_dir / "export").exists()

    _assert_resumes_exactly(tmp_path, plan_file, run_dir, uninterrupted)


@pytest.mark.slow
def test_sigusr1_writes_a_checkpoint_and_training_goes_on(
    tmp_path: Path, uninterrupted: float
) -> None:
    plan_file = _plan_file(tmp_path, "run")
    run_dir = tmp_path / "run"
    process = _Run(_command(plan_file), _env(tmp_path, hold_from=4), tmp_path / "stderr")
    _wait_for(_held(_gate(tmp_path, 4)), process, "step 4")
    process.send_signal(signal.SIGUSR1)
    _gate(tmp_path, 4).touch()
    _wait_for(_held(_gate(tmp_path, 5)), process, "step 5")
    assert [s for s, _ in complete_checkpoints(run_dir)] == [4]  # saved before step 5 began
    requested = 4
    _gate(tmp_path, "all").touch()
    code, err = process.wait()
    assert code == 0, err[-3000:]
    assert [s for s, _ in complete_checkpoints(run_dir)] == [requested, STEPS]
    assert 3 <= requested < STEPS
    assert _final_loss(run_dir) == uninterrupted
    assert _train_steps(run_dir) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_second_signal_during_the_save_leaves_the_previous_checkpoint_the_newest(
    tmp_path: Path, uninterrupted: float
) -> None:
    plan_file = _plan_file(tmp_path, "run", "training.save_steps=2")
    run_dir = tmp_path / "run"
    marker = tmp_path / "saving"
    env = _env(tmp_path, hold_from=4, save_marker=marker, slow_saves_after=2)
    process = _Run(_command(plan_file), env, tmp_path / "stderr")
    _wait_for(_held(_gate(tmp_path, 4)), process, "step 4")
    process.send_signal(signal.SIGTERM)
    _gate(tmp_path, 4).touch()
    # The stop's own save is held for good: only a second SIGTERM, abandoning it, ends the run.
    _wait_for(marker.exists, process, "the stop's save")
    time.sleep(DUPLICATE_WINDOW_S)  # at least this long: sooner is the same signal twice
    code, err = _stop(process, signal.SIGTERM)

    assert code == 143, err[-3000:]
    assert [s for s, _ in complete_checkpoints(run_dir)] == [2]
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".tmp")] == []
    newest = run_dir / checkpoint_dir_name(2)
    assert err.strip().splitlines()[-1] == (
        "stopped at once by a second SIGTERM: the step or save in progress was abandoned and "
        f"left nothing half-written; the newest valid checkpoint is {newest}; rerun the same "
        "command to resume"
    )
    _assert_resumes_exactly(tmp_path, plan_file, run_dir, uninterrupted)


@pytest.mark.slow
def test_usr1_then_sigterm_to_the_torchrun_launcher_reach_both_ranks(
    tmp_path: Path,
) -> None:
    straight = _plan_file(tmp_path, "straight", "training.per_device_train_batch_size=1")
    done = subprocess.run(
        _command(straight, "--nproc-per-node", "2"),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = _final_loss(tmp_path / "straight")

    plan_file = _plan_file(tmp_path, "run", "training.per_device_train_batch_size=1")
    run_dir = tmp_path / "run"
    command = _command(plan_file, "--nproc-per-node", "2")
    launcher = _Run(command, _env(tmp_path, hold_from=4), tmp_path / "stderr")
    _wait_for(_held(_gate(tmp_path, 4)), launcher, "step 4")
    launcher.send_signal(signal.SIGUSR1)  # passed on to the workers: a checkpoint, then on
    # One step at a time until the checkpoint is there (the launcher passes the signal on in
    # its own time); the run then waits in the step after it.
    step = 4
    while not complete_checkpoints(run_dir):
        assert step < STEPS - 1, "no checkpoint after SIGUSR1"
        _gate(tmp_path, step).touch()
        step += 1
        _wait_for(_held(_gate(tmp_path, step)), launcher, f"step {step}")
    requested = complete_checkpoints(run_dir)[0][0]
    assert requested < step
    code, err = _stop(launcher, signal.SIGTERM, lambda: _step_on(launcher, tmp_path, step))

    assert code == 143, err[-3000:]
    saved = [step for step, _ in complete_checkpoints(run_dir)]
    assert len(saved) == 2 and saved[0] == requested and saved[1] < STEPS, (saved, err[-3000:])
    step = saved[1]
    line = (
        f"stopped by SIGTERM after step {step} of {STEPS}: saved "
        f"{run_dir / checkpoint_dir_name(step)}; rerun the same command to resume"
    )
    assert err.count(line) == 1, err[-3000:]  # rank 0's line only
    assert err.strip().splitlines()[-1] == line  # torchrun ends quietly: no traceback
    assert "Traceback" not in err
    assert _train_steps(run_dir) == list(range(1, step + 1))

    rerun = subprocess.run(
        _command(plan_file, "--nproc-per-node", "2"),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _final_loss(run_dir) == expected
    assert _train_steps(run_dir) == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_finishes_the_shard_and_the_rerun_completes_the_capture(
    tmp_path: Path, signum: signal.Signals
) -> None:
    plan_file = _plan_file(tmp_path, "run")
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    command = [sys.executable, "-m", "dflash_recipes", "capture", str(plan_file)]
    options = ["--shard-mib", "1", "--no-progress"]
    done = subprocess.run(
        [*command, "--output", str(straight), *options],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    env = _env(tmp_path)
    marker = tmp_path / "writing"
    env["DFLASH_TEST_SHARD_MARKER"] = str(marker)
    process = _Run([*command, "--output", str(parts), *options], env, tmp_path / "stderr")
    _wait_for(marker.exists, process, "the first shard")
    code, err = _stop(process, signum, Path(f"{marker}.release").touch)

    assert code == 128 + signum, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"stopped by {signum.name}: the shard being written was finished; every whole shard "
        f"in {parts} is kept; rerun the same command to resume"
    )
    manifest = read_manifest(parts)
    assert not manifest.complete
    whole = [e.file for e in manifest.shards if (parts / e.file).is_file()]
    assert whole == [manifest.shards[0].file]  # the shard in progress, nothing after it
    assert not [p.name for p in parts.iterdir() if ".tmp" in p.name]

    rerun = subprocess.run(
        [*command, "--output", str(parts), *options],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert read_manifest(parts).to_dict() == read_manifest(straight).to_dict()


@pytest.mark.slow
def test_a_second_signal_during_a_shard_drops_it_and_leaves_nothing_half_written(
    tmp_path: Path,
) -> None:
    plan_file = _plan_file(tmp_path, "run")
    parts, marker = tmp_path / "parts", tmp_path / "writing"
    env = {**_env(tmp_path), "DFLASH_TEST_SHARD_MARKER": str(marker)}  # a shard held for good
    command = [sys.executable, "-m", "dflash_recipes", "capture", str(plan_file)]
    options = ["--output", str(parts), "--shard-mib", "1", "--no-progress"]
    process = _Run([*command, *options], env, tmp_path / "stderr")
    _wait_for(marker.exists, process, "the first shard")
    process.send_signal(signal.SIGTERM)  # finish this shard, then stop...
    time.sleep(DUPLICATE_WINDOW_S + 0.2)  # at least this long: sooner is the same signal twice
    code, err = _stop(process, signal.SIGTERM)  # ...no: stop now

    assert code == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"stopped by SIGTERM: the shard being written was dropped; every whole shard in "
        f"{parts} is kept; rerun the same command to resume"
    )
    manifest = read_manifest(parts)
    assert not [e.file for e in manifest.shards if (parts / e.file).exists()]
    assert not [p.name for p in parts.iterdir() if ".tmp" in p.name]


def test_the_same_signal_twice_at_once_is_one_stop_and_later_it_abandons() -> None:
    with SignalWatch() as watch:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # Slurm's and torchrun's copies of one signal
        assert watch.stop_signal == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.take_checkpoint_request() and not watch.take_checkpoint_request()
        time.sleep(DUPLICATE_WINDOW_S)
        with pytest.raises(Abandoned) as info:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here at the latest
        assert info.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_child_pids_lists_the_children_of_a_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in child_pids(os.getpid())
        assert child_pids(child.pid) == []
    finally:
        child.kill()
        child.wait()
