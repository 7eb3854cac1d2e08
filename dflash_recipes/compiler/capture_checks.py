"""Compile-time cross-checks of a capture against a plan (no torch, no tensor bytes).

A capture made for another plan must never train: :func:`check_capture` compares the manifest
(:mod:`dflash_recipes.files.capture_manifest`) and every shard's *header* (read with
:func:`~dflash_recipes.checkpoint.safetensors_header.read_safetensors_header`, never the tensor
data) with
what the plan needs: the taps, hidden size, dtype, ``training_seq_len``, loss-mask policy, base
model and tokenizer (by hash) and the chat template (by hash, a warning), every shard present
with the size the manifest states, and the sample count. Each finding is a diagnostic with a
registered code and a fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs

from dflash_recipes.checkpoint.model_files import CONFIG_FILE
from dflash_recipes.diagnostics import Severity, register_code
from dflash_recipes.errors import DataError
from dflash_recipes.files.capture_manifest import (
    RECAPTURE,
    CaptureManifest,
    ShardEntry,
    read_manifest,
    shard_problem,
)
from dflash_recipes.recipe.choices import SUPERVISED_PARTS
from dflash_recipes.records import Record

_E, _W = Severity.ERROR, Severity.WARNING
_code = register_code


CAPTURE_UNREADABLE = _code(
    "capture-unreadable",
    _E,
    "data.hidden_states_path is not a complete, readable `dflash-recipe capture` directory",
)
CAPTURE_TAPS_MISMATCH = _code(
    "capture-taps-mismatch", _E, "the capture holds other target layers than the plan's taps"
)
CAPTURE_HIDDEN_SIZE_MISMATCH = _code(
    "capture-hidden-size-mismatch", _E, "the capture's hidden size differs from the target's"
)
CAPTURE_DTYPE_MISMATCH = _code(
    "capture-dtype-mismatch", _E, "the capture's dtype differs from model.dtype"
)
CAPTURE_SEQ_LEN_MISMATCH = _code(
    "capture-seq-len-mismatch", _E, "the capture was truncated at another training_seq_len"
)
CAPTURE_LOSS_MASK_MISMATCH = _code(
    "capture-loss-mask-mismatch",
    _E,
    "the capture's loss masks follow another answer_only_loss or data.supervise",
)
CAPTURE_NO_TEACHER_STATES = _code(
    "capture-no-teacher-states",
    _E,
    "the objective needs teacher logits but the capture holds no last hidden state",
)
CAPTURE_BASE_MODEL_MISMATCH = _code(
    "capture-base-model-mismatch",
    _E,
    "the capture was made with another base model or tokenizer (config/tokenizer hash differs)",
)
CAPTURE_CHAT_TEMPLATE_CHANGED = _code(
    "capture-chat-template-changed",
    _W,
    "the capture was rendered with another chat template than the recipe's",
)
CAPTURE_DATA_CHANGED = _code(
    "capture-data-changed",
    _W,
    "data.data_path is not the file the capture was made from (its sha256 differs)",
)
CAPTURE_BLOCK_SIZE_DIFFERS = _code(
    "capture-block-size-differs",
    _W,
    "the capture kept the conversations that open a block of another dflash_block_size",
)
CAPTURE_SHARD_BAD = _code(
    "capture-shard-bad",
    _E,
    "a capture shard is missing, truncated, or its header differs from the manifest",
)
CAPTURE_SAMPLE_COUNT_MISMATCH = _code(
    "capture-sample-count-mismatch",
    _E,
    "the manifest's sample or token counts do not add up over its shards",
)


@attrs.frozen(repr=False, eq=False, slots=False)
class CaptureExpectation(Record):
    """What the plan needs from a capture (all known at compile time)."""

    target_layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str
    training_seq_len: int
    answer_only_loss: bool
    needs_last_hidden: bool
    base_config_sha256: str | None
    tokenizer_sha256: str | None
    chat_template_sha256: str | None
    #: sha256 of data.data_path, or None when the recipe names no data file.
    data_sha256: str | None = None
    block_size: int | None = None
    #: data.supervise (the parts of an assistant turn the loss masks keep).
    supervise: tuple[str, ...] = SUPERVISED_PARTS


@attrs.frozen(repr=False, eq=False, slots=False)
class CaptureFinding(Record):
    """One problem of a capture: registered code, message, fix."""

    code: str
    message: str
    hint: str


def _ids(ids: Sequence[int]) -> str:
    return "[" + ", ".join(str(i) for i in ids) + "]"


def check_manifest(manifest: CaptureManifest, expect: CaptureExpectation) -> list[CaptureFinding]:
    """Manifest-level findings: the capture against what the plan needs."""
    found: list[CaptureFinding] = []
    if manifest.target_layer_ids != expect.target_layer_ids:
        found.append(
            CaptureFinding(
                CAPTURE_TAPS_MISMATCH,
                f"the capture holds target layers {_ids(manifest.target_layer_ids)}, but the "
                f"plan's taps are {_ids(expect.target_layer_ids)}: the drafter would read other "
                "layers than it is built for",
                f"{RECAPTURE} (it captures {_ids(expect.target_layer_ids)}), or set "
                "dflash.dflash_architecture_config.target_layer_ids: "
                f"{_ids(manifest.target_layer_ids)}",
            )
        )
    if manifest.hidden_size != expect.hidden_size:
        found.append(
            CaptureFinding(
                CAPTURE_HIDDEN_SIZE_MISMATCH,
                f"the capture's hidden size is {manifest.hidden_size}, the target's is "
                f"{expect.hidden_size}: it was captured from another model",
                RECAPTURE,
            )
        )
    if manifest.dtype != expect.dtype:
        found.append(
            CaptureFinding(
                CAPTURE_DTYPE_MISMATCH,
                f"the capture holds {manifest.dtype} states, the plan runs the target in "
                f"{expect.dtype}",
                f"set model.dtype: {manifest.dtype}, or {RECAPTURE}",
            )
        )
    if manifest.training_seq_len != expect.training_seq_len:
        found.append(
            CaptureFinding(
                CAPTURE_SEQ_LEN_MISMATCH,
                f"the capture truncated sequences at training_seq_len {manifest.training_seq_len}"
                f", the plan trains at {expect.training_seq_len}",
                f"set training.training_seq_len: {manifest.training_seq_len}, or {RECAPTURE}",
            )
        )
    if manifest.answer_only_loss != expect.answer_only_loss:
        value = str(manifest.answer_only_loss).lower()
        found.append(
            CaptureFinding(
                CAPTURE_LOSS_MASK_MISMATCH,
                f"the capture's loss masks were made with answer_only_loss {value}, the plan "
                f"says {str(expect.answer_only_loss).lower()}",
                f"set data.answer_only_loss: {value}, or {RECAPTURE}",
            )
        )
    kept = manifest.supervise if manifest.supervise is not None else SUPERVISED_PARTS
    if expect.answer_only_loss and manifest.answer_only_loss and set(kept) != set(expect.supervise):
        value = ", ".join(kept)
        found.append(
            CaptureFinding(
                CAPTURE_LOSS_MASK_MISMATCH,
                f"the capture's loss masks supervise [{value}] of each assistant turn, the plan's "
                f"data.supervise is [{', '.join(expect.supervise)}]",
                f"set data.supervise: [{value}], or {RECAPTURE}",
            )
        )
    if expect.needs_last_hidden and not manifest.last_hidden_state:
        found.append(
            CaptureFinding(
                CAPTURE_NO_TEACHER_STATES,
                "the objective needs the target's logits as a teacher (self-distillation or "
                "DSpark's TV term), but the capture holds no last hidden state to recompute "
                "them from",
                f"{RECAPTURE} (it then stores the last hidden state), or turn off "
                "dflash.dflash_self_logit_distillation",
            )
        )
    different = [
        name
        for name, have, want in (
            (CONFIG_FILE, manifest.base_config_sha256, expect.base_config_sha256),
            ("tokenizer", manifest.tokenizer_sha256, expect.tokenizer_sha256),
        )
        if have != want
    ]
    if different:
        found.append(
            CaptureFinding(
                CAPTURE_BASE_MODEL_MISMATCH,
                f"the capture was made from {manifest.base_model_path}, whose "
                f"{' and '.join(different)} differ from the recipe's base model: its states "
                "belong to another model",
                f"{RECAPTURE}, or point model.model_name_or_path at {manifest.base_model_path}",
            )
        )
    if manifest.chat_template_sha256 != expect.chat_template_sha256:
        found.append(
            CaptureFinding(
                CAPTURE_CHAT_TEMPLATE_CHANGED,
                "the capture was rendered with another chat template than the one the recipe "
                "names now; training follows the capture's rendering",
                f"{RECAPTURE} to train on the new rendering, or restore data.chat_template",
            )
        )
    if expect.data_sha256 is not None and manifest.data_sha256 != expect.data_sha256:
        found.append(
            CaptureFinding(
                CAPTURE_DATA_CHANGED,
                f"data.data_path is not the file the capture was made from "
                f"({manifest.data_path}): training reads the capture, not this file",
                f"{RECAPTURE} to train on the current data, or leave data.data_path unset "
                "(it is not read offline)",
            )
        )
    if expect.block_size is not None and manifest.block_size != expect.block_size:
        found.append(
            CaptureFinding(
                CAPTURE_BLOCK_SIZE_DIFFERS,
                f"the capture kept the conversations that open a block of "
                f"{manifest.block_size} tokens, the plan trains blocks of {expect.block_size}: "
                "the set of conversations differs from what online training would use",
                f"{RECAPTURE}, or set dflash.dflash_block_size: {manifest.block_size}",
            )
        )
    return found


def check_shards(directory: Path, manifest: CaptureManifest) -> list[CaptureFinding]:
    """Every shard present, with the manifest's size and a header listing its samples."""
    found: list[CaptureFinding] = []
    samples, tokens, expected_first = 0, 0, 0

    def bad(entry: ShardEntry, what: str) -> None:
        found.append(
            CaptureFinding(
                CAPTURE_SHARD_BAD,
                f"capture shard {directory / entry.file} {what}",
                f"{RECAPTURE}: it rewrites missing or damaged shards and keeps the good ones",
            )
        )

    for entry in manifest.shards:
        if entry.first_sample != expected_first:
            bad(entry, f"starts at sample {entry.first_sample}, expected {expected_first}")
        expected_first = entry.first_sample + entry.num_samples
        samples += entry.num_samples
        tokens += entry.num_tokens
        path = directory / entry.file
        try:
            size = path.stat().st_size if path.is_file() else None
        except OSError:
            size = None
        if size is not None and size != entry.bytes:
            bad(entry, f"is {size} bytes, the manifest says {entry.bytes} (truncated or replaced)")
            continue
        problem = shard_problem(directory, entry, manifest)
        if problem is not None:
            bad(entry, problem)
    if samples != manifest.num_samples or tokens != manifest.num_tokens:
        found.append(
            CaptureFinding(
                CAPTURE_SAMPLE_COUNT_MISMATCH,
                f"the manifest counts {manifest.num_samples} samples and {manifest.num_tokens} "
                f"tokens, its shards hold {samples} samples and {tokens} tokens",
                RECAPTURE,
            )
        )
    return found


