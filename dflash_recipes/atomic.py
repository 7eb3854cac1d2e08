"""Writing a file so that readers see the old content or the whole new one, never a part."""

from __future__ import annotations

import os
from pathlib import Path


def temporary_sibling(path: Path) -> Path:
    """A hidden name next to `path`, unique to this process, to write into before renaming."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to path through a temporary sibling, so a failure leaves no partial file.

    Raises OSError (the folder cannot be created, or is not writable) with nothing left behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


__all__ = ["temporary_sibling", "write_text_atomic"]
