"""The capture directory's format and its compile-time cross-checks (no torch, no tensor bytes).

`dflash-recipe capture` runs the frozen target over the training data once and writes, per
sample, the token ids, the loss mask and the tapped hidden states into safetensors shards, plus
``manifest.json`` describing them (:class:`CaptureManifest`). Training with
``data.hidden_states_path`` then reads those shards instead of running the target's decoder.

A capture made for another plan must never train: :func:`check_capture` compares the manifest
and every shard's *header* (read with
:func:`~dflash_recipes.safetensors_header.read_safetensors_header`, never the tensor data)
with what the plan needs: the taps, hidden size, dtype,
``training_seq_len``, loss-mask policy, base model and tokenizer (by hash) and the chat template
(by hash, a warning), every shard present with the size the manifest states, and the sample
count. Each finding is a diagnostic with a registered code and a fix.

Shard layout: ``shard-NNNNN.safetensors`` holds consecutive samples; sample ``i`` (0-based over
the whole capture, in the order of the data file) has the tensors ``{i:09d}.input_ids``
(int32 ``[T]``), ``{i:09d}.loss_mask`` (uint8 ``[T]``), ``{i:09d}.taps`` (``[T, n_taps, H]``
in the capture dtype, tap ``j`` = output of target layer ``target_layer_ids[j]``) and, when the
objective needs a teacher, ``{i:09d}.last_hidden`` (``[T, H]``: the input of the target's final
norm; teacher logits are recomputed through the final norm and ``lm_head`` at train time).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeGuard

import attrs

from dflash_recipes.diagnostics import Severity, register_code
from dflash_recipes.errors import DataError, SafetensorsHeaderError
from dflash_recipes.model_files import CONFIG_FILE
from dflash_recipes.safetensors_header import TensorInfo, read_safetensors_header

MANIFEST_FILE = "manifest.json"
CAPTURE_FORMAT = "dflash-capture"
CAPTURE_FORMAT_VERSION = 1
#: Largest manifest read back (a manifest lists shards, a few hundred bytes each).
MAX_MANIFEST_BYTES = 64 * 2**20

#: Bytes per element of the dtypes a capture can hold (the plan's base-model dtypes).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Safetensors dtype names of the same.
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
#: Header bytes one tensor entry costs, about (name, dtype, shape and offsets in JSON).
HEADER_BYTES_PER_TENSOR = 96

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
    "capture-loss-mask-mismatch", _E, "the capture's loss masks follow another answer_only_loss"
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

_RECAPTURE = "rerun `dflash-recipe capture RECIPE --output DIR` with this recipe"


# ---------------------------------------------------------------------------------------------
# names and sizes
# ---------------------------------------------------------------------------------------------


def shard_file_name(index: int) -> str:
    """``shard-00003.safetensors``."""
    return f"shard-{index:05d}.safetensors"


def sample_tensor_names(index: int, *, last_hidden: bool) -> tuple[str, ...]:
    """The tensor names of sample `index` in its shard."""
    base = f"{index:09d}"
    names = (f"{base}.input_ids", f"{base}.loss_mask", f"{base}.taps")
    return (*names, f"{base}.last_hidden") if last_hidden else names


def bytes_per_token(n_taps: int, hidden_size: int, dtype: str, *, last_hidden: bool) -> int:
    """Tensor bytes one captured token costs: taps (+ last hidden state), int32 id, uint8 mask."""
    states = n_taps + (1 if last_hidden else 0)
    return states * hidden_size * DTYPE_BYTES[dtype] + 4 + 1


def estimate_bytes(
    token_counts: Sequence[int], n_taps: int, hidden_size: int, dtype: str, *, last_hidden: bool
) -> int:
    """Disk a capture of samples with these token counts needs (tensors + headers)."""
    per_token = bytes_per_token(n_taps, hidden_size, dtype, last_hidden=last_hidden)
    tensors_per_sample = 4 if last_hidden else 3
    header = HEADER_BYTES_PER_TENSOR * tensors_per_sample * len(token_counts)
    return per_token * sum(token_counts) + header


def plan_shards(
    token_counts: Sequence[int], *, bytes_per_token: int, max_shard_bytes: int
) -> list[tuple[int, int]]:
    """Split samples (in order) into shards of at most `max_shard_bytes` of tensor data.

    Returns ``(first_sample, num_samples)`` per shard. A pure function of its inputs, so a
    resumed capture cuts the same shards. A sample larger than the bound gets a shard alone.
    """
    shards: list[tuple[int, int]] = []
    first, size = 0, 0
    for index, count in enumerate(token_counts):
        cost = count * bytes_per_token
        if index > first and size + cost > max_shard_bytes:
            shards.append((first, index - first))
            first, size = index, 0
        size += cost
    if len(token_counts) > first:
        shards.append((first, len(token_counts) - first))
    return shards


# ---------------------------------------------------------------------------------------------
# identity hashes (the same functions at capture time and at compile time)
# ---------------------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, streamed."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_files(paths: Sequence[Path]) -> str | None:
    digest = hashlib.sha256()
    found = False
    for path in paths:
        if path.is_file():
            found = True
            digest.update(path.name.encode() + b"\0" + file_sha256(path).encode() + b"\0")
    return digest.hexdigest() if found else None


def base_config_sha256(base_path: Path) -> str | None:
    """sha256 of the base model's config.json (None when it cannot be read)."""
    try:
        return file_sha256(base_path / CONFIG_FILE)
    except OSError:
        return None


