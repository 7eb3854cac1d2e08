"""The tensor table of a checkpoint directory: one model.safetensors or a sharded index.

:func:`read_checkpoint_weights` merges the safetensors headers of a directory's weight files
(never their tensor bytes) into one :class:`CheckpointWeights`, checking that a shard index and
its shards agree; every problem is a :class:`~dflash_recipes.errors.CheckpointError` naming
the file and the rule.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from dflash_recipes.checkpoint.model_files import WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from dflash_recipes.checkpoint.model_paths import describe_directory
from dflash_recipes.checkpoint.safetensors_header import (
    SafetensorsHeader,
    TensorInfo,
    has_surrogates,
    read_safetensors_header,
    show_value,
)
from dflash_recipes.errors import CheckpointError, SafetensorsHeaderError
from dflash_recipes.files.jsonio import read_json_object_file
from dflash_recipes.records import Record


@attrs.frozen(repr=False, eq=False, slots=False)
class CheckpointWeights(Record):
    """The merged tensor table of a checkpoint directory (one file or the shards of an index)."""

    directory: Path
    #: Weight files relative to `directory`, sorted.
    weight_files: tuple[str, ...]
    tensors: Mapping[str, TensorInfo]
    #: Tensor name -> the weight file (relative) that holds it.
    tensor_files: Mapping[str, str]
    #: Safetensors dtypes present, sorted unique (e.g. ("BF16",)).
    dtypes: tuple[str, ...]
    #: Bytes of tensor data over all weight files (headers excluded).
    total_bytes: int
    #: Tensor name -> the name it is stored under, for tensors read under another name
    #: (:func:`dflash_recipes.checkpoint.known_layouts.canonical_weights`); empty otherwise.
    stored_names: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape, the form :func:`dflash_recipes.layout.compare_layout` takes."""
        return {name: info.shape for name, info in self.tensors.items()}


def read_checkpoint_weights(
    directory: Path, *, max_index_bytes: int = 16 * 2**20
) -> CheckpointWeights:
    """Read the tensor table of a checkpoint directory from its safetensors headers only.

    `model.safetensors` is used when present (as transformers does); otherwise
    `model.safetensors.index.json` and the shards it names. Raises CheckpointError for a
    missing or inconsistent directory, index or shard; a malformed header is reported as a
    CheckpointError too, caused by (``__cause__``) the SafetensorsHeaderError.
    """
    single = directory / WEIGHTS_FILE
    index = directory / WEIGHTS_INDEX_FILE
    if single.exists() or single.is_symlink():
        header = _header_or_checkpoint_error(single)
        return _weights(directory, {WEIGHTS_FILE: header})
    if index.exists():
        return _read_sharded(directory, index, max_index_bytes)
    msg = (
        f"{directory}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}; "
        f"the directory holds {describe_directory(directory)}"
    )
    raise CheckpointError(msg)


def _header_or_checkpoint_error(path: Path) -> SafetensorsHeader:
    try:
        return read_safetensors_header(path)
    except SafetensorsHeaderError as exc:
        raise CheckpointError(str(exc)) from exc


def _weights(directory: Path, headers: Mapping[str, SafetensorsHeader]) -> CheckpointWeights:
    tensors: dict[str, TensorInfo] = {}
    tensor_files: dict[str, str] = {}
    total = 0
    for file_name in sorted(headers):
        header = headers[file_name]
        for name, info in header.tensors.items():
            tensors[name] = info
            tensor_files[name] = file_name
        total += header.data_size
    return CheckpointWeights(
        directory=directory,
        weight_files=tuple(sorted(headers)),
        tensors=tensors,
        tensor_files=tensor_files,
        dtypes=tuple(sorted({info.dtype for info in tensors.values()})),
        total_bytes=total,
    )


def _plain_basename(name: str) -> bool:
    return (
        bool(name)
        and name not in {".", ".."}
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not os.path.isabs(name)
        and not has_surrogates(name)
    )


def _read_sharded(directory: Path, index: Path, max_index_bytes: int) -> CheckpointWeights:
    where = str(index)
    document = read_json_object_file(
        index, max_bytes=max_index_bytes, what="shard index", error=CheckpointError
    )
    weight_map = document.get("weight_map")
    if not isinstance(weight_map, dict):
        msg = f"{where}: the index must have a weight_map object (tensor name -> shard file)"
        raise CheckpointError(msg)
    if not weight_map:
        msg = f"{where}: weight_map is empty, the index names no tensors"
        raise CheckpointError(msg)
    by_shard: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            shown = show_value(shard)
            msg = f"{where}: weight_map[{show_value(name)}] must be a shard file name, got {shown}"
            raise CheckpointError(msg)
        if not _plain_basename(shard):
            msg = (
                f"{where}: weight_map[{show_value(name)}] names shard {show_value(shard)}, which "
                f"is not a plain file name inside {directory} (no '/', '..' or absolute paths)"
            )
            raise CheckpointError(msg)
        by_shard.setdefault(shard, set()).add(name)

    missing_files = sorted(s for s in by_shard if not (directory / s).is_file())
    if missing_files:
        msg = (
            f"{where}: shard file(s) {', '.join(missing_files)} named by the index are missing "
            f"or not files; the directory holds {describe_directory(directory)}"
        )
        raise CheckpointError(msg)

    headers: dict[str, SafetensorsHeader] = {}
    seen_in: dict[str, str] = {}
    for shard in sorted(by_shard):
        header = _header_or_checkpoint_error(directory / shard)
        headers[shard] = header
        for name in header.tensors:
            other = seen_in.get(name)
            if other is not None:
                msg = (
                    f"{directory}: tensor {show_value(name)} is stored in two shards, {other} and "
                    f"{shard}; which copy to load would be ambiguous"
                )
                raise CheckpointError(msg)
            seen_in[name] = shard
        listed = by_shard[shard]
        absent = sorted(listed - set(header.tensors))
        if absent:
            msg = (
                f"{where}: {len(absent)} tensor(s) the index places in {shard} are not in its "
                f"header: {_name_list(absent)}"
            )
            raise CheckpointError(msg)
    for name, shard in seen_in.items():
        if name not in weight_map:
            msg = (
                f"{where}: shard {shard} holds tensor {show_value(name)}, which the index does not "
                "list (the index and the shards disagree)"
            )
            raise CheckpointError(msg)
    return _weights(directory, headers)


def _name_list(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown


__all__ = ["CheckpointWeights", "read_checkpoint_weights"]
