"""The demo's closing table: each row says what its figure is (issue 36: the training-batch
estimate is named as such, next to the acceptance measured by drafting)."""

from __future__ import annotations

from pathlib import Path

from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.demo.runner import DemoResult, _print_summary


def test_the_summary_names_the_estimate_and_the_measurement_apart(tmp_path: Path) -> None:
    plan = tiny_scratch_plan(tmp_path / "run", "dflash.dflash_block_size=16")
    result = DemoResult(
        steps=60,
        warm_accuracy=(0.0, 0.6, 0.5),
        scratch_accuracy=(0.0, 0.4, 0.3),
        warm_estimate=3.93,
        scratch_estimate=1.83,
        warm_tau=1.91,
        scratch_tau=1.45,
        warm_lossless=True,
        scratch_lossless=True,
        tensors_checked=25,
        tensors_equal=25,
        seconds=285.0,
    )
    lines: list[str] = []
    _print_summary(result, plan, lines.append)
    assert "\n".join(lines).splitlines() == [
        "",
        "== summary: warm start vs from scratch, 60 steps each, block 16",
        "                                             warm start  from scratch",
        "  mean top-1 accuracy (positions 1..)             0.550         0.350",
        "  training-batch tau estimate                      3.93          1.83",
        "  measured acceptance length tau (eval)            1.91          1.45",
        "  output equals greedy decoding                    True          True",
        "  warm start: 25/25 tensors loaded bit-exact; demo took 285s",
        "  the warm start is better at equal steps (1.32x tau)",
    ]
