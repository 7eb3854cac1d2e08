"""The trainer's end of the tracker process (rank 0): rows go into a pipe, nothing waits.

:class:`TrackerProcess` starts :mod:`~dflash_recipes.executor.training.trackers.worker`,
opens the trackers there (waiting for their resume state), then hands each row, already
serialised as its metrics.jsonl line, to a writer thread that writes whatever has queued
into the process's stdin: a step never blocks on a full pipe or a slow tracker. A reader
thread logs the warnings the process forwards (a tracker that failed) and collects its
answers; :meth:`flush` and :meth:`close` wait for theirs.

Rows are gathered for up to :data:`GATHER_SECONDS` and written as one chunk (a message that
waits for an answer goes at once, with the rows before it): the trackers then work through a
burst of rows rather than waking for each step, which is most of what they cost (W&B's
client and service, TensorBoard's writer and MLflow's store each pay a wake-up per call,
several times the cost of the row itself when rows arrive one step apart). A tracker sees a
row at most that much later; :meth:`flush` delivers everything at once.

When the process itself ends without being asked (killed, out of memory), the trainer warns
once, training goes on, and each tracker is named in the summary with the rows logged since
(rows the process held when it ended are lost to the trackers too; metrics.jsonl has them).

The end of a run never hangs on a tracker: :meth:`TrackerProcess.flush` and
:meth:`TrackerProcess.close` wait at most :data:`END_SECONDS` each for the process's answer
(a W&B or MLflow server that stopped answering), then say so; close then stops the process.
metrics.jsonl, written by the trainer itself, is complete either way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from dflash_recipes.executor.training.trackers.protocol import ConfigValue, Outcome

logger = logging.getLogger("dflash_recipes.train")

#: What :meth:`TrackerProcess._answer` returns when its time ran out.
_NO_ANSWER = object()

WORKER_MODULE = "dflash_recipes.executor.training.trackers.worker"
#: How long rows are gathered before they are written to the tracker process in one chunk.
GATHER_SECONDS = 1.0
#: How long the end of a run waits for the trackers to deliver (flush) and to close, each.
END_SECONDS = 120.0
#: How long a stopped tracker process is given to exit on SIGTERM before it is killed.
_STOP_SECONDS = 10.0
#: The tracker process's command: the worker without the executor's and the training
#: package's ``__init__`` (they import torch and transformers, which no tracker needs: seconds
#: of start-up and hundreds of MB): both are entered as bare packages over their folders.
_BOOTSTRAP = f"""
import os, sys, types
import dflash_recipes
root = os.path.dirname(dflash_recipes.__file__)
for name in ("executor", "executor.training"):
    package = types.ModuleType("dflash_recipes." + name)
    package.__path__ = [os.path.join(root, *name.split("."))]
    sys.modules[package.__name__] = package
