"""The decisions every rank of a data-parallel run must share, made in one place.

A decision that ranks could make differently (a file listing seen through a stale network
filesystem, a read error on one node, a recipe compiled again by every worker) is made once and
received by the others; a rank that decided on its own would start another step or train
another plan, and the job would hang at its next collective. Each helper here is a no-op for a
single process, and every rank calls it at the same point.

- :func:`rank0_decides`: rank 0 runs the decision (which checkpoint to resume, which one could
  be read), every other rank receives its answer; an error on rank 0 stops every rank with
  rank 0's message instead of leaving them waiting.
- :func:`stop_if_any_rank_failed`: what each rank did on its own (restoring the checkpoint rank
  0 chose) either worked everywhere or stops every rank, naming the rank that failed.
- :func:`require_same_plan`: before any work, the ranks compare their plan fingerprints and stop
  together, naming each rank's fingerprint, when they differ.
- :func:`rank0_measurement`: a figure only rank 0 measures (the held-out acceptance of an
  evaluation), received by every rank, so that no rank acts on a value the others lack.
- :class:`StepVote`: the stop and checkpoint-now decision at each step boundary; any rank's
  signal counts (the MAX over ranks), one asynchronous all-reduce per step.
- :func:`wait_for_rank0`: where every rank meets after work rank 0 does alone (a whole
  checkpoint, the export, a restore): a rank that waits longer than
  ``training.distributed_timeout_s`` stops with a message naming rank 0 and that work, not
  the backend's bare timeout. :func:`rank0_text` is that wait when the other ranks also need
  rank 0's answer (what the shared build of the tokenized-data cache tells them).

What needs no collective: a decision computed only from values every rank holds identically
(the optimiser step, the plan, the vote's agreed flags): when to log, evaluate and save, and
``stop_after``. Those stay plain functions of the step (``training/eval_policy.py``,
``training/save_policy.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from dflash_recipes import errors
from dflash_recipes.errors import DFlashRecipeError, PlanError, RanksOutOfStepError
from dflash_recipes.executor.collectives import broadcast_text, first_rank_where, gather_texts
from dflash_recipes.executor.dist_env import DistEnv, joined
from dflash_recipes.executor.signals import SignalWatch

#: How rank 0's answer travels: "ok" or "none" or "error <class>", a newline, the text.
_OK, _NONE, _ERROR = "ok", "none", "error"


def rank0_decides(decide: Callable[[], str | None], env: DistEnv) -> str | None:
    """Rank 0's ``decide()`` on every rank: rank 0 runs it, the others wait for its answer.

    An exception on rank 0 is raised again there; every other rank raises the same
    :class:`~dflash_recipes.errors.DFlashRecipeError` class with rank 0's message (a
    :class:`~dflash_recipes.errors.DFlashRecipeError` naming rank 0 for any other exception).
    The answer travels as UTF-8 text of at most about 4 KiB
    (:data:`~dflash_recipes.executor.collectives.TEXT_LIMIT`).
    """
    if not joined(env):
        return decide()
    answer: str | None = None
    failure: BaseException | None = None
    if env.rank == 0:
        try:
            answer = decide()
        except Exception as exc:  # every rank must hear of it, whatever it is
            failure = exc
        if failure is not None:
            message = f"{_ERROR} {type(failure).__name__}\n{failure}"
        else:
            message = f"{_NONE}\n" if answer is None else f"{_OK}\n{answer}"
    else:
        message = None
    received = broadcast_text(message, env)
    if failure is not None:
        raise failure
    if env.rank == 0:
        return answer
    return _answer_of(received)


def _answer_of(received: str | None) -> str | None:
    header, _, text = (received or "").partition("\n")
    if header == _OK:
        return text
    if header == _NONE:
        return None
    kind = header.removeprefix(_ERROR).strip()
    raise _same_error(kind, text)


def _same_error(kind: str, message: str) -> DFlashRecipeError:
    """Rank 0's error as this rank raises it: the same class when it is one of ours."""
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, DFlashRecipeError):
        return cls(message)
    return DFlashRecipeError(f"rank 0 stopped ({kind}): {message}")


def stop_if_any_rank_failed(
    problem: DFlashRecipeError | None,
    env: DistEnv,
    *,
    what: str,
    error: type[DFlashRecipeError] = DFlashRecipeError,
) -> None:
    """Raise on every rank when any rank's `problem` is not None (one all-reduce).

    A rank that failed raises its own `problem`; the others raise `error` naming the lowest
    failing rank and `what` it could not do (that rank's own message says why).
    """
    failed = first_rank_where(problem is not None, env)
    if problem is not None:
        raise problem
    if failed is not None:
        msg = f"rank {failed} could not {what}; its own error says why"
        raise error(msg)


def require_same_plan(fingerprint: str, env: DistEnv) -> None:
    """Stop every rank, naming each rank's plan fingerprint, unless all ranks hold one plan.

    Under ``run recipe.yaml --nproc-per-node N`` every worker compiles the recipe itself; a
    file that differs between nodes (the base model, the data, a path mounted elsewhere) or an
    override given to one node only gives another plan. Call it before any work.
    """
    prints = gather_texts(fingerprint, env)
    if len(set(prints)) <= 1:
        return
    listed = ", ".join(f"rank {rank} {value[:16]}" for rank, value in enumerate(prints))
    msg = (
        f"the ranks hold different plans (plan fingerprints: {listed}): each worker compiled "
        "the recipe on its own and read different files or settings; compile once "
        "(`dflash-recipe compile RECIPE -o plan.json`) on a filesystem every node shares "
        "and run that plan.json on every node"
    )
    raise PlanError(msg)


