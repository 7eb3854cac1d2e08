"""Exceptions raised by dflash_recipes.

Every exception a user can cause derives from :class:`DFlashRecipeError`, so a caller (and the
CLI) can catch one type and print a clean message instead of a traceback::

    DFlashRecipeError
     ├── RecipeError              a recipe could not be loaded or structured (carries diagnostics)
     ├── CompileError             compilation found errors (carries diagnostics)
     ├── PlanError                a run plan is malformed, unresolved or from another version
     ├── SafetensorsHeaderError   a safetensors header is malformed or out of bounds
     ├── CheckpointError          a checkpoint directory is missing, incomplete or inconsistent
     │    └── WarmStartError      checkpoint tensors do not match the drafter being loaded
     ├── DataError                training data is unusable
     ├── LaunchError              a distributed launch or environment is misconfigured
     ├── DirectoryLockedError     another process is writing the same output directory
     ├── ReplaceRefusedError      an output path holds data the tool will not replace or delete
     ├── RunIOError               reading or writing a run's files failed (disk full, permissions)
     ├── Interrupted              a signal stopped a command at a boundary (exit 128 + signal)
     ├── TrackerError             a tracker in training.report_to cannot start (library missing)
     ├── ResourceError            a plan's resources cannot be estimated, or do not fit the device
     ├── TrainingDivergedError    too many optimiser steps in a row had a NaN or Inf gradient norm
     ├── RanksOutOfStepError      a rank waited past distributed_timeout_s for another rank's work
     ├── RegenerateError          `regenerate` cannot start: unusable server, settings or output
     └── TargetServerError        a served target (vLLM) cannot give the tap states a run needs
          ├── TargetServerUnavailable   no server answered (each host:port and what it did)
          └── ServedStatesError         an answer differs from what was asked (token ids, layer
                                        count, hidden size, dtype, NaN/Inf): never retried
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dflash_recipes.echo import bound_message

if TYPE_CHECKING:
    from dflash_recipes.diagnostics import Diagnostic


class DFlashRecipeError(Exception):
    """Base class of every error a user of dflash_recipes can cause.

    Its text is printable and bounded (:func:`~dflash_recipes.echo.bound_message`), whatever a
    message echoes: a huge or unencodable value cannot flood or crash what prints it.
    """

    def __str__(self) -> str:
        return bound_message(super().__str__())


class _DiagnosticsError(DFlashRecipeError):
    """An error that carries the diagnostics which explain it."""

    def __init__(self, message: str, diagnostics: Sequence[Diagnostic] = ()) -> None:
        super().__init__(message)
        self.diagnostics: tuple[Diagnostic, ...] = tuple(diagnostics)

    def __str__(self) -> str:
        base = super().__str__()
        if not self.diagnostics:
            return base
        from dflash_recipes.diagnostics import render_text

        return bound_message(base + "\n" + render_text(self.diagnostics))


class RecipeError(_DiagnosticsError):
    """The recipe file or the Python values could not be turned into a valid Recipe."""


class CompileError(_DiagnosticsError):
    """Compilation reported at least one error diagnostic."""


class PlanError(DFlashRecipeError):
    """A run plan is malformed, incomplete (unresolved) or was written by another format version."""


class SafetensorsHeaderError(DFlashRecipeError):
    """A safetensors file's header is malformed, inconsistent or larger than allowed."""


class CheckpointError(DFlashRecipeError):
    """A checkpoint directory is missing, incomplete or inconsistent."""


class WarmStartError(CheckpointError):
    """The tensors of an init checkpoint do not match the drafter that should receive them."""


class DataError(DFlashRecipeError):
    """Training or evaluation data is unusable."""


class LaunchError(DFlashRecipeError):
    """A distributed launch or its environment is misconfigured."""


class RegenerateError(DFlashRecipeError):
    """`dflash-recipe regenerate` cannot start or go on: the server, its settings or the output."""


class TargetServerError(DFlashRecipeError):
    """A served target (vLLM with the hidden-states connector) cannot give the tap states a run
    needs: a server refused the request, answered with something that is not vLLM's answer, or
    its hidden-states file or lock could not be read. The message names the server as host:port
    and the file or lock involved."""


class TargetServerUnavailable(TargetServerError):
    """No server answered a request, after the retries on each: the message names every server
    as host:port and what each did (refused the connection, timed out, failed to write)."""


class ServedStatesError(TargetServerError):
    """A server answered with other states than were asked: other token ids (a chat-template or
    BOS drift), another layer count or hidden size (a server started for other taps), another
    dtype, or NaN/Inf. Never retried: the same request would get the same answer."""


class DirectoryLockedError(DFlashRecipeError):
    """Another process holds the lock of an output directory (one writer per directory)."""


class ReplaceRefusedError(DFlashRecipeError):
    """An output path holds data the tool will not replace or delete (a run, a user's files)."""


class RunIOError(DFlashRecipeError):
    """Reading or writing a run's files failed at run time (full disk, permissions, I/O)."""


class Interrupted(DFlashRecipeError):
    """A signal (SIGTERM, SIGINT) stopped a command at a boundary; what was complete is kept.

    The message is the one line the command prints (which signal, where it stopped, what was
    saved, "rerun the same command to resume"); ``exit_code`` is 128 + the signal number.
    """

    def __init__(self, message: str, *, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class TrackerError(DFlashRecipeError):
    """An experiment tracker named in training.report_to cannot start (its library is missing)."""


class ResourceError(DFlashRecipeError):
    """A plan's memory cannot be estimated, or the estimate exceeds the device it runs on."""


class TrainingDivergedError(DFlashRecipeError):
    """``training.max_nonfinite_steps`` optimiser steps in a row had a NaN or Inf gradient
    norm: each was skipped, and the run stops without saving after them."""


class RanksOutOfStepError(DFlashRecipeError):
    """A rank waited longer than ``training.distributed_timeout_s`` for the work one rank does
    alone (a checkpoint, the export, a restore); the message names that rank and the work."""


__all__ = [
    "CheckpointError",
    "CompileError",
    "DFlashRecipeError",
    "DataError",
    "DirectoryLockedError",
    "Interrupted",
    "LaunchError",
    "PlanError",
    "RanksOutOfStepError",
    "RecipeError",
    "RegenerateError",
    "ReplaceRefusedError",
    "ResourceError",
    "RunIOError",
    "SafetensorsHeaderError",
    "ServedStatesError",
    "TargetServerError",
    "TargetServerUnavailable",
    "TrackerError",
    "TrainingDivergedError",
    "WarmStartError",
]
