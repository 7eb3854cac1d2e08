"""Under torchrun the ranks build the data cache together, each a slice, or fall back safely.

Each test runs two real gloo ranks (separate processes, as torchrun starts them).
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
from testkit.cache_data import cache_tokenizer, write_cache_data
from testkit.ranks import run_ranks

from dflash_recipes.data.sources import resolve_source
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.token_build import CHUNK, prepared_examples
from dflash_recipes.executor.data.token_cache import LOCK_NAME, TokenizeSettings
from dflash_recipes.executor.demo.tiny_tokenizer import TINY_CHAT_TEMPLATE
from dflash_recipes.files.locking import hold_directory_lock

pytestmark = pytest.mark.timing

SETTINGS = TokenizeSettings(TINY_CHAT_TEMPLATE, True, 64, 4)
#: A conversation whose answer opens no block of 4 tokens on supervised ones.
SHORT = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "x"}]}

_RANK = """
import io, json, logging, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from testkit.cache_data import cache_tokenizer
from dflash_recipes.data.sources import resolve_source
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data import token_build, token_shared
from dflash_recipes.executor.data.token_cache import TokenizeSettings
from dflash_recipes.executor.demo.tiny_tokenizer import TINY_CHAT_TEMPLATE
from dflash_recipes.executor.dist_env import (
    detect_dist_env, init_distributed, shutdown_distributed,
)
env = detect_dist_env("cpu")
init_distributed(env)
data, cache_dir, mode = sys.argv[2], sys.argv[3].replace("RANK", str(env.rank)), sys.argv[4]
tokenized = []
plain = token_build.tokenize_chunk
def counting(tokenizer, settings, chunk):  # every conversation this rank tokenizes
    tokenized.append(len(chunk))
    if mode == "slice-fails" and env.rank == 1:
        raise DataError("the tokenizer produced a token id outside int32 (rank 1's own error)")
    return plain(tokenizer, settings, chunk)
token_build.tokenize_chunk = counting
parsed = []
plain_parse = token_shared.conversation_of
def parsing(number, row, **kwargs):  # every row this rank parses
    parsed.append(number)
    return plain_parse(number, row, **kwargs)
token_shared.conversation_of = parsing
if mode == "say-when-waiting":  # tell the test when this rank waits for the lock, one-builder way
    plain_lock = token_build.hold_directory_lock
    def saying(directory, **kwargs):
        Path(directory).parent.joinpath(f"waiting-{env.rank}").touch()
        return plain_lock(directory, **kwargs)
    token_build.hold_directory_lock = saying
log = io.StringIO()
logging.getLogger("dflash_recipes").addHandler(logging.StreamHandler(log))
source = resolve_source(Path(data), setting="data.data_path")
settings = TokenizeSettings(TINY_CHAT_TEMPLATE, True, 64, 4)
try:
    examples, stats, built = token_shared.shared_prepared_examples(
        source, cache_tokenizer(), settings, cache_dir=Path(cache_dir), num_proc=2, env=env,
        data_sha256=None,
    )
    result = {
        "built": built, "tokenized": sum(tokenized), "parsed": len(parsed), "n": len(examples),
        "ids": [examples[i].input_ids for i in range(len(examples))],
        "skipped": [[s.line, s.kind, s.reason] for s in stats.skipped],
        "log": log.getvalue(),
    }
except DataError as exc:
    result = {"error": str(exc)}
shutdown_distributed()
print(json.dumps(result))
"""


def _ranks(data: Path, cache_dir: str, mode: str = "plain", **env: str) -> list[dict[str, object]]:
    here = str(Path(__file__).parents[2])  # tests/, for testkit
    reports = []
    for rank in run_ranks([sys.executable, "-c", _RANK, here, str(data), cache_dir, mode], env=env):
        assert rank.returncode == 0, rank.stderr[-3000:]
        reports.append(json.loads(rank.stdout.strip().splitlines()[-1]))
    return reports


def _data(tmp_path: Path, n: int = 4 * CHUNK - 24) -> Path:
    """`n` conversations (and a line that is not JSON) plus four that open no block, spread
    over the blocks of rows so that both ranks' slices skip some."""
    path = write_cache_data(tmp_path / "d.jsonl", n)
    lines = path.read_text(encoding="utf-8").splitlines()
    short = json.dumps(SHORT)
    for at in (10, CHUNK + 30, 2 * CHUNK + 50, 3 * CHUNK + 70):
        lines.insert(at, short)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _files(entry: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(entry.iterdir())}


