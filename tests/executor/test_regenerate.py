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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai_test_server import DEFAULT_KNOBS

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.errors import DataError, DirectoryLockedError, RegenerateError
from dflash_recipes.executor.regenerate.job import RegenerateSummary, run_regenerate
from dflash_recipes.executor.regenerate.types import apply_reasoning
from dflash_recipes.files.locking import hold_directory_lock
from dflash_recipes.plan.run_plan import RunPlan

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "dflash_recipes" / "demo_data" / "target"
DOMAIN = ROOT / "dflash_recipes" / "demo_data" / "data" / "domain.jsonl"
SERVER = ROOT / "tools" / "openai_test_server.py"
_CLI = (sys.executable, "-m", "dflash_recipes.cli")


class Server:
    def __init__(self, url: str) -> None:
        self.url = url

    def control(self, **knobs: object) -> None:
        httpx.post(f"{self.url}/control", json=knobs).raise_for_status()

    def stats(self) -> dict[str, int]:
        data = httpx.get(f"{self.url}/stats").json()
        assert isinstance(data, dict)
        return data


@pytest.fixture(scope="module")
def server_process() -> Iterator[Server]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--model-dir", str(TARGET), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"the test server did not start: {line!r}"
        yield Server(f"http://127.0.0.1:{int(line.split()[1])}")
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def server(server_process: Server) -> Server:
    server_process.control(**DEFAULT_KNOBS)
    httpx.post(f"{server_process.url}/reset").raise_for_status()
    return server_process


def _conversations(n: int) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in DOMAIN.read_text().splitlines()[:n]]
    for row in rows:  # the original answers, which the target would not give
        row["messages"][1]["content"] = "an answer from some other model"
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recipe(tmp_path: Path, data: Path, *, name: str = "recipe.yaml", **regenerate: object) -> Path:
    lines = [f"    {k}: {json.dumps(v)}" for k, v in regenerate.items()]
    text = f"""
model: {{model_name_or_path: {TARGET}, dtype: float32}}
data: {{data_path: {data}}}
training:
  output_dir: {tmp_path / "run"}
  max_steps: 1
  per_device_train_batch_size: 2
  training_seq_len: 128
  device: cpu
  save_steps: 1
  logging_steps: 1
dflash:
  dflash_block_size: 4
  dflash_mask_token_id: 384
  dflash_num_anchors: 4
  dflash_architecture_config:
    num_hidden_layers: 1
    num_attention_heads: 4
    num_key_value_heads: 2
    head_dim: 32
    intermediate_size: 128
    target_layer_ids: [3]
regenerate:
    max_new_tokens: 48
{chr(10).join(lines)}
"""
    path = tmp_path / name
    path.write_text(text)
    return path


def _plan(recipe: Path, *overrides: str) -> RunPlan:
    result = compile_file(recipe, overrides)
    assert result.plan is not None, result.diagnostics
    return result.plan


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


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
    from dflash_recipes.executor.data.conversations import read_conversations

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


def test_requests_are_in_flight_at_once_up_to_max_concurrency(
    tmp_path: Path, server: Server
) -> None:
    server.control(latency_ms=400)
    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(13))
    plan = _plan(_recipe(tmp_path, data, base_url=server.url, max_concurrency=4))
    _run(plan, tmp_path / "out.jsonl")
    # the server saw 4 requests at once, never more (the probe goes alone, then 4 workers)
    assert server.stats()["max_in_flight"] == 4
    assert len(_read(tmp_path / "out.jsonl")) == 13


def test_503s_and_dropped_connections_are_retried(tmp_path: Path, server: Server) -> None:
    server.control(fail_503=3, drop=2)
    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(4))
    plan = _plan(_recipe(tmp_path, data, base_url=server.url, max_concurrency=2, max_retries=6))
    summary = _run(plan, tmp_path / "out.jsonl", backoff_base_s=0.01)
    assert summary.answered == 4 and summary.failed == 0
    assert server.stats()["requests"] == 4 + 3 + 2
    assert len(_read(tmp_path / "out.jsonl")) == 4


