"""The tokenize-once cache: equal to fresh tokens, never stale, crash-safe, one build per job."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit.cache_data import cache_tokenizer, write_cache_data
from testkit.compiling import tiny_scratch_plan
from testkit.tiny import tiny_plan

from dflash_recipes.data.conversations import read_conversations
from dflash_recipes.data.sources import resolve_source
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.token_build import prepared_examples
from dflash_recipes.executor.data.token_cache import (
    LOCK_NAME,
    META_FILE,
    TokenizeSettings,
)
from dflash_recipes.executor.data.tokenize import tokenize_conversation
from dflash_recipes.executor.data.train_dataset import build_dataset
from dflash_recipes.executor.demo.tiny_tokenizer import TINY_CHAT_TEMPLATE
from dflash_recipes.executor.model.convert import load_tokenizer
from dflash_recipes.files.data_cache import default_data_cache_dir, folder_bytes, format_bytes
from dflash_recipes.files.locking import hold_directory_lock
from dflash_recipes.plan.run_plan import RunPlan


def _plan(tmp_path: Path, data: Path, **overrides: object) -> RunPlan:
    return tiny_plan(tmp_path, data_path=str(data), training_seq_len=64, **overrides)


def _cache_root() -> Path:
    """This test's tokenized-data cache (conftest gives each test its own)."""
    root = default_data_cache_dir()
    assert root is not None
    return root


def _cache_entries(plan: RunPlan) -> list[Path]:
    return sorted(p for p in _cache_root().iterdir() if p.is_dir())


def test_cached_examples_equal_freshly_tokenized_ones_and_a_rerun_reads_the_cache(
    tmp_path: Path,
) -> None:
    data = write_cache_data(tmp_path / "d.jsonl", 40)
    plan = _plan(tmp_path, data)
    first = build_dataset(plan, cache_tokenizer())
    fresh = [
        tokenize_conversation(
            cache_tokenizer(),
            c.messages,
            chat_template=TINY_CHAT_TEMPLATE,
            answer_only_loss=True,
            max_len=64,
        )
        for c in read_conversations(data).conversations
    ]
    assert [(e.input_ids, e.loss_mask, e.truncated) for e in first.examples] == [
        (e.input_ids, e.loss_mask, e.truncated) for e in fresh
    ]
    assert "used 40 conversations, skipped 1: 1 invalid JSON (line 2)" in first.summary
    source = resolve_source(data, setting="data.data_path")
    settings = TokenizeSettings(TINY_CHAT_TEMPLATE, True, 64, plan.draft.block_size)
    root = _cache_root()
    again, stats, built = prepared_examples(
        source, cache_tokenizer(), settings, cache_dir=root, num_proc=1
    )
    assert not built and stats == first.stats
    assert list(again) == list(first.examples)


def test_an_edit_that_keeps_size_and_mtime_is_tokenized_again(tmp_path: Path) -> None:
    data = write_cache_data(tmp_path / "d.jsonl", 10)
    plan = _plan(tmp_path, data)
    before = build_dataset(plan, cache_tokenizer()).examples[0]
    info = data.stat()
    data.write_bytes(data.read_bytes().replace(b"the capital", b"the computer", 1))
    data.write_bytes(data.read_bytes()[: info.st_size].ljust(info.st_size, b"\n"))
    os.utime(data, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert data.stat().st_size == info.st_size and data.stat().st_mtime_ns == info.st_mtime_ns
    after = build_dataset(plan, cache_tokenizer()).examples[0]
    assert after.input_ids != before.input_ids
    assert len(_cache_entries(plan)) == 2


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("ids", "input_ids.bin does not match its checksum"),
        ("meta", "meta.json cannot be read"),
        ("version", "written by another version of dflash-recipes"),
        ("tokenizer", "made with another tokenizer"),
    ],
)
def test_a_corrupt_or_foreign_cache_is_rebuilt_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, said: str
) -> None:
    data = write_cache_data(tmp_path / "d.jsonl", 10)
    plan = _plan(tmp_path, data)
    good = list(build_dataset(plan, cache_tokenizer()).examples)
    (entry,) = _cache_entries(plan)
    meta = json.loads((entry / META_FILE).read_text())
    if damage == "ids":
        raw = bytearray((entry / "input_ids.bin").read_bytes())
        raw[0] ^= 1
        (entry / "input_ids.bin").write_bytes(bytes(raw))
    elif damage == "meta":
        (entry / META_FILE).write_text('{"format": "dflash-tok')
    else:
        meta["key"]["version" if damage == "version" else "tokenizer_sha256"] = "other"
        (entry / META_FILE).write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        again = build_dataset(plan, cache_tokenizer())
    assert list(again.examples) == good
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and said in warnings[0] and "tokenizing" in warnings[0]
    assert _cache_entries(plan) == [entry]


