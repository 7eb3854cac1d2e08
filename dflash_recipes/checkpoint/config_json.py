"""Reading a model directory's config.json as one strict JSON object (no torch).

The JSON rules are :func:`dflash_recipes.files.jsonio.parse_json`'s; what the fields mean is
:mod:`dflash_recipes.checkpoint.hfconfig`'s.
"""

from __future__ import annotations

from pathlib import Path

from dflash_recipes.errors import CheckpointError
from dflash_recipes.files.jsonio import read_json_object_file


def read_json_config(path: Path, *, max_bytes: int = 4 * 2**20) -> dict[str, object]:
    """Read a config.json strictly: at most `max_bytes`, UTF-8, a JSON object.

    Duplicate keys, NaN/Infinity and integers of more than 20 digits are rejected.
    Raises CheckpointError naming the file and the problem.
    """
    return read_json_object_file(path, max_bytes=max_bytes, what="config", error=CheckpointError)


__all__ = ["read_json_config"]
