"""`dflash-recipe report`: the metrics schema a run writes, and a PNG drawn from one or more runs.

The trainer appends one JSON object per line to `output_dir/metrics.jsonl`
(:data:`dflash_recipes.files.run_dir.METRICS_FILE`). The row schema lives here so writer and
reader share it (build rows with :func:`train_row` / :func:`eval_row`, serialise them with
:func:`metrics_json_line`):

- a training row (:class:`MetricsRow`, `"kind": "train"`) every `logging_steps`;
- an evaluation row (:class:`EvalMetricsRow`, `"kind": "eval"`) whenever acceptance is measured
  by drafting and greedy verification (tau); extra keys (the full eval report) are allowed;
- rows of other kinds (the trainer's final `"summary"`) are not plotted.

`accuracy_by_position[k]` is the top-1 accuracy at block position `k`. Position 0 is the anchor
(given, never predicted) and is not plotted; positions without supervision may be null.
Non-finite numbers (NaN) read as missing points.

:func:`render_report` draws loss, estimated and measured acceptance length over steps, and
accuracy by block position at the last logged step, one line per run (two runs: a warm-start
vs. from-scratch comparison). It needs matplotlib (`pip install 'dflash-recipes[plot]'`),
imported only when a report is drawn, without touching pyplot's global backend. No torch here.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict

import attrs

from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.files.jsonio import FileReadProblem, JsonProblem, parse_json, read_regular_file
from dflash_recipes.files.run_dir import METRICS_FILE
from dflash_recipes.records import Record

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# -- the metrics schema ------------------------------------------------------------------------

KEY_KIND = "kind"
KIND_TRAIN = "train"
KIND_EVAL = "eval"
KEY_STEP = "step"
KEY_LOSS = "loss"
KEY_LR = "lr"
KEY_ACCURACY_BY_POSITION = "accuracy_by_position"
KEY_ACCEPTANCE_LENGTH_ESTIMATE = "acceptance_length_estimate"
KEY_TOKENS_PER_SECOND = "tokens_per_second"
KEY_TAU = "tau"

#: Keys every training row carries (besides `kind`).
TRAIN_KEYS: tuple[str, ...] = (
    KEY_STEP,
    KEY_LOSS,
    KEY_LR,
    KEY_ACCURACY_BY_POSITION,
    KEY_ACCEPTANCE_LENGTH_ESTIMATE,
    KEY_TOKENS_PER_SECOND,
)
#: Keys every evaluation row carries (besides `kind`).
EVAL_KEYS: tuple[str, ...] = (KEY_STEP, KEY_TAU)

PLOT_EXTRA_HINT = "pip install 'dflash-recipes[plot]'"

#: A metrics file of a very long run is a few tens of megabytes.
METRICS_MAX_BYTES = 1 << 30


class MetricsRow(TypedDict):
    """One training log line (`"kind": "train"`), written every `logging_steps`."""

    kind: Literal["train"]
    #: Optimizer steps completed (1-based).
    step: int
    #: Weighted loss averaged over the logging window and over ranks; None if not finite.
    loss: float | None
    #: Learning rate after this step.
    lr: float
    #: Top-1 accuracy per block position k (index = position); None where k has no loss.
    accuracy_by_position: list[float | None]
    #: Expected accepted prefix + 1, from the per-position accuracies.
    acceptance_length_estimate: float | None
    #: Training tokens per second over the logging window (all ranks).
    tokens_per_second: float
    #: Gradient norm before clipping, when the trainer measures it.
    grad_norm: NotRequired[float | None]


class EvalMetricsRow(TypedDict):
    """One evaluation line (`"kind": "eval"`): acceptance measured by real drafting."""

    kind: Literal["eval"]
    #: The training step the evaluated weights come from.
    step: int
    #: Mean acceptance length (tokens committed per target pass).
    tau: float
    #: Fraction of drafts whose block position k was accepted (index = position).
    per_position_acceptance: NotRequired[list[float | None]]


def _finite_or_none(value: float | None) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def train_row(
    *,
    step: int,
    loss: float | None,
    lr: float,
    accuracy_by_position: Sequence[float | None],
    acceptance_length_estimate: float | None,
    tokens_per_second: float,
    grad_norm: float | None = None,
) -> MetricsRow:
    """A training row with exactly the schema's keys; NaN/inf become None (JSON null)."""
    row: MetricsRow = {
        "kind": "train",
        "step": int(step),
        "loss": _finite_or_none(loss),
        "lr": float(lr),
        "accuracy_by_position": [_finite_or_none(a) for a in accuracy_by_position],
        "acceptance_length_estimate": _finite_or_none(acceptance_length_estimate),
        "tokens_per_second": float(tokens_per_second),
    }
    if grad_norm is not None:
        row["grad_norm"] = _finite_or_none(grad_norm)
    return row


