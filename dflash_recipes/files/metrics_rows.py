"""The rows of a run's `metrics.jsonl`: their schema, and how they are written and read back.

The trainer appends one JSON object per line to `output_dir/metrics.jsonl`
(:data:`dflash_recipes.files.run_dir.METRICS_FILE`); build rows with :func:`train_row` /
:func:`eval_row` and serialise them with :func:`metrics_json_line`:

- a training row (:class:`MetricsRow`, `"kind": "train"`) every `logging_steps`;
- an evaluation row (:class:`EvalMetricsRow`, `"kind": "eval"`) whenever acceptance is measured
  by drafting and greedy verification (tau); extra keys (the full eval report) are allowed;
- the trainer's final `"summary"` row.

`accuracy_by_position[k]` is the top-1 accuracy at block position `k`. Position 0 is the anchor
(given, never predicted: null) unless a Domino/DSpark head with shift_label predicts the next
token there; positions without supervision may be null. Non-finite numbers (NaN)
read as missing points. A resumed run drops the rows after its checkpoint
(:func:`drop_metrics_after`) before it redoes those steps. No torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, NotRequired, TypedDict

import attrs

from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.files.crashsafe import write_bytes_atomic
from dflash_recipes.files.jsonio import FileReadProblem, JsonProblem, parse_json, read_regular_file
from dflash_recipes.files.run_dir import METRICS_FILE
from dflash_recipes.records import Record

KEY_KIND = "kind"


KIND_TRAIN = "train"


KIND_EVAL = "eval"


KEY_STEP = "step"


KEY_LOSS = "loss"


KEY_LR = "lr"


KEY_ACCURACY_BY_POSITION = "accuracy_by_position"


#: The training-batch estimate of the acceptance length (from the window's per-position
#: accuracies on training batches, not measured by drafting; the eval rows' `tau` is).
KEY_ACCEPTANCE_LENGTH_ESTIMATE = "train_batch_tau_estimate"

#: The key of that estimate in metrics files written before it was renamed; still read.
LEGACY_KEY_ACCEPTANCE_LENGTH_ESTIMATE = "acceptance_length_estimate"


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
    #: Expected accepted prefix + 1, from the per-position accuracies on the window's training
    #: batches: the training-batch estimate, not acceptance measured on held-out prompts.
    train_batch_tau_estimate: float | None
    #: Training tokens per second over the logging window (all ranks).
    tokens_per_second: float
    #: Gradient norm before clipping, when the trainer measures it.
    grad_norm: NotRequired[float | None]
    #: DFlash 2: accuracy per block position of the candidate selector's greedy choice among
    #: the unary top-K from the true previous token (as ``accuracy_by_position`` is the unary
    #: top-1's), over the same positions.
    selector_accuracy_by_position: NotRequired[list[float | None]]
    #: Optimiser steps of the window skipped because their gradient norm was NaN or Inf (the
    #: weights never took them; training.max_nonfinite_steps in a row stop the run).
    skipped_steps: NotRequired[int]


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
    selector_accuracy_by_position: Sequence[float | None] | None = None,
    skipped_steps: int | None = None,
) -> MetricsRow:
    """A training row with exactly the schema's keys; NaN/inf become None (JSON null)."""
    row: MetricsRow = {
        "kind": "train",
        "step": int(step),
        "loss": _finite_or_none(loss),
        "lr": float(lr),
        "accuracy_by_position": [_finite_or_none(a) for a in accuracy_by_position],
        "train_batch_tau_estimate": _finite_or_none(acceptance_length_estimate),
        "tokens_per_second": float(tokens_per_second),
    }
    if grad_norm is not None:
        row["grad_norm"] = _finite_or_none(grad_norm)
    if selector_accuracy_by_position is not None:
        row["selector_accuracy_by_position"] = [
            _finite_or_none(a) for a in selector_accuracy_by_position
        ]
    if skipped_steps is not None:
        row["skipped_steps"] = int(skipped_steps)
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
        if (
            LEGACY_KEY_ACCEPTANCE_LENGTH_ESTIMATE in data
            and KEY_ACCEPTANCE_LENGTH_ESTIMATE not in data
        ):
            data = {
                **data,
                KEY_ACCEPTANCE_LENGTH_ESTIMATE: data[LEGACY_KEY_ACCEPTANCE_LENGTH_ESTIMATE],
            }
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


#: metrics.jsonl larger than this is not rewritten on resume (rows are then left as they are).
_MAX_METRICS_REWRITE_BYTES = 512 * 2**20


def _json_row(line: bytes) -> dict[str, object] | None:
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return row if isinstance(row, dict) else None


def _row_step(row: dict[str, object] | None) -> int | None:
    step = row.get(KEY_STEP) if row is not None else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _read_lines(path: Path) -> list[bytes]:
    try:
        if not path.is_file() or path.stat().st_size > _MAX_METRICS_REWRITE_BYTES:
            return []
        return path.read_bytes().splitlines(keepends=True)
    except OSError:
        return []


def drop_metrics_after(path: Path, step: int) -> int:
    """Remove the rows of steps after `step` from a metrics file, atomically; how many.

    A resumed run redoes those steps and logs them again. Lines without a step (summaries,
    lines that do not parse) are kept byte for byte.
    """
    lines = _read_lines(path)
    kept = [line for line in lines if (_row_step(_json_row(line)) or 0) <= step]
    removed = len(lines) - len(kept)
    if removed:
        write_bytes_atomic(path, b"".join(kept))
    return removed


def last_train_row(path: Path, up_to: int) -> dict[str, object] | None:
    """The last ``kind: train`` row of a metrics file at a step <= `up_to` (None if none)."""
    found: dict[str, object] | None = None
    for line in _read_lines(path):
        row = _json_row(line)
        step = _row_step(row)
        if (
            row is not None
            and step is not None
            and step <= up_to
            and row.get(KEY_KIND) == KIND_TRAIN
        ):
            found = row
    return found
