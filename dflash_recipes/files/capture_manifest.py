"""The capture directory's format: names, sizes, hashes, manifest (no torch, no tensor bytes).

`dflash-recipe capture` runs the frozen target over the training data once and writes, per
sample, the token ids, the loss mask and the tapped hidden states into safetensors shards, plus
``manifest.json`` describing them (:class:`CaptureManifest`). Training with
``data.hidden_states_path`` then reads those shards instead of running the target's decoder.

The compile-time cross-checks of a capture against a plan live in
:mod:`dflash_recipes.compiler.capture_checks`.

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
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeGuard

import attrs

from dflash_recipes.checkpoint.config_bounds import (
    MAX_LAYER_INDEX,
    MAX_LIST_ENTRIES,
    plausible_maximum,
)
from dflash_recipes.checkpoint.model_files import CONFIG_FILE
from dflash_recipes.checkpoint.safetensors_header import TensorInfo, read_safetensors_header
from dflash_recipes.echo import printable
from dflash_recipes.errors import DataError, SafetensorsHeaderError
from dflash_recipes.files.jsonio import (
    FileReadProblem,
    JsonProblem,
    parse_json,
    read_regular_file,
    shorten,
)
from dflash_recipes.records import Record

MANIFEST_FILE = "manifest.json"
CAPTURE_FORMAT = "dflash-capture"
#: Version 2 adds each shard's content hash and the hash of its samples (ids and loss masks).
CAPTURE_FORMAT_VERSION = 2
#: Versions this dflash-recipes reads (a version-1 capture trains unverified, with a warning).
READABLE_FORMAT_VERSIONS = (1, 2)
#: Largest manifest read back (a manifest lists shards, a few hundred bytes each).
MAX_MANIFEST_BYTES = 64 * 2**20

#: Bytes per element of the dtypes a capture can hold (the plan's base-model dtypes).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Safetensors dtype names of the same.
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
#: Header bytes one tensor entry costs, about (name, dtype, shape and offsets in JSON).
HEADER_BYTES_PER_TENSOR = 96

RECAPTURE = "rerun `dflash-recipe capture RECIPE --output DIR` with this recipe"
RECAPTURE_SHARD = "re-capture this shard with `dflash-recipe capture` (it resumes)"


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


def samples_sha256(samples: Iterable[tuple[Sequence[int], Sequence[int]]]) -> str:
    """sha256 of samples given as (token ids, loss mask): per sample its length, its ids
    (int32 little-endian) and its mask (one byte a token).

    What a shard's samples are: the same at capture time (from the tokenized conversations)
    and at train time (from the shard's ``input_ids`` and ``loss_mask`` tensors).
    """
    digest = hashlib.sha256()
    for ids, mask in samples:
        values = array("i", ids)
        if sys.byteorder == "big":
            values.byteswap()
        digest.update(len(values).to_bytes(8, "little"))
        digest.update(values.tobytes())
        digest.update(bytes(mask))
    return digest.hexdigest()


def shard_mismatch(path: Path, what: str, expected: str, found: str) -> str:
    """The message of a shard whose `what` hash is not the manifest's (names the fix)."""
    return (
        f"capture shard {path} is not the one the manifest recorded: its {what} sha256 is "
        f"{found}, the manifest says {expected} (the file changed, or was copied from another "
        f"capture); {RECAPTURE_SHARD}"
    )


def shard_content_problem(directory: Path, entry: ShardEntry) -> str | None:
    """Why the shard file does not hash to the manifest's sha256 (None: it does, or the
    manifest records none). Reads the whole file once."""
    if entry.sha256 is None:
        return None
    path = directory / entry.file
    found = file_sha256(path)
    if found == entry.sha256:
        return None
    return shard_mismatch(path, "content", entry.sha256, found)


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
        if config.is_file():
            # model_max_length is often 1e30 written as a 31-digit integer
            raw = read_regular_file(config, max_bytes=MAX_MANIFEST_BYTES)
            data = parse_json(raw, max_int_digits=4000)
            value = data.get("chat_template") if isinstance(data, dict) else None
            if isinstance(value, str):
                return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    except (OSError, FileReadProblem, JsonProblem):
        return None
    return None


# ---------------------------------------------------------------------------------------------
# the manifest
# ---------------------------------------------------------------------------------------------


@attrs.frozen(repr=False, eq=False, slots=False)
class ShardEntry(Record):
    """One shard: its file, the samples it holds, their tokens, its size once written."""

    file: str
    first_sample: int
    num_samples: int
    num_tokens: int
    #: File size in bytes; None while the capture is still being written.
    bytes: int | None = None
    #: sha256 of the file, recorded when the capture completes (None: version 1, unverified).
    sha256: str | None = None
    #: :func:`samples_sha256` of the shard's samples, from the tokenized conversations.
    samples_sha256: str | None = None


@attrs.frozen(repr=False, eq=False, slots=False)
class CaptureManifest(Record):
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
    #: The parts of an assistant turn the loss masks supervise (``data.supervise``); None in a
    #: capture made before the setting existed, whose masks supervise every part.
    supervise: tuple[str, ...] | None = None

    def identity(self) -> dict[str, object]:
        """Everything but the progress fields: two captures with equal identities are equal."""
        data = self.to_dict()
        data.pop("complete")
        progress = ("bytes", "sha256")
        data["shards"] = [
            {k: v for k, v in s.items() if k not in progress}
            for s in data["shards"]  # type: ignore[attr-defined]
        ]
        return data

    def to_dict(self) -> dict[str, object]:
        """The JSON object of ``manifest.json`` (format and version first)."""
        body = attrs.asdict(self, recurse=True)
        body["target_layer_ids"] = list(self.target_layer_ids)
        body["supervise"] = None if self.supervise is None else list(self.supervise)
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


#: Bounds of the manifest's sizes (its counts: :data:`MAX_COUNT`, an int64).
_INT_MAXIMA = {
    "hidden_size": plausible_maximum("hidden_size"),
    "training_seq_len": 2**24,
    "block_size": plausible_maximum("block_size"),
}
MAX_COUNT = 2**63 - 1
#: Longest shard file name (a file system's limit).
_MAX_NAME = 255


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_sha256(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def parse_manifest(text: str, where: str) -> CaptureManifest:
    """A manifest from its JSON text; DataError naming `where` and the bad field otherwise."""

    def bad(what: str) -> DataError:
        return DataError(f"{where}: {what}; {RECAPTURE}")

    try:
        raw = parse_json(text)
    except JsonProblem as exc:
        raise bad(f"not valid JSON ({exc.reason})") from None
    if not isinstance(raw, dict) or raw.get("format") != CAPTURE_FORMAT:
        raise bad(f'not a capture manifest (no "format": "{CAPTURE_FORMAT}")')
    version = raw.get("format_version")
    if type(version) is not int or version not in READABLE_FORMAT_VERSIONS:  # not true, 2.0
        readable = " and ".join(str(v) for v in READABLE_FORMAT_VERSIONS)
        msg = (
            f"{where}: capture format version {shorten(version)}, this dflash-recipes reads "
            f"versions {readable}; {RECAPTURE}"
        )
        raise DataError(msg)
    for name in _INT_FIELDS:
        value, maximum = raw.get(name), _INT_MAXIMA.get(name, MAX_COUNT)
        if not _int(value):
            raise bad(f"{name} must be a non-negative integer, got {shorten(value)}")
        if value > maximum:
            # sizes are bounded before anything is sized by them (as config.json's are)
            raise bad(f"{name} must be at most {maximum}, got {shorten(value)}")
    for name in _OPTIONAL_STR_FIELDS:
        if raw.get(name) is not None and not isinstance(raw.get(name), str):
            raise bad(f"{name} must be a string or null")
    for name in ("answer_only_loss", "last_hidden_state", "complete"):
        if not isinstance(raw.get(name), bool):
            raise bad(f"{name} must be true or false")
    taps = raw.get("target_layer_ids")
    if not isinstance(taps, list) or not taps or not all(_int(t) for t in taps):
        raise bad("target_layer_ids must be a non-empty list of layer ids")
    if len(taps) > MAX_LIST_ENTRIES or max(taps) > MAX_LAYER_INDEX:
        want = f"at most {MAX_LIST_ENTRIES} layer ids in [0, {MAX_LAYER_INDEX}]"
        raise bad(f"target_layer_ids must be {want}")
    supervise = raw.get("supervise")
    if supervise is not None and (
        not isinstance(supervise, list)
        or len(supervise) > MAX_LIST_ENTRIES
        or not all(isinstance(part, str) and 0 < len(part) <= _MAX_NAME for part in supervise)
    ):
        raise bad("supervise must be null or a list of the supervised parts' names")
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:  # a list is not hashable
        dtype = None
    if dtype is None or not isinstance(raw.get("base_model_path"), str):
        raise bad(f"dtype must be one of {', '.join(DTYPE_BYTES)} and base_model_path a string")
    shards_raw = raw.get("shards")
    if not isinstance(shards_raw, list):
        raise bad("shards must be a list")
    shards: list[ShardEntry] = []
    for number, entry in enumerate(shards_raw):
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise bad(f"shards[{number}] must be an object with a file name")
        name = entry["file"]
        if (
            Path(name).name != name
            or not name.endswith(".safetensors")
            or len(name) > _MAX_NAME
            or printable(name) != name
        ):
            raise bad(
                f"shards[{number}].file {shorten(name)} must be a plain .safetensors file name"
            )
        first, count, tokens = (entry.get(k) for k in ("first_sample", "num_samples", "num_tokens"))
        size = entry.get("bytes")
        if not (_int(first) and _int(count) and _int(tokens)) or (
            size is not None and not _int(size)
        ):
            raise bad(f"shards[{number}] needs non-negative integer counts and bytes")
        if max(first, count, tokens, size or 0) > MAX_COUNT:
            raise bad(f"shards[{number}]'s counts and bytes must be at most {MAX_COUNT}")
        hashes = [entry.get(k) for k in ("sha256", "samples_sha256")]
        if not all(h is None or _is_sha256(h) for h in hashes):
            raise bad(f"shards[{number}]'s sha256 and samples_sha256 must be 64 hex digits")
        shards.append(
            ShardEntry(
                name,
                first,
                count,
                tokens,
                bytes=size,
                sha256=hashes[0],
                samples_sha256=hashes[1],
            )
        )
    return CaptureManifest(
        base_model_path=raw["base_model_path"],
        base_config_sha256=raw.get("base_config_sha256"),
        tokenizer_sha256=raw.get("tokenizer_sha256"),
        chat_template_sha256=raw.get("chat_template_sha256"),
        data_path=raw.get("data_path"),
        data_sha256=raw.get("data_sha256"),
        answer_only_loss=raw["answer_only_loss"],
        supervise=None if supervise is None else tuple(supervise),
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
        msg = f"capture directory {directory} {what}; {RECAPTURE}"
        raise DataError(msg)
    try:
        # stat first: a FIFO in its place is refused, never waited on
        raw = read_regular_file(path, max_bytes=MAX_MANIFEST_BYTES)
    except FileReadProblem as exc:
        if exc.missing:
            msg = f"{directory} has no {MANIFEST_FILE}: it is not a capture directory; {RECAPTURE}"
        else:
            msg = f"cannot read {path}: {exc.reason}; {RECAPTURE}"
        raise DataError(msg) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        msg = f"cannot read {path}: not valid utf-8 (byte {exc.start}); {RECAPTURE}"
        raise DataError(msg) from None
    return parse_manifest(text, str(path))


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


__all__ = [
    "CAPTURE_FORMAT",
    "CAPTURE_FORMAT_VERSION",
    "MANIFEST_FILE",
    "READABLE_FORMAT_VERSIONS",
    "RECAPTURE",
    "RECAPTURE_SHARD",
    "CaptureManifest",
    "ShardEntry",
    "base_config_sha256",
    "bytes_per_token",
    "chat_template_sha256",
    "estimate_bytes",
    "file_sha256",
    "parse_manifest",
    "plan_shards",
    "read_manifest",
    "sample_tensor_names",
    "samples_sha256",
    "shard_content_problem",
    "shard_file_name",
    "shard_mismatch",
    "shard_problem",
    "tokenizer_sha256",
]