def _only_entry(cache_dir: Path) -> Path:
    entries = [p for p in cache_dir.iterdir() if p.is_dir()]
    assert len(entries) == 1, [p.name for p in cache_dir.iterdir()]
    return entries[0]


def test_two_ranks_each_tokenize_a_slice_of_one_entry_equal_to_one_process(tmp_path: Path) -> None:
    data = _data(tmp_path)
    source = resolve_source(data, setting="data.data_path")
    one, stats, _ = prepared_examples(
        source, cache_tokenizer(), SETTINGS, cache_dir=tmp_path / "one", num_proc=1
    )
    reports = _ranks(data, str(tmp_path / "shared"))

    assert [r["built"] for r in reports] == [True, False]  # rank 0 publishes, once
    rows = 4 * CHUNK - 24 + 1 + 4  # conversations, the line that is not JSON, four short ones
    blocks = [min(CHUNK, rows - start) for start in range(0, rows, CHUNK)]
    mine = [sum(blocks[rank::2]) for rank in range(2)]  # blocks of rows 0, 2 and 1, 3
    assert [r["parsed"] for r in reports] == mine == [2 * CHUNK, rows - 2 * CHUNK]
    # Rank 0's rows hold the line that is not JSON (row 2): skipped while reading.
    assert [r["tokenized"] for r in reports] == [mine[0] - 1, mine[1]]
    # The same entry, byte for byte, as one process writes; every rank reads all of it.
    assert _files(_only_entry(tmp_path / "shared")) == _files(_only_entry(tmp_path / "one"))
    expected_ids = [list(one[i].input_ids) for i in range(len(one))]
    for report in reports:
        assert report["n"] == len(one) == rows - 1 - 4
        assert report["ids"] == expected_ids
        assert report["skipped"] == [[s.line, s.kind, s.reason] for s in stats.skipped]
    assert [s.kind for s in stats.skipped].count("nothing to supervise") == 4
    assert not [p for p in (tmp_path / "shared").iterdir() if p.name.startswith(".tmp-")]


def test_a_second_start_reads_the_entry_and_a_corrupt_one_is_rebuilt_with_a_warning(
    tmp_path: Path,
) -> None:
    data = _data(tmp_path, n=300)
    first = _ranks(data, str(tmp_path / "shared"))
    again = _ranks(data, str(tmp_path / "shared"))
    assert [(r["built"], r["tokenized"]) for r in again] == [(False, 0), (False, 0)]
    assert again[0]["ids"] == again[1]["ids"] == first[0]["ids"]
    entry = _only_entry(tmp_path / "shared")
    ids = entry / "input_ids.bin"
    ids.write_bytes(bytes(len(ids.read_bytes())))  # same size, other tokens
    third = _ranks(data, str(tmp_path / "shared"), "log")
    assert [(r["built"], r["tokenized"]) for r in third] == [
        (True, CHUNK - 1),
        (False, 305 - CHUNK),
    ]
    assert third[0]["ids"] == third[1]["ids"] == first[0]["ids"]
    assert f"data cache {entry} is not used" in str(third[0]["log"])
    assert _only_entry(tmp_path / "shared") == entry


def test_slices_that_do_not_fit_together_are_refused(tmp_path: Path) -> None:
    from dflash_recipes.data.conversations import Conversation, Message
    from dflash_recipes.executor.data.token_build import tokenize_chunk
    from dflash_recipes.executor.data.token_shared import merged_results, write_part

    turns = (Message("user", "hello"), Message("assistant", "paris is the capital"))
    chunk = [Conversation(i, turns) for i in range(3)]
    result = tokenize_chunk(cache_tokenizer(), SETTINGS, chunk)
    write_part(tmp_path / "part-0", [result, result])
    write_part(tmp_path / "part-1", [result])
    merged = list(merged_results(tmp_path, 2, []))
    assert [len(r.lengths) for r in merged] == [3, 3, 3]
    ids = tmp_path / "part-1" / "input_ids.bin"
    ids.write_bytes(ids.read_bytes()[:-4])
    with pytest.raises(DataError, match=r"^the tokenized slice .*part-1 is cut short; rerun"):
        list(merged_results(tmp_path, 2, []))
    shutil.rmtree(tmp_path / "part-1")
    write_part(tmp_path / "part-1", [result, result, result])  # more than its turn allows
    with pytest.raises(DataError, match=r"^the tokenized slices in .* do not fit together"):
        list(merged_results(tmp_path, 2, []))


