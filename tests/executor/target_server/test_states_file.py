"""One vLLM hidden-states file: read only once vLLM's lock is free, every check, nothing left."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_recipes.errors import ServedStatesError
from dflash_recipes.executor.target_server.states_file import (
    ExpectedStates,
    ServedStates,
    StatesFileFailure,
    first_difference,
    lock_path,
    sweep_request_files,
    take_states_file,
)

EXPECTED = ExpectedStates(layer_ids=(2, 4), hidden_size=8, dtype="float32")
IDS = [5, 6, 7, 8]
SERVER = "127.0.0.1:8000"


def _write(path: Path, ids: list[int] = IDS, layers: int = 2) -> torch.Tensor:
    states = torch.randn(len(ids), layers, 8)
    save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(path))
    return states


def _take(path: Path, *, deadline_s: float = 2.0, keep_dir: Path | None = None) -> ServedStates:
    return take_states_file(
        path,
        IDS,
        expected=EXPECTED,
        server=SERVER,
        conversation=3,
        deadline=time.monotonic() + deadline_s,
        keep_dir=keep_dir,
    )


def _hold(lock: Path) -> int:
    """vLLM's side: create the lock and hold it exclusively."""
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _release(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "cmpl-r1-0-0a1b2c3d.safetensors"


def test_the_file_is_read_once_vllm_releases_its_lock_then_both_are_deleted(path: Path) -> None:
    fd = _hold(lock_path(path))
    written: list[torch.Tensor] = []

    def engine_step() -> None:  # the file is written after the answer, then the lock released
        time.sleep(0.3)
        written.append(_write(path))
        _release(fd)

    writer = threading.Thread(target=engine_step)
    started = time.monotonic()
    writer.start()
    served = _take(path)
    writer.join()
    assert time.monotonic() - started >= 0.3
    assert torch.equal(served.hidden_states, written[0])
    assert served.token_ids.tolist() == IDS
    assert list(path.parent.iterdir()) == []


def test_a_lock_held_past_the_deadline_is_a_failure_naming_it(path: Path) -> None:
    fd = _hold(lock_path(path))
    try:
        with pytest.raises(StatesFileFailure, match=f"still held its lock {lock_path(path)}"):
            _take(path, deadline_s=0.2)
    finally:
        _release(fd)
    assert lock_path(path).exists()  # vLLM's, still being written: the sweep deletes it later


def test_a_free_lock_without_its_file_is_a_failed_write(path: Path) -> None:
    _release(_hold(lock_path(path)))
    with pytest.raises(StatesFileFailure) as caught:
        _take(path)
    assert f"released its lock {lock_path(path)} but the file {path} is not there" in str(
        caught.value
    )
    assert list(path.parent.iterdir()) == []


def test_a_file_without_a_lock_is_read(path: Path) -> None:
    written = _write(path)
    assert torch.equal(_take(path).hidden_states, written)


def test_token_ids_of_the_file_that_differ_name_the_conversation_and_position(
    path: Path,
) -> None:
    _write(path, ids=[5, 6, 9, 8])
    with pytest.raises(ServedStatesError) as caught:
        _take(path)
    message = str(caught.value)
    assert "conversation 3" in message and "position 2, sent 7, served 9" in message
    assert str(path) in message and SERVER in message
    assert list(path.parent.iterdir()) == []


def test_a_file_for_another_prompt_length_or_layer_count_is_refused(path: Path) -> None:
    _write(path, ids=[5, 6, 7])
    with pytest.raises(ServedStatesError, match="holds 3 rows of states"):
        _take(path)
    _write(path, layers=3)
    with pytest.raises(ServedStatesError, match="serves 3 layers of hidden size 8"):
        _take(path)


def test_a_kept_file_stays_where_it_was_written_unless_it_failed(path: Path) -> None:
    _write(path)
    assert _take(path, keep_dir=path.parent).path == path
    assert list(path.parent.iterdir()) == [path]
    _write(path, ids=[1, 2, 3, 4])
    with pytest.raises(ServedStatesError):
        _take(path, keep_dir=path.parent)
    assert list(path.parent.iterdir()) == []


@pytest.mark.parametrize(
    ("sent", "served", "position"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2], [1, 2, 3], 2),
        ([1, 2], [0, 1, 2], 0),
    ],
)
def test_first_difference(sent: list[int], served: list[int], position: int | None) -> None:
    assert first_difference(sent, served) == position


def test_the_sweep_deletes_only_its_requests_files_and_waits_for_a_held_lock(
    tmp_path: Path,
) -> None:
    mine = tmp_path / "cmpl-dflash-aa-0-00000000.safetensors"
    held = tmp_path / "cmpl-dflash-aa-0-11111111.safetensors"
    other = tmp_path / "cmpl-dflash-bb-0-22222222.safetensors"
    for one in (mine, other):
        _write(one)
        _release(_hold(lock_path(one)))
    fd = _hold(lock_path(held))
    assert sweep_request_files(tmp_path, "dflash-aa") is False  # one still being written
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [lock_path(held).name, other.name, lock_path(other).name]
    )
    _write(held)
    _release(fd)
    assert sweep_request_files(tmp_path, "dflash-aa") is True
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, lock_path(other).name]
