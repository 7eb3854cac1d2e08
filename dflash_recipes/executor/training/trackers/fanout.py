"""The trainer's one metrics destination: metrics.jsonl first, then the tracker process.

:func:`open_trackers` opens (rank 0) metrics.jsonl and, when ``training.report_to`` names
trackers, the :class:`~.process.TrackerProcess` that runs them, continuing the tracker runs
kept in ``trackers.json`` when the run resumes, and records the plan in them.
:class:`TrackerSet` then writes every row to metrics.jsonl and hands the same line to that
process. metrics.jsonl's write errors stop the run as before; a tracker that fails (server
gone, disk full), or the process itself, is warned about once, and the run's summary names
it with the rows it missed (:meth:`TrackerSet.problems`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from dflash_recipes.executor.training.trackers.jsonl import MetricsJsonl
from dflash_recipes.executor.training.trackers.process import TrackerProcess
from dflash_recipes.executor.training.trackers.protocol import Outcome, flat_config, row_step
from dflash_recipes.files.crashsafe import write_text_atomic
from dflash_recipes.files.jsonio import FileReadProblem, JsonProblem, parse_json, read_regular_file
from dflash_recipes.plan.run_plan import RunPlan

#: The tracker runs of this run directory: ``{name: {"run_id": ...}}`` (rank 0 writes it).
TRACKERS_FILE = "trackers.json"


class TrackerSet:
    """Writes each row to metrics.jsonl (errors propagate) and sends it to the trackers."""

    def __init__(self, jsonl: MetricsJsonl | None, process: TrackerProcess | None) -> None:
        self._jsonl = jsonl
        self._process = process
        self._problems: tuple[str, ...] = ()

    @classmethod
    def silent(cls) -> TrackerSet:
        """The set of a rank other than 0: rows go nowhere."""
        return cls(None, None)

    def log_row(self, row: Mapping[str, object]) -> None:
        if self._jsonl is None:
            return
        line = self._jsonl.write(row)
        if self._process is not None:
            self._process.log_line(line, row_step(row))

    def flush(self) -> None:
        """Deliver what the trackers hold back (before the summary counts what was missed)."""
        if self._process is not None:
            self._problems = self._process.flush()

    def problems(self) -> tuple[str, ...]:
        """One line per tracker that missed rows in this run (for the run's summary)."""
        return self._problems

    def close(self, outcome: Outcome) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.close(outcome)


def open_trackers(plan: RunPlan, metrics_path: Path, *, resumed_from: int | None) -> TrackerSet:
    """metrics.jsonl and the plan's trackers for rank 0, the plan recorded in each.

    A tracker that fails to open is contained like one that fails later (warned about, the
    run goes on); a missing library was refused before the model was loaded
    (:func:`~dflash_recipes.executor.training.trackers.registry.check_tracker_libraries`).
    """
    training = plan.training
    if not training.report_to:
        return TrackerSet(MetricsJsonl(metrics_path), None)
    run_dir = Path(training.output_dir)
    kept = _read_kept(run_dir / TRACKERS_FILE) if resumed_from is not None else {}
    process = TrackerProcess(
        training.report_to,
        {
            "run_dir": str(run_dir),
            "run_name": training.run_name,
            "logging_dir": training.logging_dir,
            "resumed_from": resumed_from,
            "metrics_path": str(metrics_path),
            "kept": kept,
        },
    )
    try:  # the process runs from here: a failure must not leave it behind
        if process.resume_state:
            write_text_atomic(
                run_dir / TRACKERS_FILE,
                json.dumps({**kept, **process.resume_state}, indent=2, sort_keys=True),
            )
        process.log_config(flat_config(plan.to_dict()), {"plan_fingerprint": plan.fingerprint})
        return TrackerSet(MetricsJsonl(metrics_path), process)
    except BaseException:
        process.close("failed")
        raise


def _read_kept(path: Path) -> dict[str, dict[str, str]]:
    try:
        data = parse_json(read_regular_file(path, max_bytes=2**20))
    except (FileReadProblem, JsonProblem):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        name: {k: v for k, v in entry.items() if isinstance(v, str)}
        for name, entry in data.items()
        if isinstance(name, str) and isinstance(entry, dict)
    }


__all__ = ["TRACKERS_FILE", "TrackerSet", "open_trackers"]