def test_ranks_that_do_not_share_the_cache_folder_each_build_their_own(tmp_path: Path) -> None:
    # A cache folder on each node's own disk: rank 1 cannot see rank 0's staging folder.
    data = _data(tmp_path, n=300)
    reports = _ranks(data, str(tmp_path / "node-RANK"))
    assert [r.get("built") for r in reports] == [True, True], reports
    assert [r["tokenized"] for r in reports] == [304, 304]  # each all of it, once
    entries = [_only_entry(tmp_path / f"node-{rank}") for rank in range(2)]
    assert _files(entries[0]) == _files(entries[1])
    # One node's disk was wiped: its rank builds again, the other keeps its entry as it is.
    shutil.rmtree(tmp_path / "node-1")
    again = _ranks(data, str(tmp_path / "node-RANK"), "log")
    assert [(r["built"], r["tokenized"]) for r in again] == [(False, 0), (True, 304)]
    assert again[0]["log"] == "" and again[0]["ids"] == again[1]["ids"]


def test_a_slice_that_fails_stops_every_rank_and_leaves_nothing(tmp_path: Path) -> None:
    data = _data(tmp_path)
    reports = _ranks(data, str(tmp_path / "run" / "cache"), "slice-fails")
    assert reports[1]["error"] == (
        "the tokenizer produced a token id outside int32 (rank 1's own error)"
    )
    assert reports[0]["error"] == (
        f"rank 1 could not tokenize its slice of {data}; its error, in its output, says why"
    )
    assert not (tmp_path / "run").exists()  # the folders the build created are gone too


def test_no_usable_conversation_is_the_same_error_on_every_rank(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(SHORT) + "\n", encoding="utf-8")
    reports = _ranks(data, str(tmp_path / "run" / "cache"))
    errors = [str(r["error"]) for r in reports]
    assert errors[0] == errors[1]
    assert "no usable conversation" in errors[0] and "nothing to supervise" in errors[0]
    assert not (tmp_path / "run").exists()


def test_while_another_job_holds_the_cache_every_rank_waits_on_the_lock(tmp_path: Path) -> None:
    # Rank 0 does not wait for the lock inside a collective (whose time limit would end the job
    # with a bare gloo error): every rank waits the one-builder way, with its clear error.
    data = _data(tmp_path, n=300)
    cache_dir = tmp_path / "cache"
    with hold_directory_lock(cache_dir, purpose="data tokenization", lock_name=LOCK_NAME):
        reports = _ranks(data, str(cache_dir), DFLASH_DATA_CACHE_WAIT_S="0.5")
    for report in reports:
        assert str(report["error"]).startswith(
            f"waited 0 s for the tokenized data cache in {cache_dir}"
        )
        assert "data tokenization (pid" in str(report["error"])


def test_when_the_other_job_is_done_one_rank_builds_and_the_other_reads(tmp_path: Path) -> None:
    data = _data(tmp_path, n=300)
    cache_dir = tmp_path / "cache"
    lock = hold_directory_lock(cache_dir, purpose="data tokenization", lock_name=LOCK_NAME)
    lock.__enter__()
    waiting = [tmp_path / f"waiting-{rank}" for rank in range(2)]

    def release_once_both_wait() -> None:
        # The lock goes only when both ranks wait for it, however long they take to start
        # (a release before that lets rank 0 take the lock itself and build in slices, as it
        # should). The deadline only keeps a broken run from holding the test forever.
        deadline = time.monotonic() + 300
        while not all(path.exists() for path in waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        lock.__exit__(None, None, None)

    releaser = threading.Thread(target=release_once_both_wait)
    releaser.start()
    try:
        reports = _ranks(data, str(cache_dir), "say-when-waiting", DFLASH_DATA_CACHE_WAIT_S="600")
    finally:
        releaser.join()
    assert all(path.exists() for path in waiting), reports  # both fell back to waiting
    # Both waited on the lock; the first to take it built everything, the other read it.
    assert sorted((r["built"], r["tokenized"]) for r in reports) == [(False, 0), (True, 304)]
    assert reports[0]["ids"] == reports[1]["ids"]


@pytest.mark.parametrize("local_world_size", ["", "1", "2", "x"])
def test_each_rank_uses_its_share_of_the_node_processes(
    monkeypatch: pytest.MonkeyPatch, local_world_size: str
) -> None:
    from dflash_recipes.executor.data.token_shared import ranks_on_this_node
    from dflash_recipes.executor.dist_env import detect_dist_env

    env = detect_dist_env(
        "cpu", {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                "MASTER_PORT": "1"},
    )  # fmt: skip
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    expected = {"": 4, "1": 1, "2": 2, "x": 4}[local_world_size]
    assert ranks_on_this_node(env) == expected
