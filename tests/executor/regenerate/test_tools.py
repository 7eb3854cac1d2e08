"""`regenerate` of whole tool conversations against the real local test server (issue 52): the
target answers each assistant turn in order, given its own earlier calls and the row's tool
results, with the row's `tools` in every request; thinking on, off or both; a killed run
resumes; and the output trains."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from testkit.regenerating import ROOT, Server, _plan, _read, _recipe, _write_jsonl
from testkit.tool_chat import WEATHER_TOOL

from dflash_recipes.executor.regenerate.job import run_regenerate

from .test_job import _wait_for_lines


def _tool_row(city: str) -> dict[str, Any]:
    """Three assistant turns: a call, the answer from the tool's result, a follow-up."""
    return {
        "tag": "tool",
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "orig_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": json.dumps({"city": city}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "orig_1", "content": f"{city}: sunny, 18 C"},
            {"role": "assistant", "content": "an answer from some other model"},
            {"role": "user", "content": "Thanks. What is the capital of it?"},
            {"role": "assistant", "content": "another answer from some other model"},
        ],
    }


def _requests(server: Server) -> list[dict[str, Any]]:
    data = httpx.get(f"{server.url}/requests").json()
    assert isinstance(data, list)
    return data


def test_a_three_turn_tool_conversation_is_answered_turn_by_turn(
    tmp_path: Path, server: Server
) -> None:
    server.control(tool_call_on="weather")
    data = _write_jsonl(tmp_path / "in.jsonl", [_tool_row("Paris")])
    out = tmp_path / "out.jsonl"
    recipe = _recipe(tmp_path, data, base_url=server.url, model="tiny-target")
    summary = run_regenerate(_plan(recipe), output_path=out, progress=False, echo=lambda _: None)
    assert (summary.answered, summary.turns, summary.diverged) == (1, 3, 0)

    first, second, third = _requests(server)
    assert all(r["tools"] == [WEATHER_TOOL] for r in (first, second, third))
    assert "chat_template_kwargs" not in first  # regenerate.thinking: template sends none
    assert [m["role"] for m in first["messages"]] == ["user"]
    # the second turn sees the target's own call and the row's result, under the call's id
    call_turn, result = second["messages"][1:]
    assert call_turn["tool_calls"][0]["id"] == "call_1"
    assert call_turn["tool_calls"][0]["function"]["name"] == "get_weather"
    assert result == {"role": "tool", "content": "Paris: sunny, 18 C", "tool_call_id": "call_1"}
    assert [m["role"] for m in third["messages"]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert third["messages"][3]["content"] != "an answer from some other model"

    (row,) = _read(out)
    assert row["tools"] == [WEATHER_TOOL] and row["tag"] == "tool"
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    call = row["messages"][1]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"query": "What is the weather in Paris?"}
    assert row["messages"][2]["tool_call_id"] == call["id"] == "call_1"
    assert "other model" not in json.dumps(row)


def test_a_target_that_calls_no_tool_ends_the_conversation_there(
    tmp_path: Path, server: Server
) -> None:
    data = _write_jsonl(tmp_path / "in.jsonl", [_tool_row("Oslo")])  # no tool_call_on: text
    out = tmp_path / "out.jsonl"
    recipe = _recipe(tmp_path, data, base_url=server.url, model="tiny-target")
    summary = run_regenerate(_plan(recipe), output_path=out, progress=False, echo=lambda _: None)
    assert (summary.answered, summary.turns, summary.diverged) == (1, 1, 1)
    (row,) = _read(out)
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert len(_requests(server)) == 1


def test_thinking_both_makes_a_row_with_and_one_without_reasoning(
    tmp_path: Path, server: Server
) -> None:
    server.control(tool_call_on="weather", reasoning=True)
    data = _write_jsonl(tmp_path / "in.jsonl", [_tool_row("Rome")])
    out = tmp_path / "out.jsonl"
    recipe = _recipe(
        tmp_path, data, base_url=server.url, model="tiny-target", thinking="both",
        reasoning="separate",
    )  # fmt: skip
    summary = run_regenerate(_plan(recipe), output_path=out, progress=False, echo=lambda _: None)
    assert summary.answered == 2
    switches = [r["chat_template_kwargs"]["enable_thinking"] for r in _requests(server)]
    assert sorted(switches) == [False] * 3 + [True] * 3
    rows = {row["thinking"]: row for row in _read(out)}
    on = [m for m in rows[True]["messages"] if m["role"] == "assistant"]
    off = [m for m in rows[False]["messages"] if m["role"] == "assistant"]
    assert all(m["reasoning_content"] == "the user wants a short answer" for m in on)
    assert all("reasoning_content" not in m for m in off)
    assert on[0]["tool_calls"] and off[0]["tool_calls"]


def test_a_killed_tool_run_resumes_and_its_output_trains(tmp_path: Path, server: Server) -> None:
    from dflash_recipes.executor.training.fit import run_plan

    cities = ["Paris", "Oslo", "Rome", "Lima", "Kyiv", "Oran"]
    data = _write_jsonl(tmp_path / "in.jsonl", [_tool_row(c) for c in cities])
    out = tmp_path / "out.jsonl"
    recipe = _recipe(tmp_path, data, base_url=server.url, model="tiny-target", max_concurrency=1)
    server.control(tool_call_on="weather", hang_after=6)  # two conversations, then it hangs
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "dflash_recipes.cli", "regenerate", str(recipe)]
    proc = subprocess.Popen(
        [*command, "--output", str(out), "--no-progress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    journal = tmp_path / "out.jsonl.parts" / "journal.jsonl"
    _wait_for_lines(journal, 2, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    assert journal.read_bytes().count(b"\n") == 2

    server.control(hang_after=-1)
    httpx.post(f"{server.url}/reset")
    summary = run_regenerate(_plan(recipe), output_path=out, progress=False, echo=lambda _: None)
    assert (summary.skipped, summary.answered) == (2, 4)
    assert len(_requests(server)) == 4 * 3  # only the rest, turn by turn
    rows = _read(out)
    assert sorted(r["messages"][0]["content"] for r in rows) == sorted(
        f"What is the weather in {c}?" for c in cities
    )

    plan = _plan(recipe, f"data.data_path={out}", "training.training_seq_len=512")
    trained = run_plan(plan, progress=False)
    assert trained.steps == 1


def test_the_local_backend_renders_the_tools_as_the_server_does(
    tmp_path: Path, server: Server
) -> None:
    """Both backends give the template the row's tools: the greedy first answers agree, and
    without a call parser the local backend's conversation ends at that answer."""
    data = _write_jsonl(tmp_path / "in.jsonl", [_tool_row("Lima")])
    remote = _recipe(tmp_path, data, base_url=server.url, model="tiny-target", thinking="off")
    local = _recipe(tmp_path, data, name="local.yaml", thinking="off")
    run_regenerate(_plan(remote), output_path=tmp_path / "r.jsonl", progress=False, echo=len)
    summary = run_regenerate(
        _plan(local), output_path=tmp_path / "l.jsonl", progress=False, echo=lambda _: None
    )
    assert (summary.answered, summary.turns, summary.diverged) == (1, 1, 1)
    (by_server,), (by_local,) = _read(tmp_path / "r.jsonl"), _read(tmp_path / "l.jsonl")
    assert by_local == by_server
    assert by_local["thinking"] is False and by_local["tools"] == [WEATHER_TOOL]
    (request,) = _requests(server)
    assert request["chat_template_kwargs"] == {"enable_thinking": False}
