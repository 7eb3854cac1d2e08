"""What an export's card is gathered from: Hub ids in cache paths, data files and their
hashes, the tokenized-data cache, and which checkpoint (and measurement) the weights are."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from testkit.compiling import make_training_checkpoint
from testkit.tiny import tiny_plan

from dflash_recipes.card import gather
from dflash_recipes.card.gather import (
    CACHE_META_FILE,
    data_files,
    hub_id_from_cache_path,
    training_facts,
)
from dflash_recipes.plan.run_plan import RunPlan


def test_hub_ids_come_from_hugging_face_cache_folders_only() -> None:
    snapshot = "/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/0123"
    assert hub_id_from_cache_path(snapshot, "models") == "Qwen/Qwen3-8B"
    assert hub_id_from_cache_path(snapshot, "datasets") is None
    data = "/c/hub/datasets--HuggingFaceH4--ultrachat_200k/snapshots/ab/data/train.parquet"
    assert hub_id_from_cache_path(data, "datasets") == "HuggingFaceH4/ultrachat_200k"
    assert hub_id_from_cache_path("/models/Qwen3-8B", "models") is None  # never guessed
    assert hub_id_from_cache_path(None, "models") is None


def test_data_files_are_named_sized_and_hashed(tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    for name, text in (("a.jsonl", "1\n"), ("b.jsonl", "22\n")):
        (folder / name).write_text(text, encoding="utf-8")
    budget = [100]
    files = data_files(str(folder), "training", "data.data_path", budget)
    assert [(f.name, f.size) for f in files] == [("shards/a.jsonl", 2), ("shards/b.jsonl", 3)]
    assert files[0].sha256 == hashlib.sha256(b"1\n").hexdigest()
    assert budget == [95]
    # Past the hashing budget a file keeps its size and says why it has no hash.
    over = data_files(str(folder / "b.jsonl"), "training", "data.data_path", [2])
    assert (over[0].name, over[0].size, over[0].sha256) == ("b.jsonl", 3, None)
    assert over[0].note == "too large to hash at export"
    gone = data_files(str(tmp_path / "gone.jsonl"), "held-out", "data.eval_data_path", [100])
    assert (gone[0].name, gone[0].note) == ("gone.jsonl", "not readable at export")


def test_a_held_out_slice_is_named_on_the_training_file(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text("{}\n", encoding="utf-8")
    facts, _ = training_facts(tiny_plan(tmp_path, eval_holdout=5, seed=3))
    assert [(f.name, f.role) for f in facts.data_files] == [
        (
            "data.jsonl",
            "training, less 5 conversations held out for the held-out measurement "
            "(data.eval_holdout, seed 3)",
        )
    ]
    plain, _ = training_facts(tiny_plan(tmp_path))
    assert [(f.name, f.role) for f in plain.data_files] == [("data.jsonl", "training")]


def test_the_cache_meta_name_is_the_token_caches() -> None:
    from dflash_recipes.executor.data.token_cache import META_FILE

    assert CACHE_META_FILE == META_FILE


def _cache_entry(plan: RunPlan, name: str, *, block_size: int, tokens: int) -> None:
    entry = Path(str(plan.data.cache_dir)) / name
    entry.mkdir(parents=True)
    meta = {
        "source": plan.data.data_path,
        "key": {"answer_only_loss": True, "training_seq_len": 32, "block_size": block_size},
        "stats": {
            "num_tokens": tokens,
            "num_supervised_tokens": tokens // 2,
            "conversations_used": 3,
        },
    }
    (entry / CACHE_META_FILE).write_text(json.dumps(meta), encoding="utf-8")


def test_token_counts_come_from_the_plans_cache_entry(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, cache_dir=str(tmp_path / "cache"))
    _cache_entry(plan, "other-block-size", block_size=16, tokens=999)
    facts, _ = training_facts(plan)
    assert facts.dataset_tokens is None  # an entry for other settings is not this data
    _cache_entry(plan, "ours", block_size=plan.draft.block_size, tokens=1000)
    facts, _ = training_facts(plan)
    assert (facts.dataset_tokens, facts.supervised_tokens, facts.conversations) == (1000, 500, 3)


def _eval_rows(plan: RunPlan) -> None:
    rows = [{"kind": "eval", "step": s, "tau": t, "block_size": 4} for s, t in ((1, 1.5), (2, 2.5))]
    path = Path(plan.training.output_dir) / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_the_weights_step_and_measurement_follow_what_the_export_read(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path)
    run = Path(plan.training.output_dir)
    first = make_training_checkpoint(run, 1)
    make_training_checkpoint(run, 2)
    (first / "trainer_state.json").write_text(json.dumps({"world_size": 4}), encoding="utf-8")
    _eval_rows(plan)
    # The export at the end of `run`: the newest checkpoint, the last measurement.
    facts, measured = training_facts(plan)
    assert facts.steps == 2 and measured is not None and (measured.step, measured.tau) == (2, 2.5)
    # `export checkpoint-1`: step 1, 4 processes, the measurement of step 1 at the latest.
    facts, measured = training_facts(plan, (first,))
    assert facts.steps == 1 and facts.sequences_per_step == 2 * 1 * 4
    assert measured is not None and (measured.step, measured.tau) == (1, 1.5)
    # Another export, or a checkpoint of another run: nothing ties them to this run's metrics.
    elsewhere = make_training_checkpoint(tmp_path / "other-run", 2)
    for source in (tmp_path / "some-export", elsewhere):
        assert training_facts(plan, (source,))[1] is None


def test_hashing_stops_at_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = tiny_plan(tmp_path)
    Path(str(plan.data.data_path)).write_text("x" * 10, encoding="utf-8")
    monkeypatch.setattr(gather, "HASH_LIMIT_BYTES", 9)
    facts, _ = training_facts(plan)
    assert facts.data_files[0].sha256 is None and facts.data_files[0].size == 10


def test_an_entry_another_run_built_from_the_same_data_elsewhere_is_found(tmp_path: Path) -> None:
    """The cache is shared and keyed by content: an entry whose recorded source is another
    path (another checkout, another run's copy) counts when the data's bytes are the same."""
    from dflash_recipes.data.sources import content_sha256, resolve_source

    plan = tiny_plan(tmp_path, cache_dir=str(tmp_path / "cache"))
    assert plan.data.data_path is not None
    Path(plan.data.data_path).write_text('{"messages": []}\n', encoding="utf-8")
    ours = content_sha256(resolve_source(Path(plan.data.data_path), setting="data.data_path"))
    entry = Path(str(plan.data.cache_dir)) / "built-by-another-run"
    entry.mkdir(parents=True)
    meta: dict[str, object] = {
        "source": str(tmp_path / "elsewhere" / "domain.jsonl"),
        "key": {
            "data_sha256": "0" * 64,  # other bytes: not this data
            "answer_only_loss": True,
            "training_seq_len": 32,
            "block_size": plan.draft.block_size,
        },
        "stats": {"num_tokens": 700, "num_supervised_tokens": 300, "conversations_used": 5},
    }
    (entry / CACHE_META_FILE).write_text(json.dumps(meta), encoding="utf-8")
    facts, _ = training_facts(plan)
    assert facts.dataset_tokens is None
    key = meta["key"]
    assert isinstance(key, dict)
    key["data_sha256"] = ours
    (entry / CACHE_META_FILE).write_text(json.dumps(meta), encoding="utf-8")
    facts, _ = training_facts(plan)
    assert (facts.dataset_tokens, facts.supervised_tokens, facts.conversations) == (700, 300, 5)