def test_a_cache_cut_short_while_in_use_is_a_clear_error(tmp_path: Path) -> None:
    data = write_cache_data(tmp_path / "d.jsonl", 10)
    plan = _plan(tmp_path, data)
    dataset = build_dataset(plan, cache_tokenizer())
    assert dataset.examples[-1].input_ids  # read on access, from the entry's files
    (entry,) = _cache_entries(plan)
    ids = entry / "input_ids.bin"
    os.truncate(ids, ids.stat().st_size // 2)
    with pytest.raises(DataError, match=r"changed while in use .*delete that folder and rerun"):
        list(dataset.examples)


_BUILD = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from testkit.cache_data import cache_tokenizer
from dflash_recipes.data.sources import resolve_source
from dflash_recipes.executor.data import token_build
from dflash_recipes.executor.data.token_build import prepared_examples
if os.environ.get("HOLD_AT_CHUNK"):  # "3:/marker": the 3rd chunk waits, held, to be killed
    at, marker = os.environ["HOLD_AT_CHUNK"].split(":", 1)
    plain, calls = token_build.tokenize_chunk, []
    def holding(*args):
        calls.append(1)
        if len(calls) == int(at):
            Path(marker).touch()
            time.sleep(600)
        return plain(*args)
    token_build.tokenize_chunk = holding
from dflash_recipes.executor.data.token_cache import TokenizeSettings
from dflash_recipes.executor.demo.tiny_tokenizer import TINY_CHAT_TEMPLATE
source = resolve_source(Path(sys.argv[1]), setting="data.data_path")
settings = TokenizeSettings(TINY_CHAT_TEMPLATE, True, 64, 4)
print("ready", flush=True)
sys.stdin.readline()
examples, stats, built = prepared_examples(
    source, cache_tokenizer(), settings, cache_dir=Path(sys.argv[2]), num_proc=1,
    wait_s=float(sys.argv[3]),
)
print(json.dumps({"built": built, "n": len(examples), "first": examples[0].input_ids}))
"""


def _builder(
    data: Path, cache_dir: Path, wait_s: float = 120.0, **extra_env: str
) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra_env}
    argv = [sys.executable, "-c", _BUILD, str(data), str(cache_dir), str(wait_s)]
    proc = subprocess.Popen(
        [*argv, str(Path(__file__).parents[2])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


@pytest.mark.timing
def test_two_ranks_starting_together_tokenize_once(tmp_path: Path) -> None:
    data = write_cache_data(tmp_path / "d.jsonl", 3000)
    ranks = [_builder(data, tmp_path / "cache") for _ in range(2)]
    for proc in ranks:
        _go(proc)
    reports = []
    for proc in ranks:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["built"] for r in reports) == [False, True]
    assert reports[0]["n"] == reports[1]["n"] == 3000
    assert reports[0]["first"] == reports[1]["first"]


@pytest.mark.timing
def test_a_builder_killed_mid_build_leaves_nothing_trusted_and_a_rerun_builds(
    tmp_path: Path,
) -> None:
    data = write_cache_data(tmp_path / "d.jsonl", 6000)
    cache_dir, held = tmp_path / "cache", tmp_path / "held"
    proc = _builder(data, cache_dir, HOLD_AT_CHUNK=f"3:{held}")  # two chunks written
    _go(proc)
    deadline = time.monotonic() + 300
    while not held.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the build never got there"
        time.sleep(0.02)
    assert any(p.name.startswith(".tmp-") for p in cache_dir.glob(".*"))  # mid-build
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not [p for p in cache_dir.iterdir() if not p.name.startswith(".")]  # nothing published
    rerun = _builder(data, cache_dir)
    _go(rerun)
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["built"] is True
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.timing
def test_waiting_for_a_stuck_builder_ends_with_a_clear_error(tmp_path: Path) -> None:
    data = write_cache_data(tmp_path / "d.jsonl", 5)
    source = resolve_source(data, setting="data.data_path")
    settings = TokenizeSettings(TINY_CHAT_TEMPLATE, True, 64, 4)
    cache_dir = tmp_path / "cache"
    lock = hold_directory_lock(cache_dir, purpose="data tokenization", lock_name=LOCK_NAME)
    waited = pytest.raises(DataError, match=r"waited 0 s .*DFLASH_DATA_CACHE_WAIT_S")
    with lock, waited as info:
        prepared_examples(
            source, cache_tokenizer(), settings, cache_dir=cache_dir, num_proc=1, wait_s=0.3
        )
    assert "data tokenization (pid" in str(info.value)


def test_a_second_experiment_in_another_output_dir_reads_the_first_ones_tokens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # issue 36: the cache is per user (decided at compile, recorded in the plan), not per run
    plans = [tiny_scratch_plan(tmp_path / name) for name in ("first", "second")]
    assert {p.data.cache_dir for p in plans} == {str(_cache_root())}
    tokenizer = load_tokenizer(plans[0])
    with caplog.at_level(logging.INFO):
        first = build_dataset(plans[0], tokenizer)
        second = build_dataset(plans[1], tokenizer)
    entry = first.examples.directory  # type: ignore[attr-defined]
    assert second.examples.directory == entry  # type: ignore[attr-defined]
    assert entry.parent == _cache_root()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenized")]
    size = format_bytes(folder_bytes(entry))
    tail = "`dflash-recipe cache list` shows every entry, `dflash-recipe cache rm` removes them"
    assert said[0].startswith(f"tokenized {plans[0].data.data_path} into {entry}: ")
    assert said[1:] == [
        f"tokenized data: {entry} ({size}, new); {tail}",
        f"tokenized data: {entry} ({size}, reused); {tail}",
    ]
    assert not any(
        p.exists() and any(p.iterdir()) for p in (tmp_path / "first", tmp_path / "second")
    )
