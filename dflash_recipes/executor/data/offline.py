"""Offline training input: a `dflash-recipe capture` directory read lazily, sample by sample.

With ``data.hidden_states_path`` the trainer never runs the target's decoder. The token ids and
loss masks of every sample (a few bytes a token) are read once into a
:class:`~dflash_recipes.executor.data.train_dataset.TrainDataset`, so batching, the seeded epoch
order, rank
sharding and resumption are exactly those of online training. The tapped states (kilobytes a
token) stay on disk: each micro-batch reads only its rows' tensors through ``safe_open``
(memory-mapped, no full load) and pads them like the batch, in the stored dtype, on the
prefetch thread (:mod:`~dflash_recipes.executor.training.setup.prefetch`): the loop only
moves them to the device, ``non_blocking`` from pinned memory.

Nothing in a capture is trusted blindly (manifest format version 2): the token ids and loss
masks read from each shard must hash to what the manifest recorded from the tokenized
conversations
(checked for every shard at setup, a few bytes a token), and each shard's file must hash to its
recorded sha256 before an optimiser step uses its states: a background thread hashes the
shards in order ahead of the reads (:meth:`CaptureReader.verify_in_background`; one sequential
read of each, which leaves it in the page cache for the reads that follow), and a read of a
shard not hashed yet hashes it first (:meth:`CaptureReader.verify_all` checks every shard up
front instead). A mismatch is a
DataError naming the shard, both hashes and the fix.

Teacher logits (self-distillation, DSpark's TV term) are recomputed from the stored input of the
target's final norm, through that norm and ``lm_head``: the same modules and dtype as the online
forward, never stored logits. Only the target's embeddings, final norm and ``lm_head`` are
loaded (:func:`load_target_without_decoder`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from dflash_recipes.checkpoint.kinds.registry import needs_teacher
from dflash_recipes.checkpoint.model_files import CONFIG_FILE
from dflash_recipes.errors import CheckpointError, DataError
from dflash_recipes.executor.data.tokenize import DatasetStats, TokenizedExample
from dflash_recipes.executor.data.train_dataset import TrainDataset
from dflash_recipes.executor.model.convert import CapturedStates, torch_dtype
from dflash_recipes.files.capture_manifest import (
    CaptureManifest,
    ShardEntry,
    read_manifest,
    sample_tensor_names,
    samples_sha256,
    shard_content_problem,
    shard_mismatch,
)
from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger(__name__)


def load_target_without_decoder(plan: RunPlan) -> PreTrainedModel:
    """The target with its embeddings, final norm and ``lm_head`` only (no decoder layers).

    The layers' tensors are never read. ``config.num_hidden_layers`` keeps the checkpoint's
    value so the model still describes the checkpoint it came from.
    """
    base = plan.base_model
    path = Path(base.path)
    facts = base.facts
    if facts is None or not (path / CONFIG_FILE).is_file():
        msg = f"base model directory {path} has no config.json (or the plan no target facts)"
        raise CheckpointError(msg)
    import transformers

    verbosity = transformers.logging.get_verbosity()
    # The loader reports every skipped layer tensor as "unexpected": that is the point here.
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    try:
        config = AutoConfig.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=base.trust_remote_code
        )
        text = config.get_text_config()
        text.num_hidden_layers = 0
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = []
        model = AutoModelForCausalLM.from_pretrained(
            str(path),
            config=config,
            local_files_only=True,
            trust_remote_code=base.trust_remote_code,
            dtype=torch_dtype(base.dtype),
        )
    except (OSError, ValueError, TypeError) as exc:
        msg = f"cannot load the base model's embeddings and lm_head from {path}: {exc}"
        raise CheckpointError(msg) from exc
    finally:
        transformers.logging.set_verbosity(verbosity)
    assert isinstance(model, PreTrainedModel)
    model.config.get_text_config().num_hidden_layers = facts.num_hidden_layers
    nn.Module.eval(model)
    return model


#: Most shards a reader keeps open (memory-mapped) at once; the least recently read is closed.
MAX_OPEN_SHARDS = 32


class CaptureReader:
    """Lazy access to a capture's samples: one ``safe_open`` handle (a memory map) per shard,
    opened on use, at most :data:`MAX_OPEN_SHARDS` at once (the least recently read is closed).

    :meth:`close` (or leaving a ``with`` block) closes every handle; reading again reopens.
    """

    def __init__(self, directory: Path, manifest: CaptureManifest) -> None:
        self.directory = directory
        self.manifest = manifest
        self._starts = [entry.first_sample for entry in manifest.shards]
        #: Open handles by shard file, least recently read first.
        self._handles: OrderedDict[str, safe_open] = OrderedDict()
        #: Shards whose file was hashed and matched the manifest.
        self._verified: set[str] = set()
        #: One lock per shard file, so a shard is hashed once whichever thread asks first.
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def close(self) -> None:
        """Close the shard handles (reading again opens them again)."""
        _close_handles(self._handles)

    def __enter__(self) -> CaptureReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def open_shards(self) -> tuple[str, ...]:
        """The shard files open now, least recently read first."""
        return tuple(self._handles)

    def _handle(self, entry: ShardEntry) -> safe_open:
        handle = self._handles.get(entry.file)
        if handle is not None:
            self._handles.move_to_end(entry.file)
            return handle
        while len(self._handles) >= MAX_OPEN_SHARDS:
            _, oldest = self._handles.popitem(last=False)
            oldest.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        handle = safe_open(str(self.directory / entry.file), framework="pt")
        handle.__enter__()  # type: ignore[no-untyped-call]
        self._handles[entry.file] = handle
        return handle

    def _shard(self, index: int) -> ShardEntry:
        if not 0 <= index < self.manifest.num_samples:
            msg = f"sample {index} is outside the capture's {self.manifest.num_samples} samples"
            raise IndexError(msg)
        lo, hi = 0, len(self._starts) - 1
        while lo < hi:  # last shard whose first sample <= index
            mid = (lo + hi + 1) // 2
            if self._starts[mid] <= index:
                lo = mid
            else:
                hi = mid - 1
        return self.manifest.shards[lo]

    def verify(self, entry: ShardEntry) -> None:
        """Check the shard's file against its recorded sha256 (once); DataError on mismatch.

        Thread-safe: two threads asking for the same shard hash it once, the second waiting
        for the first's verdict (:meth:`verify_in_background`)."""
        with self._locks_lock:
            lock = self._locks.setdefault(entry.file, threading.Lock())
        with lock:
            if entry.file in self._verified:
                return
            try:
                problem = shard_content_problem(self.directory, entry)
            except OSError as exc:
                msg = f"cannot read capture shard {self.directory / entry.file}: {exc}"
                raise DataError(msg) from exc
            if problem is not None:
                raise DataError(problem)
            self._verified.add(entry.file)

    def verify_all(self) -> None:
        """Check every shard's file now (``dflash-recipe run --verify-capture``)."""
        for entry in self.manifest.shards:
            self.verify(entry)

    def _tensor(self, index: int, part: int) -> Tensor:
        entry = self._shard(index)
        if part >= 2:  # the states: never used from a shard that does not hash right
            self.verify(entry)
        path = self.directory / entry.file
        try:
            handle = self._handle(entry)
            name = sample_tensor_names(index, last_hidden=self.manifest.last_hidden_state)[part]
            tensor: Tensor = handle.get_tensor(name)  # type: ignore[no-untyped-call]
        except (OSError, RuntimeError, KeyError, SafetensorError) as exc:
            msg = (
                f"cannot read sample {index} from capture shard {path}: {exc}; the shard changed "
                "after compile: rerun `dflash-recipe capture` for this recipe"
            )
            raise DataError(msg) from exc
        return tensor

    def example(self, index: int) -> TokenizedExample:
        """Token ids and loss mask of sample `index`."""
        ids = self._tensor(index, 0).long().tolist()
        mask = self._tensor(index, 1).long().tolist()
        return TokenizedExample(ids, mask)

    def states(self, indices: Sequence[int], length: int) -> CapturedStates:
        """The captured states of samples `indices` as batch rows padded to `length`, in host
        memory and the stored dtype (the prefetch thread reads them; the loop moves them)."""
        first = self._tensor(indices[0], 2)
        _, n_taps, hidden = first.shape
        tapped = torch.zeros(len(indices), length, n_taps * hidden, dtype=first.dtype)
        last: Tensor | None = None
        if self.manifest.last_hidden_state:
            last = torch.zeros(len(indices), length, hidden, dtype=first.dtype)
        for row, index in enumerate(indices):
            taps = first if row == 0 else self._tensor(index, 2)
            n = int(taps.shape[0])
            tapped[row, :n] = taps.reshape(n, n_taps * hidden)
            if last is not None:
                last[row, :n] = self._tensor(index, 3)
        return CapturedStates(tapped, last)

    def verify_in_background(self) -> threading.Thread:
        """Hash every shard on a daemon thread, in order, ahead of the reads that need them:
        a read of a shard being hashed waits for that hash (never hashes it twice), a read of
        one not reached yet hashes it itself. Returns the started thread."""

        def verify_every_shard() -> None:
            for entry in self.manifest.shards:
                try:
                    self.verify(entry)
                except DataError:
                    return  # the read that needs this shard raises it, on its own thread

        thread = threading.Thread(target=verify_every_shard, name="capture-verify", daemon=True)
        thread.start()
        return thread


