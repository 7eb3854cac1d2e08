"""The download step a recipe's header gives for a model folder that is missing.

The shipped recipes start with comments showing the exact commands that use them, staging
included (``#   hf download Qwen/Qwen3-8B --local-dir /hf-local/Qwen/Qwen3-8B``): when the
folder a field names does not exist, the fix quotes the header's own step for that folder
instead of a generic one.
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash_recipes.checkpoint.model_paths import CheckpointDirProblem, resolve_local_path
from dflash_recipes.compiler.state import CompileInputs
from dflash_recipes.files.jsonio import FileReadProblem, read_regular_file

#: A comment line holding `hf download REPO ... --local-dir DIR` (or huggingface-cli's).
_STEP = re.compile(
    r"^\s*#\s*(?P<command>(?:hf|huggingface-cli)\s+download\s+\S+.*?--local-dir[ =](?P<dir>\S+))",
    re.MULTILINE,
)
#: A recipe larger than this is not searched (the header is at the top).
_MAX_BYTES = 1 << 20


def header_download_step(inputs: CompileInputs, missing: Path) -> str | None:
    """The recipe header's download command whose ``--local-dir`` is `missing`, or None (no
    recipe file, no such comment, or the file cannot be read again)."""
    if inputs.recipe_file is None:
        return None
    try:
        text = read_regular_file(inputs.recipe_file, max_bytes=_MAX_BYTES).decode(
            "utf-8", "replace"
        )
    except FileReadProblem:
        return None
    for match in _STEP.finditer(text):
        if resolve_local_path(match["dir"], base_dir=inputs.base_dir) == missing:
            return " ".join(match["command"].split())
    return None


def staging_hint(inputs: CompileInputs, problem: CheckpointDirProblem) -> str:
    """`problem`'s fix, or for a folder that is missing or empty the recipe header's own
    download step for it (:func:`header_download_step`)."""
    if problem.kind in ("not-found", "empty-directory"):
        step = header_download_step(inputs, Path(problem.path))
        if step is not None:
            return f"stage it as the recipe's header says: {step}"
    return problem.hint


__all__ = ["header_download_step", "staging_hint"]
