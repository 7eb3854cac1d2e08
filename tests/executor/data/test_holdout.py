"""The held-out slice of the training data (`data.eval_holdout`, issue 36): which conversations,
the training examples without them, and the held-out conversations read back from the input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.data.conversations import read_conversations
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.holdout import (
    TrainingExamples,
    held_out_conversations,
    held_out_indices,
    plan_held_out_conversations,
    split_dataset,
)
from dflash_recipes.executor.data.tokenize import TokenizedExample
from dflash_recipes.executor.data.train_dataset import build_dataset
from dflash_recipes.executor.evaluation.evaluate import _held_out_prompts, load_prompts
from dflash_recipes.executor.model.convert import load_tokenizer

DOMAIN = Path(__file__).resolve().parents[3] / "dflash_recipes" / "demo_data" / "data"


def test_the_choice_is_seeded_sorted_and_of_the_asked_size() -> None:
    first = held_out_indices(100, 7, seed=3)
    assert first == held_out_indices(100, 7, seed=3)
    assert len(set(first)) == 7 and list(first) == sorted(first)
    assert all(0 <= i < 100 for i in first)
    assert held_out_indices(100, 7, seed=4) != first
    # not the first or last rows of a file sorted by source: spread over the data
    assert max(first) - min(first) > 20


def test_holding_out_everything_is_refused_with_the_bound() -> None:
    with pytest.raises(DataError) as caught:
        held_out_indices(5, 5, seed=0)
    assert str(caught.value) == (
        "data.eval_holdout is 5 but the data has 5 usable conversation(s), so nothing would "
        "be left to train on; lower data.eval_holdout (at most 4) or add data"
    )
    assert len(held_out_indices(5, 4, seed=0)) == 4


def _examples(n: int) -> list[TokenizedExample]:
    return [TokenizedExample([i], [1]) for i in range(n)]


@given(n=st.integers(1, 60), data=st.data())
def test_the_training_view_is_the_examples_less_the_held_out(n: int, data: st.DataObject) -> None:
    held = data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
    view = TrainingExamples(_examples(n), sorted(held))
    expected = [i for i in range(n) if i not in held]
    assert len(view) == len(expected)
    assert [e.input_ids[0] for e in view] == expected
    assert [view.underlying(i) for i in range(len(view))] == expected
    assert [e.input_ids[0] for e in view[1:3]] == expected[1:3]
    if expected:
        assert view[-1].input_ids[0] == expected[-1]
    with pytest.raises(IndexError):
        view[len(expected)]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _conversation(question: str, answer: str) -> str:
    return json.dumps(
        {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
        }
    )


def test_held_out_examples_are_the_conversations_they_were_made_from(tmp_path: Path) -> None:
    """Example i is the i-th conversation neither the reader nor tokenizing skipped: a bad
    JSON line and a conversation too short to open a block do not shift the mapping."""
    long = "the answer is a long one, " * 4
    lines = [
        _conversation("q0", "a0 " + long),
        "{not json",
        # its answer lies past training_seq_len (64): nothing to supervise, skipped by tokenizing
        _conversation("q2 " + "many words " * 60, "a2"),
        _conversation("q3", "a3 " + long),
        _conversation("q4", "a4 " + long),
        _conversation("q5", "a5 " + long),
    ]
    data = _write(tmp_path / "train.jsonl", lines)
    plan = tiny_scratch_plan(
        tmp_path / "run",
        f"data.data_path={data}",
        "data.eval_data_path=null",
        "data.eval_holdout=2",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    tokenizer = load_tokenizer(plan)
    dataset = build_dataset(plan, tokenizer)
    assert len(dataset) == 4, dataset.summary  # lines 1, 4, 5, 6
    assert {s.line for s in dataset.stats.skipped} == {2, 3}
    examples = [dataset.examples[i] for i in range(4)]
    training, indices = split_dataset(plan, dataset)
    assert indices == held_out_indices(4, 2, seed=plan.training.seed)
    assert [e.input_ids for e in training.examples] == [
        examples[i].input_ids for i in range(4) if i not in indices
    ]
    found = held_out_conversations(
        str(data), dataset.stats, indices, answer_only_loss=plan.data.answer_only_loss
    )
    usable_lines = [1, 4, 5, 6]
    assert [c.line for c in found] == [usable_lines[i] for i in indices]
    # and the plan-level call (from the cache) finds the same ones
    assert plan_held_out_conversations(plan, tokenizer) == found


def test_an_input_shorter_than_its_tokenized_data_is_a_data_error(tmp_path: Path) -> None:
    data = _write(tmp_path / "train.jsonl", [_conversation(f"q{i}", "a" * 80) for i in range(6)])
    plan = tiny_scratch_plan(
        tmp_path / "run",
        f"data.data_path={data}",
        "data.eval_data_path=null",
        "data.eval_holdout=5",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    dataset = build_dataset(plan, load_tokenizer(plan))
    _, indices = split_dataset(plan, dataset)
    _write(data, [_conversation("q0", "a" * 80)])  # edited after tokenizing
    with pytest.raises(DataError, match=r"changed since it was tokenized; rerun"):
        held_out_conversations(str(data), dataset.stats, indices, answer_only_loss=True)


def test_a_slice_and_a_file_of_the_same_conversations_give_the_same_prompts(
    tmp_path: Path,
) -> None:
    plan = tiny_scratch_plan(
        tmp_path / "run",
        "data.eval_data_path=null",
        "data.eval_holdout=6",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    tokenizer = load_tokenizer(plan)
    held = plan_held_out_conversations(plan, tokenizer)
    assert len(held) == 6
    assert plan.data.data_path is not None
    raw = Path(plan.data.data_path).read_text(encoding="utf-8").splitlines()
    copy = _write(tmp_path / "held.jsonl", [raw[c.line - 1] for c in held])
    assert [c.messages for c in read_conversations(copy).conversations] == [
        c.messages for c in held
    ]
    assert _held_out_prompts(plan, tokenizer, held, 4) == load_prompts(copy, tokenizer, limit=4)
