"""tools/launcher/launch.py renders a Slurm script for a compiled plan and never submits
without --yes."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from testkit.compiling import TINY_SCRATCH

from dflash_recipes.compiler.compilation import CompileResult, compile_file
from dflash_recipes.errors import LaunchError
from dflash_recipes.plan.run_plan import RunPlan

REPO = Path(__file__).resolve().parents[2]


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
    recipe = TINY_SCRATCH
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


def _plan(output_dir: Path) -> RunPlan:
    """The compiled plan of the tiny recipe, writing to `output_dir`."""
    result = compile_file(
        TINY_SCRATCH,
        overrides=(f"training.output_dir={output_dir}",),
    )
    assert result.plan is not None, result.diagnostics
    return result.plan


def test_render_slurm_script_for_a_plan(tmp_path: Path) -> None:
    launch = _launcher()
    plan = _plan(tmp_path / "out")
    plan_path = tmp_path / "job dir" / "plan.json"
    text = launch.render_slurm_script(
        plan_path,
        plan.fingerprint,
        nodes=4,
        gpus_per_node=8,
        partition="gpu",
        time="1-12:00:00",
        account="proj_a",
    )
    assert text.startswith("#!/bin/bash\n")
    assert f"#SBATCH --job-name=dflash-{plan.fingerprint[:12]}\n" in text
    for line in ("--nodes=4", "--gpus-per-node=8", "--partition=gpu", "--time=1-12:00:00"):
        assert f"#SBATCH {line}\n" in text
    assert "#SBATCH --account=proj_a\n" in text
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    args = shlex.split(srun.replace('"$HEAD_NODE:29500"', "HEAD:29500"))
    assert args[args.index("--nnodes") + 1] == "4"
    assert args[args.index("--nproc-per-node") + 1] == "8"
    assert args[args.index("--rdzv-endpoint") + 1] == "HEAD:29500"
    assert str(plan_path) in args  # quoted, so the space survives the shell
    assert "scontrol show hostnames" in text
    assert "sbatch" not in text.replace("#SBATCH", "")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"nodes": 0}, "must be >= 1"),
        ({"partition": "gpu\n#SBATCH --qos=high"}, "--partition"),
        ({"account": "a b"}, "--account"),
        ({"time": "90"}, "--time '90' is not HH:MM:SS"),
    ],
)
def test_invalid_slurm_values_are_refused(
    tmp_path: Path, kwargs: dict[str, object], expected: str
) -> None:
    launch = _launcher()
    options: dict[str, object] = {"nodes": 1, "gpus_per_node": 8, **kwargs}
    with pytest.raises(LaunchError, match=re.escape(expected)):
        launch.render_slurm_script(tmp_path / "p.json", "ab" * 32, **options)


def test_yes_submits_the_written_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launch = _launcher()
    plan = _plan(tmp_path / "out")
    monkeypatch.setattr(launch, "compile_file", lambda path, overrides=(): CompileResult(plan, ()))
    calls: list[list[str]] = []

    def fake_run(argv: list[str], check: bool) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    script = tmp_path / "job.sbatch"
    code = launch.main(["--yaml", "r.yaml", "--output", str(script), "--yes", "--nodes", "2"])
    assert code == 0
    assert calls == [["sbatch", str(script)]]
    assert RunPlan.from_json((tmp_path / "job.plan.json").read_text()) == plan


_FAKE_SRUN = """#!/bin/bash
# Stands in for srun: records the USR1 the batch shell passes on, ends when the job is requeued.
trap 'echo USR1 >> "$FAKE_LOG"' USR1
echo started >> "$FAKE_LOG"
while [ ! -f "$FAKE_LOG.requeued" ]; do sleep 0.05; done
exit 143
"""
_FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then echo node001; exit 0; fi
echo "scontrol $*" >> "$FAKE_LOG"
touch "$FAKE_LOG.requeued"
"""


def test_the_batch_script_passes_usr1_on_to_the_step_and_requeues(tmp_path: Path) -> None:
    import os
    import signal
    import time

    launch = _launcher()
    plan = _plan(tmp_path / "out")
    script = tmp_path / "job.sbatch"
    script.write_text(
        launch.render_slurm_script(
            tmp_path / "plan.json", plan.fingerprint, nodes=1, gpus_per_node=2
        )
    )
    assert "#SBATCH --signal=B:USR1@120\n" in script.read_text()
    assert "#SBATCH --requeue\n" in script.read_text()
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    for name, text in (("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node001",
    }
    shell = subprocess.Popen(["bash", str(script)], env=env)
    try:
        deadline = time.monotonic() + 30
        while not (log.is_file() and "started" in log.read_text()):
            assert shell.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        shell.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends to the batch shell
        assert shell.wait(timeout=30) == 143  # the step's status: Slurm sees the stop
    finally:
        if shell.poll() is None:
            shell.kill()
    lines = log.read_text().splitlines()  # (the fake srun's trap runs after its sleep)
    assert lines[0] == "started"
    assert sorted(lines[1:]) == ["USR1", "scontrol requeue 4242"]
