"""Reading a W&B offline run file (``run-<id>.wandb``) back, for the tracker tests.

The file is a LevelDB-log-framed stream of ``wandb_internal_pb2.Record`` protobufs: a 7-byte
file header (``:W&B``, magic 0xBEE1, version), then 32 KiB blocks of records, each with a
7-byte header (crc32c, length, type: full, first, middle, last). wandb has no public reader of
these files in offline mode, so the tests parse the framing here and the protobufs with
wandb's own message classes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import attrs

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _key(item: object) -> str:
    """An item's key: ``key``, or its ``nested_key`` path (what wandb-core writes)."""
    key: str = item.key or ".".join(item.nested_key)  # type: ignore[attr-defined]
    return key


def _payloads(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", data[:7]
    assert struct.unpack("<H", data[4:6])[0] == 0xBEE1
    out: list[bytes] = []
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # the block's tail is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if length == 0 and kind == 0:  # zero fill at the end of a block
            pos += left_in_block
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
            pending = b""
    return out


@attrs.define
class WandbRun:
    """What one offline run file holds."""

    run_id: str
    #: History rows: ``_step`` -> {key: value}.
    history: dict[int, dict[str, object]]
    config: dict[str, object]
    summary: dict[str, object]
    tags: tuple[str, ...]
    resumed: bool
    exit_code: int | None


def read_wandb_run(path: Path) -> WandbRun:
    """Parse ``run-<id>.wandb``: history by step, the config, the summary, the run's tags."""
    from wandb.proto import wandb_internal_pb2 as pb

    history: dict[int, dict[str, object]] = {}
    config: dict[str, object] = {}
    summary: dict[str, object] = {}
    run_id, tags, resumed, exit_code = "", (), False, None
    for payload in _payloads(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        which = record.WhichOneof("record_type")
        if which == "run":
            run_id = record.run.run_id
            tags = tuple(record.run.tags)
            resumed = resumed or record.run.resumed
            for item in record.run.config.update:
                config[_key(item)] = json.loads(item.value_json)
        elif which == "config":
            for item in record.config.update:
                config[_key(item)] = json.loads(item.value_json)
        elif which == "history":
            row = {_key(item): json.loads(item.value_json) for item in record.history.item}
            step = int(row["_step"])  # type: ignore[call-overload]
            history.setdefault(step, {}).update(row)
        elif which == "summary":
            for item in record.summary.update:
                summary[_key(item)] = json.loads(item.value_json)
        elif which == "exit":
            exit_code = record.exit.exit_code
    return WandbRun(
        run_id=run_id,
        history=history,
        config=config,
        summary=summary,
        tags=tags,
        resumed=resumed,
        exit_code=exit_code,
    )


def offline_run_files(wandb_dir: Path) -> list[Path]:
    """The ``run-<id>.wandb`` files under ``<WANDB_DIR>/wandb``, oldest first."""
    return sorted((wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"))