def eval_row(
    *, step: int, tau: float, per_position_acceptance: Sequence[float | None] | None = None
) -> EvalMetricsRow:
    """An evaluation row with the schema's keys (add further report keys as needed)."""
    row: EvalMetricsRow = {"kind": "eval", "step": int(step), "tau": float(tau)}
    if per_position_acceptance is not None:
        row["per_position_acceptance"] = [_finite_or_none(a) for a in per_position_acceptance]
    return row


def metrics_json_line(row: MetricsRow | EvalMetricsRow) -> str:
    """One line of `metrics.jsonl` (strict JSON, sorted keys, trailing newline)."""
    return json.dumps(row, sort_keys=True, allow_nan=False) + "\n"


# -- reading -----------------------------------------------------------------------------------


@attrs.frozen(repr=False, eq=False, slots=False)
class TrainPoint(Record):
    """A training row as read back (None where the run logged null)."""

    step: int
    loss: float | None
    lr: float
    accuracy_by_position: tuple[float | None, ...]
    acceptance_length_estimate: float | None
    tokens_per_second: float


@attrs.frozen(repr=False, eq=False, slots=False)
class EvalPoint(Record):
    """An evaluation row as read back."""

    step: int
    #: None where the evaluation produced no finite tau.
    tau: float | None


@attrs.frozen(repr=False, eq=False, slots=False)
class RunMetrics(Record):
    """Everything one metrics file holds, in file order."""

    path: Path
    train: tuple[TrainPoint, ...]
    evals: tuple[EvalPoint, ...]


class _RowError(Exception):
    pass


def metrics_path(run: Path) -> Path:
    """`run/metrics.jsonl` for a run's output_dir; a file path is taken as the metrics file."""
    return run if run.is_file() else run / METRICS_FILE


def read_metrics(run: Path) -> RunMetrics:
    """Parse a run's metrics file; DFlashRecipeError names the file and line of any problem."""
    path = metrics_path(run)
    if not path.is_file():
        msg = (
            f"{path} does not exist; pass the training.output_dir of a run started with "
            f"`dflash-recipe run` (it writes {METRICS_FILE} every logging_steps) or the file"
        )
        raise DFlashRecipeError(msg)
    try:
        text = read_regular_file(path, max_bytes=METRICS_MAX_BYTES).decode("utf-8")
    except (FileReadProblem, UnicodeDecodeError) as exc:
        reason = exc.reason if isinstance(exc, FileReadProblem) else f"not UTF-8 ({exc.reason})"
        msg = f"{path}: cannot read the metrics file: {reason}"
        raise DFlashRecipeError(msg) from None
    train: list[TrainPoint] = []
    evals: list[EvalPoint] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = parse_json(line)
        except JsonProblem as exc:
            msg = (
                f"{path}:{lineno}: not a JSON object ({exc.reason}); the metrics file is "
                f"damaged: remove line {lineno} or the file"
            )
            raise DFlashRecipeError(msg) from None
        try:
            point = _parse_row(data)
        except _RowError as exc:
            msg = f"{path}:{lineno}: {exc}"
            raise DFlashRecipeError(msg) from None
        if isinstance(point, TrainPoint):
            train.append(point)
        elif isinstance(point, EvalPoint):
            evals.append(point)
    if not train:
        msg = (
            f"{path} has no training rows yet (the first is written after "
            "training.logging_steps steps)"
        )
        raise DFlashRecipeError(msg)
    return RunMetrics(path=path, train=tuple(train), evals=tuple(evals))


