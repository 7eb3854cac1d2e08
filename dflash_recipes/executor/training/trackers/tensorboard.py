"""TensorBoard: event files in training.logging_dir through the ``tensorboard`` package.

Each row is one event carrying all its scalars at the row's optimiser step (the library's
``EventFileWriter`` checksums every event in Python: one event per row instead of one per
scalar is most of this tracker's cost). Each run (fresh or resumed) opens its event file with
a purge marker at step 1 (a ``SessionLog.START`` event, as ``SummaryWriter(purge_step=1)``
writes), so TensorBoard drops every earlier attempt's events, and a resumed run writes the
rows metrics.jsonl kept again before going on: each step shows once, with the values
metrics.jsonl has, even when a killed process had not flushed its events. The plan is a text
summary (``plan``), its fingerprint another (``plan_fingerprint``), the run summary a third
(``summary``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from dflash_recipes.executor.training.trackers.protocol import (
    ConfigValue,
    Outcome,
    TrackerContext,
    row_scalars,
    row_step,
)
from dflash_recipes.recipe.choices import TRACKER_LIBRARIES

if TYPE_CHECKING:
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

NAME = "tensorboard"
#: The import that must succeed, and what provides it.
LIBRARY = TRACKER_LIBRARIES[NAME]
PIP_EXTRA = NAME
#: How often the library's writer thread flushes the event file (TensorBoard reads it live).
_FLUSH_SECONDS = 10


def missing_library() -> str | None:
    """Why the tracker cannot start here (None: it can)."""
    from dflash_recipes.executor.training.trackers.registry import library_present

    if library_present(LIBRARY):
        return None
    return "the tensorboard package is not installed"


class TensorBoardLogger:
    """Scalars, a text plan and a text summary in one event file of the event directory."""

    name = NAME

    def __init__(self, context: TrackerContext) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        context.logging_dir.mkdir(parents=True, exist_ok=True)
        self._writer: EventFileWriter = EventFileWriter(
            str(context.logging_dir), max_queue_size=100, flush_secs=_FLUSH_SECONDS
        )
        # Events of earlier attempts at steps >= 1 are purged by TensorBoard's readers.
        self._writer.add_event(
            Event(wall_time=time.time(), step=1, session_log=SessionLog(status=SessionLog.START))
        )
        self._config_step = (context.resumed_from or 0) + 1
        for row in context.earlier_rows:
            self.log_row(row)

    @property
    def resume_state(self) -> Mapping[str, str]:
        return {}

    def log_config(self, config: Mapping[str, ConfigValue], tags: Mapping[str, str]) -> None:
        table = "\n".join(f"| {key} | {json.dumps(value)} |" for key, value in config.items())
        self._add(_text("plan", f"| key | value |\n|---|---|\n{table}"), self._config_step)
        for key, value in tags.items():
            self._add(_text(key, value), self._config_step)

    def log_row(self, row: Mapping[str, object]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        step = row_step(row)
        if row.get("kind") == "summary":
            text = json.dumps(dict(row), sort_keys=True, indent=1)
            self._add(_text("summary", f"```\n{text}\n```"), step)
            return
        values = [Summary.Value(tag=k, simple_value=v) for k, v in row_scalars(row).items()]
        if values:
            self._add(Summary(value=values), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self, outcome: Outcome) -> None:
        self._writer.close()

    def _add(self, summary: Summary, step: int | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        event = Event(wall_time=time.time(), summary=summary)
        if step is not None:
            event.step = step
        self._writer.add_event(event)


def _text(tag: str, text: str) -> Summary:
    """A text-plugin summary under ``<tag>/text_summary`` (what TensorBoard's Text tab shows)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

    metadata = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()
        )
    )
    tensor = TensorProto(
        dtype="DT_STRING",
        string_val=[text.encode("utf-8")],
        tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
    )
    value = Summary.Value(tag=f"{tag}/text_summary", metadata=metadata, tensor=tensor)
    return Summary(value=[value])


def open_logger(context: TrackerContext) -> TensorBoardLogger:
    return TensorBoardLogger(context)


__all__ = ["NAME", "TensorBoardLogger", "missing_library", "open_logger"]
