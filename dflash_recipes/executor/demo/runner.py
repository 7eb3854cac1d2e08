"""`dflash-recipe demo`: the whole warm-start story on the embedded tiny default, offline.

1. compile `recipes/tiny/tiny_released.yaml` (diagnostics shown), train a drafter from scratch
   at block size 8 and export it: this plays the part of a released drafter;
2. compile `recipes/tiny/tiny_finetune.yaml`: warm start from that export at block size 16
   (taps and mask id taken from the checkpoint's config.json), fine-tune on new data;
3. check independently that the warm start loaded every tensor bit-exactly;
4. compile and run `recipes/tiny/tiny_scratch.yaml`: the same fine-tune from scratch, same
   steps, same data, same seed;
5. measure real acceptance of both exports with speculative decoding against the target
   (lossless greedy verification) on every prompt of ``demo_data/data/eval.jsonl`` (cities no
   training file mentions), write it into each export's model card (README.md), and print
   accuracy and acceptance side by side.

Everything goes through the public path a user takes: recipe -> compile -> plan -> run. The
recipes, the target and the data are package data (``demo_data/``; ``demo_data/recipes`` is the
repository's ``recipes/tiny``), so the demo runs from an installed wheel as from a checkout.

The demo marks each run directory it creates (:data:`DEMO_MARKER`); ``--fresh`` deletes only
marked directories, and a directory of the same name that the demo did not create is refused,
never reused or deleted (``W/runs`` may hold the user's own runs).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from dflash_recipes.checkpoint.model_files import WEIGHTS_FILE
from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.diagnostics import render_text, sort_diagnostics, summary_line
from dflash_recipes.errors import DFlashRecipeError, ReplaceRefusedError
from dflash_recipes.files.run_dir import EXPORT_DIR
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.recipe.loader import load_recipe
from dflash_recipes.records import Record

if TYPE_CHECKING:
    from dflash_recipes.executor.evaluation.evaluate import AcceptanceReport

Echo = Callable[[str], None]

DEMO_DATA = Path(__file__).resolve().parents[2] / "demo_data"
#: The tiny demo recipes, as package data (``demo_data/recipes`` is the repository's
#: ``recipes/tiny``, shipped in the wheel): the demo runs from an installed package too.
RECIPES_DIR = DEMO_DATA / "recipes"
#: The recipe keys that name the demo's assets; the recipes write them relative to
#: ``recipes/tiny`` in a checkout, so the demo points them at this package's ``demo_data``.
_ASSET_KEYS = ("model.model_name_or_path", "data.data_path", "data.eval_data_path")
_ASSETS_MARK = "demo_data/"

#: The run directories the demo creates under ``WORKDIR/runs``.
DEMO_RUNS = ("released", "finetune", "scratch")
#: Written into each run directory the demo creates: only those may be deleted by --fresh.
DEMO_MARKER = ".dflash-demo-run"


def _check_demo_runs(runs: Path) -> None:
    """Refuse a demo run directory that exists but was not created (marked) by the demo."""
    for name in DEMO_RUNS:
        path = runs / name
        if (path.exists() or path.is_symlink()) and not (
            path.is_dir() and not path.is_symlink() and (path / DEMO_MARKER).is_file()
        ):
            msg = (
                f"{path} exists but was not created by the demo (it has no {DEMO_MARKER} "
                "marker), so the demo will neither reuse nor delete it; move it away or pass "
                "another --workdir"
            )
            raise ReplaceRefusedError(msg)


def clear_demo_runs(runs: Path) -> list[Path]:
    """``--fresh``: delete the run directories the demo created (marked); returns them.

    Everything else under ``runs`` (the user's own runs) is left alone; an unmarked directory
    with a demo run's name is refused before anything is deleted.
    """
    _check_demo_runs(runs)
    removed = []
    for name in DEMO_RUNS:
        path = runs / name
        if path.is_dir():
            shutil.rmtree(path)
            removed.append(path)
    return removed


def _mark_new_run(path: Path) -> None:
    if not path.exists():
        path.mkdir(parents=True)
        (path / DEMO_MARKER).write_text(
            "created by `dflash-recipe demo`; `demo --fresh` may delete this directory\n",
            encoding="utf-8",
        )


@attrs.frozen(repr=False, eq=False, slots=False)
class DemoResult(Record):
    """The figures the demo prints."""

    steps: int
    warm_accuracy: tuple[float, ...]
    scratch_accuracy: tuple[float, ...]
    warm_estimate: float
    scratch_estimate: float
    warm_tau: float
    scratch_tau: float
    warm_lossless: bool
    scratch_lossless: bool
    tensors_checked: int
    tensors_equal: int
    seconds: float


def _asset_overrides(recipe: Path) -> list[str]:
    """Overrides pointing the recipe's model and data paths at this package's demo data
    (wherever it is installed), keeping the files each recipe names."""
    loaded = load_recipe(recipe)
    values = {
        "model.model_name_or_path": loaded.model.model_name_or_path,
        "data.data_path": loaded.data.data_path,
        "data.eval_data_path": loaded.data.eval_data_path,
    }
    return [
        f"{key}={DEMO_DATA / value.split(_ASSETS_MARK, 1)[1]}"
        for key in _ASSET_KEYS
        if (value := values[key]) is not None and _ASSETS_MARK in value
    ]


def _compile(name: str, overrides: list[str], echo: Echo) -> RunPlan:
    recipe = RECIPES_DIR / name
    if not recipe.is_file():
        msg = (
            f"the demo recipe {recipe} is missing: this installation of dflash-recipes is "
            "incomplete; reinstall it (pip install --force-reinstall dflash-recipes)"
        )
        raise DFlashRecipeError(msg)
    overrides = [*_asset_overrides(recipe), *overrides]
    echo(f"$ dflash-recipe compile {_rel(recipe)} " + " ".join(overrides))
    result = compile_file(recipe, overrides=tuple(overrides))
    if result.diagnostics:
        echo(_indent(render_text(sort_diagnostics(result.diagnostics))))
    if result.plan is None:
        msg = f"{recipe} did not compile ({summary_line(result.diagnostics)})"
        raise DFlashRecipeError(msg)
    echo(f"  -> plan {result.plan.fingerprint[:16]} ({summary_line(result.diagnostics)})")
    return result.plan


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _bit_exact(plan: RunPlan) -> tuple[int, int]:
    """Warm-start a fresh drafter from the plan and compare every tensor with the file."""
    from safetensors.torch import load_file

    from dflash_recipes.executor.model.convert import convert, dflash_module, load_base_model

    assert plan.init_checkpoint is not None
    model = convert(load_base_model(plan), plan)
    own = dflash_module(model).state_dict()
    source = load_file(str(Path(plan.init_checkpoint.path) / WEIGHTS_FILE))
    equal = sum(
        1
        for name, tensor in source.items()
        if name in own and own[name].dtype == tensor.dtype and torch.equal(own[name], tensor)
    )
    return len(source), equal


def _fmt_acc(acc: tuple[float, ...]) -> str:
    return " ".join(f"{a:.2f}" for a in acc[1:])


def run_demo(workdir: Path, *, fresh: bool = False, echo: Echo = print) -> DemoResult:
    """Run the demo in `workdir` (runs are resumed/reused on a rerun unless `fresh`)."""
    from dflash_recipes.executor.evaluation.evaluate import run_eval
    from dflash_recipes.executor.training.fit import run_plan

    started = time.perf_counter()
    workdir = Path(workdir).resolve()
    runs = workdir / "runs"
    if fresh:
        clear_demo_runs(runs)
    _check_demo_runs(runs)
    for name in DEMO_RUNS:
        _mark_new_run(runs / name)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    eval_prompts = DEMO_DATA / "data" / "eval.jsonl"

    echo("== 1. a drafter trained from scratch at block size 8, exported (the 'released' one)")
    released = _compile("tiny_released.yaml", [f"training.output_dir={runs / 'released'}"], echo)
    released_summary = run_plan(released, progress=True)
    released_export = Path(released.training.output_dir) / EXPORT_DIR
    echo(
        f"  trained {released_summary.steps} steps, accuracy by position "
        f"{_fmt_acc(released_summary.accuracy_by_position)}; exported to {released_export}"
    )

    echo("\n== 2. warm-start fine-tune from that export at block size 16")
    finetune = _compile(
        "tiny_finetune.yaml",
        [
            f"training.output_dir={runs / 'finetune'}",
            f"dflash.dflash_init_checkpoint={released_export}",
        ],
        echo,
    )
    checked, equal = _bit_exact(finetune)
    echo(f"  warm start check: {equal}/{checked} tensors bit-exact copies of {released_export}")
    warm = run_plan(finetune, progress=True)

    echo("\n== 3. the same fine-tune from scratch (same data, steps, seed, block size)")
    scratch_plan = _compile("tiny_scratch.yaml", [f"training.output_dir={runs / 'scratch'}"], echo)
    scratch = run_plan(scratch_plan, progress=True)

    prompts = sum(1 for line in eval_prompts.read_text(encoding="utf-8").splitlines() if line)
    echo(
        f"\n== 4. measured acceptance (speculative decoding, greedy verification) on the "
        f"{prompts} held-out prompts"
    )
    warm_eval = run_eval(
        finetune,
        Path(finetune.training.output_dir) / EXPORT_DIR,
        eval_prompts,
        num_prompts=prompts,
    )
    scratch_eval = run_eval(
        scratch_plan,
        Path(scratch_plan.training.output_dir) / EXPORT_DIR,
        eval_prompts,
        num_prompts=prompts,
    )
    cards = [
        _measured_card(Path(plan.training.output_dir) / EXPORT_DIR, report)
        for plan, report in ((finetune, warm_eval), (scratch_plan, scratch_eval))
    ]
    echo("  model cards with these figures: " + ", ".join(_rel(card) for card in cards))
    result = DemoResult(
        steps=warm.steps,
        warm_accuracy=warm.accuracy_by_position,
        scratch_accuracy=scratch.accuracy_by_position,
        warm_estimate=warm.acceptance_length_estimate,
        scratch_estimate=scratch.acceptance_length_estimate,
        warm_tau=warm_eval.tau,
        scratch_tau=scratch_eval.tau,
        warm_lossless=warm_eval.lossless is True,  # greedy: always checked
        scratch_lossless=scratch_eval.lossless is True,
        tensors_checked=checked,
        tensors_equal=equal,
        seconds=time.perf_counter() - started,
    )
    _print_summary(result, finetune, echo)
    _maybe_report(runs, echo)
    return result


def _measured_card(export: Path, report: AcceptanceReport) -> Path:
    """Write an `eval` measurement into an export's model card, as `eval --write-card` does."""
    from dflash_recipes.card.acceptance import measurement_from_report
    from dflash_recipes.card.facts import CARD_FILE
    from dflash_recipes.card.writer import write_card_measurement

    measured = measurement_from_report(report.to_dict(), source="eval")
    if measured is None:  # no finite tau: the card keeps what it had
        return export / CARD_FILE
    return write_card_measurement(export, measured)


def _print_summary(result: DemoResult, plan: RunPlan, echo: Echo) -> None:
    block = plan.draft.block_size

    def mean(acc: tuple[float, ...]) -> float:
        return sum(acc[1:]) / max(1, len(acc) - 1)

    rows = [
        ("mean top-1 accuracy (positions 1..)", result.warm_accuracy, result.scratch_accuracy),
    ]
    echo(f"\n== summary: warm start vs from scratch, {result.steps} steps each, block {block}")
    echo(f"  {'':40s} {'warm start':>12s} {'from scratch':>13s}")
    for label, warm_acc, scratch_acc in rows:
        echo(f"  {label:40s} {mean(warm_acc):12.3f} {mean(scratch_acc):13.3f}")
    echo(
        f"  {'training-batch tau estimate':40s} {result.warm_estimate:12.2f} "
        f"{result.scratch_estimate:13.2f}"
    )
    echo(
        f"  {'measured acceptance length tau (eval)':40s} {result.warm_tau:12.2f} "
        f"{result.scratch_tau:13.2f}"
    )
    echo(
        f"  {'output equals greedy decoding':40s} {result.warm_lossless!s:>12s} "
        f"{result.scratch_lossless!s:>13s}"
    )
    echo(
        f"  warm start: {result.tensors_equal}/{result.tensors_checked} tensors loaded "
        f"bit-exact; demo took {result.seconds:.0f}s"
    )
    verdict = "better" if result.warm_tau > result.scratch_tau else "NOT better"
    ratio = result.warm_tau / result.scratch_tau
    echo(f"  the warm start is {verdict} at equal steps ({ratio:.2f}x tau)")


def _maybe_report(runs: Path, echo: Echo) -> None:
    try:
        from dflash_recipes.report import render_report

        out = render_report(
            [runs / "finetune", runs / "scratch"],
            runs / "warm_vs_scratch.png",
            labels=["warm start", "from scratch"],
        )
    except (DFlashRecipeError, ImportError) as exc:
        echo(f"  (no plot: {str(exc).splitlines()[0]})")
        return
    echo(f"  plot: {out}")


__all__ = ["DemoResult", "run_demo"]
