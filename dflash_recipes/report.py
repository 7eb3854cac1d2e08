"""`dflash-recipe report`: training plots from a run's `metrics.jsonl` (the `plot` extra).

Rows the trainer writes (one JSON object per line):

- `{"kind": "train", "step", "loss", "lr", "accuracy_by_position", "acceptance_length_estimate",
  "tokens_per_second"}` every `logging_steps`;
- `{"kind": "eval", "step", "tau", "per_position_acceptance", ...}` every `eval_steps`;
- `{"kind": "summary", ...}` once at the end.

Panels: loss over steps; estimated (and measured, when evaluated) acceptance length over steps;
accuracy by block position at the last logged step. Several runs are overlaid (warm start vs
from scratch). No torch import; matplotlib is imported only when a report is drawn.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import attrs

from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.run_layout import METRICS_FILE

PLOT_EXTRA_HINT = "pip install 'dflash-recipes[plot]'"


@attrs.frozen
class RunMetrics:
    """The rows of one run's metrics file, split by kind."""

    label: str
    train: tuple[dict[str, object], ...]
    evals: tuple[dict[str, object], ...]


def _metrics_path(run: Path) -> Path:
    run = Path(run)
    return run if run.is_file() else run / METRICS_FILE


def read_metrics(run: Path, *, label: str | None = None) -> RunMetrics:
    """Parse a run's metrics.jsonl (a run directory or the file itself)."""
    path = _metrics_path(run)
    if not path.is_file():
        msg = (
            f"{path} does not exist; pass a training.output_dir of a run started with "
            "`dflash-recipe run` (it writes metrics.jsonl every logging_steps)"
        )
        raise DFlashRecipeError(msg)
    train: list[dict[str, object]] = []
    evals: list[dict[str, object]] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                msg = f"{path}:{number}: not a JSON object ({exc.msg})"
                raise DFlashRecipeError(msg) from exc
            if not isinstance(row, dict):
                msg = f"{path}:{number}: expected a JSON object, got {type(row).__name__}"
                raise DFlashRecipeError(msg)
            kind = row.get("kind", "train")
            if kind == "train":
                for key in ("step", "loss", "accuracy_by_position", "acceptance_length_estimate"):
                    if key not in row:
                        msg = f"{path}:{number}: train row has no {key!r}"
                        raise DFlashRecipeError(msg)
                train.append(row)
            elif kind == "eval":
                evals.append(row)
    if not train:
        msg = f"{path} has no training rows yet; wait for the first logging step"
        raise DFlashRecipeError(msg)
    name = label if label is not None else Path(run).name
    return RunMetrics(label=name, train=tuple(train), evals=tuple(evals))


def _floats(rows: Sequence[dict[str, object]], key: str) -> list[float]:
    values: list[float] = []
    for row in rows:
        value = row.get(key)
        values.append(float(value) if isinstance(value, (int, float)) else math.nan)
    return values


def render_report(runs: Sequence[Path], out: Path, *, labels: Sequence[str] | None = None) -> Path:
    """Draw the report PNG for one or more runs; returns `out` (written atomically)."""
    if labels is not None and len(labels) not in (0, len(runs)):
        msg = f"got {len(labels)} labels for {len(runs)} runs; give one --label per run"
        raise DFlashRecipeError(msg)
    metrics = [read_metrics(run, label=labels[i] if labels else None) for i, run in enumerate(runs)]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        msg = f"plotting needs matplotlib: {PLOT_EXTRA_HINT}"
        raise DFlashRecipeError(msg) from exc

    fig, (ax_loss, ax_tau, ax_acc) = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in metrics:
        steps = _floats(run.train, "step")
        ax_loss.plot(steps, _floats(run.train, "loss"), label=run.label)
        (line,) = ax_tau.plot(
            steps, _floats(run.train, "acceptance_length_estimate"), label=f"{run.label} (est.)"
        )
        if run.evals:
            ax_tau.plot(
                _floats(run.evals, "step"),
                _floats(run.evals, "tau"),
                "o--",
                color=line.get_color(),
                label=f"{run.label} (measured)",
            )
        last = run.train[-1].get("accuracy_by_position")
        if isinstance(last, list) and len(last) > 1:
            positions = list(range(1, len(last)))
            ax_acc.plot(positions, [float(v) for v in last[1:]], "o-", label=run.label)
    ax_loss.set(title="training loss", xlabel="step", ylabel="loss")
    ax_tau.set(title="acceptance length", xlabel="step", ylabel="tokens per target pass")
    ax_acc.set(
        title="top-1 accuracy by block position (last log)",
        xlabel="block position k",
        ylabel="accuracy",
        ylim=(0, 1.02),
    )
    for axis in (ax_loss, ax_tau, ax_acc):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
    return out


__all__ = ["PLOT_EXTRA_HINT", "RunMetrics", "read_metrics", "render_report"]
