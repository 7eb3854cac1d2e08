"""Runtime I/O of `dflash-recipe run`: failed saves, unreadable checkpoints, metrics, summaries."""

from __future__ import annotations

import errno
import json
from collections.abc import Mapping
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from testkit.compiling import SMALL_BLOCKS, TINY_SCRATCH

from dflash_recipes.cli import main
from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.executor.training import checkpoints as training_checkpoints
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.summary import summary_line

pytestmark = pytest.mark.usefixtures("one_thread")


def _overrides(out: Path, steps: int) -> list[str]:
    return [
        f"training.output_dir={out}",
        f"training.max_steps={steps}",
        "training.save_steps=1",
        "training.logging_steps=1",
        "training.save_total_limit=null",
        *SMALL_BLOCKS,
    ]


def _run(out: Path, steps: int) -> Result:
    args = ["run", str(TINY_SCRATCH), *_overrides(out, steps), "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    return result


def _train_steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if row.get("kind") == "train"]


def _fail_on_call(n: int, exc: OSError, real: object) -> object:
    calls = {"n": 0}

    def save(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] >= n:
            raise exc
        return real(*args, **kwargs)  # type: ignore[operator]

    return save


@pytest.mark.parametrize(
    ("target", "error", "reason"),
    [
        ("save_file", OSError(errno.ENOSPC, "No space left on device"), "No space left"),
        ("torch.save", PermissionError(errno.EACCES, "Permission denied"), "Permission denied"),
    ],
)
def test_a_failed_checkpoint_save_is_one_line_and_keeps_earlier_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, error: OSError, reason: str
) -> None:
    out = tmp_path / "run"
    owner = training_checkpoints.torch if target == "torch.save" else training_checkpoints
    name = target.rsplit(".", 1)[-1]
    monkeypatch.setattr(owner, name, _fail_on_call(2, error, getattr(owner, name)))
    result = _run(out, 3)
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: cannot save the checkpoint of step 2 to {out / 'checkpoint-00000002'}: "
        f"{reason}" + errors[0].split(reason, 1)[1]
    ]
    assert "earlier checkpoints" in errors[0] and "rerun to resume" in errors[0]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint", ".tmp"))) == [
        "checkpoint-00000001"
    ]
    assert (out / "checkpoint-00000001" / "optimizer.pt").stat().st_size > 0


@pytest.mark.parametrize("broken", ["optimizer.pt", "model.safetensors"])
def test_a_corrupt_newest_checkpoint_falls_back_and_metrics_hold_each_step_once(
    tmp_path: Path, broken: str
) -> None:
    out = tmp_path / "run"
    assert _run(out, 2).exit_code == 0
    assert _train_steps(out) == [1, 2]
    newest = out / "checkpoint-00000002" / broken
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated

    result = _run(out, 3)
    assert result.exit_code == 0, result.output
    assert f"warning: checkpoint {out / 'checkpoint-00000002'} cannot be read" in result.output
    assert broken in result.output.split("cannot be read", 1)[1].splitlines()[0]
    assert f"warning: resuming from {out / 'checkpoint-00000001'}" in result.output
    assert "done: 3 steps" in result.output
    assert _train_steps(out) == [1, 2, 3]  # step 2 was redone: its old row replaced


def test_no_readable_checkpoint_is_a_clean_error(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert _run(out, 1).exit_code == 0
    (out / "checkpoint-00000001" / "optimizer.pt").write_bytes(b"\x80\x02trunc")
    result = _run(out, 2)
    assert result.exit_code == 1
    assert f"error: no checkpoint in {out} can be read to resume from" in result.output


def test_resuming_a_finished_run_reports_the_finished_state(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _run(out, 2)
    assert first.exit_code == 0
    again = _run(out, 2)
    assert again.exit_code == 0, again.output
    assert "already finished: 2 of 2 steps were done before" in again.output
    assert "loss nan" not in again.output and "loss n/a" not in again.output
    loss = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1]["loss"]
    assert f"loss {loss:.4f}" in again.output
    assert _train_steps(out) == [1, 2]


def test_a_run_stopped_early_reports_the_steps_done(tmp_path: Path) -> None:
    result = compile_file(TINY_SCRATCH, _overrides(tmp_path / "run", 3))
    assert result.plan is not None
    summary = run_plan(result.plan, progress=False, stop_after=1)
    assert (summary.steps, summary.planned_steps, summary.export_dir) == (1, 3, None)
    assert summary_line(summary).startswith("stopped after 1 of 3 steps, loss ")
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["kind"] == "summary" and row["steps"] == 1


def test_any_other_os_error_during_a_run_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflash_recipes.executor.training.trackers import jsonl

    real = jsonl.append_jsonl

    def full(path: Path, row: Mapping[str, object]) -> None:
        if row.get("kind") == "summary":  # the disk fills up at the final summary row
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, row)

    monkeypatch.setattr(jsonl, "append_jsonl", full)
    out = tmp_path / "run"
    result = _run(out, 1)
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: run stopped: cannot read or write {out / 'metrics.jsonl'}: No space left on "
        "device; the checkpoints already saved are intact: fix the cause (free space, "
        "permissions) and rerun to resume"
    ]
    assert (out / "checkpoint-00000001" / "optimizer.pt").is_file()
