"""The chunk budget of the lm_head/loss: sized from free device memory, floored, overridable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from testkit.compiling import tiny_scratch_plan
from testkit.tiny import tiny_target

import dflash_recipes.executor.training.step as step_module
from dflash_recipes.executor.model.convert import convert, dflash_module, lm_head
from dflash_recipes.executor.training.step import DraftStep
from dflash_recipes.plan.resources.chunk_budget import (
    MAX_CHUNK_LOGITS,
    SAFETY_FRACTION,
    bytes_per_row,
    chunk_rows,
    logits_budget,
)

GIB = 2**30
#: Qwen3-8B's lm_head: a 151936 vocabulary over 4096 hidden units, bfloat16.
QWEN3_8B = {"vocab": 151936, "hidden": 4096, "dtype_bytes": 2}


def test_rows_are_the_safe_share_of_free_memory_over_the_bytes_of_a_row() -> None:
    per_row = bytes_per_row(**QWEN3_8B)
    assert per_row == 151936 * (4 * 4 + 2 * 2) + 4096 * (2 + 4)
    free = 120 * GIB
    assert chunk_rows(free, **QWEN3_8B) == int(free * SAFETY_FRACTION) // per_row
    # A 139 GiB device holds a whole step of 512 blocks of 16 (8192 rows) in one chunk,
    # where the fixed budget cut it into chunks of 441 rows.
    assert chunk_rows(139 * GIB, **QWEN3_8B) >= 8192
    assert MAX_CHUNK_LOGITS // QWEN3_8B["vocab"] == 441


def test_a_teacher_and_float32_weights_cost_more_per_row() -> None:
    plain = bytes_per_row(**QWEN3_8B)
    assert bytes_per_row(**QWEN3_8B, teacher=True) == plain + 151936 * 4 * 3
    assert bytes_per_row(vocab=100, hidden=10, dtype_bytes=4) > bytes_per_row(
        vocab=100, hidden=10, dtype_bytes=2
    )
    free = 100 * GIB
    assert chunk_rows(free, **QWEN3_8B, teacher=True) < chunk_rows(free, **QWEN3_8B)


def test_little_free_memory_keeps_the_fixed_budget_as_a_floor() -> None:
    assert chunk_rows(1 * GIB, **QWEN3_8B) == MAX_CHUNK_LOGITS // 151936
    assert chunk_rows(0, **QWEN3_8B) == 441
    assert chunk_rows(-5, vocab=10**9, hidden=8, dtype_bytes=2) == 1  # never zero rows


def test_the_budget_is_the_override_else_fixed_without_a_device_figure() -> None:
    assert logits_budget(None, **QWEN3_8B) == MAX_CHUNK_LOGITS  # CPU: today's behaviour
    assert logits_budget(139 * GIB, **QWEN3_8B, override=3000) == 3000
    sized = logits_budget(139 * GIB, **QWEN3_8B)
    assert sized == chunk_rows(139 * GIB, **QWEN3_8B) * 151936 > MAX_CHUNK_LOGITS


def test_bad_dimensions_are_refused() -> None:
    with pytest.raises(ValueError, match="vocab, hidden and dtype_bytes"):
        chunk_rows(GIB, vocab=0, hidden=8, dtype_bytes=2)


def test_the_module_needs_no_torch() -> None:
    code = (
        "import sys; import dflash_recipes.plan.resources.chunk_budget; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _step(tmp_path: Path) -> DraftStep:
    plan = tiny_scratch_plan(tmp_path)
    model = convert(tiny_target(plan), plan)
    return DraftStep(
        dflash_module(model),
        lm_head(model),
        plan.draft.objective,
    )


def test_the_step_sizes_its_chunks_from_the_free_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = _step(tmp_path)
    spec = step.drafter.spec
    batch = 2
    rows_per_block = batch * spec.block_size
    floor_blocks = MAX_CHUNK_LOGITS // (rows_per_block * spec.vocab_size)
    n_blocks = 10 * floor_blocks  # only integers: nothing of that size is allocated
    dims = {"vocab": spec.vocab_size, "hidden": spec.hidden_size, "dtype_bytes": 4}
    seen: list[torch.device] = []
    answer = 0

    def free(device: torch.device) -> int | None:
        seen.append(device)
        return answer

    monkeypatch.setattr(step_module, "free_device_bytes", free)
    for wanted in (3, 7):  # room for `wanted` times the floor's blocks
        answer = int(
            wanted * floor_blocks * rows_per_block * bytes_per_row(**dims) / SAFETY_FRACTION
        )
        blocks = step.blocks_per_chunk(batch, n_blocks)
        assert blocks == chunk_rows(answer, **dims) // rows_per_block
        assert wanted * floor_blocks - 1 <= blocks <= wanted * floor_blocks
    assert seen and seen[0] == next(step.drafter.parameters()).device
    answer = 0  # a full device: the floor
    assert step.blocks_per_chunk(batch, n_blocks) == floor_blocks
    step.max_chunk_logits = 2 * rows_per_block * spec.vocab_size  # the override wins
    assert step.blocks_per_chunk(batch, n_blocks) == 2


def test_on_cpu_the_step_keeps_the_fixed_budget(tmp_path: Path) -> None:
    step = _step(tmp_path)
    spec = step.drafter.spec
    assert step_module.free_device_bytes(torch.device("cpu")) is None
    per_block = 1 * spec.block_size * spec.vocab_size
    n_blocks = MAX_CHUNK_LOGITS // per_block + 10
    assert step.blocks_per_chunk(1, n_blocks) == MAX_CHUNK_LOGITS // per_block
