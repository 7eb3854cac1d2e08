"""The target-server client against real local servers that answer as vLLM does: the states
equal the in-process target's, every failure says what happened, nothing is left behind."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from testkit.vllm_server import (
    SavedTarget,
    ServerPair,
    SettingsFactory,
    dead_url,
    start_vllm_server,
)

from dflash_recipes.errors import ServedStatesError, TargetServerError, TargetServerUnavailable
from dflash_recipes.executor.model.target_states import target_states
from dflash_recipes.executor.target_server import TargetServerClient

CONVERSATIONS = [[5, 17, 3, 99, 42, 7], [64, 2, 2, 81], [11], [9, 8, 7, 6, 5, 4, 3, 2, 1]]


def _left(storage: Path) -> list[str]:
    return sorted(p.name for p in storage.iterdir())


def test_states_equal_the_in_process_target_taps_with_id_l_before_the_final_norm(
    servers: ServerPair, settings: SettingsFactory, target: SavedTarget
) -> None:
    with TargetServerClient(settings()) as client:
        served = client.states(CONVERSATIONS)
    model = target.model
    for ids, states in zip(CONVERSATIONS, served, strict=True):
        x = torch.tensor([ids])
        with torch.no_grad():
            # vLLM ids (0, 2, 4): the embeddings, then DFlash taps 1 and 3 as training takes them
            taps = target_states(model, x, torch.ones_like(x), [1, 3], with_logits=False)
            embeddings = model.get_input_embeddings()(x)
            normed_last = model(x, output_hidden_states=True).hidden_states[4]
        assert states.hidden_states.shape == (len(ids), 3, 64)
        assert states.hidden_states.dtype == torch.float32
        assert states.token_ids.tolist() == ids
        assert states.server == servers.first.name and states.path is None
        expected = torch.stack([embeddings[0], *taps.tapped[0].split(64, dim=-1)], dim=1)
        torch.testing.assert_close(states.hidden_states, expected, rtol=1e-5, atol=1e-6)
        # id L is the last layer before the final norm, not transformers' hidden_states[L]
        assert not torch.allclose(states.hidden_states[:, 2], normed_last[0], atol=1e-3)
    assert _left(servers.storage) == []
    assert servers.first.stats()["files_written"] == len(CONVERSATIONS)


def test_a_token_id_mismatch_names_conversation_and_position_and_is_not_retried(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(wrong_token_at=2)
    client = TargetServerClient(settings(retries=3))
    with pytest.raises(ServedStatesError) as caught:
        client.states([CONVERSATIONS[0]], indices=[41])
    client.close()
    message = str(caught.value)
    assert "conversation 41" in message and "position 2" in message
    assert "sent 3, served 4" in message and servers.first.name in message
    assert servers.first.stats()["requests"] == 1  # not retried
    # the server wrote the file after its answer; close() waited for the lock and deleted it
    assert servers.first.stats()["files_written"] == 1
    assert _left(servers.storage) == []


def test_a_failed_batch_stops_at_once_and_what_its_other_requests_write_is_deleted(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(wrong_token_at=0)  # answers at once, with other token ids
    servers.second.control(delay_ms=1000)  # still working on its share when the error comes
    chosen = settings(servers.first.url, servers.second.url, max_in_flight=4)
    client = TargetServerClient(chosen)
    with pytest.raises(ServedStatesError, match="position 0"):
        client.states(CONVERSATIONS)
    assert servers.second.stats()["answered"] == 0  # the error did not wait for them
    client.close()
    # the slow server answered both of its requests and wrote their files; close() waited for
    # them and deleted them
    assert servers.second.stats()["files_written"] == 2
    assert _left(servers.storage) == []


def test_a_server_started_for_other_taps_stops_at_the_first_answer_with_the_numbers(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(layer_ids=[2, 4])
    with (
        TargetServerClient(settings(max_in_flight=1)) as client,
        pytest.raises(ServedStatesError) as caught,
    ):
        client.states(CONVERSATIONS)
    message = str(caught.value)
    assert "serves 2 layers of hidden size 64" in message
    assert "expects 3 layers (vLLM ids [0, 2, 4]) of hidden size 64" in message
    assert servers.first.name in message and ".safetensors" in message
    assert servers.first.stats()["requests"] == 1
    assert _left(servers.storage) == []


def test_another_hidden_size_or_dtype_or_nan_is_refused(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    with (
        TargetServerClient(settings(hidden_size=32)) as client,
        pytest.raises(ServedStatesError, match="serves 3 layers of hidden size 64 per token"),
    ):
        client.states(CONVERSATIONS[:1])
    servers.first.control(dtype="bfloat16")
    with (
        TargetServerClient(settings()) as client,
        pytest.raises(ServedStatesError, match=r"serves states in bfloat16 .*--dtype float32"),
    ):
        client.states(CONVERSATIONS[:1])
    servers.first.control(dtype=None, nan=True)
    with (
        TargetServerClient(settings()) as client,
        pytest.raises(
            ServedStatesError, match="NaN or Inf states \\(first at token 3, vLLM layer 4\\)"
        ),
    ):
        client.states(CONVERSATIONS[:1])
    assert servers.first.stats()["requests"] == 3  # none retried
    assert _left(servers.storage) == []


def test_http_500s_are_retried_with_backoff_then_succeed(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(fail_500=2)
    started = time.monotonic()
    with TargetServerClient(settings(retries=2, backoff_s=0.2)) as client:
        served = client.states(CONVERSATIONS[:1])
    assert served[0].token_ids.tolist() == CONVERSATIONS[0]
    assert servers.first.stats()["requests"] == 3
    assert time.monotonic() - started >= 0.2 + 0.4  # waited 0.2 s, then twice as long
    assert _left(servers.storage) == []


def test_work_goes_to_the_live_server_when_one_url_is_dead(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    with TargetServerClient(settings(dead_url(), servers.first.url)) as client:
        served = client.states(CONVERSATIONS)
    assert {s.server for s in served} == {servers.first.name}
    assert servers.first.stats()["answered"] == len(CONVERSATIONS)
    assert _left(servers.storage) == []


def test_when_no_server_answers_one_error_names_each_and_what_it_did(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    urls = (dead_url(), dead_url())
    with (
        TargetServerClient(settings(*urls)) as client,
        pytest.raises(TargetServerUnavailable) as caught,
    ):
        client.states(CONVERSATIONS[:1], indices=[7])
    message = str(caught.value)
    assert "conversation 7 (6 tokens)" in message
    for url in urls:
        host_port = url.removeprefix("http://")
        assert re.search(rf"{host_port}: refused the connection \(.*?\) \(3 attempts\)", message)


def test_a_failed_write_names_the_file_and_its_lock_and_is_retried(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(fail_write=1)
    with TargetServerClient(settings()) as client:
        assert client.states(CONVERSATIONS[:1])[0].token_ids.tolist() == CONVERSATIONS[0]
    assert servers.first.stats()["requests"] == 2

    servers.first.control(fail_write=100)
    with (
        TargetServerClient(settings(retries=1)) as client,
        pytest.raises(TargetServerUnavailable) as caught,
    ):
        client.states(CONVERSATIONS[:1])
    message = str(caught.value)
    assert re.search(
        rf"{servers.first.name}: vLLM released its lock \S+/cmpl-dflash-\w+-0-\w+"
        r"\.safetensors\.lock but the file \S+\.safetensors is not there",
        message,
    )
    assert "(2 attempts)" in message
    assert _left(servers.storage) == []


def test_a_stalled_server_times_out_and_its_work_goes_to_the_other(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(stall=True)
    started = time.monotonic()
    chosen = settings(servers.first.url, servers.second.url, timeout_s=0.5, retries=1)
    with TargetServerClient(chosen) as client:
        served = client.prefetch(CONVERSATIONS[:2]).result(timeout=10)  # not forever
    assert {s.server for s in served} == {servers.second.name}
    assert time.monotonic() - started >= 2 * 0.5  # two attempts cut off at timeout_s
    assert _left(servers.storage) == []


def test_a_server_that_dies_hands_its_work_to_the_other(
    tmp_path: Path, servers: ServerPair, settings: SettingsFactory, target: SavedTarget
) -> None:
    with start_vllm_server(target.path, servers.storage, [0, 2, 4]) as doomed:
        doomed.control(die=True)
        with TargetServerClient(settings(doomed.url, servers.first.url)) as client:
            served = client.states(CONVERSATIONS)
        assert doomed.process.wait(timeout=5) == 3
    assert {s.server for s in served} == {servers.first.name}


def test_the_lock_is_waited_for_and_its_deadline_is_an_error_naming_it(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(write_delay_ms=400)  # the file appears well after the answer
    with TargetServerClient(settings()) as client:
        assert client.states(CONVERSATIONS[:1])[0].token_ids.tolist() == CONVERSATIONS[0]
    servers.first.control(write_delay_ms=1500)
    with (
        TargetServerClient(settings(retries=0, lock_timeout_s=0.3)) as client,
        pytest.raises(
            TargetServerUnavailable, match=r"vLLM still held its lock \S+\.safetensors\.lock"
        ),
    ):
        client.states(CONVERSATIONS[:1])
    # close() waited for the late file and deleted it
    assert _left(servers.storage) == []


@pytest.mark.parametrize("where", ["elsewhere", "in place"])
def test_checked_files_are_kept_in_keep_dir_and_their_locks_deleted(
    tmp_path: Path, servers: ServerPair, settings: SettingsFactory, where: str
) -> None:
    keep_dir = tmp_path if where == "elsewhere" else servers.storage
    with TargetServerClient(settings(keep_dir=keep_dir)) as client:
        served = client.states(CONVERSATIONS)
    kept = [s.path for s in served]
    assert all(p is not None and p.parent == keep_dir for p in kept)
    assert _left(keep_dir) == sorted(p.name for p in kept if p is not None)
    assert all(p.endswith(".safetensors") for p in _left(keep_dir))
    if where == "elsewhere":
        assert _left(servers.storage) == []
    for states, path in zip(served, kept, strict=True):
        assert path is not None
        on_disk = load_file(str(path))
        assert torch.equal(on_disk["hidden_states"], states.hidden_states)
        assert on_disk["token_ids"].tolist() == states.token_ids.tolist()


def test_a_file_that_fails_a_check_is_not_kept(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(nan=True)
    with (
        TargetServerClient(settings(keep_dir=servers.storage)) as client,
        pytest.raises(ServedStatesError),
    ):
        client.states(CONVERSATIONS[:1])
    assert _left(servers.storage) == []


def test_in_flight_requests_and_files_stay_within_the_bound(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(delay_ms=150)
    with TargetServerClient(settings(max_in_flight=2)) as client:
        client.states(CONVERSATIONS + CONVERSATIONS)
    stats = servers.first.stats()
    assert stats["max_in_flight"] == 2  # reached, never passed
    assert 1 <= stats["max_files"] <= 2
    assert _left(servers.storage) == []


def test_requests_spread_over_every_server(servers: ServerPair, settings: SettingsFactory) -> None:
    for server in (servers.first, servers.second):
        server.control(delay_ms=100)
    chosen = settings(servers.first.url, servers.second.url, max_in_flight=4)
    with TargetServerClient(chosen) as client:
        served = client.states(CONVERSATIONS + CONVERSATIONS)
    counts = [servers.first.stats()["answered"], servers.second.stats()["answered"]]
    assert sum(counts) == 8 and min(counts) >= 2  # the first four alone go two and two
    assert {s.server for s in served} == {servers.first.name, servers.second.name}


def _eventually(check: Callable[[], bool], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_prefetch_returns_at_once_and_the_states_arrive_while_the_caller_works(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(delay_ms=300)
    with TargetServerClient(settings()) as client:
        handle = client.prefetch(CONVERSATIONS)
        assert servers.first.stats()["answered"] == 0 and not handle.done()
        # nobody waits on the handle: the requests go on behind the caller's back
        assert _eventually(handle.done)
        assert servers.first.stats()["answered"] == len(CONVERSATIONS)
        assert [s.token_ids.tolist() for s in handle.result()] == CONVERSATIONS


def test_stream_requests_the_next_batch_while_the_caller_works_on_one(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(delay_ms=100)
    batches = [[c] for c in CONVERSATIONS]
    got: list[list[int]] = []
    with TargetServerClient(settings()) as client:
        for step, states in enumerate(client.stream(batches, ahead=1)):
            got.append(states[0].token_ids.tolist())
            if step + 1 < len(batches):  # the next batch reaches the server during this step
                assert _eventually(lambda n=step + 2: servers.first.stats()["requests"] >= n)
    assert got == CONVERSATIONS
    assert servers.first.stats()["requests"] == len(CONVERSATIONS)


def test_an_unknown_model_or_an_overlong_prompt_is_refused_without_retry(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    with (
        TargetServerClient(settings(served_model_name="other")) as client,
        pytest.raises(TargetServerError, match=r"does not serve the model 'other' \(HTTP 404"),
    ):
        client.states(CONVERSATIONS[:1])
    with (
        TargetServerClient(settings()) as client,
        pytest.raises(TargetServerError, match=r"refused conversation 0 \(300 tokens\): HTTP 400"),
    ):
        client.states([[1] * 300])
    assert servers.first.stats()["requests"] == 2


def test_probe_lists_the_live_servers_and_refuses_another_model(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    with TargetServerClient(settings(dead_url(), servers.first.url)) as client:
        assert client.probe() == (servers.first.name,)
    with (
        TargetServerClient(settings(served_model_name="other")) as client,
        pytest.raises(TargetServerError, match="serves \\['tiny-target'\\], not 'other'"),
    ):
        client.probe()
    with (
        TargetServerClient(settings(dead_url())) as client,
        pytest.raises(TargetServerUnavailable, match="no target server answers"),
    ):
        client.probe()


def test_the_api_key_is_sent_and_a_refused_one_is_not_retried(
    servers: ServerPair, settings: SettingsFactory
) -> None:
    servers.first.control(api_key="sesame")
    with TargetServerClient(settings(api_key="sesame")) as client:
        assert client.states(CONVERSATIONS[:1])[0].token_ids.tolist() == CONVERSATIONS[0]
    with (
        TargetServerClient(settings(api_key="wrong")) as client,
        pytest.raises(TargetServerError, match=r"refused the request \(HTTP 401") as caught,
    ):
        client.states(CONVERSATIONS[:1])
    assert "wrong" not in str(caught.value)
    stats = servers.first.stats()
    assert (stats["requests"], stats["refused"]) == (1, 1)
