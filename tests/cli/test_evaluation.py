"""`dflash-recipe report` (runs in, a PNG out) and `eval`'s command line: the acceptance gate
(--min-tau) and the model card (--write-card)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from click.testing import Result
from testkit.cli_runner import cli
from testkit.metrics_runs import PNG_SIGNATURE, _write_run

from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.report import render_report


def test_report_of_two_runs_is_a_png(tmp_path: Path) -> None:
    warm = _write_run(tmp_path / "warm", [0.8, 0.6, 0.4], with_eval=True)
    scratch = _write_run(tmp_path / "scratch", [0.3, 0.2, 0.1], with_eval=False)
    out = render_report([warm, scratch], tmp_path / "cmp.png", labels=["warm", "scratch"])
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    import matplotlib.image

    height, width = matplotlib.image.imread(str(out)).shape[:2]
    assert (width, height) == (1500, 420)
    assert not list(tmp_path.glob(".cmp.png.tmp-*"))


def test_missing_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _write_run(tmp_path / "run", [0.5], with_eval=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(DFlashRecipeError, match=r"pip install 'dflash-recipes\[plot\]'"):
        render_report([run], tmp_path / "r.png")
    assert not (tmp_path / "r.png").exists()


# ---------------------------------------------------------------------------------------------
# eval --min-tau (the acceptance gate) and --write-card (issue 38), through the real CLI
# ---------------------------------------------------------------------------------------------

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "a drafter proposes a block and the target verifies it",
]


def _eval_files(root: Path, plan: RunPlan) -> tuple[Path, Path, Path]:
    """(plan.json, export, prompts) of a plan saved by ``saved_eval_setup`` under `root`."""
    plan_file = root / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    prompts = root / "bench.json"
    prompts.write_text(json.dumps(PROMPTS), encoding="utf-8")
    return plan_file, root / "export", prompts


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(plan.json, export, prompts) of a tiny random target and drafter."""
    from testkit.tiny import saved_eval_setup

    root = tmp_path_factory.mktemp("gate")
    plan, _ = saved_eval_setup(root, PROMPTS)
    return _eval_files(root, plan)


def _eval(exported: tuple[Path, Path, Path], *args: str) -> Result:
    plan_file, _, prompts = exported
    base = ("eval", str(plan_file), "--prompts", str(prompts), "--max-new-tokens", "6")
    return cli(*base, *args)


def _tau(exported: tuple[Path, Path, Path]) -> float:
    result = _eval(exported, "--checkpoint", str(exported[1]), "--json")
    assert result.exit_code == 0, result.output
    tau = json.loads(result.stdout)["tau"]
    assert isinstance(tau, float)
    return tau


@pytest.mark.usefixtures("one_thread")
def test_min_tau_fails_below_the_measured_tau_and_passes_at_it(
    exported: tuple[Path, Path, Path],
) -> None:
    tau = _tau(exported)
    export = str(exported[1])
    above = _eval(exported, "--checkpoint", export, "--min-tau", str(tau + 0.5))
    assert above.exit_code == 1
    shown, needed = f"{tau:.3g}", f"{tau + 0.5:.3g}"
    line = (
        f"acceptance gate failed: measured tau {shown} is below the required {needed} (--min-tau)"
    )
    assert above.stderr.strip().splitlines()[-1] == line
    assert "acceptance length tau, pooled" in above.stdout  # the report is still printed
    at = _eval(exported, "--checkpoint", export, "--min-tau", repr(tau))  # greedy: the same tau
    assert at.exit_code == 0, at.output
    assert "acceptance gate" not in at.output
    below = _eval(exported, "--checkpoint", export, "--min-tau", "0.5", "--json")
    assert below.exit_code == 0 and json.loads(below.stdout)["tau"] == tau


