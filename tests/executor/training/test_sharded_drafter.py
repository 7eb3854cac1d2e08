"""The drafter sharded with FSDP2 (``training.fsdp``) on 2 gloo ranks trains as DDP does, saves
sharded checkpoints each rank writes, and resumes them on another number of ranks (issue 51).

Each test starts this file as a script on 1 or 2 ranks (:func:`testkit.ranks.run_ranks`): a
rank compiles the tiny from-scratch recipe with the test's overrides and trains it with
``run_plan``, as ``dflash-recipe run --nproc-per-node 2`` would; the test compares what the
runs wrote (metrics.jsonl, the export, the checkpoints).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

#: What keeps these runs small and comparable: a fixed number of steps, a checkpoint at each
#: step, no held-out measurement unless a test asks for one.
RUN = (
    "training.max_steps=4",
    "training.save_steps=1",
    "training.save_total_limit=2",
    "training.eval_steps=0",
    "training.warmup_ratio=0.0",
    "training.learning_rate=0.003",
)
ARCH = "dflash.dflash_architecture_config"
DOMINO = (f"{ARCH}.projector_type=domino", f"{ARCH}.emb_dim=32", f"{ARCH}.gru_hidden_dim=16")


def _worker(out_dir: str, stop_after: str, *overrides: str) -> None:
    """One rank: compile the tiny recipe into `out_dir` with `overrides` and train it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from testkit.compiling import tiny_scratch_plan

    from dflash_recipes.executor.training.fit import run_plan

    torch.set_num_threads(1)
    plan = tiny_scratch_plan(Path(out_dir), *overrides)
    run_plan(plan, progress=False, stop_after=int(stop_after) or None)


def _train(
    out: Path, *overrides: str, ranks: int = 2, stop_after: int = 0
) -> list[subprocess.CompletedProcess[str]]:
    from testkit.ranks import run_ranks  # not at the top: ranks run this file

    argv = [sys.executable, __file__, str(out), str(stop_after), *RUN, *overrides]
    results = run_ranks(argv, world_size=ranks, what=f"training {out.name}")
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stderr[-4000:]}"
    return results


def _rows(out: Path) -> list[dict[str, object]]:
    lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [row for row in map(json.loads, lines) if row["kind"] == "train"]


def _series(out: Path, key: str) -> list[float]:
    values = []
    for row in _rows(out):
        value = row[key]
        assert isinstance(value, float), (key, row)
        values.append(value)
    return values


def _export(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "export" / "model.safetensors"))


