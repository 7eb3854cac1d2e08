"""The trainer: one run plan from setup through the optimiser steps to the export.

:class:`Trainer` runs exactly what the plan says, nothing re-decided, in three phases:
setup (resume state, tokenizer, data, model, warm start, optimiser: :meth:`Trainer._setup`),
the train loop (:meth:`Trainer._train`) and finish (export, summary: :meth:`Trainer._finish`).
One optimiser step is ``gradient_accumulation_steps`` micro-batches; each micro-batch draws its
anchors (:func:`~dflash_recipes.executor.training.anchors.sample_batch_anchors`), builds the step's
inputs and runs :class:`~dflash_recipes.executor.training.step.DraftStep` (the fused taps, the
drafter
over all blocks, lm_head and the plan's objective; docs/dflash.md, "The training objective").

Randomness is counter-based: the anchors of a sequence are a pure function of ``(seed, epoch,
position of the sequence in the epoch's order)`` (splitmix64 counters, the whole batch in one
vectorised pass), the data order of ``(seed, epoch)``. There is no hidden RNG stream, so a
resumed run draws exactly what an uninterrupted run would have drawn, and a data-parallel run
draws the same anchors per sequence as a single-process run over the same global batch.

Under DDP the loss of each rank is normalised by the *global* weight sum of the micro-batch
(:func:`~dflash_recipes.executor.distributed.global_batch_loss`), so the averaged gradient
equals the single-process gradient over the whole global batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import attrs
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dflash_recipes.errors import CheckpointError, DataError, Interrupted, RunIOError
from dflash_recipes.executor.data.conversations import Batch, TrainDataset, batches, epoch_order
from dflash_recipes.executor.data.offline import (
    CaptureReader,
    capture_dataset,
    load_target_without_decoder,
    open_capture,
)
from dflash_recipes.executor.distributed import (
    barrier,
    detect_dist_env,
    global_batch_loss,
    init_distributed,
    is_main,
    shard_target_fsdp2,
    shutdown_distributed,
    wrap_ddp,
)
from dflash_recipes.executor.model.convert import (
    ConvertedModel,
    convert,
    dflash_module,
    lm_head,
    load_base_model,
    load_tokenizer,
)
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.executor.model.warmstart import WarmStartReport, warm_start
from dflash_recipes.executor.signals import (
    Abandoned,
    SignalWatch,
    StepVote,
    abandoned_run,
    stopped_run,
)
from dflash_recipes.executor.training.anchors import batch_positions, sample_batch_anchors
from dflash_recipes.executor.training.checkpoints import save_training_checkpoint
from dflash_recipes.executor.training.device_memory import check_device_memory
from dflash_recipes.executor.training.loss import LossOutput
from dflash_recipes.executor.training.metrics import MetricWindow, accuracies, log_train_window
from dflash_recipes.executor.training.optimizer import (
    build_optimizer,
    clip_gradients,
    lr_factor,
    total_optimizer_steps,
)
from dflash_recipes.executor.training.resume import (
    checkpoint_to_resume,
    locked_run_directory,
    restore_newest_readable,
)
from dflash_recipes.executor.training.step import DraftStep, step_inputs
from dflash_recipes.executor.training.trackers.fanout import TrackerSet, open_trackers
from dflash_recipes.executor.training.trackers.protocol import Outcome
from dflash_recipes.executor.training.trackers.registry import check_tracker_libraries
from dflash_recipes.files.crashsafe import write_text_atomic
from dflash_recipes.files.export_target import check_export_target
from dflash_recipes.files.metrics_rows import drop_metrics_after, eval_row, last_train_row
from dflash_recipes.files.run_dir import (
    EXPORT_DIR,
    METRICS_FILE,
    PLAN_FILE,
)
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.records import Record

logger = logging.getLogger("dflash_recipes.train")


@attrs.frozen(repr=False, eq=False, slots=False)
class TrainSummary(Record):
    """What a finished run reports (also written as the last line of metrics.jsonl).

    ``steps`` is the optimiser step the run reached (fewer than ``planned_steps`` when it
    stopped early); ``steps_this_run`` is 0 when a finished run was resumed.
    """

    steps: int
    resumed_from_step: int | None
    final_loss: float
    accuracy_by_position: tuple[float, ...]
    acceptance_length_estimate: float
    tokens_per_second: float
    export_dir: str | None
    warm_start: str | None
    data_summary: str
    last_eval_tau: float | None = None
    planned_steps: int = 0
    steps_this_run: int = 0
    #: One line per tracker of training.report_to that missed rows in this run.
    tracker_problems: tuple[str, ...] = ()


@attrs.define(eq=False)
class _Setup:
    """What :meth:`Trainer._setup` builds for the train loop and the finish."""

    model: ConvertedModel
    drafter: DFlashDraftModel
    #: The step module (DDP-wrapped on several processes) and the parameters it trains.
    wrapped: nn.Module
    trainable: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    tokenizer: PreTrainedTokenizerBase
    dataset: TrainDataset
    warm: WarmStartReport | None
    #: The checkpoint this run resumed from (None for a fresh run).
    resume_from: Path | None
    total_steps: int
    start_step: int
    #: Where the data stands: the epoch and the index into its order of the next batch.
    epoch: int
    next_index: int
    metrics_path: Path
    #: Where the metrics rows go: metrics.jsonl and training.report_to (rank 0; else nowhere).
    trackers: TrackerSet


@attrs.define
class _Progress:
    """Where the train loop stopped and what it measured."""

    done: int
    last_row: dict[str, object]
    tokens: int
    seconds: float
    last_eval_tau: float | None


class Trainer:
    """Runs one plan: build, (warm start | resume), train, checkpoint, export."""

    def __init__(
        self,
        plan: RunPlan,
        *,
        progress: bool = True,
        stop_after: int | None = None,
        max_chunk_logits: int | None = None,
        verify_capture: bool = False,
    ) -> None:
        self.plan = plan
        #: Hash every capture shard at setup (else each on the first read of its states).
        self.verify_capture = verify_capture
        #: Stop after this optimiser step (its checkpoint saved), as if the job were killed
        #: there; the schedule still spans the whole run. For tests and preemption drills.
        self.stop_after = stop_after
        #: Most logits one chunk of blocks holds (None: :data:`step.MAX_CHUNK_LOGITS`).
        self.max_chunk_logits = max_chunk_logits
        self.spec: ResolvedDraft = plan.resolved_draft()
        self.progress = progress
        self.env = detect_dist_env(plan.training.device)
        self.output_dir = Path(plan.training.output_dir)
        #: The capture offline training reads (data.hidden_states_path), else None.
        self.capture: CaptureReader | None = None
        self._order: list[int] = []
        self._order_key: tuple[int, int] | None = None
        #: SIGTERM / SIGINT / SIGUSR1 while the run is in :meth:`run` (docs/dflash.md).
        self.signals = SignalWatch()

    # -- main entry -------------------------------------------------------------------------

    def run(self) -> TrainSummary:
        """Train under the run directory's lock (rank 0); OSError becomes one RunIOError."""
        env = self.env
        # A tracker that cannot start stops the run before anything is loaded or written.
        check_tracker_libraries(self.plan.training.report_to)
        try:
            with (
                self.signals,
                locked_run_directory(self.output_dir, main=is_main(env)),
            ):
                init_distributed(env)
                try:
                    setup = self._setup()
                    outcome: Outcome = "failed"
                    try:
                        summary = self._finish(setup, self._train(setup))
                        done = summary.steps >= summary.planned_steps
                        outcome = "finished" if done else "stopped"
                        return summary
                    except Interrupted:  # a stop signal: checkpoint saved, to be resumed
                        outcome = "stopped"
                        raise
                    finally:
                        setup.trackers.close(outcome)
                finally:
                    shutdown_distributed()
        except Abandoned as exc:
            raise abandoned_run(exc, self.output_dir) from None
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else f" in {self.output_dir}"
            msg = (
                f"run stopped: cannot read or write{where}: {exc.strerror or exc}; the "
                "checkpoints already saved are intact: fix the cause (free space, "
                "permissions) and rerun to resume"
            )
            raise RunIOError(msg) from exc

    # -- setup ------------------------------------------------------------------------------

    def _build_dataset(self, tokenizer: PreTrainedTokenizerBase) -> TrainDataset:
        from dflash_recipes.executor.data.conversations import build_dataset

        if self.plan.data.hidden_states_path is not None:
            self.capture, manifest = open_capture(self.plan)
            if self.verify_capture:
                self.capture.verify_all()
            return capture_dataset(self.capture, manifest, tokenizer)
        if self.plan.data.data_path is None:
            msg = "the plan has no data.data_path; set it in the recipe and recompile"
            raise DataError(msg)
        return build_dataset(self.plan, tokenizer, env=self.env)

    def _setup(self) -> _Setup:
        """Check the resume state and the export target, load data and model, warm-start or
        restore, build the optimiser; write plan.json. Data problems stop the run here,
        before anything is written to output_dir."""
        plan, env = self.plan, self.env
        training = plan.training
        resume_from = checkpoint_to_resume(self.plan, self.output_dir)
        if is_main(env):  # refuse now, not after hours of training
            check_export_target(self.output_dir / EXPORT_DIR)
        tokenizer = load_tokenizer(plan)
        dataset = self._build_dataset(tokenizer)
        if is_main(env):
            logger.info("data: %s", dataset.summary)

        # Offline, the decoder runs only for measured evaluation (speculative decoding needs it).
        needs_decoder = self.capture is None or (
            training.eval_steps is not None and plan.data.eval_data_path is not None
        )
        # Every rank, before minutes of loading the target: refuse what cannot fit.
        check_device_memory(plan, device=env.device, world_size=env.world_size, log=is_main(env))
        base = load_base_model(plan) if needs_decoder else load_target_without_decoder(plan)
        model = convert(base, plan, init=False)
        drafter = dflash_module(model)
        # Before anything moves the drafter, so the loaded values are the checkpoint's.
        warm = warm_start(drafter, plan) if resume_from is None else None
        if training.fsdp and env.is_distributed:
            # Shard before moving: each decoder layer reaches the device already sharded.
            shard_target_fsdp2(model, env)
        else:
            nn.Module.to(model, env.device)
        # Master weights of the drafter stay float32; the frozen target keeps the plan dtype.
        drafter.float()
        step_module = DraftStep(
            drafter, lm_head(model), plan.draft.objective, max_chunk_logits=self.max_chunk_logits
        )
        trainable = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = build_optimizer(
            trainable, lr=training.learning_rate, weight_decay=training.weight_decay
        )
        total_steps = total_optimizer_steps(plan, len(dataset), env.world_size)

        def schedule(step: int) -> float:
            return lr_factor(
                step,
                total_steps=total_steps,
                warmup_ratio=training.warmup_ratio,
                kind=training.lr_scheduler_type,
            )

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        start_step, epoch, next_index = 0, 0, 0
        metrics_path = self.output_dir / METRICS_FILE
        if resume_from is not None:
            resume_from, state = restore_newest_readable(
                resume_from, self.output_dir, drafter, optimizer, scheduler
            )
            start_step = _int(state, "step")
            epoch = _int(state, "epoch")
            next_index = _int(state, "next_index")
            if is_main(env):
                logger.info(
                    "resumed from %s (step %d); dflash_init_checkpoint is ignored",
                    resume_from,
                    start_step,
                )
                # The steps after the checkpoint are redone: their old rows go.
                drop_metrics_after(metrics_path, start_step)
        wrapped = wrap_ddp(step_module, env)

        if is_main(env):
            self.output_dir.mkdir(parents=True, exist_ok=True)
            # Atomic: other ranks (or a resume compile) may read plan.json at any moment.
            write_text_atomic(self.output_dir / PLAN_FILE, plan.to_json())
            trackers = open_trackers(
                plan,
                metrics_path,
                resumed_from=start_step if resume_from is not None else None,
            )
        else:
            trackers = TrackerSet.silent()
        barrier(env)
        return _Setup(
            model=model,
            drafter=drafter,
            wrapped=wrapped,
            trainable=trainable,
            optimizer=optimizer,
            scheduler=scheduler,
            tokenizer=tokenizer,
            dataset=dataset,
            warm=warm,
            resume_from=resume_from,
            total_steps=total_steps,
            start_step=start_step,
            epoch=epoch,
            next_index=next_index,
            metrics_path=metrics_path,
            trackers=trackers,
        )

    # -- train loop -------------------------------------------------------------------------

    def _train(self, run: _Setup) -> _Progress:
        """The optimiser steps from ``run.start_step``: log, evaluate and save as planned."""
        training, env = self.plan.training, self.env
        model, drafter, wrapped = run.model, run.drafter, run.wrapped
        data = self._data_stream(run.dataset, run.epoch, run.next_index)
        window = MetricWindow(self.spec.block_size, shift=self.spec.label_shift)
        bar = self._progress_bar(run.total_steps, run.start_step)
        progress = _Progress(
            done=run.start_step, last_row={}, tokens=0, seconds=0.0, last_eval_tau=None
        )
        position = (run.epoch, run.next_index)
        _training_modes(model, drafter)
        vote = StepVote(self.signals, distributed=env.is_distributed)
        for step in range(run.start_step, run.total_steps):
            run.optimizer.zero_grad(set_to_none=True)
            for micro in range(training.gradient_accumulation_steps):
                batch = next(data)
                position = (batch.epoch, batch.next_index)
                sync = micro == training.gradient_accumulation_steps - 1
                context: AbstractContextManager[object] = (
                    nullcontext() if sync or not env.is_distributed else wrapped.no_sync()  # type: ignore[operator]
                )
                with context:
                    out, micro_tokens = self._micro_step(
                        wrapped, model, batch, step=step, total_steps=run.total_steps
                    )
                window.add(out, micro_tokens)
            norm = clip_gradients(run.trainable, training.max_grad_norm)
            window.add_grad_norm(norm)
            run.optimizer.step()
            run.scheduler.step()
            done = progress.done = step + 1
            if bar is not None:
                bar.update(1)
            if done % training.logging_steps == 0 or done == run.total_steps:
                window.settle()
                lr = float(run.scheduler.get_last_lr()[0])
                progress.last_row = log_train_window(
                    window, step=done, lr=lr, trackers=run.trackers, env=env
                )
                progress.tokens += window.tokens
                progress.seconds += time.perf_counter() - window.started
                if bar is not None:
                    bar.set_postfix(
                        loss=f"{progress.last_row['loss']:.3f}",
                        tau=f"{progress.last_row['acceptance_length_estimate']:.2f}",
                    )
                window.reset()
            stop_signal, checkpoint_now = vote.decide()  # the same on every rank
            evaluating = training.eval_steps is not None and done % training.eval_steps == 0
            if evaluating and not stop_signal:
                progress.last_eval_tau = self._maybe_eval(model, run.tokenizer, done, run.trackers)
                _training_modes(model, drafter)
            stopping = self.stop_after is not None and done >= self.stop_after
            if (
                done % training.save_steps == 0
                or done == run.total_steps
                or stopping
                or stop_signal
                or checkpoint_now
            ):
                self._save(drafter, run.optimizer, run.scheduler, done, position)
            if stop_signal:
                vote.close()
                if bar is not None:
                    bar.close()
                raise stopped_run(stop_signal, done, run.total_steps, self.output_dir)
            if stopping:
                break
        vote.close()
        if bar is not None:
            bar.close()
        return progress

    # -- finish -----------------------------------------------------------------------------

    def _finish(self, run: _Setup, progress: _Progress) -> TrainSummary:
        """Export (rank 0, a finished run only), then the summary (also metrics.jsonl's last
        row)."""
        env, done = self.env, progress.done
        export_dir: Path | None = None
        if done < run.total_steps:
            logger.info("stopped after step %d of %d as asked (no export)", done, run.total_steps)
        elif is_main(env):
            export_dir = export_drafter(run.drafter, self.plan, self.output_dir / EXPORT_DIR)
            logger.info("exported the drafter to %s", export_dir)
        barrier(env)
        last_row = progress.last_row
        if not last_row:  # nothing logged in this run (a finished run resumed): the last row
            last_row = last_train_row(run.metrics_path, done) or {}
        acc = accuracies(last_row.get("accuracy_by_position"))
        tokens, seconds = progress.tokens, progress.seconds
        summary = TrainSummary(
            steps=done,
            resumed_from_step=run.start_step if run.resume_from is not None else None,
            final_loss=float(last_row.get("loss", float("nan"))),  # type: ignore[arg-type]
            accuracy_by_position=tuple(acc),
            acceptance_length_estimate=float(last_row.get("acceptance_length_estimate", 1.0)),  # type: ignore[arg-type]
            tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
            export_dir=str(export_dir) if export_dir is not None else None,
            warm_start=run.warm.describe() if run.warm is not None else None,
            data_summary=run.dataset.summary,
            last_eval_tau=progress.last_eval_tau,
            planned_steps=run.total_steps,
            steps_this_run=done - run.start_step,
            tracker_problems=_tracker_problems(run.trackers),
        )
        if is_main(env):
            run.trackers.log_row({"kind": "summary", **attrs.asdict(summary)})
        return summary

    # -- pieces ------------------------------------------------------------------------------

    def _data_stream(self, dataset: TrainDataset, epoch: int, start: int) -> Iterator[Batch]:
        training, env = self.plan.training, self.env
        while True:
            produced = False
            for batch in batches(
                dataset,
                batch_size=training.per_device_train_batch_size,
                seed=training.seed,
                epoch=epoch,
                start_index=start,
                rank=env.rank,
                world_size=env.world_size,
            ):
                produced = True
                yield batch
            if not produced and start == 0:
                msg = (
                    f"the data has {len(dataset)} usable conversations, fewer than one global "
                    f"batch ({training.per_device_train_batch_size} x {env.world_size} "
                    "processes); add data or lower per_device_train_batch_size"
                )
                raise DataError(msg)
            epoch, start = epoch + 1, 0

    def _micro_step(
        self,
        wrapped: nn.Module,
        target: ConvertedModel,
        batch: Batch,
        *,
        step: int,
        total_steps: int,
    ) -> tuple[LossOutput, Tensor]:
        """One micro-batch: anchors, the step's inputs, forward and backward. Returns the
        step's loss output and the batch's token count (a tensor: no host sync)."""
        plan, spec, env = self.plan, self.spec, self.env
        objective = plan.draft.objective
        device = env.device
        drawn = sample_batch_anchors(
            batch,
            positions=batch_positions(batch, env),
            seed=plan.training.seed,
            block_size=spec.block_size,
            num_anchors=objective.num_anchors,
        )
        captured = None
        if self.capture is not None:
            rows = self._sample_indices(batch)
            captured = self.capture.states(rows, int(batch.input_ids.shape[1]), device)
        on_device = batch.to(device)
        inputs = step_inputs(
            target,
            spec,
            objective,
            on_device,
            drawn.to(device),
            step=step,
            total_steps=total_steps,
            captured=captured,
        )
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda" and plan.base_model.dtype == "bfloat16"
            else nullcontext()
        )
        with autocast:
            result: LossOutput = wrapped(inputs)
        # Normalised by the global weight sum (DDP), then averaged over micro-batches.
        loss = global_batch_loss(result.loss, result.weight_sum, env)
        loss = loss / plan.training.gradient_accumulation_steps
        loss.backward()  # type: ignore[no-untyped-call]
        return result, on_device.attention_mask.sum()

    def _sample_indices(self, batch: Batch) -> list[int]:
        """Dataset indices of this rank's rows of `batch` (offline: which captured samples)."""
        assert self.capture is not None
        key = (batch.epoch, self.capture.manifest.num_samples)
        if self._order_key != key:
            self._order = epoch_order(key[1], seed=self.plan.training.seed, epoch=batch.epoch)
            self._order_key = key
        return [self._order[p] for p in batch_positions(batch, self.env)]

    def _maybe_eval(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        step: int,
        trackers: TrackerSet,
    ) -> float | None:
        if not is_main(self.env) or self.plan.data.eval_data_path is None:
            return None
        from dflash_recipes.executor.evaluation.evaluate import evaluate_on_plan_data

        drafter = dflash_module(model)
        was_training = drafter.training
        drafter.eval()
        report = evaluate_on_plan_data(self.plan, model, drafter, tokenizer)
        drafter.train(was_training)
        row = {**report.to_dict(), **eval_row(step=step, tau=report.tau)}
        trackers.log_row(row)
        logger.info("eval at step %d: tau %.3f (measured)", step, report.tau)
        return report.tau

    def _save(
        self,
        drafter: DFlashDraftModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        step: int,
        position: tuple[int, int],
    ) -> None:
        env = self.env
        if is_main(env):
            state = {
                "epoch": position[0],
                "next_index": position[1],
                "seed": self.plan.training.seed,
                "plan_fingerprint": self.plan.fingerprint,
                "world_size": env.world_size,
            }
            path = save_training_checkpoint(
                self.output_dir,
                step,
                drafter,
                optimizer,
                scheduler,
                state,
                save_total_limit=self.plan.training.save_total_limit,
            )
            logger.info("saved %s", path)
        barrier(env)

    def _progress_bar(self, total: int, start: int) -> _Bar | None:
        if not self.progress or not is_main(self.env):
            return None
        from tqdm.auto import tqdm

        # disable=None: no bar when stderr is not a terminal (CI logs, files).
        bar: _Bar = tqdm(
            total=total, initial=start, desc="train", unit="step", leave=False, disable=None
        )
        return bar