@pytest.mark.usefixtures("one_thread")
def test_write_card_puts_the_measurement_into_the_card(exported: tuple[Path, Path, Path]) -> None:
    export = exported[1]
    card = export / "README.md"
    assert "Not measured." in card.read_text(encoding="utf-8")
    result = _eval(exported, "--write-card", str(export), "--json")  # --checkpoint: the export
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    text = card.read_text(encoding="utf-8")
    assert "Not measured." not in text
    assert f"| acceptance length tau (pooled) | **{report['tau']:.3f}** |" in text
    digest = hashlib.sha256(exported[2].read_bytes()).hexdigest()
    assert "| prompts | 2 from `bench.json` |" in text and f"`{digest}`" in text
    assert "| max new tokens | 6 |" in text and "| thinking mode | template default |" in text
    assert str(exported[2].parent) not in text
    assert f"wrote the measurement into {card}" in result.stderr


def test_write_card_refuses_another_directory_or_an_export_without_card(
    exported: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    export = exported[1]
    other = _eval(exported, "--checkpoint", str(tmp_path), "--write-card", str(export))
    assert other.exit_code == 2
    assert "is not the --checkpoint measured" in other.stderr
    bare = tmp_path / "old"
    bare.mkdir()
    refused = _eval(exported, "--write-card", str(bare))
    assert refused.exit_code == 2
    assert f"cannot write the card of {bare}: it has no card data" in refused.stderr
    neither = _eval(exported)
    assert neither.exit_code == 2 and "pass --checkpoint DIR" in neither.stderr


# ---------------------------------------------------------------------------------------------
# eval of a DFlash 2 drafter: tau with the selector and without it (the unary argmax path)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_dflash2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(plan.json, export, prompts) of a tiny random target and DFlash 2 drafter whose
    successor codebook is not zero (so the selector decides)."""
    import torch
    from testkit.dflash2_fixtures import TINY_DFLASH2
    from testkit.tiny import saved_eval_setup

    def codebook(drafter: torch.nn.Module) -> None:
        successor = drafter.candidate_selector.successor_codebook
        successor.normal_(std=1.0, generator=torch.Generator().manual_seed(2))

    root = tmp_path_factory.mktemp("dflash2")
    plan, _ = saved_eval_setup(
        root, PROMPTS, drafter_init=codebook, projector_type="dflash2", **TINY_DFLASH2
    )
    return _eval_files(root, plan)


@pytest.mark.usefixtures("one_thread")
def test_eval_of_dflash2_prints_tau_without_the_selector(
    exported_dflash2: tuple[Path, Path, Path],
) -> None:
    export = str(exported_dflash2[1])
    measured = _eval(exported_dflash2, "--checkpoint", export, "--json")
    assert measured.exit_code == 0, measured.output
    report = json.loads(measured.stdout)
    assert report["lossless"] is True and report["mismatched_prompts_without_head"] == []
    without = report["tau_without_head"]
    assert isinstance(without, float) and 1.0 <= without <= report["drafted_tokens"] + 1
    assert isinstance(report["tau_without_head_per_prompt_mean"], float)
    shown = _eval(exported_dflash2, "--checkpoint", export)
    assert shown.exit_code == 0, shown.output
    line = (
        "acceptance length tau without the dflash2 head (the backbone's own argmax), pooled: "
        f"{without:.3f}; mean of per-prompt means: "
        f"{report['tau_without_head_per_prompt_mean']:.3f} "
        f"(the dflash2 head adds {report['tau'] - without:+.3f})"
    )
    assert line in shown.stdout.splitlines()
    # Sampled, the head-off figure is the backbone's own draws (the same seed's).
    sampled = _eval(exported_dflash2, "--checkpoint", export, "--temperature", "1")
    assert sampled.exit_code == 0, sampled.output
    assert "without the dflash2 head (the backbone's own draws), pooled: " in sampled.stdout


@pytest.mark.usefixtures("one_thread")
def test_eval_of_a_kind_without_the_head_off_figure_prints_no_such_line(
    exported: tuple[Path, Path, Path],
) -> None:
    shown = _eval(exported, "--checkpoint", str(exported[1]))
    assert shown.exit_code == 0, shown.output
    assert "without the" not in shown.stdout
    measured = json.loads(_eval(exported, "--checkpoint", str(exported[1]), "--json").stdout)
    assert measured["tau_without_head"] is None