def check_capture(directory: Path, expect: CaptureExpectation) -> list[CaptureFinding]:
    """All findings for `directory` against `expect` (manifest first, then the shards)."""
    try:
        manifest = read_manifest(directory)
    except DataError as exc:
        return [CaptureFinding(CAPTURE_UNREADABLE, str(exc), RECAPTURE)]
    if not manifest.complete:
        done = sum(1 for s in manifest.shards if s.bytes is not None)
        return [
            CaptureFinding(
                CAPTURE_UNREADABLE,
                f"the capture in {directory} is incomplete ({done} of {len(manifest.shards)} "
                "shards recorded): `dflash-recipe capture` was stopped before it finished",
                "rerun the same `dflash-recipe capture` command: it resumes shard by shard",
            )
        ]
    return check_manifest(manifest, expect) + check_shards(directory, manifest)


__all__ = [
    "CAPTURE_BASE_MODEL_MISMATCH",
    "CAPTURE_BLOCK_SIZE_DIFFERS",
    "CAPTURE_CHAT_TEMPLATE_CHANGED",
    "CAPTURE_DATA_CHANGED",
    "CAPTURE_DTYPE_MISMATCH",
    "CAPTURE_HIDDEN_SIZE_MISMATCH",
    "CAPTURE_LOSS_MASK_MISMATCH",
    "CAPTURE_NO_TEACHER_STATES",
    "CAPTURE_SAMPLE_COUNT_MISMATCH",
    "CAPTURE_SEQ_LEN_MISMATCH",
    "CAPTURE_SHARD_BAD",
    "CAPTURE_TAPS_MISMATCH",
    "CAPTURE_UNREADABLE",
    "CaptureExpectation",
    "CaptureFinding",
    "check_capture",
    "check_manifest",
    "check_shards",
]
