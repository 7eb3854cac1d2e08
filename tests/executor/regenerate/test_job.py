"""`dflash-recipe regenerate` against a real OpenAI-compatible server started by the test.

The server (tools/openai_test_server.py) runs in a subprocess on a free port and answers
greedily with the embedded tiny demo target; knobs inject latency, 503s, dropped connections,
4xx answers and reasoning output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from testkit.regenerating import (
    ROOT,
    Server,
    _conversations,
    _plan,
    _read,
    _recipe,
    _write_jsonl,
)

from dflash_recipes.errors import DataError, DirectoryLockedError, RegenerateError
from dflash_recipes.executor.regenerate.job import RegenerateSummary, run_regenerate
from dflash_recipes.files.locking import hold_directory_lock
from dflash_recipes.plan.run_plan import RunPlan

_CLI = (sys.executable, "-m", "dflash_recipes.cli")


def _wait_for_lines(journal: Path, count: int, proc: subprocess.Popen[Any]) -> None:
    """Wait until `journal` holds `count` lines (a generous deadline: it only catches a run
    that never gets there)."""
    deadline = time.monotonic() + 300
    while not (journal.is_file() and journal.read_bytes().count(b"\n") >= count):
        assert proc.poll() is None, f"the run ended before {count} answers"
        assert time.monotonic() < deadline, f"no {count} answers in {journal}"
        time.sleep(0.05)


def _assistant(row: dict[str, Any]) -> list[str]:
    return [m["content"] for m in row["messages"] if m["role"] == "assistant"]


def _run(plan: RunPlan, out: Path, backoff_base_s: float = 0.5) -> RegenerateSummary:
    return run_regenerate(
        plan, output_path=out, progress=False, echo=lambda _: None, backoff_base_s=backoff_base_s
    )


def test_server_and_local_backends_answer_turn_by_turn_with_the_targets_own_answers(
    tmp_path: Path, server: Server
) -> None:
    rows = _conversations(3)
    rows.append(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "give me a travel note for dorne."},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "describe the flag and trade of dorne."},
                {"role": "assistant", "content": "y"},
            ]
        }
    )
    rows.append({"conversations": [{"from": "human", "value": "give me a travel note for dorne."}]})
    data = _write_jsonl(tmp_path / "in.jsonl", rows)
    remote = _plan(_recipe(tmp_path, data, base_url=server.url + "/v1", max_concurrency=4))
    local = _plan(_recipe(tmp_path, data, name="local.yaml"))

    summary = _run(remote, tmp_path / "remote.jsonl")
    _run(local, tmp_path / "local.jsonl")

    got = _read(tmp_path / "remote.jsonl")
    assert len(got) == 5 and summary.answered == 5 and summary.failed == 0
    # 3 single-turn + 2 turns + 1 appended answer to a prompt-only ShareGPT line
    assert server.stats()["requests"] == 6
    multi = next(r for r in got if len(r["messages"]) == 5)
    assert [m["role"] for m in multi["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert multi["messages"][0]["content"] == "be brief"
    answers = [a for row in got for a in _assistant(row)]
    assert all(a and a not in ("x", "y", "an answer from some other model") for a in answers)
    assert any("travel note: dorne" in a for a in answers)  # the tiny target's own answer
    # greedy server answers equal greedy local answers, conversation by conversation
    by_prompt = {json.dumps(r["messages"][:2]): r for r in _read(tmp_path / "local.jsonl")}
    for row in got:
        assert by_prompt[json.dumps(row["messages"][:2])] == row
    # the output is ordinary training data: the reader takes every line
    from dflash_recipes.data.conversations import read_conversations

    assert len(read_conversations(tmp_path / "remote.jsonl").conversations) == 5
    sidecar = json.loads((tmp_path / "remote.jsonl.summary.json").read_text())
    assert sidecar["answered"] == 5 and sidecar["turns"] == 6 and sidecar["tokens_generated"] > 0


def test_first_turn_only_keeps_the_conversation_up_to_its_first_answer(tmp_path: Path) -> None:
    row = {
        "messages": [
            {"role": "user", "content": "give me a travel note for dorne."},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "and the flag?"},
            {"role": "assistant", "content": "y"},
        ]
    }
    data = _write_jsonl(tmp_path / "in.jsonl", [row])
    _run(_plan(_recipe(tmp_path, data, first_turn_only=True)), tmp_path / "out.jsonl")
    (got,) = _read(tmp_path / "out.jsonl")
    assert [m["role"] for m in got["messages"]] == ["user", "assistant"]


def test_reasoning_drop_removes_the_thinking_and_keep_keeps_it(
    tmp_path: Path, server: Server
) -> None:
    server.control(reasoning=True)
    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(2))
    for policy in ("drop", "keep"):
        plan = _plan(_recipe(tmp_path, data, base_url=server.url, reasoning=policy))
        _run(plan, tmp_path / f"{policy}.jsonl")
    dropped = [a for row in _read(tmp_path / "drop.jsonl") for a in _assistant(row)]
    kept = [a for row in _read(tmp_path / "keep.jsonl") for a in _assistant(row)]
    assert all(a and "think" not in a for a in dropped)
    assert all(a.startswith("<think>let me think</think>") for a in kept)
    assert [k.split("</think>", 1)[1].strip() for k in kept] == dropped


def test_bad_input_lines_are_reported_by_line_number(tmp_path: Path) -> None:
    good = json.dumps(_conversations(1)[0])
    data = tmp_path / "in.jsonl"
    data.write_text(
        good + "\n{not json\n" + '{"messages": [{"role": "bot", "content": "x"}]}\n' + good + "\n"
    )
    lines: list[str] = []
    summary = run_regenerate(
        _plan(_recipe(tmp_path, data)),
        output_path=tmp_path / "out.jsonl",
        progress=False,
        echo=lines.append,
    )
    assert lines[0] == (
        f"{data}: used 2 conversations, skipped 2: 1 invalid JSON (line 2), 1 bad role (line 3)"
    )
    assert [b["line"] for b in summary.bad_lines] == [2, 3]
    assert "messages[0] has role 'bot'" in str(summary.bad_lines[1]["reason"])
    # two identical prompts are two conversations: both are answered, neither is lost
    assert len(_read(tmp_path / "out.jsonl")) == 2

    empty = tmp_path / "bad.jsonl"
    empty.write_text("{not json\n")
    with pytest.raises(DataError, match=r"line 1: invalid JSON"):
        _run(_plan(_recipe(tmp_path, empty, name="r2.yaml")), tmp_path / "o2.jsonl")


def test_the_output_must_not_be_the_input_and_is_locked(tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(1))
    plan = _plan(_recipe(tmp_path, data))
    with pytest.raises(RegenerateError, match="is the input file itself"):
        _run(plan, data)
    out = tmp_path / "out.jsonl"
    with (
        hold_directory_lock(tmp_path / "out.jsonl.parts", purpose="regenerate"),
        pytest.raises(DirectoryLockedError, match="in use by another regenerate"),
    ):
        _run(plan, out)
    assert not out.exists()


@pytest.mark.timing
def test_a_killed_run_resumes_with_nothing_lost_and_nothing_duplicated(
    tmp_path: Path, server: Server
) -> None:
    rows = _conversations(12)
    data = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    recipe = _recipe(tmp_path, data, base_url=server.url, max_concurrency=2, model="tiny-target")
    server.control(hang_after=4)  # four answers, then the run waits: killed mid-job, any load
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "dflash_recipes.cli", "regenerate", str(recipe)]
    proc = subprocess.Popen(
        [*command, "--output", str(out), "--no-progress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    journal = tmp_path / "out.jsonl.parts" / "journal.jsonl"
    _wait_for_lines(journal, 4, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    kept = journal.read_bytes().count(b"\n")
    assert kept == 4

    # rerun on the same input in another order: only the rest is sent
    server.control(hang_after=-1)
    httpx.post(f"{server.url}/reset")
    _write_jsonl(data, list(reversed(rows)))
    lines: list[str] = []
    summary = run_regenerate(_plan(recipe), output_path=out, progress=False, echo=lines.append)
    assert f"resuming: {kept} conversation(s) already answered in {out}.parts" in lines
    assert server.stats()["requests"] == 12 - kept
    got = _read(out)
    prompts = sorted(r["messages"][0]["content"] for r in got)
    assert prompts == sorted(r["messages"][0]["content"] for r in rows)
    sidecar = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert sidecar["skipped"] == kept == summary.skipped
    assert sidecar["answered"] == 12 - kept and sidecar["written"] == 12


def test_regenerated_data_trains_with_run(tmp_path: Path) -> None:
    from dflash_recipes.executor.training.fit import run_plan

    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(4))
    recipe = _recipe(tmp_path, data, output_path=str(tmp_path / "regen.jsonl"))
    _run(_plan(recipe), tmp_path / "regen.jsonl")
    plan = _plan(recipe, f"data.data_path={tmp_path / 'regen.jsonl'}")
    summary = run_plan(plan, progress=False)
    assert summary.steps == 1


def test_the_cli_command_reads_input_and_output_from_options(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from dflash_recipes.cli import main

    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(2))
    prompts = _write_jsonl(tmp_path / "prompts.jsonl", _conversations(3)[2:])
    recipe = _recipe(tmp_path, data)
    runner = CliRunner()
    missing = runner.invoke(main, ["regenerate", str(recipe), "--no-progress"])
    assert missing.exit_code == 1
    assert "error: no output: set regenerate.output_path in the recipe, or pass --output" in (
        missing.output
    )
    out = tmp_path / "out.jsonl"
    args = ["regenerate", str(recipe), "--input", str(prompts), "--output", str(out)]
    done = runner.invoke(main, [*args, "--no-progress"])
    assert done.exit_code == 0, done.output
    assert f"wrote 1 conversation(s) to {out}" in done.output
    assert len(_read(out)) == 1


@pytest.mark.parametrize("kind", ["folder", "save_to_disk"])
def test_the_cli_command_takes_a_folder_or_a_save_to_disk_input(tmp_path: Path, kind: str) -> None:
    # issue 36: --input reads every training-data format, as the library and CHANGELOG promise
    import datasets
    from click.testing import CliRunner

    from dflash_recipes.cli import main

    rows = _conversations(3)
    folder = tmp_path / "prompts"
    if kind == "folder":
        folder.mkdir()
        _write_jsonl(folder / "part-0.jsonl", rows[:2])
        _write_jsonl(folder / "part-1.jsonl", rows[2:])
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    recipe = _recipe(tmp_path, _write_jsonl(tmp_path / "in.jsonl", _conversations(1)))
    out = tmp_path / "out.jsonl"
    args = ["regenerate", str(recipe), "--input", str(folder), "--output", str(out)]
    done = CliRunner().invoke(main, [*args, "--no-progress"])
    assert done.exit_code == 0, done.output
    assert f"wrote 3 conversation(s) to {out}" in done.output
    users = [[m["content"] for m in row["messages"] if m["role"] == "user"] for row in _read(out)]
    expected = [[m["content"] for m in row["messages"] if m["role"] == "user"] for row in rows]
    assert users == expected


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_seals_the_journal_and_keeps_every_answer(
    tmp_path: Path, server: Server, signum: signal.Signals
) -> None:
    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(12))
    out = tmp_path / "out.jsonl"
    recipe = _recipe(tmp_path, data, base_url=server.url, max_concurrency=2, model="tiny-target")
    server.control(hang_after=2)  # two answers, then the run waits: the signal lands mid-job
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [*_CLI, "regenerate", str(recipe), "--output", str(out), "--no-progress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_lines(tmp_path / "out.jsonl.parts" / "journal.jsonl", 2, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, err
    assert err.strip().splitlines()[-1] == (
        f"stopped by {signum.name}: every answered conversation is kept (the journal was "
        "sealed into the output's parts); rerun the same command to resume"
    )
    assert "Traceback" not in err
    sidecar = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert sidecar["interrupted"] is True and sidecar["answered"] == 2
    # the journal was sealed into a part on the way out: a rerun finds every answer
    parts = sorted((tmp_path / "out.jsonl.parts").glob("part-*.jsonl"))
    assert sum(p.read_text().count("\n") for p in parts) == sidecar["answered"]
    assert not out.exists()


_NO_TORCH = """
import json, sys
from pathlib import Path
from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.executor.regenerate.job import run_regenerate

plan = compile_file(sys.argv[1]).plan
summary = run_regenerate(plan, output_path=Path(sys.argv[2]), progress=False, echo=lambda _: None)
heavy = sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules)
print(json.dumps({"answered": summary.answered, "heavy": heavy}))
"""


def test_regenerate_against_a_server_imports_neither_torch_nor_transformers(
    tmp_path: Path, server: Server
) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    rows = _conversations(3)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")  # a Parquet input too
    recipe = _recipe(tmp_path, tmp_path / "in.parquet", base_url=server.url + "/v1")
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(recipe), str(tmp_path / "out.jsonl")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"answered": 3, "heavy": []}
