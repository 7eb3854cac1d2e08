"""Signals from a scheduler or a person: stop at a step boundary, checkpoint now, abandon a save.

Clusters end jobs with a signal: Slurm's time limit, ``scancel`` and preemption send SIGTERM
(then SIGKILL after ``KillWait``), Kubernetes sends SIGTERM (then SIGKILL after
``terminationGracePeriodSeconds``), Ctrl-C sends SIGINT. ``sbatch --signal=B:USR1@120`` warns
earlier with SIGUSR1. The long-running commands (``run``, ``capture``, ``regenerate``) share
this module:

- :class:`SignalWatch` records SIGTERM / SIGINT (stop) and SIGUSR1 (checkpoint now) instead of
  dying on the spot. The loop asks it at its boundaries (an optimiser step, a shard, a
  journal entry) and stops or saves there.
- A second stop signal once the first has been taken (after :data:`DUPLICATE_WINDOW_S`: Slurm
  signals every process of a step and torchrun forwards the same signal a moment later)
  raises :class:`Abandoned` in the main thread: a save in progress is given up (the crash-safe
  writers remove their staging files), and the newest complete checkpoint stays the one a
  rerun resumes from.
- The ranks of a data-parallel run agree on what a signal decides through
  :class:`~dflash_recipes.executor.coordination.StepVote` (with every other decision the ranks
  share): one asynchronous all-reduce per step, so they stop one step after the step in
  which the signal arrived.
- :func:`run_forwarding_signals` is the launcher's side (``--nproc-per-node``): it passes the
  signals a scheduler sends to the launcher on to torchrun (stop) or to the workers (SIGUSR1,
  which torchrun would treat as a death signal).
- :class:`RaiseOnStopSignals` turns SIGTERM into what Ctrl-C is (a KeyboardInterrupt,
  :class:`StopRequested`) for loops that already seal their work on it (``regenerate``).

:class:`Interrupted` (:mod:`dflash_recipes.errors`) carries the one line a stopped command
prints and its exit status, 128 + the signal number (143 for SIGTERM, 130 for SIGINT).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType, TracebackType

from dflash_recipes.errors import Interrupted
from dflash_recipes.files.run_dir import checkpoint_dir_name, complete_checkpoints

#: The signals that stop a run at its next boundary.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
#: The signal that asks for a checkpoint now, training going on (Slurm's ``--signal``).
CHECKPOINT_SIGNAL = signal.SIGUSR1
#: A stop signal this soon after the first is the same event delivered twice (Slurm signals
#: every process of the job step, and torchrun forwards it as well), not a second request.
DUPLICATE_WINDOW_S = 1.0


class Abandoned(BaseException):
    """A second stop signal: give up what is being done now (a save) and exit at once.

    A BaseException so that no ``except Exception`` on the way swallows it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15 (the number when the platform has no name for it)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_status(signum: int) -> int:
    """What a shell and a scheduler expect from a process stopped by `signum`: 128 + signum."""
    return 128 + signum


Handler = Callable[[int, FrameType | None], object] | int | None


class _InstalledHandlers:
    """Installs one handler for some signals while entered (a context manager).

    Installs only in the main thread (Python delivers signals there); elsewhere it installs
    nothing and the process keeps the handlers it had. Restores the previous handlers on exit.
    """

    def __init__(self, signals: Sequence[int]) -> None:
        self._signals = tuple(signals)
        self._previous: dict[int, Handler] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        raise NotImplementedError

    def _install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in self._signals:
                self._previous[signum] = signal.signal(signum, self._handle)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


class SignalWatch(_InstalledHandlers):
    """Records stop and checkpoint signals while installed (a context manager).

    Installs only in the main thread (Python delivers signals there); elsewhere it records
    nothing and the process keeps the handlers it had. Restores the previous handlers on exit.
    """

    def __init__(self, *, checkpoint_signal: bool = True) -> None:
        super().__init__(list(STOP_SIGNALS) + ([CHECKPOINT_SIGNAL] if checkpoint_signal else []))
        self.stop_signal: int | None = None
        self._stop_time = 0.0
        self._checkpoint_requested = False

    # -- installation -------------------------------------------------------------------

    def __enter__(self) -> SignalWatch:
        self._install()
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == CHECKPOINT_SIGNAL:
            self._checkpoint_requested = True
            return
        now = time.monotonic()
        if self.stop_signal is None:
            self.stop_signal, self._stop_time = signum, now
            return
        if now - self._stop_time >= DUPLICATE_WINDOW_S:
            raise Abandoned(signum)

    # -- what the loop asks -------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self.stop_signal is not None

    def take_checkpoint_request(self) -> bool:
        """Whether SIGUSR1 arrived since the last call (the request is consumed)."""
        requested, self._checkpoint_requested = self._checkpoint_requested, False
        return requested

    def request_stop(self, signum: int) -> None:
        """Record `signum` as if it had arrived (the agreed decision of the other ranks)."""
        if self.stop_signal is None:
            self.stop_signal, self._stop_time = signum, time.monotonic()


