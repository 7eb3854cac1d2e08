"""Held-out acceptance as a card records it, and the acceptance gate that can fail a pipeline.

A measurement comes from an `eval` report (:func:`measurement_from_report`, the dict of
``AcceptanceReport.to_dict()``) or from the last ``kind: eval`` row a training run wrote to its
``metrics.jsonl`` (:func:`last_training_measurement`, the same dict plus the step). Either way
only file names and hashes are kept, never a path.

The gate is one rule, :func:`acceptance_shortfall`: a measured pooled tau below the required
one (or none measured) fails, with one line that says measured against required. `eval
--min-tau` applies it to the measurement it just made; `run` applies it, through
:func:`run_gate_line`, to the last held-out tau the run measured (``training.eval_min_tau``),
after the checkpoint and the export are written.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

from dflash_recipes.card.facts import Measurement, TagMeasurement
from dflash_recipes.files.metrics_rows import KEY_KIND, KIND_EVAL, METRICS_MAX_BYTES
from dflash_recipes.files.run_dir import METRICS_FILE
from dflash_recipes.plan.run_plan import RunPlan

#: What `run` prints when it has nothing to compare with training.eval_min_tau.
_NOT_MEASURED = "no held-out tau was measured"


def _text(row: Mapping[str, object], key: str) -> str | None:
    value = row.get(key)
    return value if isinstance(value, str) else None


def _int(row: Mapping[str, object], key: str) -> int | None:
    value = row.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(row: Mapping[str, object], key: str) -> float | None:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def file_name(text: str | None) -> str | None:
    """The last component of a path (``/data/eval.jsonl`` -> ``eval.jsonl``); None passes."""
    if text is None:
        return None
    return os.path.basename(os.path.normpath(text)) or text


def _template_source(text: str | None) -> str | None:
    # `eval` records "data.chat_template /abs/path.jinja" or "tokenizer": keep the name only.
    prefix = "data.chat_template "
    if text is not None and text.startswith(prefix):
        return f"data.chat_template {file_name(text[len(prefix) :])}"
    return text


def measurement_from_report(
    report: Mapping[str, object], *, source: str, step: int | None = None
) -> Measurement | None:
    """The :class:`Measurement` of an eval report dict (None when it holds no finite tau).

    ``source`` is ``training`` or ``eval``; ``step`` the training step of the weights measured.
    """
    tau = _number(report, "tau")
    block_size = _int(report, "block_size")
    if tau is None or block_size is None:
        return None
    settings = report.get("settings")
    found: Mapping[str, object] = settings if isinstance(settings, dict) else {}
    lossless = report.get("lossless")
    return Measurement(
        tau=tau,
        tau_per_prompt_mean=_number(report, "tau_per_prompt_mean"),
        block_size=block_size,
        drafted_tokens=_int(report, "drafted_tokens"),
        max_new_tokens=_int(report, "max_new_tokens"),
        num_prompts=_int(report, "num_prompts") or 0,
        thinking_mode=_text(found, "thinking_mode"),
        prompts_file=file_name(_text(found, "prompt_file")),
        prompts_sha256=_text(found, "prompt_file_sha256"),
        chat_template=_template_source(_text(found, "chat_template_source")),
        chat_template_sha256=_text(found, "chat_template_sha256"),
        head=_text(report, "head"),
        lossless=lossless if isinstance(lossless, bool) else None,
        source=source,
        step=step,
        decoding=decoding_description(found),
        per_tag=_per_tag(report.get("tau_per_tag")),
    )


def _per_tag(value: object) -> tuple[TagMeasurement, ...]:
    """A report's ``tau_per_tag`` ({tag: {"tau", "num_prompts", ...}}); what is not a finite
    tau is left out."""
    if not isinstance(value, dict):
        return ()
    found = []
    for tag, figures in sorted(value.items()):
        if not isinstance(tag, str) or not isinstance(figures, dict):
            continue
        tau = _number(figures, "tau")
        if tau is not None:
            found.append(TagMeasurement(tag, tau, _int(figures, "num_prompts") or 0))
    return tuple(found)


def decoding_description(settings: Mapping[str, object]) -> str | None:
    """``greedy`` or ``sampling at temperature T (top-k K, top-p P, drafts D, seed S)`` (the
    cuts only when set) from a report's settings (None when they do not say)."""
    decoding = _text(settings, "decoding")
    if decoding != "sampling":
        return decoding
    temperature = _number(settings, "temperature")
    shown = f"{temperature:g}" if temperature is not None else "?"
    cuts = []
    top_k, top_p = _int(settings, "top_k"), _number(settings, "top_p")
    if top_k:
        cuts.append(f"top-k {top_k}")
    if top_p is not None and top_p < 1:
        cuts.append(f"top-p {top_p:g}")
    drafts = _text(settings, "draft_sampling") or "?"
    cuts += [f"drafts {drafts}", f"seed {_int(settings, 'seed')}"]
    return f"sampling at temperature {shown} ({', '.join(cuts)})"


