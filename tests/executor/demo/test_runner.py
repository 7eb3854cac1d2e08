"""The README's first command: the embedded demo tells the warm-start story end to end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from testkit.readme import assert_quoted_output, quoted_block

from dflash_recipes.cli import main
from dflash_recipes.executor.demo.runner import run_demo


@pytest.mark.slow
def test_demo_warm_start_beats_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    workdir = tmp_path / "demo"
    result = run_demo(workdir, echo=lines.append)
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

    # What the README quotes of the demo: its closing table, then the eval example run in the
    # demo's work directory. The seconds and tokens/s are the machine's; so are the
    # per-proposal shares of 4 prompts, which one draft decided otherwise moves by a third.
    printed = text[text.index("== summary") :].splitlines()
    printed = [_seconds(line).replace(str(workdir.resolve()), "dflash-demo") for line in printed]
    assert_quoted_output([_seconds(line) for line in quoted_block("== summary")], printed)
    command, *quoted = quoted_block("$ dflash-recipe eval runs/finetune/plan.json")
    monkeypatch.chdir(workdir)
    evaluated = CliRunner().invoke(main, command.split()[2:])
    assert evaluated.exit_code == 0, evaluated.output
    assert_quoted_output(
        [_speed(line) for line in quoted], [_speed(line) for line in evaluated.stdout.splitlines()]
    )


def _seconds(line: str) -> str:
    return re.sub(r"demo took \d+s", "demo took Ns", line)


def _speed(line: str) -> str:
    if line.startswith("per-proposal acceptance (k=1.."):
        return line.split(":")[0]
    return re.sub(r"^[\d.]+ tokens/s", "N tokens/s", line)