class _Bar:
    """The part of tqdm the trainer uses (for typing)."""

    def update(self, n: int) -> None: ...
    def set_postfix(self, **kwargs: str) -> None: ...
    def close(self) -> None: ...


def _tracker_problems(trackers: TrackerSet) -> tuple[str, ...]:
    """Which trackers missed rows, once what they hold back is delivered."""
    trackers.flush()
    return trackers.problems()


def _training_modes(model: nn.Module, drafter: nn.Module) -> None:
    """Frozen target in eval mode, drafter in train mode (set once, again after an eval)."""
    model.train(False)
    drafter.train(True)


def _int(state: dict[str, object], key: str) -> int:
    value = state.get(key)
    if not isinstance(value, int):
        msg = f"trainer_state.json has no integer {key!r}; the checkpoint is from another tool"
        raise CheckpointError(msg)
    return value


def run_plan(
    plan: RunPlan,
    *,
    progress: bool = True,
    stop_after: int | None = None,
    max_chunk_logits: int | None = None,
    verify_capture: bool = False,
) -> TrainSummary:
    """Train as the plan says and return the summary (rank 0's view under torchrun).

    `stop_after` stops after that optimiser step with its checkpoint saved, as a killed job
    would; rerunning the recipe then resumes. `max_chunk_logits` bounds the logits one chunk
    of blocks holds (default :data:`~dflash_recipes.executor.training.step.MAX_CHUNK_LOGITS`);
    the loss is the same, only the memory and the time change. `verify_capture` hashes every
    shard of the plan's capture before the first step (otherwise each is checked on first use).
    """
    trainer = Trainer(
        plan,
        progress=progress,
        stop_after=stop_after,
        max_chunk_logits=max_chunk_logits,
        verify_capture=verify_capture,
    )
    return trainer.run()


__all__ = [
    "TrainSummary",
    "Trainer",
    "run_plan",
]