def _parse_row(data: object) -> TrainPoint | EvalPoint | None:
    if not isinstance(data, dict):
        msg = f"expected a JSON object, got {type(data).__name__}"
        raise _RowError(msg)
    kind = data.get(KEY_KIND, KIND_TRAIN)
    if kind == KIND_TRAIN:
        _require(data, TRAIN_KEYS, kind)
        accuracies = data[KEY_ACCURACY_BY_POSITION]
        if not isinstance(accuracies, list):
            msg = f"{KEY_ACCURACY_BY_POSITION} must be a list, got {type(accuracies).__name__}"
            raise _RowError(msg)
        return TrainPoint(
            step=_int(data, KEY_STEP),
            loss=_number(data, KEY_LOSS, nullable=True),
            lr=_number_required(data, KEY_LR),
            accuracy_by_position=tuple(
                _as_number(a, f"{KEY_ACCURACY_BY_POSITION}[{i}]", nullable=True)
                for i, a in enumerate(accuracies)
            ),
            acceptance_length_estimate=_number(data, KEY_ACCEPTANCE_LENGTH_ESTIMATE, nullable=True),
            tokens_per_second=_number_required(data, KEY_TOKENS_PER_SECOND),
        )
    if kind == KIND_EVAL:
        _require(data, EVAL_KEYS, kind)
        return EvalPoint(step=_int(data, KEY_STEP), tau=_number(data, KEY_TAU, nullable=True))
    if not isinstance(kind, str):
        msg = f"{KEY_KIND} must be a string, got {kind!r}"
        raise _RowError(msg)
    return None  # summary and future kinds: not plotted


def _require(data: dict[str, object], keys: Sequence[str], kind: object) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        msg = f"{kind} row lacks {', '.join(missing)}"
        raise _RowError(msg)