def _assert_same_run(ddp: Path, sharded: Path, *, steps: int = 4) -> None:
    """Losses and gradient norms of every step, and the exported weights, equal up to float
    rounding (the reductions sum in another order)."""
    for key in ("loss", "grad_norm"):
        expected, got = _series(ddp, key), _series(sharded, key)
        assert len(expected) == len(got) == steps, (key, expected, got)
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-6), key
    expected_w, got_w = _export(ddp), _export(sharded)
    assert set(expected_w) == set(got_w)
    for name, tensor in expected_w.items():
        torch.testing.assert_close(got_w[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def _sharded_files(checkpoint: Path) -> list[str]:
    return sorted(p.name for p in (checkpoint / "sharded").iterdir())


# ---------------------------------------------------------------------------------------------
# the sharded drafter computes what DDP computes
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [(), ("data.packing=true",), DOMINO, ("training.activation_checkpointing=true",)],
    ids=["padded", "packed", "domino", "activation-checkpointing"],
)
def test_a_sharded_drafter_trains_as_ddp_does(
    tmp_path: Path, extra: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    ddp, sharded = tmp_path / "ddp", tmp_path / "fsdp"
    built = tmp_path / "built"  # where each rank built the drafter it trains
    built.mkdir()
    monkeypatch.setenv("DFLASH_TEST_BUILT", str(built))
    _train(ddp, "training.fsdp=false", *extra)
    assert (built / "rank-1").read_text() == "cpu"  # DDP: every rank holds its whole drafter
    for rank in (0, 1):
        (built / f"rank-{rank}").unlink()
    _train(sharded, "training.fsdp=true", *extra)
    _assert_same_run(ddp, sharded)
    # A node holds one whole drafter, not one per rank: rank 1 built it on meta and got its part
    # from rank 0 (the equal runs above show the parts are rank 0's values).
    assert (built / "rank-0").read_text() == "cpu"
    assert (built / "rank-1").read_text() == "meta"
    # each rank wrote its part; no whole model.safetensors was gathered for a checkpoint
    newest = sharded / "checkpoint-00000004"
    assert not (newest / "model.safetensors").exists()
    assert _sharded_files(newest) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (ddp / "checkpoint-00000004" / "model.safetensors").is_file()
    # save_total_limit 2: the older sharded checkpoints were pruned like whole ones
    assert sorted(p.name for p in sharded.glob("checkpoint-*")) == [
        "checkpoint-00000003",
        "checkpoint-00000004",
    ]


@pytest.mark.slow
def test_accumulated_micro_batches_skip_the_reduction_until_the_last(tmp_path: Path) -> None:
    """Gradient accumulation under FSDP2 (no reduction before the last micro-batch) equals
    DDP's no_sync accumulation."""
    ddp, sharded = tmp_path / "ddp", tmp_path / "fsdp"
    accumulate = ("training.gradient_accumulation_steps=2", "training.max_steps=2")
    _train(ddp, "training.fsdp=false", *accumulate)
    _train(sharded, "training.fsdp=true", *accumulate)
    _assert_same_run(ddp, sharded, steps=2)


# ---------------------------------------------------------------------------------------------
# held-out evaluation: every rank in step
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "held_out",
    [(), ("data.eval_data_path=null", "data.eval_holdout=2")],
    ids=["eval-file", "eval-holdout"],
)
def test_held_out_evaluation_runs_on_every_rank_under_fsdp(
    tmp_path: Path, held_out: tuple[str, ...]
) -> None:
    """Target and drafter sharded: every rank measures in step (rank 0 alone would wait for
    all-gathers the others never join) and the tau is DDP's, where rank 0 measures alone."""
    evaluate = (
        "training.eval_steps=2",
        "training.eval_num_prompts=2",
        "training.eval_max_new_tokens=8",
        *held_out,
    )
    ddp, sharded = tmp_path / "ddp", tmp_path / "fsdp"
    _train(ddp, "training.fsdp=false", *evaluate)
    _train(sharded, "training.fsdp=true", *evaluate)

    def taus(out: Path) -> list[tuple[object, object]]:
        lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        return [(r["step"], r["tau"]) for r in map(json.loads, lines) if r["kind"] == "eval"]

    assert [step for step, _ in taus(ddp)] == [2, 4]
    assert taus(sharded) == pytest.approx(taus(ddp))
    _assert_same_run(ddp, sharded)


# ---------------------------------------------------------------------------------------------
# resuming a sharded checkpoint on another number of ranks
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_one_rank_and_a_whole_one_on_two(tmp_path: Path) -> None:
    """2 -> 1 and 1 -> 2 ranks continue as an uninterrupted run: training.max_steps keeps the
    schedule, the global batch changes with the ranks, so the reference changes ranks at the
    same step without a checkpoint in between being read back (the DDP run)."""
    fsdp = "training.fsdp=true"
    # reference: 2 ranks for steps 1-2, then 1 rank for 3-4, DDP and whole checkpoints
    reference = tmp_path / "reference"
    _train(reference, "training.fsdp=false", stop_after=2)
    _train(reference, "training.fsdp=false", ranks=1)
    # 2 -> 1: the sharded checkpoint of step 2 read by one process
    down = tmp_path / "down"
    _train(down, fsdp, stop_after=2)
    assert _sharded_files(down / "checkpoint-00000002")[0] == ".metadata"
    _train(down, fsdp, ranks=1)
    _assert_same_run(reference, down)
    assert (down / "checkpoint-00000004" / "model.safetensors").is_file()  # one rank: whole

    # 1 -> 2: a whole checkpoint cut into the two ranks' parts
    reference_up, up = tmp_path / "reference-up", tmp_path / "up"
    _train(reference_up, "training.fsdp=false", ranks=1, stop_after=2)
    _train(reference_up, "training.fsdp=false")
    _train(up, fsdp, ranks=1, stop_after=2)
    _train(up, fsdp)
    _assert_same_run(reference_up, up)


# ---------------------------------------------------------------------------------------------
# crash safety
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kill_9_during_a_sharded_save_resumes_the_previous_checkpoint(tmp_path: Path) -> None:
    """Both ranks killed while their parts of step 3 are being written: no checkpoint-00000003
    appears, step 2's is resumed, and the run ends as an uninterrupted one."""
    from testkit.ranks import free_port

    out, reference = tmp_path / "run", tmp_path / "reference"
    _train(reference, "training.fsdp=true")
    argv = [sys.executable, __file__, str(out), "0", *RUN, "training.fsdp=true"]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
        DFLASH_TEST_SLOW_SAVE="3",  # the ranks pause inside step 3's DCP write
    )
    procs = [
        subprocess.Popen(
            argv,
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + 300
        while not list(out.glob(".tmp-checkpoint-00000003-*/sharded/*.distcp")):
            assert time.monotonic() < deadline, "step 3's save never began"
            assert all(p.poll() is None for p in procs), "a rank ended before step 3's save"
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not (out / "checkpoint-00000003").exists()
    assert (out / "checkpoint-00000002" / "sharded" / ".metadata").is_file()
    _train(out, "training.fsdp=true")
    assert not list(out.glob(".tmp-*")), "the staging directory of the killed save was left"
    _assert_same_run(reference, out)


@pytest.mark.slow
def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's shard of one gradient turns NaN at step 2: the global norm (over every rank's
    shard) is NaN on both ranks, so both skip it; the weights of step 2 are step 1's."""
    from testkit.ranks import run_ranks

    from dflash_recipes.executor.model.draft import DFlashDraftModel
    from dflash_recipes.executor.model.weights import load_drafter_weights
    from dflash_recipes.plan.run_plan import RunPlan

    out = tmp_path / "run"
    keep = "training.save_total_limit=null"
    argv = [sys.executable, __file__, str(out), "0", *RUN, keep, "training.fsdp=true"]
    results = run_ranks(argv, env={"DFLASH_TEST_NAN_STEP": "2"}, what="the NaN run")
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stderr[-4000:]}"
    rows = _rows(out)
    assert [(r["step"], r["skipped_steps"]) for r in rows] == [(1, 0), (2, 1), (3, 0), (4, 0)]
    plan = RunPlan.from_json((out / "plan.json").read_text(encoding="utf-8"))
    weights = []
    for step in (1, 2, 3):
        drafter = DFlashDraftModel(plan.resolved_draft())
        load_drafter_weights(drafter, out / f"checkpoint-{step:08d}")
        weights.append(drafter.state_dict())
    one, two, three = weights
    assert all(torch.equal(one[k], two[k]) for k in one)  # the skipped step changed nothing
    assert not all(torch.equal(two[k], three[k]) for k in two)  # the next one trained
    assert all(torch.isfinite(t).all() for t in three.values())


