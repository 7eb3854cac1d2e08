"""torchrun (``torch.distributed.run``) as `run --nproc-per-node` starts it, minus its traceback
on a stop signal, and with the stop grace kept where torchrun cannot keep it.

torchrun forwards SIGTERM / SIGINT to its workers, waits for them (they finish their step and
save, :mod:`dflash_recipes.executor.signals`), then raises ``SignalException`` out of its
``main`` and prints a traceback after the workers' one-line summary. Here that exception ends
the process with 128 + the signal number and nothing more.

A torchrun without ``--shutdown-timeout`` (torch before 2.12) SIGKILLs the workers 30 s after
forwarding a stop signal. The launcher then tells it to leave SIGTERM and SIGINT alone
(``--signals-to-handle`` without them, :func:`~dflash_recipes.executor.launch.stop_grace_options`)
and this wrapper takes them (:class:`KeptStopSignals`): it passes each on to the workers and,
inside the signal handler, waits until every worker has exited. torchrun runs in this thread,
so it is held still meanwhile: it neither starts a deadline nor, seeing the first worker exit
with 128 + the signal, signals the others again in the middle of their save. Anything else is
torchrun's own behaviour, unchanged. Run as ``python -m dflash_recipes.executor.torchrun
ARGS...`` with torchrun's arguments.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType, TracebackType

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser
from torch.distributed.run import main as torchrun_main

from dflash_recipes.executor.launch import KEPT_STOP_SIGNALS
from dflash_recipes.executor.signals import DUPLICATE_WINDOW_S, Handler, child_pids

#: How often the wait for the workers looks at them.
_POLL_S = 0.05


def kept_stop_signals(argv: Sequence[str]) -> tuple[signal.Signals, ...]:
    """The stop signals torchrun is told by `argv` not to handle (none where it has no say)."""
    known, _ = get_args_parser().parse_known_args(list(argv))
    handled = getattr(known, "signals_to_handle", None)
    if handled is None:  # a torchrun that handles every stop signal itself
        return ()
    names = {name.strip() for name in str(handled).split(",")}
    return tuple(signal.Signals[name] for name in KEPT_STOP_SIGNALS if name not in names)


class KeptStopSignals:
    """While entered, `signals` go to torchrun's workers, and the handler waits for them.

    The first signal, and one more than :data:`DUPLICATE_WINDOW_S` after it (a second stop
    abandons a save, as for a worker), are passed on to every worker; one within the window is
    the same event delivered twice (Slurm signals every process of the step) and is dropped.
    The handler returns once every worker it signalled has exited: no deadline, the
    scheduler's grace period is the one that counts. Main thread only (elsewhere: no effect).
    """

    def __init__(self, signals: Sequence[signal.Signals]) -> None:
        self._signals = tuple(signals)
        self._previous: dict[int, Handler] = {}
        #: The first stop signal passed on, or None.
        self.received: int | None = None
        self._first_time = 0.0
        self._waiting = False

    def __enter__(self) -> KeptStopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self._signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_time = signum, now
        elif now - self._first_time < DUPLICATE_WINDOW_S:
            return
        workers = child_pids(os.getpid())
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):  # it has just exited
                os.kill(pid, signum)
        if self._waiting:  # a second signal: the first handler call is still waiting
            return
        self._waiting = True
        try:
            wait_for_exit(workers)
        finally:
            self._waiting = False


def wait_for_exit(pids: Sequence[int]) -> None:
    """Return once every child in `pids` has exited, leaving it for its parent to reap."""
    waiting = list(pids)
    while waiting:
        still = []
        for pid in waiting:
            try:
                # WNOWAIT: look, do not reap; torchrun's own wait() collects the status.
                state = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # already reaped
                continue
            if state is None:
                still.append(pid)
        waiting = still
        if waiting:
            time.sleep(_POLL_S)


def main(argv: Sequence[str] | None = None) -> int:
    """torchrun's main; a stop signal is exit 128 + signal, no traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    with KeptStopSignals(kept_stop_signals(args)) as kept:
        try:
            torchrun_main(args)
        except SignalException as exc:
            return 128 + int(exc.sigval)
        except ChildFailedError:
            # the workers stopped by a kept signal end with 128 + it: that is the stop, done
            if kept.received is None:
                raise
    return 0 if kept.received is None else 128 + kept.received


if __name__ == "__main__":
    sys.exit(main())
