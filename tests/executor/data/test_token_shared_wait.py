"""A rank waiting for rank 0's solitary work on the shared tokenized-data cache (hashing the
input, starting the build, merging the slices) stops past ``training.distributed_timeout_s``
with a message naming rank 0 and that work, not the backend's bare timeout (issue 51, "every
rank in step").

Each test runs two real gloo ranks (separate processes, as torchrun starts them) through
``build_dataset``, the plan giving the timeout; the process group itself keeps the backend's
default (30 minutes), so only the plan's timeout can end the wait early.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from testkit.cache_data import cache_tokenizer, write_cache_data
from testkit.ranks import run_ranks
from testkit.tiny import tiny_plan

pytestmark = pytest.mark.timing

#: How long rank 0's slowed work lasts at most when rank 1 never gives up (the rule deleted).
_SLOW_S = 30

_RANK = """
import json, os, sys, time
from pathlib import Path
import attrs
sys.path.insert(0, sys.argv[1])
from testkit.cache_data import cache_tokenizer
from testkit.tiny import tiny_plan
from dflash_recipes.executor.data import token_shared, train_dataset
from dflash_recipes.executor.dist_env import detect_dist_env, init_distributed
folder, slow, timeout_s, slow_s = Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
env = detect_dist_env("cpu")
init_distributed(env)  # the backend's default timeout: only the plan's may end a wait early
gave_up = folder / "rank-1-gave-up"
def slowly(work):  # rank 0's work, until rank 1 gave up waiting for it (at most slow_s)
    def run(*args, **kwargs):
        deadline = time.monotonic() + float(slow_s)
        while not gave_up.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return work(*args, **kwargs)
    return run
if env.rank == 0 and slow == "hash":
    train_dataset.content_sha256 = slowly(train_dataset.content_sha256)
if env.rank == 0 and slow == "start":
    token_shared._start_build = slowly(token_shared._start_build)
if env.rank == 0 and slow == "merge":
    token_shared.merged_results = slowly(token_shared.merged_results)
plan = tiny_plan(
    folder / "run", data_path=str(folder / "d.jsonl"), cache_dir=str(folder / "cache"),
    training_seq_len=64, num_proc=1,
)
plan = attrs.evolve(plan, training=attrs.evolve(plan.training, distributed_timeout_s=timeout_s))
began = time.monotonic()
try:
    dataset = train_dataset.build_dataset(plan, cache_tokenizer(), env=env)
    outcome = {"n": len(dataset), "ids": [list(e.input_ids) for e in dataset.examples]}
except Exception as exc:
    outcome = {"error": type(exc).__name__ + ": " + str(exc)}
    if env.rank == 1:
        gave_up.touch()
outcome["waited"] = time.monotonic() - began
print(json.dumps(outcome))
sys.stdout.flush()
os._exit(0)  # a rank whose partner left would wait for it in the group's shutdown
"""


def _ranks(folder: Path, slow: str, timeout_s: int) -> list[dict[str, object]]:
    here = str(Path(__file__).parents[2])  # tests/, for testkit
    argv = [sys.executable, "-c", _RANK, here, str(folder), slow, str(timeout_s), str(_SLOW_S)]
    reports = []
    for rank in run_ranks(argv, what=f"rank 0 slow to {slow}"):
        assert rank.returncode == 0, rank.stderr[-3000:]
        reports.append(json.loads(rank.stdout.strip().splitlines()[-1]))
    return reports


@pytest.mark.parametrize(
    ("slow", "work"),
    [
        ("hash", "hash the data {data} (the key of the tokenized-data cache)"),
        ("start", "start the build of the tokenized-data cache in {cache}"),
        ("merge", "merge the ranks' slices into the tokenized-data cache {cache}/"),
    ],
)
def test_a_rank_waiting_for_rank_0s_cache_work_stops_at_the_plans_timeout_naming_it(
    tmp_path: Path, slow: str, work: str
) -> None:
    data = write_cache_data(tmp_path / "d.jsonl", 300)
    rank1 = _ranks(tmp_path, slow, timeout_s=3)[1]
    error = str(rank1.get("error"))
    what = work.format(data=data, cache=tmp_path / "cache")
    assert error.startswith(f"RanksOutOfStepError: rank 1 stopped waiting for rank 0 to {what}"), (
        rank1
    )
    assert "(training.distributed_timeout_s: 3)" in error, error
    # Well before the backend's default (30 minutes) and before rank 0 came back (_SLOW_S).
    assert float(str(rank1["waited"])) < _SLOW_S - 10, rank1


def test_when_rank_0_is_in_time_the_ranks_build_the_cache_as_one_process_does(
    tmp_path: Path,
) -> None:
    from dflash_recipes.executor.data.train_dataset import build_dataset

    data = write_cache_data(tmp_path / "d.jsonl", 300)
    reports = _ranks(tmp_path, "none", timeout_s=3)
    alone = tiny_plan(
        tmp_path / "alone", data_path=str(data), cache_dir=str(tmp_path / "alone-cache"),
        training_seq_len=64, num_proc=1,
    )  # fmt: skip
    one = build_dataset(alone, cache_tokenizer())
    expected = [list(e.input_ids) for e in one.examples]
    for report in reports:
        assert "error" not in report, report
        assert report["n"] == len(one) and report["ids"] == expected
    shared = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    single = [p for p in (tmp_path / "alone-cache").iterdir() if p.is_dir()]
    assert len(shared) == len(single) == 1
    assert [p.name for p in shared] == [p.name for p in single]
    files = {p.name: p.read_bytes() for p in sorted(shared[0].iterdir())}
    assert files == {p.name: p.read_bytes() for p in sorted(single[0].iterdir())}