def tokenizer_sha256(base_path: Path) -> str | None:
    """One sha256 over the base model's tokenizer files (None when there are none)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    try:
        return _hash_files([base_path / name for name in names])
    except OSError:
        return None


def chat_template_sha256(chat_template: str | None, base_path: Path) -> str | None:
    """sha256 of the template the data is rendered with: data.chat_template, else the model's.

    The model's template is ``chat_template.jinja`` next to config.json, else the
    ``chat_template`` string of tokenizer_config.json. None when there is none.
    """
    try:
        if chat_template is not None:
            return file_sha256(Path(chat_template))
        jinja = base_path / "chat_template.jinja"
        if jinja.is_file():
            return file_sha256(jinja)
        config = base_path / "tokenizer_config.json"
        if config.is_file() and config.stat().st_size <= MAX_MANIFEST_BYTES:
            value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(value, str):
                return hashlib.sha256(value.encode("utf-8")).hexdigest()
    except (OSError, ValueError, AttributeError):
        return None
    return None


# ---------------------------------------------------------------------------------------------
# the manifest
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class ShardEntry:
    """One shard: its file, the samples it holds, their tokens, its size once written."""

    file: str
    first_sample: int
    num_samples: int
    num_tokens: int
    #: File size in bytes; None while the capture is still being written.
    bytes: int | None = None


@attrs.frozen
class CaptureManifest:
    """What a capture directory holds (``manifest.json``)."""

    base_model_path: str
    base_config_sha256: str | None
    tokenizer_sha256: str | None
    chat_template_sha256: str | None
    data_path: str | None
    data_sha256: str | None
    answer_only_loss: bool
    target_layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str
    training_seq_len: int
    block_size: int
    last_hidden_state: bool
    num_samples: int
    num_tokens: int
    #: Samples cut at training_seq_len.
    num_truncated: int
    bytes_per_token: int
    estimated_bytes: int
    shards: tuple[ShardEntry, ...]
    #: False until every shard is written and sized.
    complete: bool = False

    def identity(self) -> dict[str, object]:
        """Everything but the progress fields: two captures with equal identities are equal."""
        data = self.to_dict()
        data.pop("complete")
        data["shards"] = [{k: v for k, v in s.items() if k != "bytes"} for s in data["shards"]]  # type: ignore[attr-defined]
        return data

    def to_dict(self) -> dict[str, object]:
        """The JSON object of ``manifest.json`` (format and version first)."""
        body = attrs.asdict(self, recurse=True)
        body["target_layer_ids"] = list(self.target_layer_ids)
        body["shards"] = [attrs.asdict(s) for s in self.shards]
        return {"format": CAPTURE_FORMAT, "format_version": CAPTURE_FORMAT_VERSION, **body}

    def to_json(self) -> str:
        """Indented, key-sorted JSON text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