def test_a_request_failing_past_its_retries_is_recorded_and_the_run_goes_on(
    tmp_path: Path, server: Server
) -> None:
    rows = _conversations(4)
    server.control(fail_503_on=rows[2]["messages"][0]["content"])
    data = _write_jsonl(tmp_path / "in.jsonl", rows)
    plan = _plan(_recipe(tmp_path, data, base_url=server.url, max_concurrency=1, max_retries=2))
    summary = _run(plan, tmp_path / "out.jsonl", backoff_base_s=0.01)
    assert summary.answered == 3 and summary.failed == 1
    assert summary.failures == [
        {
            "line": 3,
            "reason": 'HTTP 503: {"error": {"message": "injected overload"}} (after 3 attempts)',
        }
    ]
    assert len(_read(tmp_path / "out.jsonl")) == 3
    # a rerun retries only the failed conversation
    server.control(fail_503_on="")
    httpx.post(f"{server.url}/reset")
    again = _run(plan, tmp_path / "out.jsonl")
    assert again.skipped == 3 and again.answered == 1
    assert server.stats()["requests"] == 1
    assert len(_read(tmp_path / "out.jsonl")) == 4


def test_a_4xx_on_the_first_request_stops_with_one_clear_error(
    tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(5))
    out = tmp_path / "out.jsonl"
    wrong_model = _plan(_recipe(tmp_path, data, base_url=server.url + "/v1", model="Qwen3-8B"))
    with pytest.raises(RegenerateError) as info:
        _run(wrong_model, out)
    message = str(info.value)
    assert f"{server.url}/v1/chat/completions refused the first request with HTTP 404" in message
    assert "The model `Qwen3-8B` does not exist" in message
    assert "check regenerate.model 'Qwen3-8B'" in message
    assert server.stats()["requests"] == 1  # nothing more was sent
    assert not out.exists() and not (tmp_path / "out.jsonl.summary.json").exists()

    monkeypatch.delenv("MY_KEY", raising=False)
    unset = _plan(_recipe(tmp_path, data, base_url=server.url, api_key_env="MY_KEY"))
    with pytest.raises(RegenerateError, match="names the environment variable MY_KEY, which is"):
        _run(unset, out)
    assert server.stats()["requests"] == 1  # refused before any request

    server.control(api_key="right")
    monkeypatch.setenv("MY_KEY", "wrong")
    bad_key = _plan(_recipe(tmp_path, data, base_url=server.url, api_key_env="MY_KEY"))
    with pytest.raises(
        RegenerateError, match=r"HTTP 401.*wants an API key: check the key in \$MY_KEY"
    ):
        _run(bad_key, out)
    monkeypatch.setenv("MY_KEY", "right")  # the key goes out as a bearer token
    assert _run(bad_key, tmp_path / "keyed.jsonl").answered == 5
    server.control(api_key="")

    server.control(status_4xx=0, not_json=True)
    with pytest.raises(RegenerateError, match=r"not with a chat completion \(the body is not JSON"):
        _run(_plan(_recipe(tmp_path, data, base_url=server.url)), out)


def test_an_unreachable_server_is_one_clear_error(tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(2))
    plan = _plan(_recipe(tmp_path, data, base_url="http://127.0.0.1:9/v1", model="m"))
    with pytest.raises(RegenerateError) as info:
        _run(plan, tmp_path / "out.jsonl")
    assert "cannot reach the generation server at http://127.0.0.1:9/v1/chat/completions" in str(
        info.value
    )
    assert "vllm serve" in str(info.value)


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


def test_apply_reasoning_policies() -> None:
    assert apply_reasoning("answer", "because", "keep") == "<think>\nbecause\n</think>\n\nanswer"
    assert apply_reasoning("answer", "because", "drop") == "answer"
    assert apply_reasoning("<think>a</think>\n\nb <think>c</think>d", None, "drop") == "b d"
    assert apply_reasoning("half a thought</think>answer", None, "drop") == "answer"
    assert apply_reasoning("answer <think>cut off", None, "drop") == "answer"


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


