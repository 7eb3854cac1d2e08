"""What a recipe file's header says: the download step it gives for a model folder.

The shipped recipes start with comments showing the exact commands that use them, staging
included (``#   hf download Qwen/Qwen3-8B --local-dir /hf-local/Qwen/Qwen3-8B``): when the
folder a field names does not exist, compile's fix quotes the header's own step for that folder
instead of a generic one.
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash_recipes.checkpoint.model_paths import resolve_local_path
from dflash_recipes.files.jsonio import FileReadProblem, read_regular_file

#: A comment line holding `hf download REPO ... --local-dir DIR` (or huggingface-cli's).
_STEP = re.compile(
    r"^\s*#\s*(?P<command>(?:hf|huggingface-cli)\s+download\s+\S+.*?--local-dir[ =](?P<dir>\S+))",
    re.MULTILINE,
)
#: A recipe larger than this is not searched (the header is at the top).
_MAX_BYTES = 1 << 20


def header_download_step(recipe_file: Path, missing: Path, *, base_dir: Path | None) -> str | None:
    """The header's download command whose ``--local-dir`` (resolved against `base_dir`, the
    recipe's folder) is `missing`; None when there is none or the file cannot be read again."""
    try:
        text = read_regular_file(recipe_file, max_bytes=_MAX_BYTES).decode("utf-8", "replace")
    except FileReadProblem:
        return None
    for match in _STEP.finditer(text):
        if resolve_local_path(match["dir"], base_dir=base_dir) == missing:
            return " ".join(match["command"].split())
    return None


__all__ = ["header_download_step"]