_INT_FIELDS = (
    "hidden_size",
    "training_seq_len",
    "block_size",
    "num_samples",
    "num_tokens",
    "num_truncated",
    "bytes_per_token",
    "estimated_bytes",
)
_OPTIONAL_STR_FIELDS = (
    "base_config_sha256",
    "tokenizer_sha256",
    "chat_template_sha256",
    "data_path",
    "data_sha256",
)


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_manifest(text: str, where: str) -> CaptureManifest:
    """A manifest from its JSON text; DataError naming `where` and the bad field otherwise."""

    def bad(what: str) -> DataError:
        return DataError(f"{where}: {what}; {_RECAPTURE}")

    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise bad(f"not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != CAPTURE_FORMAT:
        raise bad(f'not a capture manifest (no "format": "{CAPTURE_FORMAT}")')
    version = raw.get("format_version")
    if version != CAPTURE_FORMAT_VERSION:
        msg = (
            f"{where}: capture format version {version!r}, this dflash-recipes reads version "
            f"{CAPTURE_FORMAT_VERSION}; {_RECAPTURE}"
        )
        raise DataError(msg)
    for name in _INT_FIELDS:
        if not _int(raw.get(name)):
            raise bad(f"{name} must be a non-negative integer, got {raw.get(name)!r}")
    for name in _OPTIONAL_STR_FIELDS:
        if raw.get(name) is not None and not isinstance(raw.get(name), str):
            raise bad(f"{name} must be a string or null")
    for name in ("answer_only_loss", "last_hidden_state", "complete"):
        if not isinstance(raw.get(name), bool):
            raise bad(f"{name} must be true or false")
    taps = raw.get("target_layer_ids")
    if not isinstance(taps, list) or not taps or not all(_int(t) for t in taps):
        raise bad("target_layer_ids must be a non-empty list of layer ids")
    if raw.get("dtype") not in DTYPE_BYTES or not isinstance(raw.get("base_model_path"), str):
        raise bad(f"dtype must be one of {', '.join(DTYPE_BYTES)} and base_model_path a string")
    shards_raw = raw.get("shards")
    if not isinstance(shards_raw, list):
        raise bad("shards must be a list")
    shards: list[ShardEntry] = []
    for number, entry in enumerate(shards_raw):
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise bad(f"shards[{number}] must be an object with a file name")
        name = entry["file"]
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise bad(f"shards[{number}].file {name!r} must be a plain .safetensors file name")
        first, count, tokens = (entry.get(k) for k in ("first_sample", "num_samples", "num_tokens"))
        size = entry.get("bytes")
        if not (_int(first) and _int(count) and _int(tokens)) or (
            size is not None and not _int(size)
        ):
            raise bad(f"shards[{number}] needs non-negative integer counts and bytes")
        shards.append(ShardEntry(name, first, count, tokens, bytes=size))
    return CaptureManifest(
        base_model_path=raw["base_model_path"],
        base_config_sha256=raw.get("base_config_sha256"),
        tokenizer_sha256=raw.get("tokenizer_sha256"),
        chat_template_sha256=raw.get("chat_template_sha256"),
        data_path=raw.get("data_path"),
        data_sha256=raw.get("data_sha256"),
        answer_only_loss=raw["answer_only_loss"],
        target_layer_ids=tuple(taps),
        hidden_size=raw["hidden_size"],
        dtype=raw["dtype"],
        training_seq_len=raw["training_seq_len"],
        block_size=raw["block_size"],
        last_hidden_state=raw["last_hidden_state"],
        num_samples=raw["num_samples"],
        num_tokens=raw["num_tokens"],
        num_truncated=raw["num_truncated"],
        bytes_per_token=raw["bytes_per_token"],
        estimated_bytes=raw["estimated_bytes"],
        shards=tuple(shards),
        complete=raw["complete"],
    )


def read_manifest(directory: Path) -> CaptureManifest:
    """The manifest of a capture directory; DataError (what, where, fix) when unusable."""
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        msg = f"capture directory {directory} {what}; {_RECAPTURE}"
        raise DataError(msg)
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            msg = f"{path} is {size} bytes, more than a manifest can be ({MAX_MANIFEST_BYTES})"
            raise DataError(msg)
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        msg = f"{directory} has no {MANIFEST_FILE}: it is not a capture directory; {_RECAPTURE}"
        raise DataError(msg) from None
    except (OSError, UnicodeDecodeError) as exc:
        msg = f"cannot read {path}: {exc}"
        raise DataError(msg) from exc
    return parse_manifest(text, str(path))


# ---------------------------------------------------------------------------------------------
# cross-checks
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class CaptureExpectation:
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


@attrs.frozen
class CaptureFinding:
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
                f"{_RECAPTURE} (it captures {_ids(expect.target_layer_ids)}), or set "
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
                _RECAPTURE,
            )
        )
    if manifest.dtype != expect.dtype:
        found.append(
            CaptureFinding(
                CAPTURE_DTYPE_MISMATCH,
                f"the capture holds {manifest.dtype} states, the plan runs the target in "
                f"{expect.dtype}",
                f"set model.dtype: {manifest.dtype}, or {_RECAPTURE}",
            )
        )
    if manifest.training_seq_len != expect.training_seq_len:
        found.append(
            CaptureFinding(
                CAPTURE_SEQ_LEN_MISMATCH,
                f"the capture truncated sequences at training_seq_len {manifest.training_seq_len}"
                f", the plan trains at {expect.training_seq_len}",
                f"set training.training_seq_len: {manifest.training_seq_len}, or {_RECAPTURE}",
            )
        )
    if manifest.answer_only_loss != expect.answer_only_loss:
        value = str(manifest.answer_only_loss).lower()
        found.append(
            CaptureFinding(
                CAPTURE_LOSS_MASK_MISMATCH,
                f"the capture's loss masks were made with answer_only_loss {value}, the plan "
                f"says {str(expect.answer_only_loss).lower()}",
                f"set data.answer_only_loss: {value}, or {_RECAPTURE}",
            )
        )
    if expect.needs_last_hidden and not manifest.last_hidden_state:
        found.append(
            CaptureFinding(
                CAPTURE_NO_TEACHER_STATES,
                "the objective needs the target's logits as a teacher (self-distillation or "
                "DSpark's TV term), but the capture holds no last hidden state to recompute "
                "them from",
                f"{_RECAPTURE} (it then stores the last hidden state), or turn off "
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
                f"{_RECAPTURE}, or point model.model_name_or_path at {manifest.base_model_path}",
            )
        )
    if manifest.chat_template_sha256 != expect.chat_template_sha256:
        found.append(
            CaptureFinding(
                CAPTURE_CHAT_TEMPLATE_CHANGED,
                "the capture was rendered with another chat template than the one the recipe "
                "names now; training follows the capture's rendering",
                f"{_RECAPTURE} to train on the new rendering, or restore data.chat_template",
            )
        )
    if expect.data_sha256 is not None and manifest.data_sha256 != expect.data_sha256:
        found.append(
            CaptureFinding(
                CAPTURE_DATA_CHANGED,
                f"data.data_path is not the file the capture was made from "
                f"({manifest.data_path}): training reads the capture, not this file",
                f"{_RECAPTURE} to train on the current data, or leave data.data_path unset "
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
                f"{_RECAPTURE}, or set dflash.dflash_block_size: {manifest.block_size}",
            )
        )
    return found


