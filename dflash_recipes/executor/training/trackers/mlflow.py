"""MLflow through ``MlflowClient``: one MLflow run per training run, continued on resume.

The store is ``MLFLOW_TRACKING_URI`` (a tracking server, ``sqlite:///...``); unset, a sqlite
store in the run directory (``mlflow.db``, which needs the full ``mlflow`` package, not
``mlflow-skinny``). The experiment is ``MLFLOW_EXPERIMENT_NAME`` (default ``dflash-recipes``).
The run id is kept in trackers.json; a resumed run sets the same run back to RUNNING, sends
the rows metrics.jsonl kept beyond the last step the run holds, skips the redone steps it
already holds (MLflow cannot replace a metric's point), and ends FINISHED (KILLED when
stopped early to be resumed, FAILED on an error). Metrics are sent on a background thread (a
step never waits for the store); the plan goes in as params, its fingerprint as the tag
``plan_fingerprint`` (updated on resume; params already recorded stay as they were).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from dflash_recipes.executor.training.trackers.protocol import (
    ConfigValue,
    Outcome,
    RowsLost,
    TrackerContext,
    row_scalars,
    row_step,
)
from dflash_recipes.recipe.choices import TRACKER_LIBRARIES

if TYPE_CHECKING:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

NAME = "mlflow"
LIBRARY = TRACKER_LIBRARIES[NAME]
PIP_EXTRA = NAME
DEFAULT_EXPERIMENT = "dflash-recipes"
#: MLflow's limits: characters per param value, params per batch call, metrics per batch call.
_PARAM_VALUE_MAX = 6000
_BATCH_MAX = 100
_METRICS_MAX = 1000
#: How long the sender gathers rows before one store call (a sqlite commit costs tens of ms).
_GATHER_SECONDS = 1.0
_STATUS: dict[str, str] = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


def _local_store() -> bool:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    return not uri or uri.startswith("sqlite:")


def missing_library() -> str | None:
    """Why the tracker cannot start here (None: it can)."""
    from dflash_recipes.executor.training.trackers.registry import library_present

    if not library_present(LIBRARY):
        return "the mlflow package is not installed"
    if _local_store() and not library_present("sqlalchemy"):
        return (
            "MLflow's local sqlite store needs the full mlflow package (mlflow-skinny has no "
            "SQL store); or set MLFLOW_TRACKING_URI to a tracking server"
        )
    return None


class MlflowLogger:
    """Metrics by step, params and tags of one MLflow run."""

    name = NAME

    def __init__(self, context: TrackerContext) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (
            f"sqlite:///{(context.run_dir / 'mlflow.db').resolve()}"
        )
        self._client: MlflowClient = MlflowClient(tracking_uri=uri)
        #: The last step the MLflow run holds (rows up to it are not sent again).
        self._have = 0
        run_id = context.kept.get("run_id") if context.resumed_from is not None else None
        if run_id is not None:
            try:
                self._client.get_run(run_id)
            except MlflowException:
                run_id = None  # another store than the one the earlier attempt used
        if run_id is not None:
            self._client.update_run(run_id, status="RUNNING")
            history = self._client.get_metric_history(run_id, "train/loss")
            self._have = max((m.step for m in history), default=0)
            self._existing = set(self._client.get_run(run_id).data.params)
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
            experiment = self._client.get_experiment_by_name(name)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self._client.create_experiment(name)
            )
            run_id = self._client.create_run(experiment_id, run_name=context.run_name).info.run_id
            self._existing = set()
        self.run_id: str = run_id
        client = self._client

        def send(metrics: Sequence[Metric]) -> None:
            for start in range(0, len(metrics), _METRICS_MAX):
                client.log_batch(run_id, metrics=metrics[start : start + _METRICS_MAX])

        self._sender = _BackgroundSender(send)
        for row in context.earlier_rows:
            self.log_row(row)

    @property
    def resume_state(self) -> Mapping[str, str]:
        return {"run_id": self.run_id, "tracking_uri": self._client.tracking_uri}

    def log_config(self, config: Mapping[str, ConfigValue], tags: Mapping[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        params = [
            Param(key, _param_text(value))
            for key, value in config.items()
            if key not in self._existing
        ]
        for start in range(0, len(params), _BATCH_MAX):
            self._client.log_batch(self.run_id, params=params[start : start + _BATCH_MAX])
        run_tags = [RunTag(key, value) for key, value in tags.items()]
        self._client.log_batch(self.run_id, tags=run_tags)

    def log_row(self, row: Mapping[str, object]) -> None:
        from mlflow.entities import Metric

        step = row_step(row)
        if step is None or (row.get("kind") != "summary" and step <= self._have):
            return
        now = int(time.time() * 1000)
        self._sender.put([Metric(key, value, now, step) for key, value in row_scalars(row).items()])

    def flush(self) -> None:
        self._sender.flush()

    def close(self, outcome: Outcome) -> None:
        try:
            self._sender.close()
        finally:
            self._client.set_terminated(self.run_id, status=_STATUS[outcome])


class _BackgroundSender:
    """Sends the rows' metrics on a thread, the rows of about a second in one call, so a step
    never waits for the store (a sqlite commit, a slow or unreachable server).

    After a failed call it sends nothing more: the next :meth:`put` or :meth:`flush` raises
    :class:`RowsLost` with the rows that did not arrive (once).
    """

    def __init__(self, send: Callable[[Sequence[Metric]], None]) -> None:
        self._send = send
        self._rows: list[list[Metric]] = []
        self._changed = threading.Condition()
        self._sending = False
        self._hurry = False
        self._closing = False
        self._error: BaseException | None = None
        self._lost = 0
        self._reported = False
        self._thread = threading.Thread(target=self._work, name="dflash-mlflow", daemon=True)
        self._thread.start()

    def put(self, metrics: list[Metric]) -> None:
        with self._changed:
            self._raise_lost(extra=1)
            self._rows.append(metrics)
            self._changed.notify_all()

    def flush(self) -> None:
        """Wait until every row put so far is sent; raises if one did not arrive."""
        with self._changed:
            self._hurry = True
            self._changed.notify_all()
            self._changed.wait_for(
                lambda: self._error is not None or not (self._rows or self._sending)
            )
            self._hurry = False
            self._raise_lost(extra=0)

    def close(self) -> None:
        """Send what is waiting, then stop; raises if a row did not arrive."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()
        with self._changed:
            self._raise_lost(extra=0)

    def _raise_lost(self, *, extra: int) -> None:
        if self._error is not None and not self._reported:
            self._reported = True
            raise RowsLost(self._lost + extra, self._error)
        if self._error is not None:
            raise RowsLost(extra, self._error)

    def _work(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._rows or self._closing)
                # Gather the rows of about a second: one store call for all of them.
                self._changed.wait_for(lambda: self._closing or self._hurry, _GATHER_SECONDS)
                if not self._rows:
                    return
                rows, self._rows = self._rows, []
                self._sending = True
            try:
                self._send([metric for row in rows for metric in row])
            except Exception as exc:  # put() or flush() reports it
                with self._changed:
                    self._error = exc
                    self._lost = len(rows) + len(self._rows)
                    self._rows, self._sending = [], False
                    self._changed.notify_all()
                return
            with self._changed:
                self._sending = False
                self._changed.notify_all()


def _param_text(value: ConfigValue) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= _PARAM_VALUE_MAX else text[: _PARAM_VALUE_MAX - 3] + "..."


def open_logger(context: TrackerContext) -> MlflowLogger:
    return MlflowLogger(context)


__all__ = ["NAME", "MlflowLogger", "missing_library", "open_logger"]
