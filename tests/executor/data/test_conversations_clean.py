"""Executor-side readers give clean errors whatever the bytes; a huge data line stays cheap."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.tiny import tiny_plan

from dflash_recipes.data.conversations import Message, read_conversations
from dflash_recipes.errors import CheckpointError, DataError, DFlashRecipeError
from dflash_recipes.executor.data.tokenize import MAX_CHARS_PER_TOKEN, tokenize_conversation
from dflash_recipes.executor.demo.tiny_tokenizer import build_tiny_tokenizer
from dflash_recipes.executor.evaluation.evaluate import load_prompts
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.training.checkpoints import (
    restore_training_checkpoint,
    save_training_checkpoint,
)
from dflash_recipes.files.metrics_rows import read_metrics

GOOD = json.dumps(
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
)
#: JSON that Python's json module cannot take cleanly (or that is not JSON at all).
HOSTILE_LINES = {
    "deep": "[" * 100_000 + "]" * 100_000,
    "huge int": '{"messages": [], "n": ' + "7" * 5000 + "}",
    "nan": GOOD[:-1] + ', "score": NaN}',
}


def test_bad_data_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([GOOD, *HOSTILE_LINES.values(), GOOD]) + "\n", encoding="utf-8")
    file = read_conversations(path)
    assert [c.line for c in file.conversations] == [1, 5]
    assert [(s.line, s.kind) for s in file.skipped] == [(n, "invalid JSON") for n in (2, 3, 4)]
    reasons = [s.reason for s in file.skipped]
    assert "nested too deeply" in reasons[0]
    assert "an integer of 5000 digits" in reasons[1]
    assert "NaN is not valid JSON" in reasons[2]
    assert "3 invalid JSON (lines 2, 3, 4)" in file.summary


def test_a_fifo_as_data_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DFlashRecipeError, match=r"FIFO \(named pipe\), not a regular file"):
        read_conversations(fifo)


@pytest.mark.timing
def test_a_multi_megabyte_turn_is_cut_before_the_template_and_tokenizer_see_it() -> None:
    tok = build_tiny_tokenizer(["hello world, the quick brown fox"])
    seen: list[int] = []
    render = tok.apply_chat_template

    def spy(conversation: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(sum(len(m["content"]) for m in conversation))
        return render(conversation, *args, **kwargs)

    tok.apply_chat_template = spy  # type: ignore[method-assign]
    huge = "hello world " * 400_000  # 4.8 MB in one assistant turn
    messages = (Message("user", "hi"), Message("assistant", huge))
    example = tokenize_conversation(
        tok, messages, chat_template=None, answer_only_loss=True, max_len=256
    )
    assert example.truncated
    assert len(example.input_ids) == 256  # still filled to training_seq_len
    assert max(seen) <= 256 * MAX_CHARS_PER_TOKEN  # the template never saw the 4.8 MB


def _metrics(tmp_path: Path, line: str) -> Path:
    (tmp_path / "metrics.jsonl").write_text(line + "\n", encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("name", sorted(HOSTILE_LINES))
def test_a_hostile_metrics_line_is_a_clean_error_with_file_and_line(
    tmp_path: Path, name: str
) -> None:
    with pytest.raises(DFlashRecipeError) as info:
        read_metrics(_metrics(tmp_path, HOSTILE_LINES[name]))
    assert str(info.value).startswith(f"{tmp_path / 'metrics.jsonl'}:1: not a JSON object")


@pytest.mark.parametrize("name", sorted(HOSTILE_LINES))
def test_a_hostile_trainer_state_is_a_checkpoint_error(tmp_path: Path, name: str) -> None:
    plan = tiny_plan(tmp_path)
    module = DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(module.parameters())
    path = save_training_checkpoint(tmp_path / "out", 3, module, optimizer, None, {})
    (path / "trainer_state.json").write_text(HOSTILE_LINES[name], encoding="utf-8")
    with pytest.raises(CheckpointError) as info:
        restore_training_checkpoint(path, module)
    message = str(info.value)
    assert message.startswith(f"{path / 'trainer_state.json'}: cannot read the trainer state")
    assert "delete it to resume from the previous one" in message


def test_a_fifo_as_eval_prompts_names_the_option_to_change(tmp_path: Path) -> None:
    """The fix names what the user set: --prompts for eval, not the training data key."""
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    tok = build_tiny_tokenizer(["hello world"])
    with pytest.raises(DataError, match=r"set --prompts \(or data.eval_data_path\) to a JSONL"):
        load_prompts(fifo, tok)