def shard_problem(directory: Path, entry: ShardEntry, manifest: CaptureManifest) -> str | None:
    """What is wrong with one shard file (None: present, and its header lists its samples).

    The size the manifest states is checked by :func:`check_shards`; this reads the header only.
    """
    path = directory / entry.file
    try:
        if not path.is_file():
            return "is missing"
    except OSError:
        return "is missing"
    try:
        header = read_safetensors_header(path)
    except SafetensorsHeaderError as exc:
        return f"has a damaged header ({exc})"
    return _shard_header_problem(header.tensors, entry, manifest)


def check_shards(directory: Path, manifest: CaptureManifest) -> list[CaptureFinding]:
    """Every shard present, with the manifest's size and a header listing its samples."""
    found: list[CaptureFinding] = []
    samples, tokens, expected_first = 0, 0, 0

    def bad(entry: ShardEntry, what: str) -> None:
        found.append(
            CaptureFinding(
                CAPTURE_SHARD_BAD,
                f"capture shard {directory / entry.file} {what}",
                f"{_RECAPTURE}: it rewrites missing or damaged shards and keeps the good ones",
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
                _RECAPTURE,
            )
        )
    return found


def _shard_header_problem(
    table: Mapping[str, TensorInfo],
    entry: ShardEntry,
    manifest: CaptureManifest,
) -> str | None:
    n_taps = len(manifest.target_layer_ids)
    st_dtype = SAFETENSORS_DTYPES[manifest.dtype]
    wanted: set[str] = set()
    tokens = 0
    for index in range(entry.first_sample, entry.first_sample + entry.num_samples):
        names = sample_tensor_names(index, last_hidden=manifest.last_hidden_state)
        wanted.update(names)
        ids = table.get(names[0])
        taps = table.get(names[2])
        if ids is None or taps is None or len(ids.shape) != 1:
            return f"has no tensors for sample {index}"
        length = ids.shape[0]
        if length > manifest.training_seq_len:
            return f"holds sample {index} of {length} tokens, over training_seq_len"
        tokens += length
        if taps.shape != (length, n_taps, manifest.hidden_size) or taps.dtype != st_dtype:
            return (
                f"holds taps of sample {index} as {taps.dtype} {list(taps.shape)}, expected "
                f"{st_dtype} {[length, n_taps, manifest.hidden_size]}"
            )
    extra = sorted(set(table) - wanted)
    if extra:
        return f"holds tensors the manifest does not list (e.g. {extra[0]})"
    missing = sorted(wanted - set(table))
    if missing:
        return f"lacks tensor {missing[0]}"
    if tokens != entry.num_tokens:
        return f"holds {tokens} tokens, the manifest says {entry.num_tokens}"
    return None


