"""The server backend of regenerate against a real local OpenAI-compatible server: concurrency,
retries, failures."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from testkit.regenerating import (
    Server,
    _conversations,
    _plan,
    _read,
    _recipe,
    _write_jsonl,
)

from dflash_recipes.errors import RegenerateError
from dflash_recipes.executor.regenerate.job import RegenerateSummary, run_regenerate
from dflash_recipes.plan.run_plan import RunPlan


def _run(plan: RunPlan, out: Path, backoff_base_s: float = 0.5) -> RegenerateSummary:
    return run_regenerate(
        plan, output_path=out, progress=False, echo=lambda _: None, backoff_base_s=backoff_base_s
    )


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


# ---------------------------------------------------------------------------------------------
# every request bounded: a deadline for the whole request, a bounded body
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("knob", ["trickle", "hang"])
@pytest.mark.timing
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
    # A trickled answer takes minutes, a hung one never comes: only the whole request's
    # deadline ends an attempt, and the run fails instead of waiting for the answer. Nothing
    # here is timed: a missing deadline shows as a run that answers (trickle) or never ends.
    server.control(**{knob: True})
    with pytest.raises(RegenerateError) as info:
        _run(plan, tmp_path / "out.jsonl", backoff_base_s=backoff)
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