def _close_handles(handles: OrderedDict[str, safe_open]) -> None:
    while handles:
        _, handle = handles.popitem(last=False)
        handle.__exit__(None, None, None)  # type: ignore[no-untyped-call]


def open_capture(plan: RunPlan) -> tuple[CaptureReader, CaptureManifest]:
    """Open the plan's capture and re-check what training relies on (compile checked it all)."""
    raw = plan.data.hidden_states_path
    if raw is None:
        msg = "the plan has no data.hidden_states_path"
        raise DataError(msg)
    directory = Path(raw)
    manifest = read_manifest(directory)
    spec = plan.resolved_draft()
    objective = plan.draft.objective
    wanted = tuple(spec.target_layer_ids)
    problems = []
    if not manifest.complete:
        problems.append("it is incomplete (rerun `dflash-recipe capture` to finish it)")
    if manifest.target_layer_ids != wanted:
        problems.append(
            f"it holds target layers {list(manifest.target_layer_ids)}, the plan taps "
            f"{list(wanted)}"
        )
    if manifest.dtype != plan.base_model.dtype:
        problems.append(f"it holds {manifest.dtype}, the plan runs {plan.base_model.dtype}")
    teacher = needs_teacher(spec.projector_type, objective)
    if teacher and not manifest.last_hidden_state:
        problems.append("the objective needs teacher logits and it holds no last hidden state")
    if problems:
        msg = (
            f"the capture {directory} does not fit this plan: {'; '.join(problems)}; "
            "recompile the recipe (`dflash-recipe compile`) to see every difference with its fix"
        )
        raise DataError(msg)
    return CaptureReader(directory, manifest), manifest


