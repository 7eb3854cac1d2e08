"""The small collectives the ranks coordinate with: rank 0's text, every rank's text, the lowest
rank with a flag."""

from __future__ import annotations

import json
import sys

import pytest
from testkit.ranks import run_ranks

from dflash_recipes.executor.collectives import (
    GATHER_LIMIT,
    TEXT_LIMIT,
    broadcast_digest,
    broadcast_text,
    first_rank_where,
    gather_texts,
)
from dflash_recipes.executor.dist_env import detect_dist_env

pytestmark = pytest.mark.timing

_RANK = """
import json
from dflash_recipes.executor.collectives import (
    GATHER_LIMIT, TEXT_LIMIT, broadcast_digest, broadcast_text, first_rank_where, gather_texts,
)
from dflash_recipes.executor.dist_env import detect_dist_env, init_distributed, shutdown_distributed
env = detect_dist_env("cpu")
init_distributed(env)
mine = lambda text: text if env.rank == 0 else "not rank 0's"
out = {
    "plain": broadcast_text(mine("a path/.tmp-x"), env),
    "empty": broadcast_text(mine(""), env),
    "none": broadcast_text(None if env.rank == 0 else "not rank 0's", env),
    "wide": broadcast_text(mine("\u00e9" * TEXT_LIMIT), env),
    "digest": broadcast_digest(mine("ab" * 32), env),
    "not a digest": broadcast_digest(mine("ab"), env),
    "none set": first_rank_where(False, env),
    "rank 1 set": first_rank_where(env.rank == 1, env),
    "both set": first_rank_where(True, env),
    "gathered": gather_texts(f"rank {env.rank} \u00e9", env),
    "gathered long": gather_texts("x" * (GATHER_LIMIT + 10) if env.rank else "", env),
}
shutdown_distributed()
print(json.dumps(out))
"""


def test_rank_0s_text_and_the_lowest_flagged_rank_reach_every_rank() -> None:
    reports = []
    for rank in run_ranks([sys.executable, "-c", _RANK]):
        assert rank.returncode == 0, rank.stderr[-3000:]
        reports.append(json.loads(rank.stdout.strip().splitlines()[-1]))
    r0, r1 = reports
    assert r1["plain"] == r0["plain"] == "a path/.tmp-x"
    assert r1["empty"] == "" and r1["none"] is None
    # Cut to TEXT_LIMIT bytes on a character boundary (2 bytes each), never mid-character.
    assert r1["wide"] == "\u00e9" * (TEXT_LIMIT // 2)
    assert r1["digest"] == "ab" * 32 and r1["not a digest"] is None and r0["not a digest"] == "ab"
    for report in reports:
        assert (report["none set"], report["rank 1 set"], report["both set"]) == (None, 1, 0)
        # every rank's text in rank order, on every rank; a long one cut to GATHER_LIMIT bytes
        assert report["gathered"] == ["rank 0 \u00e9", "rank 1 \u00e9"]
        assert report["gathered long"] == ["", "x" * GATHER_LIMIT]


def test_a_single_process_keeps_its_own_values() -> None:
    env = detect_dist_env("cpu", {})
    assert broadcast_text("x", env) == "x" and broadcast_text(None, env) is None
    assert broadcast_digest("ab", env) == "ab"
    assert first_rank_where(True, env) == 0 and first_rank_where(False, env) is None
    assert gather_texts("x", env) == ["x"]
