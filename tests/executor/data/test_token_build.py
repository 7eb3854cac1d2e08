"""Building a cache entry: several processes write exactly what one process writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_recipes.data.sources import resolve_source
from dflash_recipes.executor.data import token_build
from dflash_recipes.executor.data.token_build import prepared_examples
from dflash_recipes.executor.data.token_cache import ARRAYS, META_FILE, TokenizeSettings
from dflash_recipes.executor.demo.tiny_tokenizer import TINY_CHAT_TEMPLATE, build_tiny_tokenizer

WORDS = "the capital of france is paris why did cat sit on computer hello world".split()  # noqa: SIM905


def _write(path: Path, n: int) -> Path:
    rows = []
    for i in range(n):
        q = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + i % 4))
        a = " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(1 + i % 9))
        rows.append(
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_parallel_tokenization_is_byte_identical_to_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # small chunks and no inline limit, so 300 conversations really go through two processes
    monkeypatch.setattr(token_build, "CHUNK", 16)
    monkeypatch.setattr(token_build, "INLINE_LIMIT", 0)
    data = _write(tmp_path / "d.jsonl", 300)
    tokenizer = build_tiny_tokenizer(WORDS)
    source = resolve_source(data, setting="data.data_path")
    # short answers and long prompts open no block of 6 within 40 tokens: skipped in both
    settings = TokenizeSettings(TINY_CHAT_TEMPLATE, True, 40, 6)
    entries = {}
    for num_proc in (1, 2):
        _, stats, built = prepared_examples(
            source, tokenizer, settings, cache_dir=tmp_path / f"c{num_proc}", num_proc=num_proc
        )
        assert built and stats.skipped and stats.num_truncated
        (entry,) = (p for p in (tmp_path / f"c{num_proc}").iterdir() if p.is_dir())
        entries[num_proc] = {name: (entry / name).read_bytes() for name, _ in ARRAYS}
        entries[num_proc][META_FILE] = (entry / META_FILE).read_bytes()
    assert entries[1] == entries[2]