# ---------------------------------------------------------------------------------------------
# the lines a stopped command prints
# ---------------------------------------------------------------------------------------------

RERUN = "rerun the same command to resume"


def stopped_run(signum: int, step: int, total_steps: int, output_dir: Path) -> Interrupted:
    """The training run stopped by `signum` after `step`, its checkpoint saved."""
    checkpoint = output_dir / checkpoint_dir_name(step)
    msg = (
        f"stopped by {signal_name(signum)} after step {step} of {total_steps}: saved "
        f"{checkpoint}; {RERUN}"
    )
    return Interrupted(msg, signum=signum)


def abandoned_run(exc: Abandoned, output_dir: Path) -> Interrupted:
    """A second stop signal gave up the save (or the step) in progress."""
    found = complete_checkpoints(output_dir)
    newest = (
        f"the newest valid checkpoint is {found[-1][1]}"
        if found
        else f"no checkpoint was saved in {output_dir} yet"
    )
    msg = (
        f"stopped at once by a second {signal_name(exc.signum)}: the step or save in progress "
        f"was abandoned and left nothing half-written; {newest}; {RERUN}"
    )
    return Interrupted(msg, signum=exc.signum)


def stopped_capture(signum: int, output: Path, *, abandoned: bool) -> Interrupted:
    """`capture` stopped by `signum`: the whole shards are kept, a rerun writes the rest."""
    how = (
        "the shard being written was dropped"
        if abandoned
        else "the shard being written was finished"
    )
    msg = f"stopped by {signal_name(signum)}: {how}; every whole shard in {output} is kept; {RERUN}"
    return Interrupted(msg, signum=signum)


def stopped_regenerate(exc: KeyboardInterrupt) -> Interrupted:
    """`regenerate` stopped by a signal (Ctrl-C: SIGINT): its journal is sealed into a part."""
    signum = exc.signum if isinstance(exc, StopRequested) else int(signal.SIGINT)
    msg = (
        f"stopped by {signal_name(signum)}: every answered conversation is kept (the journal "
        f"was sealed into the output's parts); {RERUN}"
    )
    return Interrupted(msg, signum=signum)


class StopRequested(KeyboardInterrupt):
    """SIGTERM or SIGINT, raised where the main thread is (as Ctrl-C raises KeyboardInterrupt).

    For loops that already seal their work on KeyboardInterrupt (``regenerate``'s journal):
    SIGTERM then takes the same path; ``signum`` says which signal it was.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


class RaiseOnStopSignals(_InstalledHandlers):
    """While installed, SIGTERM and SIGINT raise :class:`StopRequested` (main thread only)."""

    def __init__(self) -> None:
        super().__init__(STOP_SIGNALS)

    def __enter__(self) -> RaiseOnStopSignals:
        self._install()
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        raise StopRequested(signum)


# ---------------------------------------------------------------------------------------------
# the launcher's side
# ---------------------------------------------------------------------------------------------


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is `parent` (Linux ``/proc``; empty elsewhere)."""
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after it.
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and fields[1] == str(parent):
            found.append(int(entry))
    return found


def run_forwarding_signals(argv: Sequence[str]) -> int:
    """Run the torchrun command `argv`, passing on the signals this launcher receives.

    SIGTERM / SIGINT go to torchrun, which forwards them to its workers and waits for them
    (each worker finishes its step and saves); SIGUSR1 goes to torchrun's children, the
    workers, directly (torchrun would take it as a death signal). torchrun runs in its own
    session so that Ctrl-C in a terminal reaches it once, through this launcher. Returns
    torchrun's exit status, or 128 + the first stop signal received.
    """
    received: list[int] = []
    process = subprocess.Popen(list(argv), start_new_session=True)

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum == CHECKPOINT_SIGNAL:
            for pid in child_pids(process.pid):
                _send(pid, signum)
            return
        received.append(signum)
        _send(process.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (*STOP_SIGNALS, CHECKPOINT_SIGNAL)}
    try:
        code = process.wait()  # the handlers above run while this waits (PEP 475 retries)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        return exit_status(received[0])
    return 128 - code if code < 0 else code


def _send(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it has just exited
        os.kill(pid, signum)


__all__ = [
    "CHECKPOINT_SIGNAL",
    "DUPLICATE_WINDOW_S",
    "STOP_SIGNALS",
    "Abandoned",
    "RaiseOnStopSignals",
    "SignalWatch",
    "StopRequested",
    "abandoned_run",
    "child_pids",
    "exit_status",
    "run_forwarding_signals",
    "signal_name",
    "stopped_capture",
    "stopped_regenerate",
    "stopped_run",
]