def _nan_hook() -> None:
    """DFLASH_TEST_NAN_STEP=N: rank 1's shard of the first gradient is NaN at step N."""
    step = os.environ.get("DFLASH_TEST_NAN_STEP")
    if not step or os.environ.get("RANK") != "1":
        return
    import dflash_recipes.executor.training.train_step as train_step_module

    clip = train_step_module.clip_gradients
    calls = [0]

    def clip_with_nan(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == int(step):
            grad = params[0].grad
            assert grad is not None
            grad.fill_(float("nan"))
        return clip(params, max_norm)

    train_step_module.clip_gradients = clip_with_nan  # type: ignore[assignment]


def _slow_save_hook() -> None:
    """DFLASH_TEST_SLOW_SAVE=N: the DCP write of step N's checkpoint pauses (for the kill)."""
    step = os.environ.get("DFLASH_TEST_SLOW_SAVE")
    if not step:
        return
    import dflash_recipes.executor.training.checkpoints as checkpoints

    real = checkpoints.write_sharded_state

    def slow(directory: Path, *args: object) -> None:
        real(directory, *args)  # type: ignore[arg-type]
        if directory.parent.name.startswith(f".tmp-checkpoint-{int(step):08d}-"):
            time.sleep(600)  # the parts are written; .metadata is, but the rename never comes

    checkpoints.write_sharded_state = slow  # type: ignore[assignment]


def _built_drafter_hook() -> None:
    """DFLASH_TEST_BUILT=DIR: each rank writes the device type of the first drafter's
    parameters as built (before any sharding) to DIR/rank-N."""
    where = os.environ.get("DFLASH_TEST_BUILT")
    if not where:
        return
    from dflash_recipes.executor.model import draft

    init = draft.DFlashDraftModel.__init__

    def recording(self: draft.DFlashDraftModel, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        kinds = sorted({p.device.type for p in self.parameters()})
        first = Path(where, f"rank-{os.environ['RANK']}")
        if not first.exists():  # the drafter the run trains (the export builds its own later)
            first.write_text(",".join(kinds))

    draft.DFlashDraftModel.__init__ = recording  # type: ignore[method-assign]


if __name__ == "__main__":
    _nan_hook()
    _slow_save_hook()
    _built_drafter_hook()
    _worker(*sys.argv[1:])
