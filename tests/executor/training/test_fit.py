"""End-to-end training on the shipped tiny target: run, resume, data errors, DDP, schedule."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file
from testkit.compiling import tiny_scratch_plan
from testkit.dflash2_fixtures import TINY_DFLASH2_OVERRIDES

from dflash_recipes.errors import DataError, PlanError
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.files.run_dir import complete_checkpoints
from dflash_recipes.plan.run_plan import RunPlan

REPO = Path(__file__).resolve().parents[3]


pytestmark = pytest.mark.usefixtures("one_thread")


def _plan(tmp_path: Path, name: str, *extra: str) -> RunPlan:
    return tiny_scratch_plan(
        tmp_path / name,
        "training.max_steps=4",
        "training.save_steps=2",
        "training.save_total_limit=null",
        *extra,
    )


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "export" / "model.safetensors"))


def test_run_writes_checkpoints_metrics_and_export(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "run")
    summary = run_plan(plan, progress=False)
    out = tmp_path / "run"
    assert summary.steps == 4
    assert [step for step, _ in complete_checkpoints(out)] == [2, 4]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    assert len(train_rows[0]["accuracy_by_position"]) == 4
    assert rows[-1]["kind"] == "summary"
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["dflash_config"]["block_size"] == 4
    assert config["dflash_config"]["mask_token_id"] == 384
    # Plan recorded next to the run, byte-identical to what was compiled.
    assert (out / "plan.json").read_text() == plan.to_json()


def test_resume_gives_identical_weights(tmp_path: Path) -> None:
    straight = _plan(tmp_path, "straight")
    run_plan(straight, progress=False)

    # First half (stopped as if killed after step 2), then a rerun of the same recipe
    # (recompiled: the plan now resumes from the step-2 checkpoint).
    half = _plan(tmp_path, "halves")
    run_plan(half, progress=False, stop_after=2)
    assert not (tmp_path / "halves" / "export").exists()
    resumed = _plan(tmp_path, "halves")
    assert resumed.resume is not None and resumed.resume.step == 2
    summary = run_plan(resumed, progress=False)
    assert summary.resumed_from_step == 2

    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "halves")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_chunked_loss_trains_like_the_whole_batch_loss(tmp_path: Path) -> None:
    """A vocabulary too large for one chunk of logits: same losses and same training.

    AdamW's first steps move each weight by about +-lr whatever the gradient's size, so a
    float-noise difference in a near-zero gradient can show in single weights. The weights are
    therefore compared against how far training moved them, and the losses (which see every
    gradient) directly.
    """
    whole = _plan(tmp_path, "whole", "training.max_steps=2")
    run_plan(whole, progress=False)
    # One block per chunk (2 rows x 4 positions x 392 vocab > 3000 logits).
    chunked = _plan(tmp_path, "chunked", "training.max_steps=2")
    run_plan(chunked, progress=False, max_chunk_logits=3000)

    def losses(run: str) -> list[float]:
        rows = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, rows) if r["kind"] == "train"]

    assert len(losses("whole")) == 2
    assert losses("chunked") == pytest.approx(losses("whole"), rel=1e-5)

    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "chunked")
    assert a.keys() == b.keys()
    seed = torch.Generator().manual_seed(whole.training.seed)
    start = DFlashDraftModel(whole.resolved_draft(), generator=seed).state_dict()
    for name in a:
        moved = (a[name] - start[name].to(a[name].dtype)).abs().max().item()
        apart = (b[name] - a[name]).abs().max().item()
        # Training moved every tensor (two AdamW steps of lr 3e-3 are about 6e-3) ...
        assert moved > 1e-3, name
        # ... and the chunked run lands within 1% of that movement of the whole-batch run.
        assert apart < 0.01 * moved, (name, apart, moved)


def test_a_plan_continues_its_own_checkpoints_but_not_others(tmp_path: Path) -> None:
    """A requeued job reusing its plan.json continues; another plan never clobbers them."""
    plan = _plan(tmp_path, "stale")
    run_plan(plan, progress=False, stop_after=2)
    summary = run_plan(plan, progress=False)  # same plan file, e.g. a Slurm requeue
    assert summary.resumed_from_step == 2
    other = _plan(tmp_path, "stale", "training.learning_rate=5.0e-4")
    other = attrs.evolve(other, resume=None)
    with pytest.raises(PlanError, match="recompile"):
        run_plan(other, progress=False)


def test_unusable_data_stops_before_writing_anything(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": 5}\nnot json\n', encoding="utf-8")
    plan = _plan(tmp_path, "bad", f"data.data_path={bad}")
    with pytest.raises(DataError) as info:
        run_plan(plan, progress=False)
    text = str(info.value)
    assert "line 1" in text and "line 2" in text
    assert not (tmp_path / "bad").exists()


_CHUNKING_SITECUSTOMIZE = """
import os
from pathlib import Path

