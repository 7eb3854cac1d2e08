"""Sharded training checkpoints (torch.distributed.checkpoint) in one process: the layout, the
crash-safety rules they share with whole ones, and the restore of either layout (issue 51).

One process writes the sharded layout as a one-rank group would (DCP needs no process group
for it); the 2-rank runs are in ``test_sharded_drafter.py``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from testkit.tiny import tiny_plan

from dflash_recipes.errors import CheckpointError, RunIOError
from dflash_recipes.executor.dist_env import detect_dist_env
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.training import checkpoints as training_checkpoints
from dflash_recipes.executor.training.checkpoints import (
    prune_checkpoints,
    restore_training_checkpoint,
    save_sharded_training_checkpoint,
    save_training_checkpoint,
)
from dflash_recipes.executor.training.setup.resume import restore_newest_readable
from dflash_recipes.files.run_dir import (
    SHARDED_CHECKPOINT_FILES,
    checkpoint_dir_name,
    complete_checkpoints,
    is_complete_checkpoint,
    is_sharded_checkpoint,
)

ONE_PROCESS = detect_dist_env("cpu", environ={})


def trained(
    tmp_path: Path, seed: int = 0
) -> tuple[DFlashDraftModel, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """A drafter and its AdamW after a few steps (`seed` gives other weights and moments)."""
    torch.manual_seed(seed)
    plan = tiny_plan(tmp_path)
    module = DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for _ in range(2 + seed):
        for p in module.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        scheduler.step()
    return module, optimizer, scheduler


def _save_sharded(out: Path, step: int, seed: int = 0, **state: object) -> Path:
    module, optimizer, scheduler = trained(out.parent, seed)
    return save_sharded_training_checkpoint(
        out, step, module, optimizer, scheduler, {"epoch": 0, **state}, ONE_PROCESS
    )


def _assert_restored(
    module: DFlashDraftModel,
    optimizer: torch.optim.AdamW,
    other: DFlashDraftModel,
    other_opt: torch.optim.AdamW,
) -> None:
    for (name, a), b in zip(module.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    saved, restored = optimizer.state_dict(), other_opt.state_dict()
    assert restored["param_groups"] == saved["param_groups"]
    for index, values in saved["state"].items():
        for key, value in values.items():
            assert torch.equal(restored["state"][index][key], value), (index, key)


def test_a_sharded_checkpoint_restores_weights_moments_and_scheduler(tmp_path: Path) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    path = save_sharded_training_checkpoint(
        tmp_path / "out", 2, module, optimizer, scheduler, {"epoch": 1}, ONE_PROCESS
    )
    assert sorted(p.name for p in path.iterdir()) == [
        "optimizer.pt",
        "sharded",
        "trainer_state.json",
    ]
    assert is_sharded_checkpoint(path) and is_complete_checkpoint(path)
    other, other_opt, other_sched = trained(tmp_path, seed=3)
    state = restore_training_checkpoint(path, other, other_opt, other_sched)
    assert state == {"epoch": 1, "step": 2}
    _assert_restored(module, optimizer, other, other_opt)
    assert other_sched.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"]
    # the restored AdamW steps on (its fused kernel takes the restored step counters)
    for p in other.parameters():
        p.grad = torch.ones_like(p)
    other_opt.step()


@pytest.mark.parametrize("missing", SHARDED_CHECKPOINT_FILES)
def test_a_sharded_checkpoint_without_any_of_its_files_is_not_complete(
    tmp_path: Path, missing: str
) -> None:
    path = _save_sharded(tmp_path / "out", 2)
    (path / missing).unlink()
    assert not is_complete_checkpoint(path)
    assert complete_checkpoints(tmp_path / "out") == []
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        restore_training_checkpoint(path, trained(tmp_path)[0])


def test_a_failed_sharded_write_leaves_no_checkpoint_and_keeps_the_older_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    _save_sharded(out, 1)

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(training_checkpoints, "write_sharded_state", full_disk)
    with pytest.raises(RunIOError, match=r"step 2.*No space left on device"):
        _save_sharded(out, 2)
    assert [step for step, _ in complete_checkpoints(out)] == [1]
    assert sorted(p.name for p in out.iterdir()) == [checkpoint_dir_name(1)]


def test_pruning_waits_for_the_new_sharded_checkpoint_and_keeps_the_last_finite_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    module, optimizer, scheduler = trained(tmp_path)

    def save(step: int, streak: int) -> Path:
        return save_sharded_training_checkpoint(
            out,
            step,
            module,
            optimizer,
            scheduler,
            {"nonfinite_streak": streak},
            ONE_PROCESS,
            save_total_limit=1,
        )

    save(1, 0)
    save(2, 0)
    assert [step for step, _ in complete_checkpoints(out)] == [2]
    save(3, 1)  # after a skipped step: step 2's, the last finite one, stays
    save(4, 2)
    assert [step for step, _ in complete_checkpoints(out)] == [2, 4]
    # a save that fails before its checkpoint is complete prunes nothing
    pruned: list[object] = []
    monkeypatch.setattr(training_checkpoints, "prune_checkpoints", lambda *a, **k: pruned.append(a))

    def fail_publish(staging: Path, final: Path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(training_checkpoints, "publish_directory", fail_publish)
    with pytest.raises(RunIOError, match="Input/output error"):
        save(5, 0)
    assert pruned == []
    assert [step for step, _ in complete_checkpoints(out)] == [2, 4]
    assert not list(out.glob(".tmp-*"))


def test_pruning_counts_sharded_and_whole_checkpoints_alike(tmp_path: Path) -> None:
    out = tmp_path / "out"
    module, optimizer, scheduler = trained(tmp_path)
    save_training_checkpoint(out, 1, module, optimizer, scheduler, {})
    _save_sharded(out, 2)
    prune_checkpoints(out, 1)
    assert [step for step, _ in complete_checkpoints(out)] == [2]


def test_a_whole_checkpoint_and_a_sharded_one_restore_the_same_state(tmp_path: Path) -> None:
    module, optimizer, scheduler = trained(tmp_path)
    whole = save_training_checkpoint(tmp_path / "a", 2, module, optimizer, scheduler, {})
    sharded = save_sharded_training_checkpoint(
        tmp_path / "b", 2, module, optimizer, scheduler, {}, ONE_PROCESS
    )
    from_whole, from_whole_opt, _ = trained(tmp_path, seed=1)
    from_sharded, from_sharded_opt, _ = trained(tmp_path, seed=2)
    restore_training_checkpoint(whole, from_whole, from_whole_opt)
    restore_training_checkpoint(sharded, from_sharded, from_sharded_opt)
    _assert_restored(from_whole, from_whole_opt, from_sharded, from_sharded_opt)


def test_a_corrupt_sharded_checkpoint_falls_back_to_the_previous_one_unchanged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    expected, expected_opt, expected_sched = trained(tmp_path, seed=0)
    good = save_sharded_training_checkpoint(
        out, 1, expected, expected_opt, expected_sched, {"epoch": 0}, ONE_PROCESS
    )
    bad = _save_sharded(out, 2, seed=1)
    part = next((bad / "sharded").glob("*.distcp"))
    part.write_bytes(part.read_bytes()[:100])  # truncated
    module, optimizer, scheduler = trained(tmp_path, seed=4)
    with caplog.at_level(logging.WARNING):
        used, state = restore_newest_readable(bad, out, module, optimizer, scheduler)
    assert used == good and state["step"] == 1
    assert "truncated or corrupt" in caplog.text
    _assert_restored(expected, expected_opt, module, optimizer)


def test_a_sharded_checkpoint_of_another_drafter_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    path = _save_sharded(tmp_path / "out", 2)
    plan = tiny_plan(tmp_path, num_hidden_layers=1)
    other = DFlashDraftModel(plan.resolved_draft())
    before = {name: t.clone() for name, t in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="does not match this drafter"):
        restore_training_checkpoint(path, other)
    for name, tensor in other.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_the_trainer_state_of_a_sharded_checkpoint_is_the_pruning_rule_s(tmp_path: Path) -> None:
    path = _save_sharded(tmp_path / "out", 3, nonfinite_streak=2)
    assert json.loads((path / "trainer_state.json").read_text())["nonfinite_streak"] == 2


class _Payload:
    """Unpickled, it would run a command: what a crafted ``.metadata`` could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_metadata_file_is_refused_without_running_it(tmp_path: Path) -> None:
    import pickle

    path = _save_sharded(tmp_path / "out", 2)
    marker = tmp_path / "ran"
    (path / "sharded" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match="not part of a checkpoint's metadata"):
        restore_training_checkpoint(path, trained(tmp_path)[0])
    assert not marker.exists()


def test_export_and_eval_read_a_sharded_checkpoint_whole(tmp_path: Path) -> None:
    """`dflash-recipe export` / `eval` of a sharded checkpoint load the drafter it holds."""
    from dflash_recipes.executor.model.weights import load_drafter_weights

    module, optimizer, scheduler = trained(tmp_path)
    path = save_sharded_training_checkpoint(
        tmp_path / "out", 2, module, optimizer, scheduler, {}, ONE_PROCESS
    )
    fresh = DFlashDraftModel(tiny_plan(tmp_path).resolved_draft())
    assert load_drafter_weights(fresh, path) == len(module.state_dict())
    for (name, a), b in zip(module.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
