"""The trainer's one metrics destination: metrics.jsonl first, then each tracker, contained.

:func:`open_trackers` opens (rank 0) metrics.jsonl and the trackers of ``training.report_to``,
continuing the tracker runs kept in ``trackers.json`` when the run resumes, and records the
plan in them. :class:`TrackerSet` then sends every row to all of them, each tracker from its
own thread (:class:`_OnThread`). metrics.jsonl's write
errors stop the run as before; a tracker that raises (server gone, disk full) is warned about
once, gets no further rows in this run (a dead server would stall every step) and is named in
the run's summary with the rows it missed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from dflash_recipes.executor.training.trackers.jsonl import MetricsJsonl
from dflash_recipes.executor.training.trackers.protocol import (
    ConfigValue,
    MetricLogger,
    Outcome,
    RowsLost,
    TrackerContext,
    flat_config,
    row_step,
)
from dflash_recipes.executor.training.trackers.registry import tracker_module
from dflash_recipes.files.crashsafe import write_text_atomic
from dflash_recipes.files.jsonio import FileReadProblem, JsonProblem, parse_json, read_regular_file
from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger("dflash_recipes.train")

#: The tracker runs of this run directory: ``{name: {"run_id": ...}}`` (rank 0 writes it).
TRACKERS_FILE = "trackers.json"


class TrackerSet:
    """Sends each row to metrics.jsonl (errors propagate) and to every tracker (contained)."""

    def __init__(
        self,
        jsonl: MetricsJsonl | None,
        trackers: Sequence[MetricLogger],
        not_started: Sequence[tuple[str, Exception]] = (),
    ) -> None:
        self._jsonl = jsonl
        self._active: list[MetricLogger] = list(trackers)
        #: Tracker name -> where it failed; rows it missed since.
        self._failed: dict[str, str] = {}
        self._missed: dict[str, int] = {}
        for name, exc in not_started:
            self._failed[name] = f"start ({_why(exc)})"
            self._missed[name] = 0
            logger.warning(
                "tracker %s could not start: %s; training goes on and metrics.jsonl keeps "
                "every row",
                name,
                _why(exc),
            )

    @classmethod
    def silent(cls) -> TrackerSet:
        """The set of a rank other than 0: rows go nowhere."""
        return cls(None, ())

    def log_config(self, config: Mapping[str, ConfigValue], tags: Mapping[str, str]) -> None:
        for tracker in list(self._active):
            try:
                tracker.log_config(config, tags)
            except Exception as exc:  # any tracker failure is contained
                self._fail(tracker, exc, "recording the plan")

    def log_row(self, row: Mapping[str, object]) -> None:
        if self._jsonl is not None:
            self._jsonl.log_row(row)
        for name in self._failed:
            self._missed[name] += 1
        for tracker in list(self._active):
            try:
                tracker.log_row(row)
            except Exception as exc:
                step = row_step(row)
                self._fail(tracker, exc, f"step {step}" if step is not None else "a row")
                self._missed[tracker.name] += exc.rows if isinstance(exc, RowsLost) else 1

    def flush(self) -> None:
        """Deliver what the trackers hold back (before the summary counts what was missed)."""
        for tracker in list(self._active):
            try:
                tracker.flush()
            except Exception as exc:  # any tracker failure is contained
                self._fail(tracker, exc, "the end of the run")
                self._missed[tracker.name] += exc.rows if isinstance(exc, RowsLost) else 0

    def problems(self) -> tuple[str, ...]:
        """One line per tracker that missed rows in this run (for the run's summary)."""
        return tuple(
            f"{name} missed {self._missed[name]} row(s) after failing at {where}"
            for name, where in self._failed.items()
        )

    def close(self, outcome: Outcome) -> None:
        for tracker in self._active:
            try:
                tracker.close(outcome)
            except Exception as exc:
                logger.warning("tracker %s did not close cleanly: %s", tracker.name, _why(exc))
        self._active = []

    def _fail(self, tracker: MetricLogger, exc: Exception, where: str) -> None:
        self._active.remove(tracker)
        self._failed[tracker.name] = f"{where} ({_why(exc)})"
        self._missed.setdefault(tracker.name, 0)
        logger.warning(
            "tracker %s failed at %s: %s; it gets no more rows in this run, training goes on "
            "and metrics.jsonl keeps every row",
            tracker.name,
            where,
            _why(exc),
        )
        with contextlib.suppress(Exception):  # already warned about this tracker
            tracker.close("failed")


class _OnThread:
    """A tracker whose rows are sent by its own thread, in order: the step only queues them.

    The library's work (protobufs, W&B's serialisation, a store's commit) then overlaps the
    next step's tensor work instead of adding to it. A failure there is raised, as
    :class:`RowsLost` with the rows that did not arrive, by the next :meth:`log_row` or
    :meth:`flush`.
    """

    def __init__(self, tracker: MetricLogger) -> None:
        self._tracker = tracker
        self.name = tracker.name
        self._rows: queue.Queue[Mapping[str, object] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._lost = 0
        self._thread = threading.Thread(target=self._work, name=f"dflash-{self.name}", daemon=True)
        self._thread.start()

    @property
    def resume_state(self) -> Mapping[str, str]:
        return self._tracker.resume_state

    def log_config(self, config: Mapping[str, ConfigValue], tags: Mapping[str, str]) -> None:
        self._rows.join()
        self._tracker.log_config(config, tags)

    def log_row(self, row: Mapping[str, object]) -> None:
        self._raise_lost(extra=1)
        self._rows.put(row)

    def flush(self) -> None:
        self._rows.join()
        self._raise_lost(extra=0)
        self._tracker.flush()

    def close(self, outcome: Outcome) -> None:
        self._rows.join()
        self._rows.put(None)
        self._thread.join()
        try:
            self._raise_lost(extra=0)
        finally:
            self._tracker.close(outcome)

    def _raise_lost(self, *, extra: int) -> None:
        if self._error is not None:
            error, lost = self._error, self._lost + extra
            self._lost = 0  # reported: the caller stops sending to this tracker
            raise RowsLost(lost, error)

    def _work(self) -> None:
        while True:
            row = self._rows.get()
            try:
                if row is None:
                    return
                if self._error is None:
                    self._tracker.log_row(row)
            except Exception as exc:  # the trainer's next call reports it
                self._error = exc
                self._lost += exc.rows if isinstance(exc, RowsLost) else 1
            else:
                if self._error is not None and row is not None:
                    self._lost += 1
            finally:
                self._rows.task_done()


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    if isinstance(exc, RowsLost):  # its text names the cause already
        return text[0] if text else "rows lost"
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def open_trackers(plan: RunPlan, metrics_path: Path, *, resumed_from: int | None) -> TrackerSet:
    """metrics.jsonl and the plan's trackers for rank 0, the plan recorded in each.

    A tracker that fails to open is contained like one that fails later (warned about, the
    run goes on); a missing library was refused before the model was loaded
    (:func:`~dflash_recipes.executor.training.trackers.registry.check_tracker_libraries`).
    """
    training = plan.training
    run_dir = Path(training.output_dir)
    kept = _read_kept(run_dir / TRACKERS_FILE) if resumed_from is not None else {}
    earlier = _earlier_rows(metrics_path) if resumed_from is not None and training.report_to else ()
    opened: list[MetricLogger] = []
    failures: list[tuple[str, Exception]] = []
    for name in training.report_to:
        context = TrackerContext(
            run_dir=run_dir,
            run_name=training.run_name,
            logging_dir=Path(training.logging_dir),
            resumed_from=resumed_from,
            earlier_rows=earlier,
            kept=kept.get(name, {}),
        )
        try:
            opened.append(_OnThread(tracker_module(name).open_logger(context)))
        except Exception as exc:
            failures.append((name, exc))
    states = {t.name: dict(t.resume_state) for t in opened if t.resume_state}
    if states:
        write_text_atomic(
            run_dir / TRACKERS_FILE, json.dumps({**kept, **states}, indent=2, sort_keys=True)
        )
    trackers = TrackerSet(MetricsJsonl(metrics_path), opened, failures)
    trackers.log_config(flat_config(plan.to_dict()), {"plan_fingerprint": plan.fingerprint})
    return trackers


def _earlier_rows(path: Path) -> tuple[Mapping[str, object], ...]:
    """The train and eval rows of metrics.jsonl (already cut back to the checkpoint)."""
    rows: list[Mapping[str, object]] = []
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return ()
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("kind") in ("train", "eval"):
            rows.append(row)
    return tuple(rows)


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