from dflash_recipes.executor.training.step import DraftStep

_blocks_per_chunk = DraftStep.blocks_per_chunk


def _recorded(self, batch, n_blocks):
    self.max_chunk_logits = 1000  # 1 row x 4 positions x 392 vocab > 1000: one block per chunk
    blocks = _blocks_per_chunk(self, batch, n_blocks)
    marker = Path(os.environ["DFLASH_TEST_MARKERS"]) / f"rank{os.environ.get('RANK', '-')}"
    marker.write_text(f"{blocks} of {n_blocks}")
    return blocks


DraftStep.blocks_per_chunk = _recorded
"""


def _torchrun_env() -> dict[str, str]:
    """This process's environment without a torchrun rank's variables, one thread per rank."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run_two_ranks(plan_file: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`dflash-recipe run PLAN --nproc-per-node 2` (gloo ranks) as a user starts it."""
    return subprocess.run(
        [
            *(sys.executable, "-m", "dflash_recipes", "run", str(plan_file)),
            *("--nproc-per-node", "2", "--no-progress"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_two_process_gloo_matches_one_process(tmp_path: Path) -> None:
    """Same global batch: 2 ranks x 1 sequence == 1 process x 2 sequences.

    The ranks also compute their loss in chunks of one block (a large-vocabulary run), the
    single process over the whole batch: both must still agree.
    """
    single = _plan(tmp_path, "single", "training.max_steps=3")
    run_plan(single, progress=False)

    ddp = _plan(
        tmp_path,
        "ddp",
        "training.max_steps=3",
        "training.per_device_train_batch_size=1",
    )
    plan_file = tmp_path / "ddp_plan.json"
    plan_file.write_text(ddp.to_json(), encoding="utf-8")
    env = _torchrun_env()
    hooks, markers = tmp_path / "hooks", tmp_path / "markers"
    hooks.mkdir()
    markers.mkdir()
    (hooks / "sitecustomize.py").write_text(_CHUNKING_SITECUSTOMIZE, encoding="utf-8")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hooks), env.get("PYTHONPATH")]))
    env["DFLASH_TEST_MARKERS"] = str(markers)
    proc = _run_two_ranks(plan_file, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chunked = {m.name: m.read_text() for m in markers.iterdir()}
    assert chunked == {"rank0": "1 of 4", "rank1": "1 of 4"}, chunked
    a, b = _weights(tmp_path / "single"), _weights(tmp_path / "ddp")
    assert a.keys() == b.keys()
    # Float tolerance: reduction order differs between 1 and 2 processes, and AdamW's first
    # steps move every weight by about +-lr (3e-3) whatever the gradient's size, so a
    # mismatched batch or anchor draw would show as differences of that order everywhere.
    for name in a:
        diff = (a[name].float() - b[name].float()).abs()
        assert float(diff.max()) < 1e-4, name
        assert float(diff.mean()) < 1e-7, name


def _train_and_export(tmp_path: Path, name: str, *extra: str) -> RunPlan:
    plan = _plan(tmp_path, name, "training.max_steps=2", *extra)
    run_plan(plan, progress=False)
    return plan


def test_heads_warm_start_backbone_from_plain_export_and_train(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Domino and DSpark: the backbone starts from a plain export, the heads from scratch."""
    _train_and_export(tmp_path, "plain")
    source = _weights(tmp_path / "plain")
    for projector, head_fields in (
        ("domino", ("emb_dim=32", "gru_hidden_dim=16")),
        ("dspark", ("markov_rank=8", "use_confidence_head=true")),
    ):
        arch = "dflash.dflash_architecture_config"
        plan = _plan(
            tmp_path,
            projector,
            "training.max_steps=2",
            f"dflash.dflash_init_checkpoint={tmp_path / 'plain' / 'export'}",
            f"{arch}.projector_type={projector}",
            *(f"{arch}.{field}" for field in head_fields),
            "training.learning_rate=1.0e-3",
        )
        assert plan.init_checkpoint is not None and plan.init_checkpoint.heads_from_scratch
        caplog.clear()
        with caplog.at_level("INFO"):
            summary = run_plan(plan, progress=False)
        assert math.isfinite(summary.final_loss)
        warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        for head in plan.init_checkpoint.heads_from_scratch:
            assert head in warned, (head, warned)
        trained = _weights(tmp_path / projector)
        heads = set(trained) - set(source)
        assert heads, projector
        assert set(source) <= set(trained)
        rows = (tmp_path / projector / "metrics.jsonl").read_text().splitlines()
        first = json.loads(rows[0])
        assert first["kind"] == "train" and math.isfinite(first["loss"])
        for name in heads:
            assert bool(trained[name].abs().sum() > 0), name


def _rows(run_dir: Path, kind: str) -> list[dict[str, object]]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [row for row in map(json.loads, lines) if row["kind"] == kind]


def test_self_distillation_adds_its_term_to_the_loss_and_moves_the_weights(
    tmp_path: Path,
) -> None:
    """Same seed, data and anchors with and without the term: only the term differs."""
    common = ("training.max_steps=2", "dflash.dflash_loss_objective=dpace")
    plain = _plan(tmp_path, "plain", *common)
    distill = _plan(
        tmp_path,
        "distill",
        *common,
        "training.eval_steps=2",
        "dflash.dflash_self_logit_distillation=true",
    )
    assert not plain.draft.objective.self_logit_distillation
    assert distill.draft.objective.self_logit_distillation
    run_plan(plain, progress=False)
    summary = run_plan(distill, progress=False)

    # Step 1's loss is taken at the (identical) initial weights: the cross-entropy parts are
    # equal, so the difference is the soft cross-entropy against the target, which is > 0.
    plain_loss = _rows(tmp_path / "plain", "train")[0]["loss"]
    distill_loss = _rows(tmp_path / "distill", "train")[0]["loss"]
    assert isinstance(plain_loss, float) and isinstance(distill_loss, float)
    assert distill_loss > plain_loss + 1e-3, (plain_loss, distill_loss)
    # ... and its gradient moves the drafter somewhere else.
    plain_weights = _weights(tmp_path / "plain")
    distill_weights = _weights(tmp_path / "distill")
    assert plain_weights.keys() == distill_weights.keys()
    moved = max((plain_weights[k] - distill_weights[k]).abs().max().item() for k in plain_weights)
    assert moved > 1e-6

    assert summary.last_eval_tau is not None and 1.0 <= summary.last_eval_tau <= 4.0
    evals = _rows(tmp_path / "distill", "eval")
    assert len(evals) == 1 and evals[0]["step"] == 2 and evals[0]["lossless"] is True


def test_base_model_without_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    import shutil

    from dflash_recipes.errors import CheckpointError

    target = tmp_path / "target"
    shutil.copytree(REPO / "dflash_recipes" / "demo_data" / "target", target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (target / name).unlink()
    plan = _plan(tmp_path, "notok", f"model.model_name_or_path={target}")
    with pytest.raises(CheckpointError, match="tokenizer files") as info:
        run_plan(plan, progress=False)
    assert str(target) in str(info.value)
    assert not (tmp_path / "notok").exists()


def test_parquet_a_folder_and_a_save_to_disk_folder_train_exactly_like_the_jsonl(
    tmp_path: Path,
) -> None:
    datasets = pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    plan = _plan(tmp_path, "jsonl", "training.max_steps=2")
    assert plan.data.data_path is not None
    rows = [json.loads(line) for line in Path(plan.data.data_path).read_text().splitlines()]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "train.parquet")
    (tmp_path / "parts").mkdir()
    half = len(rows) // 2
    pq.write_table(table.slice(0, half), tmp_path / "parts" / "a.parquet")
    pq.write_table(table.slice(half), tmp_path / "parts" / "b.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))

    def losses(name: str, data: str | None = None) -> list[float]:
        extra = () if data is None else (f"data.data_path={data}",)
        run_plan(_plan(tmp_path, name, "training.max_steps=2", *extra), progress=False)
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, rows) if r["kind"] == "train"]

    reference = losses("jsonl")
    assert len(reference) == 2
    for name in ("train.parquet", "parts", "saved"):
        assert losses(f"run-{name}", str(tmp_path / name)) == reference, name


def test_a_recipe_with_num_proc_2_tokenizes_and_trains_exactly_like_num_proc_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflash_recipes.executor.data import token_build

    # Small chunks and no inline limit: the 60 demo conversations really go to two processes.
    monkeypatch.setattr(token_build, "CHUNK", 8)
    monkeypatch.setattr(token_build, "INLINE_LIMIT", 0)
    arrays: dict[int, dict[str, bytes]] = {}
    losses: dict[int, list[float]] = {}
    for num_proc in (1, 2):
        name = f"np{num_proc}"
        run_plan(
            _plan(
                tmp_path,
                name,
                "training.max_steps=2",
                f"data.num_proc={num_proc}",
                f"data.cache_dir={tmp_path / name / 'data_cache'}",  # a build each, not shared
            ),
            progress=False,
        )
        (entry,) = (p for p in (tmp_path / name / "data_cache").iterdir() if p.is_dir())
        arrays[num_proc] = {p.name: p.read_bytes() for p in sorted(entry.iterdir())}
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[num_proc] = [r["loss"] for r in map(json.loads, rows) if r["kind"] == "train"]
    assert {"input_ids.bin", "loss_mask.bin", "offsets.bin", "meta.json"} <= set(arrays[1])
    assert arrays[2] == arrays[1]
    assert len(losses[1]) == 2 and losses[2] == losses[1]


def test_gradient_accumulation_equals_one_micro_step_over_the_whole_batch(
    tmp_path: Path,
) -> None:
    """Two micro-batches of one sequence (the no_sync path, the loss scaling) train like one
    batch of both, though their supervised weights differ: 5e-5 of the movement apart here;
    averaging the two micro-batches' means instead lands 2e-2 of it away.

    Compared as the whole drafter's distance over how far training moved it: AdamW's first
    steps amplify float noise in near-zero gradients in single weights (see above).
    """
    whole = _plan(tmp_path, "whole", "training.max_steps=2")
    run_plan(whole, progress=False)
    halves = _plan(
        tmp_path,
        "halves",
        "training.max_steps=2",
        "training.per_device_train_batch_size=1",
        "training.gradient_accumulation_steps=2",
    )
    run_plan(halves, progress=False)
    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "halves")
    seed = torch.Generator().manual_seed(whole.training.seed)
    start = DFlashDraftModel(whole.resolved_draft(), generator=seed).state_dict()
    moved = math.sqrt(sum(float((a[n] - start[n].to(a[n].dtype)).square().sum()) for n in a))
    apart = math.sqrt(sum(float((b[n] - a[n]).square().sum()) for n in a))
    assert moved > 1e-2
    assert apart < 1e-3 * moved, (apart, moved)


@pytest.mark.slow
def test_two_gloo_ranks_accumulating_train_like_one_process_over_the_whole_batch(
    tmp_path: Path,
) -> None:
    """2 ranks x 2 micro-batches of one sequence == 1 process x 4 sequences: the gradients
    summed over micro-batches and averaged over ranks with the step's total weight (issue 36,
    "gradient_accumulation_steps > 1 is never run by any test")."""
    whole = _plan(
        tmp_path, "whole", "training.max_steps=2", "training.per_device_train_batch_size=4"
    )
    run_plan(whole, progress=False)
    ranks = _plan(
        tmp_path,
        "ranks",
        "training.max_steps=2",
        "training.per_device_train_batch_size=1",
        "training.gradient_accumulation_steps=2",
    )
    plan_file = tmp_path / "ranks_plan.json"
    plan_file.write_text(ranks.to_json(), encoding="utf-8")
    proc = _run_two_ranks(plan_file, _torchrun_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "ranks")
    seed = torch.Generator().manual_seed(whole.training.seed)
    start = DFlashDraftModel(whole.resolved_draft(), generator=seed).state_dict()
    moved = math.sqrt(sum(float((a[n] - start[n].to(a[n].dtype)).square().sum()) for n in a))
    apart = math.sqrt(sum(float((b[n] - a[n]).square().sum()) for n in a))
    assert moved > 1e-2
    assert apart < 1e-3 * moved, (apart, moved)


def test_an_epoch_counts_optimiser_steps_not_micro_batches(tmp_path: Path) -> None:
    """max_steps unset: one epoch is batches per epoch // gradient_accumulation_steps steps."""
    one = _plan(tmp_path, "one", "training.max_steps=null", "training.num_train_epochs=1")
    two = _plan(
        tmp_path,
        "two",
        "training.max_steps=null",
        "training.num_train_epochs=1",
        "training.gradient_accumulation_steps=2",
    )
    steps_one = run_plan(one, progress=False, stop_after=1).planned_steps
    steps_two = run_plan(two, progress=False, stop_after=1).planned_steps
    assert steps_one >= 2
    assert steps_two == steps_one // 2


def test_a_dflash2_drafter_trains_from_scratch_and_resumes_to_identical_weights(
    tmp_path: Path,
) -> None:
    """DFlash 2 without an init checkpoint: every part from its initialisation; a run stopped
    at step 2 and resumed ends with the uninterrupted run's weights, selector included."""
    fields = (*TINY_DFLASH2_OVERRIDES, "dflash.dflash_selector_missing_gold=inject")
    straight = _plan(tmp_path, "straight", *fields)
    assert straight.init_checkpoint is None
    run_plan(straight, progress=False)
    half = _plan(tmp_path, "halves", *fields)
    run_plan(half, progress=False, stop_after=2)
    resumed = _plan(tmp_path, "halves", *fields)
    assert resumed.resume is not None and resumed.resume.step == 2
    run_plan(resumed, progress=False)
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "halves")
    assert a.keys() == b.keys() and "candidate_selector.successor_codebook" in a
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert a["candidate_selector.successor_codebook"].abs().sum() > 0  # trained from zero
    rows = _rows(tmp_path / "straight", "train")
    assert all(math.isfinite(float(str(r["loss"]))) for r in rows)
    assert all("selector_accuracy_by_position" in r for r in rows)
