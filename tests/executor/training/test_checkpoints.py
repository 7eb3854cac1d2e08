"""Training checkpoints: atomic save, pruning, exact restore, no pickle execution."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from testkit.tiny import tiny_plan

from dflash_recipes.errors import CheckpointError, RunIOError
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.training import checkpoints as training_checkpoints
from dflash_recipes.executor.training.checkpoints import (
    restore_training_checkpoint,
    save_training_checkpoint,
)
from dflash_recipes.files.run_dir import complete_checkpoints


def trained(
    tmp_path: Path, seed: int = 0
) -> tuple[DFlashDraftModel, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    plan = tiny_plan(tmp_path)
    module = DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for _ in range(2):
        for p in module.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        scheduler.step()
    return module, optimizer, scheduler


def test_save_then_restore_gives_back_weights_optimizer_and_scheduler(tmp_path: Path) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    path = save_training_checkpoint(
        tmp_path / "out", 2, module, optimizer, scheduler, {"epoch": 1, "seen": [3, 4]}
    )
    assert path.name == "checkpoint-00000002"
    assert sorted(p.name for p in path.iterdir()) == [
        "model.safetensors",
        "optimizer.pt",
        "trainer_state.json",
    ]

    other, other_opt, other_sched = trained(tmp_path, seed=5)
    state = restore_training_checkpoint(path, other, other_opt, other_sched)
    assert state == {"epoch": 1, "seen": [3, 4], "step": 2}
    for (name, a), b in zip(module.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    saved_state = optimizer.state_dict()["state"]
    for key, value in other_opt.state_dict()["state"].items():
        assert torch.equal(value["exp_avg"], saved_state[key]["exp_avg"])
    assert other_sched.last_epoch == scheduler.last_epoch == 2
    assert other_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_old_checkpoints_beyond_the_limit_are_pruned(tmp_path: Path) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    for step in (1, 2, 3):
        save_training_checkpoint(
            tmp_path / "out", step, module, optimizer, scheduler, {}, save_total_limit=2
        )
    assert [step for step, _ in complete_checkpoints(tmp_path / "out")] == [2, 3]


def test_a_crash_while_saving_leaves_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    out = tmp_path / "out"
    save_training_checkpoint(out, 1, module, optimizer, scheduler, {})

    def crash(*_args: object, **_kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(training_checkpoints.torch, "save", crash)
    with pytest.raises(RunIOError, match=r"checkpoint of step 2 .*: disk full"):
        save_training_checkpoint(out, 2, module, optimizer, scheduler, {})
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-00000001"]


def test_stale_staging_directories_are_removed_on_the_next_save(tmp_path: Path) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    out = tmp_path / "out"
    (out / ".tmp-checkpoint-00000001-dead").mkdir(parents=True)
    save_training_checkpoint(out, 2, module, optimizer, scheduler, {})
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-00000002"]


def test_incomplete_checkpoint_is_refused(tmp_path: Path) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    path = save_training_checkpoint(tmp_path / "out", 4, module, optimizer, scheduler, {})
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"missing: optimizer\.pt"):
        restore_training_checkpoint(path, module)


def test_checkpoint_of_another_architecture_is_refused(tmp_path: Path) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    path = save_training_checkpoint(tmp_path / "out", 4, module, optimizer, scheduler, {})
    bigger = DFlashDraftModel(tiny_plan(tmp_path, intermediate_size=96).resolved_draft())
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight: recipe expects \[96, 64\]"):
        restore_training_checkpoint(path, bigger)


class _Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, ("open('PWNED', 'w').write('x')",))


@pytest.mark.parametrize("forced", [False, True], ids=["default", "forcing-env"])
def test_optimizer_file_is_never_unpickled_freely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forced: bool
) -> None:
    """Also with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 in the environment: torch honours it only
    where weights_only is not passed."""
    module, optimizer, scheduler = trained(tmp_path)
    path = save_training_checkpoint(tmp_path / "out", 4, module, optimizer, scheduler, {})
    with open(path / "optimizer.pt", "wb") as handle:
        pickle.dump({"optimizer": _Payload()}, handle, protocol=2)
    monkeypatch.chdir(tmp_path)
    if forced:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError, match="not written by dflash-recipe") as info:
        restore_training_checkpoint(path, module, optimizer)
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)
    assert not (tmp_path / "PWNED").exists()


def test_trainer_state_must_be_json(tmp_path: Path) -> None:
    module, optimizer, _ = trained(tmp_path)
    with pytest.raises(ValueError, match="JSON"):
        save_training_checkpoint(tmp_path / "out", 1, module, optimizer, None, {"x": object()})
    path = save_training_checkpoint(tmp_path / "out", 1, module, optimizer, None, {"loss": 0.5})
    assert json.loads((path / "trainer_state.json").read_text()) == {"loss": 0.5, "step": 1}


# ---------------------------------------------------------------------------------------------
# self-consistency: a checkpoint that disagrees with itself is refused before anything changes
# ---------------------------------------------------------------------------------------------


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in module.state_dict().items()}


def _unchanged(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(t, before[name]) for name, t in module.state_dict().items())


def test_the_saved_files_are_what_a_reader_expects(tmp_path: Path) -> None:
    module, optimizer, _ = trained(tmp_path)
    path = save_training_checkpoint(tmp_path / "out", 3, module, optimizer, None, {"b": 1, "a": 2})
    assert (path / "trainer_state.json").read_text() == '{\n  "a": 2,\n  "b": 1,\n  "step": 3\n}\n'
    with safe_open(path / "model.safetensors", framework="pt") as weights:
        assert weights.metadata() == {"format": "pt"}
        assert sorted(weights.keys()) == sorted(module.state_dict())
    blob = torch.load(path / "optimizer.pt", weights_only=True)
    assert set(blob) == {"optimizer", "scheduler"} and blob["scheduler"] is None
    # a restore that asks for no optimizer never reads optimizer.pt
    (path / "optimizer.pt").write_bytes(b"garbage")
    assert restore_training_checkpoint(path, module)["step"] == 3


def test_a_trainer_state_of_another_step_is_refused_before_the_weights_change(
    tmp_path: Path,
) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    path = save_training_checkpoint(tmp_path / "out", 4, module, optimizer, scheduler, {})
    (path / "trainer_state.json").write_text('{"step": 3}')
    other, other_opt, _ = trained(tmp_path, seed=5)
    before = _weights(other)
    with pytest.raises(CheckpointError) as info:
        restore_training_checkpoint(path, other, other_opt)
    assert str(info.value) == (
        f"{path / 'trainer_state.json'} records step 3, the directory name says 4"
    )
    assert _unchanged(other, before)
    (path / "trainer_state.json").write_text("[4]")
    with pytest.raises(CheckpointError) as info:
        restore_training_checkpoint(path, other, other_opt)
    assert str(info.value) == f"{path / 'trainer_state.json'} must hold a JSON object"
    assert _unchanged(other, before)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x80\x02}q\x00", "is unreadable ("),
        ({"scheduler": None}, "does not hold optimizer and scheduler state"),
        ([1, 2], "does not hold optimizer and scheduler state"),
        (
            {"optimizer": {"state": {}, "param_groups": []}, "scheduler": None},
            "holds no scheduler state",
        ),
    ],
    ids=["truncated", "no-optimizer", "not-a-dict", "no-scheduler"],
)
def test_an_unusable_optimizer_file_is_refused_before_anything_changes(
    tmp_path: Path, content: object, message: str
) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    path = save_training_checkpoint(tmp_path / "out", 4, module, optimizer, scheduler, {})
    if isinstance(content, bytes):
        (path / "optimizer.pt").write_bytes(content)
    else:
        torch.save(content, path / "optimizer.pt")
    other, other_opt, other_sched = trained(tmp_path, seed=5)
    before, lr = _weights(other), other_opt.param_groups[0]["lr"]
    with pytest.raises(CheckpointError) as info:
        restore_training_checkpoint(path, other, other_opt, other_sched)
    assert str(info.value).startswith(f"{path / 'optimizer.pt'} {message}")
    if message == "is unreadable (":
        assert str(info.value).endswith("); it is truncated or corrupt")
    assert _unchanged(other, before) and other_opt.param_groups[0]["lr"] == lr


def test_an_incomplete_checkpoint_names_every_missing_file(tmp_path: Path) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    path = save_training_checkpoint(tmp_path / "out", 4, module, optimizer, scheduler, {})
    (path / "optimizer.pt").unlink()
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        restore_training_checkpoint(path, module)
    assert str(info.value) == (
        f"{path} is not a complete training checkpoint (missing: model.safetensors, "
        "optimizer.pt); it was probably interrupted while saving: delete it to resume from the "
        "previous one"
    )


def test_a_failed_rename_keeps_the_earlier_checkpoints_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    out = tmp_path / "out"
    first = save_training_checkpoint(out, 1, module, optimizer, scheduler, {})
    real_rename = os.rename

    def no_space(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", no_space)
    with pytest.raises(RunIOError) as info:
        save_training_checkpoint(out, 2, module, optimizer, scheduler, {}, save_total_limit=1)
    assert str(info.value) == (
        f"cannot save the checkpoint of step 2 to {out / 'checkpoint-00000002'}: No space left "
        f"on device; no partial checkpoint was left and the earlier checkpoints in {out} are "
        "intact: free space or fix the permissions, then rerun to resume from the newest one"
    )
    monkeypatch.setattr(os, "rename", real_rename)
    assert sorted(p.name for p in out.iterdir()) == [first.name]  # not pruned, no staging


def test_pruning_keeps_the_checkpoint_just_saved_even_when_it_is_the_oldest(
    tmp_path: Path,
) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    out = tmp_path / "out"
    for step in (2, 3):
        save_training_checkpoint(out, step, module, optimizer, scheduler, {})
    # a run resumed from an older step saves step 1 again
    save_training_checkpoint(out, 1, module, optimizer, scheduler, {}, save_total_limit=2)
    assert [step for step, _ in complete_checkpoints(out)] == [1, 3]
    save_training_checkpoint(out, 4, module, optimizer, scheduler, {}, save_total_limit=1)
    assert [step for step, _ in complete_checkpoints(out)] == [4]


# ---------------------------------------------------------------------------------------------
# what a restore puts back, and what each refusal says
# ---------------------------------------------------------------------------------------------


def test_a_restore_puts_the_scheduler_back_where_it_was_and_needs_none(tmp_path: Path) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    path = save_training_checkpoint(tmp_path / "out", 2, module, optimizer, scheduler, {})
    other, other_opt, other_sched = trained(tmp_path, seed=5)
    for _ in range(3):
        other_opt.step()
        other_sched.step()
    assert other_sched.last_epoch == 5
    restore_training_checkpoint(path, other, other_opt, other_sched)
    assert other_sched.last_epoch == 2
    assert other_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    # an optimizer alone (a run without a schedule) restores without one
    assert restore_training_checkpoint(path, other, other_opt)["step"] == 2


def test_a_nan_in_the_trainer_state_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    module, optimizer, _ = trained(tmp_path)
    with pytest.raises(ValueError, match=r"JSON-serialisable \(no NaN\)"):
        save_training_checkpoint(tmp_path / "out", 1, module, optimizer, None, {"loss": math.nan})
    assert not (tmp_path / "out" / "checkpoint-00000001").exists()


def test_the_first_save_creates_a_nested_output_dir(tmp_path: Path) -> None:
    module, optimizer, _ = trained(tmp_path)
    out = tmp_path / "runs" / "a" / "out"
    path = save_training_checkpoint(out, 1, module, optimizer, None, {})
    assert path == out / "checkpoint-00000001" and path.is_dir()


def test_a_damaged_or_oversized_trainer_state_says_what_to_do(tmp_path: Path) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    path = save_training_checkpoint(tmp_path / "out", 4, module, optimizer, scheduler, {})
    state = path / "trainer_state.json"
    fix = "the checkpoint is damaged: delete it to resume from the previous one"
    state.write_text('{"step": 4')
    with pytest.raises(CheckpointError) as info:
        restore_training_checkpoint(path, module)
    assert str(info.value).startswith(f"{state}: cannot read the trainer state: ")
    assert str(info.value).endswith(f"; {fix}")
    text = '{"step": 4}'
    state.write_text(text + " " * (2**20 - len(text)))  # at the 1 MiB bound: read
    assert restore_training_checkpoint(path, module)["step"] == 4
    state.write_text(text + " " * (2**20 + 1 - len(text)))
    with pytest.raises(CheckpointError) as info:
        restore_training_checkpoint(path, module)
    assert str(info.value).startswith(f"{state}: cannot read the trainer state: ")


def test_the_refusals_of_a_restore_name_their_reason(tmp_path: Path) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    path = save_training_checkpoint(tmp_path / "out", 4, module, optimizer, scheduler, {})
    bigger = DFlashDraftModel(tiny_plan(tmp_path, intermediate_size=96).resolved_draft())
    with pytest.raises(CheckpointError) as info:
        restore_training_checkpoint(path, bigger)
    assert str(info.value).startswith(
        f"training checkpoint {path} does not match this drafter (was the recipe's architecture "
        "changed since it was saved?):\n"
    )
    with open(path / "optimizer.pt", "wb") as handle:
        pickle.dump({"optimizer": _Payload()}, handle, protocol=2)
    with pytest.raises(CheckpointError) as info:
        restore_training_checkpoint(path, module, optimizer)
    assert str(info.value) == (
        f"{path / 'optimizer.pt'} holds objects other than tensors and plain containers; it was "
        "not written by dflash-recipe and is refused (loaded with weights_only=True)"
    )
    cut = b"\x80\x02}q\x00"
    (path / "optimizer.pt").write_bytes(cut)
    with pytest.raises(Exception) as loader:  # what torch itself says about these bytes
        torch.load(path / "optimizer.pt", weights_only=True)
    lines = str(loader.value).splitlines()  # (this stream's error has no text at all)
    said = f"{type(loader.value).__name__}: {lines[0] if lines else ''}"
    with pytest.raises(CheckpointError) as info:
        restore_training_checkpoint(path, module, optimizer)
    assert str(info.value) == (
        f"{path / 'optimizer.pt'} is unreadable ({said}); it is truncated or corrupt"
    )
