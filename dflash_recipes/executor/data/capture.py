"""`dflash-recipe capture`: run the frozen target over the training data once, write shards.

The data is read, rendered, masked and truncated exactly as online training does
(:func:`~dflash_recipes.executor.data.train_dataset.build_dataset`), and the samples keep the order
of the
data file. They are cut into shards of a bounded size by a pure function of the data and the
plan (:func:`~dflash_recipes.files.capture_manifest.plan_shards`), so a rerun cuts the same shards:

- ``manifest.json`` is written first with ``"complete": false`` and the shard table; a rerun
  whose data or plan gives another table is refused instead of mixing two captures;
- each shard is written to a hidden temporary file and renamed, so a killed capture leaves whole
  shards or none; a rerun keeps every shard whose header lists its samples and redoes the rest;
- under torchrun, rank ``r`` writes shards ``r, r + W, ...``; rank 0 holds the directory lock,
  checks the disk, and records the sizes when every shard is written (``"complete": true``).

Before writing, the disk the capture needs is estimated (tensor bytes a token x tokens, plus
headers) and the capture refuses to start when the output filesystem has less free space.
Only safetensors and JSON are written.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TypeAlias

import attrs
import torch
from safetensors.torch import save_file
from torch import Tensor

from dflash_recipes.checkpoint.kinds.registry import needs_teacher
from dflash_recipes.data.sources import input_sha256
from dflash_recipes.errors import DataError, PlanError
from dflash_recipes.executor.collectives import barrier
from dflash_recipes.executor.data.token_cache import CachedExamples
from dflash_recipes.executor.data.tokenize import TokenizedExample
from dflash_recipes.executor.data.train_dataset import TrainDataset, build_dataset
from dflash_recipes.executor.dist_env import (
    DistEnv,
    detect_dist_env,
    init_distributed,
    is_main,
    shutdown_distributed,
)
from dflash_recipes.executor.model.convert import load_base_model, load_tokenizer
from dflash_recipes.executor.model.target_states import final_norm, target_states
from dflash_recipes.executor.signals import Abandoned, SignalWatch, stopped_capture
from dflash_recipes.files.capture_manifest import (
    MANIFEST_FILE,
    CaptureManifest,
    ShardEntry,
    base_config_sha256,
    bytes_per_token,
    chat_template_sha256,
    estimate_bytes,
    file_sha256,
    parse_manifest,
    plan_shards,
    sample_tensor_names,
    samples_sha256,
    shard_content_problem,
    shard_file_name,
    shard_problem,
    tokenizer_sha256,
)
from dflash_recipes.files.crashsafe import atomic_replace, write_text_atomic
from dflash_recipes.files.locking import hold_directory_lock
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.records import Record

logger = logging.getLogger("dflash_recipes.capture")

#: One sample's tensors as a shard stores them: ids, loss mask, taps (and the last state).
_Parts: TypeAlias = Iterator[tuple[Tensor, ...]]
#: What computes the states of a chunk of samples (their examples and sample indices).
_StatesOf: TypeAlias = Callable[[Sequence[TokenizedExample], Sequence[int]], _Parts]

#: Default bound of a shard's tensor data (1 GiB).
DEFAULT_SHARD_BYTES = 2**30


@attrs.frozen(repr=False, eq=False, slots=False)
class CaptureSummary(Record):
    """What a capture run reports."""

    directory: str
    num_samples: int
    num_tokens: int
    shards: int
    #: Shards this run wrote (the others were already there).
    shards_written: int
    estimated_bytes: int
    bytes_on_disk: int
    complete: bool
    seconds: float


def planned_manifest(
    plan: RunPlan, dataset: TrainDataset, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> CaptureManifest:
    """The manifest (incomplete, no sizes) a capture of `dataset` for `plan` writes."""
    facts = plan.base_model.facts
    if facts is None:
        msg = "the plan has no target facts; compile the recipe with its base model"
        raise PlanError(msg)
    spec = plan.resolved_draft()
    objective = plan.draft.objective
    taps = tuple(spec.target_layer_ids)
    last = needs_teacher(spec.projector_type, objective)
    dtype = plan.base_model.dtype
    per_token = bytes_per_token(len(taps), facts.hidden_size, dtype, last_hidden=last)
    examples = dataset.examples
    counts = (
        examples.lengths()
        if isinstance(examples, CachedExamples)
        else [len(example.input_ids) for example in examples]
    )
    table = plan_shards(counts, bytes_per_token=per_token, max_shard_bytes=max_shard_bytes)
    base = Path(plan.base_model.path)
    data_path = plan.data.data_path
    return CaptureManifest(
        base_model_path=str(base),
        base_config_sha256=base_config_sha256(base),
        tokenizer_sha256=tokenizer_sha256(base),
        chat_template_sha256=chat_template_sha256(plan.data.chat_template, base),
        data_path=data_path,
        data_sha256=input_sha256(Path(data_path)) if data_path is not None else None,
        answer_only_loss=plan.data.answer_only_loss,
        supervise=tuple(plan.data.supervise),
        target_layer_ids=taps,
        hidden_size=facts.hidden_size,
        dtype=dtype,
        training_seq_len=plan.training.training_seq_len,
        block_size=plan.draft.block_size,
        last_hidden_state=last,
        num_samples=len(counts),
        num_tokens=sum(counts),
        num_truncated=dataset.stats.num_truncated,
        bytes_per_token=per_token,
        estimated_bytes=estimate_bytes(
            counts, len(taps), facts.hidden_size, dtype, last_hidden=last
        ),
        shards=tuple(
            ShardEntry(
                shard_file_name(number),
                first,
                count,
                sum(counts[first : first + count]),
                samples_sha256=samples_sha256(
                    (e.input_ids, e.loss_mask) for e in dataset.examples[first : first + count]
                ),
            )
            for number, (first, count) in enumerate(table)
        ),
    )


def _recorded_shards(directory: Path) -> dict[str, ShardEntry]:
    """The shards of the manifest on disk that carry a content hash (a complete capture)."""
    path = directory / MANIFEST_FILE
    try:
        previous = parse_manifest(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError, DataError):
        return {}
    return {e.file: e for e in previous.shards if e.sha256 is not None}


def _changed_since_recorded(
    directory: Path, entry: ShardEntry, recorded: dict[str, ShardEntry]
) -> bool:
    """Whether a shard whose content hash was recorded no longer has it: it is written again."""
    known = recorded.get(entry.file)
    if known is None:
        return False
    problem = shard_content_problem(directory, known)
    if problem is not None:
        logger.warning("%s: capturing it again", problem)
    return problem is not None


class _Capture:
    def __init__(
        self,
        plan: RunPlan,
        output: Path,
        *,
        max_shard_bytes: int,
        progress: bool,
        stop_after_shards: int | None,
    ) -> None:
        self.plan = plan
        self.output = output
        self.max_shard_bytes = max_shard_bytes
        self.progress = progress
        self.stop_after_shards = stop_after_shards
        self.env: DistEnv = detect_dist_env(plan.training.device)
        #: SIGTERM / SIGINT: finish the shard being written, then stop (the rest on a rerun).
        self.signals = SignalWatch(checkpoint_signal=False)

    def run(self) -> CaptureSummary:
        import time

        started = time.perf_counter()
        env = self.env
        init_distributed(env, timeout_s=self.plan.training.distributed_timeout_s)
        try:
            with ExitStack() as stack:
                stack.enter_context(self.signals)
                if is_main(env):
                    stack.enter_context(hold_directory_lock(self.output, purpose="capture"))
                return self._run(started)
        except Abandoned as exc:  # a second signal: the shard being written is dropped
            raise stopped_capture(exc.signum, self.output, abandoned=True) from None
        except OSError as exc:
            msg = (
                f"capture into {self.output} failed: {exc}; fix the directory (a writable folder "
                "with free space) and rerun the same command: whole shards are kept"
            )
            raise DataError(msg) from exc
        finally:
            shutdown_distributed()

    def _run(self, started: float) -> CaptureSummary:
        import time

        plan, env = self.plan, self.env
        if plan.data.data_path is None:
            msg = "data.data_path is not set: capture needs the JSONL conversations to run over"
            raise DataError(msg)
        tokenizer = load_tokenizer(plan)
        dataset = build_dataset(plan, tokenizer, env=env)
        manifest = planned_manifest(plan, dataset, max_shard_bytes=self.max_shard_bytes)
        if is_main(env):
            logger.info("data: %s", dataset.summary)
            self._prepare(manifest)
        barrier(env)
        mine = [
            (number, entry)
            for number, entry in enumerate(manifest.shards)
            if number % env.world_size == env.rank
        ]
        recorded = _recorded_shards(self.output)
        todo = [
            (n, e)
            for n, e in mine
            if shard_problem(self.output, e, manifest) is not None
            or _changed_since_recorded(self.output, e, recorded)
        ]
        written = 0
        if todo:
            with self._states_source(manifest) as states:
                bar = self._bar(sum(e.num_tokens for _, e in todo))
                for _, entry in todo:
                    if self.stop_after_shards is not None and written >= self.stop_after_shards:
                        break
                    if self.signals.stopping:
                        break
                    self._write_shard(states, dataset.examples, entry, manifest)
                    written += 1
                    if bar is not None:
                        bar.update(entry.num_tokens)
                if bar is not None:
                    bar.close()
        stopped = (self.stop_after_shards is not None or self.signals.stopping) and written < len(
            todo
        )
        barrier(env)
        complete = False
        on_disk = 0
        if is_main(env) and not stopped:
            missing = [e.file for e in manifest.shards if shard_problem(self.output, e, manifest)]
            if not missing:
                # One read of each shard (from the page cache when just written): the hashes
                # every later read is checked against.
                sized = tuple(
                    attrs.evolve(
                        e,
                        bytes=(self.output / e.file).stat().st_size,
                        sha256=file_sha256(self.output / e.file),
                    )
                    for e in manifest.shards
                )
                final = attrs.evolve(manifest, shards=sized, complete=True)
                write_text_atomic(self.output / MANIFEST_FILE, final.to_json())
                complete = True
                on_disk = sum(e.bytes or 0 for e in sized)
        barrier(env)
        if is_main(env):
            logger.info(
                "capture %s: %d samples, %d tokens in %d shards (%d written now), %s",
                self.output,
                manifest.num_samples,
                manifest.num_tokens,
                len(manifest.shards),
                written,
                "complete" if complete else "incomplete: rerun to finish",
            )
        if stopped and self.signals.stop_signal is not None:
            raise stopped_capture(self.signals.stop_signal, self.output, abandoned=False)
        return CaptureSummary(
            directory=str(self.output),
            num_samples=manifest.num_samples,
            num_tokens=manifest.num_tokens,
            shards=len(manifest.shards),
            shards_written=written,
            estimated_bytes=manifest.estimated_bytes,
            bytes_on_disk=on_disk,
            complete=complete,
            seconds=time.perf_counter() - started,
        )

    def _prepare(self, manifest: CaptureManifest) -> None:
        """Refuse a directory holding another capture, check the disk, write the manifest."""
        path = self.output / MANIFEST_FILE
        if path.is_file():
            try:
                previous = parse_manifest(path.read_text(encoding="utf-8"), str(path))
            except (OSError, UnicodeDecodeError, DataError) as exc:
                msg = (
                    f"{path} cannot be read ({exc}); it is not a capture this command can "
                    "resume: choose another --output, or delete the directory to start over"
                )
                raise DataError(msg) from exc
            if previous.identity() != manifest.identity():
                differ = sorted(
                    key
                    for key, value in manifest.identity().items()
                    if previous.identity().get(key) != value
                )
                msg = (
                    f"{self.output} holds a capture of other data or another plan (differs in: "
                    f"{', '.join(differ)}); choose another --output, or delete {self.output} "
                    "to capture again"
                )
                raise DataError(msg)
        for stale in self.output.glob(".shard-*.safetensors.tmp-*"):
            stale.unlink(missing_ok=True)  # left by a killed capture
        remaining = [e for e in manifest.shards if shard_problem(self.output, e, manifest)]
        needed = sum(e.num_tokens for e in remaining) * manifest.bytes_per_token
        needed += manifest.estimated_bytes - manifest.num_tokens * manifest.bytes_per_token
        free = shutil.disk_usage(self.output).free
        if needed > free:
            msg = (
                f"capture needs about {_size(needed)} more in {self.output} "
                f"({manifest.num_tokens} tokens x {manifest.bytes_per_token} bytes a token), but "
                f"the filesystem has {_size(free)} free; free space, choose another --output, or "
                "capture less data"
            )
            raise DataError(msg)
        logger.info(
            "capture needs about %s (%d bytes a token); %s free",
            _size(needed),
            manifest.bytes_per_token,
            _size(free),
        )
        if not path.is_file() or not manifest_is_complete(path):
            write_text_atomic(path, manifest.to_json())

    @contextlib.contextmanager
    def _states_source(self, manifest: CaptureManifest) -> Iterator[_StatesOf]:
        """What computes the samples' states: the target loaded here, or the servers of a
        served target (``target_server``: no target in this process)."""
        plan = self.plan
        if plan.target_server is None:
            model = load_base_model(plan)
            torch.nn.Module.to(model, self.env.device)

            def computed(rows: Sequence[TokenizedExample], _names: Sequence[int]) -> _Parts:
                return self._states(model, rows, manifest)

            yield computed
            return
        from dflash_recipes.executor.target_server.batch_states import (
            client_settings,
            kept_states,
            served_target,
            split_rows,
        )
        from dflash_recipes.executor.target_server.client import TargetServerClient
        from dflash_recipes.executor.target_server.kept_states import ServedConversations

        served = served_target(plan)
        assert served.tap_rows is not None
        tap_rows = served.tap_rows
        final_row = served.final_row if manifest.last_hidden_state else None
        kept = kept_states(plan)  # what a run with keep_files: capture kept: not asked again
        with TargetServerClient(client_settings(plan, kept)) as client:
            conversations = ServedConversations(client, kept)

            def answered(rows: Sequence[TokenizedExample], names: Sequence[int]) -> _Parts:
                answers = conversations([r.input_ids for r in rows], names)
                for example, answer in zip(rows, answers, strict=True):
                    taps, last = split_rows(answer.hidden_states, tap_rows, final_row)
                    parts = [
                        torch.tensor(example.input_ids, dtype=torch.int32),
                        torch.tensor(example.loss_mask, dtype=torch.uint8),
                        taps.contiguous(),
                    ]
                    if last is not None:
                        parts.append(last.contiguous())
                    yield tuple(parts)

            yield answered

    def _write_shard(
        self,
        states: _StatesOf,
        examples: Sequence[TokenizedExample],
        entry: ShardEntry,
        manifest: CaptureManifest,
    ) -> None:
        tensors: dict[str, Tensor] = {}
        indices = range(entry.first_sample, entry.first_sample + entry.num_samples)
        size = self.plan.training.per_device_train_batch_size
        for chunk in _chunks(list(indices), size):
            rows = [examples[i] for i in chunk]
            for index, parts in zip(chunk, states(rows, chunk), strict=True):
                names = sample_tensor_names(index, last_hidden=manifest.last_hidden_state)
                for name, tensor in zip(names, parts, strict=True):
                    tensors[name] = tensor
        with atomic_replace(self.output / entry.file) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})

    def _states(
        self,
        model: torch.nn.Module,
        rows: Sequence[TokenizedExample],
        manifest: CaptureManifest,
    ) -> Iterator[tuple[Tensor, ...]]:
        """Per row: int32 ids, uint8 mask, ``[T, n_taps, H]`` taps (+ ``[T, H]`` last state)."""
        device = self.env.device
        longest = max(len(r.input_ids) for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        for row, example in enumerate(rows):
            ids[row, : len(example.input_ids)] = torch.tensor(example.input_ids)
        seen: list[Tensor] = []
        hook = None
        if manifest.last_hidden_state:
            norm = final_norm(model)
            hook = norm.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
        taps_per_layer = len(manifest.target_layer_ids)
        try:
            with torch.no_grad():
                # right-padded rows need no mask (causal attention never sees the padding
                # after a real position): the states training would compute for these rows
                tapped = target_states(
                    model,  # type: ignore[arg-type]
                    ids.to(device),
                    None,
                    manifest.target_layer_ids,
                    with_logits=False,
                ).tapped
        finally:
            if hook is not None:
                hook.remove()
        # [B, S, n_taps * H] -> [B, S, n_taps, H]: tap j is target layer target_layer_ids[j]
        layered = tapped.view(*tapped.shape[:-1], taps_per_layer, -1)
        for row, example in enumerate(rows):
            n = len(example.input_ids)
            taps = layered[row, :n].contiguous().cpu()
            parts = [
                torch.tensor(example.input_ids, dtype=torch.int32),
                torch.tensor(example.loss_mask, dtype=torch.uint8),
                taps,
            ]
            if seen:
                parts.append(seen[-1][row, :n].contiguous().cpu())
            yield tuple(parts)

    def _bar(self, total: int) -> _Bar | None:
        if not self.progress or not is_main(self.env):
            return None
        from tqdm.auto import tqdm

        bar: _Bar = tqdm(total=total, desc="capture", unit="tok", leave=False, disable=None)
        return bar


class _Bar:
    """The part of tqdm the capture uses (for typing)."""

    def update(self, n: int) -> None: ...
    def close(self) -> None: ...


def manifest_is_complete(path: Path) -> bool:
    """Whether the manifest at `path` says the capture is complete (False if unreadable)."""
    try:
        return parse_manifest(path.read_text(encoding="utf-8"), str(path)).complete
    except (OSError, UnicodeDecodeError, DataError):
        return False


def _chunks(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), max(1, size)):
        yield items[start : start + size]


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{count} B"
        value /= 1024
    return f"{count} B"


def capture_plan(
    plan: RunPlan,
    output: Path,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
    stop_after_shards: int | None = None,
) -> CaptureSummary:
    """Capture the plan's training data into `output` (resuming what is there).

    `stop_after_shards` stops after this process has written that many shards, leaving the
    capture incomplete as a killed job would; rerunning completes it.
    """
    if max_shard_bytes < 1:
        msg = f"the shard size bound must be positive, got {max_shard_bytes} bytes"
        raise ValueError(msg)
    return _Capture(
        plan,
        Path(output),
        max_shard_bytes=max_shard_bytes,
        progress=progress,
        stop_after_shards=stop_after_shards,
    ).run()


__all__ = [
    "DEFAULT_SHARD_BYTES",
    "CaptureSummary",
    "capture_plan",
    "manifest_is_complete",
    "planned_manifest",
]
