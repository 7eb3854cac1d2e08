"""tools/stress.py: pytest runs while the cores are kept busy, and the load never outlives it.

The load is watched through /proc (Linux, as CI and the tool's users run it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from stress import PIDS_ENV, main, run_under_load

pytestmark = pytest.mark.timing

TOOL = Path(__file__).resolve().parents[1] / "tools" / "stress.py"

#: A command that reports the load it ran under: each spinner's pid and whether it is busy.
_REPORT = """
import json, os, sys
pids = [int(p) for p in os.environ["DFLASH_STRESS_PIDS"].split(",") if p]
states = {}
for pid in pids:
    with open(f"/proc/{pid}/stat") as handle:
        states[pid] = handle.read().rsplit(")", 1)[1].split()[0]
with open(sys.argv[1], "a") as out:
    out.write(json.dumps({"pids": pids, "states": states, "me": os.getpid()}) + "\\n")
sys.exit(int(sys.argv[2]))
"""


def _alive(pid: int) -> bool:
    """Running or sleeping: not gone, and not a zombie waiting for a parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in "ZX"


def _gone(pids: list[int]) -> bool:
    # Reaped by the tool before it returned: nothing left to poll for.
    return not any(_alive(pid) for pid in pids)


def test_the_command_runs_beside_the_spinning_load_which_is_gone_afterwards(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report.jsonl"
    code = run_under_load([sys.executable, "-c", _REPORT, str(report), "0"], load=3, times=2)
    assert code == 0
    runs = [json.loads(line) for line in report.read_text().splitlines()]
    assert len(runs) == 2 and runs[0]["pids"] == runs[1]["pids"]  # one load for every run
    pids = runs[0]["pids"]
    assert len(pids) == 3 and os.getpid() not in pids
    assert all(state in "RSD" for state in runs[0]["states"].values())  # alive, not zombies
    assert _gone(pids)


def test_the_runs_stop_at_the_first_failure_and_its_status_is_returned(tmp_path: Path) -> None:
    report = tmp_path / "report.jsonl"
    code = run_under_load([sys.executable, "-c", _REPORT, str(report), "3"], load=1, times=3)
    assert code == 3
    runs = [json.loads(line) for line in report.read_text().splitlines()]
    assert len(runs) == 1
    assert _gone(runs[0]["pids"])


def test_pytest_gets_the_arguments_after_the_separator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    test_file = tmp_path / "test_one.py"
    test_file.write_text(
        f"import os\ndef test_load():\n    assert len(os.environ['{PIDS_ENV}'].split(',')) == 2\n",
        encoding="utf-8",
    )
    args = ["--", "-q", "-p", "no:cacheprovider", str(test_file)]
    assert main(["--load", "2", *args]) == 0
    assert "stress: run 1 of 1 under a load of 2 busy processes: exit status 0" in (
        capsys.readouterr().out
    )


def test_a_bad_option_is_refused() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--times", "0"])
    assert info.value.code == 2


def test_when_the_tool_is_killed_its_load_ends_too(tmp_path: Path) -> None:
    # Even SIGKILL, which no handler sees: each spinner watches its parent.
    report = tmp_path / "report.jsonl"
    hold = f"{_REPORT.replace('sys.exit(int(sys.argv[2]))', '')}\nimport time\ntime.sleep(600)"
    code = (
        "import sys\nsys.path.insert(0, sys.argv[1])\nfrom stress import run_under_load\n"
        "run_under_load([sys.executable, '-c', sys.argv[2], sys.argv[3], '0'], load=2)\n"
    )
    tool = subprocess.Popen([sys.executable, "-c", code, str(TOOL.parent), hold, str(report)])
    try:
        deadline = time.monotonic() + 120
        while not report.exists() or not report.read_text().endswith("\n"):
            assert tool.poll() is None and time.monotonic() < deadline, "no report"
            time.sleep(0.05)
        found = json.loads(report.read_text())
        pids = found["pids"]
        os.kill(found["me"], signal.SIGKILL)  # the command, orphaned by what follows
        os.kill(tool.pid, signal.SIGKILL)
        tool.wait()
        deadline = time.monotonic() + 120
        while not _gone(pids):  # orphans, reparented: they notice and end on their own
            assert time.monotonic() < deadline, f"the load outlived the tool: {pids}"
            time.sleep(0.05)
    finally:
        if tool.poll() is None:
            tool.kill()
            tool.wait()
