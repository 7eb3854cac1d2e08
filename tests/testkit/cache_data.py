"""Conversations and a tokenizer for the tokenized-data cache's tests (and their rank scripts)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from dflash_recipes.executor.demo.tiny_tokenizer import build_tiny_tokenizer

CORPUS = ["the capital of france is paris", "why did the cat sit on the computer", "hello world"]
WORDS = "the capital of france is paris why did cat sit on computer hello world".split()  # noqa: SIM905


@cache
def cache_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer, trained on :data:`CORPUS` (once per process)."""
    return build_tiny_tokenizer(CORPUS)


def write_cache_data(path: Path, n: int, *, salt: int = 0) -> Path:
    """`n` two-turn conversations of :data:`WORDS` as JSONL, with a line that is not JSON as
    the second line (`salt` changes the questions)."""
    lines = []
    for i in range(n):
        q = " ".join(WORDS[(i + salt + k) % len(WORDS)] for k in range(3 + i % 5))
        a = " ".join(WORDS[(2 * i + k) % len(WORDS)] for k in range(6 + i % 7))
        turns = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        lines.append(json.dumps({"messages": turns}))
    lines.insert(1, "not json")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
