"""The tracker process: the trackers of ``training.report_to`` run here, not in the trainer.

Rank 0 starts it (:class:`~dflash_recipes.executor.training.trackers.process.TrackerProcess`,
without the executor's torch imports, which no tracker needs) and it reads one JSON
message per line on stdin: ``open`` (the tracker names and what they are opened with),
``config``, ``row`` (a metrics.jsonl row), ``flush``, ``close``. It answers ``opened``,
``flushed`` and ``closed`` on its stdout, and forwards its warnings there as ``log`` messages
for the trainer's log. The libraries' own work (MLflow's SQL store, W&B's serialisation,
TensorBoard's checksums) then never holds the trainer's interpreter lock; the trainer only
writes a line per row into a pipe.

Here :class:`Fanout` contains each tracker's failures: a tracker that raises is warned about
once, gets no further rows and is named with the rows it missed; each tracker sends from its
own thread (:class:`_OnThread`), so a slow server does not hold up the others. The process
runs below the trainer's priority (``nice`` +10: where cores are short, steps go first). It
ignores SIGINT, SIGTERM and SIGUSR1 (the trainer decides when tracking ends: a stop signal
still closes the tracker runs as ``stopped``) and exits without closing the runs when stdin
ends without ``close`` (the trainer was killed: the runs stay open, to be continued on resume).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from dflash_recipes.executor.training.trackers.protocol import (
    ConfigValue,
    MetricLogger,
    Outcome,
    RowsLost,
    TrackerContext,
    row_step,
)
from dflash_recipes.executor.training.trackers.registry import tracker_module

logger = logging.getLogger("dflash_recipes.train")

#: A message larger than this is refused (a row is a few hundred bytes; an open or config
#: message carries the flattened plan).
MAX_MESSAGE_BYTES = 64 * 2**20
#: How much lower than the trainer the process runs (``os.nice``).
NICE_INCREMENT = 10


class Fanout:
    """Sends each row to every tracker; a tracker that raises is dropped, warned about once."""

    def __init__(
        self, trackers: Sequence[MetricLogger], not_started: Sequence[tuple[str, Exception]] = ()
    ) -> None:
        self._active: list[MetricLogger] = list(trackers)
        #: Tracker name -> where it failed; rows it missed since.
        self._failed: dict[str, str] = {}
        self._missed: dict[str, int] = {}
        for name, exc in not_started:
            self._failed[name] = f"start ({why(exc)})"
            self._missed[name] = 0
            logger.warning(
                "tracker %s could not start: %s; training goes on and metrics.jsonl keeps "
                "every row",
                name,
                why(exc),
            )

    def log_config(self, config: Mapping[str, ConfigValue], tags: Mapping[str, str]) -> None:
        for tracker in list(self._active):
            try:
                tracker.log_config(config, tags)
            except Exception as exc:  # any tracker failure is contained
                self._fail(tracker, exc, "recording the plan")

    def log_row(self, row: Mapping[str, object]) -> None:
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
                logger.warning("tracker %s did not close cleanly: %s", tracker.name, why(exc))
        self._active = []

    def _fail(self, tracker: MetricLogger, exc: Exception, where: str) -> None:
        self._active.remove(tracker)
        self._failed[tracker.name] = f"{where} ({why(exc)})"
        self._missed.setdefault(tracker.name, 0)
        logger.warning(
            "tracker %s failed at %s: %s; it gets no more rows in this run, training goes on "
            "and metrics.jsonl keeps every row",
            tracker.name,
            where,
            why(exc),
        )
        with contextlib.suppress(Exception):  # already warned about this tracker
            tracker.close("failed")


class _OnThread:
    """A tracker whose rows are sent by its own thread, in order: the caller only queues them.

    A failure there is raised, as :class:`RowsLost` with the rows that did not arrive, by the
    next :meth:`log_row` or :meth:`flush`.
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
            except Exception as exc:  # the caller's next call reports it
                self._error = exc
                self._lost += exc.rows if isinstance(exc, RowsLost) else 1
            else:
                if self._error is not None and row is not None:
                    self._lost += 1
            finally:
                self._rows.task_done()