from {WORKER_MODULE} import main
main()
"""


class TrackerProcess:
    """The trackers of ``training.report_to``, run in their own process."""

    def __init__(self, names: Sequence[str], context: Mapping[str, object]) -> None:
        self.names = tuple(names)
        # -P: the current directory is not put on the child's import path; the module name is
        # an argument the bootstrap ignores, for `ps` to show what the process is.
        self._process = subprocess.Popen(
            [sys.executable, "-P", "-c", _BOOTSTRAP, WORKER_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._answers: queue.Queue[Mapping[str, object] | None] = queue.Queue()
        #: Lines for the writer thread; None ends it. A message that waits for an answer sets
        #: _urgent after queueing its line: it is written at once, with the rows before it.
        self._lines: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._urgent = threading.Event()
        #: Set once the process ended unasked: (the step of the last row sent, why).
        self._gone: tuple[int | None, str] | None = None
        self._closing = False
        self._last_step: int | None = None
        self._missed = 0
        self._reader = threading.Thread(
            target=self._read, args=(self._process.stdout,), name="dflash-trackers-in", daemon=True
        )
        self._writer = threading.Thread(
            target=self._write, args=(self._process.stdin,), name="dflash-trackers-out", daemon=True
        )
        self._reader.start()
        self._writer.start()
        self._send({"op": "open", "names": list(self.names), "context": dict(context)})
        opened = self._answer("opened")
        self.resume_state: dict[str, dict[str, str]] = (
            dict(opened) if isinstance(opened, dict) else {}
        )

    def log_config(self, config: Mapping[str, ConfigValue], tags: Mapping[str, str]) -> None:
        """Record the plan, and wait until every tracker has it (or failed at it).

        Waiting here makes "the tracker runs hold the plan before step 1" a fact rather than a
        race with the first rows, at a one-off cost before training starts.
        """
        self._send({"op": "config", "config": dict(config), "tags": dict(tags)})
        self._send({"op": "flush"})
        self._answer("flushed")

    def log_line(self, line: str, step: int | None) -> None:
        """Send one row given as its strict-JSON text (a metrics.jsonl line without newline)."""
        if self._gone is not None:
            self._missed += 1
            return
        if step is not None:
            self._last_step = step
        self._lines.put(b'{"op":"row","row":' + line.encode("utf-8") + b"}\n")

    def flush(self) -> tuple[str, ...]:
        """Wait until the trackers delivered every row; one line per tracker that missed rows."""
        self._send({"op": "flush"})
        problems = self._answer("flushed", timeout=END_SECONDS)
        found = [str(p) for p in problems] if isinstance(problems, list) else []
        if problems is _NO_ANSWER:
            found += [
                f"{name} had not confirmed delivering every row after {END_SECONDS:g} s"
                for name in self.names
            ]
        if self._gone is not None:
            step, reason = self._gone
            where = f"step {step}" if step is not None else "the start"
            found += [
                f"{name} missed {self._missed} row(s) after failing at {where} ({reason})"
                for name in self.names
            ]
        return tuple(found)

    def close(self, outcome: Outcome) -> None:
        """End the tracker runs (``outcome`` for MLflow's status and W&B's exit code)."""
        self._closing = True
        self._send({"op": "close", "outcome": outcome})
        if self._answer("closed", timeout=END_SECONDS) is _NO_ANSWER:
            logger.warning(
                "the trackers (%s) did not finish closing within %g s; stopped their process "
                "so the run can end (their runs may lack the end; metrics.jsonl has every row)",
                ", ".join(self.names),
                END_SECONDS,
            )
            self._stop()
        self._lines.put(None)
        self._urgent.set()
        self._writer.join()
        self._process.wait()
        self._reader.join()

    def _stop(self) -> None:
        """SIGTERM, then SIGKILL if the process has not exited within _STOP_SECONDS."""
        with contextlib.suppress(OSError):
            self._process.terminate()
        try:
            self._process.wait(_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                self._process.kill()

    # -- the two threads and the answers ---------------------------------------------------

    def _send(self, message: Mapping[str, object]) -> None:
        if self._gone is None:
            self._lines.put(json.dumps(message, allow_nan=False).encode("utf-8") + b"\n")
            self._urgent.set()

    def _answer(self, key: str, *, timeout: float | None = None) -> object:
        """The process's answer `key` (None when it ended without giving one; _NO_ANSWER when
        `timeout` seconds passed without it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._gone is None:
            try:
                if deadline is None:
                    answer = self._answers.get()
                else:
                    answer = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return _NO_ANSWER
            if answer is None:
                break
            if key in answer:
                return answer[key]
        return None

    def _write(self, stream: IO[bytes]) -> None:
        done = False
        while not done:
            chunk = gather(self._lines, self._urgent, GATHER_SECONDS)
            done = None in chunk
            try:
                stream.write(b"".join(line for line in chunk if line is not None))
                stream.flush()
            except OSError:  # the process is gone: the reader sees it end
                done = True
        with contextlib.suppress(OSError):
            stream.close()

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            try:
                message = json.loads(raw)
                if "log" in message:
                    level, text = message["log"]
                    logger.log(int(level), "%s", text)
                else:
                    self._answers.put(dict(message))
            except (ValueError, TypeError):  # not one of the worker's messages: skipped
                continue
        code = self._process.wait()
        if not self._closing:
            self._gone = (self._last_step, f"the tracker process ended with exit code {code}")
            logger.warning(
                "tracker process (%s) ended with exit code %s at step %s; training goes on "
                "without them and metrics.jsonl keeps every row",
                ", ".join(self.names),
                code,
                self._last_step,
            )
        self._answers.put(None)


def gather(
    lines: queue.SimpleQueue[bytes | None], urgent: threading.Event, seconds: float
) -> list[bytes | None]:
    """The next chunk to write: the first line, then what queues until `seconds` have passed
    or `urgent` is set (by a message that waits for an answer, or the end, after queueing it).

    Only the first line wakes the caller: later ones are queued without waking anyone.
    """
    chunk = [lines.get()]
    urgent.wait(seconds)
    urgent.clear()
    while not lines.empty():
        chunk.append(lines.get())
    return chunk


__all__ = ["END_SECONDS", "GATHER_SECONDS", "WORKER_MODULE", "TrackerProcess", "gather"]