def last_training_measurement(run_dir: Path, up_to_step: int | None = None) -> Measurement | None:
    """The last held-out measurement a run logged (at a step <= `up_to_step`), or None.

    Reads ``run_dir/metrics.jsonl`` (bounded); lines that do not parse are skipped, as the
    metrics reader of a resumed run does. None when the file is missing or holds no eval row.
    """
    path = run_dir / METRICS_FILE
    try:
        if not path.is_file() or path.stat().st_size > METRICS_MAX_BYTES:
            return None
        lines = path.read_bytes().splitlines()
    except OSError:
        return None
    found: Measurement | None = None
    for line in lines:
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(row, dict) or row.get(KEY_KIND) != KIND_EVAL:
            continue
        step = _int(row, "step")
        if step is None or (up_to_step is not None and step > up_to_step):
            continue
        measured = measurement_from_report(row, source="training", step=step)
        if measured is not None:
            found = measured
    return found


def _pair(measured: float, required: float) -> tuple[str, str]:
    """Both numbers at the fewest digits (3 to 12) that do not make them read as equal."""
    for digits in range(3, 13):
        left, right = f"{measured:.{digits}g}", f"{required:.{digits}g}"
        if left != right:
            return left, right
    return repr(measured), repr(required)


def acceptance_shortfall(measured: float | None, required: float, *, setting: str) -> str | None:
    """The one line that fails a gate (None: `measured` reaches `required`).

    ``setting`` names where the requirement comes from (``--min-tau``,
    ``training.eval_min_tau``). A missing or non-finite measurement fails.
    """
    if measured is not None and math.isfinite(measured) and measured >= required:
        return None
    if measured is None or not math.isfinite(measured):
        return f"acceptance gate failed: {_NOT_MEASURED}, {setting} requires tau >= {required:g}"
    shown, needed = _pair(measured, required)
    return (
        f"acceptance gate failed: measured tau {shown} is below the required {needed} ({setting})"
    )


def run_gate_line(plan: RunPlan) -> str | None:
    """Whether a finished `run` of `plan` fails ``training.eval_min_tau``: the line, or None.

    Judges the last held-out measurement in the run's ``metrics.jsonl`` (what the export's card
    records); call it after the export is written, on rank 0.
    """
    required = plan.training.eval_min_tau
    if required is None:
        return None
    measured = last_training_measurement(Path(plan.training.output_dir))
    if measured is None:
        return (
            f"acceptance gate failed: {_NOT_MEASURED} in this run (training.eval_steps "
            f"{plan.training.eval_steps}), training.eval_min_tau requires tau >= {required:g}"
        )
    return acceptance_shortfall(
        measured.tau,
        required,
        setting=f"training.eval_min_tau, held-out eval at step {measured.step}",
    )


def eval_step_gate_note(plan: RunPlan, tau: float, step: int) -> str | None:
    """The warning for a training-time eval below ``training.eval_min_tau`` (None: at or above).

    For the trainer's eval step, to log after each measurement: the run goes on (later steps
    may reach the gate) and `run` exits 1 at the end only if its last measurement falls short.
    """
    required = plan.training.eval_min_tau
    if required is None or acceptance_shortfall(tau, required, setting="") is None:
        return None
    shown, needed = _pair(tau, required)
    return (
        f"eval at step {step}: tau {shown} is below training.eval_min_tau {needed}; the run "
        "goes on and ends with exit 1 after its export unless a later eval reaches it"
    )


__all__ = [
    "acceptance_shortfall",
    "decoding_description",
    "eval_step_gate_note",
    "file_name",
    "last_training_measurement",
    "measurement_from_report",
    "run_gate_line",
]
