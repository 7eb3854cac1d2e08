"""Where `regenerate` keeps its work beside its output file, and how it names a conversation.

``OUTPUT.parts/`` holds the journal and the sealed shards, ``OUTPUT.summary.json`` the summary;
:func:`prompt_key` is the content hash a rerun resumes by. No torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

#: Suffixes of the files that belong to an output (shards folder, summary sidecar).
PARTS_SUFFIX = ".parts"


SUMMARY_SUFFIX = ".summary.json"


def parts_dir(output: Path) -> Path:
    """The folder of `output`'s shards (and its lock)."""
    return output.with_name(output.name + PARTS_SUFFIX)


def summary_path(output: Path) -> Path:
    """The JSON sidecar with `output`'s summary."""
    return output.with_name(output.name + SUMMARY_SUFFIX)


def prompt_key(
    turns: Sequence[tuple[str, str | None]],
    *,
    tools: str | None = None,
    thinking: bool | None = None,
) -> str:
    """Content hash of a conversation's prompt turns: (role, content) pairs, where assistant
    turns (the part regenerate replaces) are given with content None, with the row's `tools`
    (JSON text) and the thinking switch sent, when there are any.

    The same prompts give the same key in any file order, so a reordered input still resumes.
    A conversation without tools or a thinking switch keeps the key it always had.
    """
    payload: list[object] = [[role, content] for role, content in turns]
    if tools is not None or thinking is not None:
        payload = [payload, tools, thinking]
    canonical = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
