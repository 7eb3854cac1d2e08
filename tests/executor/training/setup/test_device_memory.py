"""`run`'s memory check against the device, and the disk estimate against a real checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.errors import ResourceError
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.setup.device_memory import check_device_memory
from dflash_recipes.files.run_dir import EXPORT_DIR
from dflash_recipes.plan.resources.estimate import GIB, estimate_resources

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = torch.device("cuda", 0)


def _size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def test_a_plan_larger_than_the_gpu_is_refused_with_what_would_fit(tmp_path: Path) -> None:
    plan = tiny_scratch_plan(tmp_path / "run")
    needed = estimate_resources(plan, device="cuda").memory.total
    with pytest.raises(ResourceError) as caught:
        check_device_memory(
            plan, device=CUDA, world_size=1, total_bytes=needed - 1, label="cuda:0 (test GPU)"
        )
    message = str(caught.value)
    assert "more than cuda:0 (test GPU)" in message
    assert "recompile with that change" in message
    # the tiny plan fits 1 byte less with fewer anchors or a shorter sequence
    assert "dflash.dflash_num_anchors:" in message or "training.training_seq_len:" in message


def test_a_plan_that_fits_says_so_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = tiny_scratch_plan(tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="dflash_recipes.run"):
        line = check_device_memory(
            plan, device=CUDA, world_size=1, total_bytes=80 * GIB, label="cuda:0 (test GPU)"
        )
    assert line is not None and line.endswith("fits")
    assert "cuda:0 (test GPU) has 80.00 GiB" in line
    assert [r.getMessage() for r in caplog.records] == [line]


def test_cpu_is_not_checked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plan = tiny_scratch_plan(tmp_path / "run")
    with caplog.at_level(logging.DEBUG, logger="dflash_recipes.run"):
        assert check_device_memory(plan, device=torch.device("cpu"), world_size=1) is None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_a_real_checkpoint_and_export_are_within_10_percent_of_the_estimate(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    plan = tiny_scratch_plan(
        out, "training.max_steps=1", "training.save_steps=1", "training.eval_steps=null"
    )
    run_plan(plan, progress=False)
    disk = estimate_resources(plan).disk
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1
    real = _size(checkpoints[0])
    assert abs(disk.checkpoint_bytes / real - 1) <= 0.10, (disk.checkpoint_bytes, real)
    export = _size(out / EXPORT_DIR)
    assert abs(disk.export_bytes / export - 1) <= 0.10, (disk.export_bytes, export)


def test_run_checks_memory_on_every_rank_before_it_loads_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflash_recipes.executor.training.setup import models as train

    plan = tiny_scratch_plan(tmp_path / "run", "training.max_steps=1")
    asked: list[tuple[str, int, bool, bool]] = []
    loaded: list[str] = []

    def refuse(
        plan_: object, *, device: torch.device, world_size: int, log: bool, skip: bool
    ) -> None:
        asked.append((device.type, world_size, log, skip))
        msg = "the plan needs about 99 GiB per rank"
        raise ResourceError(msg)

    def load(*args: object, **kwargs: object) -> None:
        loaded.append("target")

    monkeypatch.setattr(train, "check_device_memory", refuse)
    monkeypatch.setattr(train, "load_base_model", load)
    with pytest.raises(ResourceError, match="99 GiB"):
        run_plan(plan, progress=False)
    assert asked == [("cpu", 1, True, False)]
    assert loaded == []  # refused before the target was loaded
    assert not (tmp_path / "run" / "plan.json").exists()


def test_the_check_sizes_the_loss_chunks_from_the_devices_memory(tmp_path: Path) -> None:
    """On a 141 GiB device the step holds every block's logits in one chunk (chunk_budget), so
    the check's estimate is the one sized for that device, above the fixed floor's."""
    from testkit.fixture_8b import make_fixture

    from dflash_recipes.compiler.compilation import compile_file
    from dflash_recipes.plan.resources.estimate import gib

    make_fixture(tmp_path, target_weights=True)
    recipe = Path(__file__).resolve().parents[4] / "recipes/Qwen/Qwen3-8B/hf_online_dflash.yaml"
    result = compile_file(
        recipe,
        overrides=(
            f"model.model_name_or_path={tmp_path / 'base'}",
            f"data.data_path={tmp_path / 'data' / 'train.jsonl'}",
            f"training.output_dir={tmp_path / 'runs'}",
        ),
    )
    assert result.plan is not None
    line = check_device_memory(
        result.plan, device=CUDA, world_size=1, total_bytes=141 * GIB, label="big", log=False
    )
    sized = estimate_resources(result.plan, device="cuda", device_bytes=141 * GIB).memory.total
    assert line is not None and f"about {gib(sized)} GiB per rank" in line
    assert sized > estimate_resources(result.plan, device="cuda").memory.total


def test_the_check_can_be_skipped_with_a_warning_of_what_was_measured(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 49: the estimate is an estimate; `run --skip-memory-check` trains anyway and says
    what the device has and what the estimate needs."""
    plan = tiny_scratch_plan(tmp_path / "run")
    needed = estimate_resources(plan, device="cuda").memory.total
    with pytest.raises(ResourceError) as refused:
        check_device_memory(plan, device=CUDA, world_size=1, total_bytes=needed - 1, label="g")
    assert str(refused.value).endswith(
        "recompile with that change, use a device with more memory, or run with "
        "--skip-memory-check if the estimate is wrong for this device"
    )
    with caplog.at_level(logging.INFO, logger="dflash_recipes.run"):
        line = check_device_memory(
            plan, device=CUDA, world_size=1, total_bytes=needed - 1, label="g", skip=True
        )
    assert line is not None
    refusal, advice = str(refused.value).split("; ", 1)
    assert line == (
        f"warning: memory check skipped (--skip-memory-check): by the estimate {refusal}; "
        "training anyway, so an out-of-memory error may stop the run (the estimate's advice: "
        f"{advice.split('; recompile with that change')[0]})"
    )
    assert f"the plan needs about {needed / GIB:.2f} GiB per rank" in line
    assert f"more than g ({(needed - 1) / GIB:.2f} GiB)" in line
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, line)]
    fits = check_device_memory(plan, device=CUDA, world_size=1, total_bytes=needed, skip=True)
    assert fits is not None and fits.endswith("fits")  # a plan that fits: no warning


def test_run_hands_the_skip_to_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_plan(skip_memory_check=True) reaches the check that build_models makes."""
    from dflash_recipes.executor.training.setup import models

    seen: list[bool] = []

    def recording(*args: object, skip: bool = False, **kwargs: object) -> str | None:
        seen.append(skip)
        return check_device_memory(*args, skip=skip, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(models, "check_device_memory", recording)
    overrides = ("training.max_steps=1", "training.save_steps=1")
    run_plan(tiny_scratch_plan(tmp_path / "a", *overrides), progress=False)
    run_plan(tiny_scratch_plan(tmp_path / "b", *overrides), progress=False, skip_memory_check=True)
    assert seen == [False, True]