def rank0_measurement(value: float | None, env: DistEnv) -> float | None:
    """Rank 0's `value` (a figure only rank 0 measured, or None) on every rank."""
    text = rank0_decides(lambda: None if value is None else repr(float(value)), env)
    return None if text is None else float(text)


class StepVote:
    """The ranks' agreement at step boundaries: one asynchronous tiny all-reduce per step.

    :meth:`decide` returns ``(stop_signal or 0, checkpoint_now)``, the same on every rank:
    the MAX over ranks of what each rank's :class:`~dflash_recipes.executor.signals.SignalWatch`
    had recorded at the previous boundary (any rank's signal stops every rank, so this is a
    vote, not rank 0's decision). Every step boundary starts one all-reduce on a CPU (gloo)
    group and reads the one started at the previous boundary, long finished: no device sync and
    no blocking collective on a step without a signal; the price is that the ranks stop one
    step after the step in which the signal arrived. One process decides on its own flags at
    once, with no collective at all.
    """

    def __init__(
        self, watch: SignalWatch, *, distributed: bool, timeout_s: float | None = None
    ) -> None:
        self._watch = watch
        self._pending: tuple[dist.Work, Tensor] | None = None
        self._group: dist.ProcessGroup | None = None
        self._distributed = distributed
        if distributed:
            # A CPU group: the flag never touches the accelerator, so waiting costs no sync.
            # A new group does not inherit the world's timeout: the plan's is given again.
            timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=timeout)

    def decide(self) -> tuple[int, bool]:
        watch = self._watch
        if not self._distributed:
            return watch.stop_signal or 0, watch.take_checkpoint_request()
        agreed = (0, 0)
        if self._pending is not None:
            agreed = self._collect()
            if agreed[1]:  # the same SIGUSR1 reaching this rank a step later: one checkpoint
                watch.take_checkpoint_request()
        local = (watch.stop_signal or 0, int(watch.take_checkpoint_request()))
        flags = torch.tensor(local, dtype=torch.int64)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        assert work is not None  # async_op=True always returns the handle
        self._pending = (work, flags)
        if agreed[0] and not watch.stopping:
            watch.request_stop(agreed[0])
        return agreed[0], bool(agreed[1])

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any: a blocking all-reduce on the CPU
        group (no device sync), for a decision the ranks must take at the same point (one
        process: `flag` itself). Every rank must call it at the same point of the loop."""
        if not self._distributed:
            return flag
        flags = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flags.item())

    def _collect(self) -> tuple[int, int]:
        assert self._pending is not None
        work, flags = self._pending
        self._pending = None
        work.wait()
        values = flags.tolist()
        return int(values[0]), int(values[1])

    def close(self) -> None:
        """Finish the collective still in flight (every rank started it)."""
        if self._pending is not None:
            self._collect()


#: The CPU (gloo) group each process group's waits use, made at the first wait (every rank
#: waits at the same points, so every rank makes it at the same point).
_WAIT_GROUPS: dict[int, dist.ProcessGroup] = {}


def wait_for_rank0(env: DistEnv, what: str, *, timeout_s: float | None) -> None:
    """Every rank meets here once rank 0 has done `what` alone (say it as "save the checkpoint
    of step 4"); a no-op for a single process.

    A rank that waits longer than `timeout_s` (``training.distributed_timeout_s``) raises
    :class:`~dflash_recipes.errors.RanksOutOfStepError` naming itself, rank 0 and `what`, and
    the fix. The wait is on a CPU group, so it never blocks the accelerator and fails the same
    way under NCCL.
    """
    if not joined(env):
        return
    key = id(dist.group.WORLD)
    try:
        group = _WAIT_GROUPS.get(key)
        if group is None:  # its making waits for every rank too
            timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
            group = _WAIT_GROUPS[key] = dist.new_group(backend="gloo", timeout=timeout)
        dist.barrier(group=group)
    except RuntimeError as exc:  # the timeout (a DistError), or a rank that left
        waited = "" if timeout_s is None else f" (training.distributed_timeout_s: {timeout_s:g})"
        if env.rank == 0:  # rank 0 did its part: another rank is the one missing
            msg = (
                f"rank 0 stopped waiting for the other ranks to meet it after its solitary "
                f"work ({what}){waited}: another rank stopped or is out of step (its own log "
                "says which); if rank 0's work is just slow (a large drafter, a slow "
                "filesystem), raise training.distributed_timeout_s"
            )
        else:
            msg = (
                f"rank {env.rank} stopped waiting for rank 0 to {what}{waited}: rank 0 took "
                "longer or stopped (its own log says which); if the work is just slow (a large "
                "drafter, a slow filesystem), raise training.distributed_timeout_s"
            )
        raise RanksOutOfStepError(msg) from exc


def rank0_text(text: str | None, env: DistEnv, what: str, *, timeout_s: float | None) -> str | None:
    """Rank 0's `text` (None when it has none) on every rank, once rank 0 has done `what` alone.

    The wait is :func:`wait_for_rank0`'s (a rank that waits longer than `timeout_s` raises
    :class:`~dflash_recipes.errors.RanksOutOfStepError` naming rank 0 and `what`); the text
    then travels as :func:`~dflash_recipes.executor.collectives.broadcast_text` carries it, at
    once, rank 0 being there. A single process: `text` itself.
    """
    wait_for_rank0(env, what, timeout_s=timeout_s)
    return broadcast_text(text, env)


__all__ = [
    "StepVote",
    "rank0_decides",
    "rank0_measurement",
    "rank0_text",
    "require_same_plan",
    "stop_if_any_rank_failed",
    "wait_for_rank0",
]
