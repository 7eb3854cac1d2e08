"""testkit.ranks.run_ranks: every rank's output arrives whole, whatever its size and order."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from testkit.ranks import run_ranks

pytestmark = pytest.mark.timing

#: Rank 1 writes a report far larger than a pipe holds (64 KiB) before rank 0 may end; rank 0
#: waits for rank 1's "written" file. Read through pipes one rank after the other, rank 1
#: would block on its full pipe while the test waits for rank 0: a hang, or a report cut short.
_RANK = """
import os, sys, time
from pathlib import Path
done = Path(sys.argv[1])
if os.environ["RANK"] == "1":
    print("x" * (1 << 20) + "|end")
    sys.stdout.flush()
    done.touch()
else:
    deadline = time.monotonic() + 120
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    print("rank 0 saw rank 1 done" if done.exists() else "rank 0 gave up")
    print("and wrote to stderr", file=sys.stderr)
"""


def test_a_report_larger_than_a_pipe_arrives_whole_while_another_rank_waits_for_it(
    tmp_path: Path,
) -> None:
    ranks = run_ranks([sys.executable, "-c", _RANK, str(tmp_path / "written")], timeout=240)
    assert [rank.returncode for rank in ranks] == [0, 0]
    assert ranks[0].stdout == "rank 0 saw rank 1 done\n"
    assert ranks[0].stderr == "and wrote to stderr\n"
    assert ranks[1].stdout == "x" * (1 << 20) + "|end\n"


def test_a_rank_that_hangs_fails_the_test_naming_what_hung() -> None:
    hang = [sys.executable, "-c", "import time; time.sleep(600)"]
    with pytest.raises(pytest.fail.Exception, match=r"^the hanging ranks hung for 1 s\nrank 0"):
        run_ranks(hang, timeout=1, what="the hanging ranks")
