"""The README's first command: the embedded demo tells the warm-start story end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_recipes.executor.demo.runner import run_demo


@pytest.mark.slow
def test_demo_warm_start_beats_scratch(tmp_path: Path) -> None:
    lines: list[str] = []
    result = run_demo(tmp_path / "demo", echo=lines.append)
    text = "\n".join(lines)
    assert result.tensors_checked > 0 and result.tensors_equal == result.tensors_checked
    assert result.warm_lossless and result.scratch_lossless
    assert result.warm_tau > result.scratch_tau
    assert sum(result.warm_accuracy[1:]) > sum(result.scratch_accuracy[1:])
    # The stage-2 compile shows the warm-start checks (taps and mask from the checkpoint,
    # the block size change allowed).
    for code in ("taps-from-checkpoint", "mask-from-checkpoint", "checkpoint-block-size-differs"):
        assert code in text
    assert "the warm start is better at equal steps" in text
    assert (tmp_path / "demo" / "runs" / "warm_vs_scratch.png").is_file()