def why(exc: BaseException) -> str:
    """An exception in one line: its type and first line (a RowsLost's text names its cause)."""
    text = str(exc).strip().splitlines()
    if isinstance(exc, RowsLost):
        return text[0] if text else "rows lost"
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def open_fanout(
    names: Sequence[str], context: Mapping[str, object]
) -> tuple[Fanout, dict[str, dict[str, str]]]:
    """Open the named trackers (each on its own thread) and what each keeps for a resume."""
    resumed = context.get("resumed_from")
    resumed_from = resumed if isinstance(resumed, int) else None
    kept = context.get("kept")
    kept_by_name = kept if isinstance(kept, dict) else {}
    earlier = earlier_rows(Path(str(context["metrics_path"]))) if resumed_from is not None else ()
    opened: list[MetricLogger] = []
    failures: list[tuple[str, Exception]] = []
    for name in names:
        own = kept_by_name.get(name)
        tracker_context = TrackerContext(
            run_dir=Path(str(context["run_dir"])),
            run_name=str(context["run_name"]),
            logging_dir=Path(str(context["logging_dir"])),
            resumed_from=resumed_from,
            earlier_rows=earlier,
            kept={k: v for k, v in own.items() if isinstance(v, str)}
            if isinstance(own, dict)
            else {},
        )
        try:
            opened.append(_OnThread(tracker_module(name).open_logger(tracker_context)))
        except Exception as exc:
            failures.append((name, exc))
    states = {t.name: dict(t.resume_state) for t in opened if t.resume_state}
    return Fanout(opened, failures), states


def earlier_rows(path: Path) -> tuple[Mapping[str, object], ...]:
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


class _Replies:
    """The process's answers and forwarded warnings, one JSON line each, from any thread."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def send(self, message: Mapping[str, object]) -> None:
        line = json.dumps(message, allow_nan=False, default=str) + "\n"
        with self._lock:
            self._stream.write(line)
            self._stream.flush()


class _Forward(logging.Handler):
    def __init__(self, replies: _Replies) -> None:
        super().__init__()
        self._replies = replies

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # the trainer is gone: nothing to tell
            self._replies.send({"log": [record.levelno, record.getMessage()]})


def serve(requests: IO[bytes], replies: _Replies) -> int:
    """Answer the trainer's messages until ``close`` (0) or the end of `requests` (1)."""
    fanout: Fanout | None = None
    while True:
        line = requests.readline(MAX_MESSAGE_BYTES + 1)
        if not line:
            return 1  # the trainer is gone without closing: leave the runs to a resume
        message = json.loads(line)
        op = message["op"]
        if op == "row" and fanout is not None:
            fanout.log_row(message["row"])
        elif op == "open":
            fanout, states = open_fanout(message["names"], message["context"])
            replies.send({"opened": states})
        elif op == "config" and fanout is not None:
            fanout.log_config(message["config"], message["tags"])
        elif op == "flush" and fanout is not None:
            fanout.flush()
            replies.send({"flushed": list(fanout.problems())})
        elif op == "close":
            if fanout is not None:
                fanout.close(message["outcome"])
            replies.send({"closed": True})
            return 0


def main() -> None:
    # Below the trainer's priority (W&B's service, started from here, inherits it): where cores
    # are short, a step's CPU time goes first and the trackers catch up in between.
    with contextlib.suppress(OSError):
        os.nice(NICE_INCREMENT)
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(number, signal.SIG_IGN)
    # The protocol gets its own copy of stdout; fd 1 goes to stderr, so that whatever a library
    # prints cannot break a message.
    replies = _Replies(os.fdopen(os.dup(1), "w", encoding="utf-8"))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logger.addHandler(_Forward(replies))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        code = serve(sys.stdin.buffer, replies)
    except Exception:  # the trainer warns that the process ended; the details go to stderr
        traceback.print_exc()
        code = 2
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: W&B's exit hook would finish a run left open


if __name__ == "__main__":
    main()
