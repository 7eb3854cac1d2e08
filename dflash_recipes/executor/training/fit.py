"""Training one run plan: :func:`run_plan` sets up, :func:`fit` runs the optimiser steps.

Read top to bottom: :func:`run_plan` is the shell (the run directory's lock, the signals, the
process group, the ranks' plan check, the errors a user sees); :func:`setup` calls one named
builder per part (``setup/``: resume, data, models, optimizer; the trackers) and returns the
:class:`Run` the loop needs; :func:`fit` is the loop; :func:`finish` exports and summarises.
One optimiser step is ``gradient_accumulation_steps`` micro-batches (:func:`micro_step`): each
draws its anchors (:func:`~dflash_recipes.executor.training.anchors.sample_batch_anchors`),
builds the step's inputs and runs the
:class:`~dflash_recipes.executor.training.step.DraftStep` (the fused taps, the drafter over all
blocks, lm_head and the plan's objective; docs/dflash.md, "The training objective").

Randomness is counter-based: the anchors of a sequence are a pure function of ``(seed, epoch,
position of the sequence in the epoch's order)`` (splitmix64 counters, the whole batch in one
vectorised pass), the data order of ``(seed, epoch)``. There is no hidden RNG stream, so a
resumed run draws exactly what an uninterrupted run would have drawn, and a data-parallel run
draws the same anchors per sequence as a single-process run over the same global batch.

Under DDP the loss of each rank is normalised by the *global* weight sum of the micro-batch
(:func:`~dflash_recipes.executor.collectives.global_batch_loss`), so the averaged gradient
equals the single-process gradient over the whole global batch; with gradient accumulation by
the weight sum of the whole step (:mod:`~dflash_recipes.executor.training.setup.accumulation`).
Every decision the ranks must share (the checkpoint to resume, the plan, the stop) is made in
:mod:`dflash_recipes.executor.coordination`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import attrs
from transformers import PreTrainedTokenizerBase

from dflash_recipes.errors import (
    Interrupted,
    RunIOError,
    TargetServerError,
    TargetServerUnavailable,
)
from dflash_recipes.executor.coordination import StepVote, require_same_plan, wait_for_rank0
from dflash_recipes.executor.dist_env import (
    DistEnv,
    detect_dist_env,
    init_distributed,
    is_main,
    shutdown_distributed,
)
from dflash_recipes.executor.model.convert import load_tokenizer
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.executor.sharded_drafter import whole_drafter_on_rank0
from dflash_recipes.executor.signals import Abandoned, SignalWatch, abandoned_run, stopped_run
from dflash_recipes.executor.training.eval_policy import EvalPolicy, schedule_line
from dflash_recipes.executor.training.metrics import (
    MetricWindow,
    accuracies,
    log_train_window,
    row_number,
)
from dflash_recipes.executor.training.nonfinite import NonfiniteSteps
from dflash_recipes.executor.training.progress_bar import ProgressBar
from dflash_recipes.executor.training.save_policy import SavePolicy
from dflash_recipes.executor.training.setup.models import Models
from dflash_recipes.executor.training.setup.optimizer import (
    Optimization,
)
from dflash_recipes.executor.training.setup.prefetch import Prefetch, PreparedBatch, prepare_batch
from dflash_recipes.executor.training.setup.resume import (
    ResumePoint,
    locked_run_directory,
    restore,
    resume_checkpoint,
    world_size_change,
)
from dflash_recipes.executor.training.setup.train_data import TrainData, build_train_data
from dflash_recipes.executor.training.summary import TrainSummary
from dflash_recipes.executor.training.trackers.fanout import TrackerSet, open_trackers
from dflash_recipes.executor.training.trackers.protocol import Outcome
from dflash_recipes.executor.training.trackers.registry import check_tracker_libraries
from dflash_recipes.executor.training.train_step import TrainStep, build_step, optimizer_step
from dflash_recipes.files.crashsafe import write_text_atomic
from dflash_recipes.files.export_target import check_export_target
from dflash_recipes.files.metrics_rows import KEY_ACCEPTANCE_LENGTH_ESTIMATE, last_train_row
from dflash_recipes.files.run_dir import EXPORT_DIR, METRICS_FILE, PLAN_FILE
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger("dflash_recipes.train")


def run_plan(
    plan: RunPlan,
    *,
    progress: bool = True,
    stop_after: int | None = None,
    max_chunk_logits: int | None = None,
    verify_capture: bool = False,
    skip_memory_check: bool = False,
) -> TrainSummary:
    """Train as the plan says and return the summary (rank 0's view under torchrun).

    `stop_after` stops after that optimiser step with its checkpoint saved, as a killed job
    would; rerunning the recipe then resumes. `max_chunk_logits` bounds the logits one chunk
    of blocks holds (default: sized from the free memory on CUDA,
    :func:`~dflash_recipes.plan.resources.chunk_budget.logits_budget`, and
    :data:`~dflash_recipes.plan.resources.chunk_budget.MAX_CHUNK_LOGITS` on CPU); the loss
    is the same, only the memory and the time change. `verify_capture` hashes every
    shard of the plan's capture before the first step (otherwise each is checked on first use).
    `skip_memory_check` lets a plan the memory estimate refuses train, with a warning.
    """
    env = detect_dist_env(plan.training.device)
    output_dir = Path(plan.training.output_dir)
    # A tracker that cannot start stops the run before anything is loaded or written.
    check_tracker_libraries(plan.training.report_to)
    #: SIGTERM / SIGINT / SIGUSR1 while the run trains (docs/dflash.md, "Signals").
    signals = SignalWatch()
    try:
        with signals, locked_run_directory(output_dir, main=is_main(env)):
            init_distributed(env, timeout_s=plan.training.distributed_timeout_s)
            try:
                require_same_plan(plan.fingerprint, env)  # before any work
                run = setup(
                    plan,
                    env,
                    max_chunk_logits,
                    verify_capture=verify_capture,
                    skip_memory_check=skip_memory_check,
                )
                outcome: Outcome = "failed"
                try:
                    summary = finish(run, fit(run, signals, stop_after, show_progress=progress))
                    outcome = "finished" if summary.steps >= summary.planned_steps else "stopped"
                    return summary
                except Interrupted:  # a stop signal: checkpoint saved, to be resumed
                    outcome = "stopped"
                    raise
                finally:
                    run.trackers.close(outcome)
                    run.data.close()
            finally:
                shutdown_distributed()
    except Abandoned as exc:
        raise abandoned_run(exc, output_dir) from None
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else f" in {output_dir}"
        msg = (
            f"run stopped: cannot read or write{where}: {exc.strerror or exc}; the "
            "checkpoints already saved are intact: fix the cause (free space, "
            "permissions) and rerun to resume"
        )
        raise RunIOError(msg) from exc


@attrs.define(eq=False)
class Run:
    """What :func:`setup` builds for :func:`fit` and :func:`finish`: the training step's parts
    (:class:`~dflash_recipes.executor.training.train_step.TrainStep`) and what a run adds."""

    #: The models, optimizer, precision and loss settings (:func:`.train_step.build_step`).
    train: TrainStep
    output_dir: Path
    tokenizer: PreTrainedTokenizerBase
    data: TrainData
    #: Where training starts (step 0 of epoch 0 for a fresh run).
    start: ResumePoint
    #: Where the metrics rows go: metrics.jsonl and training.report_to (rank 0; else nowhere).
    trackers: TrackerSet
    evaluation: EvalPolicy
    saving: SavePolicy

    @property
    def plan(self) -> RunPlan:
        return self.train.plan

    @property
    def spec(self) -> ResolvedDraft:
        """The drafter the plan resolves to (block size, label shift, taps)."""
        return self.train.spec

    @property
    def env(self) -> DistEnv:
        return self.train.env

    @property
    def models(self) -> Models:
        return self.train.models

    @property
    def optimization(self) -> Optimization:
        return self.train.optimization

    @property
    def nonfinite(self) -> NonfiniteSteps:
        """The skip of a step whose gradient norm is NaN or Inf, and its counters."""
        return self.train.nonfinite


def setup(
    plan: RunPlan,
    env: DistEnv,
    max_chunk_logits: int | None,
    *,
    verify_capture: bool,
    skip_memory_check: bool = False,
) -> Run:
    """Every part of the run from its builder, then plan.json and the trackers. Data problems
    stop the run here, before anything is written to output_dir."""
    output_dir = Path(plan.training.output_dir)
    chosen = resume_checkpoint(plan, env)  # rank 0 decides, every rank receives
    if is_main(env):  # refuse now, not after hours of training
        check_export_target(output_dir / EXPORT_DIR)
    tokenizer = load_tokenizer(plan)
    data = build_train_data(plan, tokenizer, env, verify_capture=verify_capture)
    try:  # a failure from here on stops the servers' client too (a served target)
        train = build_step(
            plan,
            env=env,
            offline=data.offline,
            warm=chosen is None,
            batches_per_epoch=data.batches_per_epoch,
            max_chunk_logits=max_chunk_logits,
            skip_memory_check=skip_memory_check,
            wrap=False,  # after the restore: the restored drafter is the one wrapped
        )
        models, optimization = train.models, train.optimization
        start = restore(
            chosen,
            output_dir,
            models.drafter,
            optimization.optimizer,
            optimization.scheduler,
            env,
            timeout_s=plan.training.distributed_timeout_s,
        )
        if start.checkpoint is not None:  # the plan's rate and decay, not the checkpoint's
            optimization.follow_plan(start.step)
        models.wrap_for_ranks(env)
        trackers = TrackerSet.silent()
        if is_main(env):
            change = world_size_change(
                plan, start, world_size=env.world_size, num_examples=len(data.dataset)
            )
            if change is not None:
                logger.warning("%s", change)
            logger.info("%s", schedule_line(plan))  # training.eval_steps' mode, in words
            output_dir.mkdir(parents=True, exist_ok=True)
            # Atomic: other ranks (or a resume compile) may read plan.json at any moment.
            write_text_atomic(output_dir / PLAN_FILE, plan.to_json())
            trackers = open_trackers(
                plan, output_dir / METRICS_FILE, resumed_from=start.resumed_from
            )
        try:  # a failure from here on (another rank's setup) ends the tracker process too
            wait_for_rank0(
                env,
                "write plan.json and open the trackers",
                timeout_s=plan.training.distributed_timeout_s,
            )
            return Run(
                train=train,
                output_dir=output_dir,
                tokenizer=tokenizer,
                data=data,
                start=start,
                trackers=trackers,
                evaluation=EvalPolicy(
                    plan,
                    env,
                    models,
                    tokenizer,
                    trackers,
                    final_step=optimization.total_steps,
                    held_out=data.held_out,
                ),
                saving=SavePolicy(plan, env, models, optimization),
            )
        except BaseException:
            trackers.close("failed")
            raise
    except BaseException:
        data.close()
        raise


@attrs.define
class Progress:
    """Where the loop stopped and what it measured."""

    done: int
    last_row: dict[str, object] = attrs.Factory(dict)
    tokens: int = 0
    seconds: float = 0.0
    last_eval_tau: float | None = None


def fit(
    run: Run,
    signals: SignalWatch,
    stop_after: int | None,
    *,
    show_progress: bool,
    prefetch: bool = True,
) -> Progress:
    """The optimiser steps from ``run.start`` to the plan's last one (or `stop_after`): log,
    evaluate and save as planned; a stop signal saves and raises Interrupted.

    Batches are prepared on a background thread while the steps run (`prefetch` False: on the
    loop's thread, the synchronous baseline), and nothing is read back from the device between
    logging steps (:mod:`~dflash_recipes.executor.training.setup.prefetch`)."""
    training, env, models, opt = run.plan.training, run.env, run.models, run.optimization
    nonfinite = run.nonfinite
    progress = Progress(done=run.start.step)
    window = MetricWindow(run.spec.block_size, shift=run.spec.label_shift)
    bar = ProgressBar(
        total=opt.total_steps, start=run.start.step, show=show_progress and is_main(env)
    )
    vote = StepVote(
        signals, distributed=env.is_distributed, timeout_s=training.distributed_timeout_s
    )
    where = _DataPosition(now=(run.start.epoch, run.start.next_index))
    models.training_modes()
    with Prefetch(_prepared_batches(run), background=prefetch) as batches:
        for step in range(run.start.step, opt.total_steps):
            taken = _step_batches(run, batches, vote, where, progress)
            out = optimizer_step(run.train, taken, index=step)
            window.add_step(out.micro, out.grad_norm)
            done = progress.done = step + 1
            where.step_finished()
            bar.advance()
            if done % training.logging_steps == 0 or done == opt.total_steps:
                _log_window(run, window, progress, bar, nonfinite)  # the window's one host sync
            stop_signal, checkpoint_now = vote.decide()  # the same on every rank
            stopping = stop_after is not None and done >= stop_after
            with window.paused():  # evaluation and checkpoints are not training throughput
                if run.evaluation.due(done, stopping=bool(stop_signal)):
                    progress.last_eval_tau = run.evaluation.measure(done)
                if run.saving.due(done, asked=stopping or bool(stop_signal) or checkpoint_now):
                    # never a checkpoint after the limit of skips in a row (check raises)
                    run.saving.save(done, where.now, nonfinite.check(done))
                    where.saved = True
            if stop_signal:
                vote.close()
                bar.close()
                raise stopped_run(stop_signal, done, opt.total_steps, run.output_dir)
            if stopping:
                break
    vote.close()
    bar.close()
    return progress


@attrs.define
class _DataPosition:
    """Where the data stands: after the last batch taken (`now`), after the last finished
    step (`finished`, what a checkpoint of it resumes from), and whether that step is saved."""

    now: tuple[int, int]
    finished: tuple[int, int] = attrs.field()
    saved: bool = True

    @finished.default
    def _start(self) -> tuple[int, int]:
        return self.now

    def step_finished(self) -> None:
        self.finished, self.saved = self.now, False


def _step_batches(
    run: Run,
    batches: Iterator[PreparedBatch],
    vote: StepVote,
    where: _DataPosition,
    progress: Progress,
) -> Iterator[PreparedBatch]:
    """One optimiser step's micro-batches, taken as each micro-step starts. A served target
    whose servers fail stops the run here, on every rank at the same micro-step (a CPU
    all-reduce), with every finished step saved: a rerun resumes exactly."""
    for _ in range(run.train.micro_batches):
        try:
            prepared, failed = next(batches), None
        except TargetServerError as exc:
            failed = exc
        served = run.data.served is not None
        if vote.any_rank(failed is not None) if served else failed is not None:
            if not where.saved:
                run.saving.save(progress.done, where.finished, run.nonfinite.check(progress.done))
            if failed is not None:
                raise failed
            msg = (
                "run stopped with the other ranks: another rank could not get its batch's "
                "states from the target servers (its error says why); the finished steps are "
                f"saved (step {progress.done}): rerun to resume"
            )
            raise TargetServerUnavailable(msg)
        where.now = (prepared.batch.epoch, prepared.batch.next_index)
        yield prepared


def _prepared_batches(run: Run) -> Iterator[PreparedBatch]:
    """This rank's batches from the run's start, each with its host work done
    (:func:`~dflash_recipes.executor.training.setup.prefetch.prepare_batch`)."""
    plan = run.plan
    for batch in run.data.stream(run.start.epoch, run.start.next_index):
        yield prepare_batch(
            batch,
            env=run.env,
            seed=plan.training.seed,
            spec=run.spec,
            num_anchors=plan.draft.objective.num_anchors,
            states=run.data.captured_states if run.data.offline else None,
        )


def _log_window(
    run: Run, window: MetricWindow, progress: Progress, bar: ProgressBar, nonfinite: NonfiniteSteps
) -> None:
    """A logging step: the window's train row to the trackers, the bar's figures, a new window;
    then the stop when too many steps in a row were skipped (non-finite gradient norm)."""
    window.add_skipped(nonfinite.take_window())
    window.settle()
    lr = run.optimization.lr_at(progress.done - 1)  # the rate the last step used
    row = log_train_window(window, step=progress.done, lr=lr, trackers=run.trackers, env=run.env)
    progress.last_row = dict(row)
    progress.tokens += window.tokens
    progress.seconds += window.elapsed()
    bar.show_figures(
        loss=row_number(row, "loss"), tau=row_number(row, KEY_ACCEPTANCE_LENGTH_ESTIMATE)
    )
    skipped = window.skipped_steps
    window.reset()
    streak = nonfinite.check(progress.done)  # raises at the limit, after the row is written
    if skipped and is_main(run.env):
        logger.warning(
            "%d step(s) up to step %d skipped: gradient norm NaN or Inf (weights and AdamW "
            "unchanged by them; %d in a row now, training.max_nonfinite_steps %d in a row "
            "stops the run)",
            skipped,
            progress.done,
            streak,
            nonfinite.limit,
        )


def finish(run: Run, progress: Progress) -> TrainSummary:
    """Export (rank 0, a finished run only; a sharded drafter is gathered to rank 0 first, by
    every rank), then the summary (also metrics.jsonl's last row)."""
    env, done, total = run.env, progress.done, run.optimization.total_steps
    export_dir: Path | None = None
    if done < total:
        logger.info("stopped after step %d of %d as asked (no export)", done, total)
    else:
        drafter = run.models.drafter
        whole = whole_drafter_on_rank0(drafter, env) if run.models.sharded else drafter
        if is_main(env):
            assert whole is not None
            export_dir = export_drafter(whole, run.plan, run.output_dir / EXPORT_DIR)
            logger.info("exported the drafter to %s", export_dir)
        del whole
    wait_for_rank0(env, "export the drafter", timeout_s=run.plan.training.distributed_timeout_s)
    last_row = progress.last_row
    if not last_row:  # nothing logged in this run (a finished run resumed): the last row
        last_row = last_train_row(run.output_dir / METRICS_FILE, done) or {}
    tokens, seconds = progress.tokens, progress.seconds
    run.trackers.flush()  # what the trackers hold back, before counting what they missed
    summary = TrainSummary(
        steps=done,
        resumed_from_step=run.start.resumed_from,
        final_loss=row_number(last_row, "loss"),
        accuracy_by_position=tuple(accuracies(last_row.get("accuracy_by_position"))),
        acceptance_length_estimate=row_number(last_row, KEY_ACCEPTANCE_LENGTH_ESTIMATE, 1.0),
        tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
        export_dir=str(export_dir) if export_dir is not None else None,
        warm_start=run.models.warm.describe() if run.models.warm is not None else None,
        data_summary=run.data.dataset.summary,
        last_eval_tau=progress.last_eval_tau,
        planned_steps=total,
        steps_this_run=done - run.start.step,
        tracker_problems=run.trackers.problems(),
    )
    if is_main(env):
        run.trackers.log_row({"kind": "summary", **attrs.asdict(summary)})
    return summary


__all__ = ["Progress", "Run", "finish", "fit", "run_plan", "setup"]