def check_token_ids(
    directory: Path, manifest: CaptureManifest, examples: Sequence[TokenizedExample]
) -> None:
    """Each shard's token ids and loss masks hash to what the capture recorded; DataError
    naming the shard.

    A version-1 capture records no hashes: it is read unverified, with a warning.
    """
    unverified = [e.file for e in manifest.shards if e.samples_sha256 is None]
    if unverified:
        logger.warning(
            "capture %s records no shard hashes (format version 1): its shards are not "
            "verified; capture it again with this version to have them checked",
            directory,
        )
    for entry in manifest.shards:
        if entry.samples_sha256 is None:
            continue
        rows = examples[entry.first_sample : entry.first_sample + entry.num_samples]
        found = samples_sha256((e.input_ids, e.loss_mask) for e in rows)
        if found != entry.samples_sha256:
            path = directory / entry.file
            what = "samples (token ids and loss masks)"
            raise DataError(shard_mismatch(path, what, entry.samples_sha256, found))


def capture_dataset(
    reader: CaptureReader, manifest: CaptureManifest, tokenizer: PreTrainedTokenizerBase
) -> TrainDataset:
    """The capture's samples as a dataset (ids and loss masks only; states stay on disk)."""
    examples = tuple(reader.example(index) for index in range(manifest.num_samples))
    if not examples:
        msg = f"the capture {reader.directory} holds no samples; capture a non-empty data file"
        raise DataError(msg)
    check_token_ids(reader.directory, manifest, examples)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stats = DatasetStats(
        conversations_used=len(examples),
        skipped=(),
        num_tokens=sum(len(e.input_ids) for e in examples),
        num_supervised_tokens=sum(sum(e.loss_mask) for e in examples),
        num_truncated=manifest.num_truncated,
    )
    return TrainDataset(examples, int(pad), stats, reader.directory)


__all__ = [
    "MAX_OPEN_SHARDS",
    "CaptureReader",
    "capture_dataset",
    "check_token_ids",
    "load_target_without_decoder",
    "open_capture",
]