def test_a_killed_run_resumes_with_nothing_lost_and_nothing_duplicated(
    tmp_path: Path, server: Server
) -> None:
    rows = _conversations(12)
    data = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    recipe = _recipe(tmp_path, data, base_url=server.url, max_concurrency=2, model="tiny-target")
    server.control(latency_ms=200)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "dflash_recipes.cli", "regenerate", str(recipe)]
    proc = subprocess.Popen(
        [*command, "--output", str(out), "--no-progress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    journal = tmp_path / "out.jsonl.parts" / "journal.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if journal.is_file() and journal.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    kept = journal.read_bytes().count(b"\n")
    assert 3 <= kept < 12

    # rerun on the same input in another order: only the rest is sent
    server.control(latency_ms=0)
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
    from dflash_recipes.executor.training.trainer import run_plan

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


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_seals_the_journal_and_keeps_every_answer(
    tmp_path: Path, server: Server, signum: signal.Signals
) -> None:
    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(12))
    out = tmp_path / "out.jsonl"
    recipe = _recipe(tmp_path, data, base_url=server.url, max_concurrency=2, model="tiny-target")
    server.control(latency_ms=200)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [*_CLI, "regenerate", str(recipe), "--output", str(out), "--no-progress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    journal = tmp_path / "out.jsonl.parts" / "journal.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if journal.is_file() and journal.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum, err
    assert err.strip().splitlines()[-1] == (
        f"stopped by {signum.name}: every answered conversation is kept (the journal was "
        "sealed into the output's parts); rerun the same command to resume"
    )
    assert "Traceback" not in err
    sidecar = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert sidecar["interrupted"] is True and sidecar["answered"] >= 2
    # the journal was sealed into a part on the way out: a rerun finds every answer
    parts = sorted((tmp_path / "out.jsonl.parts").glob("part-*.jsonl"))
    assert sum(p.read_text().count("\n") for p in parts) == sidecar["answered"]
    assert not out.exists()


def test_local_backend_fails_only_the_conversation_too_long_for_the_target(
    tmp_path: Path,
) -> None:
    rows = _conversations(2)
    rows.insert(1, {"messages": [{"role": "user", "content": "give me " * 400}]})
    data = _write_jsonl(tmp_path / "in.jsonl", rows)
    summary = _run(_plan(_recipe(tmp_path, data)), tmp_path / "out.jsonl")
    assert (summary.answered, summary.failed) == (2, 1)
    assert summary.failures[0]["line"] == 2
    assert "prompt too long" in str(summary.failures[0]["reason"])
    assert "max_position_embeddings=512" in str(summary.failures[0]["reason"])
    assert summary.failure_reasons == {"prompt too long": 1}
    assert len(_read(tmp_path / "out.jsonl")) == 2


# ---------------------------------------------------------------------------------------------
# every request bounded: a deadline for the whole request, a bounded body
# ---------------------------------------------------------------------------------------------

#: What a run needs besides its requests (reading the data, the lock, the output folder).
_RUN_OVERHEAD_S = 3.0


@pytest.mark.parametrize("knob", ["trickle", "hang"])
def test_a_trickling_or_silent_server_is_cut_off_at_the_request_deadline(
    tmp_path: Path, server: Server, knob: str
) -> None:
    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(2))
    timeout, retries, backoff = 1.0, 1, 0.1
    plan = _plan(
        _recipe(
            tmp_path,
            data,
            base_url=server.url,
            model="tiny-target",
            request_timeout_s=timeout,
            max_retries=retries,
        )
    )
    server.control(**{knob: True})
    started = time.monotonic()
    with pytest.raises(RegenerateError) as info:
        _run(plan, tmp_path / "out.jsonl", backoff_base_s=backoff)
    elapsed = time.monotonic() - started
    # Each attempt ends at its deadline; the backoff between two is at most 1.5 x its base.
    assert elapsed < timeout * (retries + 1) + 1.5 * backoff + _RUN_OVERHEAD_S
    message = str(info.value)
    assert f"the first request to {server.url}/v1/chat/completions failed (2 attempts)" in message
    assert "no complete answer within request_timeout_s=1 (a deadline for the whole request)" in (
        message
    )
    assert server.stats()["requests"] == retries + 1


def test_a_body_longer_than_any_completion_is_refused_without_reading_it(
    tmp_path: Path, server: Server
) -> None:
    data = _write_jsonl(tmp_path / "in.jsonl", _conversations(2))
    plan = _plan(_recipe(tmp_path, data, base_url=server.url, model="tiny-target"))
    server.control(oversized=4 * 2**20)
    with pytest.raises(RegenerateError) as info:
        _run(plan, tmp_path / "out.jsonl")
    message = str(info.value)
    assert (
        f"{server.url}/v1/chat/completions answered with more than a chat completion of "
        "max_new_tokens=48 tokens can be"
    ) in message
    assert "at most 77824 bytes are read" in message
    assert server.stats()["requests"] == 1  # refused, not retried
