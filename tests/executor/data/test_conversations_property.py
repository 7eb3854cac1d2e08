"""Property: the executor's readers raise only our own errors, whatever a file holds.

trainer_state.json (through the real checkpoint restore), training data lines and eval prompt
lines (both through read_conversations, which skips and counts bad lines).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from testkit.fuzzing import FUZZ, json_values
from testkit.tiny import tiny_plan

from dflash_recipes.data.conversations import read_conversations
from dflash_recipes.errors import DataError, DFlashRecipeError
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.training.checkpoints import (
    restore_training_checkpoint,
    save_training_checkpoint,
)

hostile = st.sampled_from(
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"messages": ' + b"9" * 5000 + b"}",
        b'{"messages": [{"role": "user", "content": "a"}], "x": NaN}',
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"conversations": [{"from": "human", "value": 1e999}]}',
    ]
)
file_bytes = st.one_of(
    st.binary(max_size=512), json_values.map(lambda v: json.dumps(v).encode("utf-8")), hostile
)
#: A conversation-shaped value with arbitrary JSON in its slots.
conversation_like = st.fixed_dictionaries(
    {"messages": st.lists(st.dictionaries(st.sampled_from(["role", "content"]), json_values))}
)


@FUZZ
@given(lines=st.lists(st.one_of(file_bytes, conversation_like.map(json.dumps).map(str.encode))))
def test_data_and_prompt_lines(tmp_path: Path, lines: list[bytes]) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines))
    for answer_only_loss in (True, False):  # training data, eval prompts
        with contextlib.suppress(DataError):
            read_conversations(path, answer_only_loss=answer_only_loss)


@FUZZ
@given(raw=file_bytes, value=json_values)
def test_trainer_state(tmp_path: Path, raw: bytes, value: Any) -> None:
    checkpoint = tmp_path / "out" / "checkpoint-00000003"
    module = DFlashDraftModel(tiny_plan(tmp_path).resolved_draft())
    if not checkpoint.exists():
        optimizer = torch.optim.AdamW(module.parameters())
        save_training_checkpoint(tmp_path / "out", 3, module, optimizer, None, {})
    state = checkpoint / "trainer_state.json"
    for content in (raw, json.dumps({"step": value, "plan_fingerprint": value}).encode()):
        state.write_bytes(content)
        with contextlib.suppress(DFlashRecipeError):
            restore_training_checkpoint(checkpoint, module)