def check_capture(directory: Path, expect: CaptureExpectation) -> list[CaptureFinding]:
    """All findings for `directory` against `expect` (manifest first, then the shards)."""
    try:
        manifest = read_manifest(directory)
    except DataError as exc:
        return [CaptureFinding(CAPTURE_UNREADABLE, str(exc), _RECAPTURE)]
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


def needs_teacher(
    *, self_logit_distillation: bool, projector_type: str, dspark_tv_weight: float
) -> bool:
    """Whether the objective compares the drafter with the target's logits (same rule as train)."""
    return self_logit_distillation or (projector_type == "dspark" and dspark_tv_weight > 0)


__all__ = [
    "CAPTURE_FORMAT",
    "CAPTURE_FORMAT_VERSION",
    "MANIFEST_FILE",
    "CaptureExpectation",
    "CaptureFinding",
    "CaptureManifest",
    "ShardEntry",
    "base_config_sha256",
    "bytes_per_token",
    "chat_template_sha256",
    "check_capture",
    "check_manifest",
    "check_shards",
    "estimate_bytes",
    "file_sha256",
    "needs_teacher",
    "parse_manifest",
    "plan_shards",
    "read_manifest",
    "sample_tensor_names",
    "shard_file_name",
    "shard_problem",
    "tokenizer_sha256",
]