def _int(data: dict[str, object], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{key} must be an integer, got {value!r}"
        raise _RowError(msg)
    return value


def _as_number(value: object, key: str, *, nullable: bool) -> float | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        msg = f"{key} must be a number{' or null' if nullable else ''}, got {value!r}"
        raise _RowError(msg)
    number = float(value)
    return number if math.isfinite(number) else None


def _number(data: dict[str, object], key: str, *, nullable: bool) -> float | None:
    return _as_number(data[key], key, nullable=nullable)


def _number_required(data: dict[str, object], key: str) -> float:
    number = _as_number(data[key], key, nullable=False)
    if number is None:
        msg = f"{key} must be a finite number, got {data[key]!r}"
        raise _RowError(msg)
    return number


# -- drawing -----------------------------------------------------------------------------------


def _load_matplotlib() -> type[Figure]:
    try:
        import matplotlib  # noqa: F401  (a missing package fails here, not on a cached submodule)
        from matplotlib.figure import Figure
    except ImportError as exc:
        msg = f"the training report needs matplotlib: {PLOT_EXTRA_HINT}"
        raise DFlashRecipeError(msg) from exc
    return Figure


def default_labels(runs: Sequence[Path]) -> list[str]:
    """Directory names of the runs, made unique with their parents where two collide."""
    dirs = [metrics_path(r).parent.resolve() for r in runs]
    labels = [d.name or str(d) for d in dirs]
    if len(set(labels)) != len(labels):
        labels = [f"{d.parent.name}/{d.name}" for d in dirs]
    if len(set(labels)) != len(labels):
        labels = [str(d) for d in dirs]
    return labels


def render_report(runs: Sequence[Path], out: Path, *, labels: Sequence[str] | None = None) -> Path:
    """Draw the training report of `runs` (output dirs or metrics files) as a PNG at `out`.

    Panels: loss over steps; estimated (lines) and measured (markers) acceptance length over
    steps; accuracy by block position at each run's last logged step. With several runs they
    are overlaid with their labels (default: the directory names). The PNG is written to a
    temporary sibling and renamed, so `out` is never a partial image (a symlink's target gets
    it; a device or FIFO is written through). Returns `out`.
    """
    fig = report_figure(runs, labels=labels)
    _save_atomic(fig, out)
    return out


def report_figure(runs: Sequence[Path], *, labels: Sequence[str] | None = None) -> Figure:
    """The figure :func:`render_report` saves, unsaved: its three axes hold the plotted lines.

    Axes in order: loss; acceptance length (per run an estimate line, then a measured-tau line
    when the run evaluated); accuracy by block position 1.. at the last logged step.
    """
    if not runs:
        msg = "render_report needs at least one run directory"
        raise DFlashRecipeError(msg)
    if labels is not None and len(labels) != len(runs):
        msg = f"{len(labels)} label(s) given for {len(runs)} run(s); give one label per run"
        raise DFlashRecipeError(msg)
    figure_cls = _load_matplotlib()
    metrics = [read_metrics(Path(r)) for r in runs]
    names = list(labels) if labels is not None else default_labels([Path(r) for r in runs])
    fig = figure_cls(figsize=(15, 4.2), dpi=100, layout="constrained")
    _draw(fig, metrics, names)
    return fig


def _draw(fig: Figure, metrics: Sequence[RunMetrics], names: Sequence[str]) -> None:
    ax_loss, ax_tau, ax_acc = fig.subplots(1, 3)
    colors = [f"C{i % 10}" for i in range(len(metrics))]
    for run, name, color in zip(metrics, names, colors, strict=True):
        steps = [p.step for p in run.train]
        ax_loss.plot(steps, _nan(p.loss for p in run.train), color=color, label=name)
        ax_tau.plot(
            steps,
            _nan(p.acceptance_length_estimate for p in run.train),
            color=color,
            label=f"{name} (estimate)",
        )
        if run.evals:
            ax_tau.plot(
                [e.step for e in run.evals],
                _nan(e.tau for e in run.evals),
                color=color,
                linestyle="--",
                marker="o",
                label=f"{name} (measured tau)",
            )
        last = run.train[-1]
        # position 0 is the anchor (given, never predicted): not plotted
        accuracies = last.accuracy_by_position[1:]
        ax_acc.plot(
            range(1, 1 + len(accuracies)),
            _nan(accuracies),
            color=color,
            marker="o",
            label=f"{name} (step {last.step})",
        )
    title = " vs ".join(names) if len(names) == 2 else None
    if title is not None:
        fig.suptitle(title)
    ax_loss.set(title="training loss", xlabel="step", ylabel="loss")
    ax_tau.set(title="acceptance length", xlabel="step", ylabel="tokens per target pass")
    ax_acc.set(
        title="accuracy by block position (last logged step)",
        xlabel="block position",
        ylabel="top-1 accuracy",
        ylim=(0.0, 1.02),
    )
    for ax in (ax_loss, ax_tau, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _nan(values: Iterable[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in values]


def _save_atomic(fig: Figure, out: Path) -> None:
    """PNG bytes to `out` as -o promises: atomic for files, through symlinks and devices."""
    from dflash_recipes.files.crashsafe import write_output

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    try:
        write_output(out, buffer.getvalue())
    except OSError as exc:
        msg = f"cannot write {out}: {exc.strerror or exc}; choose an -o path you can write to"
        raise DFlashRecipeError(msg) from exc


__all__ = [
    "EVAL_KEYS",
    "KEY_ACCEPTANCE_LENGTH_ESTIMATE",
    "KEY_ACCURACY_BY_POSITION",
    "KEY_KIND",
    "KEY_LOSS",
    "KEY_LR",
    "KEY_STEP",
    "KEY_TAU",
    "KEY_TOKENS_PER_SECOND",
    "KIND_EVAL",
    "KIND_TRAIN",
    "PLOT_EXTRA_HINT",
    "TRAIN_KEYS",
    "EvalMetricsRow",
    "EvalPoint",
    "MetricsRow",
    "RunMetrics",
    "TrainPoint",
    "default_labels",
    "eval_row",
    "metrics_json_line",
    "metrics_path",
    "read_metrics",
    "render_report",
    "report_figure",
    "train_row",
]
